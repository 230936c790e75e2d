"""One poll batch, from records to persisted aggregates (brief §8):

    decode → group by partition → one read of the touched query records → join in memory
    → evaluate the touched queries together → window deltas → one transaction per
    partition with the new offsets.

The pipeline owns the assigned partitions' state: offsets, window buckets, and a
write-through cache of query records and their `QueryState`s (this process is the
partition's only writer while it holds it). It knows nothing of Kafka or Redis: a
`Source` feeds it, a `Store` keeps its state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import NamedTuple

import msgspec
import numpy as np

from rankmeter.config import Settings, duration_ms
from rankmeter.engine import QueryState, evaluate, parse_all, stack
from rankmeter.events import Decoder, Feedback, Impression, Rejected
from rankmeter.join import (ONLINE_SIGNALS, UNDEFINED, QueryRecord, apply_feedback,
                            apply_impression, online_ratios)
from rankmeter.source import Record
from rankmeter.store import PartitionWrite, Store
from rankmeter.windows import MINUTE_MS, BucketKey, Layout, WindowView, window_views

log = logging.getLogger("rankmeter.pipeline")

OTHER = "other"             # the label of rankers and segments past the cap
SWEEP_INTERVAL_MS = 1000    # how often closed and orphaned queries are looked for
CACHE_LIMIT = 200_000       # query records kept in memory per partition


class PartitionState:
    def __init__(self, offsets: dict[str, int], buckets: dict[BucketKey, np.ndarray]) -> None:
        self.offsets = offsets
        self.buckets = buckets
        self.records: dict[str, QueryRecord] = {}
        self.states: dict[str, QueryState] = {}
        self.open_queries = 0


class _Touched(NamedTuple):
    partition: int
    query_id: str


class Pipeline:
    def __init__(self, settings: Settings, store: Store,
                 dead_letter: Callable[[Record, str], None],
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.store = store
        self.dead_letter = dead_letter
        self.clock = clock
        self.decoder = Decoder(settings)
        self.impressions_topic = settings.kafka.impressions_topic
        self.feedback_topic = settings.kafka.feedback_topic
        self.measures = parse_all(settings.evaluation.measures)
        names = [str(m) for m in self.measures] + list(ONLINE_SIGNALS)
        over_all = names if settings.evaluation.empty_query_policy == "zero" else ONLINE_SIGNALS
        self.layout = Layout(names, over_all, distributed=[str(m) for m in self.measures])
        self.level = settings.evaluation.relevance_level
        self.max_events = settings.limits.max_events_per_query
        self.attribution_ms = duration_ms(settings.windows.attribution) + duration_ms(settings.windows.grace)
        self.windows = {size: duration_ms(size) for size in settings.windows.sizes}
        # Buckets are kept while feedback can still change them and a window shows them.
        self.retention_ms = max(self.windows.values()) + self.attribution_ms
        self.events: Counter[tuple[str, str]] = Counter()   # (stream, outcome)
        self.folded: Counter[str] = Counter()               # label kind -> values folded
        self.partitions: dict[int, PartitionState] = {}
        self.lock = threading.Lock()  # between the batch and the exporter's scrape
        self._labels: dict[tuple[str, str], str] = {}
        self._record_codec = (msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(QueryRecord))
        self._last_sweep_ms = 0
        self._zero = bytes(8 * self.layout.size)

    # ---- assignment ----

    def assign(self, partitions: list[int]) -> dict[tuple[str, int], int]:
        """Load the partitions' state; returns the offsets to resume from."""
        resume = {}
        for p in partitions:
            snapshot = self.store.load(p)
            buckets = {}
            for field, data in snapshot.buckets.items():
                vector = np.frombuffer(data, dtype=np.float64).copy()
                if len(vector) != self.layout.size:
                    log.warning("dropping a window bucket written with other measures",
                                extra={"partition": p, "bucket": field})
                    continue
                buckets[BucketKey.decode(field)] = vector
            with self.lock:
                self.partitions[p] = PartitionState(dict(snapshot.offsets), buckets)
            resume.update({(topic, p): offset for topic, offset in snapshot.offsets.items()})
        log.info("partitions assigned", extra={"partitions": partitions, "resume": len(resume)})
        return resume

    def revoke(self, partitions: Iterable[int]) -> None:
        """Every batch is persisted when `process` returns: forgetting is enough."""
        with self.lock:
            for p in partitions:
                self.partitions.pop(p, None)
        log.info("partitions revoked", extra={"partitions": list(partitions)})

    # ---- one batch ----

    def process(self, records: list[Record]) -> dict[tuple[str, int], int]:
        """Apply one poll batch and persist it; returns the offsets to commit to Kafka."""
        now_ms = int(self.clock() * 1000)
        work: dict[int, list[tuple[Record, Impression | Feedback]]] = {}
        advanced: dict[int, dict[str, int]] = {}
        for r in records:
            ps = self.partitions.get(r.partition)
            if ps is None or r.offset < ps.offsets.get(r.topic, 0):
                continue  # not ours, or applied before a restart: exactly once
            advanced.setdefault(r.partition, {})[r.topic] = r.offset + 1
            if r.topic == self.impressions_topic:
                stream, event = "impressions", self.decoder.impression(r.value, now_ms)
            elif r.topic == self.feedback_topic:
                stream, event = "feedback", self.decoder.feedback(r.value, now_ms)
            else:
                continue
            if isinstance(event, Rejected):
                self.events[(stream, event.outcome)] += 1
                if event.outcome == "invalid":
                    self.dead_letter(r, event.reason)
                continue
            work.setdefault(r.partition, []).append((r, event))

        expired = self._sweep(now_ms)
        self._load_records(work, expired)
        touched, changed = self._join(work)
        dirty_buckets = self._evaluate(touched, changed)
        writes = self._writes(advanced, touched, expired, dirty_buckets, now_ms)
        self.store.write(writes)
        for ps in self.partitions.values():
            _trim(ps.records, ps.states)
        return {(topic, p): offset for p, topics in advanced.items() for topic, offset in topics.items()}

    def _sweep(self, now_ms: int) -> dict[int, list[str]]:
        """Queries past their deadline: closed (their contribution stays) or, when their
        impression never came, orphaned."""
        if now_ms - self._last_sweep_ms < SWEEP_INTERVAL_MS or not self.partitions:
            return {}
        self._last_sweep_ms = now_ms
        found = self.store.expired(list(self.partitions), now_ms)
        expired = {}
        for p, (qids, open_count) in found.items():
            self.partitions[p].open_queries = open_count - len(qids)
            if qids:
                expired[p] = qids
        return expired

    def _load_records(self, work: dict[int, list[tuple[Record, Impression | Feedback]]],
                      expired: dict[int, list[str]]) -> None:
        """Bring the records the batch needs (and the expired ones, to count orphans) into
        the cache: one read for all partitions."""
        needed = {p: [event.query_id for _, event in items] for p, items in work.items()}
        for p, qids in expired.items():
            needed.setdefault(p, []).extend(qids)
        wanted = {p: [q for q in dict.fromkeys(qids) if q not in self.partitions[p].records]
                  for p, qids in needed.items()}
        wanted = {p: qids for p, qids in wanted.items() if qids}
        if not wanted:
            return
        decode = self._record_codec[1].decode
        for p, found in self.store.read(wanted).items():
            cache = self.partitions[p].records
            for qid, data in zip(wanted[p], found):
                cache[qid] = decode(data) if data is not None else QueryRecord()

    def _join(self, work: dict[int, list[tuple[Record, Impression | Feedback]]]
              ) -> tuple[dict[_Touched, QueryRecord], dict[_Touched, set[str] | None]]:
        """Apply events to their records. `changed` holds, per query with an impression,
        the documents whose grade may have changed (None: evaluate from scratch)."""
        touched: dict[_Touched, QueryRecord] = {}
        changed: dict[_Touched, set[str] | None] = {}
        count = self.events
        for p, events in work.items():
            cache = self.partitions[p].records
            for source, event in events:
                key = _Touched(p, event.query_id)
                record = cache[event.query_id]
                touched[key] = record
                if isinstance(event, Impression):
                    outcome, waiting = apply_impression(record, event, self.attribution_ms)
                    count[("impressions", outcome)] += 1
                    if outcome == "applied":
                        record.ranker_label = self._label("ranker", event.ranker)
                        record.segment_label = self._label("segment", event.segment) if event.segment else ""
                        changed[key] = None
                        for fb_outcome, _ in waiting:
                            count[("feedback", fb_outcome)] += 1
                else:
                    outcome = apply_feedback(record, event, self.attribution_ms, self.max_events)
                    if outcome == "flooded":
                        outcome = "invalid"
                        self.dead_letter(source, f"query {event.query_id!r} already has {self.max_events} "
                                                 f"feedback events (limits.max_events_per_query)")
                    count[("feedback", outcome)] += 1
                    if outcome == "applied" and key not in changed:
                        changed[key] = set()
                    if outcome == "applied" and changed[key] is not None:
                        changed[key].add(event.doc_id)
        return touched, changed

    def _evaluate(self, touched: dict[_Touched, QueryRecord],
                  changed: dict[_Touched, set[str] | None]) -> dict[int, set[BucketKey]]:
        """Recompute the changed queries' metrics together and move their window
        contributions by the difference."""
        keys = list(changed)
        if not keys:
            return {}
        records = [touched[k] for k in keys]
        states = []
        for k, record in zip(keys, records):
            cache = self.partitions[k.partition].states
            state = cache.get(k.query_id)
            docs = changed[k]
            if state is None or docs is None:
                state = QueryState.from_grades(record.impression.results, record.grades(),
                                               self.level, shown_grade=0)
                cache[k.query_id] = state
            else:  # incremental: only the documents this batch's feedback touched
                for doc in docs:
                    state.set_grade(doc, record.grade(doc))
            states.append(state)
        batch = stack(states)
        names = self.layout.names
        values = np.empty((len(keys), len(names)))
        nums, dens = np.empty_like(values), np.empty_like(values)
        for i, (m, ratio) in enumerate(evaluate(self.measures, batch).items()):
            values[:, i], nums[:, i], dens[:, i] = m.values(ratio), ratio.num, ratio.den
        offset = len(self.measures)
        online = online_ratios(records)
        for j, name in enumerate(ONLINE_SIGNALS):
            num, den = online[name]
            with np.errstate(divide="ignore", invalid="ignore"):
                values[:, offset + j] = np.where(den != 0, num / den, UNDEFINED.get(name, 0.0))
            nums[:, offset + j], dens[:, offset + j] = num, den
        contributions = self.layout.contributions(values, nums, dens, batch.num_rel > 0)
        previous = np.frombuffer(b"".join(r.contribution or self._zero for r in records))
        deltas = contributions - previous.reshape(contributions.shape)

        # Sum the deltas per bucket first: a batch touches few buckets and many queries.
        buckets = [(k.partition, r.ranker_label, r.segment_label, r.impression.timestamp_ms // MINUTE_MS)
                   for k, r in zip(keys, records)]
        index = {b: i for i, b in enumerate(dict.fromkeys(buckets))}
        totals = np.zeros((len(index), self.layout.size))
        np.add.at(totals, [index[b] for b in buckets], deltas)
        for record, new in zip(records, contributions):
            record.contribution = new.tobytes()
        dirty: dict[int, set[BucketKey]] = {}
        with self.lock:
            for (p, *key), i in index.items():
                bucket = BucketKey(*key)
                sums = self.partitions[p].buckets.get(bucket)
                if sums is None:
                    sums = self.partitions[p].buckets[bucket] = np.zeros(self.layout.size)
                sums += totals[i]
                dirty.setdefault(p, set()).add(bucket)
        return dirty

    def _writes(self, advanced: dict[int, dict[str, int]], touched: dict[_Touched, QueryRecord],
                expired: dict[int, list[str]], dirty_buckets: dict[int, set[BucketKey]],
                now_ms: int) -> list[PartitionWrite]:
        encode = self._record_codec[0].encode
        oldest_minute = (now_ms - self.retention_ms) // MINUTE_MS
        deadline = now_ms + self.attribution_ms
        records: dict[int, dict[str, bytes]] = {}
        for k, r in touched.items():
            records.setdefault(k.partition, {})[k.query_id] = encode(r)
        writes = []
        for p in set(advanced) | set(expired) | set(dirty_buckets):
            ps = self.partitions[p]
            ps.offsets.update(advanced.get(p, {}))
            written = records.get(p, {})
            deleted = []
            for qid in expired.get(p, []):
                if qid in written:
                    continue  # new events in this batch keep it open
                record = ps.records.pop(qid, None)
                ps.states.pop(qid, None)
                if record is not None and record.impression is None:
                    self.events[("feedback", "orphaned")] += len(record.pending)
                deleted.append(qid)
            with self.lock:
                dropped = [b for b in ps.buckets if b.minute < oldest_minute]
                for b in dropped:
                    del ps.buckets[b]
                buckets = {b.encode(): ps.buckets[b].tobytes()
                           for b in dirty_buckets.get(p, ()) if b in ps.buckets}
            writes.append(PartitionWrite(
                partition=p, offsets=dict(ps.offsets), records=written,
                deadlines=dict.fromkeys(written, deadline), deleted=deleted, buckets=buckets,
                dropped_buckets=[b.encode() for b in dropped]))
        return writes

    # ---- labels ----

    def _label(self, kind: str, value: str) -> str:
        """The value itself while fewer than the cap are known (across replicas), else `other`."""
        label = self._labels.get((kind, value))
        if label is None:
            cap = self.settings.limits.max_rankers if kind == "ranker" else self.settings.limits.max_segments
            admitted = value != OTHER and self.store.admit_label(kind, value, cap)
            label = value if admitted else OTHER
            if not admitted:
                self.folded[kind] += 1
                log.warning("label folded into 'other'", extra={"kind": kind, "value": value[:100]})
            self._labels[(kind, value)] = label
        return label

    # ---- for the exporter ----

    def views(self, now_ms: int | None = None) -> list[WindowView]:
        now_ms = int(self.clock() * 1000) if now_ms is None else now_ms
        with self.lock:
            return window_views([ps.buckets for ps in self.partitions.values()],
                                self.layout, self.windows, now_ms)

    def open_queries(self) -> int:
        return sum(ps.open_queries for ps in list(self.partitions.values()))


def _trim(records: dict[str, QueryRecord], states: dict[str, QueryState]) -> None:
    """Bound the cache: forget the oldest entries (they are in the store)."""
    excess = len(records) - CACHE_LIMIT
    if excess > 0:
        for qid in list(records)[:excess]:
            del records[qid]
            states.pop(qid, None)
