"""`wipe`, `save_running` and `append_look` are fenced by the epoch (issue 19, item 8):
a stale holder — of the partition it would wipe, or of partition 0, whose holder keeps
the experiment's running statistics — writes nothing. The Redis store's scripts:
tests/integration/test_redis_store.py."""

from __future__ import annotations

from test_ab_pipeline import an_experiment, feed, started

from rankmeter.store import MemoryStore, PartitionCheckpoint


def checkpoint(epoch: int) -> PartitionCheckpoint:
    return PartitionCheckpoint(partition=0, epoch=epoch, layout="L", offsets={"t": 5}, watermarks={}, records={},
                               deadlines={}, deleted=[], buckets={"b": b"1"}, dropped_buckets=[], ab={}, meta={},
                               meta_deleted=[])


def test_a_stale_claim_cannot_wipe_the_partition():
    store = MemoryStore()
    stale = store.claim(0).epoch
    store.commit([checkpoint(store.claim(0).epoch)])   # another replica claimed it and stored a checkpoint
    assert store.wipe(0, stale) is False
    assert store.offsets[0] == {"t": 5} and store.buckets[0] == {"b": b"1"}
    assert store.wipe(0, store.epochs[0]) is True
    assert 0 not in store.offsets and 0 not in store.buckets and store.epochs[0] == stale + 1


def test_a_stale_holder_of_partition_0_cannot_write_the_running_statistics():
    store = MemoryStore()
    stale = store.claim(0).epoch
    store.claim(0)
    assert store.save_running("exp", {"P@10": "0.01"}, stale) is False
    assert store.append_look("exp", "{}", 10, stale) is False
    assert store.running == {} and store.history == {}
    assert store.save_running("exp", {"P@10": "0.01"}, store.epochs[0]) is True
    assert store.append_look("exp", "{}", 10, store.epochs[0]) is True
    assert store.running == {"exp": {"P@10": "0.01"}} and store.history == {"exp": ["{}"]}


def test_a_stale_pipelines_look_leaves_the_new_holders_statistics_alone():
    settings, events, _, store, bus, stale = an_experiment(5, 300, partitions=2)
    feed(stale, bus, events)
    newer = started(settings, store, bus)   # claims every partition again: `stale` stalled meanwhile
    assert newer.ab_look() is not None
    kept, history = {k: dict(v) for k, v in store.running.items()}, {k: list(v) for k, v in store.history.items()}
    assert kept and history
    store.running.clear()
    store.history.clear()
    stale.ab_look()   # wakes up and looks: its running minimum p was read before the newer holder's
    assert store.running == {} and store.history == {}
    newer.ab_look()
    assert store.running == kept
