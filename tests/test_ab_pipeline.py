"""The experiment's cumulative arm sums on the pipeline: every impression since the start
counts (a query with nothing relevant as 0), feedback moves them by deltas, they survive a
restart and a configuration change, and a look turns them into the exported statistics."""

from __future__ import annotations

import json
import random
from typing import NamedTuple

import numpy as np
import pytest

from rankmeter import config
from rankmeter.ab.stats import MeanSums, mean_difference
from rankmeter.engine import QueryState, parse, stack
from rankmeter.pipeline import Pipeline
from rankmeter.source import Bus
from rankmeter.store import MemoryStore

NOW_S = 1_800_000_000.0
NOW_MS = int(NOW_S * 1000)
ENV = {"RANKMETER_AB_BASELINE": "base", "RANKMETER_AB_UNIT": "query", "RANKMETER_AB_MIN_QUERIES": "20",
       "RANKMETER_AB_MIXTURE_AFTER": "0s",  # (a τ² from the first look: no feedback arrives late here)
       "RANKMETER_AB_SPLIT": "base=0.5,new=0.5"}
START_MS = NOW_MS - 600_000  # an_experiment's start


def experiment_stream(seed: int, queries: int, start_ms: int):
    """Impressions of two arms, some before the start; clicks on a random subset."""
    rnd = random.Random(seed)
    out, truth = [], {}
    for q in range(queries):
        qid, ranker = f"q{q}", rnd.choice(["base", "new"])
        t = start_ms + rnd.randrange(-120_000, 600_000)
        results = [f"d{rnd.randrange(40)}" for _ in range(10)]
        results = list(dict.fromkeys(results))
        out.append(("impressions", qid, {"query_id": qid, "ranker": ranker, "timestamp": t, "results": results}))
        clicked = {d for d in results if rnd.random() < (0.25 if ranker == "new" else 0.15)}
        for d in clicked:
            out.append(("feedback", qid, {"query_id": qid, "action": "click", "doc_id": d, "timestamp": t + 1000}))
        truth[qid] = (ranker, t, results, clicked)
    rnd.shuffle(out)
    return out, truth


def started(settings, store: MemoryStore, bus: Bus) -> Pipeline:
    """A pipeline (a process) on the store and bus, holding every partition."""
    pipeline = Pipeline(settings, store, lambda r, why: None, lambda: NOW_S)
    bus.subscribe([settings.kafka.impressions_topic, settings.kafka.feedback_topic], pipeline.assign, pipeline.revoke)
    return pipeline


class Started(NamedTuple):
    settings: config.Settings
    events: list
    truth: dict
    store: MemoryStore
    bus: Bus
    pipeline: Pipeline


def an_experiment(seed: int, queries: int, partitions: int, **env: str) -> Started:
    """An experiment started 10 minutes ago, its stream (not yet sent) and a pipeline
    holding every partition of a fresh bus and memory store."""
    settings = config.load(None, {**ENV, "RANKMETER_AB_START": str(START_MS), **env})
    events, truth = experiment_stream(seed, queries, START_MS)
    store, bus = MemoryStore(), Bus(partitions=partitions)
    return Started(settings, events, truth, store, bus, started(settings, store, bus))


def feed(pipeline: Pipeline, bus: Bus, events, batch: int = 37) -> None:
    settings = pipeline.settings
    topics = {"impressions": settings.kafka.impressions_topic, "feedback": settings.kafka.feedback_topic}
    for stream, key, event in events:
        bus.send(topics[stream], key.encode(), json.dumps(event).encode())
    while records := bus.poll(0, batch):
        pipeline.process(records)


def test_arm_sums_cover_every_impression_since_the_start_and_give_the_welch_estimate():
    settings, events, truth, store, bus, pipeline = an_experiment(5, 400, partitions=3)
    feed(pipeline, bus, events)
    look = pipeline.ab_look()

    # Independently: P@10 per query from its clicks (grade 1), 0 when nothing was clicked.
    p10 = parse("P@10")
    expected = {}
    for ranker in ("base", "new"):
        qids = [q for q, (r, t, _, _) in truth.items() if r == ranker and t >= START_MS]
        states = [QueryState.from_grades(truth[q][2], {d: 1.0 for d in truth[q][3]}, shown_grade=0) for q in qids]
        values = p10.values(p10.compute(stack(states)))
        expected[ranker] = MeanSums(len(values), float(values.sum()), float((values ** 2).sum()))
    arms = {a.ranker: a for a in look.arms}
    assert arms["base"].queries == expected["base"].n and arms["new"].queries == expected["new"].n
    comparison = next(c for c in look.comparisons if c.metric == "P@10" and c.average == "macro")
    reference = mean_difference(expected["new"], expected["base"])
    assert comparison.estimate.delta == pytest.approx(reference.delta, abs=1e-12)
    assert comparison.estimate.variance == pytest.approx(reference.variance, rel=1e-9)
    assert comparison.running.ci_lower <= comparison.estimate.delta <= comparison.running.ci_upper
    assert 0 < look.srm[""] <= 1


def test_arm_sums_survive_a_restart_and_moving_batches():
    start = NOW_MS - 600_000
    settings = config.load(None, {**ENV, "RANKMETER_AB_START": str(start)})
    events, _ = experiment_stream(9, 200, start)

    def final(batches: list[int]) -> dict:
        store, bus = MemoryStore(), Bus(partitions=2)
        done = 0
        for size in batches:   # each element: a new process on the same store
            pipeline = started(settings, store, bus)
            feed(pipeline, bus, events[done:done + size], batch=size // 3 + 1)
            done += size
        return {p: {f: np.frombuffer(v) for f, v in sums.items()} for p, sums in store.ab.items()}

    whole, restarted = final([len(events)]), final([50, 100, len(events) - 150])
    assert whole.keys() == restarted.keys()
    for p in whole:
        assert whole[p].keys() == restarted[p].keys()
        for field in whole[p]:
            np.testing.assert_allclose(restarted[p][field], whole[p][field], atol=1e-9)


def test_no_statistic_before_each_arm_has_min_queries():
    _, events, _, store, bus, pipeline = an_experiment(2, 200, partitions=1, RANKMETER_AB_MIN_QUERIES="1000")
    feed(pipeline, bus, events)
    look = pipeline.ab_look()
    assert look.comparisons == [] and look.srm == {} and {a.ranker for a in look.arms} == {"base", "new"}


def test_only_partition_0s_holder_keeps_the_experiments_result():
    settings, events, _, store, bus, pipeline = an_experiment(2, 200, partitions=2)
    feed(pipeline, bus, events)
    assert pipeline.ab_look() is not None and pipeline.ab_result is not None
    pipeline.revoke([1])
    assert pipeline.ab_result is not None  # partition 0 still held: it exports the experiment
    pipeline.revoke([0])
    assert pipeline.ab_result is None and pipeline.interleaving_result == []


def test_enrolment_is_by_impression_time_alone_and_feedback_never_enrols():
    """Every impression stamped from ab.start on is enrolled, in whatever order partitions
    see them; one stamped before is not, and a later click does not enrol it either (that
    would pick the population by its outcome)."""
    start = NOW_MS - 300_000
    settings = config.load(None, {**ENV, "RANKMETER_AB_START": str(start)})
    store, bus = MemoryStore(), Bus(partitions=2)
    pipeline = started(settings, store, bus)
    results = [f"d{i}" for i in range(10)]
    imp = lambda q, r, t: ("impressions", q, {"query_id": q, "ranker": r, "timestamp": t, "results": results})
    clk = lambda q, t: ("feedback", q, {"query_id": q, "action": "click", "doc_id": "d0", "timestamp": t})
    feed(pipeline, bus, [imp(f"before{i}", "base", start - 1000) for i in range(30)]
         + [imp(f"base{i}", "base", start + 1000) for i in range(50)]
         + [imp(f"new{i}", "new", start) for i in range(50)])
    feed(pipeline, bus, [clk(f"before{i}", start + 3000) for i in range(10)] + [clk(f"base{i}", start + 3000) for i in range(5)])
    arms = {a.ranker: a for a in pipeline.ab_look().arms}
    assert (arms["base"].queries, arms["base"].judged) == (50, 5)
    assert (arms["new"].queries, arms["new"].judged) == (50, 0)


def test_an_experiment_needs_its_start():
    with pytest.raises(config.ConfigError, match="ab.start: required with ab.baseline"):
        config.load(None, ENV)


def test_a_configuration_change_starts_a_new_experiment():
    start = NOW_MS - 600_000
    before = config.load(None, {**ENV, "RANKMETER_AB_START": str(start), "RANKMETER_EVALUATION_MEASURES": "P@10"})
    after = config.load(None, {**ENV, "RANKMETER_AB_START": str(start), "RANKMETER_EVALUATION_MEASURES": "P@1"})
    events, _ = experiment_stream(3, 200, start + 120_000)   # every impression after the start
    store, bus = MemoryStore(), Bus(partitions=1)
    first = started(before, store, bus)
    feed(first, bus, events[:300])
    assert sum(a.queries for a in first.ab_look().arms) > 0
    second = started(after, store, bus)
    feed(second, bus, events[300:])
    look = second.ab_look()
    impressions_after = sum(1 for stream, _, _ in events[300:] if stream == "impressions")
    assert sum(a.queries for a in look.arms) == impressions_after   # a new experiment: only these
    assert look.experiment != first.ab_result.experiment and {c.metric for c in look.comparisons} <= {"P@1", *[
        "CTR", "Abandonment", "Clicks", "FirstClickRank"]}


def test_turning_debias_on_or_off_keeps_the_experiment():
    """The debiased measures are outside the A/B layout: same experiment, same sums."""
    start = NOW_MS - 600_000
    events, _ = experiment_stream(4, 300, start)
    names, arms = set(), []
    for measures in ("", "nDCG@10", "nDCG@10,DCG@10"):
        settings = config.load(None, {**ENV, "RANKMETER_AB_START": str(start), "RANKMETER_DEBIAS_MEASURES": measures})
        store, bus = MemoryStore(), Bus(partitions=2)
        pipeline = started(settings, store, bus)
        feed(pipeline, bus, events)
        names.add(pipeline.experiments.name)
        arms.append({(p, f): v for p, fields in store.load_ab([0, 1]).items() for f, v in fields.items()
                     if not f.startswith("propensity")})
    assert len(names) == 1
    assert arms[0] and arms[0] == arms[1] == arms[2]
