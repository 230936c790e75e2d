"""Search traffic: queries by Zipf popularity, rankers by a traffic split, clicks from a
position-based click model driven by the hidden grades, dwell times by grade, some
add-to-carts and purchases, a share of explicit judgments, duplicates and a little
disorder in delivery — the shape of a real event pipeline.

Position-based model (Craswell et al., WSDM 2008; Chuklin et al., Click Models for Web
Search, 2015): P(click at rank r) = P(examine r) · P(attractive | grade), with
P(examine r) = 1 / r^0.9.

With `interleave=(A, B)` every query is answered by a team-draft interleaving of A's and
B's lists (Radlinski, Kurup & Joachims, CIKM 2008), carrying brief §2's
`interleaving: {"experiment": "A-vs-B", "teams": [...]}`; the click model is the same.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

from rankmeter.engine import QueryState, evaluate, parse_all, stack
from rankmeter.simulator.bm25 import Index, Ranker
from rankmeter.simulator.corpus import Corpus, Query

ATTRACTIVE = {0: 0.04, 1: 0.25, 2: 0.55, 3: 0.85}   # P(click | examined, true grade)
DWELL_MEDIAN_S = {0: 4.0, 1: 15.0, 2: 40.0, 3: 80.0}
CART = {2: 0.25, 3: 0.45}                            # P(add to cart | click, grade)
PURCHASE = {2: 0.3, 3: 0.5}                          # P(purchase | add to cart, grade)
TRUTH_MEASURES = ["nDCG@10", "P@10", "AP"]

DEFAULT_RANKERS = (Ranker("bm25-tuned", k1=1.2, b=0.75),
                   Ranker("bm25-degraded", k1=0.3, b=0.1, noise=0.35))
REGRESSED_NOISE = 1.5  # what --regression-at does to the first ranker


def team_draft(a: list[str], b: list[str], k: int, rng: np.random.Generator) -> tuple[list[str], list[int]]:
    """Team-draft interleaving of two rankings (Radlinski, Kurup & Joachims, CIKM 2008).

    In each round a fair coin decides which team picks first; each team in turn adds its
    highest-ranked document not yet in the list. Stops at `k` documents, or when a team
    has nothing left to add (as the paper's algorithm does). Returns the list and the team
    (0 for `a`, 1 for `b`) of each position: every prefix's team sizes differ by at most
    one, each team's documents are in its ranker's order, no document appears twice.
    """
    lists = (a, b)
    nexts = [0, 0]  # the first not-yet-examined rank of each list
    shown: list[str] = []
    teams: list[int] = []
    seen: set[str] = set()
    while len(shown) < k:
        first = int(rng.random() < 0.5)
        for team in (first, 1 - first):
            ranking, i = lists[team], nexts[team]
            while i < len(ranking) and ranking[i] in seen:
                i += 1
            nexts[team] = i
            if i == len(ranking) or len(shown) == k:
                return shown, teams
            seen.add(ranking[i])
            shown.append(ranking[i])
            teams.append(team)
    return shown, teams


class Event(NamedTuple):
    stream: str  # "impressions" or "feedback"
    key: str     # the query id: both topics are keyed by it
    value: dict


class TruthTally:
    """Running means of the true metrics (from hidden grades) per ranker."""

    def __init__(self) -> None:
        self.measures = parse_all(TRUTH_MEASURES)
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}

    def add(self, ranker: str, state: QueryState) -> None:
        if state.num_rel == 0:
            return  # as the live service's default: queries with a relevant document
        ratios = evaluate(self.measures, stack([state]))
        values = np.array([m.values(r)[0] for m, r in ratios.items()])
        self.sums[ranker] = self.sums.get(ranker, 0) + values
        self.counts[ranker] = self.counts.get(ranker, 0) + 1

    def means(self) -> dict[str, dict[str, float]]:
        return {r: dict(zip(TRUTH_MEASURES, (self.sums[r] / self.counts[r]).tolist())) for r in self.sums}


class Simulator:
    def __init__(self, seed: int = 7, rankers: tuple[Ranker, ...] = DEFAULT_RANKERS,
                 split: float = 0.5, regression_at: float | None = None,
                 judgment_share: float = 0.03, duplicate_share: float = 0.01,
                 disorder: float = 0.05, corpus: Corpus | None = None,
                 interleave: tuple[str, str] | None = None) -> None:
        self.corpus = corpus or Corpus(seed=seed)
        self.index = Index(self.corpus)
        self.rankers = list(rankers)
        self.interleave: tuple[Ranker, Ranker] | None = None
        if interleave is not None:
            by_name = {r.name: r for r in self.rankers}
            unknown = [n for n in interleave if n not in by_name]
            if len(interleave) != 2 or interleave[0] == interleave[1] or unknown:
                raise ValueError(f"interleave needs two different rankers of {', '.join(by_name)}; "
                                 f"got {','.join(interleave)}")
            self.interleave = (by_name[interleave[0]], by_name[interleave[1]])
            self.experiment = f"{interleave[0]}-vs-{interleave[1]}"
        self.split = split
        self.regression_at = regression_at
        self.judgment_share = judgment_share
        self.duplicate_share = duplicate_share
        self.disorder = disorder
        self.rng = np.random.default_rng(seed)
        self.run_id = os.urandom(3).hex()  # query ids stay unique across runs
        self.truth = TruthTally()
        self._ideal: dict[str, dict[str, int]] = {}
        self._queries = 0

    def true_grades(self, query: Query) -> dict[str, int]:
        """Every document with a positive true grade (they all contain a query term)."""
        grades = self._ideal.get(query.text)
        if grades is None:
            candidates = {i for t in query.terms for i, _ in self.index.postings.get(t, ())}
            docs = self.corpus.documents
            grades = {docs[i].doc_id: g for i in candidates if (g := self.corpus.true_grade(query, docs[i])) > 0}
            self._ideal[query.text] = grades
        return grades

    def query_events(self, now_ms: int, elapsed_s: float) -> list[Event]:
        """One answered search and what its user did, in delivery order."""
        self._queries += 1
        qid = f"{self.run_id}-{self._queries}"
        query = self.corpus.sample_query(self.rng)
        if self.interleave is not None:
            a, b = (self._regressed(r, elapsed_s) for r in self.interleave)
            lists = self.index.search(query, a, 10, self.rng), self.index.search(query, b, 10, self.rng)
            results, team_of = team_draft(*lists, 10, self.rng)
            name = self.experiment
            extra = {"interleaving": {"experiment": name, "teams": [self.interleave[t].name for t in team_of]}}
        else:
            ranker = self._regressed(self.rankers[0] if self.rng.random() < self.split else self.rankers[1], elapsed_s)
            results = self.index.search(query, ranker, 10, self.rng)
            name, extra = ranker.name, {}
        grades = self.true_grades(query)
        self.truth.add(name, QueryState.from_grades(results, grades, shown_grade=0))
        impression = Event("impressions", qid, {"query_id": qid, "ranker": name, "timestamp": now_ms,
                                                "results": results, "user_query": query.text, **extra})
        feedback = list(self._feedback(qid, results, grades, now_ms))
        if self.rng.random() < self.disorder:
            return feedback + [impression]  # the feedback pipeline outran the impression
        return [impression] + feedback

    def _regressed(self, ranker: Ranker, elapsed_s: float) -> Ranker:
        """--regression-at: from then on the first ranker is degraded (as a team, too)."""
        if self.regression_at is not None and elapsed_s >= self.regression_at and ranker is self.rankers[0]:
            return ranker._replace(noise=REGRESSED_NOISE)
        return ranker

    def _feedback(self, qid: str, results: list[str], grades: dict[str, int], now_ms: int) -> Iterator[Event]:
        t = now_ms
        n = 0
        for rank, doc in enumerate(results, start=1):
            grade = grades.get(doc, 0)
            if self.rng.random() >= ATTRACTIVE[grade] / rank ** 0.9:
                continue
            t += int(self.rng.uniform(1_000, 8_000))
            dwell = int(self.rng.lognormal(math.log(DWELL_MEDIAN_S[grade]), 0.5) * 1000)
            n += 1
            yield from self._maybe_twice(Event("feedback", qid, {"query_id": qid, "action": "click", "doc_id": doc,
                                                               "position": rank, "dwell_ms": dwell, "timestamp": t,
                                                               "event_id": f"{qid}.{n}"}))
            if self.rng.random() < CART.get(grade, 0.0):
                n += 1
                yield Event("feedback", qid, {"query_id": qid, "action": "add_to_cart", "doc_id": doc,
                                              "timestamp": t + dwell, "event_id": f"{qid}.{n}"})
                if self.rng.random() < PURCHASE.get(grade, 0.0):
                    n += 1
                    yield Event("feedback", qid, {"query_id": qid, "action": "purchase", "doc_id": doc,
                                                  "timestamp": t + dwell + 5_000, "event_id": f"{qid}.{n}"})
        if self.rng.random() < self.judgment_share:  # an editor judges the top five
            for doc in results[:5]:
                n += 1
                yield Event("feedback", qid, {"query_id": qid, "action": "judgment", "doc_id": doc,
                                              "grade": grades.get(doc, 0), "timestamp": t, "event_id": f"{qid}.{n}"})

    def _maybe_twice(self, event: Event) -> Iterator[Event]:
        yield event
        if self.rng.random() < self.duplicate_share:
            yield event  # a producer retry: same event_id

    def run(self, send: Callable[[Event], None], rate: float, duration: float | None = None,
            count: int | None = None, stop: Callable[[], bool] = lambda: False,
            clock: Callable[[], float] = time.time,
            progress: Callable[[int, float], None] | None = None) -> int:
        """Send events at about `rate` per second until `duration` seconds or `count`
        events have passed, or `stop()` says so; `progress(sent, elapsed)` every 10 s.
        Returns the number sent."""
        start = clock()
        sent = 0
        reported = start
        while not stop():
            elapsed = clock() - start
            if (duration is not None and elapsed >= duration) or (count is not None and sent >= count):
                break
            for event in self.query_events(int(clock() * 1000), elapsed):
                send(event)
                sent += 1
            if progress is not None and clock() - reported >= 10:
                reported = clock()
                progress(sent, reported - start)
            ahead = sent / rate - (clock() - start)
            if ahead > 0:
                time.sleep(min(ahead, 0.5))
        return sent
