"""The cumulative sums behind an experiment's statistics, per arm (ranker and segment).

Unlike window buckets, these are kept since the experiment started, over every
impression of each arm: a query with nothing relevant contributes 0 (trec_eval's
convention), whatever `evaluation.empty_query_policy` says for the monitoring series,
so the population is not chosen by the outcome. Per measure, an arm's vector holds

    [n, Σx, Σx², Σy, Σz, Σy², Σz², Σy·z]

(x the per-query value, y and z its numerator and denominator: the delta method for
micro averages needs the last five), then the arm's query counts, all and judged. Like
window buckets they move by deltas when feedback changes a query, persist in the
partition's checkpoint and add up across partitions and replicas. Which measures a
vector holds, in order, is the experiment's definition (ab/identity.py), fixed when it
began: a release or configuration that computes other measures maps its columns onto it
(`columns`), and a measure the definition lacks is not in this experiment.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rankmeter.ab.stats import MeanSums, RatioSums
from rankmeter.windows import Layout

SLOTS = 8


def size(measures: int) -> int:
    return SLOTS * measures + 2


def columns(definition: list[str], layout: Layout) -> list[int | None]:
    """For each measure of the definition, its column in this configuration's layout
    (None: not computed here; its sums stay as they are)."""
    where = {i: c for c, i in enumerate(layout.ids)}
    return [where.get(i) for i in definition]


def contributions(columns: list[int | None], values: np.ndarray, nums: np.ndarray, dens: np.ndarray,
                  judged: np.ndarray, old: np.ndarray) -> np.ndarray:
    """[Q, size] vectors from per-query [Q, M] values, numerators and denominators (M
    the layout's columns), placed as the definition says; a measure the layout does not
    compute keeps each query's `old` contribution. A value that is undefined even by
    trec_eval's convention (AUC without both classes, the first click rank without a
    click) leaves the query out of that measure."""
    q, m = len(values), len(columns)
    placed = [k for k, c in enumerate(columns) if c is not None]
    source = [c for c in columns if c is not None]
    values, nums, dens = values[:, source], nums[:, source], dens[:, source]
    counted = ~np.isnan(values)
    x, y, z = (np.where(counted, a, 0.0) for a in (values, nums, dens))
    out = old.copy()
    sums = out[:, :SLOTS * m].reshape(q, m, SLOTS)
    for k, column in enumerate((counted, x, x * x, y, z, y * y, z * z, y * z)):
        sums[:, placed, k] = column
    out[:, -2] = 1.0
    out[:, -1] = judged
    return out


def bucket_sums(buckets: np.ndarray, column: int, average: str) -> tuple[np.ndarray, np.ndarray]:
    """Per user bucket of an arm ([B, size]), one measure's (y, n) for ab/clusters.py:
    Σ values and queries counted (macro), or Σ numerators and Σ denominators (micro)."""
    base = SLOTS * column
    y, n = (base + 1, base) if average == "macro" else (base + 3, base + 4)
    return buckets[:, y], buckets[:, n]


class Arm(NamedTuple):
    queries: float
    judged: float
    means: dict[str, MeanSums]    # measure -> macro sums
    ratios: dict[str, RatioSums]  # measure -> micro sums


def arm(vector: np.ndarray, names: list[str | None]) -> Arm:
    """The arm's sums by measure name; `names` per slot of the definition (None: a
    measure this configuration does not compute, left out)."""
    means, ratios = {}, {}
    for c, name in enumerate(names):
        if name is None:
            continue
        n, sx, sx2, sy, sz, sy2, sz2, syz = vector[SLOTS * c:SLOTS * (c + 1)].tolist()
        means[name] = MeanSums(n, sx, sx2)
        ratios[name] = RatioSums(n, sy, sz, sy2, sz2, syz)
    return Arm(float(vector[-2]), float(vector[-1]), means, ratios)
