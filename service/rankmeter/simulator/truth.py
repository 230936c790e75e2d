"""The true metrics of the traffic, from the hidden grades: what a measured nDCG is
compared with."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rankmeter.engine import QueryState, evaluate, parse_all, stack

TRUTH_MEASURES = ["nDCG@10", "P@10", "AP"]


class TruthTally:
    """Running means of the true metrics (from hidden grades) per ranker."""

    def __init__(self) -> None:
        self.measures = parse_all(TRUTH_MEASURES)
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}

    def values(self, state: QueryState) -> np.ndarray | None:
        """The true TRUTH_MEASURES of one query; None without a relevant document (the live
        service's default leaves such queries out of the quality averages, too)."""
        if state.num_rel == 0:
            return None
        ratios = evaluate(self.measures, stack([state]))
        return np.array([m.values(r)[0] for m, r in ratios.items()])

    def add(self, ranker: str, state: QueryState) -> None:
        self.add_values(ranker, self.values(state))

    def add_values(self, ranker: str, values: np.ndarray | None) -> None:
        if values is None:
            return
        self.sums[ranker] = self.sums.get(ranker, 0) + values
        self.counts[ranker] = self.counts.get(ranker, 0) + 1

    def means(self) -> dict[str, dict[str, float]]:
        return {r: dict(zip(TRUTH_MEASURES, (self.sums[r] / self.counts[r]).tolist())) for r in self.sums}


class TruthPoint(NamedTuple):
    timestamp_ms: int
    ranker: str
    values: np.ndarray  # TRUTH_MEASURES of the query, from the hidden grades
