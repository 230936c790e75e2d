"""trec_eval's other measures (engine/measures_trec.py) against pytrec_eval on random
qrels and runs, per query, with -1 grades (trec_eval's "pooled, not judged") among them;
and the two rounding rules of interpolated precision. The measures pytrec_eval lacks
(unj, rbp, rbp_resid) and trec_eval 10's rounding are checked against trec_eval's own
expected outputs in tests/test_trec_eval_suite.py."""

import numpy as np
import pytrec_eval
from hypothesis import given, settings
from hypothesis import strategies as st

from rankmeter.engine import QueryState, evaluate, parse, stack, stack_scored
from rankmeter.trec import rank

ORACLE = {
    "NumRet": ("num_ret", "num_ret"), "NumRel": ("num_rel", "num_rel"),
    "NumRelRet": ("num_rel_ret", "num_rel_ret"),
    "NumNonRelJudgedRet": ("num_nonrel_judged_ret", "num_nonrel_judged_ret"),
    "SetAP": ("set_map", "set_map"), "SetRelP": ("set_relative_P", "set_relative_P"),
    "RelP@5": ("relative_P.5", "relative_P_5"), "RelP@10": ("relative_P.10", "relative_P_10"),
    "RprecMult@0.2": ("Rprec_mult.0.2", "Rprec_mult_0.20"), "RprecMult@1.4": ("Rprec_mult.1.4", "Rprec_mult_1.40"),
    "RprecMult@2.0": ("Rprec_mult.2.0", "Rprec_mult_2.00"),
    "Utility": ("utility", "utility"), "infAP": ("infAP", "infAP"),
    # Measures older than this change that -1 grades now reach: bpref, AP, nDCG.
    "G": ("G", "G"), "BinG": ("binG", "binG"), "nDCGRel": ("ndcg_rel", "ndcg_rel"), "RnDCG": ("Rndcg", "Rndcg"),
    "Bpref": ("bpref", "bpref"), "AP": ("map", "map"), "nDCG": ("ndcg", "ndcg"),
}
DOCS = [f"d{i}" for i in range(14)]


@st.composite
def collections(draw):
    qrels, run = {}, {}
    for q in range(draw(st.integers(1, 6))):
        judged = draw(st.lists(st.sampled_from(DOCS), min_size=1, max_size=12, unique=True))
        qrels[f"q{q}"] = {d: draw(st.sampled_from([-1, 0, 0, 1, 2, 3])) for d in judged}
        # pytrec_eval's trec_eval (9.x) crashes when every grade of a query is negative.
        qrels[f"q{q}"][judged[0]] = draw(st.integers(0, 3))
        shown = draw(st.lists(st.sampled_from(DOCS), min_size=1, max_size=13, unique=True))
        run[f"q{q}"] = {d: float(draw(st.integers(0, 4))) for d in shown}
    return qrels, run


@settings(max_examples=300, deadline=None)
@given(collections(), st.integers(1, 3))
def test_trec_measures_equal_pytrec_eval(data, level):
    qrels, run = data
    qids = sorted(run)
    measures = [parse(n) for n in ORACLE]
    # Both of the engine's paths: the live service's states and rankmeter eval's columns.
    by_state = evaluate(measures, stack([QueryState.from_grades(rank(run[q]), qrels[q], level) for q in qids]))
    by_column = evaluate(measures, stack_scored([run[q] for q in qids], [qrels[q] for q in qids], level))
    expected = pytrec_eval.RelevanceEvaluator(qrels, {r for r, _ in ORACLE.values()},
                                              relevance_level=level).evaluate(run)
    for m, (_, key) in zip(measures, ORACLE.values()):
        want = np.array([expected[q][key] for q in qids])
        got = m.values(by_state[m])
        np.testing.assert_array_equal(got, m.values(by_column[m]), err_msg=str(m))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, err_msg=str(m))


def test_the_two_rounding_rules_of_interpolated_precision():
    # R = 4, relevant at ranks 1, 3, 6, 10. Recall 0.6 needs 0.6·4 = 2.4 relevant documents:
    # trec_eval 10 rounds to 2 (best precision from rank 3 on: 2/3), pytrec_eval's
    # (long)(2.4 + 0.9) = 3 (from rank 6 on: 3/6).
    ranking = [f"d{i}" for i in range(1, 11)]
    state = QueryState.from_grades(ranking, {"d1": 1, "d3": 1, "d6": 1, "d10": 1})
    legacy, lround = parse("IPrec@0.6"), parse("IPrec(rounding=lround)@0.6")
    got = evaluate([legacy, lround], stack([state]))
    assert legacy.values(got[legacy]).tolist() == [0.5]
    assert lround.values(got[lround]).tolist() == [2 / 3]
    assert str(lround) == "IPrec(rounding=lround)@0.6" and str(parse("IPrec(rounding=legacy)@0.6")) == "IPrec@0.6"
