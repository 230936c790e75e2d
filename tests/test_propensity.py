"""Position-bias estimation (rankmeter.debias.propensity), IPW grades (rankmeter.debias.ipw),
the pooled per-query-text ideal of the debiased nDCG (Harvester.ideal_dcg) and the
simulator's examination curves (rankmeter.simulator.clicks)."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankmeter.debias import Harvester, PairSums, dcg, estimate, grades, merge, weights
from rankmeter.engine import QueryState, evaluate, parse, stack
from rankmeter.simulator.clicks import (
    CONTINUE,
    EXAMINATION,
    EXAMINE,
    cascade,
    click_model,
    dcm,
    examination,
    pbm,
)
from rankmeter.simulator.traffic import Simulator

TOLERANCE = 0.05  # |estimated − true p_k/p_1| at every rank 1..10, 6,000 simulator queries


def simulated_log(curve: str, queries: int, seed: int) -> tuple[Harvester, np.ndarray]:
    """The simulator's traffic (both rankers, pbm with `curve`) harvested by one Harvester;
    and the simulator's true curve relative to rank 1."""
    sim = Simulator(seed=seed, run_id="t", examination=curve, track_examination=True)
    harvester = Harvester()
    for i in range(queries):
        events = sim.query_events(1_700_000_000_000 + i * 500, i * 0.5)
        impression = next(e.value for e in events if e.stream == "impressions")
        clicked = {e.value["doc_id"] for e in events if e.value.get("action") == "click"}
        harvester.observe(impression["user_query"], impression["results"], clicked)
    true = sim.true_examination()
    return harvester, true / true[0]


def test_estimate_recovers_the_simulators_curve_and_a_wrong_curve_fails_the_tolerance():
    # A curve the estimator was not built around (steeper than the simulator's default).
    harvester, true = simulated_log("power-1.5", 6000, seed=11)
    np.testing.assert_allclose(true, EXAMINATION["power-1.5"][:10] / EXAMINATION["power-1.5"][0])
    est = estimate(harvester.sums).relative
    assert all(p is not None for p in est)
    error = np.abs(np.array(est) - true)
    assert error.max() < TOLERANCE, error.round(3)
    # The tolerance is not vacuous: the default curve (1/r^0.9) is far outside it.
    wrong = EXAMINATION["power-0.9"][:10]
    assert np.abs(np.array(est) - wrong).max() > 3 * TOLERANCE


def synthetic_log(rng: np.random.Generator, impressions: int, curve: np.ndarray,
                  queries: int = 40, docs: int = 15):
    """Fast position-based traffic: per query, documents with a relevance in [0, 1]; half
    the impressions from a fixed ranker, half from a noisy one (the rank changes, the
    relevance does not); clicks by the simulator's `pbm` with `curve`."""
    relevance = rng.uniform(0.05, 0.9, (queries, docs))
    score = relevance + rng.normal(0, 0.2, (queries, docs))
    for _ in range(impressions):
        q = int(rng.zipf(1.3) - 1) % queries
        noisy = score[q] + (rng.normal(0, 0.5, docs) if rng.random() < 0.5 else 0.0)
        order = np.argsort(-noisy)[:10]
        clicks = pbm(relevance[q, order], rng, curve)
        yield f"q{q}", [f"d{d}" for d in order], {f"d{order[r]}" for r in clicks}


def test_error_shrinks_with_more_data():
    curve = EXAMINATION["exp-0.75"]
    truth = curve[:10] / curve[0]

    def rmse(n: int) -> float:
        errors = []
        for seed in range(2):
            h = Harvester()
            for q, shown, clicked in synthetic_log(np.random.default_rng(seed), n, curve):
                h.observe(q, shown, clicked)
            errors.append(np.array(estimate(h.sums, min_pairs=1).relative, dtype=float) - truth)
        return float(np.sqrt(np.mean(np.square(errors))))

    small, large = rmse(400), rmse(6400)
    # 16 times the data: the standard error a quarter; asserted at half, with room for noise.
    assert large < 0.5 * small, (small, large)


def plain_pair_sums(log, k: int = 10) -> tuple[list[list[float]], list[list[float]]]:
    """Intervention harvesting written out: impressions and clicks per (query, doc, rank),
    then for every (query, doc) and every pair of ranks it was shown at, its CTR at the
    first rank (Agarwal et al. 2019, §4.2, weights 1 / impressions)."""
    shown: dict[tuple[str, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    clicks: dict[tuple[str, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for q, docs, clicked in log:
        for rank, d in enumerate(docs[:k]):
            shown[q, d][rank] += 1
            clicks[q, d][rank] += d in clicked
    c = [[0.0] * k for _ in range(k)]
    n = [[0.0] * k for _ in range(k)]
    for key, ranks in shown.items():
        for a in ranks:
            for b in ranks:
                if a != b:
                    c[a][b] += clicks[key][a] / ranks[a]
                    n[a][b] += 1
    return c, n


def test_harvested_sums_equal_a_plain_implementation():
    log = list(synthetic_log(np.random.default_rng(3), 1500, EXAMINE))
    h = Harvester()
    for entry in log:
        h.observe(*entry)
    c, n = plain_pair_sums(log)
    np.testing.assert_allclose(h.sums.clicks, c, atol=1e-9)
    np.testing.assert_array_equal(h.sums.pairs, n)


def test_allpairs_estimate_equals_a_direct_maximisation_of_its_likelihood():
    scipy_optimize = pytest.importorskip("scipy.optimize")
    log = list(synthetic_log(np.random.default_rng(5), 600, EXAMINATION["power-1.5"]))
    h = Harvester(ranks=5)
    for q, shown, clicked in log:
        h.observe(q, shown[:5], clicked)
    c, n = h.sums.clicks, h.sums.pairs
    k = 5
    upper = [(a, b) for a in range(k) for b in range(a + 1, k) if n[a, b] > 0]

    def nll(theta: np.ndarray) -> float:
        # p_k and the symmetric c_{k,k'} through a logistic: the likelihood of the module's
        # docstring, written out pair by pair.
        p = 1 / (1 + np.exp(-theta[:k]))
        rel = 1 / (1 + np.exp(-theta[k:]))
        total = 0.0
        for i, (a, b) in enumerate(upper):
            for x, y in ((a, b), (b, a)):
                prob = p[x] * rel[i]
                total -= c[x, y] * math.log(prob) + (n[x, y] - c[x, y]) * math.log(1 - prob)
        return total

    best = scipy_optimize.minimize(nll, np.zeros(k + len(upper)), method="L-BFGS-B",
                                   options={"maxiter": 20000, "ftol": 1e-15, "gtol": 1e-10})
    p = 1 / (1 + np.exp(-best.x[:k]))
    ours = estimate(h.sums, min_pairs=1)
    np.testing.assert_allclose(ours.relative, p / p[0], rtol=5e-3)


def test_sums_are_additive_across_partitions():
    log = list(synthetic_log(np.random.default_rng(8), 1200, EXAMINE))
    # Two partitions by query text: no (query, doc) spans both, so harvesting the union in
    # one place and merging the halves' sums must agree exactly.
    halves = [Harvester(), Harvester()]
    union = Harvester()
    for q, shown, clicked in log:
        halves[int(q[1:]) % 2].observe(q, shown, clicked)
        union.observe(q, shown, clicked)
    merged = merge(h.sums for h in halves)
    np.testing.assert_allclose(merged.clicks, union.sums.clicks, atol=1e-9)
    np.testing.assert_array_equal(merged.pairs, union.sums.pairs)
    assert estimate(merged).relative == pytest.approx(estimate(union.sums).relative, abs=1e-9)
    # What a checkpoint stores comes back the same.
    back = PairSums.from_vector(merged.to_vector())
    np.testing.assert_array_equal(back.clicks, merged.clicks)
    np.testing.assert_array_equal(back.pairs, merged.pairs)


def test_capacity_bounds_the_table_and_evicted_contributions_stay():
    h = Harvester(ranks=3, capacity=4)
    h.observe("q", ["a", "b", "c"], {"a"})
    h.observe("q", ["b", "a", "c"], {"a"})  # a: CTR 1 at ranks 1 and 2; b: 0 at both
    before = PairSums(h.sums.clicks.copy(), h.sums.pairs.copy())
    assert before.clicks[0, 1] == 1.0 and before.clicks[1, 0] == 1.0
    assert before.pairs[0, 1] == 2  # a and b were each shown at ranks 1 and 2
    h.observe("r", ["x", "y", "z"], set())  # 6 entries > 4: the two oldest go
    assert len(h.entries) == 4 and h.evicted == 2
    np.testing.assert_array_equal(h.sums.pairs, before.pairs)
    np.testing.assert_array_equal(h.sums.clicks, before.clicks)


def test_minimum_support_withholds_thin_ranks():
    sums = PairSums.zeros(4)
    sums.pairs[0, 1] = sums.pairs[1, 0] = 500
    sums.clicks[0, 1], sums.clicks[1, 0] = 200, 100
    sums.pairs[0, 2] = sums.pairs[2, 0] = 20  # rank 3: too few pairs
    sums.clicks[0, 2], sums.clicks[2, 0] = 8, 2
    est = estimate(sums, min_pairs=100)
    assert est.relative[0] == 1.0
    assert est.relative[1] == pytest.approx(0.5, abs=1e-6)  # one pair: the ratio of its CTRs
    assert est.relative[2] is None and est.relative[3] is None
    assert est.support == [520, 500, 20, 0]
    assert estimate(sums, min_pairs=1000).relative == [None] * 4  # rank 1 itself too thin


def test_ipw_grades_by_hand():
    shown = ["a", "b", "c", "d", "e", "f", "a"]  # "a" again: keeps its first rank
    implicit = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 1.0, "e": 1.0, "f": 1.0}
    propensities = [1.0, 0.5, 0.25, None, 0.05]
    # a: 1/1; b: 1/0.5 = 2; c: 2 × 1/0.25 = 8; d: no estimate, rank 3's weight 4 carries on;
    # e: 1/0.05 = 20, clipped at 10; f: past the estimates, rank 5's (clipped) weight; and
    # its judgment wins.
    got = grades(shown, implicit, propensities, explicit={"f": 3.0, "z": 2.0})
    assert got == {"a": 1.0, "b": 2.0, "c": 8.0, "d": 4.0, "e": 10.0, "f": 3.0, "z": 2.0}
    # Through the engine: DCG@5 = 1 + 2/log2 3 + 8/2 + 4/log2 5 + 10/log2 6.
    state = QueryState.from_grades(shown, got, shown_grade=0)
    dcg = parse("DCG@5")
    value = dcg.values(evaluate([dcg], stack([state]))[dcg])[0]
    assert value == pytest.approx(1 + 2 / math.log2(3) + 4 + 4 / math.log2(5) + 10 / math.log2(6))


def test_ipw_weights_are_clipped_to_one_and_the_maximum():
    assert weights([1.0, 1.2, 0.5, 0.01, 0.0], 5) == [1.0, 1.0, 2.0, 10.0, 10.0]
    assert weights([1.0, 0.1, 0.01], 3, max_weight=5.0) == [1.0, 5.0, 5.0]
    assert weights([None, None], 3) == [1.0, 1.0, 1.0]  # nothing estimated: raw clicks


def test_default_click_model_is_unchanged_and_curves_are_selectable():
    assert click_model("pbm") is pbm and click_model("pbm", "power-0.9") is pbm
    np.testing.assert_array_equal(EXAMINE, 1.0 / np.arange(1, 101) ** 0.9)
    steep = click_model("pbm", "plateau-3")
    assert steep([1.0] * 3, np.random.default_rng(0)) == [0, 1, 2]  # the plateau: all seen
    with pytest.raises(ValueError, match="only the pbm model"):
        click_model("cascade", "power-1.5")
    with pytest.raises(ValueError, match="one of"):
        click_model("pbm", "nope")


@pytest.mark.parametrize("model,fn", [("cascade", cascade), ("dcm", dcm)])
def test_derived_examination_matches_the_click_frequencies(model, fn):
    attractive = np.array([0.5, 0.1, 0.7, 0.3, 0.2])
    e = examination(model, attractive)
    if model == "cascade":
        np.testing.assert_allclose(e, [1, 0.5, 0.45, 0.135, 0.0945])
    else:
        lam = CONTINUE[:5]
        assert e[1] == pytest.approx(1 - 0.5 * (1 - lam[0]))
    rng = np.random.default_rng(1)
    n = 40_000
    counts = np.zeros(5)
    for _ in range(n):
        for r in fn(attractive, rng):
            counts[r] += 1
    expected = e * attractive  # P(click at r) = P(examine r) · a_r
    se = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(counts / n - expected) < 4 * se), (counts / n, expected)


# ---- the pooled ideal (debiased nDCG) ------------------------------------------------

QUERIES = ["q0", "q1", "q2"]
DOCS = [f"d{i}" for i in range(8)]
GRADE_VALUES = st.sampled_from([0.0, 1.0, 2.0, 3.0])

# One closed query: text, shown list (repeats allowed: a repeated id keeps its first rank),
# implicit grades of some of the shown documents, or None (an old call site: not pooled).
closed_query = st.tuples(
    st.sampled_from(QUERIES),
    st.lists(st.sampled_from(DOCS), min_size=0, max_size=7),
    st.one_of(st.none(), st.dictionaries(st.sampled_from(DOCS), GRADE_VALUES, max_size=4)),
)


def plain_ideal(log, w: list[float], ranks: int, min_support: float, depth: int) -> dict[str, float | None]:
    """The pooled ideal written out with loops: per (query, doc) Σ w_rank · grade and the
    graded impressions, r̂ their ratio, the supported documents' r̂ sorted descending,
    Σ r̂_i / log2(i + 1) over the top `depth`; None without a positive one."""
    weighted: dict[tuple[str, str], float] = defaultdict(float)
    graded: dict[tuple[str, str], int] = defaultdict(int)
    for q, shown, implicit in log:
        if implicit is None:
            continue
        seen: list[str] = []
        for d in shown:
            if d not in seen:
                seen.append(d)
        for rank, d in enumerate(seen[:ranks]):
            weighted[q, d] += w[rank] * implicit.get(d, 0.0)
            graded[q, d] += 1
    out: dict[str, float | None] = {}
    for q in QUERIES:
        values = sorted((weighted[key] / graded[key] for key in graded
                         if key[0] == q and graded[key] >= min_support), reverse=True)
        ideal = sum(v / math.log2(i + 2) for i, v in enumerate(values[:depth]) if v > 0)
        out[q] = ideal if ideal > 0 else None
    return out


@settings(max_examples=200, deadline=None)
@given(log=st.lists(closed_query, max_size=30), min_support=st.sampled_from([0, 1, 2, 3]),
       depth=st.integers(1, 6),
       w=st.lists(st.floats(1.0, 10.0), min_size=5, max_size=5))
def test_pooled_ideal_equals_a_plain_implementation(log, min_support, depth, w):
    h = Harvester(ranks=5, min_support=min_support)
    for q, shown, implicit in log:
        h.observe(q, shown, set(), implicit)
    want = plain_ideal(log, w, 5, min_support, depth)
    for q in QUERIES:
        got = h.ideal_dcg(q, w, depth)
        if want[q] is None:
            assert got is None
        else:
            assert got == pytest.approx(want[q], rel=1e-12)


def check_index(h: Harvester) -> None:
    """The per-query index holds exactly the table's (query, document) keys."""
    assert {(q, d) for q, docs in h.by_query.items() for d in docs} == set(h.entries)
    assert all(h.by_query.values())  # no query kept without a document
    # Each text's support: the graded impressions of its documents still held.
    held = defaultdict(float)
    for (q, _), entry in h.entries.items():
        held[q] += sum(entry[3])  # the GRADED row
    assert set(h.graded) <= set(h.by_query)
    assert all(h.support(q) == pytest.approx(held[q], abs=1e-9) for q in h.by_query)


@settings(max_examples=200, deadline=None)
@given(log=st.lists(closed_query, max_size=40), capacity=st.integers(1, 12))
def test_eviction_keeps_the_per_query_index_consistent(log, capacity):
    h = Harvester(ranks=5, capacity=capacity, min_support=1)
    w = [1.0, 2.0, 3.0, 4.0, 5.0]
    for i, (q, shown, implicit) in enumerate(log):
        h.observe(q, shown, set(), implicit)
        check_index(h)
        assert len(h.entries) <= capacity
    # What is held is what an unbounded table would hold for these keys, counted since each
    # key last entered: replay the log into a table of the survivors only.
    survivors = set(h.entries)
    replay = Harvester(ranks=5, min_support=1)
    entered: dict[tuple[str, str], int] = {}
    shadow: list[tuple[str, str]] = []  # an LRU list, least recent first
    for i, (q, shown, _) in enumerate(log):
        for d in list(dict.fromkeys(shown))[:5]:
            if (q, d) in shadow:
                shadow.remove((q, d))
            else:
                entered[q, d] = i
            shadow.append((q, d))
        while len(shadow) > capacity:
            entered.pop(shadow.pop(0))
    assert set(shadow) == survivors
    for i, (q, shown, implicit) in enumerate(log):
        # Only the survivors, from when they last entered, at the ranks they had (repeats
        # dropped first, as observe does, so the stand-ins do not shift a rank).
        mask = [d if (q, d) in survivors and entered[q, d] <= i else f"gone{j}"
                for j, d in enumerate(dict.fromkeys(shown))]
        replay.observe(q, mask, set(), implicit)
    for q in QUERIES:
        got, want = h.ideal_dcg(q, w), replay.ideal_dcg(q, w)
        assert (got is None) == (want is None)
        if got is not None:
            assert got == pytest.approx(want, rel=1e-12)


def test_eviction_by_hand():
    h = Harvester(ranks=3, capacity=3, min_support=1)
    h.observe("a", ["x", "y"], set(), {"x": 1.0})
    h.observe("b", ["z"], set(), {"z": 2.0})
    assert h.by_query == {"a": {"x": None, "y": None}, "b": {"z": None}}
    h.observe("b", ["u"], set(), {"u": 3.0})  # 4 entries: ("a", "x") goes
    assert h.by_query == {"a": {"y": None}, "b": {"z": None, "u": None}}
    assert h.ideal_dcg("a", [1.0, 1.0, 1.0]) is None  # y: shown, never graded above 0
    h.observe("b", ["v", "w"], set(), {})  # a's last document and b's z go
    assert "a" not in h.by_query and h.ideal_dcg("a", [1.0] * 3) is None
    assert h.ideal_dcg("b", [1.0] * 3) == pytest.approx(3.0)  # u: 3 at rank 1
    check_index(h)


def test_pooled_relevance_by_hand():
    h = Harvester(ranks=3, min_support=2)
    w = [1.0, 2.0, 4.0]
    h.observe("q", ["a", "b", "c"], {"a"}, {"a": 1.0})
    h.observe("q", ["b", "a", "c"], {"a"}, {"a": 2.0})
    h.observe("q", ["c", "b"], set())  # grades=None: impressions for the pairs, nothing pooled
    # a: (1·1 + 2·2) / 2 = 2.5; b: 0; c: shown three times, graded twice, never clicked: 0.
    assert h.relevance("q", w) == {"a": 2.5, "b": 0.0, "c": 0.0}
    assert h.ideal_dcg("q", w) == 2.5
    h.min_support = 3  # no document has three graded impressions
    assert h.relevance("q", w) == {} and h.ideal_dcg("q", w) is None
    h.min_support = 1
    h.observe("r", ["a"], set(), {})
    assert h.ideal_dcg("r", w) is None  # shown, never relevant: not judged
    # Ranks past the given weights take the last one.
    assert h.relevance("q", [1.0, 2.0]) == {"a": 2.5, "b": 0.0, "c": 0.0}


@settings(max_examples=200, deadline=None)
@given(shown=st.lists(st.sampled_from(DOCS), max_size=12),
       grades_=st.dictionaries(st.sampled_from(DOCS + ["unshown"]), st.floats(-1.0, 30.0), max_size=8),
       depth=st.integers(1, 12))
def test_dcg_is_the_engines_dcg_bit_for_bit(shown, grades_, depth):
    measure = parse(f"DCG@{depth}")
    state = QueryState.from_grades(shown, grades_, shown_grade=0)
    if not state.ranking:
        assert dcg(shown, grades_, depth) == 0.0
        return
    want = measure.values(evaluate([measure], stack([state]))[measure])[0]
    assert dcg(shown, grades_, depth) == want


def test_pooled_ndcg_orders_two_rankers_where_raw_ndcg_hardly_does():
    """Seeded position-based traffic, two rankers of the same 40 query texts (a good one by
    relevance, a noisy one), grade 1 per click: the raw click nDCG@10 (each list's own
    ideal) compresses the gap; the pooled IPW nDCG@10 keeps it."""
    rng = np.random.default_rng(4)
    curve = EXAMINATION["power-1.5"]
    true_w = weights((curve[:10] / curve[0]).tolist(), 10)
    queries, docs = 40, 15
    relevance = rng.uniform(0.0, 0.9, (queries, docs)) ** 2
    h = Harvester(min_support=5)
    log = []
    for i in range(8000):
        q = int(rng.integers(queries))
        good = i % 2 == 0
        score = relevance[q] + (0.0 if good else rng.normal(0, 0.6, docs))
        order = np.argsort(-score)[:10]
        shown = [f"d{d}" for d in order]
        clicked = {shown[r] for r in pbm(relevance[q, order], rng, curve)}
        implicit = {d: 1.0 for d in clicked}
        h.observe(f"q{q}", shown, clicked, implicit)
        log.append((good, f"q{q}", shown, implicit))
    raw = {True: [], False: []}
    pooled = {True: [], False: []}
    truth = {True: [], False: []}
    ndcg = parse("nDCG@10")
    for good, q, shown, implicit in log[-2000:]:
        state = QueryState.from_grades(shown, implicit, shown_grade=0)
        if state.num_rel:
            raw[good].append(ndcg.values(evaluate([ndcg], stack([state]))[ndcg])[0])
        ideal = h.ideal_dcg(q, true_w)
        if ideal is not None:
            pooled[good].append(dcg(shown, grades(shown, implicit, (curve[:10] / curve[0]).tolist())) / ideal)
        rel = relevance[int(q[1:])]
        best = sorted(rel, reverse=True)
        truth[good].append(dcg(shown, {f"d{d}": rel[d] for d in range(docs)}) / dcg([str(i) for i in range(10)],
                                                                                   {str(i): best[i] for i in range(10)}))
    gap = {name: np.mean(v[True]) - np.mean(v[False]) for name, v in
           (("raw", raw), ("pooled", pooled), ("truth", truth))}
    assert gap["truth"] > 0.1, gap
    assert gap["pooled"] > 0.5 * gap["truth"], gap
    assert gap["raw"] < 0.5 * gap["pooled"], gap
