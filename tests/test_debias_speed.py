"""The bench's speed-ups (bench/debias_agreement.py, docs/benchmarks.md) change no value: each
faster form against the plain one it replaced, kept here as the reference — the pooled
relevance (arrays kept per text), AllPairs' EM step, the held-out score, the corpus's word draws,
the true grades from the postings, BM25 with Python floats, the reactive ranker's cached
scores, and a simulator without its truth tally."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankmeter.debias.clickmodels import MODELS, P_FLOOR, FitLayout, score
from rankmeter.debias.propensity import GRADE, GRADED, Harvester, PairSums, estimate
from rankmeter.simulator import traffic
from rankmeter.simulator.corpus import Corpus, draw
from rankmeter.simulator.traffic import K, Simulator

QUERIES = ["q0", "q1", "q2"]
DOCS = [f"d{i}" for i in range(9)]
closed_query = st.tuples(st.sampled_from(QUERIES), st.lists(st.sampled_from(DOCS), max_size=7),
                         st.dictionaries(st.sampled_from(DOCS), st.sampled_from([0.0, 1.0, 2.0, 3.0]), max_size=5))


def plain_relevance(h: Harvester, query: str, weights: list[float]) -> dict[str, float]:
    """`Harvester.relevance` as it was: the whole [docs, 4, K] table built at every call."""
    docs = h.by_query.get(query)
    if not docs:
        return {}
    w = np.ones(h.ranks)
    given = weights[:h.ranks]
    w[:len(given)] = given
    w[len(given):] = given[-1]
    names = list(docs)
    table = np.array([h.entries[(query, d)] for d in names])
    graded = table[:, GRADED].sum(axis=1)
    supported = (graded >= h.min_support) & (graded > 0)
    values = table[:, GRADE] @ w
    return {d: float(values[i] / graded[i]) for i, d in enumerate(names) if supported[i]}


@settings(max_examples=200, deadline=None)
@given(log=st.lists(closed_query, max_size=40), capacity=st.integers(1, 15),
       w=st.lists(st.floats(1.0, 10.0), min_size=1, max_size=6), supports=st.lists(st.integers(0, 4), min_size=1))
def test_the_cached_relevance_is_the_plain_one_after_every_change(log, capacity, w, supports):
    h = Harvester(ranks=5, capacity=capacity)
    for i, (q, shown, implicit) in enumerate(log):
        h.observe(q, shown, set(), implicit)
        for read in (q, QUERIES[i % 3], q):  # the query just observed, another, and again
            h.min_support = supports[i % len(supports)]
            assert list(h.relevance(read, w).items()) == list(plain_relevance(h, read, w).items())


def test_a_texts_pooled_arrays_follow_its_entries_and_go_with_an_eviction():
    h = Harvester(ranks=3, capacity=3, min_support=1)
    h.observe("a", ["x", "y"], set(), {"x": 1.0})
    assert "a" not in h._pool  # made at the first read
    assert h.relevance("a", [1.0]) == {"x": 1.0, "y": 0.0}
    h.observe("a", ["y", "x"], set(), {"y": 3.0})
    assert "a" in h._pool  # moved with the entries, not rebuilt
    assert h.relevance("a", [2.0, 1.0]) == {"x": 1.0, "y": 3.0}  # x: (2·1 + 0) / 2, y: (2·3 + 0) / 2
    h.observe("a", ["z"], set(), None)  # a new document, shown without grades: a row of zeros
    assert h.relevance("a", [2.0, 1.0]) == {"x": 1.0, "y": 3.0}
    assert list(h._pool["a"][0]) == list(h.by_query["a"]) == ["x", "y", "z"]
    h.observe("b", ["u"], set(), {})  # capacity 3: a's y goes (least recently shown), and a's arrays
    assert "a" not in h._pool and h.relevance("a", [2.0, 1.0]) == {"x": 1.0}


def plain_estimate(sums: PairSums, min_pairs: float, max_iterations: int, tolerance: float) -> list:
    """`estimate`'s EM as it was written (the connectivity part unchanged, so left out)."""
    use = np.flatnonzero(sums.pairs.sum(axis=1) > 0)
    n = sums.pairs[np.ix_(use, use)]
    c = np.minimum(sums.clicks[np.ix_(use, use)], n)
    nc = n - c
    has = n > 0
    rows = n.sum(axis=1)
    p = np.full(len(use), 0.5)
    rel = np.where(has, 0.5, 0.0)
    for iterations in range(1, max_iterations + 1):
        x = np.minimum(p[:, None] * rel, 1.0 - 1e-12)
        examined = np.where(has, p[:, None] * (1.0 - rel) / (1.0 - x), 0.0)
        relevant = np.where(has, (1.0 - p[:, None]) * rel / (1.0 - x), 0.0)
        p_new = (c + nc * examined).sum(axis=1) / rows
        rel_mass = c + nc * relevant
        rel_new = np.divide(rel_mass + rel_mass.T, n + n.T, out=np.zeros_like(n), where=has)
        change = max(np.abs(p_new - p).max(), np.abs(rel_new - rel).max())
        p, rel = p_new, rel_new
        if change < tolerance:
            break
    return [float(p[i] / p[0]) for i in range(len(use))] + [iterations]


def connected_sums(seed: int, k: int, drift: bool) -> PairSums:
    """Random pair sums whose ranks all link to rank 1 (pairs symmetric, some pairs empty),
    clicks at most the pairs, or with `drift` a little past them and below 0."""
    rng = np.random.default_rng(seed)
    pairs = rng.integers(0, 60, (k, k)).astype(float) * (rng.random((k, k)) < 0.7)
    pairs = np.triu(pairs, 1)
    pairs[0, 1:] += 1  # every rank paired with rank 1
    pairs = pairs + pairs.T
    clicks = pairs * rng.uniform(0.0, 1.0, (k, k))
    if drift:
        clicks += rng.normal(0.0, 1e-9, (k, k))
    return PairSums(clicks, pairs)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("k, iterations, tolerance", [(10, 5000, 1e-10), (27, 1000, 1e-8), (4, 7, 1e-10)])
def test_the_em_step_gives_the_plain_one_bit_for_bit(seed, k, iterations, tolerance):
    sums = connected_sums(seed, k, drift=seed % 2 == 1)
    got = estimate(sums, 0.0, iterations, tolerance)
    want = plain_estimate(sums, 0.0, iterations, tolerance)
    assert got.relative + [got.iterations] == want


def plain_score(layout: FitLayout, ranked, clicked, examine, alphas) -> np.ndarray:
    """`clickmodels.score` as it was: sums in a numpy array, item by item."""
    out = np.zeros(layout.size)
    above = False
    for r, doc in enumerate(ranked[:layout.ranks]):
        c = doc in clicked
        if all(a[r] is not None for a in alphas):
            out[layout.scored().start + r] += 1
            for m in range(len(MODELS)):
                p = min(max(examine[m][r] * alphas[m][r], P_FLOOR), 1.0 - P_FLOOR)
                out[layout.ll(m).start + r] += math.log2(p if c else 1.0 - p)
                i = layout.calibration(m, int(above))
                out[i] += c
                out[i + 1] += p
        above = above or c
    return out


@settings(max_examples=300, deadline=None)
@given(data=st.data(), length=st.integers(0, 10))
def test_the_held_out_score_is_the_plain_one(data, length):
    layout = FitLayout(10)
    ranked = [f"d{i}" for i in range(length)]
    clicked = set(data.draw(st.lists(st.sampled_from(ranked), max_size=4))) if ranked else set()
    unit = st.floats(0.0, 1.0)
    examine = [data.draw(st.lists(unit, min_size=length, max_size=length)) for _ in MODELS]
    alphas = [data.draw(st.lists(st.one_of(st.none(), unit), min_size=length, max_size=length)) for _ in MODELS]
    got = score(layout, ranked, clicked, examine, alphas)
    assert np.array_equal(got, plain_score(layout, ranked, clicked, examine, alphas))


def test_the_corpus_draws_its_words_as_generator_choice_does():
    weights = np.array([1.0 / (r + 1) ** 1.05 for r in range(2000)])
    weights /= weights.sum()
    cdf = weights.cumsum()
    cdf /= cdf[-1]
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    for size in (0, 1, 57, 160):
        assert np.array_equal(draw(a, cdf, size), b.choice(2000, size, p=weights))
    assert a.random() == b.random()  # the generators are where they would be


def plain_true_grades(sim: Simulator, query) -> dict[str, int]:
    candidates = {i for t in query.terms for i, _ in sim.index.postings.get(t, ())}
    docs = sim.corpus.documents
    return {docs[i].doc_id: g for i in candidates if (g := sim.corpus.true_grade(query, docs[i])) > 0}


def test_true_grades_from_the_postings_are_the_corpus_grades_in_the_same_order():
    sim = Simulator(seed=5, corpus=Corpus(seed=5, documents=600, queries=80))
    for query in sim.corpus.queries:
        got, want = sim.true_grades(query), plain_true_grades(sim, query)
        assert list(got.items()) == list(want.items())


def test_bm25_scores_are_the_numpy_scalar_ones():
    sim = Simulator(seed=2, corpus=Corpus(seed=2, documents=400, queries=30))
    index = sim.index
    for query in sim.corpus.queries:
        for ranker in traffic.DEFAULT_RANKERS:
            want: dict[int, float] = {}
            for term in query.terms:
                idf = index.idf.get(term, 0.0)
                for i, tf in index.postings.get(term, ()):
                    norm = ranker.k1 * (1 - ranker.b + ranker.b * index.lengths[i] / index.avgdl)
                    want[i] = want.get(i, 0.0) + idf * tf * (ranker.k1 + 1) / (tf + norm)
            assert index.scores(query, ranker) == want


def plain_reactive_search(sim: Simulator, query, ranker, rng) -> list[str]:
    """`traffic.reactive_search` as it was: BM25 scored afresh at every answer."""
    scores = sim.index.scores(query, ranker)
    docs = sim.corpus.documents
    ids = list(scores)
    values = np.fromiter(scores.values(), dtype=float)
    top = values.max()
    if ranker.noise:
        values = values + rng.normal(0.0, ranker.noise * top, len(values))
    recent = np.array([sim._recent[query.text].get(docs[i].doc_id, 0.0) for i in ids])
    values += sim.react * top * recent / (1.0 + recent)
    return [docs[ids[i]].doc_id for i in np.argsort(-values, kind="stable")[:K]]


def events(sim: Simulator, queries: int) -> list:
    return [e for i in range(queries) for e in sim.query_events(1_700_000_000_000 + i * 500, i * 0.5)]


def test_the_reactive_ranker_with_cached_scores_shows_the_same_lists(monkeypatch):
    corpus = dict(documents=500, queries=40)
    fast = events(Simulator(seed=4, run_id="r", react=1.0, corpus=Corpus(seed=4, **corpus)), 1500)
    monkeypatch.setattr(traffic, "reactive_search", plain_reactive_search)
    plain = events(Simulator(seed=4, run_id="r", react=1.0, corpus=Corpus(seed=4, **corpus)), 1500)
    assert fast == plain


def test_a_simulator_without_its_tally_sends_the_same_traffic():
    with_tally, without = Simulator(seed=9, run_id="t"), Simulator(seed=9, run_id="t", tally=False)
    assert events(with_tally, 800) == events(without, 800)
    assert with_tally.truth.means() and without.truth.means() == {}
    assert Counter(e.stream for e in events(without, 10))["impressions"] == 10


def test_a_nan_from_corrupt_stored_sums_stays_where_the_plain_em_leaves_it():
    """Review (session 10): with the posteriors unmasked where a pair has no data, a NaN
    propensity reached every rank through 0 × NaN on asymmetric (corrupt) stored sums."""
    import warnings
    from rankmeter.debias.propensity import PairSums, estimate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = estimate(PairSums(np.array([[0.0, 30.0], [0.0, 0.0]]), np.array([[0.0, 55.0], [0.0, 0.0]])), 0.0)
    assert got.relative[0] == 1.0   # (the plain EM's [1.0, nan]; unmasked: [nan, nan])
