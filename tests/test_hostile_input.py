"""Hostile input (issue 19, items 1, 2, 7): the decoder's limits on names, ids and grades;
stored fields that cannot be read are counted and skipped, never raised; interleaving
names under the label cap; a bounded label cache."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from rankmeter import config
from rankmeter.ab.report import readable_history
from rankmeter.events import Decoder, Rejected
from rankmeter.events.rules import MAX_ID, MAX_NAME
from rankmeter.exporter import Exporter, Health
from rankmeter.pipeline import Pipeline
from rankmeter.pipeline import labels as labels_module
from rankmeter.pipeline.labels import Labels
from rankmeter.source import Bus
from rankmeter.store import MemoryStore
from rankmeter.unreadable import Unreadable

NOW_S = 1_800_000_000.0
NOW = int(NOW_S * 1000)
SETTINGS = config.load(None, {})
DEC = Decoder(SETTINGS)
IMPRESSIONS, FEEDBACK = SETTINGS.kafka.impressions_topic, SETTINGS.kafka.feedback_topic


def native_impression(**fields):
    return {"query_id": "q", "ranker": "bm25", "timestamp": NOW, "results": ["a", "b"], **fields}


def native_click(**fields):
    return {"query_id": "q", "action": "click", "doc_id": "a", "timestamp": NOW, **fields}


def ubi_query(**fields):
    return {"query_id": "u", "timestamp": NOW, "application": "shop", "query_response_hit_ids": ["x"], **fields}


def ubi_event(object_id="x", **fields):
    return {"action_name": "click", "query_id": "u", "timestamp": NOW,
            "event_attributes": {"object": {"object_id": object_id}, "position": {"ordinal": 1}}, **fields}


HUGE = "h" * 100_000
REFUSED = [  # (which decoder, message, the field the reason must name)
    ("impression", native_impression(ranker="a\x1fb"), "ranker"),
    ("impression", native_impression(ranker="x" * (MAX_NAME + 1)), "ranker"),
    ("impression", native_impression(ranker=HUGE), "ranker"),
    ("impression", native_impression(ranker="right\u202eleft"), "ranker"),       # a bidi override (Cf)
    ("impression", native_impression(ranker="line\u2028break"), "ranker"),        # Zl
    ("impression", native_impression(segment="de\n"), "segment"),
    ("impression", native_impression(segment="s" * (MAX_NAME + 1)), "segment"),
    ("impression", native_impression(query_id="q\x00"), "query_id"),
    ("impression", native_impression(results=["a", "d" * (MAX_ID + 1)]), "results"),
    ("impression", native_impression(interleaving={"experiment": "e\x1fx", "teams": ["A", "B"]}),
     "interleaving.experiment"),
    ("impression", native_impression(interleaving={"experiment": "e" * (MAX_NAME + 1), "teams": ["A", "B"]}),
     "interleaving.experiment"),
    ("impression", native_impression(interleaving={"experiment": "e", "teams": ["A", "B\x1f"]}),
     "interleaving.teams"),
    ("impression", ubi_query(query_attributes={"ranker": "r\x1f"}), "ranker"),
    ("impression", ubi_query(application=HUGE), "ranker"),
    ("impression", ubi_query(query_response_hit_ids=["x" * (MAX_ID + 1)]), "results"),
    ("feedback", native_click(doc_id="d" * (MAX_ID + 1)), "doc_id"),
    ("feedback", native_click(event_id="e" * 20_000), "event_id"),
    ("feedback", native_click(action="judgment", label="L" * (MAX_NAME + 1)), "label"),
    ("feedback", native_click(action="judgment", label="Exact\x1f"), "label"),
    ("feedback", ubi_event(object_id="o" * (MAX_ID + 1)), "doc_id"),
    ("feedback", ubi_event(message_id="m" * (MAX_ID + 1)), "event_id"),
    ("feedback", native_click(timestamp=HUGE), "timestamp"),
]


@pytest.mark.parametrize("which, message, field", REFUSED)
def test_names_and_ids_past_their_limits_or_with_control_characters_are_dead_lettered(which, message, field):
    out = getattr(DEC, which)(json.dumps(message).encode(), NOW)
    assert isinstance(out, Rejected) and out.outcome == "invalid", out
    assert field in out.reason
    assert len(out.reason) < 300  # names the field and the rule; never echoes the string whole


def test_names_and_ids_within_the_limits_are_accepted():
    name, ident = "n" * MAX_NAME, "i" * MAX_ID
    accepted = [
        DEC.impression(json.dumps(native_impression(ranker=name, segment="Köln — β 2", results=[ident])).encode(), NOW),
        DEC.impression(json.dumps(native_impression(ranker='quote"d \\ back', interleaving={
            "experiment": name, "teams": [name, "B"]})).encode(), NOW),
        DEC.feedback(json.dumps(native_click(doc_id=ident, event_id=ident)).encode(), NOW),
        DEC.feedback(json.dumps(ubi_event(object_id=ident, message_id=ident)).encode(), NOW),
    ]
    assert not any(isinstance(a, Rejected) for a in accepted), accepted
    assert accepted[0].ranker == name and accepted[1].experiment == name


@pytest.mark.parametrize("grade", ["1e308", "1000.5", "-1", "1e999"])  # (1e999: read as inf)
def test_a_grade_outside_0_to_1000_is_dead_lettered(grade):
    value = json.dumps(native_click(action="judgment", grade=0)).encode().replace(b'"grade": 0', f'"grade": {grade}'.encode())
    out = DEC.feedback(value, NOW)
    assert isinstance(out, Rejected) and out.outcome == "invalid" and "grade" in out.reason


def test_grades_at_the_bounds_are_applied():
    for grade in (0, 1000):
        out = DEC.feedback(json.dumps(native_click(action="judgment", grade=grade)).encode(), NOW)
        assert not isinstance(out, Rejected) and out.grade == grade


@pytest.mark.parametrize("env", [{"RANKMETER_EVALUATION_LONG_DWELL_GRADE": "1e308"}])
def test_configured_grades_are_bounded_at_load(env):
    with pytest.raises(config.ConfigError, match="long_dwell_grade"):
        config.load(None, env)


def test_configured_grade_maps_are_bounded_at_load(tmp_path):
    for section in ("grades", "labels"):
        path = tmp_path / f"{section}.yml"
        path.write_text(f"evaluation:\n  {section}:\n    click: 1e308\n")
        with pytest.raises(config.ConfigError, match=f"evaluation.{section}.*from 0 to 1000"):
            config.load(str(path), {})


def one_partition(settings=SETTINGS, store=None, letters=None, bus=None):
    """A pipeline on one partition; a restart passes the store and the bus (its offsets are the store's)."""
    bus, store = bus or Bus(partitions=1), store if store is not None else MemoryStore()
    pipeline = Pipeline(settings, store, lambda r, why: letters.append(why) if letters is not None else None,
                        lambda: NOW_S)
    bus.subscribe([IMPRESSIONS, FEEDBACK], pipeline.assign, pipeline.revoke)

    def feed(events):
        for topic, event in events:
            bus.send(topic, event["query_id"].encode(), json.dumps(event).encode())
        while records := bus.poll(0, 100_000):
            pipeline.process(records)

    feed.bus = bus
    return pipeline, store, feed


def render(pipeline: Pipeline) -> bytes:
    return Exporter(pipeline.readout, Health(), dict).render()


def test_a_100kb_ranker_and_500_clicks_with_20kb_ids_are_dead_letters_and_nothing_grows():
    letters: list[str] = []
    pipeline, store, feed = one_partition(letters=letters)
    feed([(IMPRESSIONS, native_impression(query_id="q", ranker="bm25")),
          (IMPRESSIONS, native_impression(query_id="huge", ranker=HUGE))]
         + [(FEEDBACK, native_click(query_id="q", event_id=f"{i}-" + "e" * 20_000)) for i in range(250)]
         + [(FEEDBACK, native_click(query_id="q", doc_id=f"{i}-" + "d" * 20_000)) for i in range(250)]
         + [(FEEDBACK, native_click(query_id="q", event_id="fine"))])
    assert len(letters) == 501
    assert all(len(why) < 300 for why in letters)
    assert sum("ranker has 100000 characters" in why for why in letters) == 1
    assert pipeline.events[("feedback", "applied")] == 1
    assert max(len(r) for r in store.records[0].values()) < 2_000   # main: a 10 MB record
    text = render(pipeline)
    assert len(text) < 100_000 and b"hhhhhhhh" not in text           # main: /metrics of 49 MB
    assert b'ranker="bm25"' in text


def planted(store: MemoryStore) -> None:
    """Fields no version of rankmeter writes, as a value holding \x1f would have made them."""
    store.buckets[0].update({"a\x1fb\x1fc\x1f29": bytes(8), "a\x1fb\x1fnot-a-minute": bytes(8),
                             "short": bytes(8), "a\x1f\x1f29": bytes(7)})
    store.ab[0].update({"exp\x1fonly-two": bytes(8), "il\x1fe\x1fa": bytes(24), "il\x1fe\x1fa\x1fb": bytes(16),
                        "il\x1fe\x1fa\x1fb\x1fc": bytes(24)})
    store.meta[0].update({"layout:0123456789abcdef": "not a layout", "layout:fedcba9876543210": '{"ids": 1}'})


def interleaved(qid, experiment="e", teams=("A", "B")):
    return native_impression(query_id=qid, ranker="mix", results=["a", "b"],
                             interleaving={"experiment": experiment, "teams": list(teams)})


def test_unreadable_stored_fields_are_counted_logged_once_and_skipped_by_claim_look_report_and_scrape(caplog):
    ab = config.load(None, {"RANKMETER_AB_BASELINE": "bm25", "RANKMETER_AB_UNIT": "query", "RANKMETER_AB_START": str(NOW - 60_000),
                            "RANKMETER_AB_MIN_QUERIES": "2"})
    pipeline, store, feed = one_partition(ab)
    feed([(IMPRESSIONS, native_impression(query_id=f"q{i}", ranker=r)) for i, r in enumerate(["bm25", "ltr"] * 3)]
         + [(FEEDBACK, native_click(query_id=f"q{i}")) for i in range(3)]
         + [(IMPRESSIONS, interleaved("i1")), (FEEDBACK, native_click(query_id="i1"))])
    before = {(v.ranker, v.window): v.sums for v in pipeline.views()}
    pipeline.ab_look()
    arms_before = [(a.ranker, a.queries) for a in pipeline.ab_result.arms]
    planted(store)
    caplog.set_level(logging.ERROR, logger="rankmeter.store")
    # A restart claims the partition: main raised ValueError here, inside the rebalance callback.
    restarted, _, feed_again = one_partition(ab, store=store, bus=feed.bus)
    assert {(v.ranker, v.window): v.sums for v in restarted.views()} == before
    assert restarted.unreadable.counts == {"bucket": 4, "experiment": 1, "interleaving": 3,
                                           "layout": 2, "history": 0, "offsets": 0, "watermark": 0, "epoch": 0,
                                           "list": 0, "key": 0, "query": 0}
    restarted.ab_look()
    restarted.ab_look()  # the look reads every partition's stored sums: skipped each time ...
    assert restarted.unreadable.counts["interleaving"] == 3 * 3 and restarted.unreadable.counts["experiment"] == 3
    assert [(a.ranker, a.queries) for a in restarted.ab_result.arms] == arms_before
    [preference] = restarted.interleaving_result
    assert (preference.experiment, preference.wins_a) == ("e", 1)
    lines = [r for r in caplog.records if r.getMessage() == "skipping an unreadable stored field"]
    assert len(lines) == 10  # ... but logged once per key and field
    assert {r.kind for r in lines} == {"bucket", "experiment", "interleaving", "layout"}
    assert {r.key for r in lines} == {"{0}:buckets", "{0}:ab", "{0}:meta"}
    feed_again([(IMPRESSIONS, native_impression(query_id="later"))])  # the partition goes on
    assert restarted.events[("impressions", "applied")] == 1
    text = render(restarted).decode()
    assert 'rankmeter_store_unreadable_total{kind="bucket"} 4.0' in text
    # `rankmeter report` reads without claiming: the same fields are skipped.
    report = Pipeline(ab, store, lambda r, why: None, lambda: NOW_S)
    report.assign(store.partitions(), claim=False)
    assert {(v.ranker, v.window): v.sums for v in report.views()} == {
        (v.ranker, v.window): v.sums for v in restarted.views()}
    assert report.ab_look(save=False) is not None


def test_unreadable_history_lines_are_skipped_by_the_html_report():
    unreadable = Unreadable()
    good = json.dumps({"t": 1, "arms": {"a\x1f": 3}, "srm": {}, "c": {"AP\x1fa\x1f\x1fmacro": [0.1, 0, 0.2, 0.5]}})
    bad = ["not json", json.dumps({"t": 1, "arms": {"a\x1fb\x1fc": 3}, "c": {}}),
           json.dumps({"t": 1, "arms": {}, "c": {"AP\x1fa\x1fmacro": [0.1, 0, 0.2, 0.5]}}),
           json.dumps({"t": 1, "arms": {}, "c": {"AP\x1fa\x1f\x1fmacro": [0.1]}}), json.dumps([1])]
    points = readable_history("x", [good, *bad], unreadable)
    assert len(points) == 1 and points[0]["arms"] == {"a\x1f": 3.0}
    assert unreadable.counts["history"] == len(bad)


def test_interleaving_experiments_and_teams_go_through_the_label_cap():
    capped = config.load(None, {"RANKMETER_LIMITS_MAX_EXPERIMENTS": "2", "RANKMETER_LIMITS_MAX_RANKERS": "5"})
    pipeline, store, feed = one_partition(capped)
    events = []
    for i in range(300):
        events += [(IMPRESSIONS, interleaved(f"q{i}", experiment=f"exp{i}")), (FEEDBACK, native_click(query_id=f"q{i}"))]
    events += [(IMPRESSIONS, interleaved("t", experiment="exp0", teams=("T1", "T2"))),    # rankers 4 and 5 (with "mix")
               (IMPRESSIONS, interleaved("u", experiment="exp1", teams=("U1", "U2"))),    # past max_rankers
               (FEEDBACK, native_click(query_id="t")), (FEEDBACK, native_click(query_id="u"))]
    feed(events)
    pipeline.ab_look()
    found = {(r.experiment, r.team_a, r.team_b): r.wins_a for r in pipeline.interleaving_result}
    assert found == {("exp0", "A", "B"): 1, ("exp1", "A", "B"): 1, ("exp0", "T1", "T2"): 1}
    assert len(store.ab[0]) == 3  # main: 300 stored fields, 900 series
    assert pipeline.folded["experiment"] == 298
    text = render(pipeline).decode()
    assert text.count("rankmeter_interleaving_queries{") == 9
    assert 'rankmeter_labels_folded_total{label="experiment"} 298.0' in text


def test_the_label_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(labels_module, "CACHE_LIMIT", 100)
    labels = Labels(SETTINGS, MemoryStore(), lambda: NOW_S)
    found = [labels.label("ranker", f"r{i}") for i in range(1_000)]
    assert found[:20] == [f"r{i}" for i in range(20)] and set(found[20:]) == {"other"}
    assert len(labels._cache) == 100
    assert labels.label("ranker", "r0") == "r0"  # forgotten, asked again: still admitted


def test_stored_sums_are_not_changed_by_a_skip():
    """A skipped field is left in the store as it is (a version that can read it may)."""
    pipeline, store, feed = one_partition()
    feed([(IMPRESSIONS, native_impression())])
    planted(store)
    kept = dict(store.buckets[0])
    restarted, _, feed_again = one_partition(store=store, bus=feed.bus)
    feed_again([(IMPRESSIONS, native_impression(query_id="q2"))])
    assert {f: d for f, d in store.buckets[0].items() if f in kept and f.count("\x1f") != 2} == \
        {f: d for f, d in kept.items() if f.count("\x1f") != 2}
    assert np.frombuffer(store.buckets[0][next(f for f in kept if f.startswith("bm25"))]).sum() > 0


def test_numbers_a_claim_could_not_read_are_counted_and_an_unreadable_offset_makes_the_partition_lost():
    """The Redis store reports stored numbers that are not integers with the snapshot
    (tests/integration/test_redis_store.py); the claim counts them, and a partition whose
    offsets could not be used is one without stored state: lost, since Kafka has consumed it."""
    class UnreadableOffsets(MemoryStore):
        def claim(self, partition):
            return super().claim(partition)._replace(
                offsets={}, unreadable=(("offsets", IMPRESSIONS, "not an integer"), ("watermark", FEEDBACK, "no")))
    _, store, feed = one_partition(SETTINGS)
    feed([(IMPRESSIONS, native_impression(query_id="q1"))])
    bad = UnreadableOffsets()
    bad.__dict__.update(store.__dict__)
    restarted = Pipeline(SETTINGS, bad, lambda r, why: None, lambda: NOW_S)
    restarted.assign([0], {(IMPRESSIONS, 0): 1})   # Kafka's commit: the partition was consumed
    assert restarted.unreadable.counts["offsets"] == 1 and restarted.unreadable.counts["watermark"] == 1
    assert restarted.lost == {0}
    # Review finding: without Kafka's commit (the group's offsets expired, a new group id) it
    # resumed from the log's start onto the stored sums, counting every closed query twice.
    again = Pipeline(SETTINGS, bad, lambda r, why: None, lambda: NOW_S)
    again.assign([0], {})
    assert again.lost == {0}
