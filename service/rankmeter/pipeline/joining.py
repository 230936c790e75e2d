"""Joining: the batch's events applied to their query records; a query whose list is
known is labelled, enrolled and queued for the harvest; lists assembled from impression
events are settled when complete (or when the sweep finds them due)."""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Callable

from rankmeter.config import Settings, duration_ms, time_ms
from rankmeter.events import IMPRESSION_ACTION, Impression
from rankmeter.join import Attribution, QueryRecord, apply_feedback, apply_impression, complete, settle
from rankmeter.pipeline.context import Batch, Touched
from rankmeter.pipeline.labels import Labels
from rankmeter.pipeline.state import PartitionState
from rankmeter.pipeline.sweep import SHOWN
from rankmeter.source import Record

LIST = "list:"  # partition metadata: a query assembling its list -> its time
HARVEST_QUEUE_LIMIT = 100_000  # queries waiting per partition to be harvested; past it, new
                               # ones are not harvested (a sample: the estimate needs no more)
_UNSEEN = object()  # a query not in the batch's `changed` yet


def attribution_of(settings: Settings) -> Attribution:
    w = settings.windows
    implicit_ms = duration_ms(w.attribution) + duration_ms(w.grace)
    return Attribution(implicit_ms, max(implicit_ms, duration_ms(w.judgments)))


class Joining:
    def __init__(self, settings: Settings, held: dict[int, PartitionState], labels: Labels,
                 enrol: Callable[[QueryRecord], str], dead_letter: Callable[[Record, str], None]) -> None:
        self.held = held
        self.labels = labels
        self.enrol = enrol
        self.dead_letter = dead_letter
        self.attribution = attribution_of(settings)
        self.max_events = settings.limits.max_events_per_query
        self.max_results = settings.limits.max_results
        # Queries harvested: those whose query_id hashes below this share (a deterministic
        # sample, the same on every replica and however the stream is batched).
        self.harvest_below = int(settings.debias.harvest_share * 2 ** 32)
        # CUPED: feedback from ab.start on takes a query out of the pre-period table, late or not.
        self.pre_until = time_ms(settings.ab.start) if settings.ab.cuped and settings.ab.start else None

    def apply(self, batch: Batch) -> None:
        """Apply events to their records (into `touched`); `changed` holds, per query with
        an impression, the documents whose grade may have changed (None: evaluate from scratch)."""
        touched, changed, now_ms = batch.touched, batch.changed, batch.now_ms
        attribution, max_events, feedback_time = self.attribution, self.max_events, self.pre_until is not None
        for p, events in batch.work.items():
            ps = self.held[p]
            cache = ps.records
            count = batch.count(p)
            keys: dict[str, Touched] = {}  # one key per query, not per event (a NamedTuple is dear)
            for source, event in events:
                qid = event.query_id
                key = keys.get(qid)
                if key is None:
                    key = keys[qid] = Touched(p, qid)
                record = touched[key] = cache[qid]
                if isinstance(event, Impression):
                    outcome, waiting = apply_impression(record, event, attribution)
                    if outcome == "pending":  # its list comes from impression events
                        ps.lists[qid] = event.timestamp_ms
                        ps.meta[LIST + qid] = str(event.timestamp_ms)
                        if record.shown:
                            _shown(ps, event.timestamp_ms, now_ms)
                        if complete(record):
                            self._settle(batch, key, record)
                        continue
                    count[("impressions", outcome)] += 1
                    if outcome == "applied":
                        self._applied(batch, key, record, waiting)
                    continue
                outcome = apply_feedback(record, event, attribution, max_events, feedback_time)
                if outcome == "applied":  # the common case, in short (never an impression event)
                    count[("feedback", "applied")] += 1
                    docs = changed.get(key, _UNSEEN)
                    if docs is _UNSEEN:  # (a set only for the query's first: setdefault would make one per event)
                        docs = changed[key] = set()
                    if docs is not None:
                        docs.add(event.doc_id)
                    continue
                if outcome == "flooded":
                    outcome = "invalid"
                    self.dead_letter(source, f"query {qid!r} already has {max_events} "
                                             f"feedback events (limits.max_events_per_query)")
                if event.action == IMPRESSION_ACTION and outcome != "duplicate":
                    known = record.header or record.impression
                    if known is not None:
                        _shown(ps, known.timestamp_ms, now_ms)
                if outcome != "pending":  # counted once, by what becomes of it
                    count[("feedback", outcome)] += 1
                elif complete(record):  # the impression event that completes its list
                    self._settle(batch, key, record)
                if outcome == "late" and key not in changed and self._leaves_pre_period(record, event.timestamp_ms):
                    changed[key] = set()  # evaluated again: pipeline/covariates.py takes it out

    def _leaves_pre_period(self, record: QueryRecord, timestamp_ms: int) -> bool:
        return (self.pre_until is not None and timestamp_ms >= self.pre_until
                and bool(record.pre_contribution or record.pre_user_contribution))

    def settle_due(self, batch: Batch) -> None:
        """Settle the lists found complete (`due`), and those whose query's attribution
        window the sweep found passed (no click could count any more: settled with what
        came, not closed)."""
        expired, due = batch.expired, batch.due
        for p in {*expired, *due}:
            ps = self.held[p]
            settle_now = list(due.get(p, ()))
            found = {qid for qid in expired.get(p, ()) if (r := ps.records.get(qid)) is not None and r.assembling}
            if found:
                expired[p] = [q for q in expired[p] if q not in found]
            for qid in settle_now + sorted(found):
                record = ps.records.get(qid)
                if record is not None and record.assembling:
                    key = Touched(p, qid)
                    batch.touched[key] = record
                    self._settle(batch, key, record)

    def _applied(self, batch: Batch, key: Touched, record: QueryRecord, waiting: list[tuple[str, str]]) -> None:
        """A query's list is known: label it, enrol it, count the feedback that waited."""
        impression = record.impression
        record.ranker_label = self.labels.label("ranker", impression.ranker)
        record.segment_label = self.labels.label("segment", impression.segment) if impression.segment else ""
        record.ab_experiment = self.enrol(record)
        batch.changed[key] = None
        ps = self.held[key.partition]
        if ps.pair_sums is not None and impression.query_hash and len(ps.harvest_queue) < HARVEST_QUEUE_LIMIT \
                and zlib.crc32(key.query_id.encode()) < self.harvest_below:
            heapq.heappush(ps.harvest_queue, (impression.timestamp_ms + self.attribution.implicit_ms, key.query_id))
        if waiting:
            count = batch.count(key.partition)
            for fb_outcome, _ in waiting:
                count[("feedback", fb_outcome)] += 1

    def _settle(self, batch: Batch, key: Touched, record: QueryRecord) -> None:
        """Evaluate a query whose list was assembled from impression events (join.settle)."""
        used, waiting = settle(record, self.attribution, self.max_results)
        ps = self.held[key.partition]
        ps.lists.pop(key.query_id, None)
        if ps.meta.pop(LIST + key.query_id, None) is None:  # stored by an earlier checkpoint
            ps.meta_deleted.append(LIST + key.query_id)
        count = batch.count(key.partition)
        count[("impressions", "applied")] += 1
        count[("feedback", "listed")] += used
        self._applied(batch, key, record, waiting)

    def deadline(self, record: QueryRecord) -> int:
        """The event time at which the query closes: its impression's time plus the
        longest attribution (judgments'); without an impression yet, counted from its
        latest feedback (an impression that never comes leaves it orphaned then). A query
        assembling its list is settled, at the latest, when its attribution window has
        passed (`settle_due`)."""
        if record.impression is not None:
            return record.impression.timestamp_ms + self.attribution.explicit_ms
        if record.header is not None:
            return record.header.timestamp_ms + self.attribution.implicit_ms
        explicit = any(fb.explicit for fb in record.pending)
        window = self.attribution.explicit_ms if explicit else self.attribution.implicit_ms
        return max([fb.timestamp_ms for fb in record.pending] + [ts for *_, ts in record.shown]) + window


def _shown(ps: PartitionState, query_ms: int, now_ms: int) -> None:
    """An impression event of a query at `query_ms` came: the partition's impression
    events have reached that time. The query record's time (the search engine's clock),
    not the event's (a browser's, which may run fast or slow)."""
    query_ms = min(query_ms, now_ms)
    if query_ms > ps.watermarks.get(SHOWN, -1):
        ps.watermarks[SHOWN] = query_ms
