"""The pipeline's pure logic, on the in-process bus and the in-memory store: batching,
incremental updates, replays, windows, closing and orphans."""

from __future__ import annotations

import base64
import json
import random
import zlib
from pathlib import Path
from statistics import fmean

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankmeter import config
from rankmeter.engine import QueryState, parse, stack
from rankmeter.engine import ONLINE_SIGNALS
from rankmeter.join import QueryRecord
from rankmeter.pipeline import IPW, Pipeline
from rankmeter.source import Bus
from rankmeter.store import MemoryStore
from rankmeter.windows import BIN_EDGES

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
            # The per-query distribution: queries per bin, a bin holding the values at most
            # its upper edge (Prometheus' `le`): [0, .1], (.1, .2], …, (.9, 1], above 1.
            edges = [i / 10 for i in range(1, 11)]
            expected_bins = [0] * 11
            for v in values:
                expected_bins[next((i for i, e in enumerate(edges) if v <= e), 10)] += 1
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
    assert queries == {"5m": 1, "15m": 2, "1h": 2, "24h": 2}
    ctr = {v.window: v.sums["CTR"] for v in pipeline.views()}
    assert ctr["5m"] == (0.5, 1, 1, 2, 0.25) and ctr["1h"] == (0.5, 2, 1, 3, 0.25)
    clock.t += 3600  # an hour later only the 24h window holds them
    assert {v.window: v.queries_all for v in pipeline.views()} == {"5m": 0, "15m": 0, "1h": 0, "24h": 2}


def one_partition(events, settings=SETTINGS, store=None, clock=None, letters=None, bus=None):
    """A pipeline on a one-partition bus, and a function feeding it (topic, event) pairs
    as one batch (keyed by query_id unless a `key` is given). Pipelines sharing a store
    (a restart, a second replica) share the bus too: its offsets are the store's."""
    bus, clock = bus or Bus(partitions=1), clock or Clock()
    pipeline = Pipeline(settings, store or MemoryStore(),
                        lambda r, why: letters.append(why) if letters is not None else None, clock)
    bus.subscribe([IMPRESSIONS, FEEDBACK], pipeline.assign, pipeline.revoke)

    def feed(batch, key=None):
        for topic, event in batch:
            bus.send(topic, (key or event["query_id"]).encode(), json.dumps(event).encode())
        clock.t += 2  # past the sweep interval: each batch looks for closed queries
        pipeline.process(bus.poll(0, 100_000))

    feed(events)
    return pipeline, feed


def impression(qid, ts, results=("x", "y"), ranker="a"):
    return IMPRESSIONS, {"query_id": qid, "ranker": ranker, "timestamp": ts, "results": list(results)}


def click(qid, ts, doc="x", event_id=None):
    return FEEDBACK, {"query_id": qid, "action": "click", "doc_id": doc, "timestamp": ts,
                      "event_id": event_id or f"{qid}.{doc}.{ts}"}


def test_orphaned_feedback_is_counted_once_when_event_time_passes_its_window():
    now_ms = int(NOW_S * 1000)
    store, clock = MemoryStore(), Clock()
    pipeline, feed = one_partition([click("lost", now_ms), click("lost", now_ms, "y")], store=store, clock=clock)
    assert sum(pipeline.events.values()) == 0  # pending: counted once, by what becomes of it
    clock.t += 20 * 60
    feed([impression("later", now_ms + 20 * 60_000), click("later", now_ms + 20 * 60_000)])
    assert pipeline.events[("feedback", "orphaned")] == 0   # event time is 20 min on: still open
    clock.t += 16 * 60
    feed([impression("last", now_ms + 36 * 60_000), click("last", now_ms + 36 * 60_000)])
    feed([])
    assert pipeline.events[("feedback", "orphaned")] == 2   # past attribution (30m) + grace (5m)
    assert "lost" not in store.records[0] and "later" in store.records[0]
    assert pipeline.events == {("impressions", "applied"): 2, ("feedback", "applied"): 2,
                               ("feedback", "orphaned"): 2}


def test_a_producer_with_a_fast_clock_closes_nothing_early():
    now_ms = int(NOW_S * 1000)
    store, settings = MemoryStore(), config.load(None, {"RANKMETER_WINDOWS_JUDGMENTS": "30m"})
    pipeline, feed = one_partition([impression("q", now_ms)], settings=settings, store=store)
    skew = now_ms + 50 * 60_000   # within windows.max_future (1 h): accepted
    feed([impression("skewed", skew), click("skewed", skew)])
    feed([click("q", now_ms + 60_000)])
    feed([])
    assert pipeline.events[("feedback", "applied")] == 2 and "q" in store.records[0]


def test_nothing_closes_while_a_topic_with_records_to_read_is_unseen():
    """After a rebuild (or on a fresh partition) the first batches may hold only
    impressions: their event time must not close queries whose feedback is unread."""
    clock, now_ms = Clock(), int(NOW_S * 1000)
    store = MemoryStore()
    settings = config.load(None, {"RANKMETER_WINDOWS_JUDGMENTS": "30m"})   # q's window ends 35 min after it
    pipeline, feed = one_partition([impression("q", now_ms - 50 * 60_000)], settings=settings, store=store, clock=clock)
    feed([impression("new", now_ms)])
    feed([])
    assert "q" in store.records[0]
    pipeline.caught_up = {(FEEDBACK, 0)}   # the feedback topic is read to its end: it holds nothing back
    feed([])
    assert "q" not in store.records[0] and "new" in store.records[0]


def test_an_outage_longer_than_the_attribution_window_loses_no_feedback():
    """The service is down 40 minutes (its clock moves on); the backlog holds feedback
    from inside the attribution window and traffic from after the outage. Everything
    joins as it would have live: queries close by event time, not by the wall clock."""
    clock, now_ms = Clock(), int(NOW_S * 1000)
    store = MemoryStore()
    bus = Bus(partitions=1)
    one_partition([impression("q", now_ms), click("q", now_ms + 60_000)], store=store, clock=clock, bus=bus)
    clock.t += 40 * 60   # the outage, then a restart
    restarted, feed = one_partition([], store=store, clock=clock, bus=bus)
    feed([impression("after", now_ms + 40 * 60_000), click("q", now_ms + 10 * 60_000, "y"),
          click("after", now_ms + 40 * 60_000)])
    feed([])
    assert restarted.events == {("impressions", "applied"): 1, ("feedback", "applied"): 2}
    ctr = next(v for v in restarted.views() if v.ranker == "a" and v.window == "1h").sums["CTR"]
    assert (ctr.numerator, ctr.denominator) == (2 + 1, 2 + 2)   # q: x and y clicked; after: x
    # q stays open: editors' judgments are accepted for 24 h (windows.judgments).
    assert "q" in store.records[0] and store.deadlines[0]["q"] == now_ms + 24 * 3_600_000


def test_feedback_keyed_by_something_else_is_dead_lettered():
    letters = []
    now_ms = int(NOW_S * 1000)
    pipeline, feed = one_partition([impression("q", now_ms)], letters=letters)
    feed([click("q", now_ms)], key="user-42")
    assert pipeline.events[("feedback", "invalid")] == 1
    assert letters == ["message key b'user-42' is not its query_id 'q': both topics must be keyed by query_id"]
    bus = Bus(partitions=1)
    pipeline, _ = one_partition([], bus=bus, letters=letters)
    bus.send(FEEDBACK, None, json.dumps(click("q", now_ms)[1]).encode())
    pipeline.process(bus.poll(0, 10))
    assert letters[-1] == "message no key is not its query_id 'q': both topics must be keyed by query_id"


def test_windows_end_now_an_impression_from_the_future_waits_for_its_minute():
    clock, now_ms = Clock(), int(NOW_S * 1000)
    pipeline, _ = one_partition([impression("soon", now_ms + 30 * 60_000), impression("now", now_ms)], clock=clock)
    assert {v.window: v.queries_all for v in pipeline.views()} == {"5m": 1, "15m": 1, "1h": 1, "24h": 1}
    clock.t += 31 * 60
    assert {v.window: v.queries_all for v in pipeline.views()} == {"5m": 1, "15m": 1, "1h": 2, "24h": 2}


def test_exact_tenths_are_counted_at_most_their_bin_edge():
    now_ms = int(NOW_S * 1000)
    results = [f"d{i}" for i in range(10)]
    # P@10 of 0.5 and 0.1, RR of 1.0: each in the bin whose upper edge it equals.
    events = [impression("half", now_ms, results), impression("tenth", now_ms, results)]
    events += [click("half", now_ms, d) for d in results[:5]] + [click("tenth", now_ms, "d0")]
    pipeline, _ = one_partition(events)
    view = next(v for v in pipeline.views() if v.window == "5m")
    edges = dict(zip(BIN_EDGES, view.distributions["P@10"]))
    assert edges["0.1"] == 1 and edges["0.5"] == 1 and sum(view.distributions["P@10"]) == 2
    assert dict(zip(BIN_EDGES, view.distributions["RR"]))["1.0"] == 2


def test_a_stale_owner_is_fenced_and_writes_nothing():
    """Two pipelines on one store: the second claims the partition (a rebalance while the
    first stalled); the first's next checkpoint is refused whole."""
    now_ms = int(NOW_S * 1000)
    store, bus = MemoryStore(), Bus(partitions=1)
    zombie, zombie_feed = one_partition([impression("q1", now_ms)], store=store, bus=bus)
    owner, owner_feed = one_partition([], store=store, bus=bus)  # resumes after q1
    owner_feed([impression("q2", now_ms)])
    before = (dict(store.offsets[0]), dict(store.buckets[0]), dict(store.records[0]))
    zombie_feed([impression("q3", now_ms)])
    assert zombie.fenced == {0} and zombie.partitions == {}
    assert (dict(store.offsets[0]), dict(store.buckets[0]), dict(store.records[0])) == before
    assert next(v for v in owner.views() if v.window == "5m").queries_all == 2


def test_lost_state_is_refused_unless_rebuilt():
    now_ms = int(NOW_S * 1000)
    bus, store = Bus(partitions=1), MemoryStore()
    pipeline = Pipeline(SETTINGS, store, lambda r, why: None, Clock())
    bus.subscribe([IMPRESSIONS, FEEDBACK], pipeline.assign, pipeline.revoke)
    bus.send(IMPRESSIONS, b"q", json.dumps(impression("q", now_ms)[1]).encode())
    pipeline.process(bus.poll(0, 100)).commit(bus)
    store.wipe(0)   # Redis restarted empty, Kafka kept the group's commits
    second = Pipeline(SETTINGS, store, lambda r, why: None, Clock())
    assert second.assign([0], bus.committed([0])) == {} and second.lost == {0}
    rebuilt = Pipeline(SETTINGS, store, lambda r, why: None, Clock())
    assert rebuilt.assign([0], bus.committed([0]), rebuild=True) == {(IMPRESSIONS, 0): 0, (FEEDBACK, 0): 0}
    bus.seek({(IMPRESSIONS, 0): 0, (FEEDBACK, 0): 0})
    rebuilt.process(bus.poll(0, 100))
    assert next(v for v in rebuilt.views() if v.window == "5m").queries_all == 1


def test_a_rebalance_before_a_rebuilt_partitions_first_checkpoint_rebuilds_it_again():
    """--rebuild applies to the partitions found lost at start; the wipe leaves no offsets
    until the first checkpoint, so a rebalance before it must not find them lost (it did:
    the service then read nothing, tests/integration/test_faults.py under load)."""
    now_ms = int(NOW_S * 1000)
    bus, store = Bus(partitions=1), MemoryStore()
    pipeline = Pipeline(SETTINGS, store, lambda r, why: None, Clock())
    bus.subscribe([IMPRESSIONS, FEEDBACK], pipeline.assign, pipeline.revoke)
    bus.send(IMPRESSIONS, b"q", json.dumps(impression("q", now_ms)[1]).encode())
    pipeline.process(bus.poll(0, 100)).commit(bus)
    store.wipe(0)
    rebuilt = Pipeline(SETTINGS, store, lambda r, why: None, Clock())
    rebuilt.assign([0], bus.committed([0]), rebuild=True)
    rebuilt.revoke([0])  # a rebalance in the next poll, before any batch
    assert rebuilt.assign([0], bus.committed([0])) == {(IMPRESSIONS, 0): 0, (FEEDBACK, 0): 0}
    assert rebuilt.lost == set()
    bus.seek({(IMPRESSIONS, 0): 0, (FEEDBACK, 0): 0})
    rebuilt.process(bus.poll(0, 100)).commit(bus)
    assert next(v for v in rebuilt.views() if v.window == "5m").queries_all == 1
    # Checkpointed since: losing the state again is refused again without --rebuild.
    store.wipe(0)
    rebuilt.revoke([0])
    assert rebuilt.assign([0], bus.committed([0])) == {} and rebuilt.lost == {0}


def test_a_checkpoints_steps_run_in_order_or_raise():
    now_ms = int(NOW_S * 1000)
    bus, store = Bus(partitions=1), MemoryStore()
    pipeline = Pipeline(SETTINGS, store, lambda r, why: None, Clock())
    bus.subscribe([IMPRESSIONS, FEEDBACK], pipeline.assign, pipeline.revoke)
    bus.send(IMPRESSIONS, b"q", json.dumps(impression("q", now_ms)[1]).encode())
    checkpoint = pipeline.apply(bus.poll(0, 100))
    for early in (checkpoint.confirm, lambda: checkpoint.commit(bus), lambda: checkpoint.offsets):
        with pytest.raises(RuntimeError, match="out of order"):
            early()  # counting, or committing to Kafka, a batch not stored
    assert pipeline.events == {} and bus.committed([0]) == {} and store.offsets.get(0, {}) == {}
    checkpoint.send()
    with pytest.raises(RuntimeError, match="out of order"):
        checkpoint.send()
    checkpoint.confirm()
    checkpoint.commit(bus)
    assert pipeline.events == {("impressions", "applied"): 1}
    assert bus.committed([0])[(IMPRESSIONS, 0)] == store.offsets[0][IMPRESSIONS] == 1


def test_the_stored_watermarks_are_the_batchs_newest_event_times():
    now_ms = int(NOW_S * 1000)
    store = MemoryStore()
    one_partition([impression("q1", now_ms - 5_000), impression("q2", now_ms - 9_000),
                   click("q1", now_ms - 2_000), click("q2", now_ms - 7_000)], store=store)
    assert store.load(0).watermarks == {IMPRESSIONS: now_ms - 5_000, FEEDBACK: now_ms - 2_000}


def test_configuration_changes_carry_unchanged_measures_and_never_relabel():
    """P@10 swapped for P@5 and AP removed while q1 is open: nDCG@10 carries on, P@5
    counts from the change (q1 is evaluated again when its feedback comes), nothing of
    P@10 appears under P@5's name."""
    now_ms = int(NOW_S * 1000)
    store, bus, results = MemoryStore(), Bus(partitions=1), [f"d{i}" for i in range(10)]
    before = config.load(None, {"RANKMETER_EVALUATION_MEASURES": "nDCG@10,P@10,AP"})
    after = config.load(None, {"RANKMETER_EVALUATION_MEASURES": "nDCG@10,P@5"})
    first, _ = one_partition([impression("q0", now_ms, results), click("q0", now_ms, "d0"),
                              impression("q1", now_ms, results), click("q1", now_ms, "d9")],
                             settings=before, store=store, bus=bus)
    old = next(v for v in first.views() if v.window == "5m").sums
    second, feed = one_partition([], settings=after, store=store, bus=bus)
    carried = next(v for v in second.views() if v.window == "5m").sums
    assert carried["nDCG@10"] == old["nDCG@10"] and set(carried) == {"nDCG@10", "P@5", *ONLINE_SIGNALS, IPW + "nDCG@10"}
    assert carried["P@5"].count == 0    # nothing relabelled
    feed([click("q1", now_ms, "d1")])   # q1 evaluated again: P@5 = 1/5, from the change on
    sums = next(v for v in second.views() if v.window == "5m").sums
    assert (sums["P@5"].value_sum, sums["P@5"].count) == pytest.approx((0.2, 1))
    assert sums["nDCG@10"].count == 2
    back, _ = one_partition([], settings=before, store=store, bus=bus)   # and back: P@10 was kept for q0 only
    sums = next(v for v in back.views() if v.window == "5m").sums
    assert sums["AP"].count == 0 and sums["P@10"].count == 0 and sums["nDCG@10"].count == 2


def test_late_feedback_is_counted_not_applied():
    now_ms = int(NOW_S * 1000)
    stream = [(IMPRESSIONS, "q", {"query_id": "q", "ranker": "a", "timestamp": now_ms - 40 * 60_000, "results": ["x"]}),
              (FEEDBACK, "q", {"query_id": "q", "action": "click", "doc_id": "x", "timestamp": now_ms})]
    pipeline = run(stream)
    assert pipeline.events[("feedback", "late")] == 1
    assert next(v for v in pipeline.views() if v.window == "1h").queries_judged == 0


def test_judgments_apply_for_as_long_as_windows_keep_the_query():
    """Editors judge hours later: a judgment 3 h after the impression applies (the click
    beside it is late), one after `windows.judgments` (24 h) is late."""
    now_ms = int(NOW_S * 1000)
    judgment = lambda qid, t: (FEEDBACK, {"query_id": qid, "action": "judgment", "doc_id": "x", "grade": 2,
                                          "timestamp": t, "event_id": f"{qid}.j.{t}"})
    clock = Clock()
    pipeline, feed = one_partition([impression("q", now_ms - 3 * 3_600_000)], clock=clock)
    feed([click("q", now_ms), judgment("q", now_ms)])
    assert pipeline.events[("feedback", "late")] == 1 and pipeline.events[("feedback", "applied")] == 1
    assert next(v for v in pipeline.views() if v.window == "24h").queries_judged == 1
    clock.t += 22 * 3600
    feed([judgment("q", now_ms + 22 * 3_600_000 - 1)])   # 25 h after the impression
    assert pipeline.events[("feedback", "late")] == 2


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


def test_a_measure_removed_and_restored_counts_afresh_even_for_untouched_queries():
    """A → B → A: P@10 removed, then restored. A query untouched while B ran still holds
    its contribution from the first A; converted through B, it is dropped like the
    bucket's, so P@10 counts afresh (from the change) instead of being corrupted."""
    now_ms = int(NOW_S * 1000)
    store, bus, results = MemoryStore(), Bus(partitions=1), [f"d{i}" for i in range(10)]
    a = config.load(None, {"RANKMETER_EVALUATION_MEASURES": "nDCG@10,P@10"})
    b = config.load(None, {"RANKMETER_EVALUATION_MEASURES": "nDCG@10"})
    one_partition([impression("q0", now_ms, results), click("q0", now_ms, "d0"),
                   impression("q1", now_ms, results), click("q1", now_ms, "d1")], settings=a, store=store, bus=bus)
    _, feed_b = one_partition([], settings=b, store=store, bus=bus)
    feed_b([impression("q2", now_ms, results), click("q2", now_ms, "d2")])   # B checkpoints: buckets rewritten
    restored, feed_a = one_partition([], settings=a, store=store, bus=bus)
    feed_a([click("q1", now_ms, "d3")])   # q1, last written under the first A: P@10 = 2/10 from now on
    sums = next(v for v in restored.views() if v.window == "5m").sums
    assert (sums["P@10"].value_sum, sums["P@10"].count) == pytest.approx((0.2, 1))
    assert sums["nDCG@10"].count == 3


def test_records_and_buckets_from_before_layouts_were_recorded_do_not_crash():
    """State written before layouts were recorded, under other measures: unreadable
    buckets are dropped (from the store too), their records start afresh."""
    now_ms = int(NOW_S * 1000)
    store, bus, results = MemoryStore(), Bus(partitions=1), [f"d{i}" for i in range(10)]
    old = config.load(None, {"RANKMETER_EVALUATION_MEASURES": "nDCG@10,P@10,AP"})
    one_partition([impression("q0", now_ms, results), click("q0", now_ms, "d0")], settings=old, store=store, bus=bus)
    store.meta[0].clear()          # as written before this version: no history ...
    store.layouts[0] = ""          # ... and no fingerprint
    decoder = msgspec.msgpack.Decoder(QueryRecord)
    legacy = decoder.decode(store.records[0]["q0"])
    legacy.layout = ""
    store.records[0]["q0"] = msgspec.msgpack.encode(legacy)
    new, feed = one_partition([], store=store, bus=bus)   # the default measures: another size
    feed([click("q0", now_ms, "d1")])
    sums = next(v for v in new.views() if v.window == "5m").sums
    assert sums["P@10"].value_sum == pytest.approx(0.2) and sums["P@10"].count == 1
    fields = list(store.buckets[0])
    assert all(len(store.buckets[0][f]) == 8 * new.layout.size for f in fields)


def test_the_label_cap_releases_values_unseen_for_label_idle_and_counts_folding():
    clock, now_ms = Clock(), int(NOW_S * 1000)
    settings = config.load(None, {"RANKMETER_LIMITS_MAX_RANKERS": "1", "RANKMETER_LIMITS_LABEL_IDLE": "2d"})
    pipeline, feed = one_partition([impression("q0", now_ms, ranker="v1")], settings=settings, clock=clock)
    feed([impression("q1", now_ms, ranker="v2")])
    assert {v.ranker for v in pipeline.views()} == {"v1", "other"} and pipeline.folded["ranker"] == 1
    clock.t += 3 * 86_400   # v1 unseen for 3 days: its place is free
    later = int(clock.t * 1000)
    feed([impression("q2", later, ranker="v2"), click("q2", later)])
    assert {v.ranker for v in pipeline.views()} >= {"v2"} and pipeline.folded["ranker"] == 1
    feed([impression("q3", later, ranker="v1")])   # now v1 is the one past the cap
    assert pipeline.folded["ranker"] == 2


def test_a_long_backlog_closes_over_several_batches():
    """A sweep closes at most SWEEP_LIMIT queries per partition: an outage's backlog is
    closed over several batches, each bounded, and every query closes in the end."""
    from rankmeter.pipeline import SWEEP_LIMIT
    clock, now_ms = Clock(), int(NOW_S * 1000)
    store = MemoryStore()
    settings = config.load(None, {"RANKMETER_WINDOWS_JUDGMENTS": "30m"})
    n = 2 * SWEEP_LIMIT + 10
    pipeline, feed = one_partition([impression(f"q{i}", now_ms - 3_600_000) for i in range(n)]
                                   + [click("q0", now_ms - 3_600_000)], settings=settings, store=store, clock=clock)
    sizes = []
    for _ in range(4):
        before = len(store.records[0])
        feed([impression(f"new{len(sizes)}", now_ms), click(f"new{len(sizes)}", now_ms)])
        sizes.append(before + 1 - len(store.records[0]))
    assert max(sizes) <= SWEEP_LIMIT and sum(sizes) == n
    assert all(not q.startswith("q") for q in store.records[0])


class FlakyStore(MemoryStore):
    """A store whose next commit fails with the connection: after applying it (the reply
    was lost) or before."""

    unavailable = (ConnectionError,)

    def __init__(self) -> None:
        super().__init__()
        self.fail: str | None = None

    def commit(self, checkpoints):
        checkpoints = list(checkpoints)
        if self.fail == "before":
            self.fail = None
            raise ConnectionError("connection reset")
        if self.fail is not None and self.fail.startswith("after "):
            # The connection lost midway through a pipelined commit: the first k applied.
            k, self.fail = int(self.fail.split()[1]), None
            super().commit(checkpoints[:k])
            raise ConnectionError("connection reset")
        refused = super().commit(checkpoints)
        if self.fail == "after":
            self.fail = None
            raise ConnectionError("connection reset")
        return refused


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_batch_whose_commit_failed_is_counted_once_whether_stored_or_not(when):
    now_ms = int(NOW_S * 1000)
    store, bus = FlakyStore(), Bus(partitions=1)
    pipeline, feed = one_partition([impression("q1", now_ms), click("q1", now_ms)], store=store, bus=bus)
    store.fail = when
    with pytest.raises(ConnectionError):
        feed([impression("q2", now_ms), click("q2", now_ms)])
    pipeline.revoke([0], reclaiming=True)   # what serve's recovery does, then a fresh claim
    bus.seek(pipeline.assign([0]))
    while records := bus.poll(0, 100):
        pipeline.process(records)
    assert pipeline.events == {("impressions", "applied"): 2, ("feedback", "applied"): 2}
    assert next(v for v in pipeline.views() if v.window == "5m").queries_all == 2


@pytest.mark.parametrize("applied", [0, 1, 2, 3])
def test_a_commit_cut_midway_counts_each_partitions_batch_once(applied):
    """Three partitions' checkpoints in one pipelined commit, the connection lost after
    `applied` of them ran: after the reclaim, each partition's batch is counted once,
    whether it was stored (its mark) or replayed."""
    now_ms = int(NOW_S * 1000)
    store, bus = FlakyStore(), Bus(partitions=3)
    pipeline = Pipeline(SETTINGS, store, lambda r, why: None, Clock())
    bus.subscribe([IMPRESSIONS, FEEDBACK], pipeline.assign, pipeline.revoke)
    qids = [f"q{i}" for i in range(12)]
    for qid in qids:
        for topic, event in (impression(qid, now_ms), click(qid, now_ms)):
            bus.send(topic, qid.encode(), json.dumps(event).encode())
    assert len({zlib.crc32(q.encode()) % 3 for q in qids}) == 3   # every partition has some
    store.fail = f"after {applied}"
    with pytest.raises(ConnectionError):
        pipeline.process(bus.poll(0, 1000))
    pipeline.revoke([0, 1, 2], reclaiming=True)   # what serve's recovery does, then a fresh claim
    bus.seek(pipeline.assign([0, 1, 2]))
    while records := bus.poll(0, 1000):
        pipeline.process(records)
    assert pipeline.events == {("impressions", "applied"): 12, ("feedback", "applied"): 12}
    assert next(v for v in pipeline.views() if v.window == "5m").queries_all == 12


def test_a_batch_another_replica_replayed_is_not_counted_again_when_the_partition_returns():
    now_ms = int(NOW_S * 1000)
    store, bus = FlakyStore(), Bus(partitions=1)
    first, feed = one_partition([], store=store, bus=bus)
    store.fail = "before"
    with pytest.raises(ConnectionError):
        feed([impression("q1", now_ms), click("q1", now_ms)])
    first.revoke([0])                            # a rebalance: another replica takes it over
    second, _ = one_partition([], store=store, bus=bus)   # replays the batch and counts it
    second.revoke([0])
    bus.seek(first.assign([0]))                   # back to the first, at the same offsets
    assert sum(first.events.values()) + sum(second.events.values()) == 2


def test_records_stored_by_the_previous_version_are_read_and_an_old_reader_refuses_new_ones():
    """Format 1 (the contribution vector itself, as bytes) is still read: a record rewritten
    in it moves the buckets exactly as the format-2 record (packed scores) did. A decoder of
    the previous version refuses format 2 instead of reading it without its contribution."""
    now_ms = int(NOW_S * 1000)
    results = [f"d{i}" for i in range(10)]
    events = [impression("q0", now_ms, results), click("q0", now_ms, "d3"), impression("q1", now_ms, results)]
    later = [click("q0", now_ms, "d0"), click("q1", now_ms, "d1")]
    reference, feed = one_partition(events)
    feed(later)
    store = MemoryStore()
    first, _ = one_partition(events, store=store)
    codec = msgspec.msgpack.Decoder(QueryRecord)
    for qid, data in store.records[0].items():
        record = codec.decode(data)
        assert isinstance(record.contribution, msgspec.msgpack.Ext)  # format 2
        vector = first.records.previous([record])[0]
        store.records[0][qid] = msgspec.msgpack.encode(msgspec.structs.replace(record, contribution=vector.tobytes()))
    # A new process on the rewritten store: nothing cached, every record read back in format 1.
    second, feed = one_partition([], store=store)
    feed(events + later)   # on a new bus: the first three are skipped by the stored offsets
    assert_same(sums(second), sums(reference))

    class PreviousRecord(msgspec.Struct, array_like=True):  # the fields before `contribution`, then it
        impression: object = None
        ranker_label: str = ""
        segment_label: str = ""
        implicit: dict = {}
        explicit: dict = {}
        clicked: list = []
        clicks: int = 0
        event_ids: set = set()
        pending: list = []
        contribution: bytes = b""
    with pytest.raises(msgspec.ValidationError, match="Expected `bytes`, got `ext`"):
        msgspec.msgpack.Decoder(PreviousRecord).decode(next(iter(store.records[0].values())))


def test_format_1_records_written_by_the_previous_version_carry_on_exactly():
    """tests/fixtures/format1_store.json: the state the version before record format 2
    (dc01e2b) left with 60 queries open (its query records in format 1, their
    contribution vectors), the 62 feedback events that followed, and the window sums that
    version ended with after them (made by tests/fixtures/make_format1_store.py run on
    that version: `git archive dc01e2b service | tar -x -C /tmp/old` and PYTHONPATH).
    This version, resuming from that state, ends with the same sums."""
    fixture = json.loads((Path(__file__).parent / "fixtures" / "format1_store.json").read_text())
    settings = config.load(None, {"RANKMETER_EVALUATION_MEASURES": "nDCG@10,P@10,AP",
                                  "RANKMETER_DEBIAS_HARVEST_SHARE": "1"})
    store = MemoryStore()
    for name, per_partition in fixture["store"].items():
        table = getattr(store, name)
        for p, value in per_partition.items():
            table[int(p)] = ({k: base64.b64decode(v) if name in ("records", "buckets", "ab") else v
                              for k, v in value.items()} if isinstance(value, dict) else value)
    decode = msgspec.msgpack.Decoder(QueryRecord).decode
    assert all(isinstance(decode(data).contribution, bytes) and decode(data).contribution
               for records in store.records.values() for data in records.values())  # format 1, evaluated
    bus = Bus(partitions=2)
    pipeline = Pipeline(settings, store, lambda r, why: None, lambda: NOW_S)
    # The bus holds what the previous version read (the store's offsets point past it) ...
    for p, offsets in store.offsets.items():
        for topic, n in offsets.items():
            bus.logs.setdefault(topic, [[] for _ in range(2)])[p].extend([None] * n)
    bus.subscribe([settings.kafka.impressions_topic, settings.kafka.feedback_topic], pipeline.assign, pipeline.revoke)
    for _, key, event in fixture["then"]:   # ... and then what came next
        bus.send(settings.kafka.feedback_topic, key.encode(), json.dumps(event).encode())
    while records := bus.poll(0, 17):
        pipeline.process(records)
    final = {f"{v.ranker}|{v.window}|{m}": list(s) for v in pipeline.views() for m, s in v.sums.items()}
    assert final.keys() == fixture["final"].keys()
    for key, want in fixture["final"].items():
        assert final[key] == pytest.approx(want, abs=1e-12, nan_ok=True), key
