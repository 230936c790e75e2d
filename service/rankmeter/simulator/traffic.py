"""Search traffic: queries by Zipf popularity, rankers by a traffic split, clicks from a
position-based click model driven by the hidden grades, dwell times by grade, some
add-to-carts and purchases, a share of explicit judgments, duplicates and a little
disorder in delivery — the shape of a real event pipeline.

Position-based model (Craswell et al., WSDM 2008; Chuklin et al., Click Models for Web
Search, 2015): P(click at rank r) = P(examine r) · P(attractive | grade), with
P(examine r) = 1 / r^0.9.
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
                 disorder: float = 0.05, corpus: Corpus | None = None) -> None:
        self.corpus = corpus or Corpus(seed=seed)
        self.index = Index(self.corpus)
        self.rankers = list(rankers)
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
        ranker = self.rankers[0] if self.rng.random() < self.split else self.rankers[1]
        if self.regression_at is not None and elapsed_s >= self.regression_at and ranker is self.rankers[0]:
            ranker = ranker._replace(noise=REGRESSED_NOISE)
        results = self.index.search(query, ranker, 10, self.rng)
        grades = self.true_grades(query)
        self.truth.add(ranker.name, QueryState.from_grades(results, grades, shown_grade=0))
        impression = Event("impressions", qid, {"query_id": qid, "ranker": ranker.name, "timestamp": now_ms,
                                                "results": results, "user_query": query.text})
        feedback = list(self._feedback(qid, results, grades, now_ms))
        if self.rng.random() < self.disorder:
            return feedback + [impression]  # the feedback pipeline outran the impression
        return [impression] + feedback

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
