"""BM25 rankers over the synthetic corpus.

score(d, q) = Σ_{t ∈ q} IDF(t) · f(t, d)·(k1 + 1) / (f(t, d) + k1·(1 − b + b·|d| / avgdl)),
IDF(t) = ln(1 + (N − n(t) + 0.5) / (n(t) + 0.5))  (Robertson & Zaragoza, 2009; the seed's
formula, with Lucene's non-negative IDF). `Ranker` adds a `noise` knob: Gaussian noise
on the scores, in units of the query's top score, to degrade a ranker by a known amount.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import NamedTuple

import numpy as np

from rankmeter.simulator.corpus import Corpus, Query


class Ranker(NamedTuple):
    name: str
    k1: float = 1.2
    b: float = 0.75
    noise: float = 0.0  # standard deviation of score noise, relative to the top score


class Index:
    def __init__(self, corpus: Corpus) -> None:
        self.corpus = corpus
        self.postings: dict[str, list[tuple[int, int]]] = defaultdict(list)  # term -> (doc, tf)
        for i, doc in enumerate(corpus.documents):
            for term, tf in doc.terms.items():
                self.postings[term].append((i, tf))
        self.lengths = np.array([doc.length for doc in corpus.documents], dtype=float)
        self.avgdl = float(self.lengths.mean())
        self._length = self.lengths.tolist()  # Python floats: the same sums, without numpy's per-item cost
        self._norm: dict[tuple[float, float], list[float]] = {}
        n = len(corpus.documents)
        self.idf = {t: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self.postings.items()}

    def scores(self, query: Query, ranker: Ranker) -> dict[int, float]:
        norms = self._norms(ranker)
        k1 = ranker.k1 + 1
        out: dict[int, float] = defaultdict(float)
        for term in query.terms:
            idf = self.idf.get(term, 0.0)
            for i, tf in self.postings.get(term, ()):
                out[i] += idf * tf * k1 / (tf + norms[i])
        return out

    def _norms(self, ranker: Ranker) -> list[float]:
        """k1 · (1 − b + b·|d| / avgdl) of every document, once per (k1, b)."""
        key = (ranker.k1, ranker.b)
        if key not in self._norm:
            self._norm[key] = [ranker.k1 * (1 - ranker.b + ranker.b * n / self.avgdl) for n in self._length]
        return self._norm[key]

    def search(self, query: Query, ranker: Ranker, k: int, rng: np.random.Generator) -> list[str]:
        scores = self.scores(query, ranker)
        if not scores:
            return []
        docs = np.fromiter(scores.keys(), dtype=np.int64)
        values = np.fromiter(scores.values(), dtype=float)
        if ranker.noise:
            values = values + rng.normal(0.0, ranker.noise * values.max(), len(values))
        top = docs[np.argsort(-values, kind="stable")[:k]]
        return [self.corpus.documents[i].doc_id for i in top]
