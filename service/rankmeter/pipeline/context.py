"""One batch's working state, which the stages read and fill in the order the facade
runs them (pipeline/__init__.py). Per partition throughout: a partition's checkpoint is
built from its entries alone."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from rankmeter.events import Feedback, Impression
from rankmeter.join import QueryRecord
from rankmeter.source import Record
from rankmeter.windows import BucketKey

Outcomes = Counter[tuple[str, str]]  # (stream, outcome) -> events


class Touched(NamedTuple):
    partition: int
    query_id: str


@dataclass(slots=True)
class Batch:
    now_ms: int                                  # event time's now (the pipeline's clock)
    caught_up: set[tuple[str, int]]              # (topic, partition)s read to their end
    # intake: the decoded events to apply, the next offsets read, the newest event times
    work: dict[int, list[tuple[Record, Impression | Feedback]]] = field(default_factory=dict)
    advanced: dict[int, dict[str, int]] = field(default_factory=dict)
    newest: dict[int, dict[str, int]] = field(default_factory=dict)
    # sweep: queries closed (their deadline passed), lists complete, clicks final
    expired: dict[int, list[str]] = field(default_factory=dict)
    due: dict[int, list[str]] = field(default_factory=dict)
    harvest: dict[int, list[str]] = field(default_factory=dict)
    # joining: the records written this batch, and per query with a list the documents whose
    # grade may have changed (None: evaluate from scratch)
    touched: dict[Touched, QueryRecord] = field(default_factory=dict)
    changed: dict[Touched, set[str] | None] = field(default_factory=dict)
    # scoring: the window buckets moved
    dirty_buckets: dict[int, set[BucketKey]] = field(default_factory=dict)
    # The events' outcomes, counted once the partition's checkpoint is stored.
    counts: dict[int, Outcomes] = field(default_factory=dict)

    def count(self, partition: int) -> Outcomes:
        counts = self.counts.get(partition)
        if counts is None:
            counts = self.counts[partition] = Counter()
        return counts

    def swept(self) -> dict[int, list[str]]:
        """The swept queries whose records the batch needs: to count orphans, settle lists, harvest."""
        return {p: self.expired.get(p, []) + self.due.get(p, []) + self.harvest.get(p, [])
                for p in {*self.expired, *self.due, *self.harvest}}
