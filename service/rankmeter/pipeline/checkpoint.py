"""The checkpoint: what one batch changed, committed through the store, in five steps.

    1. Build (`Checkpoint.build`), per partition the batch changed: the records written
       and their event-time deadlines; the records closed, deleted (those that never had
       an impression counted as orphaned); the buckets changed (every bucket after a
       configuration change) and those past every window dropped; the A/B sums changed;
       the users they enrolled (pipeline/users.py), the metadata (layout history, lists being
       assembled) and the checkpoint's mark,
       `epoch:number`, which tells its owner later whether it was stored.
    2. Send (`send`): every partition's checkpoint in one `store.commit`, one round trip;
       the store applies each whole or refuses it (store.py, PartitionCheckpoint). If the
       store fails midway, nobody can tell which were stored: each partition's batch is
       unsure (its mark and counts kept in the `Ledger`) and the failure is raised.
    3. Confirm (`confirm`): the batch's events are counted for the partitions applied, and
       the offset resets they resumed past (pipeline/offsets.py);
       the refused ones are fenced (another replica claimed them), lost (their state is
       gone) or rewound (the store lost their last checkpoints: claimed again from what
       it holds, `Ledger.rewound`), and dropped.
    4. Settle at claim (`Ledger.claimed`): when an unsure partition is claimed again, its
       batch is counted if the last checkpoint stored carries the unsure one's mark (a
       newer owner's checkpoints carry their own epoch).
    5. Hand the offsets to the source (`commit`): Kafka's commit is for lag tooling only;
       offsets are resumed from the store.

Nothing else calls `store.commit`. Send and confirm are separate so that one batch's
commit can overlap decoding the next.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from rankmeter.join import QueryRecord
from rankmeter.pipeline.context import Batch, Outcomes
from rankmeter.pipeline.state import PartitionState, Reset
from rankmeter.source import Source
from rankmeter.store import FENCED, LOST, PartitionCheckpoint, Store
from rankmeter.windows import MINUTE_MS

log = logging.getLogger("rankmeter.pipeline")


class Unsure(NamedTuple):
    mark: str          # the checkpoint's mark (PartitionCheckpoint.meta["mark"])
    counts: Outcomes   # its batch's events, counted if it was stored after all
    resets: list[Reset]  # and the offset resets it resumed past


class Ledger:
    """What the checkpoints have settled, across batches: the events of stored batches,
    the checkpoints whose commit failed midway (`unsure`), and the partitions refused."""

    def __init__(self, store: Store, lock: threading.Lock) -> None:
        self.store = store
        self.lock = lock   # between the batch and the exporter's scrape
        self.events: Counter[tuple[str, str]] = Counter()  # (stream, outcome), of stored batches
        self.unsure: dict[int, Unsure] = {}
        self.lost: set[int] = set()     # partitions whose stored state is gone (not consumed)
        self.fenced: set[int] = set()   # partitions another replica took over (rejoin)
        self.fenced_total = 0
        # Partitions wiped for `--rebuild` and not checkpointed since: a rebalance before
        # their first checkpoint rebuilds them again instead of finding them lost.
        self.rebuilding: set[int] = set()
        # The store lost its last writes (store.REWOUND): partitions to claim again from
        # what it holds, and each partition's losses found (a refusal or at a claim).
        self.rewound: set[int] = set()
        self.checkpoints_lost: Counter[int] = Counter()
        # Offsets gone backwards (pipeline/offsets.py): (topic, partition, cause) found, the
        # offsets skipped when resuming, and the partitions refused for it -> why.
        self.offsets_reset: Counter[tuple[str, int, str]] = Counter()
        self.offsets_skipped: Counter[tuple[str, int]] = Counter()
        self.stopped: dict[int, str] = {}
        self.recheck: set[int] = set()  # not known whether its log was reset: claim it again

    def count(self, counts: Iterable[Outcomes]) -> None:
        with self.lock:
            for c in counts:
                self.events.update(c)

    def resumed(self, partition: int, resets: Iterable[Reset]) -> None:
        """Offset resets a stored checkpoint resumed past: counted once, when stored."""
        with self.lock:
            for r in resets:
                self.offsets_reset[(r.topic, partition, r.cause)] += 1
                self.offsets_skipped[(r.topic, partition)] += r.skipped

    def claimed(self, partition: int, mark: str) -> None:
        """Step 4: the partition is ours again; its unsure batch counts if it was stored."""
        self.lost.discard(partition)
        self.fenced.discard(partition)
        self.stopped.pop(partition, None)
        self.recheck.discard(partition)
        unsure = self.unsure.pop(partition, None)
        if unsure is not None and unsure.mark == mark:
            self.count([unsure.counts])
            self.resumed(partition, unsure.resets)

    def forget(self, partition: int) -> None:
        self.unsure.pop(partition, None)

    def refused(self, refused: Mapping[int, str]) -> None:
        """The refused partitions: fenced (another replica claimed them), rewound (to claim
        again from the store) or lost."""
        for p, why in refused.items():
            if why == FENCED:
                log.warning("partition claimed by another replica: dropping it and rejoining",
                            extra={"partition": p})
                self.fenced.add(p)
                self.fenced_total += 1
            elif why != LOST:
                log.error("the state store no longer holds this partition's last checkpoint (restored "
                          "from an older copy, or failed over to a replica behind): claiming it again "
                          "from what it holds and re-reading Kafka from there", extra={"partition": p})
                self.rewound.add(p)
            else:
                log.error("the state store lost this partition's state while it was consumed: "
                          "not consuming it; restart with `rankmeter serve --rebuild`", extra={"partition": p})
                self.lost.add(p)


@dataclass(frozen=True)
class Writing:
    """How the pipeline's state is written: the layout's fingerprint, how long buckets are
    kept, a record's encoding and its deadline."""
    layout: str
    retention_ms: int
    encode: Callable[[QueryRecord], bytes]
    deadline: Callable[[QueryRecord], int]


class Checkpoint:
    """One batch's checkpoint: `build` it, `send` it, `confirm` it, `commit` its offsets,
    in that order (a step out of order raises: counting or committing a batch that was not
    stored would count it twice, or make the next owner find its partition lost)."""

    def __init__(self, ledger: Ledger, payloads: list[PartitionCheckpoint], counts: dict[int, Outcomes],
                 advanced: dict[int, dict[str, int]], settled: Callable[[list[int]], None],
                 resets: dict[int, list[Reset]] | None = None,
                 completing: Callable[[dict[int, PartitionCheckpoint]], None] | None = None) -> None:
        # What the steps need of the batch, and no more: the batch's events and records
        # are not kept alive while the next batch is read.
        self.ledger = ledger
        self.payloads = payloads
        self.partitions = [c.partition for c in payloads]
        self.counts = counts      # partition -> the batch's event outcomes
        self.advanced = advanced  # partition -> topic -> the next offset read
        self.resets = resets or {}  # partition -> the offset resets its checkpoint resumed past
        self.settled = settled    # the pipeline's, at confirm: drop the refused partitions, trim the cache
        self.completing = completing  # at send, before the commit: the batch's harvest into its payloads
        self.refused: dict[int, str] = {}
        self.step = "built"

    @classmethod
    def build(cls, batch: Batch, held: Mapping[int, PartitionState], writing: Writing, ledger: Ledger,
              settled: Callable[[list[int]], None],
              harvest: Callable[[Mapping[int, Mapping[str, QueryRecord]], Mapping[int, PartitionCheckpoint]], None]
              | None = None
              ) -> Checkpoint:
        """Step 1. `harvest(due, payloads)` runs at step 2, before the commit: the batch's
        queries whose clicks are final, into the position-bias tables and their partitions'
        payloads (a partition with only a harvest has a payload for it)."""
        records: dict[int, dict[str, bytes]] = {}
        deadlines: dict[int, dict[str, int]] = {}
        encode, deadline = writing.encode, writing.deadline
        layouts: dict[int, str] = {}  # partition -> its layout's index (the same for all its records)
        for (p, qid), r in batch.touched.items():
            layout = layouts.get(p)
            if layout is None:
                layout = layouts[p] = str(len(held[p].history) - 1)
                records[p], deadlines[p] = {}, {}
            r.layout = layout
            records[p][qid] = encode(r)
            deadlines[p][qid] = deadline(r)
        payloads = []
        resets: dict[int, list[Reset]] = {}
        pending = {p for p, ps in held.items()
                   if ps.dirty_ab or ps.users or ps.meta or ps.drop_fields or ps.meta_deleted or ps.offsets_moved}
        harvested = {p for p in batch.harvest if harvest is not None and p in held and held[p].pair_sums is not None}
        # The records to harvest, taken now: the eviction below drops the expired ones from
        # the cache, and a query can be final and expire in the same sweep.
        due = {p: {q: r for q in batch.harvest[p] if (r := held[p].records.get(q)) is not None} for p in harvested}
        for p in set(batch.advanced) | set(batch.expired) | set(batch.dirty_buckets) | pending | harvested:
            ps = held[p]
            ps.offsets.update(batch.advanced.get(p, {}))
            written = records.get(p, {})
            deleted = []
            for qid in batch.expired.get(p, []):
                if qid in written:
                    continue  # events in this batch: its new deadline decides
                record = ps.records.pop(qid, None)
                ps.states.pop(qid, None)
                if record is not None and record.impression is None:
                    batch.count(p)[("feedback", "orphaned")] += len(record.pending) + len(record.shown)
                ps.lists.pop(qid, None)
                deleted.append(qid)
            # Buckets expire by the partition's newest event time (capped at now), not by the
            # wall clock alone: a forward jump of the clock longer than the retention must
            # not delete every bucket.
            newest = min(batch.now_ms, max(ps.watermarks.values(), default=-1))
            oldest_minute = (newest - writing.retention_ms) // MINUTE_MS if newest >= 0 else None
            with ledger.lock:
                dropped = [b for b in ps.buckets if oldest_minute is not None and b.minute < oldest_minute]
                for b in dropped:
                    del ps.buckets[b]
            rewrite = ps.buckets if ps.rewrite_buckets else batch.dirty_buckets.get(p, ())
            buckets = {b.encode(): ps.buckets[b].tobytes() for b in rewrite if b in ps.buckets}
            ab = {f: ps.ab[f].tobytes() for f in (ps.ab if ps.rewrite_buckets else ps.dirty_ab)}
            users, ps.users = {arm: sorted(u) for arm, u in ps.users.items()}, {}
            ps.rewrite_buckets = False
            ps.dirty_ab = set()
            dropped_fields = [b.encode() for b in dropped] + ps.drop_fields
            meta, ps.meta, ps.drop_fields = ps.meta, {}, []
            meta_deleted, ps.meta_deleted = ps.meta_deleted, []
            ps.checkpoints += 1
            ps.offsets_moved = False
            if ps.resets:
                resets[p], ps.resets = ps.resets, []
            # The next checkpoint expects this one's mark: set now, not at confirm (a refused or
            # unsure one drops the partition, which is claimed again from the store).
            expect, ps.mark = ps.mark, f"{ps.epoch}:{ps.checkpoints}"
            meta["mark"] = ps.mark
            payloads.append(PartitionCheckpoint(
                partition=p, epoch=ps.epoch, layout=writing.layout, offsets=dict(ps.offsets),
                watermarks=dict(ps.watermarks), records=written, deadlines=deadlines.get(p, {}),
                deleted=deleted, buckets=buckets, dropped_buckets=dropped_fields, ab=ab, meta=meta,
                meta_deleted=meta_deleted, expect=expect, users=users))
        completing = functools.partial(harvest, due) if due else None
        return cls(ledger, payloads, batch.counts, batch.advanced, settled, resets, completing)

    def _at(self, step: str, then: str) -> None:
        if self.step != step:
            raise RuntimeError(f"checkpoint step out of order: {then} after {self.step}")
        self.step = then

    def send(self) -> None:
        """Step 2."""
        self._at("built", "sent")
        store = self.ledger.store
        try:
            if self.completing is not None:
                self.completing({c.partition: c for c in self.payloads})
            self.refused = store.commit(self.payloads)
        except store.unavailable:
            for c in self.payloads:
                self.ledger.unsure[c.partition] = Unsure(c.meta["mark"], self.counts.get(c.partition, Counter()),
                                                         self.resets.get(c.partition, []))
            raise
        finally:
            self.payloads = []  # sent or unsure: the bytes are not needed again

    def confirm(self) -> None:
        """Step 3."""
        self._at("sent", "confirmed")
        applied = [p for p in self.partitions if p not in self.refused]
        self.ledger.count(self.counts[p] for p in applied if p in self.counts)
        for p in applied:
            self.ledger.resumed(p, self.resets.get(p, ()))
        self.ledger.rebuilding.difference_update(applied)
        self.ledger.refused(self.refused)
        self.settled(list(self.refused))

    @property
    def offsets(self) -> dict[tuple[str, int], int]:
        """The next offsets to read of the partitions applied."""
        if self.step not in ("confirmed", "committed"):
            raise RuntimeError(f"checkpoint step out of order: offsets after {self.step}")
        return {(topic, p): offset for p, topics in self.advanced.items() if p not in self.refused
                for topic, offset in topics.items()}

    def commit(self, source: Source) -> None:
        """Step 5."""
        offsets = self.offsets
        self._at("confirmed", "committed")
        source.commit(offsets)
