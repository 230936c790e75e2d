"""A/B experiment statistics (pure functions; see :mod:`rankmeter.ab.stats`)."""

from rankmeter.ab.stats import *  # noqa: F403 (the statistics are this package's interface)
from rankmeter.ab.stats import __all__  # noqa: F401
