"""Position-bias correction: examination propensities estimated from the stream
(`propensity.py`: intervention harvesting and AllPairs, Agarwal et al., WSDM 2019) and
inverse-propensity-weighted click grades for the metric engine (`ipw.py`, Joachims et al.,
WSDM 2017), and the pooled per-query-text ideal DCG a debiased nDCG divides by
(`Harvester.ideal_dcg`)."""

from rankmeter.debias.ipw import DEFAULT_MAX_WEIGHT, dcg, dcg_of, grades, weights
from rankmeter.debias.propensity import (
    DEFAULT_CAPACITY,
    DEFAULT_MIN_PAIRS,
    DEFAULT_MIN_SUPPORT,
    DEFAULT_RANKS,
    Harvester,
    PairSums,
    Propensities,
    contribution,
    estimate,
    merge,
)

__all__ = ["DEFAULT_CAPACITY", "DEFAULT_MAX_WEIGHT", "DEFAULT_MIN_PAIRS", "DEFAULT_MIN_SUPPORT", "DEFAULT_RANKS",
           "Harvester", "PairSums", "Propensities", "contribution", "dcg", "dcg_of", "estimate", "grades", "merge",
           "weights"]
