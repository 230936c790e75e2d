"""The declared decision's error rates, measured (issue 21): A/A experiments with three
primaries and five guardrails, looked at every 100 queries through the service's own
`rankmeter.ab.experiment.look` and `rankmeter.ab.decision.decide` (the same code, the same
running statistics, τ² fixed per metric at its first look, the SRM test on).

    .venv/bin/python bench/ab_decision.py [--experiments 500] [--power-experiments 250] [--queries 10000]
        [--config all] [--seed 21]

One line per configuration, ending `false_ship=… false_stop=… variance_reduction=…` (each
rate with its Clopper–Pearson 95% interval; variance_reduction: nDCG@10's with CUPED, else n/a):

* `aa`: 50/50, per query, independent metrics; `aa_90_10`: the treatment 10%; `aa_user`:
  per-user assignment (10,000 users, lognormal activity, a persistent user effect on every
  metric), bucket statistics; `aa_rare`: Clicks a Bernoulli event of 1% (a purchase), its
  guardrail `Clicks 20%` (relative to the event: T − 0.8·B); `aa_correlated`: every metric
  driven by one latent quality (ρ = 0.6).
* `power`: the primaries improved (a latent shift of 0.05 sd: +0.017 nDCG, +4.4%), to 3 × --queries:
  the share reaching a correct `ship` and the queries it took (`false_ship` is then 0 by
  definition; `false_stop` counts `do_not_ship`).
* `guardrail`: CTR down 25% against its 10% margin, the primaries unchanged: the share
  reaching `do_not_ship` (`false_ship` counts a ship, which would be wrong here).
* CUPED (`ab.cuped`): query texts with a persistent difficulty (--persistence, fixed at 0.5),
  a pre-period of PRE_PERIOD × the queries, each query's covariate its text's pre-period
  mean: `aa_cuped` (A/A, every metric's rate: `aa_metric_max`), `no_persistence` (a
  covariate unrelated to the outcome: VR ≈ 0), `power_persistent` and `power_cuped` (the
  same experiments without and with CUPED). `pre_corr` is printed beside the reduction.
  Where its assumptions break: `aa_cuped_90_10` (the treatment 10%), `aa_cuped_rare` (the
  1% event). The user covariate (`ab.cuped_covariate: user`, per user bucket): users whose
  quality persists (--user-persistence, fixed at 0.2: aa_user's user share), each query's
  covariate its user's mean over the user's pre-period queries (PRE_USER_QUERIES: 40,000
  in every cell, the same lognormal activity): `aa_cuped_user`, `no_persistence_user` (none: VR ≈ 0),
  `power_user` and `power_cuped_user` (the same experiments without and with CUPED).
* The boundaries, where each error rate is largest: `boundary_ship`, the primaries improved
  by 0.1 sd and CTR exactly 10% down (its margin), to 2 × --queries: a `ship` is a false
  ship of the intersection-union test (CTR is not shown non-inferior), a `do_not_ship` a
  false stop (nothing is worse than its margin); `boundary_stop`: the primaries unchanged
  and every guardrail exactly at its margin (CTR ×0.9, Abandonment +0.04, FirstClickRank
  ×1.15, Clicks −0.06, P@10 −0.03), each of the 8 stop tests at its null's boundary: a
  `do_not_ship` is a false stop; `boundary_stop_rare`: the same with the rare Clicks (×0.8).

Per query, 8 latent normals (equicorrelated), mapped to nDCG-like values (35% zeros, 10%
ones, Beta(2, 2) between: nDCG@10, AP, RR, P@10), a click (CTR, 30%), abandonment (40%),
a heavy-tailed first click rank (P(r) ∝ r^-1.3 on 1..100) and a click count (Poisson 0.6).
About 4 min a configuration of 500 experiments of 10,000 queries on an idle core (per user: about 12).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import NamedTuple

import numpy as np
from scipy import special, stats

from rankmeter.ab import clusters, sums
from rankmeter.ab.decision import decide
from rankmeter.ab.experiment import look as ab_look
from rankmeter.config import AB

METRICS = ["nDCG@10", "AP", "RR", "CTR", "Abandonment", "FirstClickRank", "Clicks", "P@10"]
PRIMARY = ["nDCG@10 increase", "AP increase", "RR increase"]
# Margins of about 0.07–0.09 sd: what a few tens of thousands of queries can show non-inferior.
GUARDRAILS = ["CTR 10%", "Abandonment 0.04", "FirstClickRank 15%", "Clicks 0.06", "P@10 0.03"]
ALPHA, BATCH, USERS = 0.05, 100, 10_000
PERSISTENCE = 0.5   # fixed before measuring (issue 21): the figure is the correlation printed beside it
# The user's persistent share of a query's latent quality in the user-covariate cells, fixed
# before measuring: aa_user's user effect (sd 0.5: 0.25 / 1.25 of the variance), now persisting.
USER_PERSISTENCE = 0.2
PRE_PERIOD = 4      # the pre-period's queries, in multiples of the experiment's (four weeks before a week)
# The users' pre-period, in queries, the same in every cell (review 3: 4 × the cell's queries
# gave the 30,000-query cells three times the 10,000-query cells' pre-period, so better means).
PRE_USER_QUERIES = PRE_PERIOD * 10_000
RARE_GUARDRAILS = [g if not g.startswith("Clicks") else "Clicks 20%" for g in GUARDRAILS]  # of a 1% event


class Config(NamedTuple):
    share: float = 0.5        # the treatment's
    by_user: bool = False
    rare: bool = False        # Clicks a Bernoulli 1% event, its guardrail `Clicks 20%`
    rho: float = 0.0          # every metric's correlation through one latent quality
    shift: float = 0.0        # the primaries' latent shift, sd
    ctr: float = 1.0          # the treatment's CTR factor
    boundary: bool = False    # every guardrail's true effect exactly −margin (CTR: ctr = 0.9)
    persistence: float = 0.0  # the share of a query's latent quality its text carries (pre-period and in-experiment)
    cuped: bool = False       # ab.cuped: macro comparisons adjusted by the text's pre-period mean
    covariate: str = "text"   # "user" (ab.cuped_covariate: user, by_user): persistence is the user's share


CONFIGS = {
    "aa": Config(),
    "aa_90_10": Config(share=0.1),
    "aa_user": Config(by_user=True),
    "aa_rare": Config(rare=True),
    "aa_correlated": Config(rho=0.6),
    "power": Config(shift=0.05),
    "guardrail": Config(ctr=0.75),
    # The error rates' least favourable configurations (docs/benchmarks.md): a ship when one
    # guardrail's effect is exactly −margin (primaries better, the other guardrails 0) is
    # a false ship of the intersection-union test; a stop when every primary's effect is 0
    # and every guardrail's exactly −margin is a false stop at each stop test's boundary.
    "boundary_ship": Config(shift=0.1, ctr=0.9),
    "boundary_stop": Config(ctr=0.9, boundary=True),
    "boundary_stop_rare": Config(rare=True, ctr=0.9, boundary=True),
    # CUPED (issue 21, part 2): persistent query-text difficulty (PERSISTENCE, --persistence).
    "aa_cuped": Config(persistence=PERSISTENCE, cuped=True),
    "no_persistence": Config(cuped=True),   # a covariate unrelated to the outcome: VR ≈ 0
    "power_persistent": Config(shift=0.05, persistence=PERSISTENCE),
    "power_cuped": Config(shift=0.05, persistence=PERSISTENCE, cuped=True),
    # CUPED where the simulator's assumptions break: 90/10, the rare event, and per user
    # with the user's own pre-period mean (USER_PERSISTENCE, --user-persistence).
    "aa_cuped_90_10": Config(share=0.1, persistence=PERSISTENCE, cuped=True),
    "aa_cuped_rare": Config(rare=True, persistence=PERSISTENCE, cuped=True),
    "aa_cuped_user": Config(by_user=True, persistence=USER_PERSISTENCE, cuped=True, covariate="user"),
    "no_persistence_user": Config(by_user=True, cuped=True, covariate="user"),  # VR ≈ 0
    "power_user": Config(shift=0.05, by_user=True, persistence=USER_PERSISTENCE, covariate="user"),
    "power_cuped_user": Config(shift=0.05, by_user=True, persistence=USER_PERSISTENCE, cuped=True, covariate="user"),
}
_RANKS = np.arange(1, 101)
_RANK_CDF = np.cumsum(_RANKS ** -1.3) / np.sum(_RANKS ** -1.3)


def values(z: np.ndarray, treated: np.ndarray, rare: bool, shift: float, ctr_factor: float,
           boundary: bool = False) -> np.ndarray:
    """[Q, 8] per-query values from [Q, 8] latent normals (higher latent: better).
    `boundary`: the treatment's Abandonment, FirstClickRank, Clicks and P@10 exactly at their
    margins' worse end (+0.04, ×1.15, −0.06 or ×0.8 for the rare event, −0.03)."""
    z = z.copy()
    z[:, :3] += shift * treated[:, None]
    u = special.ndtr(z)
    out = np.empty_like(u)
    for c in (0, 1, 2, 7):   # nDCG-like
        mid = np.clip((u[:, c] - 0.35) / 0.55, 0.0, 1.0)
        out[:, c] = np.where(u[:, c] < 0.35, 0.0, np.where(u[:, c] > 0.9, 1.0, stats.beta.ppf(mid, 2, 2)))
    worse = treated if boundary else np.zeros_like(treated)
    out[:, 3] = u[:, 3] > 1.0 - 0.3 * np.where(treated, ctr_factor, 1.0)  # a click
    out[:, 4] = u[:, 4] < 0.4 + 0.04 * worse                            # abandoned
    out[:, 5] = _RANKS[np.minimum(np.searchsorted(_RANK_CDF, 1.0 - u[:, 5]), 99)] * np.where(worse, 1.15, 1.0)
    if rare:   # a purchase
        out[:, 6] = u[:, 6] > 1.0 - 0.01 * np.where(worse, 0.8, 1.0)
    else:
        out[:, 6] = stats.poisson.ppf(u[:, 6], 0.6 - 0.06 * worse)
    out[:, 7] -= 0.03 * worse
    return out


def texts(rng: np.random.Generator, queries: int, config: Config, latent: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray]:
    """Query texts with a persistent difficulty: (the in-experiment latent, each query's
    covariate [Q, 8], its text's mean value before the start). Q texts, PRE_PERIOD times as
    many queries before the start as during it (a text has Poisson(4) pre-period queries;
    one without any, 1.8%, gets the pooled pre-period mean, as the service does)."""
    p, n_texts, n_pre = config.persistence, queries, PRE_PERIOD * queries
    difficulty = rng.normal(size=n_texts)
    text, pre_text = rng.integers(0, n_texts, queries), rng.integers(0, n_texts, n_pre)
    pre_latent = np.sqrt(p) * difficulty[pre_text, None] + np.sqrt(1 - p) * rng.normal(size=(n_pre, 8))
    pre = values(pre_latent, np.zeros(n_pre, bool), config.rare, 0.0, 1.0)
    return np.sqrt(p) * difficulty[text, None] + np.sqrt(1 - p) * latent, unit_means(pre_text, pre, n_texts)[text]


def users(rng: np.random.Generator, queries: int, config: Config, latent: np.ndarray, weights: np.ndarray,
          user: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Users whose quality / click propensity persists (ab.cuped_covariate: user): (the
    in-experiment latent, √p·u_user + √(1 − p)·ε, and each query's covariate [Q, 8], its
    user's mean value over the user's pre-period queries). PRE_USER_QUERIES before the
    start, whatever the cell's size, drawn from the same activity (`weights`); a user with
    none gets the pooled pre-period mean. p = 0: no user effect, the covariate unrelated."""
    p, n_pre = config.persistence, PRE_USER_QUERIES
    propensity = rng.normal(size=USERS)
    pre_user = rng.choice(USERS, n_pre, p=weights / weights.sum())
    pre_latent = np.sqrt(p) * propensity[pre_user, None] + np.sqrt(1 - p) * rng.normal(size=(n_pre, 8))
    pre = values(pre_latent, np.zeros(n_pre, bool), config.rare, 0.0, 1.0)
    return np.sqrt(p) * propensity[user, None] + np.sqrt(1 - p) * latent, unit_means(pre_user, pre, USERS)[user]


def unit_means(unit: np.ndarray, pre: np.ndarray, units: int) -> np.ndarray:
    """[units, 8] each unit's mean pre-period value (the pooled mean for a unit without any)."""
    count = np.bincount(unit, minlength=units)[:, None]
    total = np.stack([np.bincount(unit, pre[:, j], minlength=units) for j in range(pre.shape[1])], -1)
    return np.where(count > 0, total / np.maximum(count, 1), pre.mean(0))


class Drawn(NamedTuple):
    cum: np.ndarray          # [looks, 2 (treatment, baseline), B, size] cumulative arm vectors
    n: np.ndarray            # each look's query count
    covariates: np.ndarray | None  # [looks, 2, B, 8, 3] cumulative Σx, Σx², Σxy (CUPED)
    pre_corr: float          # corr(covariate, value) of nDCG@10 over the experiment's queries


def experiment(rng: np.random.Generator, queries: int, config: Config) -> Drawn:
    """Cumulative arm vectors at every look (B = 1 per query, clusters.BUCKETS per user)."""
    share, by_user, rare, rho, shift, ctr, boundary, persistence, cuped, _ = config
    if by_user:
        weights = rng.lognormal(0.0, 1.5, USERS)
        user = rng.choice(USERS, queries, p=weights / weights.sum())
        effect = rng.normal(0.0, 0.5, (USERS, 1))
        treated = (rng.random(USERS) < share)[user]
        bucket = rng.integers(0, clusters.BUCKETS, USERS)[user]
        common = effect[user]
    else:
        treated = rng.random(queries) < share
        bucket = np.zeros(queries, dtype=int)
        common = np.zeros((queries, 1))
    latent = np.sqrt(rho) * rng.normal(size=(queries, 1)) + np.sqrt(1 - rho) * rng.normal(size=(queries, 8))
    covariate = None
    if config.covariate == "user":   # the persistent user effect replaces aa_user's (drawn, unused)
        latent, covariate = users(rng, queries, config, latent, weights, user)
        common = np.zeros((queries, 1))
    elif persistence > 0 or cuped:   # (drawn after the rest: the other cells' data stay as they were)
        latent, covariate = texts(rng, queries, config, latent)
    x = values((latent + common) / np.sqrt(1 + common.var() if by_user else 1.0), treated, rare, shift, ctr, boundary)
    buckets = clusters.BUCKETS if by_user else 1
    looks = queries // BATCH
    cell = ((np.arange(queries) // BATCH) * 2 + (~treated).astype(int)) * buckets + bucket
    m = len(METRICS)
    per_query = np.zeros((queries, sums.size(m)))
    slots = per_query[:, :sums.SLOTS * m].reshape(queries, m, sums.SLOTS)
    for k, column in enumerate((np.ones_like(x), x, x * x, x, np.ones_like(x), x * x, np.ones_like(x), x)):
        slots[:, :, k] = column   # a mean is also a ratio with denominator 1
    per_query[:, -2:] = 1.0
    def cumulative(columns: np.ndarray) -> np.ndarray:
        out = np.stack([np.bincount(cell, columns[:, j], minlength=looks * 2 * buckets)
                        for j in range(columns.shape[1])], -1).reshape(looks, 2, buckets, -1)
        return np.cumsum(out, axis=0)

    n = (np.arange(looks) + 1) * BATCH
    if covariate is None:
        return Drawn(cumulative(per_query), n, None, math.nan)
    cov = cumulative(np.stack([covariate, covariate ** 2, covariate * x], -1).reshape(queries, -1))
    pre_corr = float(np.corrcoef(covariate[:, 0], x[:, 0])[0, 1])
    return Drawn(cumulative(per_query), n, cov.reshape(looks, 2, buckets, m, 3), pre_corr)


# Cells measured on the same data as another (with and without CUPED: one experiment each).
SAME_DATA = {"power_cuped": "power_persistent", "power_cuped_user": "power_user"}


def run(name: str, experiments: int, queries: int, seed: int, first: int = 0) -> dict:
    config = CONFIGS[name]
    share, by_user = config.share, config.by_user
    settings = AB(baseline="base", unit="user" if by_user else "query", split={"base": 1 - share, "new": share},
                  alpha=ALPHA, primary=PRIMARY, guardrails=RARE_GUARDRAILS if config.rare else GUARDRAILS,
                  cuped=config.cuped)
    ships, stops, first_ship, reductions, corrs = 0, 0, [], [], []
    significant = dict.fromkeys(METRICS, 0)   # A/A: a macro comparison's running p ever below α
    for e in range(first, first + experiments):   # (experiment e's data is the same in any run)
        rng = np.random.default_rng([seed, list(CONFIGS).index(SAME_DATA.get(name, name)), e])
        drawn = experiment(rng, queries, config)
        cum, n = drawn.cum, drawn.n
        running: dict[str, str] = {}
        shipped = stopped = False
        for j in range(len(n)):
            arm = (lambda v: v) if by_user else (lambda v: v[0])
            vectors = {("new", ""): arm(cum[j, 0]), ("base", ""): arm(cum[j, 1])}
            covariates = None if drawn.covariates is None else {
                ("new", ""): arm(drawn.covariates[j, 0]), ("base", ""): arm(drawn.covariates[j, 1])}
            look, kept = ab_look("bench", "base", vectors, METRICS, settings, running, settled=True,
                                 covariates=covariates)
            running.update(kept)
            [d] = decide(look, settings) or [None]
            decision = d.decision if d else "keep_running"
            if decision == "ship" and not shipped:
                shipped = True
                first_ship.append(int(n[j]))
            stopped |= decision == "do_not_ship"
            if stopped and shipped and not name.startswith("aa"):
                break
        ships += shipped
        stops += stopped
        macro = {c.metric: c for c in look.comparisons if c.average == "macro"}
        for metric, c in macro.items():
            significant[metric] += c.running.p_value < ALPHA
        if config.cuped:
            reductions.append([macro[m].variance_reduction if m in macro else math.nan for m in METRICS])
        if math.isfinite(drawn.pre_corr):
            corrs.append(drawn.pre_corr)
        if (e + 1 - first) % 50 == 0:
            print(f"  {name}: {e + 1 - first}/{experiments}", file=sys.stderr)
    return {"ships": ships, "stops": stops, "first_ship": first_ship, "experiments": experiments,
            "significant": significant, "reductions": np.array(reductions).reshape(-1, len(METRICS)),
            "pre_corr": float(np.mean(corrs)) if corrs else math.nan}


def upper(k: int, n: int) -> float:
    return stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact").high


def reduction(r: dict) -> str:
    """The median variance reduction of nDCG@10 at the last look (n/a without CUPED)."""
    vr = r["reductions"]
    return "n/a" if not len(vr) else f"{np.nanmedian(vr[:, 0]):.3f}"


def cp(k: int, n: int) -> str:
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return f"{k / n:.4f} [{ci.low:.4f}, {ci.high:.4f}]"


def line(name: str, r: dict, queries: int) -> str:
    n = r["experiments"]
    head = f"{name:<18} experiments={n} queries={queries} looks_every={BATCH} primaries=3 guardrails=5"
    if math.isfinite(r["pre_corr"]):
        head += f" persistence={CONFIGS[name].persistence} pre_corr={r['pre_corr']:.3f}"
    if len(r["reductions"]):
        head += " vr_by_metric=" + ",".join(f"{m}:{v:.3f}" for m, v in zip(METRICS, np.nanmedian(r["reductions"], 0)))
    if name.startswith(("aa", "no_persistence")):   # every metric's A/A rate: the largest, with its upper bound
        worst = max(METRICS, key=lambda m: r["significant"][m])
        head += f" aa_metric_max={worst}:{cp(r['significant'][worst], n)}"
    tail = f"variance_reduction={reduction(r)}"
    if name.startswith("power"):
        q = np.percentile(r["first_ship"], [50, 90]).astype(int) if r["first_ship"] else ("-", "-")
        head += f" ship={cp(r['ships'], n)} queries_to_ship_median={q[0]} p90={q[1]}"
        return f"{head} false_ship=0 false_stop={cp(r['stops'], n)} {tail}"
    if name == "guardrail":
        head += f" do_not_ship={cp(r['stops'], n)}"
        return f"{head} false_ship={cp(r['ships'], n)} false_stop=n/a {tail}"
    return f"{head} false_ship={cp(r['ships'], n)} false_stop={cp(r['stops'], n)} {tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiments", type=int, default=500)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--config", default="all", help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--power-experiments", type=int, default=250, help="for power and guardrail")
    parser.add_argument("--seed", type=int, default=21)
    parser.add_argument("--persistence", type=float, default=PERSISTENCE,
                        help="the query texts' persistence in the CUPED cells (fixed at 0.5 for the figures)")
    parser.add_argument("--user-persistence", type=float, default=USER_PERSISTENCE,
                        help="the users' persistence in the user-covariate cells (fixed at 0.2 for the figures)")
    parser.add_argument("--first", type=int, default=0, help="the first experiment's index (to split a run over cores)")
    args = parser.parse_args()
    names = list(CONFIGS) if args.config == "all" else args.config.split(",")
    for name, c in CONFIGS.items():
        if c.persistence:
            CONFIGS[name] = c._replace(persistence=args.user_persistence if c.covariate == "user" else args.persistence)
    for name in names:
        started = time.monotonic()
        queries = args.queries * (3 if name.startswith("power") else 2 if name == "boundary_ship" else 1)
        power = name.startswith("power") or name == "guardrail"
        r = run(name, args.power_experiments if power else args.experiments, queries, args.seed,
                args.first)
        print(line(name, r, queries), flush=True)
        print(f"  ({time.monotonic() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
