"""Per-segment examination curves (issue 22, debias/segments.py): a segment whose users
examine ranks differently gets its own curve once its harvest has the support, a thin one
keeps the global curve exactly, and the per-segment sums survive a restart (stored per
partition, skipped by the A/B sums)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from rankmeter import config
from rankmeter.debias import ipw, segments
from rankmeter.debias.propensity import Propensities
from rankmeter.debias.tables import ModelTables, decide
from rankmeter.exporter import Exporter, Health
from rankmeter.pipeline import PAIRS, Pipeline
from rankmeter.pipeline.experiments import ab_problem
from rankmeter.simulator.clicks import EXAMINATION, pbm
from rankmeter.source import Bus
from rankmeter.store import MemoryStore
from test_prometheus_rules import promtool  # noqa: F401 (the fixture)

K = 10
CURVES = {"mobile": EXAMINATION["exp-0.75"][:K], "desktop": EXAMINATION["power-0.9"][:K]}


def traffic(queries: int, seed: int, mobile: float, texts: int = 200, curves: dict = CURVES):
    """Lists of 10 of 15 documents per text (a noisy ranking: each document shown at
    several ranks), a share `mobile` of the queries by users of the geometric curve, the
    rest by 1/r^0.9 users (pbm clicks)."""
    rng = np.random.default_rng(seed)
    attract = rng.uniform(0.02, 0.8, (texts, 15))
    for q in range(queries):
        t = int(rng.integers(texts))
        order = list(np.argsort(-(attract[t] + rng.normal(0, 0.3, 15)))[:K])
        segment = "mobile" if rng.random() < mobile else "desktop"
        clicks = pbm([attract[t][d] for d in order], rng, curves[segment])
        shown = [f"d{d}" for d in order]
        yield f"q{seed}-{q}", t, shown, [shown[r] for r in clicks], segment


def fed(queries: int, seed: int, mobile: float, min_pairs: int = 1000) -> ModelTables:
    tables = ModelTables(K, 50_000, segment_capacity=config.Debias().segment_capacity, segment_limit=21)
    for qid, t, shown, clicked, segment in traffic(queries, seed, mobile):
        tables.observe(qid, f"t{t}", shown, set(clicked), {d: 1.0 for d in clicked}, segment)
    look = decide(tables.vector(), K, 100, None)
    tables.looked(look, segments.curves(tables.segments.vectors(), K, min_pairs))
    return tables


@pytest.mark.parametrize("seed", range(1, 6))
def test_a_segment_with_another_curve_gets_its_own_within_a_tolerance(seed):
    tables = fed(6000, seed, mobile=0.3)
    own = tables.curves["mobile"]
    assert np.abs(np.array(own) - CURVES["mobile"]).max() < 0.08, own
    # The global curve, mostly desktop users', is off for mobile: what the segment's own fixes.
    glob = np.array(tables.look.pbm.relative, dtype=float)
    assert np.abs(glob - CURVES["mobile"]).max() > 0.1, glob
    assert tables.weights(["a"], set(), K, "mobile") == ipw.weights(own, K, ipw.DEFAULT_MAX_WEIGHT)
    assert tables.weights(["a"], set(), K, "mobile") != tables.weights(["a"], set(), K, "")


def test_a_segment_below_support_falls_back_to_the_global_curve_exactly():
    tables = fed(4000, 7, mobile=0.03)  # about 120 mobile queries
    assert "mobile" in tables.segments.tables and "desktop" in tables.curves
    assert "mobile" not in tables.curves
    glob = ipw.weights(tables.look.pbm.relative, K, ipw.DEFAULT_MAX_WEIGHT)
    assert tables.weights(["a"], set(), K, "mobile") == glob
    assert tables.weights(["a"], set(), K, "unknown") == glob and tables.weights(["a"], set(), K, "") == glob


def test_the_support_rule_at_its_boundary():
    curve = [float(p) for p in CURVES["mobile"]]
    assert segments.qualifies(Propensities(curve, [1000.0] * K, 1), 1000)
    assert not segments.qualifies(Propensities(curve, [1000.0] * (K - 1) + [999.0], 1), 1000)
    assert not segments.qualifies(Propensities(curve[:-1] + [None], [5000.0] * K, 1), 1000)
    # Implausible (rank 2 examined more than rank 1, on ample support): not its own curve.
    assert not segments.qualifies(Propensities([1.0, 1.5] + curve[2:], [1e6] * K, 1), 1000)


def test_a_segment_is_estimated_anew_only_once_its_pairs_have_grown(monkeypatch):
    tables = fed(6000, 1, mobile=0.3)
    sums = tables.segments.vectors()
    calls: list[int] = []
    estimating = segments.estimating
    monkeypatch.setattr(segments, "estimating", lambda *a: calls.append(1) or estimating(*a))
    kept: dict = {}
    first = segments.curves(sums, K, 1000, kept)
    assert len(calls) == 2 and set(first) == {"mobile", "desktop"}
    grown = {s: v * (1.09 if s == "mobile" else 1.11) for s, v in sums.items()}  # (pairs and clicks alike)
    again = segments.curves(grown, K, 1000, kept)
    assert again["mobile"] is first["mobile"] and len(calls) == 3  # desktop's estimated anew, not mobile's
    assert again["desktop"] == pytest.approx(first["desktop"])
    assert segments.curves({}, K, 1000, kept) == {}


def test_stored_curves_read_back_and_garbage_is_left_out():
    text = segments.to_field({"mobile": [1.0] * K}, 5.0)
    assert segments.from_field(text, K, 5.0) == {"mobile": [1.0] * K}
    # Of another look (a version without per-segment curves stored one since): none.
    assert segments.from_field(text, K, 6.0) == {}
    garbage = {"a": [1.0] * 3, "b": [None] * K, "": [1.0] * K, "c": [0.0] * K}
    assert segments.from_field(json.dumps({"at": 5.0, "curves": garbage}), K, 5.0) == {}
    assert segments.from_field("{", K, 5.0) == {} and segments.from_field("[]", K, 5.0) == {}
    assert segments.from_field(None, K, 5.0) == {}



@pytest.mark.parametrize("text", [
    json.dumps({"at": 5.0, "curves": {"mobile": [int("9" * 400)] * K}}),  # OverflowError in isfinite
    "[" * 100_000,                                                          # RecursionError
])
def test_a_hostile_stored_text_is_unreadable_not_a_crash(text):
    """Review s10 M3: what the stored look holds must never stop a replica's look."""
    assert segments.from_field(text, K, 5.0) == {}

# ---- in the pipeline: stored per partition, read back after a restart ----

START_MS = 1_800_000_000_000
ENV = {"RANKMETER_WINDOWS_ATTRIBUTION": "5m", "RANKMETER_WINDOWS_GRACE": "1m", "RANKMETER_WINDOWS_JUDGMENTS": "10m",
       "RANKMETER_WINDOWS_SIZES": "1h", "RANKMETER_DEBIAS_HARVEST_SHARE": "1",
       "RANKMETER_DEBIAS_SEGMENT_MIN_PAIRS": "300"}
SETTINGS = config.load(None, {**ENV, "RANKMETER_DEBIAS_SEGMENT_CURVES": "true"})  # (off by default)
OFF = config.load(None, ENV)


class Clock:
    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> float:
        return self.ms / 1000


def run(pipeline: Pipeline, bus: Bus, clock: Clock, queries: int, seed: int, start_ms: int) -> None:
    """The traffic, one query every 0.5 s of event time, its clicks a second later; read
    every 50 queries, then 20 minutes more so every query's clicks are final."""
    k = SETTINGS.kafka
    for i, (qid, t, shown, clicked, segment) in enumerate(traffic(queries, seed, mobile=0.4)):
        ts = start_ms + i * 500
        bus.send(k.impressions_topic, qid.encode(), json.dumps(
            {"query_id": qid, "ranker": "r", "timestamp": ts, "results": shown, "user_query": f"t{t}",
             "segment": segment}).encode(), timestamp_ms=ts)
        for doc in clicked:
            bus.send(k.feedback_topic, qid.encode(), json.dumps(
                {"query_id": qid, "action": "click", "doc_id": doc, "timestamp": ts + 1000,
                 "event_id": f"{qid}{doc}"}).encode(), timestamp_ms=ts + 1000)
        if i % 50 == 49:
            clock.ms = ts + 1000
            while records := bus.poll(0, 10_000):
                pipeline.process(records)
    for minute in range(1, 21):
        clock.ms = start_ms + queries * 500 + minute * 60_000
        bus.send(k.impressions_topic, b"tick", json.dumps(  # event time moves on: queries close
            {"query_id": f"tick{seed}-{minute}", "ranker": "r", "timestamp": clock.ms, "results": ["x"]}).encode(),
            timestamp_ms=clock.ms)
        bus.send(k.feedback_topic, b"tick", json.dumps(
            {"query_id": f"tick{seed}-{minute}", "action": "click", "doc_id": "x", "timestamp": clock.ms,
             "event_id": f"tick{seed}-{minute}"}).encode(), timestamp_ms=clock.ms)
        while records := bus.poll(0, 10_000):
            pipeline.process(records)


def pipeline_on(store: MemoryStore, clock: Clock, settings: config.Settings = SETTINGS) -> tuple[Pipeline, Bus]:
    pipeline = Pipeline(settings, store, lambda r, why: None, clock)
    bus = Bus(partitions=2)
    bus.subscribe([SETTINGS.kafka.impressions_topic, SETTINGS.kafka.feedback_topic], pipeline.assign,
                  pipeline.revoke)
    return pipeline, bus


@pytest.fixture(scope="module")
def harvested() -> tuple[Pipeline, MemoryStore, Bus]:
    store, clock = MemoryStore(), Clock(START_MS)
    pipeline, bus = pipeline_on(store, clock)
    run(pipeline, bus, clock, 3000, 1, START_MS)
    pipeline.look_at_position_bias(estimate_here=True)
    return pipeline, store, bus


def test_off_by_default_no_segment_table_field_or_curve(harvested):
    """debias.segment_curves is off by default (review s10 H1, M4): nothing per segment is
    harvested, stored or read, even a valid stored `segments` field."""
    assert not OFF.debias.segment_curves
    store, clock = MemoryStore(), Clock(START_MS)
    pipeline, bus = pipeline_on(store, clock, OFF)
    run(pipeline, bus, clock, 1000, 1, START_MS)
    pipeline.look_at_position_bias(estimate_here=True)
    bias = pipeline.position_bias
    assert bias.tables.segments.tables == {} and bias.segment_status == {} and bias.segment_curves == {}
    assert not any(segments.segment_of(f) for fields in store.load_ab(store.partitions()).values() for f in fields)
    name = next(iter(store.running))
    assert segments.KEY not in store.running[name]
    # A record an enabled holder wrote: an off replica weighs with the global curve only.
    on_store = harvested[1]
    on_name = next(iter(on_store.running))
    assert segments.KEY in on_store.running[on_name]
    replica = Pipeline(OFF, on_store, lambda r, why: None, Clock(START_MS))
    replica.look_at_position_bias(estimate_here=False)
    assert replica.position_bias.segment_curves == {}


def test_per_segment_sums_are_stored_per_partition_and_read_back_after_a_restart(harvested):
    pipeline, store, _ = harvested
    bias = pipeline.position_bias
    assert set(bias.segment_curves) == {"mobile", "desktop"}, bias.tables.segments.vectors()
    stored = store.load_ab(store.partitions(), only=[segments.field(s) for s in ("mobile", "desktop")])
    for s in ("mobile", "desktop"):
        assert all(segments.field(s) in fields for fields in stored.values()), s
        # Each partition credited with what its own queries added: together the process's.
        total = sum(np.frombuffer(fields[segments.field(s)]) for fields in stored.values())
        np.testing.assert_allclose(total, bias.tables.segments.tables[s].sums.to_vector(), atol=1e-9)
    again = Pipeline(SETTINGS, store, lambda r, why: None, Clock(START_MS + 3000 * 500 + 30 * 60_000))
    again.assign(store.partitions())
    for p, state in again.partitions.items():
        np.testing.assert_array_equal(state.ab[segments.field("mobile")],
                                      np.frombuffer(stored[p][segments.field("mobile")]))
    # The new process has harvested nothing itself: the curves come from the stored sums.
    assert not again.position_bias.tables.segments.tables
    again.look_at_position_bias(estimate_here=True)
    assert again.position_bias.segment_curves == bias.segment_curves
    # A replica without partition 0 reads them with the look.
    other = Pipeline(SETTINGS, store, lambda r, why: None, Clock(START_MS))
    other.look_at_position_bias(estimate_here=False)
    assert other.position_bias.segment_curves == bias.segment_curves


def test_a_previous_version_reads_the_segment_fields_as_another_experiments(harvested):
    _, store, _ = harvested
    stored = store.load_ab(store.partitions())
    fields = {f for fs in stored.values() for f in fs if segments.segment_of(f) is not None}
    assert fields
    for p, fs in stored.items():
        for f in fields & set(fs):
            assert ab_problem(f, fs[f]) is None  # loaded, not counted unreadable
    # (Review s10 L2) the previous version (main before this branch) reads each field's first
    # part as an experiment's name: {"propensity-segment"} (/tmp/rev_s10/s5_prev.py ran its
    # arm_vectors). Pinned here: a name without "@" matches neither `phases.notes` (a stored
    # name `<prefix>...@...@...`) nor `final.applied` (`<comparison>@...`), so it is ignored.
    assert {f.split("\x1f", 1)[0] for f in fields} == {"propensity-segment"} and "@" not in segments.NAME


@pytest.mark.parametrize("corrupt", [np.nan, np.inf, 1e300])
def test_corrupt_stored_segment_sums_are_unreadable_dropped_and_rewritten(corrupt):
    """Review s10 M1: a partition's stored segment sums that are not finite or too large
    are counted, left out of the curve and stored anew from zero."""
    f, store, clock = segments.field("mobile"), MemoryStore(), Clock(START_MS)
    pipeline, bus = pipeline_on(store, clock)
    run(pipeline, bus, clock, 1500, 1, START_MS)
    good = np.frombuffer(store.ab[1][f]).copy()
    store.ab[1][f] = np.full(len(good), corrupt).tobytes()
    pipeline.revoke([0, 1])
    pipeline.assign([0, 1])  # as a restart: the state claimed from the store
    before = pipeline.unreadable.counts["experiment"]
    pipeline.look_at_position_bias(estimate_here=True)
    assert pipeline.unreadable.counts["experiment"] > before
    assert pipeline.position_bias.segment_curves.get("mobile", [1.0])[1:] != [1.0] * (K - 1)  # (1e300: flat)
    run(pipeline, bus, clock, 1500, 2, clock.ms + 1000)
    stored = np.frombuffer(store.ab[1][f])
    assert segments.unreadable(stored, K) is None and stored[K * K:].sum() > 0


@pytest.mark.parametrize("corrupt", ["negative", "clicks"])
def test_inconsistent_segment_totals_are_counted_and_left_out(corrupt):
    """Review s10 M1: a segment's sums over every partition that are negative or have more
    clicks than pairs give no curve (the global one), counted."""
    tables = fed(6000, 1, 0.4, min_pairs=300)
    total = tables.segments.tables["mobile"].sums.to_vector()
    assert segments.curves({"mobile": total}, K, 300) != {}
    bad = total.copy()
    if corrupt == "negative":
        bad[K * K + 1] = -5.0
    else:
        bad[1] = bad[K * K + 1] + 5.0
    assert segments.inconsistent(bad, K) is not None and segments.inconsistent(total, K) is None
    assert segments.curves({"mobile": bad}, K, 300) == {}


def test_the_segment_curve_series(harvested, promtool):  # noqa: F811 (the fixture)
    pipeline, _, _ = harvested
    text = Exporter(pipeline.readout, Health(), dict).render().decode()
    assert 'rankmeter_propensity_segment_curve{segment="mobile"} 1.0' in text
    assert 'rankmeter_propensity_segment_curve{segment="desktop"} 1.0' in text
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert "rankmeter_propensity_segment_curve" not in check.stdout + check.stderr


def test_the_segment_curve_series_is_0_when_the_curve_does_not_weigh(harvested):
    """Review s10 L1: 1 only while the segment's curve weighs: not with ubm chosen, nor with
    the debiased series withdrawn."""
    bias = harvested[0].position_bias
    look, curves = bias.tables.look, bias.tables.curves
    assert bias.segment_status == {"mobile": True, "desktop": True}
    try:
        for changed in (look._replace(model="ubm"), look._replace(reason="poor_fit")):
            bias.tables.looked(changed, curves)
            assert bias.segment_status == {"mobile": False, "desktop": False}
    finally:
        bias.tables.looked(look, curves)


def test_a_batchs_segment_sums_go_into_its_own_checkpoint():
    """Sent with the checkpoint of the batch that harvested them (as PAIRS), not one later."""
    from types import SimpleNamespace

    from rankmeter.debias.tables import vector_size
    from rankmeter.events.model import Impression
    from rankmeter.join import QueryRecord
    from rankmeter.pipeline.position_bias import PositionBias
    from rankmeter.pipeline.state import PAIRS, PartitionState

    state = PartitionState(1, {}, {}, {})
    state.pair_sums = np.zeros(vector_size(K))
    bias = PositionBias(SETTINGS, MemoryStore(), {0: state})
    records = {f"q{i}": QueryRecord(Impression(f"q{i}", "r", START_MS, ["a", "b"] if i % 2 else ["b", "a"],
                                               "mobile", query_hash="t"), segment_label="mobile", clicked=["a"])
               for i in range(8)}
    payload = SimpleNamespace(ab={})
    bias.harvest_into({0: records}, {0: payload})  # type: ignore[dict-item]
    f = segments.field("mobile")
    assert set(payload.ab) == {PAIRS, f} and not state.dirty_ab
    assert np.frombuffer(payload.ab[f]).tolist() == bias.tables.segments.tables["mobile"].sums.to_vector().tolist()
    assert np.frombuffer(payload.ab[f]).any()


def test_a_segments_debiased_ndcg_weighs_by_its_own_curve_and_another_by_the_global():
    """By hand (as tests/test_debias_pipeline.py's): the text's ideal DCG@10 is 1; d0 at
    rank 3, clicked, weighs 1 / p_3: 4 by the global curve (nDCG 2.0), 2 by mobile's own
    (p_3 = 0.5: nDCG 1.0); a desktop query, without a curve of its own, takes the global."""
    from rankmeter.events import query_hash
    from rankmeter.pipeline import IPW

    clock, bus = Clock(START_MS), Bus(partitions=1)
    pipeline = Pipeline(SETTINGS, MemoryStore(), lambda r, why: None, clock)
    bus.subscribe([SETTINGS.kafka.impressions_topic, SETTINGS.kafka.feedback_topic], pipeline.assign,
                  pipeline.revoke)
    pipeline.propensities = Propensities([1.0, 0.5, 0.25] + [0.1] * 7, [1000.0] * 10, 1)
    bias = pipeline.position_bias
    bias.tables.looked(bias.tables.look, {"mobile": [1.0, 0.5, 0.5] + [0.1] * 7})
    for _ in range(10):
        pipeline.harvester.observe(query_hash("tv"), ["d0", "d1", "d2"], {"d0"}, {"d0": 1.0})
    k = SETTINGS.kafka
    for qid, segment in (("qm", "mobile"), ("qd", "desktop")):
        bus.send(k.impressions_topic, qid.encode(), json.dumps(
            {"query_id": qid, "ranker": "r", "timestamp": START_MS, "results": ["d2", "d1", "d0"],
             "user_query": "tv", "segment": segment}).encode())
        bus.send(k.feedback_topic, qid.encode(), json.dumps(
            {"query_id": qid, "action": "click", "doc_id": "d0", "timestamp": START_MS + 1000,
             "event_id": f"{qid}d0"}).encode())
    pipeline.process(bus.poll(0, 100))
    value = {v.segment: v.sums[IPW + "nDCG@10"].macro() for v in pipeline.views() if v.window == "1h"}
    assert value["mobile"] == pytest.approx(1.0) and value["desktop"] == pytest.approx(2.0)


def test_a_negative_stored_pair_count_is_unreadable_dropped_and_rewritten():
    """Review s11: a pair count only grows (an eviction leaves the sums), so a partition's
    stored segment sums with a pair cell of -1e14 are corrupt; accepted, the holder kept
    adding to them and the segment's total was "negative" at every look, its curve off."""
    f, store, clock = segments.field("mobile"), MemoryStore(), Clock(START_MS)
    pipeline, bus = pipeline_on(store, clock)
    run(pipeline, bus, clock, 1500, 1, START_MS)
    hostile = np.frombuffer(store.ab[1][f]).copy()
    hostile[K * K + 1] = -1e14
    store.ab[1][f] = hostile.tobytes()
    pipeline.revoke([0, 1])
    pipeline.assign([0, 1])
    before = pipeline.unreadable.counts["experiment"]
    pipeline.look_at_position_bias(estimate_here=True)
    assert pipeline.unreadable.counts["experiment"] > before
    run(pipeline, bus, clock, 1500, 2, clock.ms + 1000)
    stored = np.frombuffer(store.ab[1][f])
    assert segments.unreadable(stored, K) is None and stored[K * K:].min() >= 0 and stored[K * K:].sum() > 0


@pytest.mark.parametrize("corrupt", ["nan", "inf", "1e300", "negative pairs"])
def test_corrupt_stored_global_pair_sums_are_unreadable_dropped_and_rewritten(corrupt):
    """Review s11: a partition's stored global sums (`PAIRS`) were taken on their length
    alone: one NaN cell made every look `implausible_propensities` for good (the holder
    added its deltas to it). Counted at the claim and at the look, left out, stored anew."""
    store, clock = MemoryStore(), Clock(START_MS)
    pipeline, bus = pipeline_on(store, clock)
    run(pipeline, bus, clock, 1500, 1, START_MS)
    pipeline.look_at_position_bias(estimate_here=True)
    assert pipeline.position_bias.look_result.reason == "ok"
    hostile = np.frombuffer(store.ab[1][PAIRS]).copy()
    hostile[K * K + 1] = {"nan": np.nan, "inf": np.inf, "1e300": 1e300, "negative pairs": -1e14}[corrupt]
    store.ab[1][PAIRS] = hostile.tobytes()
    before = pipeline.unreadable.counts["experiment"]
    pipeline.look_at_position_bias(estimate_here=True)  # read at the look: left out
    assert pipeline.unreadable.counts["experiment"] == before + 1
    assert pipeline.position_bias.look_result.reason == "ok"
    pipeline.revoke([0, 1])
    pipeline.assign([0, 1])  # claimed: counted, started afresh
    assert pipeline.unreadable.counts["experiment"] == before + 2
    run(pipeline, bus, clock, 1500, 2, clock.ms + 1000)
    stored = np.frombuffer(store.ab[1][PAIRS])
    assert np.isfinite(stored).all() and np.abs(stored).max() < 1e15 and stored[K * K:2 * K * K].min() >= 0
    assert stored[K * K:2 * K * K].sum() > 0
    pipeline.look_at_position_bias(estimate_here=True)
    assert pipeline.position_bias.look_result.reason == "ok"
    assert pipeline.unreadable.counts["experiment"] == before + 2
