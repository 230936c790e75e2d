"""One look at an experiment: from the arms' cumulative sums to always-valid statistics.

Every ranker other than the baseline is compared with it, per segment and measure,
macro (difference of means) and micro (difference of ratios, delta method). A look
updates what persists between looks (`Running`: the running minimum p-value and the
intersection of the confidence sequence), so the statistics stay valid however often
someone looks. Nothing is computed for a comparison until both arms have
`ab.min_queries` queries: a plug-in variance from a handful is unreliable.

The mixture variance τ² of each comparison is fixed at its first look and kept with its
running statistics: `ab.mixture_variance` when set, else `ab.mixture_scale` times the
metric's per-query variance under the null (both arms as one sample) at that look, so a
rank or count metric is tested at the same relative effect as nDCG. It is never
re-estimated as the experiment runs (only if its stored statistics were lost).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from rankmeter.ab import clusters, cuped, declared, hll
from rankmeter.ab import sums as ab_sums
from rankmeter.ab.stats import (INTERLEAVING_TAU2, Estimate, MeanSums, RatioSums, Running, Sequential,
                                mean_difference, msprt, preference, ratio_difference, srm_p_value, unit_variance,
                                update)
from rankmeter.ab.users import srm_users_p_value
from rankmeter.config import AB


class Comparison(NamedTuple):
    metric: str
    ranker: str
    segment: str
    average: str          # macro or micro
    estimate: Estimate
    running: Running      # always-valid p and confidence sequence, as of this look
    tau2: float = math.nan  # the mixture variance it is tested with, fixed at its first look
    # A declared metric's running sequences at the decision's levels (ab/declared.py `tests`), by name.
    tests: Mapping[str, Running] = {}
    # ab.cuped: 1 − V(adjusted)/V(unadjusted) of the adjusted comparison (ab/cuped.py); nan: not adjusted.
    variance_reduction: float = math.nan


class ArmView(NamedTuple):
    ranker: str
    segment: str
    queries: float
    judged: float
    users: float | None = None  # distinct users (HyperLogLog estimate), ab.unit: user; None: not counted


class Look(NamedTuple):
    experiment: str
    baseline: str
    arms: list[ArmView]
    comparisons: list[Comparison]
    srm: dict[str, float]  # segment -> always-valid SRM p-value (running minimum)
    split: str = "-"       # the phase: its split (identity.split_text) and since when (ms)
    since_ms: int = 0
    unit: str = "query"    # ab.unit
    notes: tuple[str, ...] = ()  # what the reader must know (measures not compared, a split changed in place)
    decisions: tuple[declared.Decision, ...] = ()  # per treatment and segment (ab/decision.py)


def look(experiment: str, baseline: str, vectors: Mapping[tuple[str, str], np.ndarray],
         names: list[str | None], settings: AB, running: Mapping[str, str],
         settled: bool = True, users: Mapping[tuple[str, str], np.ndarray] | None = None,
         covariates: Mapping[tuple[str, str], np.ndarray] | None = None) -> tuple[Look, dict[str, str]]:
    """`vectors`: (ranker, segment) -> the arm's summed vector over every partition, or
    with `ab.unit: user` its [B, size] sums per user bucket (ab/clusters.py: the variances
    and the sample-ratio test are then the cluster-robust ones over buckets); `names`: the
    measure of each slot of the experiment's definition (None: not compared). `running`:
    what earlier looks kept; `settled`: the phase has run long enough for its first
    queries' feedback to have arrived, so a τ² may be fixed from the metric's variance
    (before, a comparison without a fixed τ² is not tested). Returns the look and what
    to keep now. `users`: with `ab.unit: user`, each arm's HyperLogLog registers of its
    distinct users (None: the store does not count them); the sample-ratio test then
    tests user counts as well as query shares (`user_srm`)."""
    by_user = settings.unit == "user"
    arms = {key: ab_sums.arm(v.sum(0) if by_user else v, names) for key, v in vectors.items()}
    columns = {n: c for c, n in enumerate(names) if n is not None}
    kept: dict[str, str] = {}
    comparisons = []
    decided = declared.tests(declared.parse(settings.primary, settings.guardrails), settings.alpha)
    for (ranker, segment), arm in sorted(arms.items()):
        control = arms.get((baseline, segment))
        if ranker == baseline or control is None:
            continue
        for metric in [n for n in names if n is not None]:
            for average in ("macro", "micro"):
                if average == "macro":
                    t, c = arm.means[metric], control.means[metric]
                else:
                    t, c = arm.ratios[metric], control.ratios[metric]
                if min(t.n, c.n) < settings.min_queries:
                    continue
                adjusted = cuped_sums(covariates, vectors, ranker, segment, baseline, columns[metric], by_user) \
                    if settings.cuped and average == "macro" else None
                if settings.cuped and average == "macro" and adjusted is None:
                    continue  # (an arm's covariate sums unreadable: not compared, never tested unadjusted,
                    # a second test of the same metric in one experiment, ab/identity.py)
                if adjusted is not None:
                    cov_t, cov_b = adjusted
                    if by_user and min(np.count_nonzero(cov_t[:, 0]), np.count_nonzero(cov_b[:, 0])) < clusters.MIN_BUCKETS:
                        continue

                    def difference(s: float) -> Estimate:
                        return (cuped.bucket_difference if by_user else cuped.difference)(cov_t, cov_b, s).estimate
                elif by_user:
                    y_t, n_t = ab_sums.bucket_sums(vectors[(ranker, segment)], columns[metric], average)
                    y_b, n_b = ab_sums.bucket_sums(vectors[(baseline, segment)], columns[metric], average)
                    if min(np.count_nonzero(n_t), np.count_nonzero(n_b)) < clusters.MIN_BUCKETS:
                        continue  # too few users for a cluster-robust variance

                    def difference(s: float) -> Estimate:  # treatment − s·baseline
                        return clusters.bucket_difference(y_t, n_t, s * y_b, n_b)
                else:
                    def difference(s: float) -> Estimate:
                        return (mean_difference(t, _scaled(c, s)) if average == "macro" else
                                ratio_difference(t, _scaled(c, s)))
                estimate = difference(1.0)
                if not math.isfinite(estimate.variance) or estimate.variance <= 0:
                    continue
                key = "\x1f".join((metric, ranker, segment, average) + (("cuped",) if adjusted else ()))
                before, tau2 = decode_running(running.get(key)), _tau2(running.get(key))
                if tau2 is None:
                    if not (settled or settings.mixture_variance):
                        continue  # read before the clicks arrive, the variance is too small
                    tau2 = mixture_tau2(settings, t, c)
                if not (math.isfinite(tau2) and tau2 > 0):
                    continue  # no variance yet (a rare event not seen): not fixed, not tested
                now = update(before, msprt(estimate, tau2, settings.alpha))
                kept[key] = _encode(now, tau2)
                tests = {}
                for test, (level, s) in decided.get((metric, average), {}).items():
                    field = f"{key}\x1f{test}\x1f{level!r}\x1f{s!r}"  # another level or margin: another record
                    tests[test] = update(decode_running(running.get(field)),
                                         msprt(estimate if s == 1.0 else difference(s), tau2, level))
                    kept[field] = _encode(tests[test], tau2)
                reduction = math.nan
                if adjusted is not None:
                    reduction = (cuped.bucket_difference if by_user else cuped.difference)(*adjusted).variance_reduction
                comparisons.append(Comparison(metric, ranker, segment, average, estimate, now, tau2, tests, reduction))
    srm, notes = {}, []
    if settings.split:
        shares = settings.split
        for segment in sorted({s for _, s in arms}):
            counts = [arms[(r, segment)].queries if (r, segment) in arms else 0.0 for r in shares]
            if sum(counts) < settings.min_queries:
                continue
            key = "\x1f".join(("srm", segment))
            before = decode_running(running.get(key))
            if by_user:  # the query share per user bucket (a user's queries are not independent)
                buckets = [vectors[(r, segment)][:, -2] if (r, segment) in arms else np.zeros(clusters.BUCKETS)
                           for r in shares]
                now = clusters.srm_query_share_p_value(buckets, list(shares.values()), min_queries=settings.min_queries)
                # (an arm without a count has no users yet; one mapped to None, a count
                # unreadable or missing on a partition: no user test at this look)
                empty = np.zeros(hll.REGISTERS, np.uint8)
                counted = [users.get((r, segment), empty) for r in shares] if users else []
                # Users tested or not, the query shares at α/2 (Bonferroni, `user_srm`): one
                # split of α over every look of the phase.
                if not counted or any(c is None for c in counted) or not any(c.any() for c in counted):
                    now = min(1.0, 2.0 * now)
                if any(c is None for c in counted):
                    notes.append(f"distinct users of segment {segment or '-'} are not all readable at this look "
                                 f"(rankmeter_store_unreadable_total): its sample-ratio check tests query shares only")
                elif any(c.any() for c in counted):
                    now = user_srm(counted, list(shares.values()), now)
                else:
                    notes.append(f"distinct users are not counted in segment {segment or '-'} (a phase begun "
                                 f"before this release, or a store without HyperLogLog): its sample-ratio check "
                                 f"tests query shares only")
            else:
                now = srm_p_value(counts, list(shares.values()))
            p = min(before.p_value, now)
            kept[key] = _encode(before._replace(p_value=p))
            srm[segment] = p
    counts = {arm: hll.count(r) for arm, r in (users or {}).items() if r is not None}
    views = [ArmView(r, s, a.queries, a.judged, counts.get((r, s)))
             for (r, s), a in sorted(arms.items())]
    return Look(experiment, baseline, views, comparisons, srm, notes=tuple(notes)), kept


def cuped_sums(covariates: Mapping[tuple[str, str], np.ndarray] | None, vectors: Mapping[tuple[str, str], np.ndarray],
               ranker: str, segment: str, baseline: str, column: int, by_user: bool) -> tuple | None:
    """Both arms' CovariateSums of one measure (per user bucket: [B, 6]), or None when either
    arm has no covariate sums (the comparison is not made)."""
    if not covariates or (ranker, segment) not in covariates or (baseline, segment) not in covariates:
        return None
    out = []
    for arm in ((ranker, segment), (baseline, segment)):
        rows = cuped.arm_sums(vectors[arm], covariates[arm], column)
        out.append(rows if by_user else cuped.CovariateSums(*rows.tolist()))
    return tuple(out)


def mixture_tau2(settings: AB, t: MeanSums | RatioSums, c: MeanSums | RatioSums) -> float:
    """The τ² a comparison is fixed with at its first look: `ab.mixture_variance`, else
    `ab.mixture_scale` × the metric's per-query variance under the null (both arms as one
    sample; nan or 0 when it has none yet: not fixed)."""
    return settings.mixture_variance or settings.mixture_scale * unit_variance(t, c)


def user_srm(registers: list[np.ndarray | None], split: list[float], query_share_p: float) -> float:
    """The sample-ratio p-value with `ab.unit: user`: the arms' distinct users
    (ab/users.py: exact multinomial test, widened by the HyperLogLog bound) and their query
    shares (ab/clusters.py), Bonferroni: 2 × the smaller, so each is tested at α/2 and
    either a mismatch of users (an assignment bug) or one of queries (a ranker losing its
    users' impressions) is found. Per arm, against the rest: the other arms' registers
    merged (one HyperLogLog, one error)."""
    empty = np.zeros(hll.REGISTERS, np.uint8)
    regs = [empty if r is None else r for r in registers]
    users = [hll.count(r) for r in regs]
    rest = [hll.count(np.max([r for j, r in enumerate(regs) if j != i] or [empty], axis=0)) for i in range(len(regs))]
    return min(1.0, 2.0 * min(srm_users_p_value(users, rest, split), query_share_p))


def _scaled(a: MeanSums | RatioSums, s: float) -> MeanSums | RatioSums:
    """An arm's sums with every value (numerator) times s: T − s·B is then a difference."""
    if isinstance(a, MeanSums):
        return MeanSums(a.n, s * a.sum_x, s * s * a.sum_x2)
    return RatioSums(a.n, s * a.sum_y, a.sum_z, s * s * a.sum_y2, a.sum_z2, s * a.sum_yz)


class Preference(NamedTuple):
    """A team-draft interleaving experiment between two rankers (teams)."""
    experiment: str
    team_a: str
    team_b: str
    wins_a: float
    wins_b: float
    ties: float
    estimate: Estimate        # Δ = (wins_A − wins_B) / (wins + ties); None before min_queries
    running: Running | None   # always-valid p and confidence sequence for Δ
    withdrawn: str = ""       # why no p-value is exported (ab.unit: user), else empty


WITHDRAWN_BY_USER = ("ab.unit: user: interleaving counts are per query, and one user's queries are correlated, "
                     "so the per-query variance is too small: no p-value")


def interleaving_look(vectors: Mapping[tuple[str, str, str], np.ndarray], settings: AB,
                      running: Mapping[str, str]) -> tuple[list[Preference], dict[str, str]]:
    """`vectors`: (experiment, team A, team B) -> [wins A, wins B, ties] over every
    partition (queries with a click; a tie when both teams' clicks are equal)."""
    out, kept = [], {}
    # The counts are per query, not per user bucket: with users assigned, one user's queries
    # are correlated and the per-query variance too small, so no p-value is claimed.
    withdrawn = WITHDRAWN_BY_USER if settings.unit == "user" else ""
    for (experiment, a, b), (wins_a, wins_b, ties) in sorted((k, v.tolist()) for k, v in vectors.items()):
        estimate = preference(wins_a, wins_b, ties)
        now = None
        if not withdrawn and wins_a + wins_b + ties >= settings.min_queries and estimate.variance > 0:
            key = "\x1f".join(("interleaving", experiment, a, b))
            now = update(decode_running(running.get(key)), msprt(estimate, INTERLEAVING_TAU2, settings.alpha))
            kept[key] = _encode(now)
        out.append(Preference(experiment, a, b, wins_a, wins_b, ties, estimate, now, withdrawn))
    return out, kept


def _encode(r: Running, tau2: float | None = None) -> str:
    text = f"{r.p_value!r} {r.ci_lower!r} {r.ci_upper!r}"
    return text if tau2 is None else f"{text} {tau2!r}"


def decode_running(text: str | None) -> Running:
    """A stored running record (p-value, sequence ends[, τ²]); Running() when none or unreadable."""
    if not text or not readable(text):
        return Running()
    p, lo, hi = (float(x) for x in text.split()[:3])
    return Running(p, lo, hi)


def _tau2(text: str | None) -> float | None:
    """The mixture variance a comparison was fixed with (a fourth number), else None."""
    parts = text.split() if text and readable(text) else []
    return float(parts[3]) if len(parts) == 4 else None


def readable(text: str) -> bool:
    """Whether a stored running value is three numbers, or four with a positive τ² (else:
    skipped, as none)."""
    try:
        numbers = [float(x) for x in text.split()]
    except ValueError:
        return False
    return (len(numbers) == 3 or len(numbers) == 4 and numbers[3] > 0 and math.isfinite(numbers[3])) \
        and not any(math.isnan(x) for x in numbers)


def tighter(a: str | None, b: str | None) -> str:
    """Two records of the same running statistics combined as one more look would: the
    smaller p, the narrower sequence, and the τ² the first was fixed with (else the
    second's). Whatever each holds, the result never loosens either."""
    tau2 = _tau2(a) if _tau2(a) is not None else _tau2(b)
    return _encode(update(decode_running(a), Sequential(*decode_running(b))), tau2)
