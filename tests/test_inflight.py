"""serve's checkpoint in flight (rankmeter/inflight.py): the next batch is polled and
decoded while the previous batch's store commit is outstanding; that commit is confirmed
before the next batch's is sent, and nothing is handed to Kafka before it is stored."""

import json
import threading
import time

import msgspec

from rankmeter import config
from rankmeter.serve import run
from rankmeter.source import Bus
from rankmeter.store import MemoryStore

SETTINGS = config.load(None, {"RANKMETER_KAFKA_MAX_POLL_RECORDS": "2"})
SETTINGS = msgspec.structs.replace(SETTINGS, metrics=msgspec.structs.replace(SETTINGS.metrics, port=0))


class HeldStore(MemoryStore):
    """Each commit holding records waits until the test lets it through."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Semaphore(0)
        self.go = threading.Semaphore(0)
        self.commits_in_progress = 0
        self.overlapping_commits = 0

    def commit(self, checkpoints):
        checkpoints = list(checkpoints)
        if not any(c.records for c in checkpoints):
            return super().commit(checkpoints)
        self.commits_in_progress += 1
        self.overlapping_commits += self.commits_in_progress > 1
        self.entered.release()
        assert self.go.acquire(timeout=20)
        try:
            return super().commit(checkpoints)
        finally:
            self.commits_in_progress -= 1


class WatchedBus(Bus):
    """Records what the loop did while a commit was held."""

    def __init__(self, store: HeldStore) -> None:
        super().__init__(partitions=1)
        self.store = store
        self.polled_while_held = 0
        self.handed: list[dict] = []
        self.handed_while_held: list[dict] = []

    def poll(self, timeout_ms, max_records):
        records = super().poll(timeout_ms, max_records)
        if records and self.store.commits_in_progress:
            self.polled_while_held += len(records)
        return records

    def commit(self, offsets):
        (self.handed_while_held if self.store.commits_in_progress else self.handed).append(dict(offsets))
        super().commit(offsets)


def query(qid: str) -> list[tuple[str, bytes, bytes]]:
    now = int(time.time() * 1000)
    return [(SETTINGS.kafka.impressions_topic, qid.encode(), json.dumps(
        {"query_id": qid, "ranker": "r", "timestamp": now, "results": ["a", "b"]}).encode()),
            (SETTINGS.kafka.feedback_topic, qid.encode(), json.dumps(
                {"query_id": qid, "action": "click", "doc_id": "a", "timestamp": now}).encode())]


def test_the_next_batch_is_read_while_the_commit_is_outstanding_and_nothing_acknowledged_before_it_is_stored():
    store = HeldStore()
    bus = WatchedBus(store)
    stop, started = threading.Event(), {}
    for qid in ("q1", "q2", "q3"):
        for topic, key, value in query(qid):
            bus.send(topic, key, value)
    server = threading.Thread(target=run, args=(SETTINGS, bus, store, stop, lambda p, port: started.update(
        pipeline=p)), daemon=True)
    server.start()
    try:
        assert store.entered.acquire(timeout=20)  # the first batch's commit, held
        deadline = time.monotonic() + 10
        while bus.polled_while_held == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        # The next batch was polled (and decoded) meanwhile; nothing was acknowledged to Kafka.
        assert bus.polled_while_held == 2
        assert bus.handed_while_held == [] and bus.handed == []
        store.go.release()
        for _ in range(2):  # the later batches' commits, one at a time
            assert store.entered.acquire(timeout=20)
            store.go.release()
        while sum(started["pipeline"].events.values()) < 6 and time.monotonic() < deadline + 10:
            time.sleep(0.01)
        assert dict(started["pipeline"].events) == {("impressions", "applied"): 3, ("feedback", "applied"): 3}
    finally:
        stop.set()
        for _ in range(3):
            store.go.release()
        server.join(timeout=20)
    assert not server.is_alive()
    assert store.overlapping_commits == 0  # a batch's commit is sent only once the one before is confirmed
    assert bus.handed_while_held == []
    # Kafka's offsets: each batch's once stored, the last one's too (settled at the stop).
    topics = (SETTINGS.kafka.impressions_topic, SETTINGS.kafka.feedback_topic)
    assert {tp: o for offsets in bus.handed for tp, o in offsets.items()} == {(t, 0): 3 for t in topics}


def test_a_batch_read_before_its_partition_was_dropped_or_claimed_again_applies_nothing_of_it():
    """Read while the previous commit was in flight, which was then refused for partition 0
    (dropped) or a rebalance claimed it again: that partition's records, rejections and dead
    letters are left to be read again from its stored offsets; partition 1's go on."""
    from rankmeter.pipeline import Pipeline

    dead: list[str] = []
    store, bus = MemoryStore(), Bus(partitions=2)
    pipeline = Pipeline(SETTINGS, store, lambda record, reason: dead.append(record.key.decode()))
    bus.subscribe([SETTINGS.kafka.impressions_topic, SETTINGS.kafka.feedback_topic], pipeline.assign,
                  pipeline.revoke)
    for qid in ("a", "b", "c", "d"):
        for topic, key, value in query(qid):
            bus.send(topic, key, value)
        bus.send(SETTINGS.kafka.feedback_topic, qid.encode(), b"not json")
    records = bus.poll(0, 100)
    assert {r.partition for r in records} == {0, 1}
    batch = pipeline.read(records)
    pipeline.revoke([0])
    pipeline.assign([0])  # claimed again: a new state, resuming from the store (nothing stored yet)
    pipeline.step(batch).send()
    on_1 = {r.key.decode() for r in records if r.partition == 1}
    assert set(dead) == on_1 and len(dead) == len(on_1)
    topics = (SETTINGS.kafka.impressions_topic, SETTINGS.kafka.feedback_topic)
    assert pipeline.partitions[0].offsets == {t: 0 for t in topics} and pipeline.partitions[0].records == {}
    assert pipeline.partitions[1].offsets == {t: n for t, n in zip(topics, (len(on_1), 2 * len(on_1)))}
    assert set(pipeline.partitions[1].records) == on_1


def test_the_harvest_runs_as_the_checkpoint_is_sent_and_is_stored_with_it(monkeypatch):
    """The position-bias harvest is off the consuming thread's path: a batch's queries whose
    clicks are final go into the tables when its checkpoint is sent (serve: from the
    checkpoint's thread, while the next batch is read), and their pair sums are in that
    checkpoint, not the next."""
    import numpy as np
    from test_debias_pipeline import simulate

    from rankmeter.pipeline import PAIRS, Pipeline

    moved = {"apply": 0, "send": 0}
    stored_behind = []

    def process(self, records):
        before = self.position_bias.tables.vector()
        checkpoint = self.apply(records)
        after_apply = self.position_bias.tables.vector()
        checkpoint.send()
        after_send = self.position_bias.tables.vector()
        checkpoint.confirm()
        moved["apply"] += not np.array_equal(before, after_apply)
        moved["send"] += not np.array_equal(after_apply, after_send)
        stored = self.store.load_ab(list(self.partitions))
        stored_behind.extend(p for p, ps in self.partitions.items() if ps.pair_sums is not None and ps.pair_sums.any() and (
            PAIRS not in stored[p] or not np.array_equal(np.frombuffer(stored[p][PAIRS]), ps.pair_sums)))
        return checkpoint

    monkeypatch.setattr(Pipeline, "process", process)
    pipeline, _, _ = simulate(seed=5, queries=1_200, look=False)
    assert pipeline.position_bias.tables.pbm.entries  # harvested
    assert moved["apply"] == 0 and moved["send"] > 0
    assert stored_behind == []


class QuietBus(Bus):
    """A broker with nothing more to read: an empty poll waits its whole timeout (as Kafka's
    does), until the test ends it."""

    def __init__(self) -> None:
        super().__init__(partitions=1)
        self.ended = threading.Event()

    def poll(self, timeout_ms, max_records):
        records = super().poll(0, max_records)
        if not records:
            self.ended.wait(timeout_ms / 1000)
        return records


def test_the_last_batch_before_a_quiet_spell_is_confirmed_without_waiting_for_a_poll_timeout():
    """Its commit answered, the batch is counted and its offsets handed to Kafka at once, not
    once the next (blocking) poll gives up: the loop does not block on the broker while a
    checkpoint is in flight."""
    settings = config.load(None, {"RANKMETER_KAFKA_POLL_TIMEOUT_MS": "60000"})
    settings = msgspec.structs.replace(settings, metrics=msgspec.structs.replace(settings.metrics, port=0))
    bus, stop, started = QuietBus(), threading.Event(), {}
    for topic, key, value in query("q1"):
        bus.send(topic, key, value)
    server = threading.Thread(target=run, args=(settings, bus, MemoryStore(), stop, lambda p, port: started.update(
        pipeline=p)), daemon=True)
    server.start()
    try:
        deadline = time.monotonic() + 10  # well short of the poll timeout
        while (not started or sum(started["pipeline"].events.values()) < 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dict(started["pipeline"].events) == {("impressions", "applied"): 1, ("feedback", "applied"): 1}
        topics = (settings.kafka.impressions_topic, settings.kafka.feedback_topic)
        assert bus.committed_offsets == {(t, 0): 1 for t in topics}
    finally:
        stop.set()
        bus.ended.set()
        server.join(timeout=20)
    assert not server.is_alive()


class FailingOnceStore(MemoryStore):
    """The first commit holding records fails as a Redis going away does (after it may or
    may not have been applied: here it was not)."""

    unavailable = (ConnectionError,)

    def __init__(self) -> None:
        super().__init__()
        self.failed = 0

    def commit(self, checkpoints):
        checkpoints = list(checkpoints)
        if not self.failed and any(c.records for c in checkpoints):
            self.failed += 1
            raise ConnectionError("the store went away")
        return super().commit(checkpoints)


class RecordingBus(Bus):
    """Each offset handed to Kafka, beside what the store held then."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(partitions=1)
        self.store = store
        self.ahead: list[tuple] = []

    def commit(self, offsets):
        stored = self.store.offsets.get(0, {})
        self.ahead.extend((tp, o, stored.get(tp[0], 0)) for tp, o in offsets.items() if o > stored.get(tp[0], 0))
        super().commit(offsets)


def test_a_failed_commit_in_flight_acknowledges_nothing_and_reloads_from_the_store(caplog):
    """Review 7, F2.1: the commit in flight fails (Redis away). Nothing of that batch reaches
    Kafka before the store holds it; serve records the failure and reloads every partition
    from the store, which then reads the batch again: each query once in the stored state."""
    store = FailingOnceStore()
    bus, stop, started = RecordingBus(store), threading.Event(), {}
    for qid in ("q1", "q2", "q3"):
        for topic, key, value in query(qid):
            bus.send(topic, key, value)
    server = threading.Thread(target=run, args=(SETTINGS, bus, store, stop, lambda p, port: started.update(
        pipeline=p)), daemon=True)
    topics = (SETTINGS.kafka.impressions_topic, SETTINGS.kafka.feedback_topic)
    with caplog.at_level("ERROR", logger="rankmeter"):
        server.start()
        try:
            deadline = time.monotonic() + 20
            while bus.committed_offsets != {(t, 0): 3 for t in topics} and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            stop.set()
            server.join(timeout=20)
    assert not server.is_alive()
    assert store.failed == 1
    assert bus.committed_offsets == {(t, 0): 3 for t in topics}
    assert bus.ahead == []  # no offset handed to Kafka beyond what the store held
    assert store.offsets[0] == {t: 3 for t in topics}
    assert sorted(k for k in store.records.get(0, {})) == ["q1", "q2", "q3"]
    assert any("the state store failed during a batch" in r.getMessage() for r in caplog.records)
