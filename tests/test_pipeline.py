"""The pipeline's pure logic, on the in-process bus and the in-memory store: batching,
incremental updates, replays, windows, closing and orphans."""

from __future__ import annotations

import json
import random
from statistics import fmean

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankmeter import config
from rankmeter.engine import QueryState, parse, stack
from rankmeter.pipeline import Pipeline
from rankmeter.source import Bus
from rankmeter.store import MemoryStore

NOW_S = 1_800_000_000.0
SETTINGS = config.load(None, {})
IMPRESSIONS, FEEDBACK = SETTINGS.kafka.impressions_topic, SETTINGS.kafka.feedback_topic


class Clock:
    def __init__(self, t: float = NOW_S) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_stream(seed: int, queries: int = 40):
    """(topic, key, event) triples: impressions, clicks, purchases, judgments (some of
    unshown documents), redeliveries; feedback often before its impression."""
    rnd = random.Random(seed)
    now_ms = int(NOW_S * 1000)
    out = []
    for q in range(queries):
        qid = f"q{q}"
        results = [f"d{rnd.randrange(30)}" for _ in range(rnd.randint(1, 12))]
        out.append((IMPRESSIONS, qid, {"query_id": qid, "ranker": rnd.choice("ab"),
                                       "timestamp": now_ms - rnd.randrange(600_000), "results": results}))
        for i in range(rnd.randint(0, 6)):
            doc = rnd.choice(results + ["unshown"])
            event = {"query_id": qid, "doc_id": doc, "timestamp": now_ms, "event_id": f"{qid}.{i}"}
            if rnd.random() < 0.4:
                event.update(action="judgment", grade=rnd.randint(0, 3))
            else:
                event.update(action=rnd.choice(["click", "purchase", "add_to_cart"]))
            out.append((FEEDBACK, qid, event))
            if rnd.random() < 0.2:
                out.append((FEEDBACK, qid, event))
    rnd.shuffle(out)
    return out


def run(stream, batch_sizes=None, store=None, clock=None) -> Pipeline:
    bus = Bus(partitions=3)
    for topic, key, event in stream:
        bus.send(topic, key.encode(), json.dumps(event).encode())
    pipeline = Pipeline(SETTINGS, store or MemoryStore(), lambda r, why: None, clock or Clock())
    bus.subscribe([IMPRESSIONS, FEEDBACK], pipeline.assign, pipeline.revoke)
    sizes = iter(batch_sizes or [])
    while records := bus.poll(0, next(sizes, 10_000)):
        pipeline.process(records)
    return pipeline


def sums(pipeline: Pipeline) -> dict:
    return {(v.ranker, v.window, metric): s for v in pipeline.views() for metric, s in v.sums.items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key], abs=1e-9), key


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.integers(1, 25), min_size=1, max_size=60))
def test_any_batching_gives_the_aggregates_of_one_batch(seed, batch_sizes):
    stream = make_stream(seed)
    assert_same(sums(run(stream, batch_sizes)), sums(run(stream)))


def test_aggregates_equal_the_engine_on_final_grades():
    stream = make_stream(7, queries=80)
    pipeline = run(stream, [7] * 1000)
    # The final grades, worked out independently from the stream: the latest judgment,
    # else the highest implicit grade; implicit feedback on unshown documents is ignored.
    shown, judged, implicit = {}, {}, {}
    for topic, qid, e in stream:
        if topic == IMPRESSIONS:
            shown[qid] = (e["ranker"], e["results"])
    seen = set()
    for topic, qid, e in stream:
        if topic == FEEDBACK and e["event_id"] not in seen:  # a redelivery changes nothing
            seen.add(e["event_id"])
            if e["action"] == "judgment":
                judged.setdefault(qid, {})[e["doc_id"]] = e["grade"]  # same timestamps: the last wins
            elif e["doc_id"] in shown[qid][1]:
                grade = {"click": 1, "add_to_cart": 2, "purchase": 3}[e["action"]]
                implicit.setdefault(qid, {})[e["doc_id"]] = max(grade, implicit.get(qid, {}).get(e["doc_id"], 0))
    for ranker in "ab":
        qids = [q for q, (r, _) in shown.items() if r == ranker]
        states = [QueryState.from_grades(shown[q][1], {**implicit.get(q, {}), **judged.get(q, {})},
                                         shown_grade=0) for q in qids]
        batch = stack(states)
        judged_rows = batch.num_rel > 0
        for name in ("nDCG@10", "P@10", "AP", "RR", "R@10"):
            m = parse(name)
            values = m.values(m.compute(batch))[judged_rows]
            view = next(v for v in pipeline.views() if v.ranker == ranker and v.window == "24h")
            sums = view.sums[name]
            assert sums.count == judged_rows.sum()
            assert sums.macro() == pytest.approx(fmean(values), abs=1e-9), (ranker, name)
            assert sums.value_squares == pytest.approx(sum(v * v for v in values), abs=1e-9)
            # The per-query distribution: queries per tenth of [0, 1].
            expected_bins = [0] * 11
            for v in values:
                expected_bins[min(int(v * 10), 9)] += 1
            assert view.distributions[name] == expected_bins, (ranker, name)


def test_restart_replays_only_what_was_not_persisted():
    stream = make_stream(3, queries=60)
    reference = sums(run(stream))
    store = MemoryStore()
    first = run(stream[: len(stream) // 2], [5] * 1000, store=store)
    assert sum(first.events.values()) > 0
    # A new process on the same store: the bus redelivers everything from offset 0.
    second = run(stream, [9] * 1000, store=store)
    assert_same(sums(second), reference)
    later = stream[len(stream) // 2:]
    # Impressions count once each: the second process saw only those of the second half.
    assert second.events[("impressions", "applied")] == sum(1 for t, _, _ in later if t == IMPRESSIONS)
    assert first.events[("impressions", "applied")] + second.events[("impressions", "applied")] == 60


def test_windows_follow_impression_time():
    clock = Clock()
    now_ms = int(NOW_S * 1000)
    stream = [(IMPRESSIONS, "old", {"query_id": "old", "ranker": "a", "timestamp": now_ms - 10 * 60_000, "results": ["x"]}),
              (IMPRESSIONS, "new", {"query_id": "new", "ranker": "a", "timestamp": now_ms, "results": ["x", "y"]}),
              (FEEDBACK, "new", {"query_id": "new", "action": "click", "doc_id": "y", "timestamp": now_ms})]
    pipeline = run(stream, clock=clock)
    queries = {v.window: v.queries_all for v in pipeline.views()}
    assert queries == {"5m": 1, "1h": 2, "24h": 2}
    ctr = {v.window: v.sums["CTR"] for v in pipeline.views()}
    assert ctr["5m"] == (0.5, 1, 1, 2, 0.25) and ctr["1h"] == (0.5, 2, 1, 3, 0.25)
    clock.t += 3600  # an hour later only the 24h window holds them
    assert {v.window: v.queries_all for v in pipeline.views()} == {"5m": 0, "1h": 0, "24h": 2}


def test_orphaned_feedback_is_counted_when_its_query_closes():
    clock = Clock()
    now_ms = int(NOW_S * 1000)
    store = MemoryStore()
    stream = [(FEEDBACK, "lost", {"query_id": "lost", "action": "click", "doc_id": "x", "timestamp": now_ms}),
              (FEEDBACK, "lost", {"query_id": "lost", "action": "click", "doc_id": "y", "timestamp": now_ms})]
    pipeline = run(stream, store=store, clock=clock)
    assert pipeline.events[("feedback", "pending")] == 2
    clock.t += 36 * 60  # past attribution (30m) + grace (5m)
    pipeline.process([])
    assert pipeline.events[("feedback", "orphaned")] == 2
    assert all("lost" not in records for records in store.records.values())


def test_late_feedback_is_counted_not_applied():
    now_ms = int(NOW_S * 1000)
    stream = [(IMPRESSIONS, "q", {"query_id": "q", "ranker": "a", "timestamp": now_ms - 40 * 60_000, "results": ["x"]}),
              (FEEDBACK, "q", {"query_id": "q", "action": "judgment", "doc_id": "x", "grade": 2, "timestamp": now_ms})]
    pipeline = run(stream)
    assert pipeline.events[("feedback", "late")] == 1
    assert next(v for v in pipeline.views() if v.window == "1h").queries_judged == 0


def test_a_flooded_query_dead_letters_what_exceeds_the_cap():
    now_ms = int(NOW_S * 1000)
    settings = config.load(None, {"RANKMETER_LIMITS_MAX_EVENTS_PER_QUERY": "3"})
    bus, letters = Bus(partitions=1), []
    bus.send(IMPRESSIONS, b"q", json.dumps({"query_id": "q", "ranker": "a", "timestamp": now_ms, "results": ["x"]}).encode())
    for i in range(5):
        bus.send(FEEDBACK, b"q", json.dumps({"query_id": "q", "action": "click", "doc_id": "x",
                                            "timestamp": now_ms, "event_id": str(i)}).encode())
    pipeline = Pipeline(settings, MemoryStore(), lambda r, why: letters.append(why), Clock())
    bus.subscribe([IMPRESSIONS, FEEDBACK], pipeline.assign, pipeline.revoke)
    pipeline.process(bus.poll(0, 100))
    assert pipeline.events[("feedback", "applied")] == 3
    assert pipeline.events[("feedback", "invalid")] == 2
    assert letters == ["query 'q' already has 3 feedback events (limits.max_events_per_query)"] * 2
