"""Many queries' states stacked into padded arrays, so each measure is a few numpy ops.

Row q, column i describes the document at rank i+1 of query q. Columns past a query's
list length are padding: grade 0, not judged, not relevant. The live service stacks the
queries a poll batch touched; `rankmeter eval` stacks every query of a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
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
    length = np.fromiter((len(s.ranking) for s in states), dtype=np.int64, count=q)
    ideal_length = np.fromiter((len(s.ideal_ascending) for s in states), dtype=np.int64, count=q)
    # Rows are concatenated once and dropped into the padded matrix through a mask:
    # row-major order of the mask's True cells is the concatenation order.
    cells = np.arange(width) < length[:, None]
    grades = np.zeros((q, width))
    grades[cells] = np.fromiter(chain.from_iterable(s.row_grades for s in states), float, int(length.sum()))
    judged = np.zeros((q, width), dtype=bool)
    judged[cells] = np.fromiter(chain.from_iterable(s.row_judged for s in states), bool, int(length.sum()))
    ideal = np.zeros((q, ideal_width))
    ideal[np.arange(ideal_width) < ideal_length[:, None]] = np.fromiter(
        chain.from_iterable(reversed(s.ideal_ascending) for s in states), float, int(ideal_length.sum()))
    num_rel = np.fromiter((s.num_rel for s in states), dtype=np.int64, count=q)
    num_nonrel = np.fromiter((s.num_nonrel for s in states), dtype=np.int64, count=q)
    level = np.fromiter((s.relevance_level for s in states), dtype=float, count=q)
    rel = judged & (grades >= level[:, None])
    return Batch(grades, judged, rel, length, ideal, num_rel, num_nonrel)
