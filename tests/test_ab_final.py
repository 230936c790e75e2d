"""do_not_ship is final within an experiment (review 7, F1.1): stored apart from the running
records (pipeline/final.py), so losing them (a restart, an unreadable record, a store put
back, another ab.mixture_scale: another state key) never turns it back into ship.

The statistics are ab/experiment.py's `look` replaced by one that behaves like it: its
stop-level record keeps a running upper end once below 0 (worse, as a running intersection
does), and without that record the same sums read better (the review's repro: the
treatment worse for its first queries, better after, ship once the record is lost)."""

from __future__ import annotations

import pytest

from rankmeter import config
from rankmeter.ab import declared
from rankmeter.ab.decision import decide
from rankmeter.ab.declared import Decision
from rankmeter.ab.experiment import ArmView, Comparison, Look
from rankmeter.ab.stats import Estimate, Running
from rankmeter.config import AB
from rankmeter.pipeline import experiments as pipeline_experiments
from rankmeter.pipeline import final
from rankmeter.source import Bus
from test_ab_pipeline import ENV, START_MS, an_experiment, feed, started

STOP = "P@10\x1fnew\x1f\x1fmacro\x1fstop"
BASE = "P@10\x1fnew\x1f\x1fmacro"  # the record holding the comparison's τ²
PRIMARY = {"RANKMETER_AB_PRIMARY": "P@10 increase"}


@pytest.fixture
def world(monkeypatch):
    """A pipeline with an experiment on P@10 whose first look finds the treatment worse."""
    state = {"worse": True}

    def look(experiment, baseline, vectors, names, settings, running, settled, *rest):
        record = running.get(STOP)
        worse = state["worse"] or (record is not None and float(record.split()[2]) < 0)
        stop = Running(1e-3, -0.05, -0.01) if worse else Running(1e-3, 0.01, 0.05)
        comparison = Comparison("P@10", "new", "", "macro", Estimate(0.02, 0.0, 1e-4), stop, 1e-4,
                                {"ship": stop, "stop": stop})
        arms = [ArmView("base", "", 1000, 500), ArmView("new", "", 1000, 500)]
        return Look(experiment, baseline, arms, [comparison], {"": 0.5}), {STOP: f"{stop.p_value!r} {stop.ci_lower!r} "
                                                                             f"{stop.ci_upper!r}"}

    monkeypatch.setattr(pipeline_experiments, "ab_look", look)
    settings, events, _, store, bus, pipeline = an_experiment(5, 200, partitions=3, **PRIMARY)
    feed(pipeline, bus, events)
    [d] = pipeline.ab_look().decisions
    assert d.decision == "do_not_ship"
    state["worse"] = False
    return store, pipeline


def _restarted(store, **env):
    """A new process on the same store (nothing saved in memory)."""
    settings = config.load(None, {**ENV, "RANKMETER_AB_START": str(START_MS), **PRIMARY, **env})
    return started(settings, store, Bus(partitions=3))


def _decision(pipeline):
    [d] = pipeline.ab_look().decisions
    return d.decision


def test_running_records_wiped_after_a_restart_still_do_not_ship(world):
    store, pipeline = world
    key = final.key(pipeline.experiments.phase.phase.comparison)
    assert final.since_ms(store.running[key]["new\x1f"]) is not None
    for k in [k for k in store.running if k != key]:
        store.running[k] = {}
    again = _restarted(store)
    look = again.ab_look()
    assert [d.decision for d in look.decisions] == ["do_not_ship"]
    assert any("do_not_ship since" in note for note in look.notes)
    assert _decision(again) == "do_not_ship"


def test_running_records_garbage_after_a_restart_still_do_not_ship(world):
    store, pipeline = world
    key = final.key(pipeline.experiments.phase.phase.comparison)
    for k in [k for k in store.running if k != key]:
        store.running[k] = {f: "garbage" for f in store.running[k]}
    again = _restarted(store)
    assert _decision(again) == "do_not_ship"
    assert again.unreadable.counts["experiment"] >= 1


def test_a_changed_mixture_scale_still_do_not_ship(world):
    store, pipeline = world
    again = _restarted(store, RANKMETER_AB_MIXTURE_SCALE="0.01")
    assert again.experiments.name == pipeline.experiments.name  # the same experiment, another state key
    assert _decision(again) == "do_not_ship"


def test_an_unreadable_final_value_keeps_running_with_a_note_never_ships(world):
    store, pipeline = world
    key = final.key(pipeline.experiments.phase.phase.comparison)
    for k in [k for k in store.running if k != key]:
        store.running[k] = {}
    for text in ("garbage", "do_not_ship ²", "do_not_ship " + "1" * 40, "ship 1"):
        store.running[key]["new\x1f"] = text
        again = _restarted(store)
        look = again.ab_look()
        assert [d.decision for d in look.decisions] == ["keep_running"], text
        assert any("stored final decision is unreadable" in note for note in look.notes)
        assert again.unreadable.counts["experiment"] == 1
        assert store.running[key]["new\x1f"] == text  # never overwritten: an operator removes it


def test_a_metric_not_compared_this_look_reads_its_stored_stop_record():
    """A rewind below ab.min_queries (or a metric with too few clicked queries) skips the
    comparison: a guardrail failed before still fails (not `waiting`), so no ship while a
    primary is better; and a primary's stored worse stop record is worse."""
    settings = AB(baseline="base", primary=["P@10 increase"], guardrails=["CTR 0.01"])
    at = declared.levels(declared.parse(settings.primary, settings.guardrails), settings.alpha)
    better = Running(1e-3, 0.01, 0.05)
    p10 = Comparison("P@10", "new", "", "macro", Estimate(0.02, 0.0, 1e-4), better, 1e-4,
                     {"ship": better, "stop": better})
    look = Look("e", "base", [ArmView("base", "", 1000, 500), ArmView("new", "", 1000, 500)], [p10], {"": 0.5})
    failed = {f"CTR\x1fnew\x1f\x1fmacro\x1fstop\x1f{at.stop!r}\x1f{1.0!r}": "0.001 -0.05 -0.02 0.0001"}
    [d] = decide(look, settings, failed)
    assert d.decision == "do_not_ship"
    assert [(r.declared.metric, r.outcome) for r in d.reasons] == [("P@10", "better"), ("CTR", "failed")]
    assert (d.reasons[1].lower, d.reasons[1].upper) == pytest.approx((-0.04, -0.01))  # + the margin 0.01
    [d] = decide(look, settings, {})  # without it CTR waits: keep_running
    assert d.decision == "keep_running" and d.reasons[1].outcome == "waiting"
    worse = {f"P@10\x1fnew\x1f\x1fmacro\x1fstop\x1f{at.stop!r}\x1f{1.0!r}": "0.001 -0.05 -0.02"}
    [d] = decide(look._replace(comparisons=[]), settings, worse)
    assert d.decision == "do_not_ship" and d.reasons[0].outcome == "worse"


def test_invalid_srm_still_replaces_a_stored_do_not_ship_and_it_is_written_once():
    stored = {"new\x1f": "do_not_ship 1000"}
    srm = Decision("new", "", "invalid_srm", ())
    assert final.apply([srm], stored, 5000) == ((srm,), {}, (), [])
    ship = Decision("new", "", "ship", ())
    [d], new, notes, bad = final.apply([ship], stored, 5000)
    assert (d.decision, new, bad) == ("do_not_ship", {}, []) and "since 1970-01-01T00:00:01Z" in notes[0]
    reached = Decision("new", "b", "do_not_ship", ())
    assert final.apply([reached], stored, 5000)[1] == {"new\x1fb": "do_not_ship 5000"}


def test_a_final_verdict_the_store_lost_is_stored_again():
    """Review (CUPED) F6: this process knew do_not_ship and the store was put back to an
    older copy without it: it is written again, not only remembered (a restart read ship)."""
    from rankmeter.ab.declared import Decision
    from rankmeter.pipeline import final
    from rankmeter.store import MemoryStore
    from rankmeter.unreadable import Unreadable

    store, k = MemoryStore(), final.key("base@1")
    saved = {k: {"new\x1f": "do_not_ship 1000"}}
    decisions, reached, _ = final.applied(store, Unreadable(), "base@1", "exp", saved, [Decision("new", "", "ship", ())], 5000)
    assert decisions[0].decision == "do_not_ship" and reached == {"new\x1f": "do_not_ship 1000"}
    store.save_running(k, reached)
    decisions, reached, _ = final.applied(store, Unreadable(), "base@1", "exp", {}, [Decision("new", "", "ship", ())], 6000)
    assert decisions[0].decision == "do_not_ship" and reached == {}


@pytest.mark.parametrize("env", [
    # CUPED review F4: a ramp (a new split from split_since) is a new experiment ...
    {"RANKMETER_AB_SPLIT": "base=0.9,new=0.1", "RANKMETER_AB_SPLIT_SINCE": str(START_MS + 60_000)},
    # ... F1.2: so is a redeclaration, even of α by 1e-7 ...
    {"RANKMETER_AB_ALPHA": "0.0499999"},
    {"RANKMETER_AB_GUARDRAILS": "CTR 0.05"},
    # ... and F5: turning CUPED on (the adjusted comparison is another test).
    {"RANKMETER_AB_CUPED": "true"},
])
def test_a_new_phase_of_the_same_comparison_still_does_not_ship(world, env):
    """The stored do_not_ship belongs to the baseline and ab.start: the next experiment of
    the same comparison, whose fresh sequences read better, does not ship the treatment."""
    store, pipeline = world
    again = _restarted(store, **env)
    assert again.experiments.name != pipeline.experiments.name  # a new experiment
    look = again.ab_look()
    assert [d.decision for d in look.decisions] == ["do_not_ship"]
    assert any("do_not_ship since" in note and "ab.start" in note for note in look.notes)


def test_a_new_ab_start_starts_over(world):
    store, _ = world
    again = _restarted(store, RANKMETER_AB_START=str(START_MS + 1))
    assert _decision(again) == "ship"


def test_turning_cuped_on_is_a_new_experiment_with_a_note(world):
    store, pipeline = world
    again = _restarted(store, RANKMETER_AB_CUPED="true")
    assert again.experiments.name == pipeline.experiments.name + "+cuped"
    notes = again.experiments.phase.notes([pipeline.experiments.name, again.experiments.name])
    assert [n for n in notes if "ab.cuped or ab.cuped_covariate changed in this phase (now cuped)" in n]
    assert not [n for n in notes if "declared" in n]
    user = _restarted(store, RANKMETER_AB_CUPED="true", RANKMETER_AB_UNIT="user", RANKMETER_AB_CUPED_COVARIATE="user")
    assert user.experiments.name.endswith("+cuped-user")
    # Review 3, H3: other buckets are another table and other means: another experiment.
    buckets = _restarted(store, RANKMETER_AB_CUPED="true", RANKMETER_AB_CUPED_BUCKETS="4096")
    assert buckets.experiments.name.endswith("+cuped-b4096")


def test_a_final_verdict_an_earlier_release_stored_under_the_experiment_still_holds(world):
    store, pipeline = world
    scope = final.key(pipeline.experiments.phase.phase.comparison)
    store.running[final.key(pipeline.experiments.name)] = store.running.pop(scope)
    for k in [k for k in store.running if "|final" not in k]:
        store.running[k] = {}
    again = _restarted(store)
    assert _decision(again) == "do_not_ship"
    assert final.since_ms(store.running[scope]["new\x1f"]) is not None  # stored under the comparison now


@pytest.fixture
def shipping(monkeypatch):
    """The fake look of `world`, the treatment better from the first look: ship."""
    state = {"worse": False}

    def look(experiment, baseline, vectors, names, settings, running, settled, *rest):
        worse = state["worse"]
        stop = Running(1e-3, -0.05, -0.01) if worse else Running(1e-3, 0.01, 0.05)
        comparison = Comparison("P@10", "new", "", "macro", Estimate(0.02, 0.0, 1e-4), stop, 1e-4,
                                {"ship": stop, "stop": stop})
        arms = [ArmView("base", "", 1000, 500), ArmView("new", "", 1000, 500)]
        return Look(experiment, baseline, arms, [comparison], {"": 0.5}), {STOP: "0.001 0.01 0.05 0.0001",
                                                                             BASE: "0.001 0.01 0.05 0.0001",
                                                                             "CTR\x1fnew\x1f\x1fmicro": "0.5 -1 1 0.1",
                                                                             "srm\x1f": "0.5 -inf inf"}

    monkeypatch.setattr(pipeline_experiments, "ab_look", look)
    settings, events, _, store, bus, pipeline = an_experiment(5, 200, partitions=3, **PRIMARY)
    feed(pipeline, bus, events)
    assert _decision(pipeline) == "ship"
    return store, pipeline, state


def test_an_unreadable_running_record_never_ships_again_but_can_stop(shipping):
    """Review (CUPED): before do_not_ship, an unreadable running record made its comparison
    begin again with a τ² fixed from data already seen, and ship on it. Now the treatment
    is stored no_ship: keep_running with a note, across restarts; do_not_ship still counts."""
    store, pipeline, worse = shipping
    state = next(k for k in store.running if "|alpha=" in k)
    store.running[state][BASE] = "garbage"
    again = _restarted(store)
    look = again.ab_look()
    assert [d.decision for d in look.decisions] == ["keep_running"]
    assert any("running statistics were unreadable" in note for note in look.notes)
    scope = final.key(again.experiments.phase.phase.comparison)
    assert final.parsed(store.running[scope]["new\x1f"])[0] == "no_ship"
    latest = _restarted(store)
    assert _decision(latest) == "keep_running"  # (the record is readable again: still no ship)
    worse["worse"] = True
    assert _decision(latest) == "do_not_ship"
    assert final.since_ms(store.running[scope]["new\x1f"]) is not None


def test_no_ship_applied():
    ship, stop = Decision("new", "", "ship", ()), Decision("new", "", "do_not_ship", ())
    [d], new, notes, bad = final.apply([ship], {}, 5000, lost={"new\x1f"})
    assert (d.decision, new, bad) == ("keep_running", {"new\x1f": "no_ship 5000"}, []) and notes
    [d], new, _, _ = final.apply([ship], {"new\x1f": "no_ship 1000"}, 5000)
    assert (d.decision, new) == ("keep_running", {})
    [d], new, _, _ = final.apply([stop], {"new\x1f": "no_ship 1000"}, 5000)
    assert (d.decision, new) == ("do_not_ship", {"new\x1f": "do_not_ship 5000"})
    undeclared = Decision("new", "", "undeclared", ())
    assert final.apply([undeclared], {}, 5000, lost={"new\x1f"})[1] == {}


@pytest.mark.parametrize("field, stops", [
    (STOP, False),                          # a test record: τ² is in the base record, still valid
    ("CTR\x1fnew\x1f\x1fmicro", False),     # an exploratory metric's: not the decision's
    ("srm\x1f", True),                      # the SRM's: a mismatch it had found would be forgotten
])
def test_which_unreadable_records_store_no_ship(shipping, field, stops):
    """Review (final) F5/F7/F10: only a record the decision needs and cannot rebuild."""
    store, _, _ = shipping
    state = next(k for k in store.running if "|alpha=" in k)
    store.running[state][field] = "garbage"
    assert _decision(_restarted(store)) == ("keep_running" if stops else "ship")


def test_a_stored_do_not_ship_of_an_earlier_release_under_an_earlier_name_holds(world):
    """Review (final) F1: an earlier release stored it under the name of the experiment that
    reached it; upgraded, the experiment's name gains +cuped: read under every stored name
    of the comparison."""
    store, pipeline = world
    scope = final.key(pipeline.experiments.phase.phase.comparison)
    store.running[final.key(pipeline.experiments.name)] = store.running.pop(scope)
    again = _restarted(store, RANKMETER_AB_CUPED="true")
    assert _decision(again) == "do_not_ship"
    assert final.since_ms(store.running[scope]["new\x1f"]) is not None


def test_the_strongest_stored_value_wins_across_keys_and_an_unreadable_one_is_logged_where_it_is():
    from rankmeter.store import MemoryStore
    from rankmeter.unreadable import Unreadable
    store, unreadable = MemoryStore(), Unreadable()
    store.save_running("base@1|final", {"new\x1f": "no_ship 5", "b\x1f": "garbage"})
    store.save_running("base@1@1@x|final", {"new\x1f": "do_not_ship 7", "c\x1f": "junk"})
    ds = [Decision(t, "", "ship", ()) for t in ("new", "b", "c")]
    decisions, reached, _ = final.applied(store, unreadable, "base@1", ["base@1@1@x", "other@1@1@x"], {}, ds, 9)
    assert [d.decision for d in decisions] == ["do_not_ship", "keep_running", "keep_running"]
    assert reached == {"new\x1f": "do_not_ship 7"}
    assert unreadable.counts["experiment"] == 2


@pytest.mark.parametrize("text", ["do_not_ship 253402300800000", "no_ship 9999999999999999999"])
def test_a_time_past_the_printable_dates_is_unreadable_not_a_crash(text):
    [d], _, notes, bad = final.apply([Decision("new", "", "ship", ())], {"new\x1f": text}, 5)
    assert d.decision == "keep_running" and bad == ["new\x1f"]


def test_a_new_phase_without_arms_yet_keeps_the_stored_do_not_ship():
    """Review (final) F12: between a ramp and the new phase's first impressions there is no
    arm, so no decision: the do_not_ship alert would resolve."""
    from rankmeter.store import MemoryStore
    from rankmeter.unreadable import Unreadable
    store = MemoryStore()
    store.save_running("base@1|final", {"new\x1fmobile": "do_not_ship 5"})
    decisions, _, _ = final.applied(store, Unreadable(), "base@1", [], {}, [], 9, declared=True)
    assert [(d.treatment, d.segment, d.decision) for d in decisions] == [("new", "mobile", "do_not_ship")]
    assert final.applied(store, Unreadable(), "base@1", [], {}, [], 9)[0] == ()


def _state_and_marks(store):
    state = next(k for k in store.running if "|alpha=" in k)
    return state, next(k for k in store.running if k.endswith("|tested"))


def test_marks_name_only_the_records_the_decision_cannot_rebuild(shipping):
    """Review 3 M3: what a look saved is marked, after it is stored: the τ²-holding base
    record and the SRM's, not a test level's or an exploratory metric's."""
    store, _, _ = shipping
    state, marks = _state_and_marks(store)
    assert set(store.running[marks]) == {BASE, "srm\x1f"}
    assert set(store.running[marks]) <= set(store.running[state])


@pytest.mark.parametrize("field, stops", [
    (BASE, True),                           # its τ² would be fixed again from data already seen
    ("srm\x1f", True),                      # a mismatch it had found would be forgotten
    (STOP, False),                          # a test level: τ² is in the base record
    ("CTR\x1fnew\x1f\x1fmicro", False),     # an exploratory metric's
])
def test_a_record_missing_after_a_restart_never_ships(shipping, field, stops):
    """Review 3 M3: a record the store lost with no process remembering it (evicted,
    deleted, a restore older than it, then a restart) began again silently and shipped."""
    store, pipeline, _ = shipping
    state, _ = _state_and_marks(store)
    del store.running[state][field]
    again = _restarted(store)
    look = again.ab_look()
    assert [d.decision for d in look.decisions] == ["keep_running" if stops else "ship"]
    assert again.experiments.records.lost == (1 if stops else 0)
    if stops:
        scope = final.key(again.experiments.phase.phase.comparison)
        assert final.parsed(store.running[scope]["new\x1f"])[0] == "no_ship"
        assert _decision(_restarted(store)) == "keep_running"  # saved again since: still no ship


def test_a_changed_mixture_scale_begins_records_again_and_never_ships(shipping):
    """Another ab.mixture_scale is another state key: every marked record is missing there
    (its τ² would be chosen again after the data was seen)."""
    store, pipeline, _ = shipping
    again = _restarted(store, RANKMETER_AB_MIXTURE_SCALE="0.01")
    assert again.experiments.name == pipeline.experiments.name
    assert _decision(again) == "keep_running"


def test_records_and_marks_both_gone_begin_again(shipping):
    """The limit: a store that lost the marks too (a restore older than the first look)
    knows of nothing tested; the test begins again, as a new one."""
    store, _, _ = shipping
    state, marks = _state_and_marks(store)
    store.running[state], store.running[marks] = {}, {}
    assert _decision(_restarted(store)) == "ship"


def test_a_record_lost_is_counted_once_and_its_no_ship_stored_again_if_that_is_lost_too(shipping, caplog):
    """Review (session 10) M2: a marked record that stayed missing was counted and logged
    at every look; M1: once it was saved again, a lost no_ship let the treatment ship."""
    store, _, _ = shipping
    state, marks = _state_and_marks(store)
    del store.running[state][BASE]
    again = _restarted(store)
    for _ in range(4):
        assert _decision(again) == "keep_running"
    # (`lost` also counts the fake look's records read back in another spelling: the log says which)
    assert sum("a look had saved" in r.getMessage() for r in caplog.records) == 1
    assert store.running[marks][BASE].startswith("lost ")
    scope = final.key(again.experiments.phase.phase.comparison)
    del store.running[scope]["new\x1f"]          # the no_ship lost too (evicted, another shard)
    latest = _restarted(store)
    assert _decision(latest) == "keep_running"
    assert sum("a look had saved" in r.getMessage() for r in caplog.records) == 1
    assert final.parsed(store.running[scope]["new\x1f"])[0] == "no_ship"


def test_marks_are_written_after_the_records_and_read_before_them(shipping, monkeypatch):
    """Review (session 10) L1/L2: a reader between the two writes must never see a mark
    without its record."""
    store, pipeline, _ = shipping
    order = []
    save, load = store.save_running, store.load_running
    monkeypatch.setattr(store, "save_running", lambda k, *a, **kw: order.append(("save", k)) or save(k, *a, **kw))
    monkeypatch.setattr(store, "load_running", lambda k: order.append(("load", k)) or load(k))
    state, marks = _state_and_marks(store)
    del store.running[marks][BASE]   # (so that this look writes the marks again)
    pipeline.ab_look()
    assert order.index(("load", marks)) < order.index(("load", state))
    assert order.index(("save", state)) < order.index(("save", marks))
