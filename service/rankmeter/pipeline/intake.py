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

try:
    from rankmeter._events import run_end
except ImportError:  # (then Decoder.plain is None too)
    run_end = None


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
        checked = set[tuple[str, int]]()  # (topic, partition)s whose offsets were checked this batch
        if self.decoder.plain is None or not isinstance(records, list):  # (rankmeter._events not built)
            self._read_each(batch, records, 0, len(records), checked)
            return
        # A poll batch holds runs of one partition's records, one after another: each run
        # decoded in C at once when it is the next records of its partition (the common
        # case), else record by record.
        start, n = 0, len(records)
        while start < n:
            stop = run_end(records, start, Record)
            if not self._read_run(batch, records, start, stop, checked):
                self._read_each(batch, records, start, stop, checked)
            start = stop

    def _read_run(self, batch: Batch, records: list[Record], start: int, stop: int,
                  checked: set[tuple[str, int]]) -> bool:
        """records[start:stop], one partition's next records of one topic: read, the plain
        native messages keyed by their query_id at once, the others one by one, in order;
        False (nothing done) when they are not the partition's next records."""
        first = records[start]
        p, topic = first.partition, first.topic
        ps = self.held.get(p)
        if ps is None or p in self.checks.ledger.stopped or p in self.checks.ledger.recheck:
            return False  # (record by record: skipped there)
        read = batch.advanced.get(p)
        expected = None if read is None else read.get(topic)
        if first.offset != (ps.offsets.get(topic, 0) if expected is None else expected):
            return False
        if topic != self.impressions_topic and topic != self.feedback_topic:
            return False
        try:  # (as record by record, impressions win when both topics have one name)
            events, misses, newest_ms, shown = self.decoder.plain.run(records, start, stop, batch.now_ms,
                                                                      topic != self.impressions_topic, Record)
        except Exception:  # (MemoryError, say): record by record, where the Python path decides
            return False
        advanced = batch.advanced.setdefault(p, {})
        at = 0  # (in the run)
        for miss in misses:  # the messages the C path leaves to the Python one, in their place
            if at < miss:
                batch.work.setdefault(p, []).extend(zip(records[start + at:start + miss], events[at:miss]))
            advanced[topic] = records[start + miss].offset  # (the next one: offsets are consecutive)
            self._read_each(batch, records, start + miss, start + miss + 1, checked)
            at = miss + 1
        if at < stop - start:
            batch.work.setdefault(p, []).extend(zip(records[start + at:stop], events[at:]))
        advanced[topic] = records[stop - 1].offset + 1
        if newest_ms != -1:
            topics = batch.newest.setdefault(p, {})
            if newest_ms > topics.get(topic, -1):
                topics[topic] = newest_ms
        if shown:
            ps.shown_wall_ms = self.wall() * 1000
        return True

    def _read_each(self, batch: Batch, records: list[Record], start: int, stop: int,
                   checked: set[tuple[str, int]]) -> None:
        """records[start:stop] one by one: any message, any offsets."""
        now_ms, work, advanced, newest, counts = batch.now_ms, batch.work, batch.advanced, batch.newest, batch.counts
        # (Attributes read once: this loop runs once per record.)
        partitions, impressions_topic, feedback_topic = self.held, self.impressions_topic, self.feedback_topic
        impression, feedback = self.decoder.impression, self.decoder.feedback
        stopped, recheck = self.checks.ledger.stopped, self.checks.ledger.recheck
        for i in range(start, stop):
            r = records[i]
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
