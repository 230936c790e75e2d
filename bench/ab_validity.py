"""Validity of the A/B statistics, measured: full-size A/A, SRM and power runs.

    .venv/bin/python bench/ab_validity.py [--experiments 2000] [--queries 20000] [--batch 100]
        [--power-experiments 1000] [--power-queries 60000] [--regression -0.02] [--seed 20261201]
    .venv/bin/python bench/ab_validity.py --matrix [--metric all] [--split 0.5,0.9,0.99] [--unit query|user|all]
        [--user-sigma 0.3,1.0] [--tau2-fixed] [--no-per-query] [--experiments 2000] [--seed 20261201]

    .venv/bin/python bench/ab_validity.py --power-matrix [--metric all] [--split 0.5] [--unit query]
        [--feedback-lag 300,1000,3000] [--fixed-total 10000] [--power-experiments 1000] [--power-queries 60000]
    .venv/bin/python bench/ab_validity.py --lag-aa [--metric bernoulli] [--split 0.5,0.9]
        [--feedback-lag 300,1000,3000] [--experiments 2000] [--queries 60000]

About 30 s on one core with the defaults; the matrix about 5 s a cell; --power-matrix
about 1–2 min a metric (per-user: about 4).

`--power-matrix`: queries to detection of a regression in each metric (nDCG-like,
Bernoulli 1%, micro CTR, FirstClickRank-like and `clicks`, a negative-binomial count a
query of mean 0.6), each sized so that a fixed-horizon 50/50 test at α = 0.05 with 80%
power needs `--fixed-total` queries, under three τ² rules: the product's (`ab.mixture_scale`
× `unit_variance` at the comparison's first look, kept — replayed through
`rankmeter.ab.experiment.look` on a sample), one τ² = 1e-4 for every metric, the oracle
(the scale × the true variance). `--feedback-lag L`: at every look the last L queries'
clicks are still to come (they read as no click), the product's rule against fixing τ²
only at the first look with n ≥ 2L; `--lag-aa`: A/A under the same lag.

`--matrix`: the A/A rate where the statistics' assumptions break (issue 20), one line a
cell, `… aa_rate=… ci=[…, …]` (Clopper–Pearson 95%): the baseline's share of the split
(0.5, 0.9, 0.99: the treatment arm small) against the measure, nDCG@10-like (`ndcg`),
a Bernoulli event of 1% (`bernoulli`, a conversion), a micro CTR of 0.2% a result over 10
results (`ctr`, a ratio, delta method) and a heavy-tailed rank defined on 60% of the
queries (`fcr`, FirstClickRank-like: P(r) ∝ r^-1.3 on 1..100); `--unit user` (or `all`)
the same under sticky per-user assignment (10,000 users a population, `--user-sigma` the σ
of their click propensity), with the SRM and interleaving cells too. τ² per cell is the
product's rule: the service's own `rankmeter.ab.experiment.mixture_tau2` at each
comparison's first look with a variance, then kept (`--tau2-fixed`: 1e-4 for every
measure, the old rule, nearly blind for `fcr`).

Pure simulation (no services): per-query values resembling nDCG@10 (35% zeros, 10% ones,
the rest Beta(2, 2); mean 0.375, sd 0.352), each query assigned to an arm at random,
every experiment looked at after every batch of `--batch` queries, statistics only
once each arm has DEFAULT_MIN_QUERIES queries.  The data are generated with NumPy in
chunks; every look goes through the library's own functions (`mean_difference`,
`msprt`, `update`, `srm_p_value`, `srm_update`), so the figures are those of the code
the service runs.  Prints a markdown table (progress goes to stderr).

* A/A: share of experiments that ever reach p < 0.05, always-valid mSPRT (running
  minimum) vs a fixed-horizon Welch z-test read at every look (the old dashboard band)
  and read once at the end, with Clopper–Pearson 95% intervals.
* SRM: share of runs that ever fire with the correct 50/50 split; with 52/48 actual
  against 50/50 configured, the share that fires by the end and the queries it takes.
* Power: a regression of δ (default −0.02) in the mean (each treatment value zeroed
  with probability −δ/0.375), queries to detection by mSPRT for several τ², against the
  analytic sample size of a fixed-horizon two-sided Welch test with the same α and
  80% power: n per arm = (z₁₋α/₂ + z₀.₈)² (σ²_T + σ²_B) / δ².
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
from scipy import stats

from progress import Progress  # bench/, beside this script
from rankmeter.ab import (
    DEFAULT_MIN_QUERIES,
    DEFAULT_TAU2,
    INTERLEAVING_TAU2,
    Estimate,
    MeanSums,
    RatioSums,
    Running,
    mean_difference,
    msprt,
    preference,
    ratio_difference,
    srm_p_value,
    srm_update,
    unit_variance,
    update,
)
from rankmeter.ab.clusters import BUCKETS, bucket_difference, bucket_preference, srm_query_share_p_value
from rankmeter.ab.experiment import look as experiment_look
from rankmeter.ab.experiment import mixture_tau2
from rankmeter.config import AB

ALPHA = 0.05
Z = stats.norm.ppf(1 - ALPHA / 2)
P_ZERO, P_ONE = 0.35, 0.10          # nDCG@10-like: share of zeros and of ones
MEAN = P_ONE + (1 - P_ZERO - P_ONE) * 0.5                      # 0.375
SECOND = P_ONE + (1 - P_ZERO - P_ONE) * (0.05 + 0.25)          # E x², Beta(2,2): var 0.05
REGRESSION = -0.02
MIXTURE_SCALE = AB().mixture_scale   # ab.mixture_scale's default


def ndcg_like(rng: np.random.Generator, size) -> np.ndarray:
    u = rng.random(size)
    x = rng.beta(2.0, 2.0, size)
    x[u < P_ZERO + P_ONE] = 1.0
    x[u < P_ZERO] = 0.0
    return x


def cp(k: int, n: int) -> str:
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return f"{k / n:.3f} [{ci.low:.3f}, {ci.high:.3f}]"


def arm_sums(rng, chunk: int, looks: int, batch: int, share: float, shrink: float):
    """Cumulative (n, Σx, Σx²) per arm at every look: arrays (chunk, looks)."""
    x = ndcg_like(rng, (chunk, looks, batch))
    treat = rng.random((chunk, looks, batch)) < share
    if shrink:
        x = np.where(treat & (rng.random(x.shape) < shrink), 0.0, x)
    out = []
    for mask in (treat, ~treat):
        out.append(tuple(np.cumsum(v, axis=1) for v in
                         (mask.sum(2).astype(float), (x * mask).sum(2), (x * x * mask).sum(2))))
    return out


def aa(args, rng, taus):
    looks = args.queries // args.batch
    hits = {t: 0 for t in taus}
    peeked = final = 0
    prog = Progress("A/A", args.experiments)
    done = 0
    while done < args.experiments:
        chunk = min(50, args.experiments - done)
        (tn, ts, ts2), (bn, bs, bs2) = arm_sums(rng, chunk, looks, args.batch, 0.5, 0.0)
        for e in range(chunk):
            running = {t: Running() for t in taus}
            fixed = False
            est = None
            for j in range(looks):
                if min(tn[e, j], bn[e, j]) < DEFAULT_MIN_QUERIES:
                    continue
                est = mean_difference(MeanSums(tn[e, j], ts[e, j], ts2[e, j]),
                                      MeanSums(bn[e, j], bs[e, j], bs2[e, j]))
                for t in taus:
                    running[t] = update(running[t], msprt(est, t, ALPHA))
                fixed = fixed or abs(est.delta) > Z * math.sqrt(est.variance)
            for t in taus:
                hits[t] += running[t].p_value < ALPHA
            peeked += fixed
            final += abs(est.delta) > Z * math.sqrt(est.variance)
        done += chunk
        prog(done)
    return hits, peeked, final


def srm(args, rng, share):
    looks = args.queries // args.batch
    fired, first = 0, []
    prog = Progress(f"SRM {share:.2f}", args.experiments)
    in_t = np.cumsum(rng.binomial(args.batch, share, (args.experiments, looks)), axis=1)
    for e in range(args.experiments):
        p = 1.0
        for j in range(looks):
            n = (j + 1) * args.batch
            p = srm_update(p, srm_p_value([in_t[e, j], n - in_t[e, j]], [0.5, 0.5]))
            if p < ALPHA:
                fired += 1
                first.append(n)
                break
        prog(e + 1)
    return fired, first


def power(args, rng, taus):
    shrink = -args.regression / MEAN
    looks = args.power_queries // args.batch
    first = {t: [] for t in taus}
    wrong_sign = {t: 0 for t in taus}
    prog = Progress("power", args.power_experiments)
    done = 0
    var_b = SECOND - MEAN ** 2
    var_t = SECOND * (1 - shrink) - (MEAN * (1 - shrink)) ** 2
    n_fixed = math.ceil((Z + stats.norm.ppf(0.8)) ** 2 * (var_t + var_b) / args.regression ** 2)
    fixed_power_hits = 0
    look_fixed = math.ceil(2 * n_fixed / args.batch) - 1   # first look with ≥ 2·n_fixed queries
    while done < args.power_experiments:
        chunk = min(25, args.power_experiments - done)
        (tn, ts, ts2), (bn, bs, bs2) = arm_sums(rng, chunk, looks, args.batch, 0.5, shrink)
        for e in range(chunk):
            running = {t: Running() for t in taus}
            pending = set(taus)
            for j in range(looks):
                if min(tn[e, j], bn[e, j]) < DEFAULT_MIN_QUERIES:
                    continue
                est = mean_difference(MeanSums(tn[e, j], ts[e, j], ts2[e, j]),
                                      MeanSums(bn[e, j], bs[e, j], bs2[e, j]))
                if j == look_fixed:
                    fixed_power_hits += est.delta < -Z * math.sqrt(est.variance)
                for t in list(pending):
                    running[t] = update(running[t], msprt(est, t, ALPHA))
                    if running[t].p_value < ALPHA:
                        first[t].append((j + 1) * args.batch)
                        wrong_sign[t] += est.delta > 0
                        pending.discard(t)
                if not pending and j >= look_fixed:
                    break
        done += chunk
        prog(done)
    return n_fixed, math.sqrt(var_b), math.sqrt(var_t), first, wrong_sign, fixed_power_hits


# ---- the matrix: splits and measures where the assumptions break ----

METRICS = ("ndcg", "bernoulli", "ctr", "fcr")
SPLITS = (0.5, 0.9, 0.99)   # the baseline's share; the treatment arm has the rest
BERNOULLI_P, CTR_P, CTR_RESULTS, FCR_CLICKED = 0.01, 0.002, 10, 0.6


def cell_values(metric: str, rng: np.random.Generator, size) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-query values (nan where the measure is undefined: left out) and, for a micro
    (ratio) measure, the denominators."""
    if metric == "ndcg":
        return ndcg_like(rng, size), None
    if metric == "bernoulli":
        return (rng.random(size) < BERNOULLI_P).astype(float), None
    if metric == "ctr":
        return rng.binomial(CTR_RESULTS, CTR_P, size).astype(float), np.full(size, float(CTR_RESULTS))
    if metric == "fcr":
        ranks = np.arange(1, 101)
        weights = ranks ** -1.3
        rank = rng.choice(ranks, size=size, p=weights / weights.sum()).astype(float)
        return np.where(rng.random(size) < FCR_CLICKED, rank, np.nan), None
    raise ValueError(f"unknown metric {metric!r}")


def cell_sums(metric: str, rng: np.random.Generator, chunk: int, looks: int, batch: int, treated: float):
    """Per arm (treatment, baseline), RatioSums' columns (n, Σy, Σz, Σy², Σz², Σyz)
    cumulated at every look: arrays (chunk, looks)."""
    y, z = cell_values(metric, rng, (chunk, looks, batch))
    arm = rng.random((chunk, looks, batch)) < treated
    counted = ~np.isnan(y)
    y = np.where(counted, y, 0.0)
    z = np.ones_like(y) if z is None else z
    out = []
    for mask in (arm & counted, ~arm & counted):
        columns = (mask.astype(float), y * mask, z * mask, y * y * mask, z * z * mask, y * z * mask)
        out.append(tuple(np.cumsum(c.sum(2), axis=1) for c in columns))
    return out


def aa_cell(metric: str, split: float, experiments: int, queries: int, batch: int,
            rng: np.random.Generator, tau2: float | None = None) -> int:
    """How many of `experiments` A/A experiments are ever 'significant' (the running
    always-valid p below α at some look), each looked at after every `batch` queries.
    `tau2` None: the product's rule, `mixture_tau2` (the service's function) at the
    comparison's first look with a variance, then kept; else that τ² for every look."""
    looks = queries // batch
    hits = done = 0
    settings = AB()
    while done < experiments:
        chunk = min(50, experiments - done)
        t, b = cell_sums(metric, rng, chunk, looks, batch, 1.0 - split)
        for e in range(chunk):
            running, fixed = Running(), tau2
            for j in range(looks):
                if min(t[0][e, j], b[0][e, j]) < DEFAULT_MIN_QUERIES:
                    continue
                arms = [RatioSums(*(c[e, j] for c in arm)) for arm in (t, b)]
                if metric != "ctr":
                    arms = [MeanSums(a.n, a.sum_y, a.sum_y2) for a in arms]
                est = ratio_difference(*arms) if metric == "ctr" else mean_difference(*arms)
                if not (math.isfinite(est.variance) and est.variance > 0):
                    continue
                if fixed is None:
                    fixed = mixture_tau2(settings, *arms)
                    if not (math.isfinite(fixed) and fixed > 0):
                        fixed = None   # no variance yet: not fixed, not tested (experiment.look)
                        continue
                running = update(running, msprt(est, fixed, ALPHA))
            hits += running.p_value < ALPHA
        done += chunk
    return hits


# ---- per-user assignment (issue 20): users with lognormal activity, sticky arms, buckets ----

USERS, ACTIVITY_SIGMA = 10_000, 1.5    # as the simulator's Users: a few heavy users, a long tail
USER_SIGMAS = (0.3, 1.0)                # σ of the users' click propensity (lognormal, mean 1)
CLICK_AT = 0.3 / np.arange(1, 11) ** 0.9   # interleaving: P(click) per rank of an average user
USER_METRICS = METRICS + ("srm", "interleaving")


def user_values(metric: str, rng: np.random.Generator, prop: np.ndarray):
    """Per-query values as `cell_values`, each query's user's propensity `prop` (mean 1)
    scaling its chance of a nonzero value, an event, a click, or (fcr) its rank."""
    size = prop.shape
    if metric == "ndcg":
        nonzero = rng.random(size) < np.minimum(1.0, (1 - P_ZERO) * prop)
        one = rng.random(size) < P_ONE / (1 - P_ZERO)
        return np.where(nonzero, np.where(one, 1.0, rng.beta(2.0, 2.0, size)), 0.0), None
    if metric == "bernoulli":
        return (rng.random(size) < np.minimum(1.0, BERNOULLI_P * prop)).astype(float), None
    if metric == "ctr":
        clicks = rng.binomial(CTR_RESULTS, np.minimum(1.0, CTR_P * prop)).astype(float)
        return clicks, np.full(size, float(CTR_RESULTS))
    if metric == "fcr":
        rank, _ = cell_values("fcr", rng, size)
        rank = np.clip(np.round(np.nan_to_num(rank, nan=1.0) * prop), 1.0, 100.0)
        return np.where(rng.random(size) < np.minimum(1.0, FCR_CLICKED * prop), rank, np.nan), None
    raise ValueError(f"unknown metric {metric!r}")


def _draw_users(rng: np.random.Generator, chunk: int, queries: int, treated: float, sigma: float):
    """A fresh population per experiment: each query's user, the users' propensity, arm
    (True: treatment, sticky) and bucket (as `bucket_of` of the client_id would be)."""
    weights = rng.lognormal(0.0, ACTIVITY_SIGMA, (chunk, USERS))
    cum = np.cumsum(weights, 1)
    cum /= cum[:, -1:]
    # one searchsorted for every row: row e's cumulative weights shifted into (e, e + 1]
    offsets = np.arange(chunk)[:, None]
    flat = (cum + offsets).ravel()
    u = rng.random((chunk, queries)) + offsets
    user = np.minimum(np.searchsorted(flat, u.ravel(), side="right").reshape(chunk, queries)
                      - offsets * USERS, USERS - 1)
    prop = rng.lognormal(-sigma ** 2 / 2, sigma, (chunk, USERS))
    arm = rng.random((chunk, USERS)) < treated
    bucket = rng.integers(0, BUCKETS, (chunk, USERS))
    rows = np.broadcast_to(offsets, user.shape)
    return prop[rows, user], arm[rows, user], bucket[rows, user], user


def _binned(index: np.ndarray, weights: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return np.bincount(index.ravel(), weights.ravel(), minlength=math.prod(shape)).reshape(shape)


def user_cell_sums(metric: str, rng: np.random.Generator, chunk: int, looks: int, batch: int,
                   treated: float, sigma: float, s: float = 0.0):
    """Cumulative sums at every look, from the same queries: per arm (0 treatment, 1
    baseline) and bucket, y and n (macro: Σ values, queries counted; micro ctr: Σ clicks,
    Σ results), shape (chunk, looks, 2, B); per arm, RatioSums' columns, (chunk, looks, 2);
    all queries per arm and bucket (the SRM's), (chunk, looks, 2, B). `s`: the treatment's
    regression, as `power_values` (ndcg: zeroed w.p. s; ctr: the click chance × (1 − s))."""
    queries = looks * batch
    prop, arm, bucket, _ = _draw_users(rng, chunk, queries, treated, sigma)
    if s and metric == "ctr":
        prop = prop * np.where(arm, 1.0 - s, 1.0)
    y, z = user_values(metric if metric in METRICS else "ndcg", rng, prop)
    if s and metric == "ndcg":
        y = np.where(arm & (rng.random(y.shape) < s), 0.0, y)
    elif s and metric != "ctr":
        raise ValueError(f"no per-user regression for {metric!r}")
    counted = ~np.isnan(y)
    y = np.where(counted, y, 0.0)
    z = counted.astype(float) if z is None else z * counted   # a mean: n = queries counted
    look = np.broadcast_to(np.arange(queries) // batch, y.shape)
    e = np.broadcast_to(np.arange(chunk)[:, None], y.shape)
    arm_index = (~arm).astype(int)
    cell = (e * looks + look) * 2 + arm_index
    shape_b, shape_a = (chunk, looks, 2, BUCKETS), (chunk, looks, 2)
    by_bucket = cell * BUCKETS + bucket
    cum = lambda a: np.cumsum(a, axis=1)  # noqa: E731
    buckets = (cum(_binned(by_bucket, y, shape_b)), cum(_binned(by_bucket, z, shape_b)))
    per_query = tuple(cum(_binned(cell, w, shape_a))
                      for w in (counted.astype(float), y, z, y * y, z * z, y * z))
    all_queries = cum(_binned(by_bucket, np.ones_like(y), shape_b))
    return buckets, per_query, all_queries


def _log_lambda(delta: np.ndarray, var: np.ndarray, tau2: float) -> np.ndarray:
    """`stats.msprt`'s ln Λ, vectorised: −½ ln(1 + τ²/V) + τ²θ̂²/(2V(V + τ²)); −inf
    where V ≤ 0 or anything is nan (`msprt`'s "no information")."""
    with np.errstate(invalid="ignore", divide="ignore"):
        out = -0.5 * np.log1p(tau2 / var) + tau2 * delta * delta / (2.0 * var * (var + tau2))
    return np.where(np.isfinite(delta) & np.isfinite(var) & (var > 0), out, -np.inf)


def _sequential(estimates: Estimate, ready: np.ndarray, tau2: float, rng: np.random.Generator) -> int:
    """How many experiments (rows) ever have the running p below α (the running minimum of
    p = 1/Λ over the looks where `ready`), vectorised; a sample of looks is checked
    against the library's `msprt` (the figures are the service's code's)."""
    delta = np.asarray(estimates.delta, dtype=float)
    var = np.asarray(estimates.variance, dtype=float)
    log_lam = np.where(ready, _log_lambda(delta, var, tau2), -np.inf)
    for idx in zip(*(rng.integers(0, d, 8) for d in delta.shape)):
        want = msprt(Estimate(float(delta[idx]), math.nan, float(var[idx])), tau2, ALPHA).p_value
        got = math.exp(-log_lam[idx]) if log_lam[idx] > 0 else 1.0
        assert not ready[idx] or math.isclose(got, want, rel_tol=1e-9), (got, want)
    return int((log_lam.max(-1) > math.log(1.0 / ALPHA)).sum())


def _per_query_estimates(metric: str, per_query, rng: np.random.Generator) -> Estimate:
    """The per-query statistics, vectorised: `mean_difference` (Welch's variance, the
    pooled floor) or, for ctr, `ratio_difference` (delta method, the pooled floor), as
    `stats.py` computes them; a sample checked against the library."""
    t = [c[..., 0] for c in per_query]
    b = [c[..., 1] for c in per_query]

    def ratio_var(n, sy, sz, syy, szz, syz):   # per-query delta method (a mean when z = 1)
        r = sy / sz
        vy, vz = (syy - sy * sy / n) / (n - 1), (szz - sz * sz / n) / (n - 1)
        cyz = (syz - sy * sz / n) / (n - 1)
        return r, np.maximum(0.0, vy - 2 * r * cyz + r * r * vz) / (n * (sz / n) ** 2)

    with np.errstate(invalid="ignore", divide="ignore"):
        (r_t, v_t), (r_b, v_b) = ratio_var(*t), ratio_var(*b)
        both = [x + y for x, y in zip(t, b)]
        _, v_0 = ratio_var(*both)
        pooled = both[0] * v_0 * (1 / t[0] + 1 / b[0])
        if metric != "ctr":   # a mean: Welch, and the pooled sample variance
            v_t = np.maximum(0.0, (t[3] - t[1] ** 2 / t[0]) / (t[0] - 1)) / t[0]
            v_b = np.maximum(0.0, (b[3] - b[1] ** 2 / b[0]) / (b[0] - 1)) / b[0]
            s2 = np.maximum(0.0, (both[3] - both[1] ** 2 / both[0]) / (both[0] - 1))
            pooled = s2 * (1 / t[0] + 1 / b[0])
        est = Estimate(r_t - r_b, r_t - r_b, np.maximum(v_t + v_b, pooled))
    for idx in zip(*(rng.integers(0, d, 8) for d in est.delta.shape)):
        arms = [RatioSums(*(float(c[idx]) for c in arm)) for arm in (t, b)]
        if min(arms[0].n, arms[1].n) < 2 or min(arms[0].sum_z, arms[1].sum_z) == 0:
            continue
        want = (ratio_difference(*arms) if metric == "ctr" else
                mean_difference(*(MeanSums(a.n, a.sum_y, a.sum_y2) for a in arms)))
        assert math.isclose(want.delta, est.delta[idx], rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(want.variance, est.variance[idx], rel_tol=1e-6, abs_tol=1e-15), (want, idx)
    return est




def user_aa_cell(metric: str, split: float, sigma: float, experiments: int, queries: int, batch: int,
                 rng: np.random.Generator, per_query: bool = True, tau2: float | None = None) -> dict[str, int]:
    """A/A experiments under per-user assignment: how many are ever 'significant' with the
    bucket statistics (`bucket`) and, on the same experiments, the per-query ones
    (`query`, wrong under this assignment). `srm`: the share of the correct split ever
    flagged, by the query-share test (`bucket`) and the per-query multinomial (`query`).
    `tau2` None: the product's rule (`_product_hits`); else that τ² for every look."""
    looks = queries // batch
    hits = {"bucket": 0, "query": 0}
    done = 0
    while done < experiments:
        chunk = min(25, experiments - done)
        (y, n), pq, all_q = user_cell_sums(metric, rng, chunk, looks, batch, 1.0 - split, sigma)
        if metric == "srm":
            hits["bucket"] += _srm_hits(all_q, split, clustered=True)
            hits["query"] += _srm_hits(all_q, split, clustered=False) if per_query else 0
        else:
            ready = np.minimum(pq[0][..., 0], pq[0][..., 1]) >= DEFAULT_MIN_QUERIES
            est = bucket_difference(y[..., 0, :], n[..., 0, :], y[..., 1, :], n[..., 1, :])
            estimates = {"bucket": est}
            if per_query:
                estimates["query"] = _per_query_estimates(metric, pq, rng)
            for stat, e in estimates.items():
                hits[stat] += (_sequential(e, ready, tau2, rng) if tau2 is not None else
                               _product_hits(metric, e, pq, ready, rng))
        done += chunk
    return hits


def _product_hits(metric: str, est: Estimate, per_query, ready: np.ndarray, rng: np.random.Generator) -> int:
    """How many experiments (rows) are ever 'significant' under the product's τ² rule: τ²
    from the service's `mixture_tau2` at the row's first look with a variance (and a
    per-query variance to scale), kept from there on, as experiment.look fixes it."""
    var = np.asarray(est.variance, dtype=float)
    uv = _unit_variances(metric, per_query, rng)   # (vectorised, checked against unit_variance)
    can = ready & np.isfinite(var) & (var > 0) & np.isfinite(uv) & (uv > 0)
    j = np.where(can.any(1), can.argmax(1), -1)
    tau2 = np.full(len(j), np.nan)
    settings = AB()
    for row in np.flatnonzero(j >= 0):
        arms = [RatioSums(*(float(c[row, j[row], a]) for c in per_query)) for a in (0, 1)]
        if metric != "ctr":
            arms = [MeanSums(a.n, a.sum_y, a.sum_y2) for a in arms]
        tau2[row] = mixture_tau2(settings, *arms)
    tested = ready & (np.arange(ready.shape[1])[None, :] >= np.where(j >= 0, j, ready.shape[1])[:, None])
    first, _ = _detections(est, tested, tau2, rng, 1.0)
    return int((first >= 0).sum())


def _srm_hits(all_q: np.ndarray, split: float, clustered: bool) -> int:
    shares = [1.0 - split, split]
    hits = 0
    for e in range(all_q.shape[0]):
        p = 1.0
        for j in range(all_q.shape[1]):
            counts = all_q[e, j]
            if counts.sum() < DEFAULT_MIN_QUERIES:
                continue
            now = (srm_query_share_p_value(counts, shares) if clustered
                   else srm_p_value(counts.sum(-1).tolist(), shares))
            p = srm_update(p, now)
            if p < ALPHA:
                hits += 1
                break
    return hits


def interleaving_aa_cell(sigma: float | None, experiments: int, queries: int, batch: int,
                         rng: np.random.Generator) -> dict[str, int]:
    """Interleaving A/A: two identical rankers, team-draft lists (in each pair of ranks a
    fair coin picks which team takes the higher), clicks per rank `CLICK_AT` × the user's
    propensity. `sigma` None: every query its own user (per-query units); else users as
    in `user_cell_sums`. Counts the experiments ever 'significant' by `preference`
    (per query) and `bucket_preference` (users bucketed), τ² INTERLEAVING_TAU2."""
    looks = queries // batch
    hits = {"bucket": 0, "query": 0}
    done = 0
    while done < experiments:
        chunk = min(25, experiments - done)
        if sigma is None:
            prop = np.ones((chunk, queries))
            bucket = rng.integers(0, BUCKETS, (chunk, queries))
        else:
            prop, _, bucket, _ = _draw_users(rng, chunk, queries, 0.5, sigma)
        clicks = rng.random((chunk, queries, 10)) < np.minimum(1.0, CLICK_AT * prop[..., None])
        a_first = rng.random((chunk, queries, 5)) < 0.5
        team_a = np.stack([a_first, ~a_first], -1).reshape(chunk, queries, 10)
        wins = (clicks & team_a).sum(-1) - (clicks & ~team_a).sum(-1)
        score = np.sign(wins).astype(float)
        clicked = clicks.any(-1).astype(float)
        look = np.broadcast_to(np.arange(queries) // batch, score.shape)
        e = np.broadcast_to(np.arange(chunk)[:, None], score.shape)
        by_bucket = (e * looks + look) * BUCKETS + bucket
        shape = (chunk, looks, BUCKETS)
        s_b = np.cumsum(_binned(by_bucket, score, shape), 1)
        n_b = np.cumsum(_binned(by_bucket, clicked, shape), 1)
        ready = n_b.sum(-1) >= DEFAULT_MIN_QUERIES
        hits["bucket"] += _sequential(bucket_preference(s_b, n_b), ready, INTERLEAVING_TAU2, rng)
        wa = np.cumsum(_binned(e * looks + look, (score > 0).astype(float), shape[:2]), 1)
        wb = np.cumsum(_binned(e * looks + look, (score < 0).astype(float), shape[:2]), 1)
        ties = n_b.sum(-1) - wa - wb
        per_query = np.vectorize(lambda a, b, t: tuple(preference(a, b, t)), otypes=[float] * 3)(wa, wb, ties)
        hits["query"] += _sequential(Estimate(*per_query), ready, INTERLEAVING_TAU2, rng)
        done += chunk
    return hits


def bucket_loss(args) -> None:
    """What bucketing costs against per-user sums: in A/A experiments at 50/50 to
    `--queries`, the variance of the nDCG-like delta from B buckets per arm and from one
    cluster per user (the same formula, B = the users), against the delta's variance over
    the experiments: mean ratio (bias) and relative sd (noise) of each estimate."""
    rng = np.random.default_rng([args.seed, 999])
    for sigma in (float(s) for s in args.user_sigma.split(",")):
        deltas, v_bucket, v_user = [], [], []
        for _ in range(args.experiments // 25):
            prop, arm, bucket, user = _draw_users(rng, 25, args.queries, 0.5, sigma)
            x, _ = user_values("ndcg", rng, prop)
            for e in range(25):
                arms = []
                for mask in (arm[e], ~arm[e]):
                    arms.append([np.bincount(key[e][mask], w[mask], minlength=size)
                                 for key, size in ((bucket, BUCKETS), (user, USERS)) for w in (x[e], np.ones(len(x[e])))])
                (tb_y, tb_n, tu_y, tu_n), (bb_y, bb_n, bu_y, bu_n) = arms
                by_bucket = bucket_difference(tb_y, tb_n, bb_y, bb_n)
                deltas.append(by_bucket.delta)
                v_bucket.append(by_bucket.variance)
                v_user.append(bucket_difference(tu_y, tu_n, bu_y, bu_n).variance)
        truth = np.var(deltas, ddof=1)
        for name, v in (("buckets", np.array(v_bucket)), ("per-user", np.array(v_user))):
            print(f"user_sigma={sigma:g} variance={name} experiments={len(deltas)} mean/empirical="
                  f"{v.mean() / truth:.3f} relative_sd={v.std(ddof=1) / v.mean():.3f}", flush=True)


def _line(fields: str, k: int, n: int) -> str:
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return f"{fields} experiments={n} aa_rate={k / n:.4f} ci=[{ci.low:.4f}, {ci.high:.4f}]"


def _tau2_text(tau2: float | None) -> str:
    return "product" if tau2 is None else f"{tau2:.3g}"


def matrix(args) -> None:
    units = ("query", "user") if args.unit == "all" else (args.unit,)
    metrics = (USER_METRICS if args.metric == "all"
               else tuple(args.metric.split(",")))
    splits = tuple(float(s) for s in (args.split or ",".join(map(str, SPLITS))).split(","))
    sigmas = tuple(float(s) for s in args.user_sigma.split(","))
    for unit in units:
        for metric in metrics:
            for split in splits:
                share = f"{split * 100:g}/{(1 - split) * 100:g}"
                if metric == "interleaving":
                    if split != 0.5:
                        continue   # team-draft: every query both rankers, a fair coin
                    share = "team-draft"
                if unit == "query":
                    if metric == "srm":
                        continue   # the per-query SRM: the main bench's table
                    if metric == "interleaving":
                        rng = np.random.default_rng([args.seed, len(METRICS) + 1])
                        hits = interleaving_aa_cell(None, args.experiments, args.queries, args.batch, rng)
                        print(_line(f"unit=query split={share} metric={metric} stat=query",
                                    hits["query"], args.experiments), flush=True)
                        continue
                    rng = np.random.default_rng([args.seed, METRICS.index(metric), round(split * 1000)])
                    tau2 = DEFAULT_TAU2 if args.tau2_fixed else None
                    k = aa_cell(metric, split, args.experiments, args.queries, args.batch, rng, tau2)
                    print(_line(f"unit=query split={share} metric={metric} tau2={_tau2_text(tau2)}", k,
                                args.experiments), flush=True)
                    continue
                for sigma in sigmas:
                    seed = [args.seed, 100 + USER_METRICS.index(metric),
                            round(split * 1000), round(sigma * 100)]
                    rng = np.random.default_rng(seed)
                    t0 = time.monotonic()
                    if metric == "interleaving":
                        hits = interleaving_aa_cell(sigma, args.experiments, args.queries, args.batch, rng)
                    tau2 = DEFAULT_TAU2 if args.tau2_fixed else None   # None: the product's rule
                    if metric in METRICS:
                        hits = user_aa_cell(metric, split, sigma, args.experiments, args.queries, args.batch,
                                            rng, per_query=not args.no_per_query, tau2=tau2)
                    elif metric == "srm":
                        hits = user_aa_cell(metric, split, sigma, args.experiments, args.queries, args.batch,
                                            rng, per_query=not args.no_per_query)
                    for stat in ("bucket", "query"):
                        if stat == "query" and args.no_per_query and metric != "interleaving":
                            continue
                        extra = f" tau2={_tau2_text(tau2)}" if metric in METRICS else ""
                        print(_line(f"unit=user user_sigma={sigma:g} split={share} metric={metric} stat={stat}"
                                    + extra, hits[stat], args.experiments), flush=True)
                    print(f"  ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)


# ---- power with τ² per metric, and τ² under late feedback (issue 20) ----

POWER_METRICS = ("ndcg", "bernoulli", "ctr", "fcr", "clicks")
CLICKS_MEAN, CLICKS_SIZE = 0.6, 0.5    # clicks a query: negative binomial, var μ + μ²/size = 1.32
FCR_RANKS = np.arange(1, 101, dtype=float)


def fcr_pmf(s: float) -> np.ndarray:
    """The first click's rank, P(r) ∝ r^−(1.3 − s) on 1..100: s > 0 a heavier tail (the
    relevant results placed lower), `cell_values`' fcr at s = 0."""
    w = FCR_RANKS ** -(1.3 - s)
    return w / w.sum()


def power_moments(metric: str, s: float) -> tuple[float, float, float]:
    """(mean, per-unit variance, share of queries where defined) of the metric when the
    treatment's regression has strength `s` (0: the baseline). The regressions: nDCG-like
    zeroed w.p. s; Bernoulli 1%, the per-result CTR and the clicks' mean × (1 − s); the
    first click's rank exponent 1.3 − s (fcr: `fcr_pmf`). ctr: the per-query variance of
    the linearised ratio (y − R·z)/z̄, what `unit_variance` estimates."""
    if metric == "ndcg":
        return MEAN * (1 - s), SECOND * (1 - s) - (MEAN * (1 - s)) ** 2, 1.0
    if metric == "bernoulli":
        p = BERNOULLI_P * (1 - s)
        return p, p * (1 - p), 1.0
    if metric == "ctr":
        q = CTR_P * (1 - s)
        return q, q * (1 - q) / CTR_RESULTS, 1.0
    if metric == "clicks":
        mu = CLICKS_MEAN * (1 - s)
        return mu, mu + mu * mu / CLICKS_SIZE, 1.0
    if metric == "fcr":
        p = fcr_pmf(s)
        m = float(p @ FCR_RANKS)
        return m, float(p @ FCR_RANKS ** 2) - m * m, FCR_CLICKED
    raise ValueError(f"unknown metric {metric!r}")


def fixed_total(metric: str, s: float, treated: float) -> float:
    """Queries in all a fixed-horizon two-sided test at α with 80% power needs, a share
    `treated` of them in the treatment: (z₁₋α/₂ + z₀.₈)²·(σ²_T/n_T + σ²_B/n_B)/δ² solved
    for n_T + n_B (n counted: the defined share of each arm's queries)."""
    m_b, v_b, f = power_moments(metric, 0.0)
    m_t, v_t, _ = power_moments(metric, s)
    k = (Z + stats.norm.ppf(0.8)) ** 2
    return k * (v_t / (f * treated) + v_b / (f * (1 - treated))) / (m_t - m_b) ** 2


def regression_for(metric: str, total: float) -> float:
    """The strength s at which the fixed-horizon 50/50 test needs `total` queries."""
    lo, hi = 1e-6, 0.99
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fixed_total(metric, mid, 0.5) > total else (lo, mid)
    return (lo + hi) / 2


def power_values(metric: str, rng: np.random.Generator, treat: np.ndarray, s: float):
    """Per-query (y, z): values (nan: undefined, left out) and, for ctr, the results shown;
    the treatment's (`treat`) with the regression of strength s."""
    size = treat.shape
    if metric == "ndcg":
        x = ndcg_like(rng, size)
        return np.where(treat & (rng.random(size) < s), 0.0, x), None
    if metric == "bernoulli":
        return (rng.random(size) < BERNOULLI_P * np.where(treat, 1 - s, 1.0)).astype(float), None
    if metric == "ctr":
        clicks = rng.binomial(CTR_RESULTS, CTR_P * np.where(treat, 1 - s, 1.0)).astype(float)
        return clicks, np.full(size, float(CTR_RESULTS))
    if metric == "clicks":
        mu = CLICKS_MEAN * np.where(treat, 1 - s, 1.0)
        return rng.negative_binomial(CLICKS_SIZE, CLICKS_SIZE / (CLICKS_SIZE + mu)).astype(float), None
    if metric == "fcr":
        u = rng.random(size)
        rank = np.where(treat, np.searchsorted(np.cumsum(fcr_pmf(s)), u), np.searchsorted(np.cumsum(fcr_pmf(0.0)), u))
        rank = np.minimum(rank, 99) + 1.0   # cumsum's last value may round below 1
        return np.where(rng.random(size) < FCR_CLICKED, rank, np.nan), None
    raise ValueError(f"unknown metric {metric!r}")


def power_batches(metric: str, rng: np.random.Generator, chunk: int, looks: int, batch: int,
                  treated: float, s: float):
    """Per batch of `batch` queries, per arm (last axis: 0 treatment, 1 baseline), RatioSums'
    columns (n, Σy, Σz, Σy², Σz², Σyz), arrays (chunk, looks, 2): as they are once every
    click has arrived (`complete`), and as they read while the clicks are still to come
    (`pending`: no click yet — 0 clicks, no event, no nDCG gain; fcr undefined)."""
    treat = rng.random((chunk, looks * batch)) < treated
    y, z = power_values(metric, rng, treat, s)
    counted = ~np.isnan(y)
    y = np.where(counted, y, 0.0)
    z = counted.astype(float) if z is None else z
    zp = np.zeros_like(z) if metric == "fcr" else z          # a pending query: no first click yet
    complete = (counted.astype(float), y, z, y * y, z * z, y * z)
    pending = ((zp > 0).astype(float) if metric == "fcr" else np.ones_like(y), 0 * y, zp, 0 * y, zp * zp, 0 * y)

    def per_batch(columns):
        out = []
        for c in columns:
            c = c.reshape(chunk, looks, batch)
            m = treat.reshape(chunk, looks, batch)
            out.append(np.stack([(c * m).sum(2), (c * ~m).sum(2)], -1))
        return out
    return per_batch(complete), per_batch(pending)


def lagged(complete, pending, lag_batches: int):
    """Cumulative sums at every look when the last `lag_batches` batches' clicks have not
    arrived yet (they read as `pending`; later looks see them complete)."""
    out = []
    for c, p in zip(complete, pending):
        cc, cp_ = np.cumsum(c, 1), np.cumsum(p, 1)
        if lag_batches == 0:
            out.append(cc)
            continue
        pad = np.zeros_like(cc[:, :lag_batches])
        cc_old = np.concatenate([pad, cc[:, :-lag_batches]], 1)   # complete up to look j − k
        cp_old = np.concatenate([pad, cp_[:, :-lag_batches]], 1)
        out.append(cc_old + cp_ - cp_old)
    return out


def _unit_variances(metric: str, per_query, rng: np.random.Generator) -> np.ndarray:
    """`unit_variance` of both arms at every look, vectorised (s² of a mean; n·Var(R) of
    the pooled ratio for ctr), a sample checked against the library."""
    n, sy, sz, syy, szz, syz = (c.sum(-1) for c in per_query)
    with np.errstate(invalid="ignore", divide="ignore"):
        if metric == "ctr":
            r = sy / sz
            vy, vz = (syy - sy * sy / n) / (n - 1), (szz - sz * sz / n) / (n - 1)
            cyz = (syz - sy * sz / n) / (n - 1)
            out = np.maximum(0.0, vy - 2 * r * cyz + r * r * vz) / (sz / n) ** 2
            out = np.where(sz != 0, out, np.nan)
        else:
            out = np.maximum(0.0, (syy - sy * sy / n) / (n - 1))
        out = np.where(n >= 2, out, np.nan)
    for idx in zip(*(rng.integers(0, d, 8) for d in out.shape)):
        arms = [RatioSums(*(float(c[idx][a]) for c in per_query)) for a in (0, 1)]
        if metric != "ctr":
            arms = [MeanSums(a.n, a.sum_y, a.sum_y2) for a in arms]
        want = unit_variance(*arms)
        assert (math.isnan(want) and math.isnan(out[idx])) or math.isclose(want, out[idx], rel_tol=1e-6,
                                                                         abs_tol=1e-15), (want, out[idx])
    return out


def _detections(est: Estimate, tested: np.ndarray, tau2: np.ndarray, rng: np.random.Generator,
                direction: float) -> tuple[np.ndarray, np.ndarray]:
    """Per experiment (row), the first look whose mSPRT p is below α among the `tested`
    looks, with its τ² per row (nan: never fixed, never tested), −1 if none, and whether
    that look's delta had the wrong sign (against `direction`). Sampled against `msprt`."""
    delta, var = np.asarray(est.delta, float), np.asarray(est.variance, float)
    t2 = tau2[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        log_lam = np.where(tested & np.isfinite(t2),
                           -0.5 * np.log1p(t2 / var) + t2 * delta * delta / (2.0 * var * (var + t2)), -np.inf)
    log_lam = np.where(np.isfinite(log_lam), log_lam, -np.inf)
    for idx in zip(*(rng.integers(0, d, 8) for d in delta.shape)):
        if not tested[idx] or not math.isfinite(tau2[idx[0]]) or not (var[idx] > 0):
            continue
        want = msprt(Estimate(float(delta[idx]), math.nan, float(var[idx])), float(tau2[idx[0]]), ALPHA).p_value
        got = math.exp(-log_lam[idx]) if log_lam[idx] > 0 else 1.0
        assert math.isclose(got, want, rel_tol=1e-9), (got, want)
    hit = log_lam > math.log(1.0 / ALPHA)
    first = np.where(hit.any(1), hit.argmax(1), -1)
    rows = np.arange(len(first))
    wrong = (first >= 0) & (np.sign(delta[rows, np.maximum(first, 0)]) == -np.sign(direction))
    return first, wrong


def _first_fixed(candidates: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the first look where `candidates` holds and that look's value (nan if none)."""
    j = np.where(candidates.any(1), candidates.argmax(1), -1)
    v = np.where(j >= 0, values[np.arange(len(j)), np.maximum(j, 0)], np.nan)
    return j, v


def power_rules(metric: str, per_query, batch: int, lag: int, rng: np.random.Generator, direction: float,
                rules: tuple[str, ...], est: Estimate | None = None,
                true_variance: float | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each τ² rule's (first detecting look, wrong sign) per experiment, from the cumulative
    sums at every look. `product`: `ab.mixture_scale` × `unit_variance` at the comparison's
    first look (each arm ≥ min_queries, a variance > 0), then kept, as experiment.look does;
    `fixed`: DEFAULT_TAU2 for every metric; `oracle`: the scale × the true per-unit
    variance; `product_after_2L` (`_4L`): as `product`, first fixed once 2·lag (4·lag)
    queries have arrived.
    `est`: the estimates when not the per-query ones (users' buckets; then not replayed)."""
    replay = est is None
    if est is None:
        est = _per_query_estimates("ctr" if metric == "ctr" else "mean", per_query, rng)
    if true_variance is None:
        true_variance = power_moments(metric, 0.0)[1]
    n_t, n_b = per_query[0][..., 0], per_query[0][..., 1]
    ready = (np.minimum(n_t, n_b) >= DEFAULT_MIN_QUERIES) & np.isfinite(est.variance) & (est.variance > 0)
    uv = _unit_variances(metric, per_query, rng)
    queries = batch * np.arange(1, ready.shape[1] + 1)[None, :]
    out = {}
    for rule in rules:
        can_fix = ready & np.isfinite(uv) & (uv > 0)
        wait = _wait(rule, lag)
        can_fix &= queries >= wait
        if rule.startswith("product"):
            j, v = _first_fixed(can_fix, uv)
            tau2 = MIXTURE_SCALE * v
        else:
            j = np.where(ready.any(1), ready.argmax(1), -1)
            tau2 = np.full(len(j), DEFAULT_TAU2 if rule == "fixed" else MIXTURE_SCALE * true_variance)
            tau2 = np.where(j >= 0, tau2, np.nan)
        tested = ready & (np.arange(ready.shape[1])[None, :] >= np.where(j >= 0, j, ready.shape[1])[:, None])
        out[rule] = _detections(est, tested, tau2, rng, direction) + (tau2,)
        if replay and rule.startswith("product"):   # one experiment replayed look by look as experiment.look does
            row = int(rng.integers(0, ready.shape[0]))
            want = _replay(metric, per_query, row, batch, wait)
            assert want == out[rule][0][row], (rule, row, want, out[rule][0][row])
    return out


def _wait(rule: str, lag: int) -> int:
    """Queries before a rule may fix τ²: k·lag for `product_after_<k>L`, else 0."""
    return int(rule[len("product_after_"):-1]) * lag if rule.startswith("product_after_") else 0


def _replay(metric: str, per_query, row: int, batch: int, fix_after: int) -> int:
    """The first look at which experiment `row` is 'significant' (−1: none), from the
    service's own `rankmeter.ab.experiment.look`, one look at a time, its kept running
    statistics (and the τ² it fixed) carried from look to look as the service carries them.
    `fix_after`: no look before that many queries (the candidate fix: nothing is fixed,
    nor tested, before)."""
    settings = AB(baseline="B", unit="query")
    average = "micro" if metric == "ctr" else "macro"
    kept: dict[str, str] = {}
    for j in range(per_query[0].shape[1]):
        if (j + 1) * batch < fix_after:
            continue
        vectors = {}
        for ranker, a in (("T", 0), ("B", 1)):
            n, sy, sz, syy, szz, syz = (float(c[row, j, a]) for c in per_query)
            # [n, Σx, Σx², Σy, Σz, Σy², Σz², Σyz, queries, judged] (ab/sums.py), x = y for a mean
            vectors[(ranker, "")] = np.array([n, sy, syy, sy, sz, syy, szz, syz, n, n])
        result, now = experiment_look("power", "B", vectors, [metric], settings, kept)
        kept.update(now)
        for c in result.comparisons:
            if c.average == average and c.running.p_value < ALPHA:
                return j
    return -1


def _quantiles(first_queries: list[int], total: int) -> tuple[float, float]:
    times = np.array(first_queries + [math.inf] * (total - len(first_queries)))
    med, p80 = np.quantile(times, [0.5, 0.8], method="inverted_cdf")
    return float(med), float(p80)


RULE_NAMES = {"product": "(a) product: scale × pooled variance at the first look",
              "fixed": "(b) one τ² = 1e-4 for every metric",
              "oracle": "(c) oracle: scale × true variance",
              "product_after_2L": "(a′) product, fixed at the first look with n ≥ 2L",
              "product_after_4L": "(a″) product, fixed at the first look with n ≥ 4L"}


def power_cell(metric: str, split: float, experiments: int, queries: int, batch: int, lags: tuple[int, ...],
               rng: np.random.Generator, total: float = 0.0) -> dict:
    """Experiments of one metric and split (the baseline's share), with the regression
    sized to a fixed-horizon 50/50 `total` (0: A/A); per lag (queries whose clicks are still to come at each look) and
    τ² rule, the looks of first detection, the wrong signs and the τ² fixed."""
    regress = total > 0
    s = regression_for(metric, total) if regress else 0.0
    direction = float(np.sign(power_moments(metric, s)[0] - power_moments(metric, 0.0)[0])) or 1.0
    looks = queries // batch
    n_fixed = fixed_total(metric, s, 1.0 - split) if regress else math.nan
    look_fixed = math.ceil(n_fixed / batch) - 1 if regress else looks
    res: dict = {"s": s, "n_fixed": n_fixed, "fixed_hits": 0, "cells": {}}
    check = np.random.default_rng(int(rng.integers(2 ** 63)))   # the library checks' samples: not the data's
    done = 0
    prog = Progress(f"{metric} {split:g}{'' if regress else ' A/A'}", experiments)
    while done < experiments:
        chunk = min(50, experiments - done)
        complete, pending = power_batches(metric, rng, chunk, looks, batch, 1.0 - split, s)
        for lag in lags:
            if lag % batch:
                raise ValueError("--feedback-lag must be a multiple of --batch")
            per_query = lagged(complete, pending, lag // batch)
            rules = (("product", "fixed", "oracle") if lag == 0 else
                     ("product", "product_after_2L", "product_after_4L", "oracle"))
            for rule, (first, wrong, tau2) in power_rules(metric, per_query, batch, lag, check, direction,
                                                          rules).items():
                cell = res["cells"].setdefault((lag, rule), {"first": [], "wrong": 0, "tau2": []})
                cell["first"] += [(f + 1) * batch for f in first if f >= 0]
                cell["wrong"] += int(wrong.sum())
                cell["tau2"] += [t for t in tau2 if math.isfinite(t)]
            if lag == 0 and regress and look_fixed < looks:   # the fixed-horizon test at its size
                est = _per_query_estimates("ctr" if metric == "ctr" else "mean",
                                           [c[:, look_fixed:look_fixed + 1] for c in per_query], check)
                res["fixed_hits"] += int((direction * est.delta[:, 0] > Z * np.sqrt(est.variance[:, 0])).sum())
        done += chunk
        prog(done)
    return res


def power_matrix(args) -> None:
    metrics = POWER_METRICS if args.metric == "all" else tuple(args.metric.split(","))
    splits = tuple(float(x) for x in (args.split or "0.5").split(","))
    lags = (0,) + tuple(int(x) for x in args.feedback_lag.split(",") if x and int(x) > 0)
    P, Q, B = args.power_experiments, args.power_queries, args.batch
    for split in splits:
        share = f"{split * 100:g}/{(1 - split) * 100:g}"
        for metric in metrics:
            t0 = time.monotonic()
            rng = np.random.default_rng([args.seed, 300 + POWER_METRICS.index(metric), round(split * 1000)])
            res = power_cell(metric, split, P, Q, B, lags, rng, args.fixed_total)
            m_b, v_b, f = power_moments(metric, 0.0)
            m_t, _, _ = power_moments(metric, res["s"])
            n_fixed = res["n_fixed"]
            print(f"\nmetric={metric} split={share} mean={m_b:.5g} sd={math.sqrt(v_b):.4g} defined={f:g} "
                  f"delta={m_t - m_b:+.5g} relative={(m_t - m_b) / m_b:+.2%} fixed_total={n_fixed:,.0f} "
                  f"fixed_power_sim={cp(res['fixed_hits'], P) if math.ceil(n_fixed / B) <= Q // B else 'n/a'} "
                  f"experiments={P} queries={Q} ({time.monotonic() - t0:.0f} s)")
            _print_rules(res["cells"], P, Q, n_fixed)


def _pilot(metric: str, sigma: float) -> tuple[float, float]:
    """The mean and the per-query variance `unit_variance` estimates (ctr: of the
    linearised ratio) for users of propensity σ, from a pilot of 2,000,000 queries (the
    oracle's τ²)."""
    rng = np.random.default_rng([8, USER_METRICS.index(metric), round(sigma * 100)])
    y, z = user_values(metric, rng, rng.lognormal(-sigma ** 2 / 2, sigma, 2_000_000))
    if z is None:
        return float(np.mean(y)), float(np.var(y))
    r = y.sum() / z.sum()
    return float(r), float(np.var(y - r * z) / z.mean() ** 2)


def user_power(args) -> None:
    """Queries to detection under per-user assignment (sticky arms, buckets, σ
    `--user-sigma`), the regression of the per-query cell, τ² rules (a)–(c); the fixed
    horizon from the delta's variance over the experiments (no formula with clusters)."""
    metrics = ("ndcg", "ctr") if args.metric == "all" else tuple(args.metric.split(","))
    split = float((args.split or "0.5").split(",")[0])
    P, Q, B = args.power_experiments, args.power_queries, args.batch
    looks = Q // B
    k = (Z + stats.norm.ppf(0.8)) ** 2
    for sigma in (float(x) for x in args.user_sigma.split(",")):
        for metric in metrics:
            t0 = time.monotonic()
            rng = np.random.default_rng([args.seed, 500 + POWER_METRICS.index(metric), round(split * 1000),
                                         round(sigma * 100)])
            s = regression_for(metric, args.fixed_total)
            direction = float(np.sign(power_moments(metric, s)[0] - power_moments(metric, 0.0)[0]))
            m_b, true_var = _pilot(metric, sigma)
            cells: dict = {}
            check = np.random.default_rng(int(rng.integers(2 ** 63)))
            deltas, variances = [], []
            done = 0
            prog = Progress(f"user {metric} σ {sigma:g}", P)
            while done < P:
                chunk = min(25, P - done)
                (y, n), pq, _ = user_cell_sums(metric, rng, chunk, looks, B, 1.0 - split, sigma, s)
                est = bucket_difference(y[..., 0, :], n[..., 0, :], y[..., 1, :], n[..., 1, :])
                deltas.append(est.delta)
                variances.append(est.variance)
                for rule, (first, wrong, tau2) in power_rules(metric, pq, B, 0, check, direction,
                                                              ("product", "fixed", "oracle"), est, true_var).items():
                    cell = cells.setdefault(rule, {"first": [], "wrong": 0, "tau2": []})
                    cell["first"] += [(f + 1) * B for f in first if f >= 0]
                    cell["wrong"] += int(wrong.sum())
                    cell["tau2"] += [t for t in tau2 if math.isfinite(t)]
                done += chunk
                prog(done)
            delta, var = np.concatenate(deltas), np.concatenate(variances)
            mean_delta = np.nanmean(delta, 0)
            need = k * np.nanvar(delta, 0, ddof=1) <= mean_delta ** 2   # the fixed horizon's size, per look
            j = int(need.argmax()) if need.any() else looks - 1
            n_fixed = (j + 1) * B if need.any() else math.nan
            fixed_hits = int((direction * delta[:, j] > Z * np.sqrt(var[:, j])).sum())
            share = f"{split * 100:g}/{(1 - split) * 100:g}"
            print(f"\nunit=user user_sigma={sigma:g} metric={metric} split={share} delta={mean_delta[-1]:+.5g} "
                  f"relative={mean_delta[-1] / m_b:+.2%} fixed_total={n_fixed:,.0f} (empirical; nan: > {Q:,}) "
                  f"fixed_power_sim={cp(fixed_hits, P)} at {(j + 1) * B:,} experiments={P} queries={Q} "
                  f"({time.monotonic() - t0:.0f} s)")
            _print_rules({(0, r): c for r, c in cells.items()}, P, Q, n_fixed)


def _print_rules(cells: dict, experiments: int, queries: int, n_fixed: float) -> None:
    print("| lag L | τ² rule | τ² fixed: median [10th, 90th pct] | detected by the end | "
          "queries to detection: median | 80th pct | median / fixed | 80th pct / fixed | wrong sign |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (lag, rule), cell in cells.items():
        med, p80 = _quantiles(cell["first"], experiments)
        fmt = lambda v: f"{v:,.0f}" if math.isfinite(v) else f"> {queries:,}"  # noqa: E731
        ratio = lambda v: ("n/a" if not math.isfinite(n_fixed)  # noqa: E731
                           else f"{v / n_fixed:.2f}" if math.isfinite(v) else f"> {queries / n_fixed:.1f}")
        t = np.percentile(cell["tau2"], [50, 10, 90]) if cell["tau2"] else [math.nan] * 3
        print(f"| {lag} | {RULE_NAMES[rule]} | {t[0]:.3g} [{t[1]:.3g}, {t[2]:.3g}] | "
              f"{cp(len(cell['first']), experiments)} | {fmt(med)} | {fmt(p80)} | {ratio(med)} | "
              f"{ratio(p80)} | {cell['wrong']} |", flush=True)


def lag_aa(args) -> None:
    """A/A under late feedback: the share of experiments ever 'significant', per lag and
    τ² rule, `--experiments` to `--queries` (Clopper–Pearson 95%)."""
    metrics = ("bernoulli",) if args.metric == "all" else tuple(args.metric.split(","))
    splits = tuple(float(x) for x in (args.split or "0.5,0.9").split(","))
    lags = (0,) + tuple(int(x) for x in args.feedback_lag.split(",") if x and int(x) > 0)
    for split in splits:
        share = f"{split * 100:g}/{(1 - split) * 100:g}"
        for metric in metrics:
            t0 = time.monotonic()
            rng = np.random.default_rng([args.seed, 400 + POWER_METRICS.index(metric), round(split * 1000)])
            res = power_cell(metric, split, args.experiments, args.queries, args.batch, lags, rng)
            for (lag, rule), cell in res["cells"].items():
                print(_line(f"metric={metric} split={share} lag={lag} rule={rule}", len(cell["first"]),
                            args.experiments), flush=True)
            print(f"  ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiments", type=int, default=2000)
    ap.add_argument("--queries", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--power-experiments", type=int, default=1000)
    ap.add_argument("--power-queries", type=int, default=60000)
    ap.add_argument("--regression", type=float, default=REGRESSION, help="δ in the mean, < 0")
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--matrix", action="store_true", help="the A/A matrix of splits and measures only")
    ap.add_argument("--metric", default="all", help=f"of the matrix: all, or some of {','.join(METRICS)}")
    ap.add_argument("--split", default=None,
                    help="the baseline's shares: of the matrix (default 0.5,0.9,0.99), --power-matrix (0.5), "
                         "--lag-aa (0.5,0.9)")
    ap.add_argument("--unit", default="query", choices=("query", "user", "all"),
                    help="of the matrix: per-query assignment, per-user (sticky, bucket statistics), or both")
    ap.add_argument("--user-sigma", default=",".join(map(str, USER_SIGMAS)),
                    help="of the matrix, --unit user: the σ of the users' click propensity (lognormal, mean 1)")
    ap.add_argument("--bucket-loss", action="store_true",
                    help="the variance from user buckets against per-user sums (--user-sigma, --experiments)")
    ap.add_argument("--tau2-fixed", action="store_true",
                    help="of the matrix: one τ² = 1e-4 for every measure (the old rule) instead of the product's "
                         "(mixture_tau2 at each comparison's first look, kept)")
    ap.add_argument("--no-per-query", action="store_true",
                    help="of the matrix, --unit user: skip the per-query statistics' lines (the slow part)")
    ap.add_argument("--power-matrix", action="store_true",
                    help="queries to detection per metric and τ² rule (--metric, --split, --power-experiments, "
                         "--power-queries, --feedback-lag)")
    ap.add_argument("--fixed-total", type=float, default=10_000,
                    help="of --power-matrix: each metric's regression sized so that a fixed-horizon 50/50 test "
                         "with 80%% power needs this many queries")
    ap.add_argument("--feedback-lag", default="",
                    help="of --power-matrix and --lag-aa: queries whose clicks are still to come at each look, "
                         "comma-separated multiples of --batch, e.g. 300,1000,3000")
    ap.add_argument("--lag-aa", action="store_true",
                    help="A/A under --feedback-lag: the product's τ² rule and the fix (--metric, default "
                         "bernoulli; --split, --experiments, --queries)")
    args = ap.parse_args()
    if args.power_matrix:
        (user_power if args.unit == "user" else power_matrix)(args)
        return
    if args.lag_aa:
        lag_aa(args)
        return
    if args.bucket_loss:
        bucket_loss(args)
        return
    if args.matrix:
        matrix(args)
        return
    if not -MEAN < args.regression < 0:
        ap.error(f"--regression must be in ({-MEAN}, 0)")
    rng = np.random.default_rng(args.seed)
    taus = sorted({2.5e-5, DEFAULT_TAU2, 4e-4, 2.5e-3})
    t0 = time.monotonic()

    hits, peeked, final = aa(args, rng, taus)
    srm_ok, _ = srm(args, rng, 0.5)
    srm_bad, srm_first = srm(args, rng, 0.52)
    n_fixed, sd_b, sd_t, first, wrong, fixed_hits = power(args, rng, taus)

    E, Q, B = args.experiments, args.queries, args.batch
    print(f"\n## A/B validity: {E} A/A experiments to {Q:,} queries, a look every {B} "
          f"(α = {ALPHA}, min {DEFAULT_MIN_QUERIES} queries per arm, seed {args.seed})\n")
    print("| test | share of experiments ever 'significant' [Clopper–Pearson 95%] |")
    print("| --- | --- |")
    for t in taus:
        mark = " (default)" if t == DEFAULT_TAU2 else ""
        print(f"| mSPRT, always-valid p, τ² = {t:g}{mark} | {cp(hits[t], E)} |")
    print(f"| fixed-horizon Welch z, read at every look | {cp(peeked, E)} |")
    print(f"| fixed-horizon Welch z, read once at {Q:,} | {cp(final, E)} |")
    print(f"| SRM, correct 50/50 split | {cp(srm_ok, E)} |")
    q = np.percentile(srm_first, [50, 90]) if srm_first else [math.nan] * 2
    print(f"| SRM, 52/48 actual vs 50/50 configured, fired by {Q:,} | {cp(srm_bad, E)}; "
          f"queries to fire: median {q[0]:,.0f}, 90th pct {q[1]:,.0f} |")

    P = args.power_experiments
    print(f"\n## Power: regression δ = {args.regression} in mean (baseline {MEAN:.3f}, sd {sd_b:.3f}; "
          f"treatment sd {sd_t:.3f}), {P} experiments to {args.power_queries:,} queries\n")
    print(f"Fixed horizon, α = {ALPHA} two-sided, 80% power: n = {n_fixed:,} per arm, "
          f"{2 * n_fixed:,} queries in all (simulated power at that size: {cp(fixed_hits, P)}).\n")
    print("| τ² | detected by the end | queries to detection: median | 80th pct | "
          "median / fixed total | 80th pct / fixed total | wrong sign |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for t in taus:
        f = first[t]
        # undetected runs count as +inf: quantiles over all runs, not only the detected
        times = np.array(f + [math.inf] * (P - len(f)))
        med, p80 = np.quantile(times, [0.5, 0.8], method="inverted_cdf")
        fmt = lambda v: f"{v:,.0f}" if math.isfinite(v) else f"> {args.power_queries:,}"  # noqa: E731
        mark = " (default)" if t == DEFAULT_TAU2 else ""
        print(f"| {t:g}{mark} | {cp(len(f), P)} | {fmt(med)} | {fmt(p80)} | "
              f"{med / (2 * n_fixed):.2f} | {p80 / (2 * n_fixed):.2f} | {wrong[t]} |")
    print(f"\n({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
