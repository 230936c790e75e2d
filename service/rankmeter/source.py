"""The event source port: poll a batch of records, seek, commit, assignment callbacks, and
produce (for the dead-letter topic). `kafka_source.KafkaSource` is the real one; `Bus`
here is the in-process bus of the embedded demo and of unit tests of the pipeline.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol


class Record(NamedTuple):
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] = []


# Called with partition numbers (the topics are co-partitioned): assignment returns the
# stored (topic, partition) -> offset to resume from.
OnAssign = Callable[[list[int]], dict[tuple[str, int], int]]
OnRevoke = Callable[[list[int]], None]


class Source(Protocol):
    def subscribe(self, topics: Sequence[str], on_assign: OnAssign, on_revoke: OnRevoke) -> None: ...
    def poll(self, timeout_ms: int, max_records: int) -> list[Record]: ...
    def commit(self, offsets: dict[tuple[str, int], int]) -> None: ...
    def produce(self, topic: str, key: bytes | None, value: bytes | None,
                headers: list[tuple[str, bytes]]) -> None: ...
    def lag(self) -> dict[tuple[str, int], int]: ...
    def close(self) -> None: ...


class Bus:
    """Topics in memory, partitioned by key like Kafka, one consumer holding every partition."""

    def __init__(self, partitions: int = 4) -> None:
        self.partitions = partitions
        self.logs: dict[str, list[list[Record]]] = {}
        self.positions: dict[tuple[str, int], int] = {}
        self.committed: dict[tuple[str, int], int] = {}
        self.topics: list[str] = []
        self._lock = threading.Lock()
        self._on_revoke: OnRevoke | None = None

    def send(self, topic: str, key: bytes | None, value: bytes | None,
             headers: list[tuple[str, bytes]] | None = None) -> None:
        with self._lock:
            log = self.logs.setdefault(topic, [[] for _ in range(self.partitions)])
            p = zlib.crc32(key) % self.partitions if key is not None else 0
            log[p].append(Record(topic, p, len(log[p]), key, value, headers or []))

    def subscribe(self, topics: Sequence[str], on_assign: OnAssign, on_revoke: OnRevoke) -> None:
        self.topics = list(topics)
        self._on_revoke = on_revoke
        resume = on_assign(list(range(self.partitions)))
        for t in self.topics:
            for p in range(self.partitions):
                self.positions[(t, p)] = resume.get((t, p), 0)

    def poll(self, timeout_ms: int, max_records: int) -> list[Record]:
        out: list[Record] = []
        with self._lock:
            for (t, p), position in self.positions.items():
                log = self.logs.get(t)
                if log is None:
                    continue
                taken = log[p][position:position + max_records - len(out)]
                out.extend(taken)
                self.positions[(t, p)] = position + len(taken)
                if len(out) >= max_records:
                    break
        if not out and timeout_ms:
            threading.Event().wait(min(timeout_ms, 50) / 1000)
        return out

    def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        self.committed.update(offsets)

    def produce(self, topic: str, key: bytes | None, value: bytes | None,
                headers: list[tuple[str, bytes]]) -> None:
        self.send(topic, key, value, headers)

    def lag(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return {(t, p): len(self.logs.get(t, [[]] * self.partitions)[p]) - pos
                    for (t, p), pos in self.positions.items()}

    def close(self) -> None:
        if self._on_revoke is not None:
            self._on_revoke(list(range(self.partitions)))
