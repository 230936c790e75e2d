"""An experiment's identity (issue 20): a ramp of `ab.split` is a new phase whose sums hold
only impressions shown since it took effect, a release that computes one more signal goes
on with the same experiment (the signal is compared from the next phase), a stored
definition the store lost or cannot read is restored, τ² is fixed per metric at its first
look, and an interleaving experiment is keyed by alpha, τ² and its start."""

from __future__ import annotations

import json

import pytest

from rankmeter import config
from rankmeter.ab import identity
from rankmeter.ab import report as ab_report
from rankmeter.ab.stats import INTERLEAVING_TAU2, MeanSums, Running, msprt, unit_variance
from rankmeter.engine import online
from rankmeter.exporter import Exporter
from rankmeter.pipeline import Pipeline, layouts
from rankmeter.source import Bus
from rankmeter.store import MemoryStore

from test_ab_pipeline import ENV, NOW_MS, NOW_S, START_MS, an_experiment, feed, started

RAMPED = "base=0.9,new=0.1"


def settings_with(**env: str) -> config.Settings:
    return config.load(None, {**ENV, "RANKMETER_AB_START": str(START_MS), **env})


def reader(settings: config.Settings, store: MemoryStore) -> Pipeline:
    """What `rankmeter report --ab` does: a read-only pipeline over the stored state."""
    pipeline = Pipeline(settings, store, lambda r, why: None, lambda: NOW_S)
    pipeline.assign(store.partitions(), claim=False)
    return pipeline


def shown(events, since_ms: int) -> int:
    return sum(1 for stream, _, e in events if stream == "impressions" and e["timestamp"] >= since_ms)


def queries(look) -> float:
    return sum(a.queries for a in look.arms)


def test_a_ramp_is_a_new_phase_of_the_impressions_shown_since_it_took_effect():
    first_settings, events, _, store, bus, first = an_experiment(7, 400, partitions=2)
    half = len(events) // 2
    feed(first, bus, events[:half])
    first_look = first.ab_look()
    assert queries(first_look) == shown(events[:half], START_MS)

    since = START_MS + 240_000
    ramped = settings_with(RANKMETER_AB_SPLIT=RAMPED, RANKMETER_AB_SPLIT_SINCE=str(since))
    second = started(ramped, store, bus)
    feed(second, bus, events[half:])
    look = second.ab_look()
    # By when an impression was shown, not when it was read: the backlog of the 50/50 phase
    # (shown before `since`, read after the ramp) is in neither phase's new sums.
    assert queries(look) == shown(events[half:], since) < len(events[half:])
    assert look.experiment != first_look.experiment and (look.split, look.since_ms) == (RAMPED, since)
    assert (first_look.split, first_look.since_ms) == ("base=0.5,new=0.5", START_MS)
    # The 50/50 phase stays in the store as it was when the ramp began.
    old = reader(first_settings, store).ab_look(save=False)
    assert old.experiment == first_look.experiment and old.arms == first_look.arms
    # Back to 50/50 later: a third phase, not the first one resumed.
    back = reader(settings_with(RANKMETER_AB_SPLIT_SINCE=str(since + 60_000)), store).experiments.name
    assert back not in (first_look.experiment, look.experiment)


def test_one_split_written_two_ways_is_one_phase():
    a, b = settings_with(RANKMETER_AB_SPLIT="base=50,new=50"), settings_with(RANKMETER_AB_SPLIT="new=0.5,base=0.5")
    layout = layouts.layout_for(a, debiased=False)
    phase_a, phase_b = identity.phase(a.ab), identity.phase(b.ab)
    assert phase_a == phase_b and phase_a.split == "base=0.5,new=0.5"
    assert phase_a.name(layout) == phase_b.name(layout)
    ramped = identity.phase(settings_with(RANKMETER_AB_SPLIT=RAMPED).ab)
    assert ramped.name(layout) != phase_a.name(layout)
    assert identity.phase(settings_with(RANKMETER_AB_SPLIT="").ab).split == "-"


def test_a_split_changed_without_a_new_since_is_said_in_the_report():
    settings, events, _, store, bus, first = an_experiment(3, 300, partitions=1)
    feed(first, bus, events[:200])
    assert first.ab_look().notes == ()
    second = started(settings_with(RANKMETER_AB_SPLIT=RAMPED), store, bus)
    feed(second, bus, events[200:])
    look = second.ab_look()
    [note] = look.notes
    assert "ab.split changed without a new ab.split_since" in note
    table = ab_report.table(look, 0.05)
    assert f"phase: split {RAMPED}, unit query, impressions since " in table and f"note: {note}" in table


def test_a_unit_changed_or_a_fleet_on_two_units_is_said_in_the_report():
    settings, events, _, store, bus, first = an_experiment(3, 300, partitions=1)
    feed(first, bus, events[:200])
    second = started(settings_with(RANKMETER_AB_UNIT="user"), store, bus)
    users = [(stream, key, {**e, "client_id": f"u{i % 40}"} if stream == "impressions" else e)
             for i, (stream, key, e) in enumerate(events[200:])]
    feed(second, bus, users)
    look = second.ab_look()
    [note] = look.notes
    assert "the same phase is stored with ab.unit query too" in note
    assert first.ab_look().notes == (note.replace("ab.unit query", "ab.unit user"),)


def test_a_release_computing_one_more_signal_goes_on_with_the_experiment(monkeypatch):
    settings, events, *_ = an_experiment(11, 600, partitions=2)
    store, bus, cut = MemoryStore(), Bus(partitions=2), len(events) // 2
    # The previous release: one online signal fewer in what it computes and stores.
    monkeypatch.setattr(layouts, "ONLINE_SIGNALS", online.ONLINE_SIGNALS[:-1])
    monkeypatch.setattr(online, "ONLINE_MEASURES", online.ONLINE_MEASURES[:-1])
    old = started(settings, store, bus)
    feed(old, bus, events[:cut])
    before = old.ab_look()
    added = online.ONLINE_SIGNALS[-1]
    monkeypatch.undo()
    assert added not in {c.metric for c in before.comparisons}

    new = started(settings, store, bus)   # the same configuration on the newer release
    assert new.ab_layout.fingerprint != old.ab_layout.fingerprint
    feed(new, bus, events[cut:])
    look = new.ab_look()
    assert look.experiment == before.experiment == new.experiments.name
    assert queries(look) == shown(events, START_MS)   # carried: every impression since the start
    # The signal the new release adds is not compared in this experiment (its population
    # would be the queries that happened to get feedback after the upgrade), and it says so.
    assert added not in {c.metric for c in look.comparisons}
    assert any(added in n and "added after the experiment began" in n for n in look.notes)
    # The shared measures' sums equal those of one release over the whole stream.
    _, _, _, _, whole_bus, whole = an_experiment(11, 600, partitions=2)
    feed(whole, whole_bus, events)
    reference = {(c.metric, c.ranker, c.average): c.estimate for c in whole.ab_look().comparisons}
    got = {(c.metric, c.ranker, c.average): c.estimate for c in look.comparisons}
    assert set(got) == {k for k in reference if k[0] != added}
    for key, estimate in got.items():
        assert estimate.delta == pytest.approx(reference[key].delta, abs=1e-12)
        assert estimate.variance == pytest.approx(reference[key].variance, rel=1e-9)
    # The running statistics went on (tightened, never restarted).
    p10 = next(c for c in before.comparisons if (c.metric, c.average) == ("P@10", "macro"))
    now = next(c for c in look.comparisons if (c.metric, c.average) == ("P@10", "macro"))
    assert now.running.p_value <= p10.running.p_value and now.tau2 == p10.tau2
    assert p10.running.ci_lower <= now.running.ci_lower and now.running.ci_upper <= p10.running.ci_upper


def test_a_definition_the_store_lost_is_stored_back_and_an_unreadable_one_is_replaced():
    settings, events, _, store, bus, pipeline = an_experiment(5, 300, partitions=2)
    feed(pipeline, bus, events[:300])
    name = pipeline.experiments.name
    written = store.definitions[name]
    assert json.loads(written) == list(pipeline.ab_layout.ids)
    del store.definitions[name]            # lost
    pipeline.assign([0, 1])                # a claim reads it again: stored back from memory
    assert store.definitions[name] == written
    store.definitions[name] = "\x00 not json"
    fresh = started(settings, store, bus)  # a replica that never held it: replaced, counted
    assert store.definitions[name] == written
    assert fresh.unreadable.counts["experiment"] == 1
    feed(fresh, bus, events[300:])
    assert queries(fresh.ab_look()) == shown(events, START_MS)


def test_tau2_is_fixed_per_metric_at_its_first_look():
    settings, events, _, store, bus, pipeline = an_experiment(13, 800, partitions=1)
    feed(pipeline, bus, events[:500])
    first = {(c.metric, c.average): c for c in pipeline.ab_look().comparisons}
    arms = {a.ranker: a for a in pipeline.ab_look().arms}
    assert arms
    rank = first[("FirstClickRank", "macro")]
    ctr = first[("CTR", "macro")]
    # Scaled to each metric's own variance: a rank's τ² is not a [0, 1] measure's.
    assert rank.tau2 > 10 * ctr.tau2
    feed(pipeline, bus, events[500:])
    later = {(c.metric, c.average): c for c in pipeline.ab_look().comparisons}
    assert all(later[k].tau2 == c.tau2 for k, c in first.items())   # never re-estimated as it runs
    # A fresh reader of the store tests with the same τ²: it is stored with the statistics.
    again = {(c.metric, c.average): c.tau2 for c in reader(settings, store).ab_look(save=False).comparisons}
    assert again == {k: c.tau2 for k, c in later.items()}
    fixed = reader(settings_with(RANKMETER_AB_MIXTURE_VARIANCE="0.0004"), store).ab_look(save=False)
    assert {c.tau2 for c in fixed.comparisons} == {0.0004}


def test_unit_variance_is_the_pooled_sample_variance():
    t, c = MeanSums(3, 6.0, 14.0), MeanSums(2, 1.0, 1.0)   # values 1, 2, 3 and 0, 1
    assert unit_variance(t, c) == pytest.approx(1.3)        # statistics.variance([1, 2, 3, 0, 1])


def interleaved(qid: str, at_ms: int, clicked: str) -> list:
    results, teams = ["a", "b", "c", "d"], ["T", "D", "D", "T"]
    return [("impressions", qid, {"query_id": qid, "ranker": "il", "timestamp": at_ms, "results": results,
                                  "interleaving": {"experiment": "e", "teams": teams}}),
            ("feedback", qid, {"query_id": qid, "action": "click", "doc_id": clicked, "timestamp": at_ms + 1000})]


def test_an_interleaving_name_used_again_with_a_new_start_is_a_new_experiment():
    store, bus = MemoryStore(), Bus(partitions=2)
    env = {"RANKMETER_AB_MIN_QUERIES": "20"}
    first = started(config.load(None, env), store, bus)
    feed(first, bus, [e for q in range(400) for e in interleaved(f"old{q}", NOW_MS - 600_000, "ab"[q % 4 == 0])])
    first.ab_look()
    [old] = first.interleaving_result
    assert (old.wins_a, old.wins_b) == (100, 300) and old.running.ci_upper < 0   # T (team B) preferred

    restart = NOW_MS - 60_000
    second = started(config.load(None, {**env, "RANKMETER_AB_INTERLEAVING_START": str(restart)}), store, bus)
    feed(second, bus, [e for q in range(20) for e in interleaved(f"late{q}", restart - 1000, "a")]   # before it
         + [e for q in range(30) for e in interleaved(f"new{q}", restart, "ba"[q % 6 == 0])])           # D wins
    second.ab_look()
    [r] = second.interleaving_result
    assert (r.experiment, r.wins_a, r.wins_b, r.ties) == ("e", 25, 5, 0)   # none of the old counts
    assert r.running.ci_upper > 0      # its own running statistics: not intersected with the old run's (< 0)
    # The old run is still there, for a reader without the new start.
    old_reader = reader(config.load(None, env), store)
    old_reader.ab_look(save=False)
    [kept] = old_reader.interleaving_result
    assert (kept.wins_a, kept.wins_b) == (100, 300)


def test_interleaving_running_statistics_are_keyed_by_alpha_tau2_and_start():
    store, bus = MemoryStore(), Bus(partitions=1)
    pipeline = started(config.load(None, {"RANKMETER_AB_MIN_QUERIES": "20"}), store, bus)
    feed(pipeline, bus, [e for q in range(100) for e in interleaved(f"q{q}", NOW_MS - 600_000, "ab"[q % 4 == 0])])
    pipeline.ab_look()
    key = f"interleaving|alpha=0.05|tau2={INTERLEAVING_TAU2}|start="
    assert [k for k in store.running if k.startswith("interleaving")] == [key]
    wider = reader(config.load(None, {"RANKMETER_AB_MIN_QUERIES": "20", "RANKMETER_AB_ALPHA": "0.01"}), store)
    wider.ab_look(save=False)
    [r] = wider.interleaving_result
    [kept] = store.running[key].values()
    # Its own, wider sequence: not intersected with the one kept for alpha 0.05.
    assert r.running.ci_lower < float(kept.split()[1]) and r.running.ci_upper > float(kept.split()[2])


def test_the_phase_and_each_comparisons_tau2_are_exported():
    settings, events, _, store, bus, pipeline = an_experiment(2, 300, partitions=1)
    feed(pipeline, bus, events)
    pipeline.ab_look()
    text = Exporter(pipeline.readout, health=None, lag=dict).render().decode()  # type: ignore[arg-type]
    name = pipeline.experiments.name
    assert (f'rankmeter_ab_experiment_info{{baseline="base",experiment="{name}",since="{START_MS}",'
            f'split="base=0.5,new=0.5",unit="query"}} 1.0') in text
    assert 'rankmeter_ab_mixture_variance{average="macro",baseline="base",metric="P@10"' in text


@pytest.mark.parametrize(("setting", "value", "problem"), [
    ("SPLIT_SINCE", str(START_MS - 1), "must not be before it"),
    ("SPLIT_SINCE", "2026-12-01T09:00:00", "no time zone"),
    ("INTERLEAVING_START", "yesterday", "neither epoch milliseconds nor an RFC 3339 time"),
    ("MIXTURE_SCALE", "0", "ab.mixture_scale: must be a number > 0"),
    ("MIXTURE_SCALE", "nan", "ab.mixture_scale: must be a number > 0"),
    ("MIXTURE_VARIANCE", "inf", "ab.mixture_variance: must be a number >= 0"),
])
def test_phase_settings_are_checked(setting: str, value: str, problem: str):
    with pytest.raises(config.ConfigError, match=problem):
        settings_with(**{f"RANKMETER_AB_{setting}": value})


def test_a_tau2_per_metric_is_fixed_only_once_the_first_queries_have_their_clicks():
    # Read before the clicks arrive, a click metric's variance is nearly 0 and so would be
    # its τ² (the test nearly blind for good: bench/ab_validity.py --feedback-lag). By
    # default a τ² is fixed twice the attribution window (with the grace: 70 min) after the
    # phase's start; the experiment began 10 minutes ago.
    settings, events, _, store, bus, pipeline = an_experiment(4, 400, partitions=2, RANKMETER_AB_MIXTURE_AFTER="")
    feed(pipeline, bus, events)
    early = pipeline.ab_look()
    assert min(a.queries for a in early.arms) >= settings.ab.min_queries and early.comparisons == []
    assert early.notes == ("no statistics before 2027-01-15T09:00:00Z: a metric's mixture variance is fixed once "
                           "the phase's first queries have their clicks (ab.mixture_after)",)
    kept = store.load_running(f"{early.experiment}|alpha=0.05|tau2=scale=0.001")
    assert list(kept) == ["srm\x1f"]  # the sample-ratio test runs; no comparison's τ² is fixed
    # 70 minutes on, by the clock; but what has been read ends 10 minutes in (a consumer
    # behind): still waiting. Once every partition has read impressions and clicks past
    # it, the τ² are fixed; `rankmeter report` (a read-only look) fixes none of its own.
    later_s = START_MS / 1000 + 71 * 60
    later = Pipeline(settings, store, lambda r, why: None, lambda: later_s)
    bus.subscribe([settings.kafka.impressions_topic, settings.kafka.feedback_topic], later.assign, later.revoke)
    assert later.ab_look().comparisons == []
    assert reader(settings, store).ab_look(save=False).comparisons == []
    t = int(later_s * 1000) - 1000
    feed(later, bus, [e for q in range(40) for e in (
        ("impressions", f"late{q}", {"query_id": f"late{q}", "ranker": ("base", "new")[q % 2], "timestamp": t,
                                     "results": ["d1", "d2"]}),
        ("feedback", f"late{q}", {"query_id": f"late{q}", "action": "click", "doc_id": "d1", "timestamp": t + 500}))])
    look = later.ab_look()
    assert look.comparisons and all(c.tau2 > 0 for c in look.comparisons)
    assert {c.tau2 for c in reader(settings, store).ab_look(save=False).comparisons} == {c.tau2 for c in look.comparisons}
    # A configured τ² is no estimate: it is tested from the first look.
    configured = settings_with(RANKMETER_AB_MIXTURE_AFTER="", RANKMETER_AB_MIXTURE_VARIANCE="1e-4")
    assert {c.tau2 for c in reader(configured, store).ab_look(save=False).comparisons} == {1e-4}


DECLARED = {"RANKMETER_AB_PRIMARY": "nDCG@10 increase,AP increase", "RANKMETER_AB_GUARDRAILS": "P@10 0.05"}


def test_a_declaration_changed_between_looks_is_a_new_experiment_with_fresh_records():
    """Review F4: a primary dropped after a look at the data (its α/k doubles) on the same
    stream. Before, the name stayed and the new levels' records were fitted to the whole
    experiment's sums, with no note."""
    settings, events, _, store, bus, first = an_experiment(3, 300, partitions=1, **DECLARED)
    feed(first, bus, events[:200])
    before = first.ab_look()
    assert before.notes == () and [d.decision for d in before.decisions] == ["keep_running"]
    old_records = {k: dict(v) for k, v in store.running.items() if k.startswith(before.experiment + "|alpha=")}
    [old_records] = old_records.values()
    # Written another way, the same declaration is the same experiment.
    same = settings_with(**{**DECLARED, "RANKMETER_AB_PRIMARY": "AP macro increase, nDCG@10 increase"})
    assert reader(same, store).experiments.name == before.experiment

    redeclared = settings_with(**{**DECLARED, "RANKMETER_AB_PRIMARY": "AP increase"})
    second = started(redeclared, store, bus)
    feed(second, bus, events[200:])
    look = second.ab_look()
    measures_tag = before.experiment.rsplit("+", 1)[0]
    assert look.experiment != before.experiment and look.experiment.startswith(measures_tag + "+")
    assert queries(look) == shown(events[200:], START_MS) < shown(events, START_MS)   # fresh sums
    [note] = look.notes
    assert "the declared decision changed" in note and f"note: {note}" in ab_report.table(look, 0.05)
    # No record of the first declaration is carried: the new experiment's sequences are one
    # look's, at its own levels (AP alone: α/k = 0.05), and the old records are untouched.
    state = {n: next(k for k in store.running if k.startswith(n + "|alpha=")) for n in (before.experiment, look.experiment)}
    assert store.running[state[before.experiment]] == old_records
    ap = next(c for c in look.comparisons if (c.metric, c.average) == ("AP", "macro"))
    assert ap.tests["ship"] == Running(*msprt(ap.estimate, ap.tau2, 0.05))
    assert not any("nDCG@10" in field and "\x1fship\x1f" in field for field in store.running[state[look.experiment]])
    # Undeclared, the name is the one it had before declarations existed (no "+…").
    assert reader(settings_with(), store).experiments.name == measures_tag
