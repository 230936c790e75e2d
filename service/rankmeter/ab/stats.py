"""Pure statistics of A/B experiments: estimates, always-valid tests, sample-ratio guard.

No I/O, no state: the caller keeps per-arm sums (:class:`MeanSums`, :class:`RatioSums`)
cumulatively from the start of the experiment, calls :func:`mean_difference` or
:func:`ratio_difference` and :func:`msprt` at every look, and persists the
:class:`Running` value that :func:`update` returns (running minimum of the p-value,
running intersection of the confidence sequence).  The sample-ratio check is
:func:`srm_p_value`, made anytime-valid by the running minimum kept with :func:`srm_update`.

Conventions, documented once:

* ``delta`` is always treatment − baseline.
* An arm with fewer than 2 queries (or a ratio arm whose Σz is 0) has no sample
  variance: the estimate is all ``nan``.
* The variance of a difference is never below the one under the null hypothesis (both
  arms one population, the pooled variance of the two-proportion z-test): with a small
  arm, or a rare event, an arm's own sample variance is often 0 or near it (no click
  yet among its first hundred queries), and Welch's variance alone then gave A/A tests
  a false-alarm rate of 13–35% (Bernoulli 1%, micro CTR 0.2% a result, 90/10 and 99/1
  splits; bench/ab_validity.py). Under the alternative the larger of the two keeps the
  confidence sequence valid, only wider.
* A variance of exactly 0 (e.g. every query 0 in both arms) carries no information:
  :func:`msprt` then returns ``p = 1`` and the confidence sequence (−∞, +∞), so the
  running values are unchanged.  ``nan`` input is treated the same way.
* Statistics should only be published once each arm has ``DEFAULT_MIN_QUERIES``
  (``ab.min_queries``) queries: a plug-in variance from a handful of queries can be
  near zero and give a spuriously tiny p-value.

References
----------
* R. Johari, L. Pekelis, D. Walsh, "Always valid inference: Bringing sequential
  analysis to A/B testing", arXiv:1512.04922 (2015/2017); R. Johari, P. Koomen,
  L. Pekelis, D. Walsh, "Peeking at A/B tests: why it matters, and what to do about
  it", KDD 2017 (the Optimizely Stats Engine).
* M. Lindon, A. Malek, "Anytime-valid inference for multinomial count data",
  arXiv:2011.03567 (2020); NeurIPS 2022 (the sequential sample-ratio-mismatch test).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

inf = math.inf
nan = math.nan

__all__ = [
    "DEFAULT_MIN_QUERIES",
    "DEFAULT_SRM_CONCENTRATION",
    "DEFAULT_TAU2",
    "Estimate",
    "INTERLEAVING_TAU2",
    "MeanSums",
    "RatioSums",
    "Running",
    "Sequential",
    "mean_difference",
    "msprt",
    "preference",
    "ratio_difference",
    "srm_log_bayes_factor",
    "srm_p_value",
    "srm_update",
    "unit_variance",
    "update",
]

#: Mixture variance τ² of the normal prior N(0, τ²) on the true difference θ, for
#: per-query measures in [0, 1] (nDCG@k, P@k, AP, …), i.e. τ = 0.01 absolute.
#:
#: Why: Johari et al. advise matching the mixing distribution to the effects one
#: expects to see (Optimizely fits it to past experiments).  For a given
#: z = θ̂/√V, log Λ = −½ ln(1+r) + z² r / (2(1+r)) with r = τ²/V, which is largest at
#: r = z² − 1, i.e. τ² = θ̂² − V ≈ θ²: the test detects fastest the effects whose size
#: is about τ.  A one-point change in a [0, 1] quality measure (0.01, ≈3% of a
#: per-query sd of ≈0.3) is the smallest change a search team usually acts on; larger
#: regressions are still detected quickly because the dependence on τ is only
#: logarithmic.  Measured (bench/ab_validity.py, sd 0.35): for δ = −0.01 τ² = 1e-4 is
#: the fastest of 2.5e-5 … 2.5e-3 (median 0.95× the fixed-horizon 80%-power n); for
#: δ = −0.02 it takes 1.17× (τ² = 4e-4 would take 0.97×).  Type-I
#: error control holds for every τ² > 0; τ² only trades speed between effect sizes.
DEFAULT_TAU2: float = 1e-4

#: ``ab.min_queries``: no statistics before each arm has this many queries.
DEFAULT_MIN_QUERIES = 100

#: Concentration k of the Dirichlet prior α₀ = k·split of the SRM test (the
#: default of Lindon & Malek's reference implementation).
DEFAULT_SRM_CONCENTRATION: float = 100.0


class MeanSums(NamedTuple):
    """One arm, one per-query measure: count, Σx, Σx².

    Every query counts (x = 0 when the measure is undefined by convention, e.g. a
    query with no relevant document, as trec_eval does).
    """

    n: float
    sum_x: float
    sum_x2: float


class RatioSums(NamedTuple):
    """One arm, one ratio (micro) measure Σy/Σz: per-query numerator y, denominator z."""

    n: float
    sum_y: float
    sum_z: float
    sum_y2: float
    sum_z2: float
    sum_yz: float


class Estimate(NamedTuple):
    """A difference treatment − baseline with its variance."""

    delta: float  #: treatment − baseline (means, or ratios Σy/Σz)
    relative: float  #: delta / baseline value (nan when the baseline value is 0)
    variance: float  #: V, the (estimated) variance of delta


class Sequential(NamedTuple):
    """The mSPRT at one look (not yet combined with earlier looks)."""

    p_value: float  #: min(1, 1/Λ) at this look
    ci_lower: float  #: lower end of the confidence sequence at this look
    ci_upper: float  #: upper end


class Running(NamedTuple):
    """What persists between looks: running minimum p and intersection of the CS."""

    p_value: float = 1.0
    ci_lower: float = -inf
    ci_upper: float = inf


_NAN_ESTIMATE = Estimate(nan, nan, nan)
_NO_INFORMATION = Sequential(1.0, -inf, inf)


def _relative(delta: float, base: float) -> float:
    return delta / base if base != 0.0 and math.isfinite(base) else nan


def _sample_variance(n: float, s: float, s2: float) -> float:
    # (Σx² − (Σx)²/n)/(n − 1), clipped at 0 against rounding
    return max(0.0, (s2 - s * s / n) / (n - 1.0))


def mean_difference(treatment: MeanSums, baseline: MeanSums) -> Estimate:
    """Difference of means; its variance the larger of Welch's and the pooled one.

    delta = x̄_T − x̄_B, relative = delta / x̄_B, V = max(V_Welch, V_pooled) with
    V_Welch = s²_T/n_T + s²_B/n_B (Welch 1947; the standard error of
    ``scipy.stats.ttest_ind(equal_var=False)``), V_pooled = s²·(1/n_T + 1/n_B), s² of
    both arms taken as one sample (the null's: the module's conventions), and
    s² = (Σx² − (Σx)²/n)/(n − 1).

    Either arm with n < 2: all nan.  V may be 0 (constant data); see :func:`msprt`.
    """
    t, b = treatment, baseline
    if not (t.n >= 2 and b.n >= 2):
        return _NAN_ESTIMATE
    mean_t = t.sum_x / t.n
    mean_b = b.sum_x / b.n
    delta = mean_t - mean_b
    welch = _sample_variance(t.n, t.sum_x, t.sum_x2) / t.n + _sample_variance(b.n, b.sum_x, b.sum_x2) / b.n
    pooled = _sample_variance(t.n + b.n, t.sum_x + b.sum_x, t.sum_x2 + b.sum_x2) * (1.0 / t.n + 1.0 / b.n)
    return Estimate(delta, _relative(delta, mean_b), max(welch, pooled))


#: Mixture variance for the interleaving preference, a mean of per-query scores in
#: {−1, 0, +1}: τ = 0.05, effects the literature reports for rankers a team would
#: compare (Chapelle et al., TOIS 2012: preferences of a few to tens of percent).
INTERLEAVING_TAU2: float = 0.0025


def preference(wins_a: float, wins_b: float, ties: float) -> Estimate:
    """Team-draft interleaving preference Δ = (wins_A − wins_B) / (wins + ties), the mean
    of a per-query score s = +1 (A's team got more clicks), −1 (B's), 0 (a tie), with the
    variance of that mean, s² = (Σs² − nΔ²)/(n − 1) over n (Radlinski, Kurup & Joachims,
    CIKM 2008; Chapelle, Joachims, Radlinski & Yue, TOIS 2012). `relative` is nan.
    Fewer than 2 queries: all nan."""
    n = wins_a + wins_b + ties
    if n < 2:
        return _NAN_ESTIMATE
    delta = (wins_a - wins_b) / n
    variance = _sample_variance(n, wins_a - wins_b, wins_a + wins_b) / n
    return Estimate(delta, nan, variance)


def _ratio_and_variance(a: RatioSums) -> tuple[float, float]:
    """R = Σy/Σz and its delta-method variance (of R over a.n units).

    Var(R) ≈ (s²_y − 2R·s_yz + R²·s²_z) / (n·z̄²), with sample (co)variances
    (n − 1 divisor) and z̄ = Σz/n: the first-order Taylor expansion of ȳ/z̄
    (Deng, Knoblich, Lu, "Applying the delta method in metric analytics", KDD 2018).
    """
    n = a.n
    ratio = a.sum_y / a.sum_z
    s_yy = _sample_variance(n, a.sum_y, a.sum_y2)
    s_zz = _sample_variance(n, a.sum_z, a.sum_z2)
    s_yz = (a.sum_yz - a.sum_y * a.sum_z / n) / (n - 1.0)
    mean_z = a.sum_z / n
    var = (s_yy - 2.0 * ratio * s_yz + ratio * ratio * s_zz) / (n * mean_z * mean_z)
    return ratio, max(0.0, var)


def ratio_difference(treatment: RatioSums, baseline: RatioSums) -> Estimate:
    """Difference of ratio (micro) measures R = Σy/Σz, delta-method variance.

    delta = R_T − R_B, relative = delta / R_B, V = max(Var(R_T) + Var(R_B), V_pooled)
    with Var(R) ≈ (s²_y − 2R·s_yz + R²·s²_z) / (n·z̄²) per arm (independent arms) and
    V_pooled = n·Var(R_pooled)·(1/n_T + 1/n_B), the per-unit variance of both arms taken
    as one sample (the null's: the module's conventions).

    Either arm with n < 2 or Σz = 0: all nan.
    """
    t, b = treatment, baseline
    if not (t.n >= 2 and b.n >= 2) or t.sum_z == 0.0 or b.sum_z == 0.0:
        return _NAN_ESTIMATE
    r_t, v_t = _ratio_and_variance(t)
    r_b, v_b = _ratio_and_variance(b)
    both = RatioSums(*(x + y for x, y in zip(t, b)))
    pooled = both.n * _ratio_and_variance(both)[1] * (1.0 / t.n + 1.0 / b.n)
    delta = r_t - r_b
    return Estimate(delta, _relative(delta, r_b), max(v_t + v_b, pooled))


def unit_variance(treatment: MeanSums | RatioSums, baseline: MeanSums | RatioSums) -> float:
    """The variance of one unit's value, both arms taken as one sample (the null's):
    s² for a mean, n·Var(R) of the pooled ratio for a ratio (its linearisation,
    (y − R·z)/z̄). It scales the mixture τ² to each metric (`ab.mixture_scale`). nan
    with fewer than 2 units or Σz = 0."""
    n = treatment.n + baseline.n
    if n < 2:
        return nan
    if isinstance(treatment, MeanSums):
        return _sample_variance(n, treatment.sum_x + baseline.sum_x, treatment.sum_x2 + baseline.sum_x2)
    both = RatioSums(*(x + y for x, y in zip(treatment, baseline)))
    return n * _ratio_and_variance(both)[1] if both.sum_z != 0.0 else nan


def _log_lambda(theta: float, v: float, tau2: float) -> float:
    # ln Λ = ½·ln(V/(V+τ²)) + τ²θ̂²/(2V(V+τ²)), kept in log space (no exp overflow)
    return -0.5 * math.log1p(tau2 / v) + tau2 * theta * theta / (2.0 * v * (v + tau2))


def msprt(estimate: Estimate, tau2: float = DEFAULT_TAU2, alpha: float = 0.05) -> Sequential:
    """Normal-mixture mSPRT for H0: θ = 0 at one look (Johari, Pekelis & Walsh 2017).

    With θ̂ = ``estimate.delta``, V = ``estimate.variance`` and the mixing
    distribution θ ~ N(0, τ²):

        Λ = ∫ N(θ̂; θ, V) / N(θ̂; 0, V) · N(θ; 0, τ²) dθ
          = √(V/(V+τ²)) · exp(τ²θ̂² / (2V(V+τ²)))

    p = min(1, 1/Λ), computed as exp(−ln Λ).  Inverting the test of θ = θ₀ (Λ with
    θ̂ − θ₀) at level α gives the confidence sequence

        θ̂ ± √( V(V+τ²)/τ² · (2 ln(1/α) + ln((V+τ²)/V)) ).

    Both are valid at every look only once combined over looks with :func:`update`
    (running minimum p, running intersection of the intervals).

    V ≤ 0 or any nan/inf input: no information, p = 1 and (−∞, +∞).
    """
    theta, v = estimate.delta, estimate.variance
    if not (math.isfinite(theta) and math.isfinite(v) and v > 0.0):
        return _NO_INFORMATION
    if not (tau2 > 0.0 and 0.0 < alpha < 1.0):
        raise ValueError(f"need tau2 > 0 and 0 < alpha < 1, got tau2={tau2!r}, alpha={alpha!r}")
    log_lam = _log_lambda(theta, v, tau2)
    p = math.exp(-log_lam) if log_lam > 0.0 else 1.0
    radius = math.sqrt(v * (v + tau2) / tau2 * (2.0 * math.log(1.0 / alpha) + math.log1p(tau2 / v)))
    return Sequential(p, theta - radius, theta + radius)


def update(running: Running, look: Sequential) -> Running:
    """Combine a new look with the persisted state: min of p, intersection of the CS.

    ``Running()`` is the state before the first look.  nan values in ``look`` are
    ignored.  The intersection can become empty (lower > upper); under H0 and the
    model this happens with probability ≤ α, and it is returned as is, for the
    caller to report (it is evidence that θ moved, or that the model is wrong).
    """
    p = running.p_value if not look.p_value < running.p_value else look.p_value
    lo = running.ci_lower if not look.ci_lower > running.ci_lower else look.ci_lower
    hi = running.ci_upper if not look.ci_upper < running.ci_upper else look.ci_upper
    return Running(p, lo, hi)


def _log_multivariate_beta(a: Sequence[float]) -> float:
    return sum(math.lgamma(x) for x in a) - math.lgamma(sum(a))


def srm_log_bayes_factor(
    counts: Sequence[float], split: Sequence[float], concentration: float = DEFAULT_SRM_CONCENTRATION
) -> float:
    """ln BF of "any split" against the configured split (Lindon & Malek 2020).

    The arms' counts x are multinomial with probabilities θ.  H0: θ = θ₀ (``split``,
    normalised to sum 1); the alternative mixes over θ ~ Dirichlet(α₀) with
    α₀ = k·θ₀ (k = ``concentration``).  The Bayes factor is the ratio of the
    Dirichlet-multinomial to the multinomial likelihood (the multinomial coefficient
    cancels):

        BF = B(α₀ + x) / B(α₀) / Π θ₀ᵢ^xᵢ,   B(a) = Π Γ(aᵢ) / Γ(Σ aᵢ)

    computed with lgamma.  BF is a nonnegative martingale under H0 with mean 1, so by
    Ville's inequality P(sup BF ≥ 1/α) ≤ α.  Arms with split 0 and count 0 are ignored;
    a count on an arm whose split is 0 gives +inf.
    """
    if len(counts) != len(split):
        raise ValueError("counts and split must have the same length")
    if concentration <= 0.0:
        raise ValueError("concentration must be > 0")
    if any(c < 0 for c in counts) or any(s < 0 for s in split):
        raise ValueError("counts and split must be nonnegative")
    total = float(sum(split))
    if not total > 0.0:
        raise ValueError("split must have a positive sum")
    xs: list[float] = []
    thetas: list[float] = []
    for c, s in zip(counts, split):
        if s == 0.0:
            if c > 0:
                return inf
            continue
        xs.append(float(c))
        thetas.append(s / total)
    if sum(xs) == 0.0 or len(xs) < 2:
        return 0.0
    prior = [concentration * t for t in thetas]
    log_null = sum(x * math.log(t) for x, t in zip(xs, thetas))
    return (
        _log_multivariate_beta([a + x for a, x in zip(prior, xs)])
        - _log_multivariate_beta(prior)
        - log_null
    )


def srm_p_value(
    counts: Sequence[float], split: Sequence[float], concentration: float = DEFAULT_SRM_CONCENTRATION
) -> float:
    """Sample-ratio-mismatch p-value at this look: min(1, 1/BF), BF as in
    :func:`srm_log_bayes_factor` (Lindon & Malek's sequential multinomial test).

    Anytime-valid only as the running minimum over looks: keep it with
    :func:`srm_update`.  No counts yet: 1.
    """
    log_bf = srm_log_bayes_factor(counts, split, concentration)
    return math.exp(-log_bf) if log_bf > 0.0 else 1.0


def srm_update(previous_p: float, p: float) -> float:
    """Running minimum of the SRM p-value (start with ``previous_p = 1.0``); nan ignored."""
    return p if p < previous_p else previous_p
