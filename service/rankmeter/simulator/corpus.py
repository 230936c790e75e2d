"""A seeded synthetic corpus and query population with hidden true relevance grades.

Topics each favour their own words of a shared vocabulary; a document is mostly about
one topic; a query names a topic with two or three of its characteristic words. The
true grade of (query, document) — 0 to 3 — follows from topic and term overlap, and is
what the click model reacts to (and what `--truth` reports metrics from).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import NamedTuple

import numpy as np


class Document(NamedTuple):
    doc_id: str
    topic: int
    terms: Counter  # term -> frequency
    length: int


class Query(NamedTuple):
    text: str
    topic: int
    terms: tuple[str, ...]


class Corpus:
    def __init__(self, seed: int = 7, documents: int = 3000, topics: int = 30, vocabulary: int = 2000,
                 queries: int = 400, zipf: float = 1.1) -> None:
        rnd = random.Random(seed)
        self.vocabulary = [f"w{i}" for i in range(vocabulary)]
        # Each topic's word distribution: a Zipf law over its own shuffle of the vocabulary.
        weights = np.array([1.0 / (r + 1) ** 1.05 for r in range(vocabulary)])
        weights /= weights.sum()
        cdf = weights.cumsum()
        cdf /= cdf[-1]
        self.topic_words = [rnd.sample(self.vocabulary, vocabulary) for _ in range(topics)]
        background = rnd.sample(self.vocabulary, vocabulary)
        nrng = np.random.default_rng(seed)
        self.documents: list[Document] = []
        for d in range(documents):
            topic = rnd.randrange(topics)
            length = rnd.randint(40, 160)
            on_topic = int(length * rnd.uniform(0.5, 0.85))
            words = [self.topic_words[topic][i] for i in draw(nrng, cdf, on_topic)]
            words += [background[i] for i in draw(nrng, cdf, length - on_topic)]
            self.documents.append(Document(f"doc{d:05d}", topic, Counter(words), length))
        self.by_id = {doc.doc_id: doc for doc in self.documents}
        self.queries: list[Query] = []
        for q in range(queries):
            topic = rnd.randrange(topics)
            # Characteristic words: frequent in the topic, skipping the very top few that
            # every topic shares less distinctively.
            terms = tuple(rnd.sample(self.topic_words[topic][3:40], rnd.choice((2, 2, 3))))
            self.queries.append(Query(" ".join(terms), topic, terms))
        popularity = np.array([1.0 / (r + 1) ** zipf for r in range(queries)])
        self.popularity = popularity / popularity.sum()
        self._rng = nrng

    def sample_query(self, rng: np.random.Generator) -> Query:
        return self.queries[int(rng.choice(len(self.queries), p=self.popularity))]

    def true_grade(self, query: Query, doc: Document) -> int:
        """3: on topic and every query term in it; 2: on topic and most terms;
        1: on topic with one term, or off topic with every term; 0 otherwise."""
        present = sum(1 for t in query.terms if doc.terms.get(t, 0) > 0)
        return grade_of(doc.topic == query.topic, present, len(query.terms))


def grade_of(on_topic: bool, present: int, terms: int) -> int:
    """`Corpus.true_grade` from the topic match and the query terms present of `terms`."""
    share = present / terms
    if on_topic:
        return 3 if share == 1 else 2 if share >= 0.5 else 1 if present else 0
    return 1 if share == 1 else 0


def draw(rng: np.random.Generator, cdf: np.ndarray, size: int) -> np.ndarray:
    """`rng.choice(len(cdf), size, p=...)` with `cdf` its normalised cumulative sum: the
    same uniforms drawn and looked up as `Generator.choice` does, without its per-call
    checks and cumulative sum (most of a corpus's build)."""
    return cdf.searchsorted(rng.random(size), side="right")
