"""trec_eval's G, binG, ndcg_rel, Rndcg and the `level=gain` parameters of ndcg, G,
ndcg_rel and Rndcg (gain_init.c), and grades read as trec_eval's atol reads them (`1e3` is
1). Expected lines come from the real trec_eval 10.0-rc3 binary (usnistgov/trec_eval built
with make), the command in a comment beside them. (The four measures without parameters
are checked against pytrec_eval in test_conformance_trec.py, and all of them in trec_eval's
own expected outputs in test_trec_eval_suite.py.)"""

import contextlib
import io
import json
from pathlib import Path

import pytest

from rankmeter.cli.command import main

QRELS = "q1 0 d1 3\nq1 0 d2 0\nq1 0 d3 1\nq1 0 d4 2\nq1 0 d5 -1\nq1 0 d6 1\nq2 0 d1 1\nq2 0 d7 4\nq2 0 d8 0\n"
RUN = ("q1 Q0 d2 1 9 t\nq1 Q0 d3 2 8 t\nq1 Q0 d9 3 7 t\nq1 Q0 d5 4 6 t\nq1 Q0 d1 5 5 t\nq1 Q0 d6 6 4 t\n"
       "q2 Q0 d8 1 3 t\nq2 Q0 d7 2 2 t\n")
GAINS = ["-m", "ndcg.1=-1,3=2", "-m", "G.2=6,3=-2", "-m", "ndcg_rel.2=0,4=1", "-m", "Rndcg.1=7,p=3",
         "-m", "binG", "-m", "G", "-m", "Rndcg", "-m", "ndcg_rel"]
# trec_eval -q -m ndcg.1=-1,3=2 -m G.2=6,3=-2 -m ndcg_rel.2=0,4=1 -m Rndcg.1=7,p=3 -m binG -m G -m Rndcg
#   -m ndcg_rel q r   (a name given twice keeps its first parameters; p=3 is not a level: ignored)
TREC_EVAL_GAINS = """\
binG                  \tq1\t0.3731
G_2=6,3=-2            \tq1\t0.0079
ndcg_1=-1,3=2         \tq1\t-0.0654
ndcg_rel_2=0,4=1      \tq1\t0.3758
Rndcg_1=7,p=3         \tq1\t0.4088
binG                  \tq2\t0.3155
G_2=6,3=-2            \tq2\t0.5047
ndcg_1=-1,3=2         \tq2\t0.6309
ndcg_rel_2=0,4=1      \tq2\t0.3869
Rndcg_1=7,p=3         \tq2\t0.1325
binG                  \tall\t0.3443
G_2=6,3=-2            \tall\t0.2563
ndcg_1=-1,3=2         \tall\t0.2827
ndcg_rel_2=0,4=1      \tall\t0.3813
Rndcg_1=7,p=3         \tall\t0.2706
"""
# Grades in exponent, decimal and signed form, as atol reads them: 1, 2, 2, 1, 0, 3.
GRADED = "q1 0 d1 1e3\nq1 0 d2 2\nq1 0 d3 2.7\nq1 0 d4 1e-3\nq1 0 d5 .5\nq1 0 d6 +3\n"
GRADED_RUN = "".join(f"q1 Q0 d{i} {i} {max(4 - i, 0)} t\n" for i in range(1, 7))


def run_eval(tmp_path: Path, qrels: str, run: str, *args: str) -> tuple[int, str, str]:
    (tmp_path / "q").write_text(qrels)
    (tmp_path / "r").write_text(run)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["eval", *args, str(tmp_path / "q"), str(tmp_path / "r")])
    return rc, out.getvalue(), err.getvalue()


def test_gain_parameters_and_the_experimental_measures_print_what_trec_eval_prints(tmp_path):
    assert run_eval(tmp_path, QRELS, RUN, "-q", *GAINS) == (0, TREC_EVAL_GAINS, "")


@pytest.mark.parametrize("measure, message", [
    ("ndcg.-1=2", "a gain for level -1 (unjudged documents) is not supported"),
    ("ndcg.0=1", "a positive gain for level 0 is not implemented"),
    ("ndcg.1=x", "'x' is not a number"),
    ("G.1=2,1=3", "level 1 is given two gains"),
    ("Rndcg.1", "malformed pair parameters in '1'"),
])
def test_gain_parameters_rankmeter_cannot_honour_are_refused_in_one_line(tmp_path, measure, message):
    rc, out, err = run_eval(tmp_path, QRELS, RUN, "-m", measure)
    assert (rc, out) == (2, "")
    assert err.startswith("rankmeter eval: error: ") and err.endswith(f"{message}\n") and err.count("\n") == 1


def test_grades_are_read_as_trec_eval_reads_them_with_its_names(tmp_path):
    # trec_eval -q -m ndcg -m relstring -m num_rel q r
    want = ("num_rel               \tq1\t5\nrelstring             \tq1\t'122301'\nndcg                  \tq1\t0.8077\n"
            "num_rel               \tall\t5\nndcg                  \tall\t0.8077\n")
    assert run_eval(tmp_path, GRADED, GRADED_RUN, "-q", "-m", "ndcg", "-m", "relstring", "-m", "num_rel") == (0, want, "")
    # trec_eval -l 1e3 -m num_rel -m map q r: -l is atol's too (1)
    want = "num_rel               \tall\t5\nmap                   \tall\t0.9667\n"
    assert run_eval(tmp_path, GRADED, GRADED_RUN, "-l", "1e3", "-m", "num_rel", "-m", "map") == (0, want, "")


def test_grades_are_the_numbers_written_with_ir_measures_names(tmp_path):
    rc, out, _ = run_eval(tmp_path, "q1 0 d1 1e3\nq1 0 d2 2\n", "q1 Q0 d2 1 3 t\nq1 Q0 d1 2 2 t\n",
                          "-m", "nDCG", "--format", "json")
    ideal = 1000 + 2 / 1.584962500721156  # log2(3)
    assert rc == 0 and json.loads(out)["all"]["nDCG"] == pytest.approx((2 + 1000 / 1.584962500721156) / ideal)


@pytest.mark.parametrize("grade", ["abc", "0x10", "inf"])
def test_a_grade_that_is_no_finite_number_is_still_an_error(tmp_path, grade):
    rc, out, err = run_eval(tmp_path, f"q1 0 d1 1\nq1 0 d2 {grade}\n", "q1 Q0 d1 1 3 t\n", "-m", "map")
    assert (rc, out) == (2, "") and ":2: grade" in err and err.count("\n") == 1
