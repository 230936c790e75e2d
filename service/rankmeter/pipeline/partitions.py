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
from rankmeter.pipeline.state import PAIRS, PartitionState
from rankmeter.store import Store
from rankmeter.unreadable import Unreadable
from rankmeter.windows import BucketKey, Layout

log = logging.getLogger("rankmeter.pipeline")


class Claims:
    """Claims partitions into `held` (shared with the stages) and forgets them."""

    def __init__(self, settings: Settings, store: Store, held: dict[int, PartitionState], layouts: Layouts,
                 ledger: Ledger, lock: threading.Lock, wall: Callable[[], float], debiased: bool,
                 unreadable: Unreadable) -> None:
        self.settings = settings
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
                had_state = any(committed.get((t, p), 0) > 0 for t in self.topics)
                if had_state and not (rebuild or p in self.ledger.rebuilding):
                    log.error("the state store has no state for a partition that Kafka has consumed: "
                              "not consuming it; restart with `rankmeter serve --rebuild` to rebuild it "
                              "from the topics", extra={"partition": p})
                    self.ledger.lost.add(p)
                    continue
                if had_state:
                    log.warning("rebuilding a partition from the start of its topics", extra={"partition": p})
                    self.store.wipe(p)
                    self.ledger.rebuilding.add(p)
                    snapshot = snapshot._replace(buckets={}, ab={}, watermarks={}, layout="", history=[], lists={},
                                                 descriptions={})
                snapshot = snapshot._replace(offsets={t: 0 for t in self.topics})
            self.layouts.learn(snapshot.descriptions, self.unreadable, p)
            state = PartitionState(snapshot.epoch, dict(snapshot.offsets), dict(snapshot.watermarks), {})
            state.lists = dict(snapshot.lists)
            state.shown_wall_ms = self.wall() * 1000
            state.history = list(snapshot.history) or ([snapshot.layout] if snapshot.layout else [])
            current = self.layouts.current
            stored = self.layouts.get(snapshot.layout) if snapshot.layout else current
            state.buckets = self._load_buckets(p, snapshot.buckets, stored, state)
            # Experiment sums as stored: an A/B experiment's name includes its layout, and
            # interleaving counts are the same in every layout.
            state.ab = self._load_ab(p, snapshot.ab)
            if self.debiased:
                stored_pairs = state.ab.get(PAIRS)
                size = 2 * self.settings.debias.ranks ** 2
                state.pair_sums = stored_pairs if stored_pairs is not None and len(stored_pairs) == size \
                    else np.zeros(size)
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
