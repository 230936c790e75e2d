"""The cumulative sums behind an experiment's statistics, per arm (ranker and segment).

Unlike window buckets, these are kept since the experiment started, over every
impression of each arm: a query with nothing relevant contributes 0 (trec_eval's
convention), whatever `evaluation.empty_query_policy` says for the monitoring series,
so the population is not chosen by the outcome. Per measure, an arm's vector holds

    [n, Σx, Σx², Σy, Σz, Σy², Σz², Σy·z]

(x the per-query value, y and z its numerator and denominator: the delta method for
micro averages needs the last five), then the arm's query counts, all and judged. Like
window buckets they move by deltas when feedback changes a query, persist in the
partition's checkpoint and add up across partitions and replicas. An experiment is tied
to the layout of its measures: a configuration change starts a new one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rankmeter.ab.stats import MeanSums, RatioSums
from rankmeter.windows import Layout

SLOTS = 8


def size(layout: Layout) -> int:
    return SLOTS * len(layout.ids) + 2


def contributions(layout: Layout, values: np.ndarray, nums: np.ndarray, dens: np.ndarray,
                  judged: np.ndarray) -> np.ndarray:
    """[Q, size] vectors from per-query [Q, M] values, numerators and denominators. A value
    that is undefined even by trec_eval's convention (AUC without both classes, the first
    click rank without a click) leaves the query out of that measure."""
    q, m = values.shape
    counted = ~np.isnan(values)
    x, y, z = (np.where(counted, a, 0.0) for a in (values, nums, dens))
    out = np.zeros((q, size(layout)))
    sums = out[:, :SLOTS * m].reshape(q, m, SLOTS)
    for k, column in enumerate((counted, x, x * x, y, z, y * y, z * z, y * z)):
        sums[:, :, k] = column
    out[:, -2] = 1.0
    out[:, -1] = judged
    return out


class Arm(NamedTuple):
    queries: float
    judged: float
    means: dict[str, MeanSums]    # measure -> macro sums
    ratios: dict[str, RatioSums]  # measure -> micro sums


def arm(vector: np.ndarray, layout: Layout) -> Arm:
    means, ratios = {}, {}
    for c, name in enumerate(layout.names):
        n, sx, sx2, sy, sz, sy2, sz2, syz = vector[SLOTS * c:SLOTS * (c + 1)].tolist()
        means[name] = MeanSums(n, sx, sx2)
        ratios[name] = RatioSums(n, sy, sz, sy2, sz2, syz)
    return Arm(float(vector[-2]), float(vector[-1]), means, ratios)
