"""OpenSearch UBI as its own tools write it (issue 12), on the in-process bus and store:
lists assembled from `impression` events equal the native impressions they stand for,
whatever the shape, the order of arrival and the batching; when a list is complete; what
each event counts as; judgments given as labels."""

from __future__ import annotations

import json
import random
import zlib

import pytest

from rankmeter import config
from rankmeter.ab.clusters import bucket_of, user_hash
from rankmeter.events import Decoder, Feedback, Impression, Rejected, query_hash
from rankmeter.pipeline import Pipeline
from rankmeter.source import Bus
from rankmeter.store import MemoryStore

from test_pipeline import NOW_S, Clock, assert_same, sums
from ubi_shapes import SHAPES, generator, iso, make_query_event, make_ubi_event, native, searches

NOW_MS = int(NOW_S * 1000)
SETTINGS = config.load(None, {})
TOPICS = {"impressions": SETTINGS.kafka.impressions_topic, "feedback": SETTINGS.kafka.feedback_topic}


class Feed:
    """A pipeline on its own bus: `send` a stream of (kind, key, record), then process it."""

    def __init__(self, store: MemoryStore | None = None) -> None:
        self.bus = Bus(partitions=3)
        self.clock = Clock()         # event time's now
        self.wall = Clock(0.0)       # processing time
        self.pipeline = Pipeline(SETTINGS, store or MemoryStore(), lambda r, why: None, self.clock, self.wall)
        self.bus.subscribe(list(TOPICS.values()), self.pipeline.assign, self.pipeline.revoke)

    def send(self, stream, batch: int = 10_000) -> Pipeline:
        for kind, key, record in stream:
            self.bus.send(TOPICS[kind], key.encode(), json.dumps(record).encode())
        while records := self.bus.poll(0, batch):
            self.pipeline.process(records)
        return self.pipeline

    def tick(self) -> None:
        """A sweep on the event time the last batch brought (a batch sweeps before it
        moves the watermarks)."""
        self.clock.t += 2
        self.pipeline.process([])


def feed(stream, batch: int = 10_000, store: MemoryStore | None = None) -> Pipeline:
    return Feed(store).send(stream, batch)


def events(pipeline: Pipeline) -> dict:
    return {k: v for k, v in pipeline.events.items() if v}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_assembled_lists_give_the_metrics_of_the_native_events(shape, seed):
    queries = sorted(searches(seed, 60, NOW_MS), key=lambda q: q.timestamp_ms)
    rnd = random.Random(seed)
    stream = []
    for q in queries:  # each query's records in any order: its query record may come last
        records = SHAPES[shape]([q])
        rnd.shuffle(records)
        stream += records
    ubi = feed(stream, batch=rnd.randint(1, 40))
    ubi.end_of_input()
    reference = feed(native(queries))
    assert_same(sums(ubi), sums(reference))
    clicks = sum(len(q.clicks) for q in queries)
    shown = sum(len(q.shown) for q in queries)
    assert events(ubi) == {("impressions", "applied"): len(queries), ("feedback", "applied"): clicks,
                           ("feedback", "listed"): shown}


def test_a_list_settles_when_event_time_passes_the_record_time_plus_list_settle():
    t = NOW_MS - 600_000
    header = make_query_event(_config("ranker-a"), _row("q1", t))
    shown = [make_ubi_event(_config("ranker-a"), {**_row("q1", t + 500), "action_name": "impression",
                                                  "object_id": doc, "position": i}) for i, doc in enumerate("abc")]
    run = Feed()
    pipeline = run.send([("impressions", "q1", header)] + [("feedback", "q1", e) for e in shown[:2]])
    assert events(pipeline) == {}            # waiting for its list
    # A click of another query a minute later: clicks come late in event time, they do
    # not settle lists. Impression events of other queries 9.9 s later: not yet ...
    run.send([("impressions", "q1", header), ("feedback", "q1", shown[2])])
    run.send([_other("q1", t + 60_000, "feedback"), *_shown_other("q1", t + 9_900)])
    run.tick()
    assert events(pipeline) == {("impressions", "applied"): 1, ("impressions", "duplicate"): 1,
                                ("feedback", "ignored"): 1}
    # ... 10 s later, the list settles with what it had: "c" came, so it is in.
    run.send(_shown_other("q1", t + 10_000))
    run.tick()
    assert events(pipeline) == {("impressions", "applied"): 3, ("impressions", "duplicate"): 1,
                                ("feedback", "listed"): 3, ("feedback", "ignored"): 2}
    assert run.clock.t - NOW_S < 10  # by event time: the process clock has not moved 10 s
    record = pipeline.partitions[_partition("q1")].records["q1"]
    assert record.impression.results == ["a", "b", "c"]
    # An impression event after that is late, or adds nothing when its document is shown.
    late = make_ubi_event(_config("ranker-a"), {**_row("q1", t + 11_000), "action_name": "impression",
                                                "object_id": "d", "position": 3})
    again = {**shown[0], "timestamp": iso(t + 11_000)}
    run.send([("feedback", "q1", late), ("feedback", "q1", again)])
    assert events(pipeline)[("feedback", "late")] == 1 and events(pipeline)[("feedback", "ignored")] == 3
    assert record.impression.results == ["a", "b", "c"]


def test_a_list_is_complete_once_the_announced_number_of_documents_came():
    t = NOW_MS - 60_000
    header = {"query_id": "q1", "timestamp": t, "application": "shop", "query_attributes": {"hits": 3},
              "query_response_hit_ids": []}
    stream = [("impressions", "q1", header)] + [
        ("feedback", "q1", _impression_event("q1", t, doc, position)) for doc, position in
        [("b", 2), ("a", 1), ("b", 5), ("c", 7)]]  # b twice: its first position wins
    run = Feed()
    pipeline = run.send(stream[:4])
    assert events(pipeline) == {}  # two distinct documents of three
    run.send(stream[4:])            # no time passed: the count completes it
    assert events(pipeline) == {("impressions", "applied"): 1, ("feedback", "listed"): 4}
    assert pipeline.partitions[_partition("q1")].records["q1"].impression.results == ["a", "b", "c"]


def test_a_query_record_whose_list_never_comes_is_a_query_that_showed_nothing():
    t = NOW_MS - 600_000
    header = {"query_id": "q1", "timestamp": t, "application": "shop", "query_response_hit_ids": []}
    click = {"action_name": "click", "query_id": "q1", "timestamp": t + 1000,
             "event_attributes": {"object": {"object_id": "x"}}}
    pipeline = feed([("impressions", "q1", header), ("feedback", "q1", click)])
    pipeline.end_of_input()
    assert events(pipeline) == {("impressions", "applied"): 1, ("feedback", "unmatched"): 1}
    view = next(v for v in pipeline.views() if v.window == "24h")
    assert (view.ranker, view.queries_all, view.sums["Abandonment"].macro()) == ("shop", 1, 1.0)


def test_impression_events_whose_query_record_never_comes_are_orphaned():
    t = NOW_MS - 3_600_000
    run = Feed()
    pipeline = run.send([("feedback", "q1", _impression_event("q1", t, "a", 0))])
    run.send([_other("q1", NOW_MS), _other("q1", NOW_MS, "feedback")])  # event time passes its window
    run.tick()
    assert events(pipeline) == {("impressions", "applied"): 1, ("feedback", "orphaned"): 1}


def test_a_restart_while_lists_are_open_finds_them_in_the_store_and_settles_them_when_quiet():
    queries = sorted(searches(5, 40, NOW_MS), key=lambda q: q.timestamp_ms)
    stream = generator(queries)
    first = Feed()
    first.send(stream[: len(stream) // 2])
    open_lists = {p: set(ps.lists) for p, ps in first.pipeline.partitions.items() if ps.lists}
    assert open_lists
    # A new process on the same store and topics: the open lists come back with the state ...
    second = Feed(first.pipeline.store)
    second.bus = first.bus
    second.bus.subscribe(list(TOPICS.values()), second.pipeline.assign, second.pipeline.revoke)
    assert {p: set(ps.lists) for p, ps in second.pipeline.partitions.items() if ps.lists} == open_lists
    pipeline = second.send(stream[len(stream) // 2:])
    # ... and, with no traffic after the last one, settle once the feedback topic is read
    # to its end and they waited windows.list_settle (serve sweeps on empty polls).
    pipeline.caught_up = {(TOPICS["feedback"], p) for p in range(3)}
    second.wall.t += 10
    second.tick()
    assert not any(ps.lists for ps in pipeline.partitions.values())
    assert_same(sums(pipeline), sums(feed(native(queries))))
    assert all(not any(k.startswith("list:") for k in meta) for meta in pipeline.store.meta.values())


def test_a_list_waits_for_its_impression_events_then_for_a_quiet_spell_of_list_settle():
    t = NOW_MS - 3_600_000
    run = Feed()
    pipeline = run.send([("impressions", "q1", make_query_event(_config("shop"), _row("q1", t))),
                         ("impressions", "q2", _native("q2", t + 60_000))])
    # The impression events' producer is down, the feedback topic is read to its end: an
    # outage must not turn lists into empty ones, however long.
    pipeline.caught_up = {(TOPICS["feedback"], p) for p in range(3)}
    run.wall.t += 3600
    run.tick()
    assert events(pipeline) == {("impressions", "applied"): 1}   # q2 only
    run.send([("feedback", "q1", _impression_event("q1", t, "a", 0)),
              ("feedback", "q1", {"action_name": "click", "query_id": "q1", "timestamp": t + 5_000,
                                  "event_attributes": {"object": {"object_id": "a"}}})])
    pipeline.caught_up = set()
    run.wall.t += 60
    run.tick()
    assert events(pipeline) == {("impressions", "applied"): 1}   # the feedback topic has more to read ...
    run.send([("feedback", "q1", _impression_event("q1", t, "b", 1))])
    pipeline.caught_up = {(TOPICS["feedback"], p) for p in range(3)}
    run.wall.t += 9.9
    run.tick()
    assert events(pipeline) == {("impressions", "applied"): 1}   # ... then the last impression event came 9.9 s ago ...
    run.wall.t += 0.2
    run.tick()  # ... and none since: the last list before a quiet spell settles
    assert events(pipeline) == {("impressions", "applied"): 2, ("feedback", "listed"): 2,
                                ("feedback", "applied"): 1}


def test_a_list_waits_for_the_feedback_topic_to_pass_its_time_when_impressions_run_ahead():
    t = NOW_MS - 3_600_000
    run = Feed()
    ahead = [_other("q1", t + 600_000)]  # the impressions topic is 10 minutes ahead ...
    pipeline = run.send([("impressions", "q1", make_query_event(_config("shop"), _row("q1", t)))] + ahead
                        + [("feedback", "q1", _impression_event("q1", t, "a", 0))])
    pipeline.caught_up = {(TOPICS["feedback"], p) for p in range(3)}  # ... and the feedback topic read to its end
    run.tick()
    run.tick()
    assert events(pipeline) == {("impressions", "applied"): 1}  # `ahead`; q1 waits for the feedback topic
    run.send([("feedback", "q1", _impression_event("q1", t + 1_000, "b", 1)), *_shown_other("q1", t + 10_000)])
    run.tick()
    assert events(pipeline) == {("impressions", "applied"): 3, ("feedback", "listed"): 2, ("feedback", "ignored"): 1}
    assert pipeline.partitions[_partition("q1")].records["q1"].impression.results == ["a", "b"]


def test_positions_of_every_shape_and_their_bases():
    decode = Decoder(SETTINGS).feedback
    base = {"action_name": "impression", "query_id": "q", "timestamp": NOW_MS,
            "event_attributes": {"object": {"object_id": 7}}}

    def position(**attributes) -> int | None:
        event = json.loads(json.dumps(base))
        event["event_attributes"].update(attributes)
        result = decode(json.dumps(event).encode(), NOW_MS)
        return result.position if isinstance(result, Feedback) else result

    assert position(position={"ordinal": 1}) == 1      # the UBI schema: 1-based
    assert position(position={"ordinal": 0}) == 0      # the generator: 0-based, the order is what counts
    assert position(position={"index": 0}) == 1
    assert position(rank=0) == 1
    assert position(position={"xy": {"x": 260.0, "y": 180.4}}) == 180_000_260   # reading order
    assert position(position={"xy": {"x": 20.0, "y": 500}}) > position(position={"xy": {"x": 900, "y": 180}})
    assert position(position={"ordinal": -1}) == Rejected("invalid", "position -1 is below 0")
    assert position(position={"x": 3, "y": 4}) == Rejected(
        "ignored", "an impression event without a position cannot place its document in a list")
    native_zero = {"query_id": "q", "timestamp": NOW_MS, "action": "click", "doc_id": "d", "position": 0}
    assert decode(json.dumps(native_zero).encode(), NOW_MS) == Rejected("invalid", "position 0 is below 1")


def test_query_records_without_hit_ids_wait_for_their_list():
    decode = Decoder(SETTINGS).impression
    record = make_query_event(_config("esci_ubi_sample"), _row("q", NOW_MS))
    text = query_hash(record["user_query"])
    assert decode(json.dumps(record).encode(), NOW_MS) == Impression(
        "q", "esci_ubi_sample", NOW_MS, [], "", assemble=True, query_hash=text,
        user_bucket=-1)
    record = {**record, "query_response_hit_ids": [], "query_attributes": {"ranker": "r", "hits": 10}}
    assert decode(json.dumps(record).encode(), NOW_MS) == Impression("q", "r", NOW_MS, [], "", assemble=True,
                                                                     expected=10, query_hash=text,
                                                                     user_bucket=-1)
    with_hits = {**record, "query_response_hit_ids": ["a", "b"]}
    assert decode(json.dumps(with_hits).encode(), NOW_MS) == Impression("q", "r", NOW_MS, ["a", "b"], "",
                                                                        query_hash=text)
    by_user = Decoder(config.load(None, {"RANKMETER_AB_UNIT": "user"})).impression
    assert by_user(json.dumps(with_hits).encode(), NOW_MS).user_bucket == bucket_of("c")
    assert by_user(json.dumps(with_hits).encode(), NOW_MS).user_hash == user_hash("c")


def test_judgments_may_carry_an_esci_label_graded_by_evaluation_labels():
    decode = Decoder(SETTINGS).feedback
    judgment = {"query_id": "q", "timestamp": NOW_MS, "action": "judgment", "doc_id": "B01", "event_id": "j"}
    graded = [decode(json.dumps({**judgment, "label": label}).encode(), NOW_MS)
              for label in ("Exact", "Substitute", "Complement", "Irrelevant", "E")]
    assert [(f.grade, f.explicit) for f in graded] == [(3.0, True), (2.0, True), (1.0, True), (0.0, True), (3.0, True)]
    assert decode(json.dumps({**judgment, "label": "Great"}).encode(), NOW_MS) == Rejected(
        "invalid", "judgment label 'Great' is not in evaluation.labels")
    ubi = {"action_name": "judgment", "query_id": "q", "timestamp": NOW_MS,
           "event_attributes": {"object": {"object_id": "B01"}, "label": "Substitute"}}
    assert decode(json.dumps(ubi).encode(), NOW_MS).grade == 2.0
    custom = config.load(None, {"RANKMETER_EVALUATION_LABELS": "perfect=4,bad=0"})
    assert Decoder(custom).feedback(json.dumps({**judgment, "label": "perfect"}).encode(), NOW_MS).grade == 4.0


# ---- helpers ----

def _config(application: str):
    from types import SimpleNamespace
    return SimpleNamespace(application=application)


def _row(query_id: str, ms: int) -> dict:
    return {"query_id": query_id, "client_id": "c", "user_query": "q", "session_id": "s", "timestamp": iso(ms),
            "object_id_field": "product_id", "search_config": "teamA"}


def _impression_event(query_id: str, ms: int, doc: str, position: int) -> dict:
    return make_ubi_event(_config("shop"), {**_row(query_id, ms), "action_name": "impression",
                                            "object_id": doc, "position": position})


def _native(query_id: str, ms: int) -> dict:
    return {"query_id": query_id, "ranker": "zz", "timestamp": ms, "results": ["z"]}


def _other(like: str, ms: int, kind: str = "impressions") -> tuple[str, str, dict]:
    """An event of another query in the same partition as `like`, at `ms`: it moves that
    partition's event time."""
    qid = next(f"other{n}" for n in range(10_000) if _partition(f"other{n}") == _partition(like)
               and not _used.get(f"other{n}"))
    _used[qid] = True
    if kind == "impressions":
        return ("impressions", qid, _native(qid, ms))
    return ("feedback", qid, {"query_id": qid, "action": "click", "doc_id": "z", "timestamp": ms})


_used: dict[str, bool] = {}


def _shown_other(like: str, ms: int) -> list[tuple[str, str, dict]]:
    """Another query of `like`'s partition at `ms`, and an impression event of it: the
    partition's impression events reach `ms`."""
    kind, qid, record = _other(like, ms)
    return [(kind, qid, record),
            ("feedback", qid, {"query_id": qid, "action": "impression", "doc_id": "z", "position": 1, "timestamp": ms})]


def _partition(query_id: str) -> int:
    return zlib.crc32(query_id.encode()) % 3  # as the bus partitions


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_list_settled_by_a_checkpoint_whose_commit_failed_is_counted_once(when):
    from test_pipeline import FlakyStore

    t = NOW_MS - 60_000
    store = FlakyStore()
    run = Feed(store)
    pipeline = run.send([("impressions", "q1", make_query_event(_config("shop"), _row("q1", t))),
                         ("feedback", "q1", _impression_event("q1", t, "a", 0))])
    pipeline.caught_up = {(TOPICS["feedback"], p) for p in range(3)}
    run.wall.t += 11
    store.fail = when  # the quiet spell's sweep settles the list: a checkpoint moving no offset
    with pytest.raises(ConnectionError):
        run.tick()
    pipeline.revoke(list(pipeline.partitions), reclaiming=True)   # serve's recovery: claim again
    run.bus.seek(pipeline.assign(list(range(3))))
    pipeline.caught_up = {(TOPICS["feedback"], p) for p in range(3)}
    run.wall.t += 11
    run.tick()
    assert events(pipeline) == {("impressions", "applied"): 1, ("feedback", "listed"): 1}
    assert next(v for v in pipeline.views() if v.window == "5m").queries_all == 1


def test_impression_events_before_a_query_record_with_its_hit_ids_are_counted():
    t = NOW_MS - 60_000
    record = {"query_id": "q1", "timestamp": t, "application": "shop", "query_response_hit_ids": ["a", "b"]}
    pipeline = feed([("feedback", "q1", _impression_event("q1", t, "a", 0)),
                     ("feedback", "q1", _impression_event("q1", t, "x", 1)),
                     ("impressions", "q1", record),
                     ("feedback", "q1", _impression_event("q1", t, "y", 1))])
    assert events(pipeline) == {("impressions", "applied"): 1, ("feedback", "ignored"): 1,
                                ("feedback", "unmatched"): 2}
    assert pipeline.partitions[_partition("q1")].records["q1"].shown == []


def test_ties_keep_their_arrival_order_and_a_list_keeps_at_most_max_results():
    t = NOW_MS - 60_000
    header = {"query_id": "q1", "timestamp": t, "application": "shop"}
    shown = [("c", 2), ("b", 1), ("a", 2), ("d", 3)]
    settings = config.load(None, {"RANKMETER_LIMITS_MAX_RESULTS": "3"})
    bus = Bus(partitions=3)
    pipeline = Pipeline(settings, MemoryStore(), lambda r, why: None, Clock(), Clock(0.0))
    bus.subscribe(list(TOPICS.values()), pipeline.assign, pipeline.revoke)
    for kind, record in [("impressions", header)] + [("feedback", _impression_event("q1", t, d, i)) for d, i in shown]:
        bus.send(TOPICS[kind], b"q1", json.dumps(record).encode())
    pipeline.process(bus.poll(0, 100))
    pipeline.end_of_input()
    assert pipeline.partitions[_partition("q1")].records["q1"].impression.results == ["b", "c", "a"]


def test_negative_positions_are_invalid_whatever_the_field():
    decode = Decoder(SETTINGS).feedback
    for attributes in ({"position": {"index": -1}}, {"rank": -2}, {"position": {"ordinal": -1}}):
        event = {"action_name": "click", "query_id": "q", "timestamp": NOW_MS,
                 "event_attributes": {"object": {"object_id": "d"}, **attributes}}
        result = decode(json.dumps(event).encode(), NOW_MS)
        assert isinstance(result, Rejected) and result.outcome == "invalid", attributes


def test_changing_the_labels_grades_starts_the_measures_afresh():
    from rankmeter.pipeline import layout_for

    default = layout_for(SETTINGS).fingerprint
    assert layout_for(config.load(None, {"RANKMETER_EVALUATION_LABELS": "E=1,S=0.1,C=0.01,I=0"})).fingerprint != default
    assert layout_for(config.load(None, {})).fingerprint == default


def test_a_fast_browser_clock_does_not_cut_other_queries_lists():
    t = NOW_MS - 600_000
    run = Feed()
    pipeline = run.send([("impressions", "q1", make_query_event(_config("shop"), _row("q1", t))),
                         ("feedback", "q1", _impression_event("q1", t + 300, "a", 0))])
    # Another search of the partition a second later, its browser 30 s fast: the impression
    # events reach its record's time (the search engine's clock), not the browser's.
    other = _shown_other("q1", t + 1_000)
    other[1][2]["timestamp"] = t + 30_000
    run.send(other)
    run.tick()
    assert ("feedback", "listed") not in events(pipeline)   # q1 still waits
    run.send([("feedback", "q1", _impression_event("q1", t + 400, d, i)) for i, d in ((1, "b"), (2, "c"))]
             + _shown_other("q1", t + 11_000))
    run.tick()
    assert pipeline.partitions[_partition("q1")].records["q1"].impression.results == ["a", "b", "c"]


def test_a_slow_browser_clock_still_lets_the_last_list_settle_in_a_quiet_spell():
    t = NOW_MS - 600_000
    run = Feed()
    pipeline = run.send([("impressions", "q1", make_query_event(_config("shop"), _row("q1", t))),
                         ("feedback", "q1", _impression_event("q1", t - 1_700, "a", 0))])
    pipeline.caught_up = {(TOPICS["feedback"], p) for p in range(3)}
    run.wall.t += 10
    run.tick()
    assert events(pipeline) == {("impressions", "applied"): 1, ("feedback", "listed"): 1}


def test_a_batch_another_replica_replayed_and_committed_is_not_counted_again_on_reclaim():
    from test_pipeline import FlakyStore

    t = NOW_MS - 60_000
    store = FlakyStore()
    qid = next(q for q in (f"q{n}" for n in range(100)) if _partition(q) == 0)  # committed first
    a = Feed(store)
    store.fail = "before"   # replica A's first checkpoint is not stored; A keeps it as unsure
    with pytest.raises(ConnectionError):
        a.send([("impressions", qid, _native(qid, t))])
    assert a.pipeline.ledger.unsure[0].counts == {("impressions", "applied"): 1}
    a.pipeline.revoke(list(a.pipeline.partitions), reclaiming=True)
    b = Feed(store)          # replica B takes the partitions over, replays and counts the batch
    b.bus = a.bus
    b.bus.subscribe(list(TOPICS.values()), b.pipeline.assign, b.pipeline.revoke)
    b.send([])               # its first checkpoint of the partition: numbered as A's was
    a.bus.seek(a.pipeline.assign(list(range(3))))   # A's recovery claims them again
    assert sum(b.pipeline.events.values()) == 1
    assert sum(a.pipeline.events.values()) == 0
