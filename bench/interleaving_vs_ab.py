"""Queries to detect a worse ranker: team-draft interleaving against an A/B test, measured.

    .venv/bin/python bench/interleaving_vs_ab.py [--seeds 100] [--budget 40000] [--batch 50]
        [--small-noise 0.1] [--seed 20261201]

Pure simulation with the simulator's own pieces (no Kafka, no Redis): its corpus and
BM25 index (corpus seed 7, the default of `rankmeter simulate`), its rankers, its
Zipf query popularity, its team-draft function (`rankmeter.simulator.interleaving.team_draft`)
and its position-based click model (P(click at r) = ATTRACTIVE[true grade] / r^0.9).
BM25 scores are cached per query and ranker, and only the score noise is drawn per
impression (as `Index.search` does), so a query costs tens of microseconds.

Two comparisons, each over `--seeds` traffic seeds:

* large gap: bm25-tuned against bm25-degraded (the simulator's two rankers);
* small gap: bm25-tuned against bm25-tuned with score noise `--small-noise` (the
  simulator's `Ranker.noise` knob).  The simulator's `--regression-at` option (noise 1.5)
  is a *larger* gap than bm25-degraded, so it is not used.

Per seed and comparison, two independent streams of queries, each looked at after every
`--batch` queries until p < 0.05 or `--budget` queries:

* interleaving: every query shows the team-draft list of the two rankers; score
  s = +1 when bm25-tuned's team got more clicks, −1 when fewer, 0 for a tie; queries
  without clicks do not count.  Always-valid p from `preference(wins, losses, ties)`
  and `msprt(·, INTERLEAVING_TAU2, 0.05)`, running minimum (`update`), from 100 counted
  queries on.
* A/B: each query to one ranker by a fair coin; per-query click-based nDCG@10 (clicked
  documents grade 1, the rest 0; a query without clicks scores 0) and, separately, CTR
  (1 when the query got a click); `mean_difference` + `msprt(·, DEFAULT_TAU2, 0.05)`,
  running minimum, from 100 queries per arm on.

A detection counts only in the right direction (bm25-tuned better); the other direction
is counted apart.  Queries to detection are all queries shown (including those without
clicks, and both arms for A/B): the traffic the experiment costs.  Seeds that do not
detect within the budget count as "> budget" (the median and 80th percentile are then
reported as "> budget" when they fall there).  Prints a markdown table; progress on stderr.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from rankmeter.ab import (
    DEFAULT_MIN_QUERIES,
    DEFAULT_TAU2,
    INTERLEAVING_TAU2,
    MeanSums,
    Running,
    mean_difference,
    msprt,
    preference,
    update,
)
from rankmeter.engine import QueryState
from rankmeter.simulator.bm25 import Ranker
from rankmeter.simulator.interleaving import team_draft
from rankmeter.simulator.traffic import ATTRACTIVE, DEFAULT_RANKERS, Simulator
from rankmeter.simulator.truth import TruthTally
from progress import Progress  # bench/, beside this script

ALPHA = 0.05
K = 10
EXAMINE = 1.0 / np.arange(1, K + 1) ** 0.9
ATTRACT = np.array([ATTRACTIVE[g] for g in range(4)])
DISCOUNT = 1.0 / np.log2(np.arange(2, K + 2))
IDEAL = np.concatenate([[0.0], np.cumsum(DISCOUNT)])  # ideal DCG of c clicked documents


class World:
    """The simulator's corpus, index (its search caches the BM25 scores) and click model."""

    def __init__(self, sim: Simulator):
        self.sim = sim
        self.queries = sim.corpus.queries
        self.popularity = sim.corpus.popularity
        self._grades: dict[int, dict[str, int]] = {}

    def grades(self, q: int) -> dict[str, int]:
        g = self._grades.get(q)
        if g is None:
            g = self._grades[q] = self.sim.true_grades(self.queries[q])
        return g

    def search(self, q: int, ranker: Ranker, rng: np.random.Generator) -> list[str]:
        return self.sim.search(self.queries[q], ranker, rng)

    def clicks(self, lists: list[list[str]], qs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The position-based click model on a batch of shown lists: a bool matrix."""
        grade = np.zeros((len(lists), K), dtype=np.int64)
        shown = np.zeros((len(lists), K), dtype=bool)
        for row, (docs, q) in enumerate(zip(lists, qs)):
            g = self.grades(int(q))
            grade[row, :len(docs)] = [g.get(d, 0) for d in docs]
            shown[row, :len(docs)] = True
        return shown & (rng.random((len(lists), K)) < ATTRACT[grade] * EXAMINE)

    def true_ndcg(self, ranker: Ranker, n: int, rng: np.random.Generator) -> float:
        tally = TruthTally()
        for q in rng.choice(len(self.queries), n, p=self.popularity):
            tally.add(ranker.name, QueryState.from_grades(self.search(int(q), ranker, rng), self.grades(int(q)),
                                                          shown_grade=0))
        return tally.means()[ranker.name]["nDCG@10"]


@dataclass
class Outcome:
    queries: list[float] = field(default_factory=list)  # per seed: queries to detection, inf if none
    wrong: int = 0                                      # detections in the wrong direction


def interleaving_run(world: World, a: Ranker, b: Ranker, rng: np.random.Generator,
                     batch: int, budget: int) -> tuple[float, bool]:
    """Queries shown until the always-valid p < α; (inf, False) at the budget; True if wrong way."""
    wins = losses = ties = 0.0
    running = Running()
    shown = 0
    while shown < budget:
        qs = rng.choice(len(world.queries), batch, p=world.popularity)
        lists, teams = [], np.zeros((batch, K), dtype=np.int64)
        for row, q in enumerate(qs):
            docs, team = team_draft(world.search(int(q), a, rng), world.search(int(q), b, rng), K, rng)
            lists.append(docs)
            teams[row, :len(team)] = team
        clicks = world.clicks(lists, qs, rng)
        a_clicks = (clicks & (teams == 0)).sum(axis=1)
        b_clicks = (clicks & (teams == 1)).sum(axis=1)
        counted = clicks.any(axis=1)
        wins += float(np.sum(a_clicks > b_clicks))
        losses += float(np.sum(a_clicks < b_clicks))
        ties += float(np.sum(counted & (a_clicks == b_clicks)))
        shown += batch
        if wins + losses + ties < DEFAULT_MIN_QUERIES:
            continue
        estimate = preference(wins, losses, ties)
        running = update(running, msprt(estimate, INTERLEAVING_TAU2, ALPHA))
        if running.p_value < ALPHA:
            return float(shown), estimate.delta < 0
    return math.inf, False


def ab_run(world: World, a: Ranker, b: Ranker, rng: np.random.Generator,
           batch: int, budget: int) -> dict[str, tuple[float, bool]]:
    """One A/B stream, two measures (click nDCG@10, CTR), each with its own running p."""
    sums = {m: [np.zeros(3), np.zeros(3)] for m in ("nDCG@10", "CTR")}  # per arm: n, Σx, Σx²
    running = {m: Running() for m in sums}
    result: dict[str, tuple[float, bool]] = {}
    shown = 0
    while shown < budget and len(result) < len(sums):
        qs = rng.choice(len(world.queries), batch, p=world.popularity)
        arm = (rng.random(batch) >= 0.5).astype(np.int64)  # 0: a (baseline), 1: b (treatment)
        lists = [world.search(int(q), (a, b)[s], rng) for q, s in zip(qs, arm)]
        clicks = world.clicks(lists, qs, rng)
        c = clicks.sum(axis=1)
        values = {"nDCG@10": (clicks * DISCOUNT).sum(axis=1) / np.where(c > 0, IDEAL[c], 1.0),
                  "CTR": (c > 0).astype(float)}
        for m, x in values.items():
            for s in (0, 1):
                xs = x[arm == s]
                sums[m][s] += (len(xs), xs.sum(), (xs * xs).sum())
        shown += batch
        if min(sums["CTR"][0][0], sums["CTR"][1][0]) < DEFAULT_MIN_QUERIES:
            continue
        for m in sums:
            if m in result:
                continue
            estimate = mean_difference(MeanSums(*sums[m][1]), MeanSums(*sums[m][0]))  # b − a
            running[m] = update(running[m], msprt(estimate, DEFAULT_TAU2, ALPHA))
            if running[m].p_value < ALPHA:
                result[m] = (float(shown), estimate.delta > 0)
    return {m: result.get(m, (math.inf, False)) for m in sums}


def summary(values: list[float], budget: int) -> tuple[str, str, float, float]:
    def show(x: float) -> str:
        return f"> {budget:,}" if math.isinf(x) else f"{x:,.0f}"

    arr = np.array(values)
    # Percentiles of a sample containing "not detected" (inf): the order statistic.
    med = float(np.sort(arr)[int(math.ceil(0.5 * len(arr))) - 1])
    p80 = float(np.sort(arr)[int(math.ceil(0.8 * len(arr))) - 1])
    return show(med), show(p80), med, p80


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--budget", type=int, default=40_000, help="queries per method and seed")
    parser.add_argument("--batch", type=int, default=50, help="queries between looks")
    parser.add_argument("--small-noise", type=float, default=0.1,
                        help="score noise of the slightly worse ranker in the small-gap comparison")
    parser.add_argument("--seed", type=int, default=20261201)
    args = parser.parse_args()

    t0 = time.monotonic()
    world = World(Simulator(seed=7))
    tuned, degraded = DEFAULT_RANKERS
    noisy = Ranker(f"bm25-tuned+noise {args.small_noise:g}", noise=args.small_noise)
    comparisons = [("large gap", tuned, degraded), ("small gap", tuned, noisy)]
    rows = []
    for label, a, b in comparisons:
        truth = [world.true_ndcg(r, 3000, np.random.default_rng(args.seed)) for r in (a, b)]
        outcomes = {"interleaving": Outcome(), "A/B nDCG@10": Outcome(), "A/B CTR": Outcome()}
        progress = Progress(f"{label} ({b.name})", args.seeds, unit="seeds")
        for s in range(args.seeds):
            il_rng, ab_rng = (np.random.default_rng([args.seed, s, i]) for i in (0, 1))
            n, wrong = interleaving_run(world, a, b, il_rng, args.batch, args.budget)
            outcomes["interleaving"].queries.append(math.inf if wrong else n)
            outcomes["interleaving"].wrong += wrong
            for m, (n, wrong) in ab_run(world, a, b, ab_rng, args.batch, args.budget).items():
                outcomes[f"A/B {m}"].queries.append(math.inf if wrong else n)
                outcomes[f"A/B {m}"].wrong += wrong
            progress(s + 1)
        il_med, il_p80 = summary(outcomes["interleaving"].queries, args.budget)[2:]
        for method, o in outcomes.items():
            med_s, p80_s, med, p80 = summary(o.queries, args.budget)
            detected = sum(math.isfinite(x) for x in o.queries)
            ratio = "" if method == "interleaving" else _ratio(med, il_med, args.budget) + " / " + _ratio(p80, il_p80, args.budget)
            rows.append(f"| {label}: {a.name} {truth[0]:.3f} vs {b.name} {truth[1]:.3f} | {method} | {med_s} "
                        f"| {p80_s} | {detected}/{len(o.queries)} ({detected / len(o.queries):.0%}) | {o.wrong} "
                        f"| {ratio} |")
    print(f"\n{args.seeds} seeds, looks every {args.batch} queries, budget {args.budget:,} queries per method "
          f"and seed, α = {ALPHA}; {time.monotonic() - t0:.0f} s\n")
    print("| comparison (true nDCG@10) | method | median queries to detection | 80th percentile "
          "| detected within budget | wrong direction | A/B ÷ interleaving (median / p80) |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


def _ratio(x: float, y: float, budget: int) -> str:
    if math.isinf(x) and math.isinf(y):
        return "n/a"
    if math.isinf(x):
        return f"> {budget / y:.1f}×"
    if math.isinf(y):
        return "< 1"
    return f"{x / y:.1f}×"


if __name__ == "__main__":
    sys.exit(main())
