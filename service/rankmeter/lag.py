"""What `rankmeter serve` knows of its consumer's lag: per (topic, partition) held,
sampled once a second, and the newest record timestamp consumed."""

from __future__ import annotations

from collections.abc import Callable

from rankmeter.clock import EventClock
from rankmeter.pipeline import Pipeline
from rankmeter.source import Record, Source

try:
    from rankmeter._events import newest as _newest
except ImportError:  # (not built: scripts/build_native.py)
    _newest = None


class Lag:
    """The consumer's lag per (topic, partition) held, sampled once a second, and the
    newest record timestamp consumed: what the pipeline's `caught_up` and the exporter's
    lag gauges read."""

    def __init__(self, pipeline: Pipeline, clock: Callable[[], float]) -> None:
        self.pipeline = pipeline
        self.clock = clock
        self.records: dict[tuple[str, int], int] = {}
        self.newest: dict[tuple[str, int], int] = {}  # (topic, partition) -> newest record timestamp consumed

    def restart(self) -> None:
        self.records.clear()
        self.pipeline.caught_up = set()

    def see(self, records: list[Record]) -> None:
        if isinstance(self.clock, EventClock):
            self.clock.see(records)
        if _newest is not None and isinstance(records, list) and _newest(records, self.newest, Record):
            return  # (the same in C, once per partition's run)
        newest = self.newest
        for r in records:
            if r.timestamp > newest.get((r.topic, r.partition), -1):
                newest[(r.topic, r.partition)] = r.timestamp

    def sample(self, source: Source) -> None:
        self.records.clear()
        self.records.update(source.lag())
        self.pipeline.caught_up = {tp for tp, behind in self.records.items() if behind == 0}

    def total(self) -> int:
        return sum(self.records.values())

    def held(self) -> dict[tuple[str, int], int]:
        """Only partitions held now: the lag is sampled once a second, a rebalance at any time."""
        return {tp: n for tp, n in dict(self.records).items() if tp[1] in self.pipeline.partitions}

    def seconds(self) -> dict[tuple[str, int], float]:
        """Event time behind, per partition: 0 when caught up, else now minus the newest
        record consumed (unknown, and left out, until one is)."""
        now_ms, seen = self.clock() * 1000, dict(self.newest)  # dict(): one copy, while the loop writes
        return {tp: 0.0 if n == 0 else max(now_ms - seen[tp], 0.0) / 1000
                for tp, n in dict(self.records).items() if tp[1] in self.pipeline.partitions and (n == 0 or tp in seen)}
