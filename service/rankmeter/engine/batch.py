"""Many queries' states stacked into padded arrays, so each measure is a few numpy ops.

Row q, column i describes the document at rank i+1 of query q. Columns past a query's
list length are padding: grade 0, not judged, not relevant. The live service stacks the
queries a poll batch touched (`stack`); `rankmeter eval` stacks every query of a run
(`stack_scored`, straight from the run's scores and the qrels' grades).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain, count, repeat
from operator import attrgetter
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
    num_nonrel: np.ndarray  # [Q] int: judged non-relevant documents known (grade >= 0, shown or not)
    # A negative grade (trec_eval's -1 / "pooled, not judged") is judged here but in
    # neither class: `judged_nonrel` below, bpref, infAP and unj tell it apart.

    @property
    def size(self) -> int:
        return len(self.length)

    @property
    def width(self) -> int:
        return self.grades.shape[1]

    @property
    def judged_nonrel(self) -> np.ndarray:
        """[Q, N] bool: judged with a grade >= 0 and below the relevance level."""
        return self.judged & ~self.rel & (self.grades >= 0)

    @property
    def shown(self) -> np.ndarray:
        """[Q, N] bool: the cell holds a shown document (not padding)."""
        return np.arange(self.width) < self.length[:, None]


# stack's per-query reads, by map: at C speed, no generator frames
_RANKING, _ROW_GRADES, _ROW_JUDGED = attrgetter("ranking"), attrgetter("row_grades"), attrgetter("row_judged")
_IDEAL, _NUM_REL, _NUM_NONREL = attrgetter("ideal_ascending"), attrgetter("num_rel"), attrgetter("num_nonrel")
_LEVEL = attrgetter("relevance_level")


def stack(states: Sequence[QueryState]) -> Batch:
    """Stack query states into one Batch (rows in the order given)."""
    q = len(states)
    ideals = list(map(_IDEAL, states))
    length = np.fromiter(map(len, map(_RANKING, states)), dtype=np.int64, count=q)
    ideal_length = np.fromiter(map(len, ideals), dtype=np.int64, count=q)
    # At least one column, so every reduction has something to reduce.
    width = int(length.max(initial=0)) or 1
    ideal_width = int(ideal_length.max(initial=0)) or 1
    n = int(length.sum())
    # Rows are concatenated once and dropped into the padded matrix through a mask:
    # row-major order of the mask's True cells is the concatenation order.
    cells = np.arange(width) < length[:, None]
    grades = np.zeros((q, width))
    grades[cells] = np.fromiter(chain.from_iterable(map(_ROW_GRADES, states)), float, n)
    judged = np.zeros((q, width), dtype=bool)
    judged[cells] = np.fromiter(chain.from_iterable(map(_ROW_JUDGED, states)), bool, n)
    ideal = np.zeros((q, ideal_width))
    ideal[np.arange(ideal_width) < ideal_length[:, None]] = np.fromiter(
        chain.from_iterable(map(reversed, ideals)), float, int(ideal_length.sum()))
    num_rel = np.fromiter(map(_NUM_REL, states), dtype=np.int64, count=q)
    num_nonrel = np.fromiter(map(_NUM_NONREL, states), dtype=np.int64, count=q)
    level = np.fromiter(map(_LEVEL, states), dtype=float, count=q)
    rel = judged & (grades >= level[:, None])
    rel.flags.writeable = False  # measures may share work on it (measures._precision_at_ranks)
    return Batch(grades, judged, rel, length, ideal, num_rel, num_nonrel)


def stack_scored(scores: Sequence[Mapping[str, float]], grades: Sequence[Mapping[str, float]],
                 relevance_level: float = 1) -> Batch:
    """The Batch that `stack` makes of `QueryState.from_grades(rank(s), g, relevance_level)`
    for each query (s: the run's {doc: score}, g: the qrels' {doc: grade}; unjudged shown
    documents stay unjudged, as in trec_eval), built column-wise: no per-query objects and
    no per-query sort. This is `rankmeter eval`'s path; `stack` is the live service's.

    Each row is ordered as `trec.rank` orders a run: score descending, ties by document id
    descending (code point order, which is Python's string order)."""
    q = len(scores)
    length = np.fromiter(map(len, scores), np.int64, q)
    n = int(length.sum())
    width = int(length.max(initial=0)) or 1
    cells = np.arange(width) < length[:, None]
    order_of = dict(zip(sorted(set(chain.from_iterable(scores))), count()))
    # Each shown document's score, its place in document id order, and its grade, NaN when
    # it is not judged (grades are finite), in the run's order.
    score, doc, grade = _cells(scores, grades, order_of, n)
    # Padding sorts last: its negated score is +inf; a document scored -inf ties with it and
    # stays ahead because lexsort is stable and a row's documents come before its padding.
    neg_score = np.full((q, width), np.inf)
    neg_score[cells] = score
    np.negative(neg_score, out=neg_score, where=cells)
    neg_doc = np.zeros((q, width), np.int64)
    neg_doc[cells] = doc
    np.negative(neg_doc, out=neg_doc)
    by_rank = np.lexsort((neg_doc, neg_score), axis=-1)
    shown = np.full((q, width), np.nan)
    shown[cells] = grade
    shown = np.take_along_axis(shown, by_rank, axis=1)
    judged = ~np.isnan(shown)
    graded = np.where(judged, shown, 0.0)
    # Every known grade of the query counts for R and the ideal DCG, shown or not.
    known_length = np.fromiter(map(len, grades), np.int64, q)
    known = np.fromiter(chain.from_iterable(g.values() for g in grades), float, int(known_length.sum()))
    known_row = np.repeat(np.arange(q), known_length)
    num_rel = np.bincount(known_row[known >= relevance_level], minlength=q)
    positive = known > 0
    ideal_length = np.bincount(known_row[positive], minlength=q)
    ideal_width = int(ideal_length.max(initial=0)) or 1
    ideal = np.zeros((q, ideal_width))
    ideal_row, ideal_grade = known_row[positive], known[positive]
    ideal[np.arange(ideal_width) < ideal_length[:, None]] = ideal_grade[np.lexsort((-ideal_grade, ideal_row))]
    rel = judged & (graded >= relevance_level)
    rel.flags.writeable = False  # measures may share work on it (measures._precision_at_ranks)
    num_pooled = np.bincount(known_row[known < 0], minlength=q)
    return Batch(graded, judged, rel, length, ideal, num_rel, known_length - num_rel - num_pooled)


def _cells(scores: Sequence[Mapping[str, float]], grades: Sequence[Mapping[str, float]],
           order_of: dict[str, int], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`stack_scored`'s per-document pass: by _treader.c's `cells` when it is built (a
    million dictionary look-ups, ~10x faster), else, or for mappings other than dicts, here."""
    score, doc, grade = np.empty(n), np.empty(n, np.int64), np.empty(n)
    try:
        from rankmeter._treader import cells
    except ImportError:
        cells = None
    if cells is not None and cells(list(scores), list(grades), order_of, score, doc, grade):
        return score, doc, grade
    score[:] = np.fromiter(chain.from_iterable(s.values() for s in scores), float, n)
    doc[:] = np.fromiter(map(order_of.__getitem__, chain.from_iterable(scores)), np.int64, n)
    grade[:] = np.fromiter(chain.from_iterable(map(g.get, s, repeat(np.nan)) for s, g in zip(scores, grades)), float, n)
    return score, doc, grade
