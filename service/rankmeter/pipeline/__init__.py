"""One poll batch, from records to persisted aggregates (brief §8): stages run in this
order over the batch's context (context.Batch), each in its own module:

    intake.py         decode, check the key, route each event to its partition's work
    sweep.py          what event time has made due: queries closed, lists complete, clicks final
    records.py        one read of the records the batch needs, into the cache
    joining.py        apply the events to their records; settle the lists complete or due
    scoring.py        evaluate the changed queries together -> window bucket deltas (with
                      experiments.py: A/B sums, interleaving; position_bias.py: debiased values)
    intake.py         the watermarks moved to the batch's newest event times
    checkpoint.py     build -> send -> confirm: one store commit for every partition; at
                      send, before the commit, position_bias.py harvests the queries whose
                      clicks are final (serve sends from another thread)

The pipeline owns the assigned partitions' state (partitions.py, state.py): offsets,
window buckets, and a write-through cache of query records and their `QueryState`s (this
process is the partition's only writer while it holds it). It knows nothing of Kafka or
Redis: a `Source` feeds it, a `Store` keeps its state.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from rankmeter.ab.experiment import Look
from rankmeter.config import Settings, duration_ms
from rankmeter.debias.propensity import Harvester, Propensities
from rankmeter.pipeline.checkpoint import Checkpoint, Ledger, Writing
from rankmeter.pipeline.context import Batch
from rankmeter.pipeline.experiments import Experiments
from rankmeter.pipeline.intake import Intake
from rankmeter.pipeline.joining import Joining, attribution_of
from rankmeter.pipeline.labels import OTHER, Labels
from rankmeter.pipeline.layouts import IPW, Layouts, layout_for
from rankmeter.pipeline.offsets import Bounds, BoundsQuery, OffsetChecks
from rankmeter.pipeline.partitions import Claims
from rankmeter.pipeline.position_bias import PositionBias
from rankmeter.pipeline.readout import Readout
from rankmeter.pipeline.records import Records
from rankmeter.pipeline.scoring import Scoring
from rankmeter.pipeline.state import PAIRS, PartitionState
from rankmeter.pipeline.sweep import SWEEP_LIMIT, Sweep
from rankmeter.source import Record
from rankmeter.store import REWOUND, Store
from rankmeter.unreadable import Unreadable
from rankmeter.windows import Layout, WindowView, window_views

__all__ = ["IPW", "OTHER", "PAIRS", "SWEEP_LIMIT", "Checkpoint", "PartitionState", "Pipeline", "layout_for"]


class Pipeline:
    def __init__(self, settings: Settings, store: Store,
                 dead_letter: Callable[[Record, str], None],
                 clock: Callable[[], float] = time.time, wall: Callable[[], float] = time.monotonic,
                 bounds: BoundsQuery | None = None) -> None:
        self.settings = settings
        self.store = store
        self.clock = clock  # event time's "now": the wall clock, or the event clock
        self.lock = threading.Lock()  # between the batch and the exporter's scrape: the buckets, the partitions
        self.partitions: dict[int, PartitionState] = {}  # held; the stages share this dict
        # (topic, partition)s read to their end, as of the last lag reading (serve sets it).
        self.caught_up: set[tuple[str, int]] = set()
        layouts = Layouts(settings)
        self.layout, self.ab_layout = layouts.current, layouts.ab
        self.windows = {size: duration_ms(size) for size in settings.windows.sizes}
        self.ledger = Ledger(store, self.lock)
        # `bounds`: the source's log start and end per partition, to find offsets gone backwards.
        checks = OffsetChecks(self.ledger, settings.kafka.on_offsets_reset, bounds)
        self.unreadable = Unreadable()  # stored fields skipped: counted, never raised
        self.position_bias = PositionBias(settings, store, self.partitions, self.unreadable)
        self.labels = Labels(settings, store, clock)
        self.experiments = Experiments(settings, store, self.partitions, self.ab_layout, clock, self.labels,
                                       self.unreadable)
        self._claims = Claims(settings, store, self.partitions, layouts, self.ledger, self.lock, wall,
                              debiased=bool(self.position_bias.measures), checks=checks,
                              unreadable=self.unreadable)
        self._intake = Intake(settings, self.partitions, dead_letter, wall, checks)
        self._sweep = Sweep(settings, store, self.partitions, wall, self.unreadable)
        self.records = Records(store, self.partitions, layouts)
        self._joining = Joining(settings, self.partitions, self.labels, self.experiments.enrol, dead_letter)
        self._scoring = Scoring(settings, self.partitions, layouts, self.records, self.experiments,
                                self.position_bias, self.lock)
        # Buckets are kept while feedback can still change them and a window shows them.
        retention_ms = max(self.windows.values()) + attribution_of(settings).explicit_ms
        self._writing = Writing(self.layout.fingerprint, retention_ms, self.records.encode, self._joining.deadline)
        # What a scrape reads. (Closures over the parts, not over `self`: no reference cycle,
        # so a pipeline let go of is freed at once, not by a full collection.)
        ledger, bias, experiments, held = self.ledger, self.position_bias, self.experiments, self.partitions
        self._views = functools.partial(_views, held, self.lock, self.layout, self.windows, clock)
        self.readout = Readout(
            views=self._views, events=ledger.events, folded=self.labels.folded, lost=ledger.lost,
            checkpoints_lost=ledger.checkpoints_lost, offsets_reset=ledger.offsets_reset,
            offsets_skipped=ledger.offsets_skipped, ab_running_lost=lambda: experiments.records.lost,
            fenced_total=lambda: ledger.fenced_total, open_queries=functools.partial(_open_queries, held),
            held=held.__len__, debiased=bool(bias.measures), propensities=lambda: bias.propensities,
            ab_result=lambda: experiments.result, interleaving_result=lambda: experiments.interleaving,
            unreadable=self.unreadable.counts, click_fit=lambda: bias.look_result,
            ab_units_missing=lambda: experiments.units_missing, harvested=lambda: bias.harvested,
            segment_curves=lambda: bias.segment_status,
            production_rankers=tuple(settings.alerts.production_rankers))

    # ---- assignment ----

    def assign(self, partitions: list[int], committed: Mapping[tuple[str, int], int] | None = None,
               rebuild: bool = False, claim: bool = True, bounds: Bounds | None = None) -> dict[tuple[str, int], int]:
        """Claim the partitions and load their state; returns the offsets to resume from
        (partitions.Claims.assign: a partition whose stored state is gone is `lost`; one whose
        last checkpoints the store lost resumes from the last it holds; `bounds`, the topics'
        log start and end, find offsets gone backwards)."""
        offsets = self._claims.assign(partitions, committed, rebuild, claim, bounds)
        self.experiments.resolve()  # the experiment's stored definition (pipeline/phases.py)
        return offsets

    def revoke(self, partitions: Iterable[int], reclaiming: bool = False) -> None:
        """Every batch is persisted when `process` returns: forgetting is enough.
        `reclaiming`: this process claims them again at once (after a store failure), so a
        checkpoint it could not confirm is still its own to count (`Ledger.unsure`)."""
        partitions = list(partitions)
        self._claims.revoke(partitions, reclaiming)
        if 0 in partitions:  # the experiments' statistics are exported by partition 0's holder
            # Claimed again by this process at once (a store failure, lost writes): what it
            # saved last is still the truth to compare the store with.
            self.experiments.forget(keep_saved=reclaiming or 0 in self.ledger.rewound)
        if reclaiming:
            # After a store failure the harvest table may hold a batch that was never stored
            # (and will be replayed). A rebalance keeps it: every batch harvested before it was stored.
            self.position_bias.restart()

    def _settled(self, refused: list[int]) -> None:
        """A checkpoint confirmed (Checkpoint.confirm): drop the partitions it was refused
        for (the harvest table holds what the refused batch harvested, which was never
        stored: start it afresh), then bound the record cache (what it forgets is stored)."""
        if refused:
            self.revoke(refused)
            self.position_bias.restart()
        self.records.trim()

    def verify(self) -> None:
        """Whether the store still holds each held partition's last checkpoint: a restore or
        a failover may lose it while the partition is idle (no commit to refuse). Those it
        lost are dropped and listed in `rewound`, for the caller to claim again; a mark of a
        newer epoch is another owner's (the next commit is fenced)."""
        ours = {p: ps.mark for p, ps in self.partitions.items() if ps.mark}
        rewound = {p: REWOUND for p, stored in self.store.marks(list(ours)).items()
                   if stored != ours[p] and _epoch(stored) <= self.partitions[p].epoch}
        if rewound:
            self.ledger.refused(rewound)
            self._settled(list(rewound))

    # ---- one batch ----

    def process(self, records: list[Record]) -> Checkpoint:
        """Apply one poll batch and persist it (sent and confirmed); the caller hands its
        offsets to the source (`Checkpoint.commit`). Partitions whose checkpoint the store
        refused are dropped and listed in `fenced` or `lost`: the caller rejoins the group,
        or stops consuming them. (serve runs `apply`, `send` and `confirm` itself.)"""
        return self._persist(self.apply(records))

    def apply(self, records: list[Record]) -> Checkpoint:
        """The stages over one poll batch; returns its checkpoint, built, not yet sent."""
        return self.step(self.read(records))

    def read(self, records: list[Record]) -> Batch:
        """Intake alone: the batch decoded and routed, nothing applied (serve reads the next
        batch while the previous checkpoint's commit is outstanding)."""
        batch = Batch(int(self.clock() * 1000), self.caught_up, read_from=dict(self.partitions))
        self._intake.read(batch, records)
        return batch

    def step(self, batch: Batch) -> Checkpoint:
        """The other stages over a batch `read`; returns its checkpoint, built, not yet sent.
        Partitions dropped or claimed again since it was read are left out (Batch.drop_changed)."""
        batch.drop_changed(self.partitions)
        self._intake.send_dead_letters(batch)
        self._sweep.run(batch)
        return self._step(batch)

    def end_of_input(self) -> Checkpoint:
        """Settle every list still being assembled from impression events, as if event time
        had passed their settle deadlines, and persist them: the end of a replayed file."""
        batch = Batch(int(self.clock() * 1000), self.caught_up)
        batch.due = {p: list(ps.lists) for p, ps in self.partitions.items() if ps.lists}
        return self._persist(self._step(batch))

    @staticmethod
    def _persist(checkpoint: Checkpoint) -> Checkpoint:
        checkpoint.send()
        checkpoint.confirm()
        return checkpoint

    def _step(self, batch: Batch) -> Checkpoint:
        self.records.load(batch)
        self._joining.apply(batch)
        self._joining.settle_due(batch)
        self._scoring.evaluate(batch)
        self._intake.advance_watermarks(batch)
        # The harvest (batch.harvest) happens as the checkpoint is sent (Checkpoint.send).
        return Checkpoint.build(batch, self.partitions, self._writing, self.ledger, self._settled,
                                self.position_bias.harvest_into if self.position_bias.measures else None)

    # ---- what the run loop and the exporter read ----

    @property
    def events(self) -> Mapping[tuple[str, str], int]:
        return self.ledger.events

    @property
    def folded(self) -> Mapping[str, int]:
        return self.labels.folded

    @property
    def lost(self) -> set[int]:
        return self.ledger.lost

    @property
    def rewound(self) -> set[int]:
        """Partitions to claim again from the store: it lost their last checkpoints (refused,
        dropped), or their log's bounds could not be read when a record was not the next."""
        return self.ledger.rewound | self.ledger.recheck

    @property
    def stopped(self) -> Mapping[int, str]:
        """Partitions refused because their offsets went backwards -> why (offsets.py)."""
        return self.ledger.stopped

    @property
    def fenced(self) -> set[int]:
        return self.ledger.fenced

    @property
    def fenced_total(self) -> int:
        return self.ledger.fenced_total

    @property
    def propensities(self) -> Propensities:
        return self.position_bias.propensities

    @propensities.setter
    def propensities(self, found: Propensities) -> None:
        self.position_bias.propensities = found

    @property
    def harvester(self) -> Harvester | None:
        return self.position_bias.harvester

    @property
    def ab_result(self) -> Look | None:
        return self.experiments.result

    @property
    def interleaving_result(self) -> list:
        return self.experiments.interleaving

    def views(self, now_ms: int | None = None) -> list[WindowView]:
        return self._views(now_ms)

    def open_queries(self) -> int:
        return _open_queries(self.partitions)

    def positions(self) -> dict[tuple[str, int], int]:
        """The next offset to read of each held partition's topics (as stored)."""
        return {(t, p): o for p, ps in self.partitions.items() for t, o in ps.offsets.items()}

    def ab_look(self, save: bool = True) -> Look | None:
        """One look at the experiment over every partition's stored sums (experiments.Experiments.look)."""
        return self.experiments.look(save)

    def look_at_position_bias(self, estimate_here: bool, now: float = 0.0, budget_s: float = math.inf) -> None:
        """Refresh the debiased measures' propensities (position_bias.PositionBias.look);
        `now`: the wall time, epoch seconds, exported as the estimate's; `budget_s`: how
        long the estimate may run now, the rest in `advance_position_bias`."""
        self.position_bias.look(estimate_here, now, budget_s)

    def advance_position_bias(self, budget_s: float) -> None:
        """The propensities' estimate under way, for `budget_s` more (none: nothing)."""
        self.position_bias.advance(budget_s)


def _views(held: Mapping[int, PartitionState], lock: threading.Lock, layout: Layout, windows: dict[str, int],
           clock: Callable[[], float], now_ms: int | None = None) -> list[WindowView]:
    now_ms = int(clock() * 1000) if now_ms is None else now_ms
    with lock:
        return window_views([ps.buckets for ps in held.values()], layout, windows, now_ms)


def _epoch(mark: str) -> int:
    """A mark's epoch; 0 for one that cannot be read (not ours: the partition is claimed again)."""
    epoch = mark.partition(":")[0]
    return int(epoch) if epoch.isascii() and epoch.isdigit() else 0


def _open_queries(held: Mapping[int, PartitionState]) -> int:
    return sum(ps.open_queries for ps in list(held.values()))
