"""The simulator's `--interleave A,B`: team-draft interleaving (Radlinski, Kurup & Joachims, 2008)."""

import json

import numpy as np
import pytest

from rankmeter import config
from rankmeter.cli import parser
from rankmeter.events import Decoder, Rejected
from rankmeter.simulator.interleaving import team_draft
from rankmeter.simulator.traffic import Simulator

PAIR = ("bm25-tuned", "bm25-degraded")


def check_team_draft(a: list[str], b: list[str], k: int, shown: list[str], teams: list[int]) -> None:
    assert len(shown) == len(teams) <= k
    assert len(set(shown)) == len(shown), "a document shown twice"
    counts = [0, 0]
    for t in teams:
        counts[t] += 1
        assert abs(counts[0] - counts[1]) <= 1, "a prefix's team sizes differ by more than one"
    for team, ranking in ((0, a), (1, b)):
        picked = [d for d, t in zip(shown, teams) if t == team]
        ranks = [ranking.index(d) for d in picked]
        assert ranks == sorted(ranks), "a team's documents out of its ranker's order"
        # Each pick is the team's highest-ranked document not yet in the list when it picked.
        for pos, (d, t) in enumerate(zip(shown, teams)):
            if t == team:
                assert d == next(x for x in ranking if x not in shown[:pos])


def test_team_draft_invariants_on_random_overlapping_lists():
    rng = np.random.default_rng(11)
    for _ in range(2000):
        pool = [f"d{i}" for i in range(int(rng.integers(1, 25)))]
        a = list(rng.permutation(pool)[: int(rng.integers(1, len(pool) + 1))])
        b = list(rng.permutation(pool)[: int(rng.integers(1, len(pool) + 1))])
        k = int(rng.integers(1, 15))
        shown, teams = team_draft(a, b, k, rng)
        check_team_draft(a, b, k, shown, teams)
        if len(a) >= k and len(b) >= k:
            assert len(shown) == k
    # Both teams pick first about half of the time.
    firsts = [team_draft(["x", "y"], ["y", "x"], 2, rng)[1][0] for _ in range(4000)]
    assert 0.46 < np.mean(firsts) < 0.54


def interleaved_events(seed: int, queries: int):
    sim = Simulator(seed=seed, interleave=PAIR)
    return sim, [e for _ in range(queries) for e in sim.query_events(1_800_000_000_000, 0.0)]


def test_simulated_impressions_carry_team_draft_attribution():
    sim, events = interleaved_events(3, 300)
    decoder = Decoder(config.load(None, {}))
    impressions = [e.value for e in events if e.stream == "impressions"]
    assert len(impressions) == 300
    for imp in impressions:
        assert imp["ranker"] == "bm25-tuned-vs-bm25-degraded"
        il = imp["interleaving"]
        assert il["experiment"] == "bm25-tuned-vs-bm25-degraded"
        assert len(il["teams"]) == len(imp["results"]) == 10
        teams = [PAIR.index(t) for t in il["teams"]]
        assert set(teams) == {0, 1}
        decoded = decoder.impression(json.dumps(imp).encode(), 1_800_000_000_000)
        assert not isinstance(decoded, Rejected), decoded
    # The teams' documents come from each ranker's own list, in its order: rebuild the
    # tuned ranker's list (no noise) and check the tuned team's picks against it.
    tuned = sim.interleave[0]
    rng = np.random.default_rng(0)
    for imp in impressions[:50]:
        query = next(q for q in sim.corpus.queries if q.text == imp["user_query"])
        full = sim.index.search(query, tuned, 30, rng)
        picked = [d for d, t in zip(imp["results"], imp["interleaving"]["teams"]) if t == "bm25-tuned"]
        assert [full.index(d) for d in picked] == sorted(full.index(d) for d in picked)
    # Clicks come from the same click model on the interleaved list.
    clicks = [e.value for e in events if e.value.get("action") == "click"]
    shown = {imp["query_id"]: imp["results"] for imp in impressions}
    assert clicks and all(shown[c["query_id"]][c["position"] - 1] == c["doc_id"] for c in clicks)


def test_interleaving_prefers_the_tuned_ranker():
    _, events = interleaved_events(4, 1500)
    teams = {e.key: dict(zip(e.value["results"], e.value["interleaving"]["teams"]))
             for e in events if e.stream == "impressions"}
    per_query: dict[str, list[int]] = {}
    for e in events:
        if e.value.get("action") == "click":
            team = teams[e.key][e.value["doc_id"]]
            per_query.setdefault(e.key, [0, 0])[PAIR.index(team)] += 1
    wins = sum(a > b for a, b in per_query.values())
    losses = sum(a < b for a, b in per_query.values())
    assert wins > 2 * losses


def test_same_seed_same_traffic():
    def strip(events):  # query ids carry a per-run random part; everything else is the seed's
        return [(e.stream, {k: v for k, v in e.value.items() if k not in ("query_id", "event_id")})
                for e in events]

    assert strip(interleaved_events(9, 200)[1]) == strip(interleaved_events(9, 200)[1])
    assert strip(interleaved_events(9, 200)[1]) != strip(interleaved_events(10, 200)[1])


def test_without_interleave_nothing_changes():
    sim = Simulator(seed=1)
    events = [e for _ in range(100) for e in sim.query_events(1_800_000_000_000, 0.0)]
    assert all("interleaving" not in e.value for e in events)
    assert {e.value["ranker"] for e in events if e.stream == "impressions"} == set(PAIR)


def test_command_line_option():
    for command in ("simulate", "demo"):
        assert parser().parse_args([command, "--interleave", "bm25-tuned,bm25-degraded"]).interleave == PAIR
        assert parser().parse_args([command]).interleave is None
        for bad in ("bm25-tuned", "bm25-tuned,bm25-tuned", "bm25-tuned,nope"):
            with pytest.raises(SystemExit):
                parser().parse_args([command, "--interleave", bad])
    with pytest.raises(ValueError):
        Simulator(seed=1, interleave=("bm25-tuned", "nope"))
