"""The seed documents' worked examples, with the values corrected in the brief (§4)."""

import math

import numpy as np
import pytest

from rankmeter.engine import QueryState, evaluate, macro, micro, parse, stack


def values(names, states):
    batch = stack(states)
    return {str(m): m.values(r) for m, r in evaluate([parse(n) for n in names], batch).items()}


def test_seed_000_ndcg_correct_values():
    # Seed 000 prints DCG 4.584, IDCG 7.170 and nDCG 0.639: its arithmetic is wrong.
    # With its own formula (linear gain, log2(1 + rank)) the values are these
    # (pytrec_eval agrees; tests/test_conformance.py checks the formula at large).
    grades = {"d1": 0, "d2": 1, "d3": 2, "d4": 2}
    state = QueryState.from_grades(["d3", "d2", "d4", "d1"], grades)
    v = values(["DCG", "nDCG", "nDCG(dcg=exp-log2)"], [state])
    assert v["DCG"][0] == pytest.approx(2 + 1 / math.log2(3) + 2 / 2, abs=1e-12)
    assert v["DCG"][0] == pytest.approx(3.630930, abs=1e-6)
    idcg = 2 + 2 / math.log2(3) + 1 / 2
    assert idcg == pytest.approx(3.761860, abs=1e-6)
    assert v["nDCG"][0] == pytest.approx(0.965195, abs=1e-6)
    assert v["nDCG"][0] != pytest.approx(0.639, abs=1e-3)  # the seed's misprint
    assert v["nDCG(dcg=exp-log2)"][0] == pytest.approx(0.951443, abs=1e-6)


def test_seed_004_average_precision_divides_by_all_relevant():
    relevant_ranks = {1, 2, 5, 10, 20}
    ranking = [f"d{i}" for i in range(1, 21)]
    grades = {f"d{i}": (1 if i in relevant_ranks else 0) for i in range(1, 21)}
    grades["unretrieved"] = 1  # the sixth relevant document, never shown
    v = values(["AP", "SetR"], [QueryState.from_grades(ranking, grades)])
    assert v["AP"][0] == pytest.approx((1 / 1 + 2 / 2 + 3 / 5 + 4 / 10 + 5 / 20) / 6, abs=1e-12)
    assert v["AP"][0] == pytest.approx(0.541667, abs=1e-6)
    assert v["AP"][0] != pytest.approx(0.65, abs=1e-3)  # not the retrieved-only variant
    assert v["SetR"][0] == pytest.approx(5 / 6)


def _query(relevant: int, retrieved: int, relevant_retrieved: int) -> QueryState:
    ranking = [f"r{i}" for i in range(retrieved)]
    grades = {doc: (1 if i < relevant_retrieved else 0) for i, doc in enumerate(ranking)}
    grades.update({f"u{i}": 1 for i in range(relevant - relevant_retrieved)})
    return QueryState.from_grades(ranking, grades)


def test_seed_004_macro_and_micro():
    batch = stack([_query(100, 80, 40), _query(50, 30, 24)])
    sp, sr = parse("SetP"), parse("SetR")
    p, r = sp.compute(batch), sr.compute(batch)
    assert list(sp.values(p)) == pytest.approx([0.5, 0.8])
    assert list(sr.values(r)) == pytest.approx([0.4, 0.48])
    assert macro(sp, p).value == pytest.approx(0.65)
    assert macro(sr, r).value == pytest.approx(0.44)
    assert micro(sp, p).value == pytest.approx(64 / 110)
    assert micro(sp, p).value == pytest.approx(0.581818, abs=1e-6)
    assert micro(sr, r).value == pytest.approx(64 / 150)
    assert micro(sr, r).value == pytest.approx(0.426667, abs=1e-6)
    # Micro F1 is the harmonic mean of micro P and micro R (brief §5).
    f1 = parse("F1")
    mp, mr = 64 / 110, 64 / 150
    assert micro(f1, f1.compute(batch)).value == pytest.approx(2 * mp * mr / (mp + mr))


def test_precision_at_k_pads_short_lists_and_micro_equals_macro():
    state = QueryState.from_grades(["a", "b", "c"], {"a": 1, "c": 2})
    other = QueryState.from_grades(["x"] * 3 + ["y"], {"y": 1})  # repeated id: first occurrence kept
    assert other.ranking == ["x", "y"]
    m = parse("P@10")
    ratio = m.compute(stack([state, other]))
    assert list(m.values(ratio)) == [0.2, 0.1]
    assert micro(m, ratio).value == pytest.approx(macro(m, ratio).value)


def test_auc_counts_ordered_pairs_and_is_undefined_with_one_class():
    state = QueryState.from_grades(["a", "b", "c", "d"], {"a": 0, "b": 1, "c": 0, "d": 2})
    only_rel = QueryState.from_grades(["a"], {"a": 3})
    m = parse("AUC")
    ratio = m.compute(stack([state, only_rel]))
    v = m.values(ratio)
    assert v[0] == pytest.approx(1 / 4)  # of (b,a) (b,c) (d,a) (d,c) only b above c
    assert math.isnan(v[1])
    assert macro(m, ratio) == (0.25, 1.0)


def test_empty_and_unjudged_queries_score_zero():
    v = values(["P@5", "AP", "nDCG@10", "RR", "Rprec", "Bpref", "IPrec", "SetF", "E"],
               [QueryState.from_grades([], {}), QueryState.from_grades(["a"], {})])
    for name, per_query in v.items():
        expected = 1.0 if name == "E" else 0.0
        assert list(per_query) == [expected, expected], name


def test_live_view_counts_shown_documents_as_judged_non_relevant():
    trec_view = QueryState.from_grades(["a", "b", "c"], {"b": 1})
    live_view = QueryState(["a", "b", "c"], shown_grade=0)
    live_view.set_grade("b", 1)
    v = values(["Bpref", "AUC"], [trec_view, live_view])
    assert v["Bpref"][0] == 1.0  # unjudged "a" is ignored
    assert v["Bpref"][1] == 0.0  # "a" is judged non-relevant and ranks above "b"
    assert math.isnan(v["AUC"][0]) and v["AUC"][1] == 0.5


@pytest.mark.parametrize("name, canonical", [
    ("nDCG@10", "nDCG@10"), ("P@10", "P@10"), ("AP", "AP"), ("AP@5", "AP@5"),
    ("P", "SetP"), ("R", "SetR"), ("F1", "SetF"), ("SetF(beta=1)", "SetF"),
    ("SetF(beta=0.5)", "SetF(beta=0.5)"), ("nDCG(dcg='exp-log2')@10", "nDCG(dcg=exp-log2)@10"),
    ("IPrec@0.5", "IPrec@0.5"), ("IPrec@1", "IPrec@1.0"), ("Success@1", "Success@1"),
])
def test_measure_names_parse_to_one_canonical_spelling(name, canonical):
    assert str(parse(name)) == canonical


@pytest.mark.parametrize("name, problem", [
    ("nDCG@0", "whole number"), ("P", None), ("Foo@3", "families"), ("RR@3", "no @cut-off"),
    ("Success", "needs a cut-off"), ("IPrec@1.5", "0.0..1.0"), ("SetF(beta=0)", "positive"),
    ("nDCG(gain=2)@10", "unknown parameter"), ("nDCG@ten", "expected a name"),
])
def test_bad_measure_names_say_what_is_wrong(name, problem):
    if problem is None:  # `P` alone is set precision, not an error
        assert str(parse(name)) == "SetP"
        return
    with pytest.raises(ValueError, match=problem):
        parse(name)


def test_batch_rows_are_independent_of_padding():
    short = QueryState.from_grades(["a", "b"], {"a": 2, "b": 1})
    long = QueryState.from_grades([f"x{i}" for i in range(300)], {"x7": 3, "zz": 4})
    names = ["nDCG", "AP", "Bpref", "IPrec", "AUC"]
    alone = values(names, [short])
    together = values(names, [short, long])
    for name in names:
        np.testing.assert_array_equal(alone[name], together[name][:1])


def test_precision_at_ranks_is_shared_within_a_batch_only():
    # AP and IPrec@r of one batch share one cumsum (measures._precision_at_ranks keeps the last
    # batch's); a second batch of the same shape, and a rebuilt one, get their own values.
    first = [QueryState.from_grades(["a", "b", "c"], {"a": 1, "c": 1})]
    second = [QueryState.from_grades(["a", "b", "c"], {"b": 1, "c": 1})]
    names = ["AP", "IPrec@0.5", "AP@2"]
    want_first, want_second = [0.5 * (1 + 2 / 3), 1.0, 0.5], [0.5 * (1 / 2 + 2 / 3), 2 / 3, 0.25]
    for states, want in ((first, want_first), (second, want_second), (first, want_first)):
        got = values(names, states)
        assert [float(got[n][0]) for n in names] == pytest.approx(want, abs=1e-15)
        shared = stack(states)
        assert parse("AP").values(parse("AP").compute(shared)) == pytest.approx(want[0], abs=1e-15)


def test_a_rel_changed_in_place_is_not_matched_with_a_stale_result():
    # review 8: a Batch built by hand (a writeable rel) changed in place between two measures
    # must not reuse the first one's cumulative sums (a stack's rel is read-only).
    built = stack([QueryState.from_grades(["a", "b", "c"], {"a": 1})])
    assert not built.rel.flags.writeable
    b = built._replace(rel=built.rel.copy())
    ap = parse("AP")
    assert ap.values(ap.compute(b)) == pytest.approx(1.0, abs=1e-15)
    b.rel[0, 1] = True
    b = b._replace(num_rel=b.num_rel + 1)
    assert ap.values(ap.compute(b)) == pytest.approx(1.0, abs=1e-15)  # (1 + 2/2) / 2
