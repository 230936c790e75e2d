"""Many queries' states stacked into padded arrays, so each measure is a few numpy ops.

Row q, column i describes the document at rank i+1 of query q. Columns past a query's
list length are padding: grade 0, not judged, not relevant. The live service stacks the
queries a poll batch touched; `rankmeter eval` stacks every query of a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from rankmeter.engine.query import QueryState


class Batch(NamedTuple):
    grades: np.ndarray      # [Q, N] float: grade at each rank (0 where unjudged or padding)
    judged: np.ndarray      # [Q, N] bool: the document at that rank has a known grade
    rel: np.ndarray         # [Q, N] bool: judged and grade >= the relevance level
    length: np.ndarray      # [Q] int: number of documents shown
    ideal: np.ndarray       # [Q, M] float: every known positive grade, descending, 0-padded
    num_rel: np.ndarray     # [Q] int: R, relevant documents known (shown or not)
    num_nonrel: np.ndarray  # [Q] int: judged non-relevant documents known (shown or not)

    @property
    def size(self) -> int:
        return len(self.length)

    @property
    def width(self) -> int:
        return self.grades.shape[1]


def stack(states: Sequence[QueryState]) -> Batch:
    """Stack query states into one Batch (rows in the order given)."""
    q = len(states)
    # At least one column, so every reduction has something to reduce.
    width = max((len(s.ranking) for s in states), default=1) or 1
    ideal_width = max((len(s.ideal_ascending) for s in states), default=1) or 1
    grades = np.zeros((q, width))
    judged = np.zeros((q, width), dtype=bool)
    ideal = np.zeros((q, ideal_width))
    length = np.empty(q, dtype=np.int64)
    num_rel = np.empty(q, dtype=np.int64)
    num_nonrel = np.empty(q, dtype=np.int64)
    level = np.empty((q, 1))
    for row, s in enumerate(states):
        n = len(s.ranking)
        grades[row, :n] = s.row_grades
        judged[row, :n] = s.row_judged
        m = len(s.ideal_ascending)
        ideal[row, :m] = s.ideal_ascending[::-1]
        length[row] = n
        num_rel[row] = s.num_rel
        num_nonrel[row] = s.num_nonrel
        level[row] = s.relevance_level
    rel = judged & (grades >= level)
    return Batch(grades, judged, rel, length, ideal, num_rel, num_nonrel)
