"""Averages over many queries: macro (mean of per-query values) and micro (ratio of sums).

Brief §5: macro P = mean of per-query P; micro P = Σ relevant shown / Σ shown. Queries
whose value is undefined (NaN, e.g. AUC with one class empty) are left out of both.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rankmeter.engine.measures import Measure, Ratio


class Average(NamedTuple):
    """The sums an average is made of; additive, so windows and replicas combine exactly."""
    numerator: float
    denominator: float

    @property
    def value(self) -> float:
        return self.numerator / self.denominator if self.denominator else float("nan")


def macro(measure: Measure, ratio: Ratio) -> Average:
    """Mean of the per-query values: Σ value / number of queries with a defined value."""
    values = measure.values(ratio)
    defined = ~np.isnan(values)
    return Average(float(np.sum(values[defined])), float(np.count_nonzero(defined)))


def micro(measure: Measure, ratio: Ratio) -> Average:
    """Σ numerators / Σ denominators over the queries with a defined value."""
    defined = ~np.isnan(measure.values(ratio))
    return Average(float(np.sum(ratio.num[defined])), float(np.sum(ratio.den[defined])))
