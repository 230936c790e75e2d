"""The state store port: per-partition query records, window buckets and offsets.

Everything about partition p lives together (in Redis under one hash tag), and a poll
batch's changes are written with the partition's new offsets in one transaction, so a
crash keeps both or neither (brief §8). `MemoryStore` is the embedded implementation
for the demo and unit tests; `RedisStore` (redis_store.py) is the real one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple, Protocol


class PartitionWrite(NamedTuple):
    """One partition's changes from one batch; applied atomically."""
    partition: int
    offsets: dict[str, int]         # topic -> next offset to read
    records: dict[str, bytes]       # query id -> encoded QueryRecord
    deadlines: dict[str, int]       # query id -> when it closes (ms since epoch)
    deleted: list[str]              # query ids closed or orphaned
    buckets: dict[str, bytes]       # bucket field -> encoded sums
    dropped_buckets: list[str]      # buckets past every window


class PartitionSnapshot(NamedTuple):
    offsets: dict[str, int]
    buckets: dict[str, bytes]


class Store(Protocol):
    def load(self, partition: int) -> PartitionSnapshot: ...

    def read(self, wanted: Mapping[int, list[str]]) -> dict[int, list[bytes | None]]:
        """Query records of several partitions in one round trip (None where unknown)."""

    def write(self, writes: Iterable[PartitionWrite]) -> None:
        """Each partition's changes in one transaction."""

    def expired(self, partitions: Iterable[int], now_ms: int) -> dict[int, tuple[list[str], int]]:
        """Per partition: query ids whose deadline has passed, and how many are open."""

    def admit_label(self, kind: str, value: str, cap: int) -> bool:
        """Whether `value` may be its own label of `kind` (at most `cap` of them, ever)."""

    def close(self) -> None: ...


class MemoryStore:
    """The store in this process's memory: for the embedded demo and unit tests."""

    def __init__(self) -> None:
        self.offsets: dict[int, dict[str, int]] = {}
        self.records: dict[int, dict[str, bytes]] = {}
        self.deadlines: dict[int, dict[str, int]] = {}
        self.buckets: dict[int, dict[str, bytes]] = {}
        self.labels: dict[str, set[str]] = {}

    def load(self, partition: int) -> PartitionSnapshot:
        return PartitionSnapshot(dict(self.offsets.get(partition, {})),
                                 dict(self.buckets.get(partition, {})))

    def read(self, wanted: Mapping[int, list[str]]) -> dict[int, list[bytes | None]]:
        return {p: [self.records.get(p, {}).get(q) for q in qids] for p, qids in wanted.items()}

    def write(self, writes: Iterable[PartitionWrite]) -> None:
        for w in writes:
            p = w.partition
            self.offsets.setdefault(p, {}).update(w.offsets)
            self.records.setdefault(p, {}).update(w.records)
            self.deadlines.setdefault(p, {}).update(w.deadlines)
            for q in w.deleted:
                self.records[p].pop(q, None)
                self.deadlines[p].pop(q, None)
            self.buckets.setdefault(p, {}).update(w.buckets)
            for field in w.dropped_buckets:
                self.buckets[p].pop(field, None)

    def expired(self, partitions: Iterable[int], now_ms: int) -> dict[int, tuple[list[str], int]]:
        out = {}
        for p in partitions:
            deadlines = self.deadlines.get(p, {})
            out[p] = ([q for q, d in deadlines.items() if d <= now_ms], len(deadlines))
        return out

    def admit_label(self, kind: str, value: str, cap: int) -> bool:
        known = self.labels.setdefault(kind, set())
        if value in known or len(known) < cap:
            known.add(value)
            return True
        return False

    def close(self) -> None:
        pass
