"""Intake: a poll batch's records decoded and checked, and routed to their partition's
work; records not ours or applied before are skipped, rejected ones counted (and the
invalid sent to the dead-letter topic)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from rankmeter.config import Settings
from rankmeter.events import IMPRESSION_ACTION, Decoder, Feedback, Rejected
from rankmeter.pipeline.context import Batch
from rankmeter.pipeline.offsets import OffsetChecks
from rankmeter.pipeline.state import PartitionState
from rankmeter.source import Record


class Intake:
    def __init__(self, settings: Settings, held: dict[int, PartitionState],
                 dead_letter: Callable[[Record, str], None], wall: Callable[[], float],
                 checks: OffsetChecks) -> None:
        self.decoder = Decoder(settings)
        self.held = held
        self.checks = checks
        self.dead_letter = dead_letter
        self.wall = wall
        self.impressions_topic = settings.kafka.impressions_topic
        self.feedback_topic = settings.kafka.feedback_topic

    def read(self, batch: Batch, records: list[Record]) -> None:
        """Fills the batch's work, advanced offsets, newest event times and rejected counts."""
        now_ms, work, advanced, newest, counts = batch.now_ms, batch.work, batch.advanced, batch.newest, batch.counts
        # (Attributes read once: this loop runs once per record.)
        partitions, impressions_topic, feedback_topic = self.held, self.impressions_topic, self.feedback_topic
        impression, feedback = self.decoder.impression, self.decoder.feedback
        stopped, recheck, checked = self.checks.ledger.stopped, self.checks.ledger.recheck, set[tuple[str, int]]()
        for r in records:
            ps = partitions.get(r.partition)
            if ps is None or r.partition in stopped or r.partition in recheck:
                continue  # not ours, or refused (its offsets went backwards), or to be claimed again
            read = advanced.get(r.partition)
            expected = None if read is None else read.get(r.topic)
            if expected is None:
                expected = ps.offsets.get(r.topic, 0)
            if r.offset != expected and (r.topic, r.partition) not in checked:
                # Not the next record: the log may have been recreated or truncated
                # (offsets.py); checked once a batch.
                checked.add((r.topic, r.partition))
                moved_to = self.checks.in_stream(ps, r.partition, r.topic, expected, r.offset)
                if moved_to is None:
                    continue
                expected = moved_to
            if r.offset < expected:
                continue  # applied before a restart: exactly once
            advanced.setdefault(r.partition, {})[r.topic] = r.offset + 1
            if r.topic == impressions_topic:
                stream, event = "impressions", impression(r.value, now_ms)
            elif r.topic == feedback_topic:
                stream, event = "feedback", feedback(r.value, now_ms)
            else:
                continue
            if not isinstance(event, Rejected) and r.key != event.query_id.encode():
                # Keyed otherwise (or not at all), it may sit in another partition than the
                # rest of its query: it would be orphaned there without a word.
                key = "no key" if r.key is None else f"key {r.key[:100]!r}"
                event = Rejected("invalid", f"message {key} is not its query_id {event.query_id[:100]!r}: "
                                            f"both topics must be keyed by query_id")
            if isinstance(event, Rejected):
                counts.setdefault(r.partition, Counter())[(stream, event.outcome)] += 1
                if event.outcome == "invalid":
                    batch.dead.append((r, event.reason))
                continue
            work.setdefault(r.partition, []).append((r, event))
            topics = newest.setdefault(r.partition, {})
            if event.timestamp_ms > topics.get(r.topic, -1):
                topics[r.topic] = event.timestamp_ms
            if isinstance(event, Feedback) and event.action == IMPRESSION_ACTION:
                ps.shown_wall_ms = self.wall() * 1000

    def send_dead_letters(self, batch: Batch) -> None:
        for r, reason in batch.dead:
            self.dead_letter(r, reason)

    def advance_watermarks(self, batch: Batch) -> None:
        """The topics' event-time watermarks moved to the batch's newest event times."""
        for p, topics in batch.newest.items():
            watermarks = self.held[p].watermarks
            for topic, ts in topics.items():
                # Never past this process's now: one producer with a fast clock (within
                # windows.max_future) must not close everyone's queries early.
                ts = min(ts, batch.now_ms)
                watermarks[topic] = max(watermarks.get(topic, ts), ts)
