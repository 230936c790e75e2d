"""The sweep: what event time (and, for lists, a quiet spell) has made due. At most every
second: queries whose deadline the partition's watermark has passed and lists that are
complete. At every batch, a bounded share of the queries whose clicks are final (to
harvest)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from rankmeter.config import Settings, duration_ms
from rankmeter.pipeline.context import Batch
from rankmeter.pipeline.state import PartitionState
from rankmeter.store import Store
from rankmeter.unreadable import Unreadable

# How far the partition's impression events have come, in their queries' record time (the
# search engine's clock, not a browser's), kept with the topics' watermarks: it settles
# lists (clicks, later in event time, do not move it).
SHOWN = "impression events"
SWEEP_INTERVAL_MS = 1000    # how often closed and orphaned queries are looked for
SWEEP_LIMIT = 5000          # queries closed per partition and sweep: an outage's backlog
                            # closes over several batches, not in one huge read
# Queries harvested per batch, all partitions together: this many, plus this many per event
# in the batch. A jump of the watermark makes thousands final at once, and harvesting them
# in one checkpoint (~90 µs a query) held the next batch for 1.5 s (issue 24). The share
# per event is 2.5 times what traffic makes final (a query is ~5 events), so the harvest
# keeps up at any rate and a burst drains over the next batches.
HARVEST_PER_BATCH, HARVEST_PER_EVENT = 100, 0.5


class Sweep:
    def __init__(self, settings: Settings, store: Store, held: dict[int, PartitionState],
                 wall: Callable[[], float], unreadable: Unreadable | None = None) -> None:
        self.store = store
        self.unreadable = unreadable
        self.held = held
        self.wall = wall
        self.topics = (settings.kafka.impressions_topic, settings.kafka.feedback_topic)
        self.feedback_topic = settings.kafka.feedback_topic
        self.settle_ms = duration_ms(settings.windows.list_settle)
        self._last_ms = 0
        self._last_wall = 0.0

    def run(self, batch: Batch) -> None:
        """Queries whose deadline the partition's event-time watermark has passed
        (`expired`): closed (their contribution stays), orphaned when their impression
        never came, or, when their list is being assembled, settled (joining). Never
        closed by the wall clock: a backlog after an outage is joined as it would have
        been live. Also (`due`) the lists known here that are complete (`_list_ready`).
        Every second of event time or of the wall clock (serve sweeps on empty polls too).
        And (`harvest`, at every batch) the queries whose clicks the watermark has made
        final, a bounded number (`_harvest`)."""
        if not self.held:
            return
        watermarks = {p: wm for p, ps in self.held.items()
                      if (wm := ps.watermark(self.topics, {t for t, q in batch.caught_up if q == p})) is not None}
        self._harvest(batch, watermarks)
        now_ms, wall_ms = batch.now_ms, self.wall() * 1000
        if now_ms - self._last_ms < SWEEP_INTERVAL_MS and wall_ms - self._last_wall < SWEEP_INTERVAL_MS:
            return
        self._last_wall = wall_ms
        for p, ps in self.held.items():
            if ps.lists and (ready := [q for q, ts in ps.lists.items() if self._list_ready(p, ts, batch.caught_up)]):
                batch.due[p] = ready
        if not watermarks:
            return
        for p, (qids, open_count) in self.store.expired(watermarks, SWEEP_LIMIT, self.unreadable).items():
            self.held[p].open_queries = open_count - len(qids)
            if qids:
                batch.expired[p] = qids
        if all(len(q) < SWEEP_LIMIT for q in batch.expired.values()):
            self._last_ms = now_ms  # else go on closing at the next batch

    def _harvest(self, batch: Batch, watermarks: dict[int, int]) -> None:
        """The queries whose clicks are final, soonest first, at most HARVEST_PER_BATCH plus
        HARVEST_PER_EVENT per event of the batch, shared by the partitions: a burst is
        harvested over the next batches (a query that closes before its turn is left out:
        a smaller sample, by time, not by its clicks)."""
        events = sum(map(len, batch.work.values()))
        budget = math.ceil((HARVEST_PER_BATCH + HARVEST_PER_EVENT * events) / max(len(watermarks), 1))
        for p, wm in watermarks.items():
            queue = self.held[p].harvest_queue
            ready = []
            while queue and queue[0][0] <= wm and len(ready) < budget:
                ready.append(heapq.heappop(queue)[1])
            if ready:
                batch.harvest[p] = ready

    def _list_ready(self, p: int, ts: int, caught_up: set[tuple[str, int]]) -> bool:
        """Whether the list of a query at event time `ts` is complete: the partition's
        impression events have passed `ts` plus `windows.list_settle` in event time (clicks,
        which come later in event time, do not count: a slow click read before the next
        queries' impression events must not cut their lists short); or they have reached
        `ts` and then none came for `windows.list_settle` of processing time while the
        feedback topic is read to its end (a quiet spell: the last lists before it). While
        the impression events stay behind `ts` (their producer is down), the list waits."""
        ps = self.held[p]
        shown_ms = ps.watermarks.get(SHOWN, -1)
        if shown_ms >= ts + self.settle_ms:
            return True
        return (shown_ms >= ts and (self.feedback_topic, p) in caught_up
                and ps.shown_wall_ms + self.settle_ms <= self.wall() * 1000)
