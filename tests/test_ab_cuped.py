"""CUPED (ab/cuped.py) against statsmodels OLS on hypothesis-drawn data: θ and the adjusted
difference are the coefficients of `y ~ arm + x`; the adjusted difference's variance is the
existing machinery's on the adjusted values (Welch = HC2 of `a ~ arm`, with the null's
floor; with user buckets the per-arm CRV1 of `a ~ 1` by bucket), and within O(1/n) of the
full regression's sandwich, which also carries θ's estimation error."""

from __future__ import annotations

import numpy as np
import pytest
import statsmodels.api as sm
from hypothesis import given, settings
from hypothesis import strategies as st

from rankmeter.ab import cuped
from rankmeter.ab.cuped import CovariateSums


def sums(x: np.ndarray, y: np.ndarray) -> CovariateSums:
    return CovariateSums(len(x), x.sum(), y.sum(), (x * x).sum(), (x * y).sum(), (y * y).sum())


def draw(seed: int, n_t: int, n_b: int, rho: float, shift: float, imbalance: bool = True) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    n = n_t + n_b
    arm = np.r_[np.ones(n_t), np.zeros(n_b)]
    x = rng.beta(2, 2, n) + 0.1 * arm * rng.random() * imbalance   # an imbalance in x between the arms
    y = np.clip(rho * x + (1 - rho) * rng.random(n) + shift * arm, 0, 1)
    return arm, x, y


def ols(y: np.ndarray, *columns: np.ndarray, **fit):
    design = np.column_stack([np.ones_like(y), *columns])
    return sm.OLS(y, design).fit(**fit)


drawn = given(seed=st.integers(0, 2**32 - 1), n_t=st.integers(20, 400), n_b=st.integers(20, 400),
              rho=st.floats(0.0, 0.95), shift=st.floats(-0.2, 0.2))


@drawn
@settings(max_examples=60, deadline=None)
def test_theta_and_adjusted_difference_are_the_ols_coefficients(seed, n_t, n_b, rho, shift):
    arm, x, y = draw(seed, n_t, n_b, rho, shift)
    fit = ols(y, arm, x)
    got = cuped.difference(sums(x[arm == 1], y[arm == 1]), sums(x[arm == 0], y[arm == 0]))
    assert got.theta == pytest.approx(fit.params[2], abs=1e-9)
    assert got.estimate.delta == pytest.approx(fit.params[1], abs=1e-9)
    assert got.unadjusted.delta == pytest.approx(y[arm == 1].mean() - y[arm == 0].mean(), abs=1e-12)


@drawn
@settings(max_examples=60, deadline=None)
def test_adjusted_variance_is_welch_of_the_adjusted_values_and_near_the_ols_sandwich(seed, n_t, n_b, rho, shift):
    # Randomised arms (x balanced but for chance): θ's estimation error is then O(1/n) of the
    # variance. A fixed imbalance in x, which randomisation does not make, adds
    # O(imbalance²/var x) whatever n (a hypothesis example: 25% at n = 121).
    arm, x, y = draw(seed, n_t, n_b, rho, shift, imbalance=False)
    th = ols(y, arm, x).params[2]
    a = y - th * (x - x.mean())
    welch = ols(a, arm, cov_type="HC2").bse[1] ** 2      # HC2 of a two-group regression is Welch's
    floor = ols(a).scale * (1 / n_t + 1 / n_b)            # both arms one sample: the null's
    got = cuped.difference(sums(x[arm == 1], y[arm == 1]), sums(x[arm == 0], y[arm == 0]))
    assert got.estimate.variance == pytest.approx(max(welch, floor), rel=1e-9, abs=1e-15)
    # The full regression's HC2 variance of `arm` also counts θ's estimation error: O(1/n).
    full = ols(y, arm, x, cov_type="HC2").bse[1] ** 2
    assert abs(welch / full - 1) < 30 / min(n_t, n_b)
    assert got.variance_reduction == pytest.approx(1 - got.estimate.variance / got.unadjusted.variance, rel=1e-12)


def bucketed(seed: int, users: int, rho: float) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    user_arm = rng.random(users) < 0.5
    user_effect = rng.normal(0, 0.3, users)
    user = rng.integers(0, users, 20 * users)
    arm, bucket = user_arm[user].astype(float), (user * 7919) % 128
    x = rng.normal(0, 1, len(user)) + user_effect[user]
    y = rho * x + rng.normal(0, 1, len(user)) + user_effect[user]
    return arm, bucket, x, y


def per_bucket(x: np.ndarray, y: np.ndarray, bucket: np.ndarray) -> np.ndarray:
    columns = (np.ones_like(x), x, y, x * x, x * y, y * y)
    return np.stack([np.bincount(bucket, c, minlength=128) for c in columns], -1)


@given(seed=st.integers(0, 2**32 - 1), users=st.integers(60, 300), rho=st.floats(0.0, 0.9))
@settings(max_examples=30, deadline=None)
def test_with_user_buckets_the_variance_is_the_cluster_robust_one(seed, users, rho):
    arm, bucket, x, y = bucketed(seed, users, rho)
    t, b = arm == 1, arm == 0
    got = cuped.bucket_difference(per_bucket(x[t], y[t], bucket[t]), per_bucket(x[b], y[b], bucket[b]))
    fit = ols(y, arm, x)
    assert got.theta == pytest.approx(fit.params[2], abs=1e-9)
    assert got.estimate.delta == pytest.approx(fit.params[1], abs=1e-9)
    a = y - got.theta * (x - x.mean())
    # Per arm, CRV1 of the intercept of a ~ 1 by bucket (G/(G − 1)·(N − 1)/(N − 1)): exactly
    # ab/clusters.py's; the null's floor is the same over both arms' buckets as clusters.
    per_arm = sum(sm.OLS(a[m], np.ones(m.sum())).fit(cov_type="cluster", cov_kwds={"groups": bucket[m]}).bse[0] ** 2
                  for m in (t, b))
    groups = bucket + 128 * arm.astype(int)
    pooled_var = sm.OLS(a, np.ones(len(a))).fit(cov_type="cluster", cov_kwds={"groups": groups}).bse[0] ** 2
    floor = len(a) * pooled_var * (1 / t.sum() + 1 / b.sum())
    assert got.estimate.variance == pytest.approx(max(per_arm, floor), rel=1e-9)
    # The full regression, clustered by (arm, bucket), within its small-sample factor and θ's
    # estimation error: G/(G − 1)·(N − 1)/(N − 3) against each arm's G_arm/(G_arm − 1).
    full = ols(y, arm, x, cov_type="cluster", cov_kwds={"groups": groups}).bse[1] ** 2
    assert abs(per_arm / full - 1) < 0.1


def test_a_covariate_that_is_constant_adjusts_nothing():
    """Every query without pre-period data: x = the pooled pre-period mean for all."""
    rng = np.random.default_rng(1)
    y = rng.random(500)
    x = np.full(500, 0.42)
    got = cuped.difference(sums(x[:250], y[:250]), sums(x[250:], y[250:]))
    assert got.theta == 0.0
    assert got.estimate == got.unadjusted
    assert got.variance_reduction == 0.0


def test_a_persistent_covariate_reduces_the_variance_by_about_rho_squared():
    rng = np.random.default_rng(2)
    x = rng.normal(size=40_000)
    y = 0.6 * x + 0.8 * rng.normal(size=40_000)   # corr(x, y) = 0.6: VR ≈ 0.36
    got = cuped.difference(sums(x[:20_000], y[:20_000]), sums(x[20_000:], y[20_000:]))
    assert got.variance_reduction == pytest.approx(0.36, abs=0.02)


def test_a_scaled_baseline_scales_its_adjusted_values():
    arm, x, y = draw(3, 300, 300, 0.7, 0.0)
    t, b = sums(x[arm == 1], y[arm == 1]), sums(x[arm == 0], y[arm == 0])
    got = cuped.difference(t, b, 0.9)
    a = y - got.theta * (x - x.mean())
    assert got.estimate.delta == pytest.approx(a[arm == 1].mean() - 0.9 * a[arm == 0].mean(), abs=1e-12)
    assert got.theta == cuped.difference(t, b).theta


def arm_vector(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One measure's A/B vector (ab/sums.py: a mean is a ratio with denominator 1) and its covariate sums."""
    n = float(len(y))
    vector = np.array([n, y.sum(), (y * y).sum(), y.sum(), n, (y * y).sum(), n, y.sum(), n, n])
    return vector, np.array([[x.sum(), (x * x).sum(), (x * y).sum()]])


def test_a_look_with_cuped_compares_the_adjusted_macro_metric_and_keeps_its_own_records():
    from rankmeter.ab.experiment import look
    from rankmeter.config import AB
    arm, x, y = draw(5, 2000, 2000, 0.8, 0.05)
    (vt, ct), (vb, cb) = arm_vector(x[arm == 1], y[arm == 1]), arm_vector(x[arm == 0], y[arm == 0])
    vectors, covariates = {("new", ""): vt, ("base", ""): vb}, {("new", ""): ct, ("base", ""): cb}
    on = AB(baseline="base", unit="query", cuped=True, primary=["nDCG@10 increase"])
    result, kept = look("e", "base", vectors, ["nDCG@10"], on, {}, covariates=covariates)
    by = {c.average: c for c in result.comparisons}
    expected = cuped.difference(sums(x[arm == 1], y[arm == 1]), sums(x[arm == 0], y[arm == 0]))
    assert by["macro"].estimate == expected.estimate
    assert by["macro"].variance_reduction == expected.variance_reduction > 0.3
    assert np.isnan(by["micro"].variance_reduction)     # ratios are not adjusted
    assert by["micro"].estimate.delta == pytest.approx(y[arm == 1].mean() - y[arm == 0].mean())
    assert sorted(k for k in kept if k.endswith("cuped")) == ["nDCG@10\x1fnew\x1f\x1fmacro\x1fcuped"]
    assert any(k.startswith("nDCG@10\x1fnew\x1f\x1fmacro\x1fcuped\x1fship") for k in kept)
    off, _ = look("e", "base", vectors, ["nDCG@10"], AB(baseline="base", unit="query", primary=["nDCG@10 increase"]),
                  {}, covariates=covariates)
    macro_off = next(c for c in off.comparisons if c.average == "macro")
    assert macro_off.estimate == expected.unadjusted and np.isnan(macro_off.variance_reduction)


def test_with_cuped_an_arm_without_covariate_sums_is_not_compared_unadjusted():
    """CUPED review F5: the unadjusted macro comparison is another test of the same metric
    (another running record): with ab.cuped on it is never made, in one experiment."""
    from rankmeter.ab.experiment import look
    from rankmeter.config import AB
    arm, x, y = draw(5, 2000, 2000, 0.8, 0.05)
    (vt, ct), (vb, _) = arm_vector(x[arm == 1], y[arm == 1]), arm_vector(x[arm == 0], y[arm == 0])
    on = AB(baseline="base", unit="query", cuped=True, primary=["nDCG@10 increase"])
    result, kept = look("e", "base", {("new", ""): vt, ("base", ""): vb}, ["nDCG@10"], on, {},
                        covariates={("new", ""): ct})
    assert [c.average for c in result.comparisons] == ["micro"]
    assert not [k for k in kept if "\x1fmacro" in k]


def test_the_variance_reduction_is_exported_and_reported():
    from prometheus_client import CollectorRegistry, generate_latest

    from rankmeter.ab import report
    from rankmeter.ab.export import experiment_metrics
    from rankmeter.ab.experiment import look
    from rankmeter.config import AB
    arm, x, y = draw(6, 1500, 1500, 0.8, 0.0)
    (vt, ct), (vb, cb) = arm_vector(x[arm == 1], y[arm == 1]), arm_vector(x[arm == 0], y[arm == 0])
    result, _ = look("e", "base", {("new", ""): vt, ("base", ""): vb}, ["nDCG@10"],
                     AB(baseline="base", unit="query", cuped=True), {},
                     covariates={("new", ""): ct, ("base", ""): cb})
    [macro] = [c for c in result.comparisons if c.average == "macro"]

    class Collector:
        def collect(self):
            return experiment_metrics(result)

    registry = CollectorRegistry()
    registry.register(Collector())
    text = generate_latest(registry).decode()
    line = next(t for t in text.splitlines() if t.startswith("rankmeter_ab_variance_reduction{"))
    assert 'average="macro"' in line and 'metric="nDCG@10"' in line and 'role="exploratory"' in line
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(macro.variance_reduction, rel=1e-12)
    assert text.count("rankmeter_ab_variance_reduction{") == 1   # micro: not adjusted, not exported
    rows = report.table(result, 0.05).splitlines()
    assert "var. red." in next(r for r in rows if r.startswith("treatment"))
    assert f"{macro.variance_reduction:.1%}" in next(r for r in rows if r.startswith("new") and "nDCG@10" in r)
