"""Pure tests of rankmeter.ab.clusters (per-user assignment, users hashed into buckets):
the variances against statsmodels' cluster-robust OLS and a from-scratch NumPy
implementation of Deng, Knoblich & Lu's formula, the null floor, the query-share SRM
against the per-query one, and a quick seeded A/A check under per-user assignment (the
full-size matrix is bench/ab_validity.py --matrix --unit user)."""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import statsmodels.api as sm
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy import stats

from rankmeter.ab import Estimate, msprt, preference, srm_p_value
from rankmeter.ab.clusters import (BUCKETS, bucket_difference, bucket_of, bucket_preference, bucket_ratio,
                                   srm_query_share, srm_query_share_p_value)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ab_validity  # noqa: E402

SEED = 20261202  # fixed before the first run, never changed to make a test pass


def _users(rng: np.random.Generator, users: int, queries: int, sigma: float = 1.0):
    """Queries of users with lognormal activity and propensity: each query's user id and a
    per-query value correlated within the user (nDCG-like, the user's propensity scaling
    the chance of a nonzero value), and 10 results with clicks (micro CTR)."""
    weights = rng.lognormal(0.0, 1.5, users)
    user = rng.choice(users, size=queries, p=weights / weights.sum())
    prop = rng.lognormal(-sigma ** 2 / 2, sigma, users)[user]
    value = np.where(rng.random(queries) < np.minimum(1.0, 0.6 * prop), rng.beta(2.0, 2.0, queries), 0.0)
    clicks = rng.binomial(10, np.minimum(1.0, 0.05 * prop)).astype(float)
    return user, value, clicks


def _buckets_of(user: np.ndarray) -> np.ndarray:
    ids = {u: bucket_of(f"u{u}") for u in np.unique(user)}
    return np.array([ids[u] for u in user])


def _per_bucket(bucket: np.ndarray, *columns: np.ndarray) -> list[np.ndarray]:
    return [np.bincount(bucket, c, minlength=BUCKETS) for c in columns]


# ---------------------------------------------------------------- bucket_of

def test_bucket_of_is_blake2b_of_the_utf8_id_modulo_b():
    for cid in ("u1", "ü-ß-名前", "", "c" * 500):
        digest = hashlib.blake2b(cid.encode("utf-8"), digest_size=8).digest()
        assert bucket_of(cid) == int.from_bytes(digest, "big") % 128
        assert bucket_of(cid, 7) == int.from_bytes(digest, "big") % 7
    # fixed values: the same in every process, replica and Python version (not hash())
    assert [bucket_of(f"u{i}") for i in range(5)] == [bucket_of(f"u{i}") for i in range(5)]
    assert bucket_of("u1") == 85 and bucket_of("u2") == 46
    with pytest.raises(ValueError):
        bucket_of("u1", 0)


def test_bucket_of_spreads_users_evenly():
    counts = np.bincount([bucket_of(f"client-{i}") for i in range(64_000)], minlength=BUCKETS)
    assert stats.chisquare(counts).pvalue > 0.001


# ---------------------------------------------------------------- one arm: against statsmodels

def _cluster_var_intercept(y: np.ndarray, groups: np.ndarray, weights: np.ndarray | None = None,
                           use_correction: bool = True) -> float:
    x = np.ones((len(y), 1))
    model = sm.OLS(y, x) if weights is None else sm.WLS(y, x, weights=weights)
    fit = model.fit(cov_type="cluster", cov_kwds={"groups": groups, "use_correction": use_correction})
    return float(fit.cov_params()[0, 0])


@pytest.mark.parametrize("users,queries,sigma", [(3000, 8000, 1.0), (300, 8000, 0.3), (60, 500, 1.0)])
def test_one_arm_macro_and_micro_equal_statsmodels_cluster_robust_exactly(users, queries, sigma):
    """statsmodels' CRV1 for an intercept-only model multiplies the sandwich by
    G/(G−1)·(N−1)/(N−K) with K = 1, i.e. by G/(G−1), G the groups present: the same
    factor as Deng et al.'s formula with B = the nonempty buckets. Equal to 1e-9."""
    rng = np.random.default_rng([SEED, users])
    user, value, clicks = _users(rng, users, queries, sigma)
    bucket = _buckets_of(user)
    y, n, num, den = _per_bucket(bucket, value, np.ones(queries), clicks, np.full(queries, 10.0))
    r, var, b = bucket_ratio(y, n)
    assert b == len(np.unique(bucket))
    assert r == pytest.approx(value.mean(), rel=1e-12)
    assert var == pytest.approx(_cluster_var_intercept(value, bucket), rel=1e-9)
    # micro: R = Σclicks/Σresults is WLS of clicks/results on 1 with weights = results
    r, var, _ = bucket_ratio(num, den)
    assert r == pytest.approx(clicks.sum() / (10.0 * queries), rel=1e-12)
    assert var == pytest.approx(_cluster_var_intercept(clicks / 10.0, bucket, np.full(queries, 10.0)), rel=1e-9)
    # without the correction: the plain sandwich, smaller by (G−1)/G
    assert _cluster_var_intercept(value, bucket, use_correction=False) == pytest.approx(
        bucket_ratio(y, n)[1] * (b - 1) / b, rel=1e-9)


def _deng(y: np.ndarray, n: np.ndarray) -> float:
    """Deng, Knoblich & Lu (2018) literally: (s²_y − 2R s_yn + R² s²_n)/(B n̄²) over the
    nonempty buckets, NumPy's (co)variances with ddof 1."""
    keep = n > 0
    y, n = y[keep], n[keep]
    b = len(y)
    r = y.sum() / n.sum()
    c = np.cov(np.vstack([y, n]), ddof=1)
    return (c[0, 0] - 2 * r * c[0, 1] + r * r * c[1, 1]) / (b * n.mean() ** 2)


_bucket_arrays = st.integers(2, 40).flatmap(lambda b: st.tuples(
    hnp.arrays(float, b, elements=st.floats(0, 50, allow_nan=False)),
    hnp.arrays(float, b, elements=st.integers(0, 30).map(float))))


@settings(max_examples=60, deadline=None)
@given(_bucket_arrays, st.randoms(use_true_random=False))
def test_one_arm_equals_the_from_scratch_delta_method(arrays, random):
    y, n = arrays
    y = np.where(n > 0, y, 0.0)  # an empty bucket has no values
    r, var, b = bucket_ratio(y, n)
    if (n > 0).sum() < 2:
        assert math.isnan(var)
        return
    assert b == (n > 0).sum()
    assert r == pytest.approx(y.sum() / n.sum(), rel=1e-12)
    assert var == pytest.approx(_deng(y, n), rel=1e-7, abs=1e-12)
    order = list(range(len(y)))
    random.shuffle(order)  # the buckets' order does not matter
    assert bucket_ratio(y[order], n[order])[1] == pytest.approx(var, rel=1e-9, abs=1e-15)
    assert bucket_ratio(3.0 * y, n)[1] == pytest.approx(9.0 * var, rel=1e-9, abs=1e-12)


def test_empty_buckets_do_not_count_and_one_bucket_has_no_variance():
    y, n = np.array([3.0, 1.0, 0.0, 0.0]), np.array([4.0, 2.0, 0.0, 0.0])
    assert bucket_ratio(y, n)[1] == pytest.approx(_deng(y, n))
    assert bucket_ratio(y, n)[1] == pytest.approx(bucket_ratio(y[:2], n[:2])[1])
    assert bucket_ratio(y, n)[2] == 2
    r, var, b = bucket_ratio([5.0, 0.0, 0.0], [7.0, 0.0, 0.0])  # one cluster: nothing to estimate from
    assert r == pytest.approx(5 / 7) and math.isnan(var) and b == 1
    assert math.isnan(bucket_ratio([0.0, 0.0], [0.0, 0.0])[0])
    assert all(math.isnan(x) for x in bucket_difference([5.0, 0.0], [7.0, 0.0], [1.0, 2.0], [3.0, 3.0]))


# ---------------------------------------------------------------- two arms

def test_difference_against_statsmodels_two_arm_regression():
    """A small treatment arm that triples the spread around the same mean (so the arms' own
    variances exceed the null's):
    V = Var(R_T) + Var(R_B). statsmodels' CRV1 of the treatment coefficient of
    y ~ 1 + treated, groups = (arm, bucket), is the same sandwich times
    G/(G−1)·(N−1)/(N−2) over both arms' G groups instead of each arm's B/(B−1): the
    ratio of the two is exactly that factor when every bucket is nonempty."""
    rng = np.random.default_rng(SEED)
    arms = []
    for scale, queries in ((1.0, 9000), (3.0, 3000)):
        user, value, _ = _users(rng, 4000, queries)
        arms.append((value.mean() + scale * (value - value.mean()), _buckets_of(user)))
    (y_b, g_b), (y_t, g_t) = arms
    sums_t = _per_bucket(g_t, y_t, np.ones(len(y_t)))
    sums_b = _per_bucket(g_b, y_b, np.ones(len(y_b)))
    assert (sums_t[1] > 0).all() and (sums_b[1] > 0).all()
    est = bucket_difference(*sums_t, *sums_b)
    v_t, v_b = bucket_ratio(*sums_t)[1], bucket_ratio(*sums_b)[1]
    assert est.variance == pytest.approx(v_t + v_b, rel=1e-12)
    assert est.delta == pytest.approx(y_t.mean() - y_b.mean(), rel=1e-12)
    assert est.relative == pytest.approx(est.delta / y_b.mean(), rel=1e-12)

    y = np.concatenate([y_t, y_b])
    treated = np.concatenate([np.ones(len(y_t)), np.zeros(len(y_b))])
    groups = np.concatenate([g_t, g_b + BUCKETS])
    fit = sm.OLS(y, sm.add_constant(treated)).fit(cov_type="cluster", cov_kwds={"groups": groups})
    assert fit.params[1] == pytest.approx(est.delta, rel=1e-9)
    g, n = 2 * BUCKETS, len(y)
    factor = (g / (g - 1) * (n - 1) / (n - 2)) / (BUCKETS / (BUCKETS - 1))
    assert fit.cov_params()[1, 1] == pytest.approx(est.variance * factor, rel=1e-9)


def test_the_null_floor_pools_both_arms_buckets():
    """A small arm with no event yet: its own variance is 0, the null's is not."""
    rng = np.random.default_rng(SEED + 1)
    n_t = np.zeros(BUCKETS)
    n_t[:20] = 5.0
    y_t = np.zeros(BUCKETS)                              # no click yet in the small arm
    n_b = rng.integers(10, 60, BUCKETS).astype(float)
    y_b = rng.binomial(n_b.astype(int), 0.02).astype(float)
    est = bucket_difference(y_t, n_t, y_b, n_b)
    assert bucket_ratio(y_t, n_t)[1] == 0.0
    y, n = np.concatenate([y_t, y_b]), np.concatenate([n_t, n_b])
    pooled = n.sum() * _deng(y, n) * (1 / n_t.sum() + 1 / n_b.sum())
    assert est.variance == pytest.approx(pooled, rel=1e-9)
    assert est.variance > bucket_ratio(y_b, n_b)[1]
    assert est.delta == pytest.approx(-y_b.sum() / n_b.sum())


def test_vectorised_over_leading_axes_equals_one_at_a_time():
    rng = np.random.default_rng(SEED + 2)
    shape = (3, 4, 16)
    n_t, n_b = (rng.integers(0, 5, shape).astype(float) for _ in range(2))
    y_t, y_b = n_t * rng.random(shape), n_b * rng.random(shape)
    n_t[0, 0, 1:] = 0.0  # one nonempty bucket: nan there
    est = bucket_difference(y_t, n_t, y_b, n_b)
    assert est.delta.shape == shape[:2]
    for idx in np.ndindex(shape[:2]):
        one = bucket_difference(y_t[idx], n_t[idx], y_b[idx], n_b[idx])
        assert isinstance(one.variance, float)
        np.testing.assert_equal([one.delta, one.variance], [est.delta[idx], est.variance[idx]])
    assert math.isnan(est.variance[0, 0])
    assert math.isfinite(msprt(bucket_difference(y_t[1, 1], n_t[1, 1], y_b[1, 1], n_b[1, 1])).p_value)


def test_preference_one_query_per_bucket_is_the_per_query_preference():
    """One query per cluster: the bucket variance is the per-query one of `preference`
    (wins, losses, ties as scores +1, −1, 0), up to the factor n/(n−1) vs the null's."""
    scores = np.array([1.0] * 30 + [-1.0] * 22 + [0.0] * 8)
    est = bucket_preference(scores, np.ones(len(scores)))
    per_query = preference(30, 22, 8)
    assert est.delta == pytest.approx(per_query.delta)
    n = len(scores)
    own = per_query.variance                                   # s²/n, s² with n − 1
    null = (scores ** 2).sum() / n ** 2 * n / (n - 1)          # around Δ = 0
    assert est.variance == pytest.approx(max(own, null), rel=1e-12)
    user, value, _ = _users(np.random.default_rng(SEED + 3), 500, 3000)
    s = np.sign(value - 0.3)
    g = _buckets_of(user)
    own_cluster = _cluster_var_intercept(s, g)
    s_b, n_b = _per_bucket(g, s, np.ones(len(s)))
    assert bucket_preference(s_b, n_b).variance >= own_cluster * (1 - 1e-12)


# ---------------------------------------------------------------- SRM: the query share

@pytest.mark.parametrize("n,share", [(1000, 0.5), (4000, 0.5), (10_000, 0.52), (10_000, 0.515), (20_000, 0.51),
                                     (3000, 0.55), (20_000, 0.5), (1000, 0.56), (5000, 0.52)])
def test_query_share_srm_with_one_query_per_user_agrees_with_the_multinomial_test(n, share):
    """One query per user: the per-query SRM (Dirichlet-multinomial, Lindon & Malek) and
    the query-share test (normal mixture, the prior's variance) are two tests of the same
    binomial: the same decision at α here, p-values within a factor of 4 down to 1e-3
    (below, the normal mixture's tail is lighter than the Dirichlet-multinomial's: both
    far below α)."""
    rng = np.random.default_rng([SEED, n, round(share * 1000)])
    in_t = int(round(n * share))
    counts = np.vstack([rng.multinomial(in_t, [1 / BUCKETS] * BUCKETS),
                        rng.multinomial(n - in_t, [1 / BUCKETS] * BUCKETS)])
    p_share = srm_query_share_p_value(counts, [0.5, 0.5])
    p_multi = srm_p_value([in_t, n - in_t], [0.5, 0.5])
    assert (p_share < 0.05) == (p_multi < 0.05)
    if p_multi < 1e-3:
        assert p_share < 1e-3
    elif p_multi < 0.5:
        assert 1 / 4 < p_share / p_multi < 4
    est = srm_query_share(counts, [0.5, 0.5])
    assert est[0].delta == pytest.approx(in_t / n - 0.5)
    # ≥ the binomial's p(1−p)/N; Ŝ = B·s²_m has a relative sd of √(2/(B−1)) ≈ 13%
    assert 0.25 / n <= est[0].variance <= 1.4 * 0.25 / n


def test_query_share_srm_is_robust_to_heavy_users():
    """Heavy users: the per-query count test sees a 'mismatch' in a correct 50/50 split,
    the query-share test's variance carries the users' clustering."""
    rng = np.random.default_rng(SEED + 4)
    user, _, _ = _users(rng, 2000, 20_000)
    arm = rng.random(2000) < 0.5
    bucket = _buckets_of(user)
    counts = np.vstack([np.bincount(bucket[arm[user]], minlength=BUCKETS),
                        np.bincount(bucket[~arm[user]], minlength=BUCKETS)]).astype(float)
    share = counts[0].sum() / counts.sum()
    est = srm_query_share(counts, [0.5, 0.5])[0]
    assert est.delta == pytest.approx(share - 0.5)
    assert est.variance > 5 * 0.25 / counts.sum()  # far above the binomial's
    assert srm_query_share_p_value(counts, [0.5, 0.5]) > 0.05


def test_query_share_srm_edges():
    assert srm_query_share_p_value(np.zeros((2, 4)), [0.5, 0.5]) == 1.0
    assert srm_query_share_p_value([[3.0, 0.0], [0.0, 0.0]], [0.5, 0.5]) == 1.0  # one bucket: no variance
    assert srm_query_share_p_value([[1.0, 2.0], [4.0, 5.0]], [1.0, 0.0]) == 0.0  # an arm split 0 with queries
    three = np.full((3, 64), 50.0)
    three[0] *= 1.3
    assert srm_query_share_p_value(three, [1, 1, 1]) < 1e-6
    assert srm_query_share_p_value(np.full((3, 64), 50.0), [1, 1, 1]) == 1.0
    with pytest.raises(ValueError):
        srm_query_share_p_value(np.ones((2, 4)), [0.5, 0.3, 0.2])


# ---------------------------------------------------------------- quick A/A under per-user assignment

def _clopper_pearson(k: int, n: int) -> tuple[float, float]:
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return ci.low, ci.high


@pytest.mark.parametrize("metric,split,sigma,experiments", [("ndcg", 0.5, 1.0, 300), ("fcr", 0.9, 1.0, 300),
                                                            ("bernoulli", 0.99, 1.0, 300), ("srm", 0.9, 1.0, 200)])
def test_quick_seeded_aa_under_per_user_assignment(metric, split, sigma, experiments):
    """Per-user assignment (10,000 users, lognormal activity σ 1.5, propensity σ 1.0),
    a look every 200 queries to 20,000, τ² by the product's rule (`mixture_tau2` at the
    first look with a variance, kept): the bucket
    statistics' A/A rate has an upper Clopper–Pearson bound ≤ 0.06; on the same
    experiments the per-query statistics (the old behaviour under this assignment) are
    far above it where the clustering matters (nDCG-like, the SRM)."""
    rng = np.random.default_rng([SEED, ab_validity.USER_METRICS.index(metric), round(split * 1000)])
    per_query = metric in ("ndcg", "srm")
    hits = ab_validity.user_aa_cell(metric, split, sigma, experiments, 20_000, 200, rng, per_query=per_query)
    lo, hi = _clopper_pearson(hits["bucket"], experiments)
    q_lo, q_hi = _clopper_pearson(hits["query"], experiments)
    print(f"A/A per-user {metric} {split:g}: bucket {hits['bucket']}/{experiments} (CP {lo:.3f}-{hi:.3f}); "
          f"per-query {hits['query']}/{experiments} (CP {q_lo:.3f}-{q_hi:.3f})")
    assert hi <= 0.06, hits
    if per_query:
        assert q_lo > 0.06, hits
