"""Position-bias correction: examination propensities estimated from the stream
(`propensity.py`: intervention harvesting and AllPairs, Agarwal et al., WSDM 2019) and
inverse-propensity-weighted click grades for the metric engine (`ipw.py`, Joachims et al.,
WSDM 2017)."""

from rankmeter.debias.ipw import DEFAULT_MAX_WEIGHT, grades, weights
from rankmeter.debias.propensity import (
    DEFAULT_CAPACITY,
    DEFAULT_MIN_PAIRS,
    DEFAULT_RANKS,
    Harvester,
    PairSums,
    Propensities,
    contribution,
    estimate,
    merge,
)

__all__ = ["DEFAULT_CAPACITY", "DEFAULT_MAX_WEIGHT", "DEFAULT_MIN_PAIRS", "DEFAULT_RANKS", "Harvester",
           "PairSums", "Propensities", "contribution", "estimate", "grades", "merge", "weights"]
