"""A/B statistics when users, not queries, are the randomisation unit: sums per user bucket.

When a platform assigns users to arms (sticky, by ``client_id``), one user's queries are
correlated — a heavy user who clicks a lot lifts every one of their queries — and the
per-query variances of :mod:`rankmeter.ab.stats` are too small: A/A experiments look
"significant" far more often than α (bench/ab_validity.py --matrix --unit user). The
independent units are users. Impressions are keyed by ``query_id``, so one user's queries
land on every partition and replica: per-user sums cannot be kept additively without the
set of users. Instead each arm keeps its sums in ``B`` buckets (:func:`bucket_of`: a
stable hash of ``client_id`` modulo B). A bucket holds whole users, so the bucket sums of
one arm are independent clusters (given the users' assignment), they add across
partitions and replicas, and their memory is fixed (B × measures per arm).

Per bucket b of one arm and one measure: ``y[b]`` = Σ per-query values (a micro measure:
Σ numerators) and ``n[b]`` = queries counted (a micro measure: Σ denominators). The arm's
value is R = Σy / Σn, its variance the delta-method, cluster-robust one over buckets
(Deng, Knoblich & Lu, "Applying the delta method in metric analytics: a practical guide
with novel ideas", KDD 2018, §3):

    Var(R) = (s²_y − 2R·s_yn + R²·s²_n) / (B · n̄²),   n̄ = Σn / B,

with bucket sample (co)variances (B − 1 divisor) and B the number of buckets with
n[b] > 0 (see :func:`bucket_ratio` for why). Equivalently Σ_b (y_b − R n_b)² / (Σn)² ·
B/(B − 1): statsmodels' cluster-robust (CRV1) variance of the intercept of y ~ 1 with
groups = bucket, exactly (its small-sample factor is G/(G − 1)·(N − 1)/(N − K), K = 1).

What bucketing loses against per-user sums: the variance is estimated from B buckets, not
from U users, i.e. with about B − 1 degrees of freedom (B = 128: a relative sd of the
variance estimate of about √(2/127) ≈ 13% for normal-like buckets). Measured with
lognormal activity (bench/ab_validity.py --bucket-loss), it is not the limit: both
estimates are unbiased and their relative sd is 0.41 (buckets) against 0.40 (per-user
sums), the heavy users' noise either way (docs/ab-testing.md, "Randomisation unit").

All functions are pure and take plain arrays with the bucket axis last; leading axes
broadcast (the bench computes thousands of experiments × looks at once). With 1-D input
they return Python floats in the same :class:`~rankmeter.ab.stats.Estimate` the
per-query functions return, so :func:`~rankmeter.ab.stats.msprt` and
:func:`~rankmeter.ab.stats.update` apply unchanged.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from rankmeter.ab.stats import DEFAULT_MIN_QUERIES, DEFAULT_SRM_CONCENTRATION, Estimate, msprt

__all__ = ["BUCKETS", "bucket_of", "user_hash", "bucket_ratio", "bucket_difference", "bucket_preference",
           "srm_query_share", "srm_query_share_p_value"]

#: Buckets per arm: 128 gives ~13% relative noise in the variance (B − 1 = 127 df) for
#: 128 × 2 floats per arm and measure; more buckets buy little (√(2/(B − 1))).
BUCKETS = 128
# Nonempty buckets (about as many users, below 128) each arm needs before a comparison is
# tested: a cluster-robust variance from a few users has a few degrees of freedom
# (docs/benchmarks.md, "Few users": a guard; no failure measured above 10 users).
MIN_BUCKETS = 30


def user_hash(client_id: str) -> int:
    """A user's 64-bit hash: BLAKE2b (8-byte digest) of the UTF-8 ``client_id``, as an
    unsigned big-endian integer. Stable across processes, replicas and Python versions
    (unlike ``hash()``, salted per process). Its bucket is :func:`bucket_of`; its 8 bytes
    are what the arm's HyperLogLog counts (ab/hll.py)."""
    return int.from_bytes(hashlib.blake2b(client_id.encode("utf-8"), digest_size=8).digest(), "big")


def bucket_of(client_id: str | int, buckets: int = BUCKETS) -> int:
    """The bucket of a user (a ``client_id``, or its :func:`user_hash`): the hash modulo ``buckets``."""
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets!r}")
    return (client_id if isinstance(client_id, int) else user_hash(client_id)) % buckets


def _scalar(x: np.ndarray) -> float | np.ndarray:
    return float(x) if np.ndim(x) == 0 else x


def _ratio_var(y: np.ndarray, n: np.ndarray, ratio: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(R, Var(R), nonempty buckets) over the last axis; Var around ``ratio`` if given
    (the null's value), else around R. nan where Σn = 0 or fewer than 2 nonempty buckets."""
    total_y, total_n = y.sum(-1), n.sum(-1)
    nonempty = (n > 0).sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = total_y / total_n
        centre = r if ratio is None else ratio
        # Σ_b (y_b − R n_b)² = (B − 1)(s²_y − 2R s_yn + R² s²_n) when R = Σy/Σn (the
        # residuals then sum to 0); an empty bucket adds 0 to it.
        resid = y - np.asarray(centre)[..., None] * n
        var = (resid * resid).sum(-1) / (total_n * total_n) * nonempty / (nonempty - 1.0)
    var = np.where(nonempty >= 2, var, np.nan)
    return r, var, nonempty


def bucket_ratio(y: ArrayLike, n: ArrayLike) -> tuple[float | np.ndarray, float | np.ndarray, int | np.ndarray]:
    """One arm: R = Σy/Σn, its cluster-robust delta-method variance, and B.

    ``y``, ``n``: per-bucket sums (bucket axis last). Var(R) = (s²_y − 2R·s_yn + R²·s²_n) /
    (B·n̄²) (Deng, Knoblich & Lu 2018), B = the number of buckets with n > 0, n̄ = Σn/B.

    Why B counts only nonempty buckets: a bucket without queries is not a cluster of the
    sample (no user of the arm hashed there, or none with a counted query yet); it adds 0
    to Σ(y_b − R n_b)², but counting it would shrink the factor B/(B − 1) and, with one
    nonempty bucket, turn an undefined variance (one cluster: nothing to estimate it
    from) into a certain 0. Counting nonempty buckets makes the formula equal to the
    standard CRV1 over the clusters present (statsmodels' ``cov_type="cluster"``).

    Σn = 0: R nan; fewer than 2 nonempty buckets: Var nan.
    """
    r, var, b = _ratio_var(np.asarray(y, dtype=float), np.asarray(n, dtype=float))
    return _scalar(r), _scalar(var), (int(b) if np.ndim(b) == 0 else b)


def bucket_difference(y_t: ArrayLike, n_t: ArrayLike, y_b: ArrayLike, n_b: ArrayLike) -> Estimate:
    """R_T − R_B of two arms' bucket sums, macro (y = Σ values, n = queries counted) or
    micro (y = Σ numerators, n = Σ denominators); the variance never below the null's.

    V = max(Var(R_T) + Var(R_B), V_pooled) (:func:`bucket_ratio` per arm: independent
    arms, whole users in each bucket). V_pooled is :mod:`rankmeter.ab.stats`' null floor
    at bucket level: both arms' nonempty buckets taken as one sample of G clusters around
    the pooled R₀ = Σy/Σn, σ² = Σn·Var(R₀) the per-unit variance, V_pooled = σ²·(1/Σn_T +
    1/Σn_B). (Under correct randomisation each arm holds a random share of the users, so
    its expected Σ(y_b − R₀ n_b)² is that share of the total: the null's Var(R_T) is
    σ²/Σn_T.) Like the per-query floor, it keeps a small arm with no events yet — its own
    bucket variance 0 — from a spuriously tiny p-value.

    nan (all three) when an arm has Σn = 0 or fewer than 2 nonempty buckets.
    """
    y_t, n_t, y_b, n_b = (np.asarray(a, dtype=float) for a in (y_t, n_t, y_b, n_b))
    r_t, v_t, _ = _ratio_var(y_t, n_t)
    r_b, v_b, _ = _ratio_var(y_b, n_b)
    both_y, both_n = np.concatenate([y_t, y_b], -1), np.concatenate([n_t, n_b], -1)
    tot_t, tot_b = n_t.sum(-1), n_b.sum(-1)
    _, v_0, _ = _ratio_var(both_y, both_n)
    with np.errstate(invalid="ignore", divide="ignore"):
        pooled = (tot_t + tot_b) * v_0 * (1.0 / tot_t + 1.0 / tot_b)
        delta = r_t - r_b
        relative = np.where(r_b != 0.0, delta / r_b, np.nan)
    variance = np.fmax(v_t + v_b, pooled)       # fmax: a nan pooled never hides a valid sum
    bad = np.isnan(v_t) | np.isnan(v_b)
    delta, relative, variance = (np.where(bad, np.nan, a) for a in (delta, relative, variance))
    return Estimate(_scalar(delta), _scalar(relative), _scalar(variance))


def bucket_preference(score: ArrayLike, n: ArrayLike) -> Estimate:
    """Team-draft interleaving preference Δ = Σs / Σn with users clustered in buckets.

    Per bucket: ``score`` = wins_A − wins_B, ``n`` = queries with a click (wins + ties).
    Δ as :func:`~rankmeter.ab.stats.preference`; its variance the cluster-robust one of
    :func:`bucket_ratio`, never below the null's (residuals around Δ = 0: Σs_b² / (Σn)² ·
    G/(G − 1)). In an A/A test every user's expected score is 0 and the per-query
    variance is already valid (bench/ab_validity.py measures both); when users prefer one
    ranker to different degrees, their queries' scores are correlated and this one is
    the consistent variance. ``relative`` is nan. Fewer than 2 nonempty buckets: nan.
    """
    s, q = np.asarray(score, dtype=float), np.asarray(n, dtype=float)
    delta, own, _ = _ratio_var(s, q)
    _, null, _ = _ratio_var(s, q, np.zeros(s.shape[:-1]))
    variance = np.fmax(own, null)
    return Estimate(_scalar(delta), math.nan, _scalar(variance))


def _share_tau2(share: float, concentration: float) -> float:
    # The variance of an arm's share under the SRM test's Dirichlet(k·split) prior:
    # Beta(k p, k (1 − p)) has variance p(1 − p)/(k + 1).
    return share * (1.0 - share) / (concentration + 1.0)


def srm_query_share(counts: ArrayLike, split: Sequence[float],
                    concentration: float = DEFAULT_SRM_CONCENTRATION) -> list[Estimate]:
    """Per arm, its query share minus the configured split, with a cluster-robust variance.

    ``counts``: queries per (arm, bucket), arms in the order of ``split``, every arm's
    buckets by the same :func:`bucket_of`, so bucket b holds the same users' queries
    whatever their arm. For arm i, x_b = counts[i, b], m_b = Σ_arms counts[:, b]:
    θ̂ = Σx/Σm − p_i, and under H0 (share = p_i; activity independent of the arm, which
    correct randomisation gives) x = Σ_users n_u·I_u with I_u ~ Bernoulli(p_i) independent,
    so Var(Σx) = p_i(1 − p_i)·S, S = Σ_u n_u² over every user. S is estimated from how the
    hash spread the users over the buckets, never from the arms: m_b = Σ_u n_u·[u in b]
    with each user in a uniform random bucket has E[s²_m] = S/B (sample variance of the
    m_b over all B buckets, empty ones included: an empty bucket is an outcome of the
    hash), so Ŝ = B·s²_m and V = p_i(1 − p_i)·max(Ŝ, Σm)/(Σm)², never below the
    binomial's (one query per user, S = Σm). ``relative`` is nan.

    Why not the bucket residuals Σ_b (x_b − p_i m_b)² (the delta method of
    :func:`bucket_ratio` around the null's share): they weigh each query of the arm by
    (1 − p)² and each of the others by p², so an arm that has drawn few (heavy) users so
    far also gets a small variance, and the two errors compound: at 99/1, 8% of correct
    splits were flagged (bench/ab_validity.py --matrix --unit user --metric srm). Ŝ does
    not depend on which users went to which arm.

    This is a test of the *query* share that is robust to user clustering, not a count
    of users: how many distinct users each arm has is not additive over partitions
    without the set of users (a user's queries land on every partition), while bucket
    query counts are. With one query per user it is the binomial test of the share.
    """
    c = np.asarray(counts, dtype=float)
    p = np.asarray(split, dtype=float)
    if c.ndim != 2 or c.shape[0] != len(p) or not p.sum() > 0 or (p < 0).any():
        raise ValueError("counts must be (arms, buckets) with one nonnegative split share per arm")
    p = p / p.sum()
    m = c.sum(0)
    total, buckets = float(m.sum()), len(m)
    if not total > 0 or buckets < 2:
        return [Estimate(math.nan, math.nan, math.nan) for _ in p]
    squares = max(buckets * float(np.var(m, ddof=1)), total)   # Ŝ, at least one query per user
    return [Estimate(float(c[i].sum() / total - p[i]), math.nan, float(p[i] * (1.0 - p[i]) * squares / total ** 2))
            for i in range(len(p))]


def srm_query_share_p_value(counts: ArrayLike, split: Sequence[float],
                            concentration: float = DEFAULT_SRM_CONCENTRATION,
                            min_queries: float = DEFAULT_MIN_QUERIES) -> float:
    """Sample-ratio mismatch under per-user assignment, at this look: the normal-mixture
    mSPRT (:func:`~rankmeter.ab.stats.msprt`) of each arm's :func:`srm_query_share`, with
    τ² = p(1 − p)/(k + 1), the variance of the share under the per-query test's
    Dirichlet(k·split) prior (k = ``concentration``, Lindon & Malek 2020), so both tests
    look for mismatches of the same size. More than two arms: Bonferroni over the arms
    (with two, both arms' tests are one). Anytime-valid as the running minimum over looks
    (:func:`~rankmeter.ab.stats.srm_update`).

    No test (1) until every arm's *expected* query count p_i·Σm reaches ``min_queries``:
    the normal approximation of a sum of a few users' heavy-tailed activities is poor
    (at 99/1, one user with 5 of the first 100 queries is a z of 4), and the guard must
    not look at the arms' realised counts, which are what is tested. An arm whose split
    is 0 and has queries: 0. No information (a zero variance): 1."""
    estimates = srm_query_share(counts, split, concentration)
    p = np.asarray(split, dtype=float) / float(np.sum(split))
    c = np.asarray(counts, dtype=float)
    total = float(c.sum())
    if (c[p == 0.0].sum() > 0):
        return 0.0
    live = [i for i in range(len(p)) if 0.0 < p[i] < 1.0]
    if not live or min(p[i] for i in live) * total < min_queries:
        return 1.0
    ps = [msprt(estimates[i], _share_tau2(float(p[i]), concentration)).p_value for i in live]
    return min(1.0, min(ps) * (len(ps) if len(ps) > 2 else 1))
