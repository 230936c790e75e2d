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

import hashlib
import heapq
import json
import logging
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import msgspec
import numpy as np

from rankmeter.ab import report as ab_report
from rankmeter.ab import sums as ab_sums
from rankmeter.ab.experiment import Look, Preference, interleaving_look
from rankmeter.ab.experiment import look as ab_look
from rankmeter.checkpoint import Checkpoint
from rankmeter.config import Evaluation, Settings, duration_ms, time_ms
from rankmeter.debias import ipw
from rankmeter.debias.propensity import Harvester, PairSums, Propensities, estimate, merge
from rankmeter.engine import ONLINE_SIGNALS, QueryState, evaluate, evaluate_online, parse_all, stack
from rankmeter.events import IMPRESSION_ACTION, Decoder, Feedback, Impression, Rejected
from rankmeter.join import (SCORES, Attribution, QueryRecord, apply_feedback, apply_impression, clicks_of, complete,
                            pack_scores, settle, unpack_scores)
from rankmeter.source import Record
from rankmeter.store import FENCED, Store
from rankmeter.windows import MINUTE_MS, SLOTS, BucketKey, Layout, WindowView, window_views

log = logging.getLogger("rankmeter.pipeline")

OTHER = "other"             # the label of rankers and segments past the cap
# How far the partition's impression events have come, in their queries' record time (the
# search engine's clock, not a browser's), kept with the topics' watermarks: it settles
# lists (clicks, later in event time, do not move it).
SHOWN = "impression events"
LIST = "list:"  # partition metadata: a query assembling its list -> its time
SWEEP_INTERVAL_MS = 1000    # how often closed and orphaned queries are looked for
SWEEP_LIMIT = 5000          # queries closed per partition and sweep: an outage's backlog
                            # closes over several batches, not in one huge read
LABEL_REFRESH_MS = 60_000   # how often an admitted label's last use is refreshed in the store
CACHE_LIMIT = 200_000       # query records kept in memory per partition
HISTORY_INTERVAL_MS = 60_000  # an experiment's history: one line a minute ...
HISTORY_KEEP = 20_000         # ... for two weeks
IPW = "ipw:"                  # layout names of the debiased measures: ipw:nDCG@10
# A partition's harvested pair sums (debias/), with its A/B sums; three parts, as an
# experiment's fields, so that a version without debias skips it (a rollback is safe).
PAIRS = "propensity\x1f\x1fpairs"
HARVEST_QUEUE_LIMIT = 100_000  # queries waiting per partition to be harvested; past it, new
                               # ones are not harvested (a sample: the estimate needs no more)


class PartitionState:
    """A partition while this process owns it: its epoch, offsets, event-time watermarks,
    window buckets, and a write-through cache of its query records."""

    def __init__(self, epoch: int, offsets: dict[str, int], watermarks: dict[str, int],
                 buckets: dict[BucketKey, np.ndarray]) -> None:
        self.epoch = epoch
        self.offsets = offsets
        self.watermarks = watermarks
        self.buckets = buckets
        self.ab: dict[str, np.ndarray] = {}     # experiment␟ranker␟segment -> cumulative arm sums
        self.dirty_ab: set[str] = set()
        self.rewrite_buckets = False
        self.history: list[str] = []             # layout fingerprints, oldest first (records name an index)
        self.meta: dict[str, str] = {}           # partition metadata the next checkpoint writes
        self.drop_fields: list[str] = []         # unreadable stored buckets the next checkpoint deletes  # converted from another layout: the next checkpoint writes all
        self.records: dict[str, QueryRecord] = {}
        self.states: dict[str, QueryState] = {}
        self.open_queries = 0
        # Queries assembling their list from impression events -> their time; in the
        # store's metadata too (LIST).
        self.lists: dict[str, int] = {}
        self.shown_wall_ms = 0.0  # when the last impression event came (wall clock, ms)
        self.checkpoints = 0  # written by this owner (their mark: epoch and number, Pipeline._unsure)
        self.meta_deleted: list[str] = []  # metadata fields the next checkpoint deletes
        # Position bias (debias/): the pair sums this partition's queries have added to the
        # harvest (stored with the A/B sums: PAIRS), and the queries waiting for their clicks
        # to be final, (attribution end, query id), soonest first. The queue is in memory
        # only: after a restart the queries open then are not harvested (a smaller sample,
        # never a biased one).
        self.pair_sums: np.ndarray | None = None
        self.harvest_queue: list[tuple[int, str]] = []

    def watermark(self, topics: tuple[str, str], caught_up: set[str]) -> int | None:
        """How far event time has certainly come in this partition: the lower of the two
        topics' highest timestamps, so a topic read ahead of the other (a backlog) closes
        nothing early. A topic read to its end (`caught_up`) holds nothing back: a quiet
        feedback topic must not keep every query open. None (close nothing) while a topic
        with records still to read has not been seen."""
        behind = [t for t in topics if t not in caught_up]
        if any(t not in self.watermarks for t in behind):
            return None
        seen = [self.watermarks[t] for t in (behind or topics) if t in self.watermarks]
        return (min if behind else max)(seen) if seen else None


class _Touched(NamedTuple):
    partition: int
    query_id: str


def layout_for(settings: Settings, debiased: bool = True) -> Layout:
    """The layout of this configuration. A quality measure's identity includes what its
    values depend on (grade map, relevance level, empty-query policy), so changing those
    starts it afresh rather than mixing old and new values under one name. The debiased
    measures (`ipw:…`) come last; `debiased=False` leaves them out (the A/B layout: an
    experiment's name, and its sums, do not change when they are turned on)."""
    e = settings.evaluation
    measures = [str(m) for m in parse_all(e.measures)]
    grading = json.dumps([sorted(e.grades.items()), e.long_dwell_ms, e.long_dwell_grade,
                          e.relevance_level, e.empty_query_policy]
                         # (the default labels leave the fingerprints as they were before labels)
                         + ([sorted(e.labels.items())] if e.labels != Evaluation().labels else []))
    tag = hashlib.sha256(grading.encode()).hexdigest()[:8]
    names = measures + list(ONLINE_SIGNALS)
    over_all = names if e.empty_query_policy == "zero" else list(ONLINE_SIGNALS)
    ids = [f"{m}#{tag}" for m in measures] + list(ONLINE_SIGNALS)
    if debiased and settings.debias.measures:
        d = settings.debias
        weighting = json.dumps([sorted(e.grades.items()), e.long_dwell_ms, e.long_dwell_grade,
                                d.ranks, d.max_weight, d.min_pairs])
        ipw_tag = hashlib.sha256(weighting.encode()).hexdigest()[:8]
        debiased_names = [IPW + str(m) for m in parse_all(d.measures)]
        names = names + debiased_names
        # Over every impression whose query has what the measure needs (module `ipw`):
        # an impression without a click counts 0, or the average would be biased upwards.
        over_all = list(over_all) + debiased_names
        ids = ids + [f"{n}#{ipw_tag}" for n in debiased_names]
    return Layout(names, over_all, distributed=measures, ids=ids, judged_id=f"judged#{tag}")


class Pipeline:
    def __init__(self, settings: Settings, store: Store,
                 dead_letter: Callable[[Record, str], None],
                 clock: Callable[[], float] = time.time, wall: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.store = store
        self.dead_letter = dead_letter
        self.clock = clock  # event time's "now": the wall clock, or the event clock
        self.wall = wall    # processing time (seconds): how long a list has waited here
        self.decoder = Decoder(settings)
        self.impressions_topic = settings.kafka.impressions_topic
        self.feedback_topic = settings.kafka.feedback_topic
        self.measures = parse_all(settings.evaluation.measures)
        self.layout = layout_for(settings)
        self.ab_layout = layout_for(settings, debiased=False)  # A/B: the measures and signals only
        self.debiased = parse_all(settings.debias.measures)
        # Examination propensity per rank, relative to rank 1 (None: not estimated yet),
        # from every partition's harvest: estimated by partition 0's holder, read by all.
        self.propensities = Propensities([None] * settings.debias.ranks, [0.0] * settings.debias.ranks, 0)
        # One harvest table for every partition held: a query text's impressions are spread
        # over partitions (keyed by query_id), and its pooled ideal needs them together.
        self.harvester = self._new_harvester()
        self._ideals: dict[tuple[str, int], float | None] = {}  # (query text, depth) -> pooled ideal DCG
        # Queries harvested: those whose query_id hashes below this share (a deterministic
        # sample, the same on every replica and however the stream is batched).
        self.harvest_below = int(settings.debias.harvest_share * 2 ** 32)
        self.level = settings.evaluation.relevance_level
        self.max_events = settings.limits.max_events_per_query
        self.max_results = settings.limits.max_results
        w = settings.windows
        implicit_ms = duration_ms(w.attribution) + duration_ms(w.grace)
        self.attribution = Attribution(implicit_ms, max(implicit_ms, duration_ms(w.judgments)))
        self.settle_ms = duration_ms(w.list_settle)
        self.windows = {size: duration_ms(size) for size in settings.windows.sizes}
        # Buckets are kept while feedback can still change them and a window shows them.
        self.retention_ms = max(self.windows.values()) + self.attribution.explicit_ms
        self.label_idle_ms = duration_ms(settings.limits.label_idle)
        self.events: Counter[tuple[str, str]] = Counter()   # (stream, outcome), of stored batches
        # This batch's counts per partition: added to `events` once the partition's checkpoint
        # is stored, so a batch replayed after a store failure or taken over from a fenced
        # replica is counted once.
        self._counts: dict[int, Counter[tuple[str, str]]] = {}
        # A checkpoint whose commit failed midway: (its mark, its counts), per partition.
        self._unsure: dict[int, tuple[str, Counter[tuple[str, str]]]] = {}
        self.folded: Counter[str] = Counter()               # label kind -> values folded
        self.partitions: dict[int, PartitionState] = {}
        self.lost: set[int] = set()     # partitions whose stored state is gone (not consumed)
        self.fenced: set[int] = set()   # partitions another replica took over (rejoin)
        self.fenced_total = 0
        # (topic, partition)s read to their end, as of the last lag reading (serve sets it).
        self.caught_up: set[tuple[str, int]] = set()
        self.lock = threading.Lock()  # between the batch and the exporter's scrape
        self._labels: dict[tuple[str, str], tuple[str, int]] = {}  # -> (label, checked at ms)
        self._layouts: dict[str, Layout | None] = {self.layout.fingerprint: self.layout}
        self._record_codec = (msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(QueryRecord))
        self._last_sweep_ms = 0
        self._last_sweep_wall = 0.0
        self.ab_size = ab_sums.size(self.ab_layout)
        self._scores_bytes = 8 * (3 * len(self.layout.names) + 1)  # a record's packed scores (join.pack_scores)
        self.baseline = settings.ab.baseline
        # The experiment: every other ranker against the baseline, from `ab.start` on.
        self.experiment_start: int | None = time_ms(settings.ab.start) if settings.ab.start else None
        self.ab_result: Look | None = None
        self.interleaving_result: list[Preference] = []
        self._last_history_ms = 0

    # ---- assignment ----

    def assign(self, partitions: list[int], committed: Mapping[tuple[str, int], int] | None = None,
               rebuild: bool = False, claim: bool = True) -> dict[tuple[str, int], int]:
        """Claim the partitions and load their state; returns the offsets to resume from.

        A partition without stored offsets starts from the beginning of both topics,
        unless Kafka has committed offsets for it: then the store lost its state, and
        resuming from Kafka's commit would export aggregates with a hole. Such a
        partition is refused (`lost`) unless `rebuild`, which wipes what is left of it
        and re-reads the retained topics from the start. `claim=False` only reads (for
        `rankmeter report`, which must not fence the running replicas)."""
        committed = committed or {}
        resume = {}
        for p in partitions:
            snapshot = self.store.claim(p) if claim else self.store.load(p)
            if not snapshot.offsets:
                had_state = any(committed.get((t, p), 0) > 0 for t in (self.impressions_topic, self.feedback_topic))
                if had_state and not rebuild:
                    log.error("the state store has no state for a partition that Kafka has consumed: "
                              "not consuming it; restart with `rankmeter serve --rebuild` to rebuild it "
                              "from the topics", extra={"partition": p})
                    self.lost.add(p)
                    continue
                if had_state:
                    log.warning("rebuilding a partition from the start of its topics", extra={"partition": p})
                    self.store.wipe(p)
                    snapshot = snapshot._replace(buckets={}, ab={}, watermarks={}, layout="", history=[], lists={},
                                                 descriptions={})
                snapshot = snapshot._replace(offsets={self.impressions_topic: 0, self.feedback_topic: 0})
            for fingerprint, description in snapshot.descriptions.items():
                if fingerprint not in self._layouts:
                    self._layouts[fingerprint] = Layout.from_description(description)
            state = PartitionState(snapshot.epoch, dict(snapshot.offsets), dict(snapshot.watermarks), {})
            state.lists = dict(snapshot.lists)
            state.shown_wall_ms = self.wall() * 1000
            state.history = list(snapshot.history) or ([snapshot.layout] if snapshot.layout else [])
            stored = self._layouts.get(snapshot.layout) if snapshot.layout else self.layout
            state.buckets = self._load_buckets(p, snapshot.buckets, stored, state)
            # Experiment sums as stored: an A/B experiment's name includes its layout, and
            # interleaving counts are the same in every layout.
            state.ab = {field: np.frombuffer(data).copy() for field, data in snapshot.ab.items()}
            if self.debiased:
                stored_pairs = state.ab.get(PAIRS)
                size = 2 * self.settings.debias.ranks ** 2
                state.pair_sums = stored_pairs if stored_pairs is not None and len(stored_pairs) == size \
                    else np.zeros(size)
            if not state.history or state.history[-1] != self.layout.fingerprint:
                # A new configuration: the first checkpoint rewrites every bucket in it and
                # records it in the partition's history, which converts old records later.
                state.history.append(self.layout.fingerprint)
                state.rewrite_buckets = bool(snapshot.layout)
                state.meta = {"history": " ".join(state.history),
                              f"layout:{self.layout.fingerprint}": self.layout.description}
            with self.lock:
                self.partitions[p] = state
            self.lost.discard(p)
            self.fenced.discard(p)
            unsure = self._unsure.pop(p, None)
            if unsure is not None and unsure[0] == snapshot.mark:
                with self.lock:
                    self.events.update(unsure[1])   # that checkpoint was stored after all
            resume.update({(topic, p): offset for topic, offset in snapshot.offsets.items()})
        log.info("partitions assigned", extra={"partitions": partitions, "resume": len(resume),
                                               "lost": sorted(self.lost)})
        return resume

    def _load_buckets(self, p: int, stored: dict[str, bytes], old: Layout | None,
                      state: PartitionState) -> dict[BucketKey, np.ndarray]:
        """The stored buckets in this configuration's layout. Buckets that cannot be read
        (an unknown layout, an unexpected size: written before layouts were recorded) are
        dropped from the store too, with the next checkpoint: kept, they would be read as
        this layout after a restart."""
        if old is None:
            log.warning("dropping window buckets written in an unknown layout", extra={"partition": p})
            state.drop_fields = list(stored)
            return {}
        if old is not self.layout:
            log.info("configuration changed: carrying on the unchanged measures' sums",
                     extra={"partition": p, "from": old.names, "to": self.layout.names})
        buckets = {}
        for field, data in stored.items():
            vector = np.frombuffer(data, dtype=np.float64)
            if len(vector) != old.size:
                log.warning("dropping a window bucket of unexpected size", extra={"partition": p, "bucket": field})
                state.drop_fields.append(field)
                continue
            buckets[BucketKey.decode(field)] = vector.copy() if old is self.layout else self.layout.convert(vector, old)
        return buckets


    def revoke(self, partitions: Iterable[int], reclaiming: bool = False) -> None:
        """Every batch is persisted when `process` returns: forgetting is enough.
        `reclaiming`: this process claims them again at once (after a store failure), so a
        checkpoint it could not confirm is still its own to count (`_unsure`)."""
        partitions = list(partitions)
        with self.lock:
            for p in partitions:
                self.partitions.pop(p, None)
                if not reclaiming:
                    self._unsure.pop(p, None)  # another owner may replay and count that batch
            if 0 in partitions:  # the experiments' statistics are exported by partition 0's holder
                self.ab_result, self.interleaving_result = None, []
        if reclaiming:
            # After a store failure the harvest table may hold a batch that was never stored
            # (and will be replayed): start it afresh; the stored pair sums are what counts.
            # A rebalance keeps it: every batch harvested before it was stored.
            self.harvester, self._ideals = self._new_harvester(), {}
        log.info("partitions revoked", extra={"partitions": partitions})

    # ---- one batch ----

    def process(self, records: list[Record]) -> dict[tuple[str, int], int]:
        """Apply one poll batch and persist it; returns the offsets to commit to Kafka.
        Partitions whose checkpoint the store refused are dropped and listed in `fenced`
        or `lost`: the caller rejoins the group, or stops consuming them."""
        now_ms = int(self.clock() * 1000)
        self._counts = counts = {}
        work: dict[int, list[tuple[Record, Impression | Feedback]]] = {}
        advanced: dict[int, dict[str, int]] = {}
        newest: dict[int, dict[str, int]] = {}  # partition -> topic -> highest event time
        # (Attributes read once: this loop runs once per record.)
        partitions, impressions_topic, feedback_topic = self.partitions, self.impressions_topic, self.feedback_topic
        impression, feedback = self.decoder.impression, self.decoder.feedback
        for r in records:
            ps = partitions.get(r.partition)
            if ps is None or r.offset < ps.offsets.get(r.topic, 0):
                continue  # not ours, or applied before a restart: exactly once
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
                    self.dead_letter(r, event.reason)
                continue
            work.setdefault(r.partition, []).append((r, event))
            topics = newest.setdefault(r.partition, {})
            if event.timestamp_ms > topics.get(r.topic, -1):
                topics[r.topic] = event.timestamp_ms
            if isinstance(event, Feedback) and event.action == IMPRESSION_ACTION:
                ps.shown_wall_ms = self.wall() * 1000

        expired, due, harvest = self._sweep(now_ms)
        return self._step(work, advanced, newest, expired, due, now_ms, harvest)

    def end_of_input(self) -> dict[tuple[str, int], int]:
        """Settle every list still being assembled from impression events, as if event time
        had passed their settle deadlines, and persist them: the end of a replayed file."""
        now_ms = int(self.clock() * 1000)
        self._counts = {}
        due = {p: list(ps.lists) for p, ps in self.partitions.items() if ps.lists}
        return self._step({}, {}, {}, {}, due, now_ms)

    def _step(self, work: dict[int, list[tuple[Record, Impression | Feedback]]],
              advanced: dict[int, dict[str, int]], newest: dict[int, dict[str, int]],
              expired: dict[int, list[str]], due: dict[int, list[str]], now_ms: int,
              harvest: Mapping[int, list[str]] | None = None) -> dict[tuple[str, int], int]:
        counts = self._counts
        harvest = harvest or {}
        self._load_records(work, {p: expired.get(p, []) + due.get(p, []) + harvest.get(p, [])
                                  for p in {*expired, *due, *harvest}})
        touched, changed = self._join(work, now_ms)
        self._settle_due(expired, due, touched, changed)
        dirty_buckets = self._evaluate(touched, changed)
        self._harvest(harvest)
        for p, topics in newest.items():
            watermarks = self.partitions[p].watermarks
            for topic, ts in topics.items():
                # Never past this process's now: one producer with a fast clock (within
                # windows.max_future) must not close everyone's queries early.
                ts = min(ts, now_ms)
                watermarks[topic] = max(watermarks.get(topic, ts), ts)
        checkpoints = self._checkpoints(advanced, touched, expired, dirty_buckets, now_ms)
        # All partitions' checkpoints in one call (one round trip to Redis; each is still
        # applied whole, or refused, on its own).
        try:
            refused = self.store.commit(checkpoints)
        except self.store.unavailable:
            # Which of them were stored, nobody can tell until the store answers: the claim
            # after recovery counts a partition's batch if the last checkpoint stored is this
            # one (its mark: another owner's checkpoints since carry their own epoch).
            for checkpoint in checkpoints:
                self._unsure[checkpoint.partition] = (checkpoint.meta["mark"],
                                                      counts.get(checkpoint.partition, Counter()))
            raise
        with self.lock:
            for checkpoint in checkpoints:
                if checkpoint.partition not in refused:
                    self.events.update(counts.get(checkpoint.partition, {}))
        self._drop_refused(refused)
        for ps in self.partitions.values():
            _trim(ps.records, ps.states)
        return {(topic, p): offset for p, topics in advanced.items() if p not in refused
                for topic, offset in topics.items()}

    def _drop_refused(self, refused: Mapping[int, str]) -> None:
        for p, why in refused.items():
            if why == FENCED:
                log.warning("partition claimed by another replica: dropping it and rejoining",
                            extra={"partition": p})
                self.fenced.add(p)
                self.fenced_total += 1
            else:
                log.error("the state store lost this partition's state while it was consumed: "
                          "not consuming it; restart with `rankmeter serve --rebuild`", extra={"partition": p})
                self.lost.add(p)
        if refused:
            self.revoke(refused)
            # The table holds what the refused batch harvested, which was never stored:
            # start it afresh, as after a store failure.
            self.harvester, self._ideals = self._new_harvester(), {}

    def _sweep(self, now_ms: int) -> tuple[dict[int, list[str]], dict[int, list[str]], dict[int, list[str]]]:
        """Queries whose deadline the partition's event-time watermark has passed: closed
        (their contribution stays), orphaned when their impression never came, or, when
        their list is being assembled, settled (see `_settle_due`). Never closed by the
        wall clock: a backlog after an outage is joined as it would have been live.
        Also (`due`): the lists known here that are complete (`_list_ready`). Every
        second of event time or of the wall clock (serve sweeps on empty polls too).
        And (`harvest`) the queries whose clicks the watermark has made final."""
        wall_ms = self.wall() * 1000
        if (now_ms - self._last_sweep_ms < SWEEP_INTERVAL_MS and wall_ms - self._last_sweep_wall < SWEEP_INTERVAL_MS) \
                or not self.partitions:
            return {}, {}, {}
        self._last_sweep_wall = wall_ms
        topics = (self.impressions_topic, self.feedback_topic)
        due = {}
        for p, ps in self.partitions.items():
            if ps.lists and (ready := [q for q, ts in ps.lists.items() if self._list_ready(p, ts)]):
                due[p] = ready
        watermarks = {p: wm for p, ps in self.partitions.items()
                      if (wm := ps.watermark(topics, {t for t, q in self.caught_up if q == p})) is not None}
        if not watermarks:
            return {}, due, {}
        harvest = {}
        for p, wm in watermarks.items():
            queue = self.partitions[p].harvest_queue
            ready = []
            while queue and queue[0][0] <= wm:
                ready.append(heapq.heappop(queue)[1])
            if ready:
                harvest[p] = ready
        found = self.store.expired(watermarks, SWEEP_LIMIT)
        expired = {}
        for p, (qids, open_count) in found.items():
            self.partitions[p].open_queries = open_count - len(qids)
            if qids:
                expired[p] = qids
        if all(len(q) < SWEEP_LIMIT for q in expired.values()):
            self._last_sweep_ms = now_ms  # else go on closing at the next batch
        return expired, due, harvest

    def _load_records(self, work: dict[int, list[tuple[Record, Impression | Feedback]]],
                      swept: dict[int, list[str]]) -> None:
        """Bring the records the batch needs (and the swept ones: to count orphans, or to
        settle their lists) into the cache: one read for all partitions."""
        needed = {p: [event.query_id for _, event in items] for p, items in work.items()}
        for p, qids in swept.items():
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
                cache[qid] = self._in_layout(decode(data), self.partitions[p].history) if data is not None \
                    else QueryRecord()

    def _in_layout(self, record: QueryRecord, history: list[str]) -> QueryRecord:
        """A record written under an earlier configuration of its partition (`layout`: its
        index in the partition's history): its contributions converted through every
        configuration since, as the buckets were, so the next delta moves only what they
        all share. One whose layout is unknown adds its whole value again; its bucket was
        dropped (see `_load_buckets`)."""
        current = len(history) - 1
        generation = int(record.layout) if record.layout.isdigit() else -1
        if generation == current:
            return record
        legacy = isinstance(record.contribution, bytes)  # format 1: the vector itself
        if generation < 0 or generation > current:
            if legacy and len(record.contribution) == 8 * self.layout.size and not record.layout:
                return record  # written before layouts were recorded, in this one
            record.contribution = b""
            return record
        vector = np.frombuffer(record.contribution) if legacy else self._unpacked(record.contribution, history[generation])
        for before, after in zip(history[generation:], history[generation + 1:]):
            old, new = self._layouts.get(before), self._layouts.get(after)
            if old is None or new is None or len(vector) != old.size:
                record.contribution = b""
                return record
            vector = new.convert(vector, old)
        # Its A/B contribution stays: it belongs to the experiment of the old layout.
        record.contribution = vector.tobytes()
        return record

    def _unpacked(self, scores: msgspec.msgpack.Ext, fingerprint: str) -> np.ndarray:
        """A format-2 record's contribution vector in the layout it was written in (empty
        when that layout, or the scores, cannot be read)."""
        if scores.code != SCORES:  # (a future format: taken as zero it would count the query twice)
            raise ValueError(f"query record in an unknown format (msgpack ext {scores.code})")
        layout = self._layouts.get(fingerprint)
        m = len(layout.names) if layout is not None else 0
        if layout is None or len(scores.data) != 8 * (3 * m + 1):
            return np.empty(0)
        return layout.contributions(*unpack_scores([scores], m))[0]

    def _keep_last(self, rows: np.ndarray, columns: slice, previous: np.ndarray, values: np.ndarray,
                   nums: np.ndarray, dens: np.ndarray) -> None:
        """Give `rows` the value, numerator and denominator they had in `columns` (measures
        averaged over all queries, without histogram bins: the debiased ones), read back
        from their previous contribution: [value, counted, numerator, denominator, value²]
        per measure, value NaN where it was not counted. The contribution rebuilt from
        them, and the scores stored, are then the previous ones in those columns."""
        last = previous[np.ix_(rows, range(SLOTS * columns.start, SLOTS * columns.stop))]
        last = last.reshape(len(last), columns.stop - columns.start, SLOTS)
        counted = last[:, :, 1] != 0
        values[rows, columns] = np.where(counted, last[:, :, 0], np.nan)
        nums[rows, columns] = np.where(counted, last[:, :, 2], 0.0)
        dens[rows, columns] = np.where(counted, last[:, :, 3], 0.0)

    def _previous(self, records: list[QueryRecord]) -> np.ndarray:
        """[Q, size]: what each record adds to its window bucket now (in this layout, which
        `_in_layout` brought it to), zero before its first evaluation. Packed scores
        (format 2) are expanded together, in one call."""
        previous = np.zeros((len(records), self.layout.size))
        packed = []
        for i, record in enumerate(records):
            c = record.contribution
            if isinstance(c, bytes):
                if c:
                    previous[i] = np.frombuffer(c)
            elif c.code == SCORES and len(c.data) == self._scores_bytes:
                packed.append(i)
            else:  # a format this version cannot read: taken as zero it would count the query twice
                raise ValueError(f"query record in an unknown format (msgpack ext {c.code}, {len(c.data)} bytes)")
        if packed:
            previous[packed] = self.layout.contributions(
                *unpack_scores([records[i].contribution for i in packed], len(self.layout.names)))
        return previous

    def _join(self, work: dict[int, list[tuple[Record, Impression | Feedback]]], now_ms: int
              ) -> tuple[dict[_Touched, QueryRecord], dict[_Touched, set[str] | None]]:
        """Apply events to their records. `changed` holds, per query with an impression,
        the documents whose grade may have changed (None: evaluate from scratch)."""
        touched: dict[_Touched, QueryRecord] = {}
        changed: dict[_Touched, set[str] | None] = {}
        for p, events in work.items():
            cache = self.partitions[p].records
            count = self._counts.setdefault(p, Counter())
            for source, event in events:
                key = _Touched(p, event.query_id)
                record = cache[event.query_id]
                touched[key] = record
                if isinstance(event, Impression):
                    outcome, waiting = apply_impression(record, event, self.attribution)
                    if outcome == "pending":  # its list comes from impression events
                        ps = self.partitions[p]
                        ps.lists[event.query_id] = event.timestamp_ms
                        ps.meta[LIST + event.query_id] = str(event.timestamp_ms)
                        if record.shown:
                            self._shown(p, event.timestamp_ms, now_ms)
                        if complete(record):
                            self._settle(key, record, changed)
                        continue
                    count[("impressions", outcome)] += 1
                    if outcome == "applied":
                        self._applied(key, record, waiting, changed)
                else:
                    outcome = apply_feedback(record, event, self.attribution, self.max_events)
                    if outcome == "flooded":
                        outcome = "invalid"
                        self.dead_letter(source, f"query {event.query_id!r} already has {self.max_events} "
                                                 f"feedback events (limits.max_events_per_query)")
                    if event.action == IMPRESSION_ACTION and outcome != "duplicate":
                        known = record.header or record.impression
                        if known is not None:
                            self._shown(p, known.timestamp_ms, now_ms)
                    if outcome != "pending":  # counted once, by what becomes of it
                        count[("feedback", outcome)] += 1
                    elif complete(record):  # the impression event that completes its list
                        self._settle(key, record, changed)
                    if outcome == "applied" and key not in changed:
                        changed[key] = set()
                    if outcome == "applied" and changed[key] is not None:
                        changed[key].add(event.doc_id)
        return touched, changed

    def _shown(self, p: int, query_ms: int, now_ms: int) -> None:
        """An impression event of a query at `query_ms` came: the partition's impression
        events have reached that time. The query record's time (the search engine's clock),
        not the event's (a browser's, which may run fast or slow)."""
        watermarks = self.partitions[p].watermarks
        query_ms = min(query_ms, now_ms)
        if query_ms > watermarks.get(SHOWN, -1):
            watermarks[SHOWN] = query_ms

    def _applied(self, key: _Touched, record: QueryRecord, waiting: list[tuple[str, str]],
                 changed: dict[_Touched, set[str] | None]) -> None:
        """A query's list is known: label it, enrol it, count the feedback that waited."""
        impression = record.impression
        record.ranker_label = self._label("ranker", impression.ranker)
        record.segment_label = self._label("segment", impression.segment) if impression.segment else ""
        record.ab_experiment = self._enrol(record)
        changed[key] = None
        ps = self.partitions[key.partition]
        if ps.pair_sums is not None and impression.query_hash and len(ps.harvest_queue) < HARVEST_QUEUE_LIMIT \
                and zlib.crc32(key.query_id.encode()) < self.harvest_below:
            heapq.heappush(ps.harvest_queue, (impression.timestamp_ms + self.attribution.implicit_ms, key.query_id))
        count = self._counts.setdefault(key.partition, Counter())
        for fb_outcome, _ in waiting:
            count[("feedback", fb_outcome)] += 1

    def _settle(self, key: _Touched, record: QueryRecord, changed: dict[_Touched, set[str] | None]) -> None:
        """Evaluate a query whose list was assembled from impression events (join.settle)."""
        used, waiting = settle(record, self.attribution, self.max_results)
        ps = self.partitions[key.partition]
        ps.lists.pop(key.query_id, None)
        if ps.meta.pop(LIST + key.query_id, None) is None:  # stored by an earlier checkpoint
            ps.meta_deleted.append(LIST + key.query_id)
        count = self._counts.setdefault(key.partition, Counter())
        count[("impressions", "applied")] += 1
        count[("feedback", "listed")] += used
        self._applied(key, record, waiting, changed)

    def _list_ready(self, p: int, ts: int) -> bool:
        """Whether the list of a query at event time `ts` is complete: the partition's
        impression events have passed `ts` plus `windows.list_settle` in event time (clicks,
        which come later in event time, do not count: a slow click read before the next
        queries' impression events must not cut their lists short); or they have reached
        `ts` and then none came for `windows.list_settle` of processing time while the
        feedback topic is read to its end (a quiet spell: the last lists before it). While
        the impression events stay behind `ts` (their producer is down), the list waits."""
        ps = self.partitions[p]
        shown_ms = ps.watermarks.get(SHOWN, -1)
        if shown_ms >= ts + self.settle_ms:
            return True
        return (shown_ms >= ts and (self.feedback_topic, p) in self.caught_up
                and ps.shown_wall_ms + self.settle_ms <= self.wall() * 1000)

    def _settle_due(self, expired: dict[int, list[str]], due: dict[int, list[str]],
                    touched: dict[_Touched, QueryRecord], changed: dict[_Touched, set[str] | None]) -> None:
        """Settle the lists found complete (`due`), and those whose query's attribution
        window the sweep found passed (no click could count any more: settled with what
        came, not closed)."""
        for p in {*expired, *due}:
            ps = self.partitions[p]
            settle_now = list(due.get(p, ()))
            found = {qid for qid in expired.get(p, ()) if (r := ps.records.get(qid)) is not None and r.assembling}
            if found:
                expired[p] = [q for q in expired[p] if q not in found]
            for qid in settle_now + sorted(found):
                record = ps.records.get(qid)
                if record is not None and record.assembling:
                    key = _Touched(p, qid)
                    touched[key] = record
                    self._settle(key, record, changed)

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
        ratios = {**evaluate(self.measures, batch), **evaluate_online(clicks_of(records, [s.rank_of for s in states]))}
        for i, (m, ratio) in enumerate(ratios.items()):   # in the layout's order: measures, then signals
            values[:, i], nums[:, i], dens[:, i] = m.values(ratio), ratio.num, ratio.den
        if self.debiased:  # ... then the debiased measures
            self._debiased_values(records, values[:, len(ratios):], nums[:, len(ratios):], dens[:, len(ratios):])
            held = self._debiased_population(records, values[:, len(ratios):])
        judged = batch.num_rel > 0
        self._move_experiment(keys, records, values, nums, dens, judged)
        self._move_interleaving(keys, records)
        previous = self._previous(records)
        if self.debiased and held.any():  # in the debiased measures, no value now: keep the last
            self._keep_last(held, slice(len(ratios), len(names)), previous, values, nums, dens)
        contributions = self.layout.contributions(values, nums, dens, judged)
        deltas = contributions - previous

        # Sum the deltas per bucket first: a batch touches few buckets and many queries.
        buckets = [(k.partition, r.ranker_label, r.segment_label, r.impression.timestamp_ms // MINUTE_MS)
                   for k, r in zip(keys, records)]
        index = {b: i for i, b in enumerate(dict.fromkeys(buckets))}
        # Rows grouped by bucket (a stable sort), summed per group: several times faster
        # than np.add.at; the same sums to rounding (reduceat adds in its own order: the
        # last bits may differ, counts are exact).
        rows = np.array([index[b] for b in buckets])
        order = np.argsort(rows, kind="stable")
        starts = np.flatnonzero(np.diff(rows[order], prepend=-1))
        totals = np.add.reduceat(deltas[order], starts, axis=0)
        # What is stored is the scores the contribution is a function of (a quarter of its size).
        for record, scores in zip(records, pack_scores(values, nums, dens, judged)):
            record.contribution = scores
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

    def _new_harvester(self) -> Harvester | None:
        d = self.settings.debias
        return Harvester(d.ranks, d.capacity) if self.debiased else None

    def _debiased_values(self, records: list[QueryRecord], values: np.ndarray, nums: np.ndarray,
                         dens: np.ndarray) -> None:
        """The IPW variants (debias/ipw.py), in place: each query's implicit grades times
        the clipped inverse propensity of their rank, DCG@k as the engine computes it
        (`ipw.dcg_of`, checked against it: tests/test_propensity.py). nDCG@k divides by the
        ideal DCG@k of the query text's pooled debiased grades (`Harvester.ideal_dcg`), the
        same whichever ranker answered: a list's own ideal would cancel the weights.
        Without a pooled ideal (a text not harvested yet), or before the first estimate
        of the propensities, the query has no value.
        Explicit judgments are left out: they carry no position bias, and the raw series
        has them."""
        if self.propensities.relative[0] is None:
            values[:], nums[:], dens[:] = np.nan, 0.0, 0.0  # nothing to weigh with yet: no value
            return
        depth = max(int(m.cutoff) for m in self.debiased)
        weights = ipw.weights(self.propensities.relative, max(depth, self.settings.debias.ranks),
                              self.settings.debias.max_weight)
        for i, r in enumerate(records):
            implicit, impression = r.implicit, r.impression
            gains = [implicit.get(doc, 0.0) * w for doc, w in zip(impression.results[:depth], weights)]
            for j, m in enumerate(self.debiased):
                k = int(m.cutoff)
                dcg = ipw.dcg_of(gains, k)
                if m.family == "DCG":
                    values[i, j], nums[i, j], dens[i, j] = dcg, dcg, 1.0
                    continue
                ideal = self._ideal(impression.query_hash, weights, k)
                if ideal:
                    values[i, j], nums[i, j], dens[i, j] = dcg / ideal, dcg, ideal
                else:
                    values[i, j], nums[i, j], dens[i, j] = np.nan, 0.0, 0.0

    def _debiased_population(self, records: list[QueryRecord], values: np.ndarray) -> np.ndarray:
        """Which queries count in the debiased measures is decided once, at a query's first
        evaluation (at its list, before any click): those with a value then (the
        propensities estimated, its text's ideal known) count from then on, the others
        never. Deciding again at each click would let clicked queries in and keep the
        unclicked out, and bias the average up. Returns the queries that count but have
        no value now (the table restarted, their text evicted): they keep their last."""
        defined = ~np.isnan(values).any(axis=1)
        held = np.zeros(len(records), dtype=bool)
        for i, r in enumerate(records):
            if r.debiased == 0:
                # (a query evaluated before, by a version or configuration without the
                # debiased measures, is decided at a click now: it stays out)
                r.debiased = 1 if defined[i] and not r.contribution else 2
            if r.debiased == 2:
                values[i] = np.nan
            elif not defined[i]:
                held[i] = True
        return held

    def _ideal(self, query: str, weights: list[float], depth: int) -> float | None:
        """The query text's pooled ideal DCG, cached until the propensities are looked at
        again (every 5 s in serve): what that text's harvest adds meanwhile waits until
        then (recomputing a popular text's ideal at each of its harvests cost more than
        the rest of the correction)."""
        if self.harvester is None or not query:
            return None
        key = (query, depth)
        if key not in self._ideals:
            self._ideals[key] = self.harvester.ideal_dcg(query, weights, depth)
        return self._ideals[key]

    def _harvest(self, due: Mapping[int, list[str]]) -> None:
        """Queries whose clicks are final (their implicit attribution is over) into the
        position-bias harvest, once each (`debias.propensity`); what they add to the pair
        sums goes to their partition's, stored with its next checkpoint."""
        for p, qids in due.items():
            ps = self.partitions.get(p)
            if ps is None or ps.pair_sums is None or self.harvester is None:
                continue
            before = self.harvester.sums.to_vector()
            for qid in qids:
                record = ps.records.get(qid)
                if record is not None and record.impression is not None:
                    self.harvester.observe(record.impression.query_hash, record.impression.results,
                                           set(record.clicked), record.implicit)
            with self.lock:
                ps.pair_sums = ps.pair_sums + (self.harvester.sums.to_vector() - before)
                ps.ab[PAIRS] = ps.pair_sums
                ps.dirty_ab.add(PAIRS)

    def look_at_position_bias(self, estimate_here: bool) -> None:
        """Refresh the propensities the debiased measures use. Partition 0's holder
        estimates them from every partition's stored pair sums and stores the estimate
        (`rankmeter_propensity`); the other replicas read it, so all weigh alike."""
        d = self.settings.debias
        if not self.debiased:
            return
        name = f"propensity|ranks={d.ranks}|min_pairs={d.min_pairs}"
        if estimate_here:
            size = 2 * d.ranks ** 2
            sums = [PairSums.from_vector(np.frombuffer(fields[PAIRS]))
                    for fields in self.store.load_ab(self.store.partitions()).values()
                    if PAIRS in fields and len(fields[PAIRS]) == 8 * size]
            if not sums:
                return
            found = estimate(merge(sums), d.min_pairs)
            self.store.save_running(name, {"relative": json.dumps(found.relative),
                                           "support": json.dumps(found.support)})
        else:
            kept = self.store.load_running(name)
            if not kept:
                return
            relative, support = json.loads(kept["relative"]), json.loads(kept["support"])
            if len(relative) != d.ranks:
                return
            found = Propensities(relative, support, 0)
        with self.lock:
            self._ideals = {}  # weighed anew, with the harvest since the last look
            self.propensities = found

    def _experiment(self) -> str | None:
        """The experiment's name: baseline, start, and the measures' layout, so that a
        configuration change starts a new experiment (sums that mix two definitions of a
        measure, or a population enrolled under another one, are no experiment)."""
        if self.experiment_start is None:
            return None
        return f"{self.baseline}@{self.experiment_start}@{self.ab_layout.fingerprint}"

    def _enrol(self, record: QueryRecord) -> str:
        """The experiment an impression belongs to, decided once, when it is applied, by its
        time alone: every impression of a ranker from `ab.start` on, and nothing that
        feedback could select later. Interleaved lists have their own experiment."""
        impression = record.impression
        if self.experiment_start is None or impression.experiment or impression.timestamp_ms < self.experiment_start:
            return ""
        return self._experiment() or ""

    def _move_experiment(self, keys: list[_Touched], records: list[QueryRecord], values: np.ndarray,
                         nums: np.ndarray, dens: np.ndarray, judged: np.ndarray) -> None:
        """Move the experiment's cumulative arm sums by the changed queries' new minus old
        A/B contributions (every enrolled impression counts, unjudged ones as 0)."""
        experiment = self._experiment()
        inside = [experiment is not None and r.ab_experiment == experiment for r in records]
        if not any(inside):
            return
        m = len(self.ab_layout.names)  # the debiased measures, last, are not in experiments
        new = ab_sums.contributions(self.ab_layout, values[:, :m], nums[:, :m], dens[:, :m], judged)
        zero = bytes(8 * self.ab_size)
        with self.lock:
            for k, record, vector, counts in zip(keys, records, new, inside):
                if not counts:
                    continue
                old = record.ab_contribution or zero
                field = f"{experiment}\x1f{record.ranker_label}\x1f{record.segment_label}"
                ps = self.partitions[k.partition]
                sums = ps.ab.get(field)
                if sums is None:
                    sums = ps.ab[field] = np.zeros(self.ab_size)
                sums += vector - np.frombuffer(old)
                ps.dirty_ab.add(field)
                record.ab_contribution = vector.tobytes()

    def _move_interleaving(self, keys: list[_Touched], records: list[QueryRecord]) -> None:
        """Team-draft credit (Radlinski et al., CIKM 2008): each clicked document counts for
        the team that contributed its position; the team with more clicks wins the query.
        A query's outcome moves the experiment's counts when later clicks change it."""
        for k, record in zip(keys, records):
            impression = record.impression
            if not impression.experiment:
                continue
            a, b = sorted(set(impression.teams))
            credit = Counter(impression.teams[impression.results.index(doc)] for doc in record.clicked)
            outcome = -1 if not record.clicked else 0 if credit[a] > credit[b] else 1 if credit[b] > credit[a] else 2
            if outcome == record.interleaving_outcome:
                continue
            field = f"il\x1f{impression.experiment}\x1f{a}\x1f{b}"
            ps = self.partitions[k.partition]
            with self.lock:
                counts = ps.ab.setdefault(field, np.zeros(3))
                if record.interleaving_outcome >= 0:
                    counts[record.interleaving_outcome] -= 1
                if outcome >= 0:
                    counts[outcome] += 1
            ps.dirty_ab.add(field)
            record.interleaving_outcome = outcome

    def _checkpoints(self, advanced: dict[int, dict[str, int]], touched: dict[_Touched, QueryRecord],
                     expired: dict[int, list[str]], dirty_buckets: dict[int, set[BucketKey]],
                     now_ms: int) -> list[Checkpoint]:
        encode = self._record_codec[0].encode
        oldest_minute = (now_ms - self.retention_ms) // MINUTE_MS
        records: dict[int, dict[str, bytes]] = {}
        deadlines: dict[int, dict[str, int]] = {}
        for k, r in touched.items():
            r.layout = str(len(self.partitions[k.partition].history) - 1)
            records.setdefault(k.partition, {})[k.query_id] = encode(r)
            deadlines.setdefault(k.partition, {})[k.query_id] = self._deadline(r)
        checkpoints = []
        pending = {p for p, ps in self.partitions.items() if ps.dirty_ab or ps.meta or ps.drop_fields or ps.meta_deleted}
        for p in set(advanced) | set(expired) | set(dirty_buckets) | pending:
            ps = self.partitions[p]
            ps.offsets.update(advanced.get(p, {}))
            written = records.get(p, {})
            deleted = []
            for qid in expired.get(p, []):
                if qid in written:
                    continue  # events in this batch: its new deadline decides
                record = ps.records.pop(qid, None)
                ps.states.pop(qid, None)
                if record is not None and record.impression is None:
                    self._counts.setdefault(p, Counter())[("feedback", "orphaned")] += \
                        len(record.pending) + len(record.shown)
                ps.lists.pop(qid, None)
                deleted.append(qid)
            with self.lock:
                dropped = [b for b in ps.buckets if b.minute < oldest_minute]
                for b in dropped:
                    del ps.buckets[b]
                rewrite = ps.buckets if ps.rewrite_buckets else dirty_buckets.get(p, ())
                buckets = {b.encode(): ps.buckets[b].tobytes() for b in rewrite if b in ps.buckets}
                ab = {f: ps.ab[f].tobytes() for f in (ps.ab if ps.rewrite_buckets else ps.dirty_ab)}
                ps.rewrite_buckets = False
                ps.dirty_ab = set()
                dropped_fields = [b.encode() for b in dropped] + ps.drop_fields
                meta, ps.meta, ps.drop_fields = ps.meta, {}, []
                meta_deleted, ps.meta_deleted = ps.meta_deleted, []
                ps.checkpoints += 1
                meta["mark"] = f"{ps.epoch}:{ps.checkpoints}"
            checkpoints.append(Checkpoint(
                partition=p, epoch=ps.epoch, layout=self.layout.fingerprint, offsets=dict(ps.offsets),
                watermarks=dict(ps.watermarks), records=written, deadlines=deadlines.get(p, {}),
                deleted=deleted, buckets=buckets, dropped_buckets=dropped_fields, ab=ab, meta=meta,
                meta_deleted=meta_deleted))
        return checkpoints

    def _deadline(self, record: QueryRecord) -> int:
        """The event time at which the query closes: its impression's time plus the
        longest attribution (judgments'); without an impression yet, counted from its
        latest feedback (an impression that never comes leaves it orphaned then). A query
        assembling its list is settled, at the latest, when its attribution window has
        passed (`_settle_due`)."""
        if record.impression is not None:
            return record.impression.timestamp_ms + self.attribution.explicit_ms
        if record.header is not None:
            return record.header.timestamp_ms + self.attribution.implicit_ms
        explicit = any(fb.explicit for fb in record.pending)
        window = self.attribution.explicit_ms if explicit else self.attribution.implicit_ms
        return max([fb.timestamp_ms for fb in record.pending] + [ts for *_, ts in record.shown]) + window

    # ---- labels ----

    def _label(self, kind: str, value: str) -> str:
        """The value itself while fewer than the cap are in use (across replicas, within
        `limits.label_idle`), else `other`. Checked again every LABEL_REFRESH_MS, which
        also keeps an admitted value's last use fresh."""
        now_ms = int(self.clock() * 1000)
        cached = self._labels.get((kind, value))
        if cached is not None and now_ms - cached[1] < LABEL_REFRESH_MS:
            return cached[0]
        cap = self.settings.limits.max_rankers if kind == "ranker" else self.settings.limits.max_segments
        admitted = value != OTHER and self.store.admit_label(kind, value, cap, now_ms, self.label_idle_ms)
        label = value if admitted else OTHER
        if not admitted and (cached is None or cached[0] != OTHER):
            self.folded[kind] += 1
            log.warning("label folded into 'other'", extra={"kind": kind, "value": value[:100]})
        self._labels[(kind, value)] = (label, now_ms)
        return label

    # ---- for the exporter ----

    def views(self, now_ms: int | None = None) -> list[WindowView]:
        now_ms = int(self.clock() * 1000) if now_ms is None else now_ms
        with self.lock:
            return window_views([ps.buckets for ps in self.partitions.values()],
                                self.layout, self.windows, now_ms)

    def ab_look(self, save: bool = True) -> Look | None:
        """One look at the experiment, over every partition's stored arm sums (the
        statistics are global: serve runs this on the replica that holds partition 0).
        Keeps the result for the exporter in `ab_result`; with `save`, stores what the
        running statistics keep, and a line of history once a minute. Interleaving
        experiments are looked at too (`interleaving_result`)."""
        stored = self.store.load_ab(self.store.partitions())
        self._look_at_interleaving(stored, save)
        if not self.baseline:
            return None
        experiment = self._experiment()
        if experiment is None:
            return None
        vectors: dict[tuple[str, str], np.ndarray] = {}
        for fields in stored.values():
            for field, data in fields.items():
                if field == PAIRS or field.startswith("il\x1f"):
                    continue
                name, ranker, segment = field.split("\x1f", 2)
                vector = np.frombuffer(data)
                if name != experiment or len(vector) != self.ab_size:
                    continue  # another experiment, or a replica still on another configuration
                vectors[(ranker, segment)] = vectors.get((ranker, segment), 0) + vector
        # What the running statistics keep depends on alpha, τ² and the split too.
        a = self.settings.ab
        state = f"{experiment}|alpha={a.alpha}|tau2={a.mixture_variance}|split={sorted(a.split.items())}"
        running = self.store.load_running(state)
        result, kept = ab_look(experiment, self.baseline, vectors, self.ab_layout, self.settings.ab, running)
        now_ms = int(self.clock() * 1000)
        if save:
            self.store.save_running(state, kept)
            if now_ms - self._last_history_ms >= HISTORY_INTERVAL_MS:
                self.store.append_look(experiment, ab_report.snapshot(result, now_ms), HISTORY_KEEP)
                self._last_history_ms = now_ms
        self.ab_result = result
        return result

    def _look_at_interleaving(self, stored: Mapping[int, Mapping[str, bytes]], save: bool) -> None:
        vectors: dict[tuple[str, str, str], np.ndarray] = {}
        for fields in stored.values():
            for field, data in fields.items():
                if field.startswith("il\x1f"):
                    _, experiment, a, b = field.split("\x1f")
                    vectors[(experiment, a, b)] = vectors.get((experiment, a, b), 0) + np.frombuffer(data)
        if not vectors:
            self.interleaving_result = []
            return
        running = self.store.load_running("interleaving")
        self.interleaving_result, kept = interleaving_look(vectors, self.settings.ab, running)
        if save:
            self.store.save_running("interleaving", kept)

    def open_queries(self) -> int:
        return sum(ps.open_queries for ps in list(self.partitions.values()))


def _trim(records: dict[str, QueryRecord], states: dict[str, QueryState]) -> None:
    """Bound the cache: forget the oldest entries (they are in the store)."""
    excess = len(records) - CACHE_LIMIT
    if excess > 0:
        for qid in list(records)[:excess]:
            del records[qid]
            states.pop(qid, None)
