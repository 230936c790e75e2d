"""The sample-ratio p-value a look exports, by exact value (review of issue 20, F2): under
`ab.unit: user` without distinct-user counts, the query-share test at α/2 (its p doubled,
Bonferroni with the user test it stands in for), and the running minimum over looks. The
reference is computed here from the formulas with SciPy, not with ab/clusters.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from rankmeter.ab import experiment
from rankmeter.ab.stats import DEFAULT_SRM_CONCENTRATION
from rankmeter.config import AB

SETTINGS = AB(baseline="base", unit="user", split={"base": 0.5, "new": 0.5}, min_queries=100)


def arms(extra: int) -> dict[tuple[str, str], np.ndarray]:
    """Queries per user bucket (128) of each arm, no measures ([B, 2]: queries, judged):
    an even split of every bucket, then 4 more queries in the first extra/4 buckets of "new"."""
    m = np.random.default_rng(7).poisson(8, 128).astype(float)
    base = np.floor(m / 2)
    new = m - base
    new[:extra // 4] += 4
    return {(r, ""): np.stack([q, q], axis=1) for r, q in (("base", base), ("new", new))}


def reference_share_p(vectors: dict[tuple[str, str], np.ndarray]) -> float:
    """The query-share mSPRT p-value from its definition: θ̂ = share − ½, V = ¼·max(B·s²_m, Σm)/(Σm)²
    (s²_m the sample variance of the buckets' totals), τ² = ¼/(k + 1); p = 1/Λ with
    Λ = N(θ̂; 0, V + τ²) / N(θ̂; 0, V), the normal mixture's likelihood ratio."""
    x, m = vectors[("new", "")][:, 0], vectors[("new", "")][:, 0] + vectors[("base", "")][:, 0]
    total = m.sum()
    theta = x.sum() / total - 0.5
    v = 0.25 * max(len(m) * np.var(m, ddof=1), total) / total ** 2
    tau2 = 0.25 / (DEFAULT_SRM_CONCENTRATION + 1)
    lam = stats.norm.pdf(theta, scale=math.sqrt(v + tau2)) / stats.norm.pdf(theta, scale=math.sqrt(v))
    return min(1.0, 1.0 / lam)


def test_without_user_counts_the_query_share_is_tested_at_half_alpha():
    vectors = arms(24)
    share_p = reference_share_p(vectors)
    look, kept = experiment.look("e", "base", vectors, [], SETTINGS, {}, users=None)
    assert look.srm[""] == pytest.approx(2 * share_p, rel=1e-9)
    # The case α/2 decides: the share alone is below α, so at α this split would be flagged.
    assert share_p < SETTINGS.alpha < look.srm[""]
    assert any("not counted" in n for n in look.notes)


def test_the_exported_srm_p_value_is_the_running_minimum_over_looks():
    first, kept = experiment.look("e", "base", arms(60), [], SETTINGS, {})
    assert first.srm[""] == pytest.approx(2 * reference_share_p(arms(60)), rel=1e-9) and first.srm[""] < 0.01
    later_p = 2 * reference_share_p(arms(0))
    assert later_p > 0.4  # this look alone: no mismatch at all
    second, kept2 = experiment.look("e", "base", arms(0), [], SETTINGS, kept)
    assert second.srm[""] == first.srm[""]  # the past smaller p holds
    assert float(kept2["srm\x1f"].split()[0]) == first.srm[""]
    fresh, _ = experiment.look("e", "base", arms(0), [], SETTINGS, {})
    assert fresh.srm[""] == pytest.approx(later_p, rel=1e-9)
