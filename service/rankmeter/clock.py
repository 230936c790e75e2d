"""The service's now: the wall clock, or for history replays and the accelerated demo the
event clock — the newest Kafka record timestamp consumed — so that windows end, and
queries close, where the replayed traffic is however fast it is read."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from rankmeter.source import Record


class EventClock:
    def __init__(self, start_ms: int = 0, max_future_ms: int = 3_600_000,
                 wall: Callable[[], float] = time.time) -> None:
        self.now_ms = start_ms
        self.max_future_ms = max_future_ms
        self.wall = wall

    def see(self, records: Iterable[Record]) -> None:
        """Called with each batch before it is processed: its newest record is now. A
        record stamped further ahead of the wall clock than `windows.max_future` does not
        count (a producer's bogus clock must not end every window in the year 2100)."""
        limit = self.wall() * 1000 + self.max_future_ms
        newest = max((r.timestamp for r in records if r.timestamp <= limit), default=-1)
        if newest > self.now_ms:  # never backwards: a late record is late, not a time machine
            self.now_ms = newest

    def __call__(self) -> float:
        return self.now_ms / 1000
