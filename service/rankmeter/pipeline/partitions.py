"""The partitions this process holds: claiming one loads its state from the store (offsets,
watermarks, window buckets in this configuration's layout, experiment sums, the layout
history, the lists being assembled); revoking forgets it (every batch is stored by then)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

import numpy as np

from rankmeter.config import Settings
from rankmeter.pipeline.checkpoint import Ledger
from rankmeter.pipeline.experiments import ab_problem
from rankmeter.pipeline.layouts import Layouts
from rankmeter.pipeline.offsets import Bounds, OffsetChecks
from rankmeter.debias.tables import unreadable as pairs_unreadable
from rankmeter.debias.tables import upgrade
from rankmeter.pipeline.state import PAIRS, PartitionState, Reset
from rankmeter.store import FENCED, Store
from rankmeter.unreadable import Unreadable
from rankmeter.windows import BucketKey, Layout

log = logging.getLogger("rankmeter.pipeline")


class Claims:
    """Claims partitions into `held` (shared with the stages) and forgets them."""

    def __init__(self, settings: Settings, store: Store, held: dict[int, PartitionState], layouts: Layouts,
                 ledger: Ledger, lock: threading.Lock, wall: Callable[[], float], debiased: bool,
                 checks: OffsetChecks, unreadable: Unreadable) -> None:
        self.settings = settings
        self.checks = checks
        self.unreadable = unreadable
        self.store = store
        self.held = held
        self.layouts = layouts
        self.ledger = ledger
        self.lock = lock
        self.wall = wall
        self.debiased = debiased
        self.topics = (settings.kafka.impressions_topic, settings.kafka.feedback_topic)

    def assign(self, partitions: list[int], committed: Mapping[tuple[str, int], int] | None = None,
               rebuild: bool = False, claim: bool = True,
               bounds: Bounds | None = None) -> dict[tuple[str, int], int]:
        """Claim the partitions and load their state; returns the offsets to resume from.

        A partition without stored offsets starts from the beginning of both topics,
        unless Kafka has committed offsets for it: then the store lost its state, and
        resuming from Kafka's commit would export aggregates with a hole. Such a
        partition is refused (`lost`) unless `rebuild`, which wipes what is left of it
        and re-reads the retained topics from the start. Stored offsets behind Kafka's
        commit (which follows the store's) mean the store lost its last checkpoints: what
        it still holds is a whole earlier checkpoint, resumed from (counted), unless Kafka no
        longer holds its offsets (`bounds`: each topic's log start and end): then it is lost
        as above. Stored offsets outside the log (recreated, truncated) are offsets.py's.
        `claim=False` only reads (for `rankmeter report`, which must not fence the running
        replicas)."""
        committed = committed or {}
        bounds = bounds or {}
        resume = {}
        for p in partitions:
            snapshot = self.store.claim(p) if claim else self.store.load(p)
            for kind, field, why in snapshot.unreadable:  # (kind `key`: the field names the key)
                where = field if kind == "key" else "offsets" if kind == "offsets" else "meta"
                self.unreadable.skip(kind, f"{{{p}}}:{where}", "" if kind == "key" else field, why)
            stored, offsets = snapshot.offsets, dict(snapshot.offsets)
            # Claimed again: not rewound any more, whatever the claim finds (else a partition
            # whose state is gone entirely would be claimed again on every batch).
            rewound = p in self.ledger.rewound
            self.ledger.rewound.discard(p)
            gone = not offsets and any(committed.get((t, p), 0) > 0 for t in self.topics)
            # Offsets the store could not read: its state is no starting point whatever Kafka's
            # commit says (resuming from the log's start onto the stored sums counts twice).
            # So do offsets or a meta (the layout history its buckets and records are read by) of
            # another type (redis_claim.py).
            gone = gone or any(kind == "offsets" or (kind, field) in (("key", "offsets"), ("key", "meta"))
                               for kind, field, _ in snapshot.unreadable)
            resets: list[Reset] = []
            if offsets and self._lost_writes(p, offsets, committed, bounds, rewound):
                gone = True
            elif offsets and not self.checks.at_claim(p, offsets, bounds, resets):
                continue
            if gone and not (rebuild or p in self.ledger.rebuilding):
                log.error("the state store has no state for a partition that Kafka has consumed: "
                          "not consuming it; restart with `rankmeter serve --rebuild` to rebuild it "
                          "from the topics", extra={"partition": p})
                self.ledger.lost.add(p)
                continue
            if gone:
                log.warning("rebuilding a partition from the start of its topics", extra={"partition": p})
                if not self.store.wipe(p, snapshot.epoch):  # claimed by another replica since
                    self.ledger.refused({p: FENCED})
                    continue
                self.ledger.rebuilding.add(p)
                snapshot = snapshot._replace(buckets={}, ab={}, watermarks={}, layout="", history=[], lists={},
                                             descriptions={}, mark="")
                offsets = {}
            if not offsets:  # from the start of the retained log
                offsets = {t: bounds.get((t, p), (0, 0))[0] for t in self.topics}
            snapshot = snapshot._replace(offsets=offsets)
            self.layouts.learn(snapshot.descriptions, self.unreadable, p)
            state = PartitionState(snapshot.epoch, dict(snapshot.offsets), dict(snapshot.watermarks), {})
            state.lists = dict(snapshot.lists)
            state.mark = snapshot.mark
            state.offsets_moved = bool(stored) and offsets != stored  # reset to a new log: stored at once
            state.resets = resets
            state.shown_wall_ms = self.wall() * 1000
            state.history = list(snapshot.history) or ([snapshot.layout] if snapshot.layout else [])
            current = self.layouts.current
            stored = self.layouts.get(snapshot.layout) if snapshot.layout else current
            state.buckets = self._load_buckets(p, snapshot.buckets, stored, state)
            # Experiment sums as stored: an A/B experiment's name includes its layout, and
            # interleaving counts are the same in every layout.
            state.ab = self._load_ab(p, snapshot.ab)
            if self.debiased:
                # (an older version's, pbm only, is padded: debias/tables.py)
                # (unreadable ones, a NaN or a negative pair count, counted and started afresh:
                # the next harvest stores them anew)
                stored_pairs = state.ab.get(PAIRS)
                if (why := pairs_unreadable(stored_pairs, self.settings.debias.ranks)) is not None:
                    self.unreadable.skip("experiment", f"{{{p}}}:ab", PAIRS, why)
                    stored_pairs = None
                state.pair_sums = upgrade(stored_pairs, self.settings.debias.ranks)
            if not state.history or state.history[-1] != current.fingerprint:
                # A new configuration: the first checkpoint rewrites every bucket in it and
                # records it in the partition's history, which converts old records later.
                state.history.append(current.fingerprint)
                state.rewrite_buckets = bool(snapshot.layout)
                state.meta = {"history": " ".join(state.history),
                              f"layout:{current.fingerprint}": current.description}
            with self.lock:
                self.held[p] = state
            self.ledger.claimed(p, snapshot.mark)
            resume.update({(topic, p): offset for topic, offset in snapshot.offsets.items()})
        log.info("partitions assigned", extra={"partitions": partitions, "resume": len(resume),
                                               "lost": sorted(self.ledger.lost)})
        return resume

    def _lost_writes(self, p: int, offsets: Mapping[str, int], committed: Mapping[tuple[str, int], int],
                     bounds: Bounds, rewound: bool) -> bool:
        """Whether the store lost the partition's last checkpoints (Kafka's commit is ahead
        of the stored offsets, or a checkpoint was refused as REWOUND), counted and logged,
        and Kafka no longer holds the stored offsets: then its state is lost."""
        ahead = [t for t in self.topics if committed.get((t, p), -1) > offsets.get(t, 0)]
        if not ahead and not rewound:
            return False
        self.ledger.checkpoints_lost[p] += 1
        gone = [t for t in self.topics if (t, p) in bounds and offsets.get(t, 0) < bounds[(t, p)][0]]
        log.error("the state store lost this partition's last checkpoints: "
                  + ("Kafka no longer holds the stored offsets" if gone
                     else "resuming from the last one it holds, re-reading Kafka from its offsets"),
                  extra={"partition": p, "stored_offsets": dict(offsets),
                         "committed_offsets": {t: committed[(t, p)] for t in self.topics if (t, p) in committed}})
        return bool(gone)

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
        layout = self.layouts.current
        if old is not layout:
            log.info("configuration changed: carrying on the unchanged measures' sums",
                     extra={"partition": p, "from": old.names, "to": layout.names})
        buckets = {}
        for field, data in stored.items():
            try:
                key = BucketKey.decode(field)
                vector = np.frombuffer(data, dtype=np.float64)
            except ValueError as e:  # left in the store: a version that can read it may
                self.unreadable.skip("bucket", f"{{{p}}}:buckets", field, e)
                continue
            if len(vector) != old.size:
                log.warning("dropping a window bucket of unexpected size", extra={"partition": p, "bucket": field})
                state.drop_fields.append(field)
                continue
            buckets[key] = vector.copy() if old is layout else layout.convert(vector, old)
        return buckets

    def _load_ab(self, p: int, stored: dict[str, bytes]) -> dict[str, np.ndarray]:
        """The stored experiment sums that can be read (the others are counted and skipped)."""
        ab = {}
        for field, data in stored.items():
            problem = ab_problem(field, data)
            if problem is not None:
                self.unreadable.skip(problem[0], f"{{{p}}}:ab", field, problem[1])
                continue
            ab[field] = np.frombuffer(data).copy()
        return ab

    def revoke(self, partitions: list[int], reclaiming: bool) -> None:
        with self.lock:
            for p in partitions:
                self.held.pop(p, None)
        for p in partitions:
            if not reclaiming:
                self.ledger.forget(p)  # another owner may replay and count that batch
        log.info("partitions revoked", extra={"partitions": partitions})
