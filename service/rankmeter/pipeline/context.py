"""One batch's working state, which the stages read and fill in the order the facade
runs them (pipeline/__init__.py). Per partition throughout: a partition's checkpoint is
built from its entries alone."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from rankmeter.events import Feedback, Impression
from rankmeter.join import QueryRecord
from rankmeter.source import Record
from rankmeter.windows import BucketKey

if TYPE_CHECKING:
    from rankmeter.pipeline.state import PartitionState

Outcomes = Counter[tuple[str, str]]  # (stream, outcome) -> events


class Touched(NamedTuple):
    partition: int
    query_id: str


@dataclass(slots=True)
class Batch:
    now_ms: int                                  # event time's now (the pipeline's clock)
    caught_up: set[tuple[str, int]]              # (topic, partition)s read to their end
    # intake: the partitions held when it was read, the decoded events to apply, the next
    # offsets read, the newest event times, the invalid records (sent to the dead-letter
    # topic when the batch is applied, not when read: the previous checkpoint may yet fail)
    read_from: dict[int, PartitionState] = field(default_factory=dict)
    work: dict[int, list[tuple[Record, Impression | Feedback]]] = field(default_factory=dict)
    advanced: dict[int, dict[str, int]] = field(default_factory=dict)
    newest: dict[int, dict[str, int]] = field(default_factory=dict)
    dead: list[tuple[Record, str]] = field(default_factory=list)
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

    def drop_changed(self, held: dict[int, PartitionState]) -> None:
        """Forget what was read for partitions dropped or claimed again since (the previous
        checkpoint, outstanding while this batch was read, was refused for them, or a
        rebalance): the source reads them again from their stored offsets."""
        changed = {p for p, ps in self.read_from.items() if held.get(p) is not ps}
        for per_partition in (self.work, self.advanced, self.newest, self.counts):
            for p in changed:
                per_partition.pop(p, None)
        if changed:
            self.dead = [(r, reason) for r, reason in self.dead if r.partition not in changed]

    def swept(self) -> dict[int, list[str]]:
        """The swept queries whose records the batch needs: to count orphans, settle lists, harvest."""
        return {p: self.expired.get(p, []) + self.due.get(p, []) + self.harvest.get(p, [])
                for p in {*self.expired, *self.due, *self.harvest}}
