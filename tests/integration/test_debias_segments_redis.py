"""Per-segment examination curves on the real Redis (issue 22): the per-partition segment
sums written by the checkpoint script, read back by HMGET after a restart and by a
replica without partition 0, give the curves the process that harvested them had."""

from __future__ import annotations

import numpy as np
import pytest

from rankmeter.debias import segments
from rankmeter.pipeline import Pipeline
from rankmeter.redis_store import RedisStore
from test_debias_segments import SETTINGS, START_MS, Clock, pipeline_on, run
from test_redis_store import store  # noqa: F401 (the fixture)

pytestmark = pytest.mark.integration


def test_segment_sums_stored_in_redis_give_the_same_curves_after_a_restart_and_on_a_replica(store, redis_url):
    clock = Clock(START_MS)
    pipeline, bus = pipeline_on(store, clock)
    run(pipeline, bus, clock, 3000, 1, START_MS)
    pipeline.look_at_position_bias(estimate_here=True)
    bias = pipeline.position_bias
    assert set(bias.segment_curves) == {"mobile", "desktop"}
    fields = [segments.field(s) for s in ("mobile", "desktop")]
    stored = store.load_ab(store.partitions(), only=fields)
    for s, f in zip(("mobile", "desktop"), fields):
        total = sum(np.frombuffer(p[f]) for p in stored.values())
        np.testing.assert_allclose(total, bias.tables.segments.tables[s].sums.to_vector(), atol=1e-9)
    later = Clock(START_MS + 3000 * 500 + 30 * 60_000)
    again = Pipeline(SETTINGS, RedisStore(redis_url, store.prefix), lambda r, why: None, later)
    again.assign(store.partitions())
    again.look_at_position_bias(estimate_here=True)
    assert again.position_bias.segment_curves == bias.segment_curves
    replica = Pipeline(SETTINGS, RedisStore(redis_url, store.prefix), lambda r, why: None, later)
    replica.look_at_position_bias(estimate_here=False)
    assert replica.position_bias.segment_curves == bias.segment_curves


def test_keys_of_another_type_do_not_stop_a_claim_nor_the_batches_after_it(store, redis_url):
    """Review s11: a partition's key of another type made every claim raise (the replica never
    ready). A restart over planted keys: the buckets' (and the open set's) counted and started
    afresh, the batches go on and the next checkpoint replaces the keys; the offsets' leave
    no starting point: that partition is lost (`serve --rebuild`), the other consumed."""
    clock = Clock(START_MS)
    pipeline, bus = pipeline_on(store, clock)
    run(pipeline, bus, clock, 300, 1, START_MS)
    for p, name in ((0, "buckets"), (0, "open"), (1, "offsets")):
        store.client.delete(store._key(p, name))
        store.client.set(store._key(p, name), "not this type")
    k = SETTINGS.kafka
    again = Pipeline(SETTINGS, RedisStore(redis_url, store.prefix), lambda r, why: None, clock)
    bus.subscribe([k.impressions_topic, k.feedback_topic], again.assign, again.revoke)  # a restart
    assert again.unreadable.counts["key"] == 3
    assert again.ledger.lost == {1} and set(again.partitions) == {0}
    run(again, bus, clock, 300, 2, clock.ms + 1000)
    assert store.client.type(store._key(0, "buckets")) in (b"hash", "hash")
    assert store.client.type(store._key(0, "open")) in (b"zset", "zset")
    assert store.client.hlen(store._key(0, "buckets")) > 0
    third = Pipeline(SETTINGS, RedisStore(redis_url, store.prefix), lambda r, why: None, clock)
    third.assign([0, 1])
    assert third.unreadable.counts["key"] == 1 and third.ledger.lost == {1}  # (the offsets' alone)
