"""Issue 19, items 3 and 4, on the in-process bus and the memory store: the store losing
its last checkpoints (put back to an earlier copy) is found, by the commit's mark check or by
the claim's comparison with Kafka's commit, and recovered exactly; offsets that go
backwards (a topic recreated, records deleted before they were read) are counted and refused
or resumed from the new log."""

from __future__ import annotations

import copy
import json

from rankmeter import config
from rankmeter.ab.experiment import readable
from rankmeter.exporter import Health
from rankmeter.pipeline import Pipeline
from rankmeter.serve import _lost_problem, _reclaim, _refused
from rankmeter.source import Bus
from rankmeter.store import FENCED, REWOUND, MemoryStore, PartitionCheckpoint
from test_ab_pipeline import an_experiment, feed, started
from test_pipeline import (FEEDBACK, IMPRESSIONS, NOW_S, SETTINGS, Clock, FlakyStore, assert_same, impression,
                           make_stream, run, sums)

RESUME = config.load(None, {"RANKMETER_KAFKA_ON_OFFSETS_RESET": "resume"})


class Loop:
    """serve's loop over a bus: claims with Kafka's commit and the log's bounds, commits
    Kafka's offsets after each batch, and claims again what the store lost (serve._reclaim)."""

    def __init__(self, store: MemoryStore, bus: Bus, settings: config.Settings = SETTINGS) -> None:
        self.bus, self.health, self.paused = bus, Health(), set()
        self.pipeline = Pipeline(settings, store, lambda r, why: None, Clock(), bounds=bus.bounds)
        bus.subscribe([IMPRESSIONS, FEEDBACK], self.assign, self.pipeline.revoke)

    def assign(self, partitions: list[int]) -> dict:
        return self.pipeline.assign(partitions, self.bus.committed(partitions), bounds=self.bus.bounds(partitions))

    def step(self, n: int) -> int:
        records = self.bus.poll(0, n)
        self.pipeline.process(records).commit(self.bus)
        self.pipeline.verify()   # serve: once a second
        if self.pipeline.rewound:
            _reclaim(self.pipeline, self.bus, self.health)
        self.paused |= _refused(self.pipeline, self.bus, self.paused)
        return len(records)

    def drain(self, n: int = 20) -> None:
        while self.step(n):
            pass


def filled(stream, partitions: int = 3) -> Bus:
    bus = Bus(partitions=partitions)
    for topic, key, event in stream:
        bus.send(topic, key.encode(), json.dumps(event).encode())
    return bus


def send(bus: Bus, events) -> None:
    for topic, event in events:
        bus.send(topic, event["query_id"].encode(), json.dumps(event).encode())


def queries(pipeline: Pipeline) -> int:
    return next(v for v in pipeline.views() if v.window == "5m").queries_all


def restart(store: MemoryStore, bus: Bus) -> Pipeline:
    """A new process on the store, claiming every partition (nothing left to read)."""
    pipeline = Pipeline(SETTINGS, store, lambda r, why: None, Clock(), bounds=bus.bounds)
    parts = list(range(bus.partitions))
    pipeline.assign(parts, bus.committed(parts), bounds=bus.bounds(parts))
    return pipeline


# ---- the store losing its last writes ----

def test_the_store_refuses_a_checkpoint_unless_it_holds_the_owners_last_mark():
    store = MemoryStore()
    store.claim(0)

    def checkpoint(offset: int, expect: str, mark: str) -> PartitionCheckpoint:
        return PartitionCheckpoint(0, 1, "", {"t": offset}, {}, {}, {}, [], {}, [], meta={"mark": mark}, expect=expect)

    assert store.commit([checkpoint(1, "", "1:1")]) == {}
    assert store.commit([checkpoint(2, "1:1", "1:2")]) == {}
    saved = copy.deepcopy(store.__dict__)
    assert store.commit([checkpoint(3, "1:2", "1:3")]) == {}
    store.__dict__.update(copy.deepcopy(saved))  # put back to the copy taken at 1:2
    assert store.commit([checkpoint(4, "1:3", "1:4")]) == {0: REWOUND}
    assert store.offsets[0] == {"t": 2} and store.meta[0]["mark"] == "1:2"
    # The epoch is checked first: another owner's claim is FENCED, whatever the mark.
    store.claim(0)
    assert store.commit([checkpoint(4, "1:2", "1:4")]) == {0: FENCED}


def put_back(seed: int, batches: int, batch: int) -> tuple[dict, Bus, MemoryStore, Loop]:
    """A stream's reference sums; a loop that ran `batches` batches, then as many more that
    the store then lost (put back to its copy taken between them: Kafka's commit is ahead)."""
    stream = make_stream(seed, queries=80)
    reference = sums(run(stream))
    bus, store = filled(stream), MemoryStore()
    loop = Loop(store, bus)
    for _ in range(batches):
        loop.step(batch)
    saved = copy.deepcopy(store.__dict__)   # the copy Redis will be put back to
    for _ in range(batches):
        loop.step(batch)
    store.__dict__.update(copy.deepcopy(saved))
    return reference, bus, store, loop


def test_writes_lost_mid_run_are_refused_reclaimed_and_the_result_exact():
    reference, bus, store, loop = put_back(7, 4, 25)
    loop.drain()
    lost = dict(loop.pipeline.ledger.checkpoints_lost)
    assert lost and set(lost.values()) == {1}, lost
    assert loop.pipeline.rewound == set() and loop.pipeline.lost == set()
    assert_same(sums(loop.pipeline), reference)
    # What the store holds is whole: a restart on it exports the same.
    assert_same(sums(restart(store, bus)), reference)


def test_a_claim_finds_kafka_ahead_of_the_store_and_resumes_from_what_it_holds():
    # Lost while no process ran (a restart from an old copy).
    reference, bus, store, _ = put_back(8, 3, 30)
    ahead = {p for (t, p), o in bus.committed([0, 1, 2]).items() if o > store.offsets.get(p, {}).get(t, 0)}
    assert ahead
    second = Loop(store, bus)
    assert dict(second.pipeline.ledger.checkpoints_lost) == {p: 1 for p in ahead}
    second.drain()
    assert_same(sums(second.pipeline), reference)


def test_lost_writes_whose_offsets_kafka_no_longer_holds_are_state_lost():
    bus, store = Bus(partitions=1), MemoryStore()
    loop = Loop(store, bus)
    send(bus, [impression(f"q{i}", int(NOW_S * 1000)) for i in range(3)])
    loop.drain()
    saved = copy.deepcopy(store.__dict__)
    send(bus, [impression(f"q{i}", int(NOW_S * 1000)) for i in range(3, 6)])
    loop.drain()
    store.__dict__.update(copy.deepcopy(saved))
    bus.truncate(IMPRESSIONS, 0, 5)   # retention took what would have to be read again
    second = Loop(store, bus)
    assert second.pipeline.lost == {0} and dict(second.pipeline.ledger.checkpoints_lost) == {0: 1}
    assert "--rebuild" in _lost_problem(second.pipeline)
    assert second.step(100) == 0   # not consumed


# ---- offsets going backwards ----

def fed(settings: config.Settings, n: int) -> tuple[Bus, MemoryStore, Loop]:
    """A one-partition bus holding `n` impressions, and a loop on a fresh store."""
    bus, store = Bus(partitions=1), MemoryStore()
    loop = Loop(store, bus, settings)
    send(bus, [impression(f"q{i}", int(NOW_S * 1000)) for i in range(n)])
    return bus, store, loop


def recreate(bus: Bus) -> None:
    """The impressions topic deleted and created again, with two records."""
    bus.recreate(IMPRESSIONS)
    send(bus, [impression(f"n{i}", int(NOW_S * 1000)) for i in range(2)])


def test_a_recreated_topic_is_refused_at_claim_by_default_and_resumed_when_configured():
    for settings in (SETTINGS, RESUME):
        bus, store, first = fed(settings, 5)
        first.drain()
        recreate(bus)
        second = Loop(store, bus, settings)
        second.drain()
        reset = dict(second.pipeline.ledger.offsets_reset)
        assert reset == {(IMPRESSIONS, 0, "recreated"): 1}
        if settings is SETTINGS:
            assert second.pipeline.stopped.keys() == {0} and second.pipeline.partitions == {}
            problem = _lost_problem(second.pipeline)
            assert "offsets reset for partitions [0]" in problem and "recreated" in problem, problem
        else:
            assert second.pipeline.stopped == {} and queries(second.pipeline) == 7
            assert dict(second.pipeline.ledger.offsets_skipped) == {(IMPRESSIONS, 0): 0}


def test_records_deleted_before_they_were_read_are_found_mid_run():
    for settings in (SETTINGS, RESUME):
        bus, store, loop = fed(settings, 10)
        loop.step(3)
        bus.truncate(IMPRESSIONS, 0, 6)   # delete_records while the consumer is behind
        loop.drain()
        assert dict(loop.pipeline.ledger.offsets_reset) == {(IMPRESSIONS, 0, "truncated"): 1}
        if settings is SETTINGS:
            assert loop.pipeline.stopped.keys() == {0} and loop.paused == {0}
            assert queries(loop.pipeline) == 3 and store.offsets[0][IMPRESSIONS] == 3
        else:
            assert dict(loop.pipeline.ledger.offsets_skipped) == {(IMPRESSIONS, 0): 3}
            assert queries(loop.pipeline) == 7 and store.offsets[0][IMPRESSIONS] == 10


def test_a_gap_resumed_past_is_counted_once_when_a_rebalance_claims_it_again_before_its_checkpoint():
    """Seen in serve: a rebalance right after the claim found the gap again; counting at the
    claim counted every skipped offset twice. The count waits for the stored checkpoint."""
    bus, store, first = fed(RESUME, 5)
    first.drain()
    send(bus, [impression(f"d{i}", int(NOW_S * 1000)) for i in range(4)])
    bus.truncate(IMPRESSIONS, 0, 9)   # the 4 unread records deleted while no replica ran
    second = Loop(store, bus, RESUME)   # claims: the gap is found, not yet stored
    assert dict(second.pipeline.ledger.offsets_skipped) == {}
    bus.rejoin()                        # revoked and claimed again before any checkpoint
    second.drain()
    assert dict(second.pipeline.ledger.offsets_reset) == {(IMPRESSIONS, 0, "truncated"): 1}
    assert dict(second.pipeline.ledger.offsets_skipped) == {(IMPRESSIONS, 0): 4}
    assert store.offsets[0][IMPRESSIONS] == 9


def test_a_topic_recreated_mid_run_is_found_and_the_new_log_read_when_resuming():
    for settings in (SETTINGS, RESUME):
        bus, store, loop = fed(settings, 5)
        loop.drain()
        recreate(bus)
        loop.drain()
        assert dict(loop.pipeline.ledger.offsets_reset) == {(IMPRESSIONS, 0, "recreated"): 1}
        if settings is SETTINGS:
            assert loop.pipeline.stopped.keys() == {0} and queries(loop.pipeline) == 5
        else:
            assert queries(loop.pipeline) == 7 and store.offsets[0][IMPRESSIONS] == 2
            # Stored: a restart resumes on the new log without finding it reset again.
            again = Loop(store, bus, settings)
            assert dict(again.pipeline.ledger.offsets_reset) == {} and queries(again.pipeline) == 7


def test_a_gap_the_log_still_spans_is_no_reset():
    """Transaction markers leave gaps in offsets: not a reset when the log holds the offset."""
    bus, store, loop = fed(SETTINGS, 6)
    records = bus.poll(0, 100)
    loop.pipeline.process([r for r in records if r.offset != 2]).commit(bus)
    assert dict(loop.pipeline.ledger.offsets_reset) == {} and queries(loop.pipeline) == 5


def test_the_experiments_running_statistics_lost_are_found_and_carried_on():
    """The A/B running minimum p and confidence-sequence bounds are written apart from the
    partitions' checkpoints: a look that reads back older ones counts it and goes on from
    what its holder saved (a lost write never moves the running minimum p back up)."""
    settings, events, _, store, bus, pipeline = an_experiment(5, 600, partitions=3)
    feed(pipeline, bus, events[:200])
    pipeline.ab_look()
    older = copy.deepcopy(store.running)
    feed(pipeline, bus, events[200:])
    pipeline.ab_look()
    assert store.running != older
    control = copy.deepcopy(store)       # what a look finds without the loss
    store.running = older                # Redis put back to an earlier copy
    got = pipeline.ab_look()
    assert pipeline.experiments.records.lost == 1
    expected = started(settings, control, Bus(partitions=3)).ab_look()
    assert [c.running for c in got.comparisons] == [c.running for c in expected.comparisons]
    assert store.running == control.running


def test_the_running_statistics_are_found_lost_when_the_whole_store_is_put_back():
    """Review finding: a real restore puts partition 0's mark back too, so its next commit
    is refused and it is claimed again; what its holder saved must survive that reclaim, or
    the lost running minimum p goes unnoticed and moves back up."""
    _, events, _, store, bus, pipeline = an_experiment(5, 600, partitions=3)
    feed(pipeline, bus, events[:200])
    pipeline.ab_look()
    older = copy.deepcopy(store)            # every key, as an RDB copy
    feed(pipeline, bus, events[200:500])
    pipeline.ab_look()
    saved = copy.deepcopy(store.running)
    for name in vars(older):                # Redis put back to the copy
        setattr(store, name, copy.deepcopy(getattr(older, name)))
    send(bus, [({"impressions": IMPRESSIONS, "feedback": FEEDBACK}[s], e) for s, _, e in events[500:]])
    pipeline.process(bus.poll(0, 37))
    assert 0 in pipeline.rewound
    assert _reclaim(pipeline, bus, Health())
    pipeline.ab_look()
    assert pipeline.experiments.records.lost == 1
    for state, kept in saved.items():       # no running minimum p saved before the loss moved back up
        now = store.running[state]
        assert [k for k in kept if k in now and float(now[k].split()[0]) > float(kept[k].split()[0])] == []
        # ... and none is missing, those this look did not compute (FirstClickRank: too few
        # clicked queries an arm in the rewound state) included.
        assert [k for k in kept if k not in now] == []


def test_a_partition_whose_state_is_gone_entirely_is_claimed_once():
    """Review finding: an idle partition whose stored state is gone altogether (mark
    included) is found rewound, claimed again and found lost, once: not claimed again on
    every batch and every second."""
    store, bus = MemoryStore(), filled(make_stream(1))
    loop = Loop(store, bus)
    loop.drain()
    for table in (store.offsets, store.watermarks, store.layouts, store.records, store.deadlines,
                  store.buckets, store.ab, store.meta):
        table.pop(1, None)
    loop.step(20)
    epoch = store.epochs[1]
    for _ in range(4):
        loop.step(20)
    assert loop.pipeline.lost == {1} and 1 not in loop.pipeline.rewound
    assert store.epochs[1] == epoch


def test_a_failed_reclaim_names_the_broker_or_the_store_whichever_failed():
    """serve's /readyz must send the operator to what is away: the log's bounds failing is
    the broker, a claim failing is the store."""
    for failing in ("broker", "store"):
        _, bus, store, loop = put_back(7, 4, 25)
        loop.pipeline.process(bus.poll(0, 25)).commit(bus)   # refused: the store lost writes
        assert loop.pipeline.rewound
        health = Health()

        def away(*args, **kwargs):
            raise ConnectionError(f"the {failing} away")
        if failing == "broker":
            bus.bounds = away
        else:
            store.unavailable, store.claim = (ConnectionError,), away
        assert _reclaim(loop.pipeline, bus, health) is False
        named, other = (("source_problem", "store_problem") if failing == "broker"
                        else ("store_problem", "source_problem"))
        assert getattr(health, named) == "reclaiming partitions after lost writes failed: ConnectionError"
        assert getattr(health, other) == "", failing


def test_an_unreadable_stored_mark_is_not_ours_and_the_partition_is_claimed_again():
    """A mark Redis holds that is not `epoch:number` (written by hand, a bad restore) must
    not stop serve's once-a-second check: it is not this owner's, so the partition is rewound."""
    bus, store = Bus(partitions=1), MemoryStore()
    loop = Loop(store, bus)
    for i, garbage in enumerate(("", "x:1", "\ufffd\ufffd:7", "²:1")):  # "²": a digit to isdigit, not to int()
        send(bus, [impression(f"q{i}", int(NOW_S * 1000))])
        loop.drain()   # a checkpoint: the partition's mark is this owner's
        store.meta[0]["mark"] = garbage
        loop.pipeline.verify()
        assert loop.pipeline.rewound == {0}, garbage
        _reclaim(loop.pipeline, bus, Health())
        assert loop.pipeline.rewound == set() and queries(loop.pipeline) == i + 1


def test_a_gap_resumed_past_in_an_unsure_checkpoint_is_counted_once_whether_it_was_stored_or_not():
    for fail in ("before", "after"):
        bus, store = Bus(partitions=1), FlakyStore()   # its next commit fails, before applying or after
        first = Loop(store, bus, RESUME)
        send(bus, [impression(f"q{i}", int(NOW_S * 1000)) for i in range(5)])
        first.drain()
        send(bus, [impression(f"d{i}", int(NOW_S * 1000)) for i in range(4)])
        bus.truncate(IMPRESSIONS, 0, 9)
        second = Loop(store, bus, RESUME)   # the gap found at the claim
        store.fail = fail
        try:
            second.pipeline.process(bus.poll(0, 20))
        except ConnectionError:
            pass
        # serve's recovery: claimed again from the store (settling the unsure checkpoint)
        second.pipeline.revoke([0], reclaiming=True)
        bus.seek(second.assign(bus.assigned()))
        second.drain()
        assert dict(second.pipeline.ledger.offsets_reset) == {(IMPRESSIONS, 0, "truncated"): 1}, fail
        assert dict(second.pipeline.ledger.offsets_skipped) == {(IMPRESSIONS, 0): 4}, fail
        assert store.offsets[0][IMPRESSIONS] == 9


def test_a_process_back_on_partition_0_with_older_memory_never_loosens_the_running_statistics():
    """Review finding: a process that kept what it saved (a reclaim) while another holder
    went on looking must not write its older running p or wider sequence over the newer
    ones, nor take the difference for a loss."""
    def parsed(running: dict) -> dict:
        return {(s, k): [float(x) for x in v.split()] for s, fields in running.items() for k, v in fields.items()
                if not s.endswith("|tested")}  # (marks: when a record was first saved)
    for seed in (1, 2, 3):
        _, events, _, store, bus, a = an_experiment(seed, 900, partitions=3)
        feed(a, bus, events[:300])
        a.ab_look()
        a.revoke([0, 1, 2], reclaiming=True)   # keeps what it saved: it means to claim again
        b = started(a.settings, store, bus)
        for lo in range(300, len(events), 150):
            feed(b, bus, events[lo:lo + 150])
            b.ab_look()
        by_b = parsed(store.running)
        a.assign([0, 1, 2], bus.committed([0, 1, 2]), bounds=bus.bounds([0, 1, 2]))
        a.ab_look()
        now = parsed(store.running)
        assert a.experiments.records.lost == 0
        assert [k for k, (p, lo, hi, *_) in by_b.items() if now[k][0] > p or now[k][1] < lo or now[k][2] > hi] == []


def test_an_unreadable_stored_running_statistic_is_skipped_and_counted_not_a_crash():
    _, events, _, store, bus, pipeline = an_experiment(5, 300, partitions=2)
    feed(pipeline, bus, events)
    pipeline.ab_look()
    [state] = [k for k in store.running if "|alpha=" in k]  # (not the marks, `|tested`)
    field = next(iter(store.running[state]))
    store.running[state][field] = "not numbers"
    look = pipeline.ab_look()   # no exception
    assert look is not None and readable(store.running[state][field])
    assert pipeline.unreadable.counts["experiment"] >= 1
