"""A/B experiment statistics (pure functions; see :mod:`rankmeter.ab.stats`)."""

from .stats import (
    DEFAULT_MIN_QUERIES,
    DEFAULT_SRM_CONCENTRATION,
    DEFAULT_TAU2,
    Estimate,
    MeanSums,
    RatioSums,
    Running,
    Sequential,
    mean_difference,
    msprt,
    ratio_difference,
    srm_log_bayes_factor,
    srm_p_value,
    srm_update,
    update,
)

__all__ = [
    "DEFAULT_MIN_QUERIES",
    "DEFAULT_SRM_CONCENTRATION",
    "DEFAULT_TAU2",
    "Estimate",
    "MeanSums",
    "RatioSums",
    "Running",
    "Sequential",
    "mean_difference",
    "msprt",
    "ratio_difference",
    "srm_log_bayes_factor",
    "srm_p_value",
    "srm_update",
    "update",
]
