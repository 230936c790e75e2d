"""Team-draft interleaving on the pipeline: clicks credited to the team that contributed
the clicked position, one outcome per query that later clicks may change, and the
experiment's preference with an always-valid p-value."""

from __future__ import annotations

import json
import random

import pytest

from rankmeter import config
from rankmeter.ab.stats import INTERLEAVING_TAU2, msprt, preference
from rankmeter.pipeline import Pipeline
from rankmeter.source import Bus
from rankmeter.store import MemoryStore

NOW_S = 1_800_000_000.0
NOW_MS = int(NOW_S * 1000)
SETTINGS = config.load(None, {"RANKMETER_AB_MIN_QUERIES": "20"})
IMPRESSIONS, FEEDBACK = SETTINGS.kafka.impressions_topic, SETTINGS.kafka.feedback_topic


def setup(partitions: int = 2):
    bus, store = Bus(partitions=partitions), MemoryStore()
    pipeline = Pipeline(SETTINGS, store, lambda r, why: None, lambda: NOW_S)
    bus.subscribe([IMPRESSIONS, FEEDBACK], pipeline.assign, pipeline.revoke)

    def send(topic, event):
        bus.send(topic, event["query_id"].encode(), json.dumps(event).encode())

    def run():
        while records := bus.poll(0, 7):
            pipeline.process(records)

    return pipeline, send, run


def impression(qid, results, teams):
    return {"query_id": qid, "ranker": "interleaved", "timestamp": NOW_MS, "results": results,
            "interleaving": {"experiment": "tuned-vs-degraded", "teams": teams}}


def click(qid, doc, i=0):
    return {"query_id": qid, "action": "click", "doc_id": doc, "timestamp": NOW_MS, "event_id": f"{qid}.{doc}.{i}"}


def test_clicks_are_credited_to_teams_and_outcomes_move_with_later_clicks():
    pipeline, send, run = setup()
    send(IMPRESSIONS, impression("q1", ["a", "b", "c", "d"], ["T", "D", "D", "T"]))
    send(FEEDBACK, click("q1", "b"))                      # D ahead
    run()
    pipeline.ab_look()
    [r] = pipeline.interleaving_result
    assert (r.team_a, r.team_b, r.wins_a, r.wins_b, r.ties) == ("D", "T", 1, 0, 0)
    send(FEEDBACK, click("q1", "a"))                      # 1–1: a tie now
    send(FEEDBACK, click("q1", "a", 1))                   # the same document again: no extra credit
    run()
    pipeline.ab_look()
    [r] = pipeline.interleaving_result
    assert (r.wins_a, r.wins_b, r.ties) == (0, 0, 1)
    send(FEEDBACK, click("q1", "d"))                      # T ahead: T wins
    send(IMPRESSIONS, impression("q2", ["x", "y"], ["D", "T"]))   # no click: not counted
    run()
    pipeline.ab_look()
    [r] = pipeline.interleaving_result
    assert (r.wins_a, r.wins_b, r.ties) == (0, 1, 0) and r.running is None   # fewer than min_queries


def test_the_preference_and_its_always_valid_p_value_match_an_independent_count():
    pipeline, send, run = setup(partitions=3)
    rnd = random.Random(4)
    wins = {"D": 0, "T": 0, "tie": 0}
    for q in range(300):
        docs = [f"d{i}" for i in range(6)]
        teams = [rnd.choice("TD") for _ in docs[:-2]] + ["T", "D"]   # team draft: both teams contribute
        send(IMPRESSIONS, impression(f"q{q}", docs, teams))
        clicked = {d for d, t in zip(docs, teams) if rnd.random() < (0.3 if t == "T" else 0.15)}
        for d in clicked:
            send(FEEDBACK, click(f"q{q}", d))
        if clicked:
            t = sum(teams[docs.index(d)] == "T" for d in clicked)
            o = "T" if t > len(clicked) - t else "D" if t < len(clicked) - t else "tie"
            wins[o] += 1
    run()
    pipeline.ab_look()
    [r] = pipeline.interleaving_result
    assert (r.wins_a, r.wins_b, r.ties) == (wins["D"], wins["T"], wins["tie"])
    n = sum(wins.values())
    assert r.estimate.delta == pytest.approx((wins["D"] - wins["T"]) / n)
    look = msprt(preference(wins["D"], wins["T"], wins["tie"]), INTERLEAVING_TAU2, 0.05)
    assert r.running.p_value == pytest.approx(look.p_value) and r.running.p_value < 0.05
    assert r.running.ci_upper < 0    # T, the better team, is preferred: D's preference is negative


def test_an_impression_with_malformed_teams_is_dead_lettered():
    letters = []
    bus, store = Bus(partitions=1), MemoryStore()
    pipeline = Pipeline(SETTINGS, store, lambda r, why: letters.append(why), lambda: NOW_S)
    bus.subscribe([IMPRESSIONS, FEEDBACK], pipeline.assign, pipeline.revoke)
    bus.send(IMPRESSIONS, b"q", json.dumps(impression("q", ["a", "b"], ["T"])).encode())
    bus.send(IMPRESSIONS, b"r", json.dumps({**impression("r", ["a", "b"], ["T", "T"])}).encode())
    pipeline.process(bus.poll(0, 10))
    bus.send(IMPRESSIONS, b"s", json.dumps(impression("s", ["a", "a"], ["T", "D"])).encode())
    pipeline.process(bus.poll(0, 10))
    assert letters == ["interleaving.teams has 1 entries for 2 results",
                       "interleaving needs an experiment name and exactly two teams",
                       "interleaving: once repeated documents are dropped, one team is left"]
