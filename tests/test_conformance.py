"""Every measure against pytrec_eval (trec_eval) on random qrels and runs, per query and
averaged; and incremental state updates against from-scratch construction."""

import math
import random

import numpy as np
import pytrec_eval
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankmeter.engine import QueryState, evaluate, macro, parse, stack, stack_scored
from rankmeter.trec import rank

# Our name -> pytrec_eval's measure request and result key.
ORACLE = {
    "P@1": ("P.1", "P_1"), "P@5": ("P.5", "P_5"), "P@10": ("P.10", "P_10"),
    "R@5": ("recall.5", "recall_5"), "R@10": ("recall.10", "recall_10"),
    "AP": ("map", "map"), "AP@5": ("map_cut.5", "map_cut_5"),
    "nDCG": ("ndcg", "ndcg"), "nDCG@3": ("ndcg_cut.3", "ndcg_cut_3"),
    "nDCG@10": ("ndcg_cut.10", "ndcg_cut_10"),
    "RR": ("recip_rank", "recip_rank"), "Rprec": ("Rprec", "Rprec"), "Bpref": ("bpref", "bpref"),
    "IPrec": ("11pt_avg", "11pt_avg"),
    **{f"IPrec@{p / 10}": ("iprec_at_recall", f"iprec_at_recall_{p / 10:.2f}") for p in range(11)},
    "SetP": ("set_P", "set_P"), "SetR": ("set_recall", "set_recall"), "SetF": ("set_F", "set_F"),
    "Success@1": ("success.1", "success_1"), "Success@5": ("success.5", "success_5"),
}

DOCS = [f"d{i}" for i in range(14)]


@st.composite
def collections(draw):
    """Random qrels and run: graded 0..4, tied scores, short and empty lists, unjudged
    documents, queries with one relevant document or none."""
    qrels, run = {}, {}
    for q in range(draw(st.integers(1, 6))):
        qid = f"q{q}"
        judged = draw(st.lists(st.sampled_from(DOCS), min_size=1, max_size=12, unique=True))
        qrels[qid] = {d: draw(st.integers(0, 4)) for d in judged}
        # min_size=1: a query with no results is absent from a TREC run, and pytrec_eval
        # crashes (SIGSEGV) on an empty one; empty lists are tested in test_engine_examples.
        shown = draw(st.lists(st.sampled_from(DOCS), min_size=1, max_size=13, unique=True))
        run[qid] = {d: float(draw(st.integers(0, 4))) for d in shown}
    return qrels, run


def ours(qrels, run, names, level):
    qids = [q for q in run if q in qrels]
    states = [QueryState.from_grades(rank(run[q]), qrels[q], level) for q in qids]
    measures = [parse(n) for n in names]
    results = evaluate(measures, stack(states))
    return qids, {str(m): (m, r) for m, r in results.items()}


def oracle(qrels, run, requests, level):
    return pytrec_eval.RelevanceEvaluator(qrels, set(requests), relevance_level=level).evaluate(run)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(collections(), st.integers(1, 3))
def test_every_measure_equals_trec_eval(data, level):
    qrels, run = data
    qids, results = ours(qrels, run, ORACLE, level)
    expected = oracle(qrels, run, {req for req, _ in ORACLE.values()}, level)
    assert sorted(expected) == sorted(qids)
    for name, (req, key) in ORACLE.items():
        measure, ratio = results[name]
        got = measure.values(ratio)
        want = np.array([expected[q][key] for q in qids])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-9, err_msg=name)
        assert macro(measure, ratio).value == pytest.approx(float(np.mean(want)), abs=1e-9)


@settings(max_examples=150, deadline=None)
@given(collections(), st.sampled_from([0.25, 0.5, 2.0]))
def test_f_beta_equals_trec_eval(data, beta):
    # trec_eval's set_F parameter is β² ("(x+1)·P·R / (R + x·P)"); ours is β, as usual.
    qrels, run = data
    qids, results = ours(qrels, run, [f"SetF(beta={beta})", f"E(beta={beta})"], 1)
    expected = oracle(qrels, run, {f"set_F.{beta * beta}"}, 1)
    want = np.array([expected[q]["set_F"] for q in qids])
    for name, reference in ((f"SetF(beta={beta:g})", want), (f"E(beta={beta:g})", 1 - want)):
        measure, ratio = results[name]
        np.testing.assert_allclose(measure.values(ratio), reference, rtol=0, atol=1e-9)


@settings(max_examples=150, deadline=None)
@given(collections())
def test_exponential_gain_ndcg_equals_trec_eval_on_transformed_grades(data):
    # nDCG with gain 2^g − 1 is trec_eval's linear nDCG on grades 2^g − 1.
    qrels, run = data
    qids, results = ours(qrels, run, ["nDCG(dcg=exp-log2)", "nDCG(dcg=exp-log2)@5"], 1)
    exp_qrels = {q: {d: 2 ** g - 1 for d, g in docs.items()} for q, docs in qrels.items()}
    expected = oracle(exp_qrels, run, {"ndcg", "ndcg_cut.5"}, 1)
    for name, key in (("nDCG(dcg=exp-log2)", "ndcg"), ("nDCG(dcg=exp-log2)@5", "ndcg_cut_5")):
        measure, ratio = results[name]
        want = [expected[q][key] for q in qids]
        np.testing.assert_allclose(measure.values(ratio), want, rtol=0, atol=1e-9)


@settings(max_examples=200, deadline=None)
@given(collections(), st.integers(1, 3))
def test_dcg_and_auc_equal_their_definitions(data, level):
    # Neither is a trec_eval measure: checked against the textbook formula, written plainly.
    qrels, run = data
    qids, results = ours(qrels, run, ["DCG", "DCG@3", "AUC"], level)
    for row, q in enumerate(qids):
        ranking, grades = rank(run[q]), qrels[q]
        g = [grades.get(d, 0) for d in ranking]
        dcg = sum(x / math.log2(i + 2) for i, x in enumerate(g) if x > 0)
        dcg3 = sum(x / math.log2(i + 2) for i, x in enumerate(g[:3]) if x > 0)
        judged = [(i, grades[d] >= level) for i, d in enumerate(ranking) if d in grades]
        pairs = [(i, j) for i, ri in judged if ri for j, rj in judged if not rj]
        auc = sum(i < j for i, j in pairs) / len(pairs) if pairs else math.nan
        for name, want in (("DCG", dcg), ("DCG@3", dcg3), ("AUC", auc)):
            measure, ratio = results[name]
            got = measure.values(ratio)[row]
            assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, abs=1e-9), name


@st.composite
def scored_collections(draw):
    """Like `collections`, plus what a run file can hold beyond them: negative and fractional
    scores, 0.0 beside -0.0, ties among non-ASCII document ids, queries without judgments."""
    docs = DOCS + ["é", "e", "ü1", "Z", "z"]
    scores = st.sampled_from([0.0, -0.0, 1.0, 1.5, -2.25, 1e300, -1e-300, 3.0])
    qrels, run = draw(collections())
    for q in range(draw(st.integers(0, 3))):
        shown = draw(st.lists(st.sampled_from(docs), min_size=1, max_size=15, unique=True))
        run[f"s{q}"] = {d: draw(scores) for d in shown}
        judged = draw(st.lists(st.sampled_from(docs), max_size=12, unique=True))
        qrels[f"s{q}"] = {d: draw(st.sampled_from([-1, 0, 0.5, 1, 2, 3])) for d in judged}
    return qrels, run


@settings(max_examples=400, deadline=None)
@given(scored_collections(), st.sampled_from([0.5, 1, 2, 3]))
def test_stack_scored_is_stack_of_states(data, level):
    """`rankmeter eval`'s column-wise batch is exactly (bit for bit) the batch of per-query
    states that the live service's path and the trec_eval tests above use."""
    qrels, run = data
    qids = sorted(q for q in run if q in qrels)
    want = stack([QueryState.from_grades(rank(run[q]), qrels[q], level) for q in qids])
    got = stack_scored([run[q] for q in qids], [qrels[q] for q in qids], level)
    for field, a, b in zip(want._fields, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, field
        np.testing.assert_array_equal(a, b, err_msg=field)


ALL_MEASURES = [*ORACLE, "nDCG(dcg=exp-log2)@5", "DCG@3", "AUC", "SetF(beta=0.5)", "E", "AP@3"]


@settings(max_examples=300, deadline=None)
@given(collections(), st.integers(1, 3), st.booleans(), st.randoms(use_true_random=False))
def test_incremental_updates_equal_from_scratch(data, level, live_view, rnd: random.Random):
    """Grades arriving one by one, in any order, some revised, give exactly the state and
    the values of building from all final grades at once."""
    qrels, run = data
    shown_grade = 0 if live_view else None
    incremental, scratch = [], []
    for q in run:
        ranking, final = rank(run[q]), qrels.get(q, {})
        state = QueryState(ranking, level, shown_grade=shown_grade)
        updates = [(d, rnd.randint(0, 4)) for d in rnd.sample(sorted(final), len(final) // 2)]
        updates += list(final.items())
        rnd.shuffle(updates)
        updates += list(final.items())  # the final grade wins, whatever came before
        for doc, grade in updates:
            state.set_grade(doc, grade)
        incremental.append(state)
        scratch.append(QueryState.from_grades(ranking, final, level, shown_grade=shown_grade))
    for a, b in zip(incremental, scratch):
        assert a.grades == b.grades and a.ideal_ascending == b.ideal_ascending
        assert (a.num_rel, a.num_nonrel) == (b.num_rel, b.num_nonrel)
        assert (a.row_grades, a.row_judged) == (b.row_grades, b.row_judged)
    measures = [parse(n) for n in ALL_MEASURES]
    got, want = evaluate(measures, stack(incremental)), evaluate(measures, stack(scratch))
    for m in measures:
        np.testing.assert_array_equal(m.values(got[m]), m.values(want[m]), err_msg=str(m))


def test_set_grade_reports_whether_anything_changed():
    state = QueryState(["a", "b"])
    assert state.set_grade("a", 2) is True
    assert state.set_grade("a", 2) is False
    assert state.set_grade("zz", 1) is True  # unshown: counts towards R and the ideal only
    assert (state.num_rel, state.ideal_ascending, state.row_grades) == (2, [1.0, 2.0], [2.0, 0.0])
