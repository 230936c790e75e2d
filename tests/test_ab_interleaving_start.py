"""Interleaving without `ab.interleaving_start` (review of issue 20, F5): its counts are
keyed by the A/B experiment's start (ab.start), so a name reused under a new ab.start is
a new experiment; under `ab.unit: user` no interleaving p-value is claimed (the counts are
per query, and one user's queries are correlated)."""

from __future__ import annotations

from rankmeter import config
from rankmeter.ab.experiment import WITHDRAWN_BY_USER
from rankmeter.exporter import Exporter
from rankmeter.source import Bus
from rankmeter.store import MemoryStore

from test_ab_identity import interleaved, reader
from test_ab_pipeline import ENV, NOW_MS, feed, started


def test_a_name_reused_under_a_new_ab_start_is_a_new_interleaving_experiment():
    store, bus = MemoryStore(), Bus(partitions=2)
    old_start, new_start = NOW_MS - 900_000, NOW_MS - 60_000
    env = {**ENV, "RANKMETER_AB_START": str(old_start)}
    first = started(config.load(None, env), store, bus)
    feed(first, bus, [e for q in range(400) for e in interleaved(f"old{q}", NOW_MS - 600_000, "ab"[q % 4 == 0])])
    first.ab_look()
    [old] = first.interleaving_result
    assert (old.wins_a, old.wins_b) == (100, 300) and old.running.ci_upper < 0

    second = started(config.load(None, {**env, "RANKMETER_AB_START": str(new_start)}), store, bus)
    feed(second, bus, [e for q in range(20) for e in interleaved(f"late{q}", new_start - 1000, "a")]    # before it
         + [e for q in range(30) for e in interleaved(f"new{q}", new_start, "ba"[q % 6 == 0])])
    second.ab_look()
    [r] = second.interleaving_result
    assert (r.wins_a, r.wins_b, r.ties) == (25, 5, 0)   # none of the old counts, none before the start
    assert r.running.ci_upper > 0                        # its own running statistics
    old_reader = reader(config.load(None, env), store)  # the old experiment stays readable
    old_reader.ab_look(save=False)
    [kept] = old_reader.interleaving_result
    assert (kept.wins_a, kept.wins_b) == (100, 300)


def test_under_user_assignment_the_interleaving_p_value_is_withdrawn_with_its_reason():
    store, bus = MemoryStore(), Bus(partitions=1)
    env = {**ENV, "RANKMETER_AB_START": str(NOW_MS - 900_000)}
    events = [e for q in range(100) for e in interleaved(f"q{q}", NOW_MS - 600_000, "ab"[q % 4 == 0])]
    results = {}
    for unit in ("query", "user"):
        pipeline = started(config.load(None, {**env, "RANKMETER_AB_UNIT": unit}), store := MemoryStore(), bus := Bus(1))
        feed(pipeline, bus, events)
        pipeline.ab_look()
        [results[unit]] = pipeline.interleaving_result
        text = Exporter(pipeline.readout, health=None, lag=dict).render().decode()  # type: ignore[arg-type]
        assert ("rankmeter_interleaving_p_value{" in text) == (unit == "query"), unit
    assert results["query"].running is not None and results["query"].withdrawn == ""
    assert results["user"].running is None and results["user"].withdrawn == WITHDRAWN_BY_USER
    assert results["user"].estimate == results["query"].estimate   # the preference itself is still shown


def test_a_record_counted_by_an_older_release_never_takes_the_new_field_below_zero():
    """Review 9: a record whose outcome an older release counted under its own field (no
    field fixed in the record) changes outcome after the upgrade: the new field counts the
    new outcome and takes nothing away (it never counted the old one)."""
    from rankmeter.pipeline.experiments import INTERLEAVING

    store, bus = MemoryStore(), Bus(partitions=1)
    p = started(config.load(None, {**ENV, "RANKMETER_AB_START": str(NOW_MS - 900_000)}), store, bus)
    t = NOW_MS - 600_000
    imp = {"query_id": "q", "ranker": "il", "timestamp": t, "results": ["a", "b", "c", "d"],
           "interleaving": {"experiment": "e", "teams": ["T", "D", "D", "T"]}}
    feed(p, bus, [("impressions", "q", imp),
                  ("feedback", "q", {"query_id": "q", "action": "click", "doc_id": "b", "timestamp": t + 1000})])
    ps = p.experiments.held[0]
    record = ps.records["q"]
    assert record.interleaving_outcome == 0  # D wins
    new_field = record.ab_experiment
    old_field = new_field.rsplit("\x1f", 1)[0]  # the field without a start, as the older release wrote it
    ps.ab[old_field], record.ab_experiment = ps.ab.pop(new_field), ""
    feed(p, bus, [("feedback", "q", {"query_id": "q", "action": "click", "doc_id": "a", "timestamp": t + 2000}),
                  ("feedback", "q", {"query_id": "q", "action": "click", "doc_id": "d", "timestamp": t + 3000})])
    counts = {k: v.tolist() for k, v in ps.ab.items() if k.startswith(INTERLEAVING)}
    assert counts == {old_field: [1.0, 0.0, 0.0], new_field: [0.0, 1.0, 0.0]}  # T wins now, counted once
