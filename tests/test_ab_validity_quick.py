"""Quick, seeded subset of bench/ab_validity.py --power-matrix and --lag-aa (issue 20): τ² per
metric makes a rank or count metric detectable, τ² fixed before the clicks arrive is too
small, fixing it only after twice the attribution window repairs that and stays valid.

Every τ² rule "product" is checked inside the bench against the service's own
`rankmeter.ab.experiment.look`, replayed look by look on a sampled experiment, so these
figures are those of the code the service runs. The full-size runs: docs/benchmarks.md."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ab_validity  # noqa: E402

SEED = 20261202


def _clopper_pearson(k: int, n: int) -> tuple[float, float]:
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return ci.low, ci.high


def _cell(metric: str, split: float, experiments: int, queries: int, lags: tuple[int, ...], total: float) -> dict:
    rng = np.random.default_rng([SEED, ab_validity.POWER_METRICS.index(metric), round(split * 1000)])
    return ab_validity.power_cell(metric, split, experiments, queries, 100, lags, rng, total)["cells"]


def test_tau2_per_metric_detects_a_rank_regression_the_fixed_tau2_misses():
    """FirstClickRank-like, a regression a 50/50 fixed-horizon test finds with 80% power at
    10,000 queries, 100 experiments to 20,000: with τ² from the metric's own variance
    (the product's rule) most are detected; with one τ² = 1e-4 for every metric none."""
    cells = _cell("fcr", 0.5, 100, 20_000, (0,), 10_000)
    product, fixed = (len(cells[(0, r)]["first"]) for r in ("product", "fixed"))
    print(f"fcr detected: product {product}/100, fixed τ² {fixed}/100")
    assert _clopper_pearson(product, 100)[0] >= 0.7
    assert _clopper_pearson(fixed, 100)[1] <= 0.1


def test_tau2_fixed_before_the_clicks_arrive_is_too_small_and_the_fix_repairs_it():
    """Clicks per query, 50/50, the last 1,000 queries' clicks still to come at every look:
    the product's τ² (fixed at the first look, 100 queries an arm) reads a variance of
    almost nothing but zeros, a fifth of the oracle's or less; fixed at the first look with
    n ≥ 2L it is at least half, and detects at least as many experiments."""
    cells = _cell("clicks", 0.5, 100, 20_000, (1000,), 10_000)
    oracle = float(np.median(cells[(1000, "oracle")]["tau2"]))
    early, after = (float(np.median(cells[(1000, r)]["tau2"])) for r in ("product", "product_after_2L"))
    found = {r: len(cells[(1000, r)]["first"]) for r in ("product", "product_after_2L")}
    print(f"τ²: oracle {oracle:.3g}, product {early:.3g}, after 2L {after:.3g}; detected {found}")
    assert early <= 0.2 * oracle
    assert after >= 0.5 * oracle
    assert found["product_after_2L"] >= found["product"] + 20


def test_aa_stays_valid_with_tau2_fixed_after_twice_the_window():
    """A/A, Bernoulli 1%, 90/10 and 50/50, 400 experiments to 20,000 queries a cell, clicks
    of the last 1,000 queries still to come: with τ² fixed at the first look with n ≥ 2L
    the upper Clopper–Pearson bound of the share ever 'significant' stays at most 6%."""
    for split in (0.9, 0.5):
        cells = _cell("bernoulli", split, 400, 20_000, (1000,), 0.0)
        hits = len(cells[(1000, "product_after_2L")]["first"])
        lo, hi = _clopper_pearson(hits, 400)
        print(f"A/A bernoulli {split:g} lag 1000 after 2L: {hits}/400 (CP {lo:.3f}-{hi:.3f})")
        assert hi <= 0.06, (split, hits)


def test_the_matrix_cells_fix_tau2_with_the_services_own_function(monkeypatch):
    """The --matrix cells take τ² from `rankmeter.ab.experiment.mixture_tau2` (the
    product's rule), once per experiment at its first look with a variance, never a
    fixed 1e-4 (review of issue 20, F3)."""
    from rankmeter.ab import experiment
    calls, returned, used = [], [], []

    def recorded(settings, t, c):
        calls.append((t, c))
        returned.append(experiment.mixture_tau2(settings, t, c))
        return returned[-1]

    def msprt(est, tau2, alpha):  # the τ² each look is tested with (review 9: not only computed)
        used.append(tau2)
        return ab_validity.msprt.__wrapped__(est, tau2, alpha)

    def detections(est, tested, tau2, rng, scale):
        used.extend(float(x) for x in np.asarray(tau2) if np.isfinite(x))
        return real_detections(est, tested, tau2, rng, scale)

    msprt.__wrapped__, real_detections = ab_validity.msprt, ab_validity._detections
    monkeypatch.setattr(ab_validity, "mixture_tau2", recorded)
    monkeypatch.setattr(ab_validity, "msprt", msprt)
    monkeypatch.setattr(ab_validity, "_detections", detections)
    ab_validity.aa_cell("fcr", 0.5, 3, 2_000, 200, np.random.default_rng(SEED))
    assert len(calls) == 3 and all(min(t.n, c.n) >= 100 for t, c in calls)
    assert used and set(used) <= set(returned) and ab_validity.DEFAULT_TAU2 not in used
    calls.clear(), returned.clear(), used.clear()
    ab_validity.user_aa_cell("fcr", 0.5, 1.0, 3, 2_000, 200, np.random.default_rng(SEED), per_query=False)
    assert len(calls) == 3 and all(min(t.n, c.n) >= 100 for t, c in calls)
    assert used and set(used) <= set(returned) and set(returned) <= set(used)
