"""The service's now: the wall clock, or for history replays and the accelerated demo the
event clock — the newest Kafka record timestamp consumed — so that windows end, and
queries close, where the replayed traffic is however fast it is read."""

from __future__ import annotations

from collections.abc import Iterable

from rankmeter.source import Record


class EventClock:
    def __init__(self, start_ms: int = 0) -> None:
        self.now_ms = start_ms

    def see(self, records: Iterable[Record]) -> None:
        """Called with each batch before it is processed: its newest record is now."""
        newest = max((r.timestamp for r in records), default=-1)
        if newest > self.now_ms:  # never backwards: a late record is late, not a time machine
            self.now_ms = newest

    def __call__(self) -> float:
        return self.now_ms / 1000
