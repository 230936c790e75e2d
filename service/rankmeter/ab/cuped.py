"""CUPED: the treatment effect on a covariate-adjusted metric (Deng, Xu, Kohavi & Walker,
"Improving the sensitivity of online controlled experiments by utilizing pre-experiment
data", WSDM 2013).

Per query i of an arm, y its value and x its covariate (the mean of the same measure over
the query text's queries before `ab.start`). The adjusted value is

    a = y − θ (x − x̄),   θ = Σ_arms S_xy / Σ_arms S_xx,   S_uv = Σuv − Σu·Σv / n (per arm),

θ pooled *within* the arms (each arm centred on its own means) and x̄ the mean of x over
both arms. θ is then the OLS coefficient of x in `y ~ arm + x`, and the difference of the
arms' mean a is that regression's coefficient of `arm`: the treatment cannot move θ
through a difference between the arms' means. The per-arm sums n, Σx, Σy, Σx², Σxy, Σy²
(per user bucket with `ab.unit: user`) give a's sums exactly, so the adjusted metric goes
through the same difference of means (:func:`rankmeter.ab.stats.mean_difference`, Welch
with the null's floor) or the same cluster-robust delta method over user buckets
(:func:`rankmeter.ab.clusters.bucket_difference`) as the unadjusted one, and the mSPRT
p-value and confidence sequence apply unchanged.

Its variance treats θ as known (Deng et al.'s CUPED): against the OLS sandwich of
`y ~ arm + x`, which also carries θ's estimation error, the difference is of relative
order 1/n (tests/test_ab_cuped.py measures both).

A query whose text has no pre-period data gets x = the pooled pre-period mean (the
caller's table): x − x̄ is then about 0 (exactly 0 when every query lacks one), so it is
adjusted by nothing; its covariate is a constant, which leaves θ and the test valid.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from rankmeter.ab import clusters
from rankmeter.ab.stats import Estimate, MeanSums, mean_difference
from rankmeter.ab.sums import SLOTS

__all__ = ["CovariateSums", "Adjusted", "COVARIATE_SLOTS", "arm_sums", "theta", "adjust", "difference",
           "bucket_difference", "variance_reduction"]

#: Per measure of the definition, what CUPED adds beside an arm's A/B sums (ab/sums.py):
#: Σx, Σx², Σxy over the queries the measure counts (x the covariate, y the value).
COVARIATE_SLOTS = 3


class CovariateSums(NamedTuple):
    """One arm, one measure: n, Σx, Σy, Σx², Σxy, Σy² (x the covariate, y the value)."""

    n: float
    sum_x: float
    sum_y: float
    sum_x2: float
    sum_xy: float
    sum_y2: float


class Adjusted(NamedTuple):
    """The adjusted comparison, with what it was adjusted by."""

    estimate: Estimate       # of the adjusted metric (treatment − baseline)
    unadjusted: Estimate     # the same comparison without the covariate
    theta: float
    variance_reduction: float  # 1 − V(adjusted) / V(unadjusted); nan without both


def arm_sums(vector: np.ndarray, covariate: np.ndarray, column: int) -> np.ndarray:
    """One measure's [n, Σx, Σy, Σx², Σxy, Σy²] of an arm, from its A/B vector (ab/sums.py:
    [..., size]; n, Σy, Σy² are the macro slots) and its covariate sums ([..., measures, 3]);
    with user buckets both have a leading bucket axis and so does the result."""
    base = SLOTS * column
    n, y, y2 = vector[..., base], vector[..., base + 1], vector[..., base + 2]
    x, x2, xy = (covariate[..., column, k] for k in range(COVARIATE_SLOTS))
    return np.stack([n, x, y, x2, xy, y2], -1)


def _centred(a: CovariateSums) -> tuple[float, float]:
    """(S_xx, S_xy) of one arm, centred on its own means."""
    if a.n <= 0:
        return 0.0, 0.0
    return a.sum_x2 - a.sum_x * a.sum_x / a.n, a.sum_xy - a.sum_x * a.sum_y / a.n


def theta(*arms: CovariateSums) -> float:
    """θ pooled within the arms: Σ S_xy / Σ S_xx. 0 when x does not vary within an arm
    (no covariate information: the metric is left as it is)."""
    sxx, sxy = (sum(v) for v in zip(*(_centred(a) for a in arms)))
    # A relative floor against rounding: x constant within arms gives S_xx of ~1e-16·Σx².
    scale = sum(a.sum_x2 for a in arms)
    return sxy / sxx if sxx > 1e-12 * scale and sxx > 0 else 0.0


def adjust(a: CovariateSums, th: float, x_mean: float) -> MeanSums:
    """The sums of a = y − θ(x − x̄) over one arm."""
    sum_a = a.sum_y - th * (a.sum_x - a.n * x_mean)
    # Σ(y − θ(x − x̄))² = Σy² − 2θ(Σxy − x̄Σy) + θ²(Σx² − 2x̄Σx + n x̄²)
    sum_a2 = (a.sum_y2 - 2.0 * th * (a.sum_xy - x_mean * a.sum_y)
              + th * th * (a.sum_x2 - 2.0 * x_mean * a.sum_x + a.n * x_mean * x_mean))
    return MeanSums(a.n, sum_a, max(sum_a2, 0.0))


def variance_reduction(adjusted: Estimate, unadjusted: Estimate) -> float:
    """1 − V(adjusted)/V(unadjusted): the share of the difference's variance the covariate
    removed (0: none; negative: it added noise, e.g. a covariate unrelated to y on few
    queries). nan when either variance is not a positive number."""
    v, u = adjusted.variance, unadjusted.variance
    if not (math.isfinite(v) and math.isfinite(u) and u > 0):
        return math.nan
    return 1.0 - v / u


def _pooled_mean(t: CovariateSums, b: CovariateSums) -> float:
    n = t.n + b.n
    return (t.sum_x + b.sum_x) / n if n > 0 else 0.0


def difference(t: CovariateSums, b: CovariateSums, s: float = 1.0) -> Adjusted:
    """Per query: the adjusted difference treatment − s·baseline (s ≠ 1: a relative
    guardrail's test, ab/declared.py `scale`; θ and x̄ are the comparison's, s only scales
    the baseline's adjusted values as it scales its raw ones)."""
    th, x_mean = theta(t, b), _pooled_mean(t, b)
    at, ab = adjust(t, th, x_mean), adjust(b, th, x_mean)
    ab = MeanSums(ab.n, s * ab.sum_x, s * s * ab.sum_x2)
    raw_b = MeanSums(b.n, s * b.sum_y, s * s * b.sum_y2)
    unadjusted = mean_difference(MeanSums(t.n, t.sum_y, t.sum_y2), raw_b)
    estimate = mean_difference(at, ab)
    return Adjusted(estimate, unadjusted, th, variance_reduction(estimate, unadjusted))


def bucket_difference(t: ArrayLike, b: ArrayLike, s: float = 1.0) -> Adjusted:
    """With user buckets: `t`, `b` each arm's [B, 6] sums per bucket (the columns of
    :class:`CovariateSums`). θ from the arms' totals (the OLS coefficient is the same
    however the queries cluster); the adjusted bucket sums Σa_b = Σy_b − θ(Σx_b − n_b x̄)
    go through :func:`rankmeter.ab.clusters.bucket_difference`, the cluster-robust delta
    method (per arm, statsmodels' CRV1 of `a ~ 1` with groups = bucket)."""
    t, b = np.asarray(t, dtype=float), np.asarray(b, dtype=float)
    total_t, total_b = CovariateSums(*t.sum(0).tolist()), CovariateSums(*b.sum(0).tolist())
    th, x_mean = theta(total_t, total_b), _pooled_mean(total_t, total_b)

    def adjusted_y(a: np.ndarray) -> np.ndarray:
        return a[:, 2] - th * (a[:, 1] - a[:, 0] * x_mean)

    estimate = clusters.bucket_difference(adjusted_y(t), t[:, 0], s * adjusted_y(b), b[:, 0])
    unadjusted = clusters.bucket_difference(t[:, 2], t[:, 0], s * b[:, 2], b[:, 0])
    return Adjusted(estimate, unadjusted, th, variance_reduction(estimate, unadjusted))
