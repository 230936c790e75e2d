"""One query's shown list and its known grades, kept as the rows the measures read.

Grades arrive one at a time in the live service (a click, then a purchase, then a
judgment). `QueryState.set_grade` patches the state in place: one cell of the row,
the counters, and one insertion into the sorted ideal grades. Nothing is rebuilt, and
the result is exactly the state `QueryState.from_grades` builds from scratch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence


def first_occurrences(ranking: Iterable[str]) -> list[str]:
    """The ranking with repeated document ids dropped, keeping each one's first rank."""
    return list(dict.fromkeys(ranking))


class QueryState:
    """A ranked list of document ids and every known grade for the query.

    `relevance_level` is trec_eval's `-l`: a grade at or above it is relevant.
    `shown_grade` is the grade a shown document has before any signal: ``None`` leaves
    it unjudged (trec_eval's view of a run), ``0`` makes it judged non-relevant (the
    live service's view: a result that was shown and not acted on).
    """

    __slots__ = ("ranking", "rank_of", "relevance_level", "grades", "row_grades",
                 "row_judged", "ideal_ascending", "num_rel", "num_nonrel")

    def __init__(self, ranking: Sequence[str], relevance_level: float = 1,
                 shown_grade: float | None = None) -> None:
        self.ranking: list[str] = first_occurrences(ranking)
        self.rank_of: dict[str, int] = dict(zip(self.ranking, range(len(self.ranking))))
        self.relevance_level = relevance_level
        self.grades: dict[str, float] = {}
        # Plain lists: patched in O(1) per grade, turned into arrays once per batch by stack().
        self.row_grades: list[float] = [0.0] * len(self.ranking)
        self.row_judged: list[bool] = [False] * len(self.ranking)
        # Positive grades only: they alone contribute to the ideal DCG.
        self.ideal_ascending: list[float] = []
        self.num_rel = 0
        self.num_nonrel = 0
        if shown_grade is not None:
            for doc in self.ranking:
                self.set_grade(doc, shown_grade)

    @classmethod
    def from_grades(cls, ranking: Sequence[str], grades: Mapping[str, float],
                    relevance_level: float = 1, shown_grade: float | None = None) -> QueryState:
        """Build the state in one go: the reference the incremental path must equal, and
        the fast path for a new query (one sort, no per-grade updates)."""
        state = cls.__new__(cls)
        rank_of = {doc: i for i, doc in enumerate(ranking)}
        if len(rank_of) != len(ranking):  # repeated ids: each keeps its first rank
            ranking = first_occurrences(ranking)
            rank_of = {doc: i for i, doc in enumerate(ranking)}
        state.ranking = list(ranking)
        state.rank_of = rank_of
        state.relevance_level = relevance_level
        # (fromkeys of a dict reuses its keys' hashes; zip/map build the pairs at C speed)
        known = dict.fromkeys(rank_of, float(shown_grade)) if shown_grade is not None else {}
        if grades:
            known.update(zip(grades, map(float, grades.values())))
        state.grades = known
        if shown_grade is not None:  # every shown document has a grade (the live service's case)
            # The shown documents are known's first keys, in rank order (update keeps a key's place).
            state.row_grades = list(known.values())[:len(rank_of)]
            state.row_judged = [True] * len(rank_of)
        else:
            row = list(map(known.get, ranking))
            state.row_judged = [g is not None for g in row]
            state.row_grades = [0.0 if g is None else g for g in row]
        values = sorted(known.values())
        state.num_rel = len(values) - bisect.bisect_left(values, relevance_level)
        # A negative grade is trec_eval's "in the pool, not judged": neither class.
        state.num_nonrel = len(values) - state.num_rel - bisect.bisect_left(values, 0.0)
        state.ideal_ascending = values[bisect.bisect_right(values, 0.0):]
        return state

    def set_grade(self, doc: str, grade: float) -> bool:
        """Record `doc`'s grade (replacing any earlier one); False when nothing changed."""
        grade = float(grade)
        old = self.grades.get(doc)
        if old == grade:
            return False
        if old is not None:
            self._count(old, -1)
        self._count(grade, +1)
        self.grades[doc] = grade
        i = self.rank_of.get(doc)
        if i is not None:
            self.row_grades[i] = grade
            self.row_judged[i] = True
        return True

    def _count(self, grade: float, sign: int) -> None:
        if grade >= self.relevance_level:
            self.num_rel += sign
        elif grade >= 0:  # a negative grade is "pooled, not judged" (trec_eval): neither class
            self.num_nonrel += sign
        if grade > 0:
            if sign > 0:
                bisect.insort(self.ideal_ascending, grade)
            else:
                del self.ideal_ascending[bisect.bisect_left(self.ideal_ascending, grade)]

    def __len__(self) -> int:
        return len(self.ranking)

    def __repr__(self) -> str:
        return f"QueryState(n={len(self.ranking)}, judged={len(self.grades)}, R={self.num_rel})"
