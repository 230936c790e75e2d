"""Stored offsets checked against Kafka's log: a topic deleted and created again (the log
ends below the stored offset) or records deleted before they were read (the log starts
above it). Found at a claim and, mid-run, when a record is not the one expected next; counted
(`rankmeter_offsets_reset_total`), logged, and then, by `kafka.on_offsets_reset`, the
partition is refused (not consumed, /readyz names it) or resumed from the new log with the
gap counted (`rankmeter_offsets_skipped_total`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from rankmeter.pipeline.checkpoint import Ledger
from rankmeter.pipeline.state import PartitionState, Reset

log = logging.getLogger("rankmeter.pipeline")

RECREATED, TRUNCATED = "recreated", "truncated"
# (topic, partition) -> (log start, log end) of these partitions of both topics
Bounds = Mapping[tuple[str, int], tuple[int, int]]
BoundsQuery = Callable[[list[int]], Bounds]


def moved(stored: int, start: int, end: int) -> str | None:
    """Why a stored next offset is not in the log [start, end], or None when it is."""
    if end < stored:
        return RECREATED
    if start > stored:
        return TRUNCATED
    return None


class OffsetChecks:
    def __init__(self, ledger: Ledger, policy: str, query: BoundsQuery | None) -> None:
        self.ledger = ledger
        self.policy = policy   # kafka.on_offsets_reset: refuse | resume
        self.query = query     # the source's log bounds (None: a source without, e.g. a replayed file)

    def found(self, topic: str, p: int, cause: str, stored: int, start: int, end: int,
              resets: list[Reset]) -> int | None:
        """Log a reset; returns the offset to resume from (the reset added to `resets`, the
        partition's, counted when its checkpoint is stored), or None: refused (counted now)."""
        extra = {"topic": topic, "partition": p, "cause": cause, "stored_offset": stored,
                 "log_start": start, "log_end": end}
        if self.policy != "resume":
            self.ledger.offsets_reset[(topic, p, cause)] += 1
            log.error("Kafka's log no longer holds this partition's stored offset (the topic was "
                      "recreated, or records were deleted before they were read): not consuming it; "
                      "set kafka.on_offsets_reset: resume to go on from the new log", extra=extra)
            self.ledger.stopped[p] = (f"{topic} partition {p} {cause} (stored offset {stored}, "
                                      f"log now {start}..{end})")
            return None
        skipped = start - stored if cause == TRUNCATED else 0
        resets.append(Reset(topic, cause, skipped))
        log.error("Kafka's log no longer holds this partition's stored offset: resuming from the new "
                  "log's start; the records in between are not counted", extra={**extra, "skipped": skipped})
        return start

    def at_claim(self, p: int, offsets: dict[str, int], bounds: Bounds, resets: list[Reset]) -> bool:
        """Moves `offsets` (a claimed partition's stored ones) to the new log where it was
        reset (adding to `resets`); False when the partition is refused for it."""
        for topic, stored in list(offsets.items()):
            if (topic, p) in bounds and (cause := moved(stored, *bounds[(topic, p)])):
                start = self.found(topic, p, cause, stored, *bounds[(topic, p)], resets)
                if start is None:
                    return False
                offsets[topic] = start
        return True

    def in_stream(self, ps: PartitionState, p: int, topic: str, expected: int, offset: int) -> int | None:
        """A record at `offset` where `expected` was next: the offset now expected (unchanged
        for a benign gap, as transaction markers leave, or a record read again), or None:
        the partition is refused, or to be claimed again (`Ledger.recheck`)."""
        if self.query is None:
            return expected
        try:
            bounds = self.query([p]).get((topic, p))
        except Exception as e:  # cannot tell (the topic's metadata gone a moment): claim it again
            log.warning("cannot read the log's bounds: claiming the partition again from the store",
                        extra={"topic": topic, "partition": p, "error": type(e).__name__})
            self.ledger.recheck.add(p)
            return None
        if bounds is None or (cause := moved(expected, *bounds)) is None:
            return expected
        start = self.found(topic, p, cause, expected, *bounds, ps.resets)
        if start is not None:
            ps.offsets[topic] = start
            ps.offsets_moved = True  # checkpointed even if nothing else changes
        return start
