"""`rankmeter eval` end to end: the installed command on files, against pytrec_eval."""

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import pytrec_eval

RANKMETER = shutil.which("rankmeter", path=str(Path(sys.executable).parent))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([RANKMETER, *args], capture_output=True, text=True, timeout=120)


def write_collection(tmp_path: Path, seed: int, queries: int = 60):
    rnd = random.Random(seed)
    qrels, run = {}, {}
    for q in range(queries):
        qid = f"{q:03d}"
        pool = [f"doc{rnd.randrange(200)}" for _ in range(40)]
        qrels[qid] = {d: rnd.choice([0, 0, 0, 1, 2, 3]) for d in pool[:25]}
        shown = list(dict.fromkeys(pool[5:]))
        run[qid] = {d: float(rnd.randrange(8)) for d in shown}  # many ties
    qrels["only-in-qrels"] = {"x": 1}
    run["only-in-run"] = {"y": 1.0}
    qrels_file, run_file = tmp_path / "qrels.txt", tmp_path / "run.txt"
    qrels_file.write_text("".join(f"{q} 0 {d} {g}\n" for q, docs in qrels.items() for d, g in docs.items()))
    # The rank column is deliberately wrong: trec_eval orders by score, and so do we.
    run_file.write_text("".join(f"{q} Q0 {d} 1 {s} tag\n" for q, docs in run.items() for d, s in docs.items()))
    return qrels, run, str(qrels_file), str(run_file)


@pytest.mark.parametrize("seed, level", [(1, 1), (2, 2), (3, 3)])
def test_eval_json_equals_pytrec_eval(tmp_path, seed, level):
    qrels, run, qrels_file, run_file = write_collection(tmp_path, seed)
    out = run_cli("eval", qrels_file, run_file, "-m", "nDCG@10", "-m", "P@10", "-m", "AP",
                  "-m", "Bpref", "-m", "RR", "-l", str(level), "-q", "--format", "json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    oracle = pytrec_eval.RelevanceEvaluator(
        qrels, {"ndcg_cut.10", "P.10", "map", "bpref", "recip_rank"}, relevance_level=level).evaluate(run)
    assert sorted(got["queries"]) == sorted(oracle) == sorted(q for q in run if q in qrels)
    assert got["num_queries"] == len(oracle)
    for ours, theirs in [("nDCG@10", "ndcg_cut_10"), ("P@10", "P_10"), ("AP", "map"),
                         ("Bpref", "bpref"), ("RR", "recip_rank")]:
        for qid, values in oracle.items():
            assert got["queries"][qid][ours] == pytest.approx(values[theirs], abs=1e-9), (ours, qid)
        mean = sum(v[theirs] for v in oracle.values()) / len(oracle)
        assert got["all"][ours] == pytest.approx(mean, abs=1e-9)


def test_eval_tsv_prints_trec_eval_style_lines(tmp_path):
    qrels, run, qrels_file, run_file = write_collection(tmp_path, 7, queries=3)
    out = run_cli("eval", qrels_file, run_file, "-m", "P@10", "-m", "AP", "--per-query")
    assert out.returncode == 0, out.stderr
    rows = [line.split("\t") for line in out.stdout.splitlines()]
    assert [r[:2] for r in rows] == [["P@10", "000"], ["AP", "000"], ["P@10", "001"], ["AP", "001"],
                                     ["P@10", "002"], ["AP", "002"], ["P@10", "all"], ["AP", "all"]]
    oracle = pytrec_eval.RelevanceEvaluator(qrels, {"P.10"}).evaluate(run)
    assert float(rows[0][2]) == pytest.approx(oracle["000"]["P_10"], abs=5e-5)
    assert all(len(r[2].split(".")[1]) == 4 for r in rows)
    # Without --per-query only the `all` lines.
    out = run_cli("eval", qrels_file, run_file, "-m", "P@10")
    assert [line.split("\t")[:2] for line in out.stdout.splitlines()] == [["P@10", "all"]]


def test_eval_micro_average(tmp_path):
    (tmp_path / "q").write_text("a 0 d1 1\na 0 d2 1\nb 0 d1 1\nb 0 d2 0\nb 0 d3 1\n")
    (tmp_path / "r").write_text("a Q0 d1 1 3 t\na Q0 d9 2 2 t\nb Q0 d1 1 5 t\nb Q0 d2 2 4 t\nb Q0 d3 3 3 t\nb Q0 d4 4 2 t\n")
    # SetP: a = 1/2, b = 2/4 -> micro 3/6; SetR: a = 1/2, b = 2/2 -> macro 0.75, micro 3/4.
    micro = run_cli("eval", str(tmp_path / "q"), str(tmp_path / "r"), "-m", "SetP", "-m", "SetR",
                    "--average", "micro", "--format", "json")
    macro = run_cli("eval", str(tmp_path / "q"), str(tmp_path / "r"), "-m", "SetR", "--format", "json")
    assert json.loads(micro.stdout)["all"] == {"SetP": 0.5, "SetR": 0.75}
    assert json.loads(macro.stdout)["all"] == {"SetR": 0.75}


GOOD_QRELS = "q1 0 d1 1\nq1 0 d2 0\n"
GOOD_RUN = "q1 Q0 d1 1 2.0 t\nq1 Q0 d2 2 1.0 t\n"
BAD_INPUTS = [
    ("q1 0 d1 1\nq1 0 d2\n", GOOD_RUN, [], "qrels:2: expected 4 fields (qid iter docid grade), got 3"),
    ("q1 0 d1 1\n\nq1 0 d2 high\n", GOOD_RUN, [], "qrels:3: grade 'high' is not a number"),
    ("q1 0 d1 nan\n", GOOD_RUN, [], "qrels:1: grade 'nan' is not a finite number"),
    ("q1 0 d1 1\nq1 0 d1 2\n", GOOD_RUN, [], "qrels:2: document 'd1' judged twice for query 'q1'"),
    (GOOD_QRELS, "q1 Q0 d1 1 2.0\n", [], "run:1: expected 6 fields (qid Q0 docid rank score tag), got 5"),
    (GOOD_QRELS, "q1 Q0 d1 1 2.0 t\nq1 Q0 d2 2 x t\n", [], "run:2: score 'x' is not a number"),
    (GOOD_QRELS, GOOD_RUN + "q1 Q0 d1 3 0.5 t\n", [], "run:3: document 'd1' retrieved twice for query 'q1'"),
    (GOOD_QRELS, "q9 Q0 d1 1 2.0 t\n", [], "run: no query of this run has judgments in"),
    (GOOD_QRELS, GOOD_RUN, ["-m", "Foo@3"], "unknown measure 'Foo@3'"),
    (GOOD_QRELS, GOOD_RUN, ["-m", "nDCG@0"], "the cut-off must be a whole number >= 1"),
    (b"q1 0 d1 1\nq1 0 \xff 1\n", GOOD_RUN, [], "qrels:2: not UTF-8 text (byte 6 of the line)"),
]


@pytest.mark.parametrize("qrels, run, args, message", BAD_INPUTS, ids=[
    "short-qrels-line", "non-numeric-grade", "nan-grade", "judged-twice", "short-run-line",
    "non-numeric-score", "retrieved-twice", "no-common-query", "unknown-measure", "zero-cut-off",
    "not-utf8"])
def test_bad_input_is_one_line_exit_2(tmp_path, qrels, run, args, message):
    for name, content in (("qrels", qrels), ("run", run)):
        path = tmp_path / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    out = run_cli("eval", str(tmp_path / "qrels"), str(tmp_path / "run"), *args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("rankmeter eval: error: ")
    assert message in out.stderr


def test_missing_file_is_one_line_exit_2(tmp_path):
    (tmp_path / "run").write_text(GOOD_RUN)
    out = run_cli("eval", str(tmp_path / "nope.qrels"), str(tmp_path / "run"))
    assert (out.returncode, out.stderr) == (2, f"rankmeter eval: error: {tmp_path}/nope.qrels: no such file\n")
