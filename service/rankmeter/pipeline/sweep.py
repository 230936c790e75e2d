"""The sweep: what event time (and, for lists, a quiet spell) has made due. At most every
second: queries whose deadline the partition's watermark has passed and lists that are
complete. At every batch, a bounded share of the queries whose clicks are final (to
harvest)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from rankmeter.config import Settings, duration_ms
from rankmeter.events import Impression
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
# Queries harvested per batch, all partitions together (~90 µs each, on the checkpoint's
# thread): a few, plus a rate's worth for the wall time since the last batch, plus twice
# what the batch's impressions can add to the queues (each queued with
# debias.harvest_share probability). A jump of the watermark makes thousands final at
# once: harvested in one checkpoint they held the next batch for 1.5 s (issue 24), and a
# budget per batch alone let small batches spend a core on them. This way the harvest
# keeps up at any rate and a burst drains at about HARVEST_PER_SECOND beyond it.
HARVEST_PER_BATCH, HARVEST_PER_SECOND, HARVEST_INFLOW = 10, 1000, 2.0
# Queries closed by a sweep while they wait, final, to be harvested: harvested as they
# close, this many at most a sweep (all partitions), soonest first; the rest of a burst
# that closes at once (an outage's backlog, windows.judgments within attribution + grace)
# is left out (a smaller sample, by time, not by clicks) rather than stall a batch.
HARVEST_CLOSING = 1000


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
        self.harvest_share = settings.debias.harvest_share
        self._last_harvest: float | None = None  # the wall time of the last batch's harvest
        self._turn = 0  # where the harvest's rounds begin (`_harvest`)
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
        closing = HARVEST_CLOSING
        for p, (qids, open_count) in self.store.expired(watermarks, SWEEP_LIMIT, self.unreadable).items():
            self.held[p].open_queries = open_count - len(qids)
            if qids:
                batch.expired[p] = qids
                closing -= self._harvest_closing(batch, p, qids, watermarks[p], closing)
        if all(len(q) < SWEEP_LIMIT for q in batch.expired.values()):
            self._last_ms = now_ms  # else go on closing at the next batch

    def _harvest_closing(self, batch: Batch, p: int, qids: list[str], watermark: int, limit: int) -> int:
        """The queries closed now that wait, final, in the partition's harvest queue: now,
        past the budget (evicted with this batch, they would never have their turn), at
        most `limit`, soonest first. Returns how many."""
        queue = self.held[p].harvest_queue
        if limit <= 0 or not queue or queue[0][0] > watermark:
            return 0
        closing = set(qids)
        now = sorted(item for item in queue if item[0] <= watermark and item[1] in closing)[:limit]
        if now:
            taken = {qid for _, qid in now}
            queue[:] = [item for item in queue if item[1] not in taken]
            heapq.heapify(queue)
            batch.harvest.setdefault(p, []).extend(qid for _, qid in now)
        return len(now)

    def _harvest(self, batch: Batch, watermarks: dict[int, int]) -> None:
        """The queries whose clicks are final, soonest first, at most the budget above,
        shared by the partitions: a burst is harvested over the next batches (one that
        closes meanwhile is harvested as it closes: `_harvest_closing`)."""
        impressions = sum(isinstance(e, Impression) for events in batch.work.values() for _, e in events)
        wall, last = self.wall(), self._last_harvest
        self._last_harvest = wall
        elapsed = min(1.0, max(0.0, wall - last)) if last is not None else 0.0
        budget = math.ceil(HARVEST_PER_BATCH + HARVEST_PER_SECOND * elapsed
                           + HARVEST_INFLOW * self.harvest_share * impressions)
        # Shared out in rounds, so that what one partition does not need goes to the others;
        # each batch begins the rounds at the next partition (a budget below one a partition).
        waiting = [p for p, wm in watermarks.items() if (q := self.held[p].harvest_queue) and q[0][0] <= wm]
        self._turn += 1
        if waiting:
            waiting = waiting[self._turn % len(waiting):] + waiting[:self._turn % len(waiting)]
        while budget > 0 and waiting:
            share = max(1, budget // len(waiting))
            for p in list(waiting):
                queue, wm, ready = self.held[p].harvest_queue, watermarks[p], batch.harvest.setdefault(p, [])
                for _ in range(min(share, budget)):
                    if not queue or queue[0][0] > wm:
                        break
                    ready.append(heapq.heappop(queue)[1])
                    budget -= 1
                if not queue or queue[0][0] > wm:
                    waiting.remove(p)
        for p in [p for p, ready in batch.harvest.items() if not ready]:
            del batch.harvest[p]

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
