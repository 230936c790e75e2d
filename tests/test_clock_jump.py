"""A forward jump of the wall clock longer than the buckets' retention deletes nothing
(issue 19, item 8): buckets expire by the partition's event time, capped at now."""

from __future__ import annotations

from test_pipeline import Clock, impression, one_partition

from rankmeter.store import MemoryStore

DAY_S = 86_400


def five_minutes(pipeline) -> int:
    return next(v for v in pipeline.views() if v.window == "5m").queries_all


def test_a_wall_clock_jump_beyond_the_retention_keeps_every_bucket():
    clock, store = Clock(), MemoryStore()
    t0_ms = int(clock.t * 1000)
    pipeline, feed = one_partition([impression(f"q{i}", t0_ms - 60_000 + i) for i in range(5)],
                                   store=store, clock=clock)
    assert five_minutes(pipeline) == 5
    stored = dict(store.buckets[0])
    clock.t += 3 * DAY_S    # NTP fixes a host clock, a VM resumes: retention is 24 h + 24 h
    feed([impression("q5", t0_ms)])   # events keep their real time (3 days "old", under max_past)
    assert stored.keys() <= store.buckets[0].keys()
    clock.t -= 3 * DAY_S - 1    # the clock put right
    assert five_minutes(pipeline) == 6


def test_buckets_past_the_retention_in_event_time_still_expire():
    clock, store = Clock(), MemoryStore()
    t0_ms = int(clock.t * 1000)
    pipeline, feed = one_partition([impression("old", t0_ms)], store=store, clock=clock)
    clock.t += 3 * DAY_S
    feed([impression("new", int(clock.t * 1000))])   # event time has moved on too
    assert len(store.buckets[0]) == 1 and five_minutes(pipeline) == 1
