"""The event source port: poll a batch of records, seek, commit, assignment callbacks, and
produce (for the dead-letter topic). `rankmeter.kafka` holds the real ones; `Bus`
here is the in-process bus of the embedded demo and of unit tests of the pipeline.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from rankmeter.dead_letters import fit


class Record(NamedTuple):
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] = []
    timestamp: int = -1  # the Kafka record timestamp (ms), as kafka-python's ConsumerRecord names it


NO_HEADERS: list[tuple[str, bytes]] = []  # a record's no headers: shared, never changed (as Record's own default)


# Called with partition numbers (the topics are co-partitioned): assignment returns the
# stored (topic, partition) -> offset to resume from; a partition it leaves out is paused
# (the pipeline refused it: its stored state is lost).
OnAssign = Callable[[list[int]], dict[tuple[str, int], int]]
OnRevoke = Callable[[list[int]], None]


class SourceUnavailable(Exception):
    """The broker cannot take a message now (the producer's buffer is full, or the topic's
    metadata cannot be had): the caller waits and tries again."""


class Source(Protocol):
    def subscribe(self, topics: Sequence[str], on_assign: OnAssign, on_revoke: OnRevoke) -> None: ...
    def poll(self, timeout_ms: int, max_records: int) -> list[Record]: ...
    def commit(self, offsets: dict[tuple[str, int], int]) -> None: ...
    def committed(self, partitions: list[int]) -> dict[tuple[str, int], int]:
        """Offsets committed to the broker for these partitions of the subscribed topics."""
    def assigned(self) -> list[int]: ...
    def bounds(self, partitions: list[int]) -> dict[tuple[str, int], tuple[int, int]]:
        """(log start, log end) of these partitions of the subscribed topics (pipeline/offsets.py)."""
    def seek(self, offsets: dict[tuple[str, int], int]) -> None:
        """Resume from these offsets; assigned partitions not named are paused."""
    def pause(self, partitions: list[int]) -> None:
        """Stop reading these partitions of both topics (their state is lost)."""
    def rejoin(self) -> None:
        """Leave the group and join again (after being fenced): a fresh assignment."""
    def produce(self, topic: str, key: bytes | None, value: bytes | None,
                headers: list[tuple[str, bytes]]) -> None:
        """Raises SourceUnavailable when the message cannot be taken now."""
    def delivered(self, timeout_s: float) -> bool:
        """Whether every message produced is acknowledged, waiting up to `timeout_s` (and
        sending again those refused): a batch's dead letters are, before its checkpoint."""
    def problem(self) -> str:
        """Why the broker is out of reach (for /readyz), or "" while it answers."""
    def lag(self) -> dict[tuple[str, int], int]: ...
    def close(self) -> None: ...


class Bus:
    """Topics in memory, partitioned by key like Kafka, one consumer holding every partition."""

    def __init__(self, partitions: int = 4, max_message_bytes: int | None = None) -> None:
        self.partitions = partitions
        self.max_message_bytes = max_message_bytes  # dead letters over it are cut, as for Kafka
        self.logs: dict[str, list[list[Record]]] = {}
        self.positions: dict[tuple[str, int], int] = {}
        self.committed_offsets: dict[tuple[str, int], int] = {}
        self.starts: dict[tuple[str, int], int] = {}  # log start where records were deleted
        self.topics: list[str] = []
        self._lock = threading.Lock()
        self._on_assign: OnAssign = lambda partitions: {}
        self._on_revoke: OnRevoke | None = None

    def send(self, topic: str, key: bytes | None, value: bytes | None,
             headers: list[tuple[str, bytes]] | None = None, timestamp_ms: int | None = None) -> None:
        with self._lock:
            log = self.logs.setdefault(topic, [[] for _ in range(self.partitions)])
            p = zlib.crc32(key) % self.partitions if key is not None else 0
            ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
            log[p].append(Record(topic, p, len(log[p]), key, value, headers or [], ts))

    def subscribe(self, topics: Sequence[str], on_assign: OnAssign, on_revoke: OnRevoke) -> None:
        self.topics = list(topics)
        self._on_assign, self._on_revoke = on_assign, on_revoke
        self.seek(on_assign(self.assigned()))

    def assigned(self) -> list[int]:
        return list(range(self.partitions))

    def seek(self, offsets: dict[tuple[str, int], int]) -> None:
        with self._lock:
            self.positions = {(t, p): offsets[(t, p)] for t in self.topics for p in range(self.partitions)
                              if (t, p) in offsets}

    def committed(self, partitions: list[int]) -> dict[tuple[str, int], int]:
        return {(t, p): o for (t, p), o in self.committed_offsets.items() if p in partitions}

    def bounds(self, partitions: list[int]) -> dict[tuple[str, int], tuple[int, int]]:
        # A log from offset `start` on; `truncate` moves it (as Kafka's delete_records).
        with self._lock:
            return {(t, p): (self.starts.get((t, p), 0), len(self.logs.get(t, [[]] * self.partitions)[p]))
                    for t in self.topics for p in partitions}

    def recreate(self, topic: str) -> None:
        """The topic deleted and created again: empty, from offset 0."""
        with self._lock:
            self.logs[topic] = [[] for _ in range(self.partitions)]
            for key in [k for k in self.starts if k[0] == topic]:
                del self.starts[key]

    def truncate(self, topic: str, partition: int, before: int) -> None:
        """Records below `before` deleted (their offsets are kept, as in Kafka's log)."""
        with self._lock:
            self.starts[(topic, partition)] = before

    def pause(self, partitions: list[int]) -> None:
        with self._lock:
            for key in [k for k in self.positions if k[1] in partitions]:
                del self.positions[key]

    def rejoin(self) -> None:
        if self._on_revoke is not None:
            self._on_revoke(self.assigned())
        self.seek(self._on_assign(self.assigned()))

    def poll(self, timeout_ms: int, max_records: int) -> list[Record]:
        out: list[Record] = []
        with self._lock:
            for (t, p), position in self.positions.items():
                log = self.logs.get(t)
                if log is None:
                    continue
                # Outside the log (truncate, recreate): reset to its start, as Kafka's
                # auto.offset.reset earliest.
                start = self.starts.get((t, p), 0)
                if not start <= position <= len(log[p]):
                    position = start
                taken = log[p][position:position + max_records - len(out)]
                out.extend(taken)
                self.positions[(t, p)] = position + len(taken)
                if len(out) >= max_records:
                    break
        if not out and timeout_ms:
            threading.Event().wait(min(timeout_ms, 50) / 1000)
        return out

    def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        self.committed_offsets.update(offsets)

    def produce(self, topic: str, key: bytes | None, value: bytes | None,
                headers: list[tuple[str, bytes]]) -> None:
        if self.max_message_bytes is not None:  # as Kafka would refuse it, cut to fit
            key, value, headers = fit(key, value, headers, self.max_message_bytes)
        self.send(topic, key, value, headers)

    def delivered(self, timeout_s: float) -> bool:
        return True  # in memory: produced is delivered

    def problem(self) -> str:
        return ""

    def lag(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return {(t, p): len(self.logs.get(t, [[]] * self.partitions)[p]) - pos
                    for (t, p), pos in self.positions.items()}

    def close(self) -> None:
        if self._on_revoke is not None:
            self._on_revoke(list(range(self.partitions)))
