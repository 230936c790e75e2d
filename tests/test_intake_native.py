"""The pipeline with the C decoder (rankmeter._events: runs of plain native messages read
at once, pipeline/intake.py) and without it (record by record in Python, as where the
module is not built) ends in the same state: the same outcome counts, dead letters (their
reasons, in order), stored records, buckets and aggregates, whatever is mixed into the
stream (native traffic, UBI records, hostile or damaged messages, wrong keys, replays)
and however it is batched."""

from __future__ import annotations

import json
import os
import random
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rankmeter.events.decoder as decoder_module
from rankmeter import config
from rankmeter.pipeline import Pipeline
from rankmeter.source import Bus, Record
from rankmeter.store import MemoryStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ubi_shapes  # noqa: E402

try:
    from rankmeter import _events
except ImportError:
    _events = None

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
pytestmark = pytest.mark.skipif(_events is None and not IN_CI,
                                reason="the C decoder is not built (scripts/build_native.py)")

NOW_MS = 1_800_000_000_000
SETTINGS = config.load(None, {"RANKMETER_AB_UNIT": "user"})
TOPIC = {"impressions": SETTINGS.kafka.impressions_topic, "feedback": SETTINGS.kafka.feedback_topic}
HOSTILE = [b"", b"not json", b"{", b"[]", b'{"query_id": 7}', b"\xff\xfe", b'{"query_id": "q\\u0000"}',
           json.dumps({"query_id": "q", "ranker": "r", "timestamp": "yesterday", "results": []}).encode()]


def stream(seed: int) -> list[tuple[str, bytes | None, bytes | None]]:
    """(stream, key, value): native searches and their clicks, in order, with messages the
    C path must leave to Python sprinkled in (plain-looking ones the rules refuse or that
    hold something else: a wrong key, an unknown action, a position 0, a label, non-ASCII, a
    user's id and text), then UBI records and damaged messages."""
    rnd = random.Random(seed)
    queries = ubi_shapes.searches(seed, 130, NOW_MS)
    out = [(kind, key.encode(), json.dumps(record).encode()) for kind, key, record in ubi_shapes.native(queries[:120])]
    for q in queries[:40]:
        judgment = {"query_id": q.query_id, "doc_id": q.shown[0], "action": "judgment",
                    "grade": rnd.randint(0, 3), "timestamp": q.timestamp_ms + 5, "event_id": f"{q.query_id}:j"}
        variant = dict(judgment, event_id=f"{q.query_id}:k", action=rnd.choice(
            ["click", "purchase", "unknown", "impression"]), position=rnd.choice([None, 0, 1, 3]),
            dwell_ms=rnd.choice([None, -1, 0, 40_000]), label=rnd.choice([None, None, "Exact", 3]),
            doc_id=rnd.choice([q.shown[-1], q.shown[-1] + "é", "x" * 513]))
        for key, record in ((q.query_id, judgment), (q.query_id, judgment),  # (redelivered)
                            (rnd.choice([q.query_id, q.query_id, "someone-else"]), variant)):
            out.insert(rnd.randrange(len(out)), ("feedback", key.encode(), json.dumps(record).encode()))
    impression = {"query_id": "q-users", "ranker": "b", "timestamp": NOW_MS - 10, "results": ["a", "b", "a"],
                  "user_query": "Red shoes", "client_id": "u-1", "segment": "mobile"}
    out.insert(rnd.randrange(len(out)), ("impressions", b"q-users", json.dumps(impression).encode()))
    out.append(("impressions", b"q-users", json.dumps(impression, ensure_ascii=False).encode()))  # a duplicate
    out.extend((kind, key.encode(), json.dumps(record).encode()) for kind, key, record in ubi_shapes.generator(queries[120:]))
    out.extend((rnd.choice(["impressions", "feedback"]), b"q", rnd.choice(HOSTILE)) for _ in range(10))
    return out


def run(events, sizes: list[int], native: bool, monkeypatch: pytest.MonkeyPatch, runs: Counter):
    letters: list[str] = []
    store = MemoryStore()
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(decoder_module, "_plain_decoder", lambda rules: None)
        pipeline = Pipeline(SETTINGS, store, lambda record, why: letters.append(why), lambda: NOW_MS / 1000)
    read_each = pipeline._intake._read_each

    def counted(batch, records, start: int, stop: int, checked) -> None:  # records read one by one
        runs["one by one"] += stop - start
        read_each(batch, records, start, stop, checked)

    pipeline._intake._read_each = counted
    assert (pipeline._intake.decoder.plain is not None) == native
    bus = Bus(partitions=3)
    for kind, key, value in events:
        bus.send(TOPIC[kind], key, value)
    bus.subscribe(list(TOPIC.values()), pipeline.assign, pipeline.revoke)
    batches = iter(sizes)
    while records := bus.poll(0, next(batches, 1000)):
        runs["records"] += len(records)
        pipeline.process(records)
    views = sorted((v.ranker, v.window, sorted(v.sums.items())) for v in pipeline.views())
    return dict(pipeline.events), letters, store.records, store.buckets, store.meta, views


RUNS = Counter()  # over every example: records read, records read one by one (the others in C)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.integers(1, 300), min_size=1, max_size=10))
def test_with_and_without_the_c_decoder_the_same_state(seed: int, sizes: list[int]) -> None:
    monkeypatch = pytest.MonkeyPatch()
    events = stream(seed)
    native = run(events, sizes, True, monkeypatch, RUNS)
    python = run(events, sizes, False, monkeypatch, Counter())
    assert native == python
    counts = native[0]
    assert counts[("impressions", "applied")] >= 120 and counts[("feedback", "duplicate")] >= 40 and counts[("feedback", "invalid")] >= 1


def test_both_ways_of_reading_were_compared() -> None:
    """(After the test above, in this module's order: both paths were taken, often.)"""
    if not RUNS:
        test_with_and_without_the_c_decoder_the_same_state()
    assert RUNS["one by one"] >= 500 and RUNS["records"] - RUNS["one by one"] >= 5000, RUNS


# ---- offsets: gaps, replays, partitions not held, other topics, a failing bounds query ----

def _pipeline(settings, native: bool, letters: list, bounds, wall=lambda: 1000.0):
    with pytest.MonkeyPatch().context() as patch:
        if not native:
            patch.setattr(decoder_module, "_plain_decoder", lambda rules: None)
        pipeline = Pipeline(settings, MemoryStore(), lambda r, why: letters.append((r.topic, r.partition, r.offset, why)),
                            lambda: NOW_MS / 1000, wall, bounds=bounds)
    assert (pipeline._intake.decoder.plain is not None) == native
    return pipeline


def _records(rnd: random.Random, n: int) -> list[Record]:
    """Records as a poll may hand them: mostly each partition's next, sometimes a gap or a
    replay, a partition not held (3), a topic not ours, wrong keys, tombstones, damage."""
    impressions, feedback = TOPIC["impressions"], TOPIC["feedback"]
    out, offsets = [], {}
    for _ in range(n):
        topic = rnd.choice([impressions, impressions, feedback, feedback, feedback, "other"])
        partition, q = rnd.randrange(4), f"q{rnd.randint(0, 30)}"
        key = rnd.choice([q.encode()] * 8 + [None, b"zz"])
        if topic == impressions:
            value = {"query_id": q, "ranker": rnd.choice("ab"), "timestamp": NOW_MS - rnd.randint(0, 10 ** 6),
                     "results": [f"d{rnd.randint(0, 5)}" for _ in range(rnd.randint(0, 6))]}
            if rnd.random() < 0.2:
                value["client_id"] = f"u{rnd.randint(0, 9)}"
        else:
            value = {"query_id": q, "timestamp": NOW_MS - rnd.randint(0, 10 ** 6), "doc_id": f"d{rnd.randint(0, 5)}",
                     "action": rnd.choice(["click", "purchase", "impression", "judgment", "zzz"]),
                     "event_id": f"e{rnd.randint(0, 50)}"}
            for field, p, values in (("position", 0.5, range(5)), ("grade", 0.3, range(4)), ("dwell_ms", 0.2, (0, 40_000))):
                if rnd.random() < p:
                    value[field] = rnd.choice(values)
        data = json.dumps(value).encode()
        if rnd.random() < 0.05:
            data = rnd.choice([b"", b"{", None, '{"query_id":"é"}'.encode()])
        offset, u = offsets.get((topic, partition), 0), rnd.random()
        if u < 0.04:
            offset += rnd.randint(2, 5)  # a gap: the log was truncated, or compacted
        elif u < 0.07:
            offset = max(0, offset - rnd.randint(1, 5))  # a replay
        offsets[(topic, partition)] = offset + 1
        out.append(Record(topic, partition, offset, key, data, [], NOW_MS))
    if rnd.random() < 0.5:
        out.sort(key=lambda r: (r.partition, r.topic))  # (stable: each partition's in order)
    return out


def _state(pipeline: Pipeline, letters: list, store: MemoryStore) -> tuple:
    views = sorted((v.ranker, v.window, sorted(v.sums.items())) for v in pipeline.views())
    held = {p: (dict(ps.offsets), dict(ps.watermarks), ps.shown_wall_ms) for p, ps in pipeline.partitions.items()}
    return (dict(pipeline.events), letters, store.records, store.buckets, store.meta, views, held,
            sorted(pipeline.ledger.stopped), sorted(pipeline.ledger.recheck))


@pytest.mark.parametrize("seed", range(40))
def test_gaps_replays_and_partitions_not_held_the_same_with_and_without_c(seed: int) -> None:
    rnd = random.Random(seed)
    records = _records(rnd, rnd.randint(50, 600))
    sizes = [rnd.randint(1, 200) for _ in range(5)]
    states = []
    for native in (True, False):
        failing = random.Random(seed)

        def bounds(partitions: list[int]) -> dict:
            if failing.random() < 0.01:
                raise RuntimeError("the log's bounds cannot be read now")
            return {(t, p): (0, 10 ** 6) for t in TOPIC.values() for p in partitions}

        letters: list = []
        pipeline = _pipeline(SETTINGS, native, letters, bounds)
        pipeline.assign([0, 1, 2])
        start = k = 0
        while start < len(records):
            pipeline.process(records[start:start + sizes[k % len(sizes)]])
            start, k = start + sizes[k % len(sizes)], k + 1
        states.append(_state(pipeline, letters, pipeline.store))
    assert states[0] == states[1]


@pytest.mark.parametrize("policy", ["refuse", "resume"])
@pytest.mark.parametrize("seed", range(8))
def test_recreated_truncated_topics_and_a_restart_the_same_with_and_without_c(policy: str, seed: int) -> None:
    settings = config.load(None, {"RANKMETER_KAFKA_ON_OFFSETS_RESET": policy})
    impressions, feedback = settings.kafka.impressions_topic, settings.kafka.feedback_topic
    states = []
    for native in (True, False):
        rnd, bus, store, letters = random.Random(seed), Bus(partitions=2), MemoryStore(), []

        def started() -> Pipeline:
            with pytest.MonkeyPatch().context() as patch:
                if not native:
                    patch.setattr(decoder_module, "_plain_decoder", lambda rules: None)
                pipeline = Pipeline(settings, store, lambda r, why: letters.append((r.topic, r.partition, r.offset, why)),
                                    lambda: NOW_MS / 1000, lambda: 1000.0, bounds=bus.bounds)
            bus.subscribe([impressions, feedback], pipeline.assign, pipeline.revoke)
            return pipeline

        def send(n: int, base: int) -> None:
            for i in range(n):
                q = f"q{base + i}"
                bus.send(impressions, q.encode(), json.dumps({"query_id": q, "ranker": rnd.choice("ab"),
                                                              "timestamp": NOW_MS - 5000 + i,
                                                              "results": ["d1", "d2", "d3"]}).encode())
                for k in range(rnd.randint(0, 2)):
                    bus.send(feedback, rnd.choice([q.encode()] * 5 + [b"x"]), json.dumps(
                        {"query_id": q, "timestamp": NOW_MS - 4000 + i, "action": rnd.choice(["click", "judgment"]),
                         "grade": rnd.randint(0, 3), "doc_id": f"d{rnd.randint(1, 3)}", "event_id": f"{q}-{k}"}).encode())

        def drain(pipeline: Pipeline, n: int) -> None:
            while records := bus.poll(0, rnd.randint(1, n)):
                pipeline.process(records)

        first = started()
        send(40, 0)
        drain(first, 50)
        bus.recreate(feedback)
        send(20, 100)
        drain(first, 30)
        bus.truncate(impressions, 0, 5)
        send(10, 200)
        drain(first, 7)
        second = started()  # a restart from the store: what was not checkpointed is read again
        send(15, 300)
        drain(second, 40)
        bus.recreate(impressions)
        send(10, 400)
        drain(second, 9)
        states.append((dict(first.events), _state(second, letters, store)))
    assert states[0] == states[1]


def _one_run(settings, values: list[bytes], topic: str) -> list[tuple]:
    """One partition's records on `topic`, read with and without C: each way's state."""
    records = [Record(topic, 0, i, b"q", value, [], NOW_MS) for i, value in enumerate(values)]
    states = []
    for native in (True, False):
        letters: list = []
        wall = [1000.0]  # at the claim (which marks the partition shown too) ...
        pipeline = _pipeline(settings, native, letters, lambda partitions: {}, lambda: wall[0])
        pipeline.assign([0])
        wall[0] = 2000.0  # ... and as the batch is read
        pipeline.process(records)
        states.append(_state(pipeline, letters, pipeline.store))
    return states


def test_an_impression_event_marks_its_partition_shown_either_way() -> None:
    event = {"query_id": "q", "timestamp": NOW_MS, "action": "impression", "doc_id": "d", "position": 1}
    values = [json.dumps(dict(event, event_id=f"e{i}")).encode() for i in range(3)]
    native, python = _one_run(SETTINGS, values, TOPIC["feedback"])
    assert native == python and native[6][0][2] == 2000.0 * 1000  # (the wall clock's, in ms)


def test_one_topic_for_both_streams_reads_impressions_first_either_way() -> None:
    settings = config.load(None, {"RANKMETER_KAFKA_FEEDBACK_TOPIC": TOPIC["impressions"]})
    impression = {"query_id": "q", "ranker": "r", "timestamp": NOW_MS, "results": ["d"]}
    click = {"query_id": "q", "timestamp": NOW_MS, "action": "click", "doc_id": "d", "event_id": "e"}
    native, python = _one_run(settings, [json.dumps(impression).encode(), json.dumps(click).encode()],
                              TOPIC["impressions"])
    assert native == python and native[0][("impressions", "invalid")] == 1
