"""`rankmeter eval` after the review of issue 23: bad input in one line, the choice between
trec_eval's and ir_measures' reading of a command line, exact numeric parameters, a
measure named twice, rbp's gain parameters, negative -M. Run in-process (the parser and
`main`, as the installed command runs them); expected trec_eval lines come from the real
trec_eval 10.0-rc3 binary, the command in a comment beside them."""

import contextlib
import io
import json
from pathlib import Path

import pytest

from rankmeter.cli.command import main

FIXTURES = Path(__file__).parent / "fixtures" / "trec_eval"
Q, R = str(FIXTURES / "qrels.test"), str(FIXTURES / "results.test")


def run_eval(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["eval", *args])
    return rc, out.getvalue(), err.getvalue()


def files(tmp_path: Path, qrels: str, run: str) -> tuple[str, str]:
    (tmp_path / "q").write_text(qrels)
    (tmp_path / "r").write_text(run)
    return str(tmp_path / "q"), str(tmp_path / "r")


def lines(*rows: tuple[str, str, object]) -> str:
    return "".join(f"{m:<22}\t{q}\t{v if isinstance(v, (int, str)) else format(v, '6.4f')}\n" for m, q, v in rows)


def assert_refused(args: list[str], message: str, tmp_path: Path,
                   qrels: str = "q1 0 d1 1\nq1 0 d2 0\n", run: str = "q1 Q0 d1 1 3 t\nq1 Q0 d2 2 2 t\n") -> None:
    q, r = files(tmp_path, qrels, run)
    rc, out, err = run_eval(*args, q, r)
    assert (rc, out) == (2, ""), err
    assert len(err.splitlines()) == 1 and err.startswith("rankmeter eval: error: "), err
    assert message in err, err


# ---- finding 6: one line and exit 2, never a traceback ------------------------------

@pytest.mark.parametrize("args, message", [
    (["-m", "P."], "illegal measure 'P.': no parameter after the '.'"),
    (["-m", "11pt_avg.2"], "illegal measure '11pt_avg': recall point 2 is not in 0..1"),
    (["-m", "iprec_at_recall.-0.1"], "illegal measure 'iprec_at_recall': recall point -0.1 is not in 0..1"),
    (["-m", "iprec_at_recall.1.5"], "illegal measure 'iprec_at_recall': recall point 1.5 is not in 0..1"),
    (["-m", "P.1e400"], "illegal measure 'P': cut-off '1e400' is not a finite number"),
    (["-m", "P.nan"], "illegal measure 'P': cut-off 'nan' is not a finite number"),
    (["-m", "Rprec_mult.-1"], "illegal measure 'Rprec_mult': multiple -1 of R must be positive"),
    (["-m", "set_F.-1"], "illegal measure 'set_F': its parameter (β²) -1 must be 0 or more"),
    (["-m", "set_F.inf"], "illegal measure 'set_F': 'inf' is not a finite number"),
    (["-m", "utility.1,-1,0,inf"], "illegal measure 'utility': 'inf' is not a finite number"),
])
def test_bad_measure_parameters_are_one_line(tmp_path, args, message):
    assert_refused(args, message, tmp_path)


@pytest.mark.parametrize("qrels, message", [
    ("q1 0 d1 inf\nq1 0 d2 -inf\n", "q:1: grade 'inf' is not a finite number"),
    ("q1 0 d1 1\nq1 0 d2 -inf\n", "q:2: grade '-inf' is not a finite number"),
])
def test_non_finite_grades_are_refused_with_file_and_line(tmp_path, qrels, message):
    for names in (["-m", "map"], ["-m", "AP"]):
        assert_refused(names, message, tmp_path, qrels=qrels)


def test_an_indented_hash_line_in_qrels_is_data_and_its_problem_is_named(tmp_path):
    # (review finding 10: the reader reads it as data, as trec_eval does; the error locator
    # skipped it as a comment, so nothing was said and the query '#' was evaluated)
    assert_refused(["-m", "map"], "q:2: grade 'z' is not a number", tmp_path,
                   qrels="q1 0 d1 1\n  # x y z\nq1 0 d2 1\n")


def test_a_nan_score_is_refused_with_file_and_line(tmp_path):
    assert_refused(["-m", "map"], "r:2: score 'nan' is not a number trec_eval can order", tmp_path,
                   run="q1 Q0 d1 1 3 t\nq1 Q0 d2 2 nan t\n")


def test_infinite_scores_are_read_and_ordered_as_trec_eval_orders_them(tmp_path):
    q, r = files(tmp_path, "q1 0 d1 1\nq1 0 d2 0\nq1 0 d3 1\nq1 0 d4 1\n",
                 "q1 Q0 d1 1 -inf t\nq1 Q0 d2 2 inf t\nq1 Q0 d3 3 -inf t\nq1 Q0 d4 4 -3 t\nq1 Q0 d5 4 -infinity t\n")
    # trec_eval -q -m relstring -m map -m P.2 q r   (10.0-rc3)
    want = lines(("map", "q1", 0.5333), ("P_2", "q1", 0.5), ("relstring", "q1", "'01-11'"),
                 ("map", "all", 0.5333), ("P_2", "all", 0.5))
    assert run_eval("-q", "-m", "relstring", "-m", "map", "-m", "P.2", q, r) == (0, want, "")
    # The ir_measures reading orders them the same way: d2, d4, then d5, d3, d1.
    rc, out, _ = run_eval("-m", "AP", "-m", "P@2", "--digits", "6", q, r)
    assert (rc, out) == (0, f"AP\tall\t{(1 / 2 + 2 / 4 + 3 / 5) / 3:.6f}\nP@2\tall\t0.500000\n")


# ---- findings 7 and 8: ir_measures users are not silently changed --------------------
# The expected ir_measures lines are old main's (85d3de7, before issue 23) on the same files.

@pytest.mark.parametrize("args, want", [
    (["-m", "Rprec", "-m", "nDCG@10"], "Rprec\tall\t0.2174\nnDCG@10\tall\t0.3016\n"),
    (["-m", "P", "-m", "AP"], "SetP\tall\t0.0873\nAP\tall\t0.1785\n"),
    (["-m", "Rprec", "--digits", "6"], "Rprec\tall\t0.217354\n"),
    (["-m", "P", "--average", "micro"], "SetP\tall\t0.0873\n"),
    (["--digits", "6"], "nDCG@10\tall\t0.301577\nP@10\tall\t0.300000\nAP\tall\t0.178545\n"
                        "RR\tall\t0.406433\nR@10\tall\t0.031710\n"),
    (["--average", "micro"], "nDCG@10\tall\t0.3016\nP@10\tall\t0.3000\nAP\tall\t0.0862\n"
                             "RR\tall\t0.4064\nR@10\tall\t0.0160\n"),
])
def test_names_of_both_kinds_follow_the_rest_of_the_command_line(args, want):
    assert run_eval(*args, Q, R) == (0, want, "")


def test_json_keeps_the_ir_measures_default_and_reading():
    rc, out, _ = run_eval("--format", "json", Q, R)
    assert rc == 0 and list(json.loads(out)["all"]) == ["nDCG@10", "P@10", "AP", "RR", "R@10"]
    rc, out, _ = run_eval("-m", "Rprec", "-m", "P", "--format", "json", Q, R)
    assert rc == 0 and json.loads(out)["all"] == pytest.approx({"Rprec": 0.217354, "SetP": 0.087333}, abs=1e-6)


def test_names_of_both_kinds_are_trec_eval_names_beside_trec_eval_names_or_alone():
    rc, out, _ = run_eval("-m", "P", "-m", "map", Q, R)
    assert rc == 0 and [line.split("\t")[0].strip() for line in out.splitlines()] == [
        "map", "P_5", "P_10", "P_15", "P_20", "P_30", "P_100", "P_200", "P_500", "P_1000"]
    assert run_eval("-m", "Rprec", Q, R) == (0, lines(("Rprec", "all", 0.2174)), "")  # the drop-in
    assert run_eval("-m", "Rprec", "-J", Q, R)[1].startswith("Rprec                 \tall\t")


@pytest.mark.parametrize("args, message", [
    (["-m", "map", "--digits", "6"], "--digits takes ir_measures names (nDCG@10, AP, ...), not trec_eval's"),
    (["-m", "map", "--average", "micro"], "--average takes ir_measures names"),
    (["-m", "P.5", "--format", "json"], "--format json takes ir_measures names"),
    (["-m", "nDCG@10", "-N", "100"], "-N takes trec_eval names (map, P.10, ...), not ir_measures'"),
    (["-m", "AP", "-c"], "-c takes trec_eval names"),
    (["-m", "Rprec", "--digits", "6", "-M", "10"], "--digits takes ir_measures names"),
    (["-m", "map", "-m", "nDCG@10"], "'nDCG@10' are not trec_eval names"),
])
def test_flags_of_the_other_kind_are_refused_in_one_line(tmp_path, args, message):
    assert_refused(args, message, tmp_path)


# ---- finding 5: numeric parameters keep their exact value ---------------------------

def test_utility_with_a_real_collection_size_and_set_f_at_a_rounding_boundary(tmp_path):
    q, r = files(tmp_path, "q 0 a 1\nq 0 b 1\nq 0 c 1\nq 0 d 1\nq 0 e 1\n", "q Q0 a 1 3 t\nq Q0 x 2 2 t\nq Q0 y 3 1 t\n")
    # trec_eval -N 25205179 -m utility.1,-1,0,1 q r   (10.0-rc3; 6 significant digits gave 25205192.0000)
    assert run_eval("-N", "25205179", "-m", "utility.1,-1,0,1", q, r) == (
        0, "utility_1,-1,0,1      \tall\t25205171.0000\n", "")
    assert run_eval("-N", "1234567", "-m", "utility.1,-1,0,1", q, r)[1].endswith("\t1234559.0000\n")
    # Queries a and b: one relevant retrieved of 6 and of 8 relevant (set_F_0.5 0.375 and 0.3),
    # c and d none: the mean 0.16875 sits on a rounding boundary of %6.4f.
    q, r = files(tmp_path, "".join(f"a 0 r{i} 1\n" for i in range(6)) + "".join(f"b 0 r{i} 1\n" for i in range(8))
                 + "c 0 r1 1\nd 0 r1 1\n", "a Q0 r1 1 1 t\nb Q0 r1 1 1 t\nc Q0 x 1 1 t\nd Q0 x 1 1 t\n")
    # trec_eval -m set_F.0.5 q r   (10.0-rc3; β = sqrt(0.5) rounded to 6 digits gave 0.1687)
    assert run_eval("-m", "set_F.0.5", q, r) == (0, "set_F_0.5             \tall\t0.1688\n", "")


def test_ir_measures_parameters_keep_every_digit(tmp_path):
    q, r = files(tmp_path, "q 0 a 1\nq 0 b 1\nq 0 c 1\nq 0 d 1\nq 0 e 1\n", "q Q0 a 1 3 t\nq Q0 x 2 2 t\nq Q0 y 3 1 t\n")
    rc, out, _ = run_eval("-m", "Utility(N=25205179)", "-m", "SetF(beta=0.7071067811865476)", "-m", "SetF(beta=1.0)",
                          "--format", "json", q, r)
    # SetF with β² = 1/2: 1.5·TP / (0.5·R + n) = 1.5 / 5.5 = 3/11 (to the last bits of β·β).
    assert rc == 0 and json.loads(out)["all"] == {"Utility(N=25205179)": -1.0,
                                                  "SetF(beta=0.7071067811865476)": pytest.approx(3 / 11, abs=1e-15),
                                                  "SetF": 0.25}


# ---- finding 1: a measure named twice with parameters -------------------------------

def test_cut_off_lists_given_twice_are_merged():
    # trec_eval -m P.5 -m P.10 ... keeps P_5 only; rankmeter gives both (docs/eval.md).
    rc, out, _ = run_eval("-m", "P.5", "-m", "P.10", "-m", "iprec_at_recall..25", "-m", "iprec_at_recall..5",
                          "-m", "success.1", "-m", "success_5", Q, R)
    assert rc == 0 and [line.split()[0] for line in out.splitlines()] == [
        "iprec_at_recall_0.25", "iprec_at_recall_0.50", "P_5", "P_10", "success_1", "success_5"]
    # A bare name and a parametrised one: the parameter, as trec_eval (-m P -m P.5 prints P_5 only).
    assert run_eval("-m", "P", "-m", "P.5", Q, R) == (0, lines(("P_5", "all", 0.2667)), "")
    # The same parameter twice is one measure: trec_eval -m set_F.0.5 -m set_F.0.5 $Q $R
    assert run_eval("-m", "set_F.0.5", "-m", "set_F.0.5", Q, R) == (0, lines(("set_F_0.5", "all", 0.1045)), "")
    # trec_eval -m utility -m utility.2,-1,0,0 $Q $R
    assert run_eval("-m", "utility", "-m", "utility.2,-1,0,0", Q, R) == (
        0, lines(("utility_2,-1,0,0", "all", -369.0)), "")


@pytest.mark.parametrize("args, first", [
    (["-m", "set_F.0.5", "-m", "set_F.4"], "set_F.0.5"),
    (["-m", "utility.2,-1,0,0", "-m", "utility.1,-1,0,0"], "utility.2,-1,0,0"),
    (["-m", "relstring.5", "-m", "relstring.20"], "relstring.5"),
    (["-m", "rbp.p=0.5", "-m", "rbp.p=0.8"], "rbp.p=0.5"),
    (["-m", "11pt_avg..25", "-m", "11pt_avg..5"], "11pt_avg..25"),
    (["-m", "rbp_resid.p=0.5", "-m", "rbp_resid.p=0.8"], "rbp_resid.p=0.5"),
])
def test_a_second_different_parameter_of_a_single_valued_measure_is_refused(tmp_path, args, first):
    name = first.split(".")[0]
    assert_refused(args, f"{name} is asked for as {first} already (one parameter per measure", tmp_path)


# ---- finding 4: rbp's gain parameters -----------------------------------------------

@pytest.mark.parametrize("measure", ["rbp.1=3", "rbp.p=0.8,1=0.5", "rbp_resid.2=1", "rbp.-1=2"])
def test_rbp_gain_parameters_are_refused_not_ignored(tmp_path, measure):
    name = measure.split(".")[0]
    assert_refused(["-m", measure], f"illegal measure '{name}': gain parameters (", tmp_path)
    assert_refused(["-m", measure], ") are not implemented", tmp_path)


def test_rbp_persistence_is_read():
    # trec_eval -m rbp.p=0.5 -m rbp_resid.p=0.8 $Q $R   (10.0-rc3)
    rc, out, _ = run_eval("-m", "rbp.p=0.5", "-m", "rbp_resid.p=0.8", Q, R)
    assert (rc, out) == (0, lines(("rbp_p=0.5", "all", 0.2966), ("rbp_resid_p=0.8", "all", 0.0068)))


# ---- findings 2 and 3: -M ------------------------------------------------------------

def test_a_negative_max_retrieved_is_refused(tmp_path):
    assert_refused(["-M", "-1", "-m", "map"], "-M -1: the number of documents must be 0 or more", tmp_path)
    q, r = files(tmp_path, "q1 0 d1 1\n", "q1 Q0 d1 1 3 t\n")
    # trec_eval -M 0 -m num_ret -m map q r   (10.0-rc3; -M -1 segfaults there)
    assert run_eval("-M", "0", "-m", "num_ret", "-m", "map", q, r) == (
        0, lines(("num_ret", "all", 0), ("map", "all", 0.0)), "")
