"""The simulator's per-user assignment (`--assign user`) and user heterogeneity
(`--user-sigma`), issue 20: sticky arms by client_id, and defaults that draw exactly the
traffic they drew before."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest

from rankmeter.simulator.corpus import Corpus
from rankmeter.simulator.traffic import Simulator
from rankmeter.simulator.users import Users, arm_share

T0 = 1_700_000_000_000
SMALL = Corpus(seed=3, documents=300, topics=5, vocabulary=300, queries=30)  # cheap queries


def _impressions(sim: Simulator, queries: int) -> list[dict]:
    out = []
    for i in range(queries):
        out += [e.value for e in sim.query_events(T0 + i * 1000, i) if e.stream == "impressions"]
    return out


def test_defaults_draw_the_same_traffic_as_before():
    """The digest of 300 queries' events with the defaults, computed on main before
    `assign` and `user_sigma` existed (85d3de7): the flags change nothing unless given."""
    h = hashlib.sha256()
    sim = Simulator(seed=11, run_id="golden", users=500)
    for i in range(300):
        for ev in sim.query_events(T0 + i * 1000, i):
            h.update(json.dumps([ev.stream, ev.key, ev.value], sort_keys=True).encode())
    assert h.hexdigest() == "3271c4c3998e871679b7764c33ae60fdc22557b411e61bb81e2049af853884aa"


def test_user_assignment_is_sticky_by_client_id_and_follows_the_split():
    sim = Simulator(seed=5, run_id="u", users=200, assign="user", split=0.7, corpus=SMALL)
    rankers = defaultdict(set)
    for imp in _impressions(sim, 1200):
        rankers[imp["client_id"]].add(imp["ranker"])
    assert all(len(r) == 1 for r in rankers.values())          # one arm per user, at every query
    first = sim.rankers[0].name
    for client, (ranker,) in rankers.items():
        assert (ranker == first) == (arm_share(client) < 0.7)
    share = np.mean([r == {first} for r in rankers.values()])
    assert 0.6 < share < 0.8
    # per-query assignment: heavy users see both rankers
    mixed = defaultdict(set)
    for imp in _impressions(Simulator(seed=5, run_id="q", users=200, corpus=SMALL), 1200):
        mixed[imp["client_id"]].add(imp["ranker"])
    assert max(len(r) for r in mixed.values()) == 2


def test_arm_share_is_uniform_and_independent_of_the_bucket_hash():
    from rankmeter.ab.clusters import bucket_of

    ids = [f"c{i}" for i in range(20_000)]
    u = np.array([arm_share(c) for c in ids])
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(np.mean(u < 0.1) - 0.1) < 0.01
    buckets = np.array([bucket_of(c) for c in ids])
    # the treatment's share is the same in every part of the bucket range
    for part in range(4):
        in_part = (buckets // 32) == part
        assert abs(np.mean(u[in_part] < 0.5) - 0.5) < 0.03


@pytest.mark.parametrize("sigma", [0.0, 0.3, 1.0])
def test_user_sigma_is_the_spread_of_the_log_propensity(sigma):
    users = Users(20_000, np.random.default_rng(2), propensity_sigma=sigma)
    assert np.std(np.log(users.propensity)) == pytest.approx(sigma, abs=0.02)
    assert np.mean(users.propensity) == pytest.approx(1.0, rel=0.05)


def test_user_heterogeneity_makes_a_users_clicks_alike():
    """σ 1.0: the users' click rates differ far more than σ 0.3's (same users' activity)."""
    spread = {}
    for sigma in (0.3, 1.0):
        sim = Simulator(seed=9, run_id="s", users=100, assign="user", user_sigma=sigma, corpus=SMALL)
        clicks, shown = defaultdict(int), defaultdict(int)
        for i in range(2000):
            events = sim.query_events(T0 + i * 1000, i)
            client = events[0].value["client_id"]
            shown[client] += 1
            clicks[client] += sum(e.value.get("action") == "click" for e in events)
        rates = [clicks[c] / shown[c] for c in shown if shown[c] >= 20]
        spread[sigma] = np.std(np.log(np.array(rates) + 0.05))
    assert spread[1.0] > 1.5 * spread[0.3]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        Simulator(seed=1, assign="session")
    with pytest.raises(ValueError):
        Simulator(seed=1, assign="user", interleave=("bm25-tuned", "bm25-degraded"))
    with pytest.raises(ValueError):
        Simulator(seed=1, user_sigma=-1.0)


def test_the_cli_flags():
    out = subprocess.run([sys.executable, "-m", "rankmeter", "simulate", "--assign", "user", "--user-sigma", "1.0",
                          "--split", "0.9", "--count", "600", "--rate", "1e9", "--output", "-", "--seed", "4"],
                         capture_output=True, text=True, check=True).stdout
    rankers = defaultdict(set)
    for line in out.splitlines():
        event = json.loads(line)
        if "ranker" in event["value"]:
            rankers[event["value"]["client_id"]].add(event["value"]["ranker"])
    assert rankers and all(len(r) == 1 for r in rankers.values())
    bad = subprocess.run([sys.executable, "-m", "rankmeter", "simulate", "--assign", "user", "--history", "1h",
                          "--output", "-"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--assign" in bad.stderr


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
def test_a_texts_click_factor_persists_with_the_persistence(p):
    """CUPED's world (simulator/users.py TextDifficulty): the log click factors of two queries
    of one text correlate by p; the factor's mean is 1 (the click level is unchanged)."""
    from rankmeter.simulator.users import TEXT_SIGMA, TextDifficulty
    texts, rng = TextDifficulty(p), np.random.default_rng(4)
    first = np.array([texts.factor(f"t{i}", rng) for i in range(20_000)])
    second = np.array([texts.factor(f"t{i}", rng) for i in range(20_000)])
    assert np.corrcoef(np.log(first), np.log(second))[0, 1] == pytest.approx(p, abs=0.03)
    assert first.mean() == pytest.approx(1.0, abs=0.02)
    assert np.log(first).std() == pytest.approx(TEXT_SIGMA, rel=0.03)


def test_persistence_outside_0_to_1_is_refused_and_none_leaves_the_traffic_as_it_was():
    from rankmeter.simulator.traffic import Simulator
    from rankmeter.simulator.users import TextDifficulty
    with pytest.raises(ValueError, match="persistence must be from 0 to 1"):
        TextDifficulty(1.5)
    corpus = Corpus(seed=3)
    a, b = Simulator(seed=3, run_id="r", corpus=corpus), Simulator(seed=3, run_id="r", corpus=corpus, persistence=None)
    assert [e.value for t in range(30) for e in a.query_events(t, 0.0)] == \
        [e.value for t in range(30) for e in b.query_events(t, 0.0)]
