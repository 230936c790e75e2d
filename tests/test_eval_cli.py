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
    ("# a comment\nq1 0 d1 1 extra\n", GOOD_RUN, [], "qrels:2: expected 4 fields (qid iter docid grade), got 5"),
    (GOOD_QRELS, "# run\nq1 Q0 d1 1 2.0 t and more\n q1 Q0 d2 2\n", [], "run:3: expected 6 fields"),
    (GOOD_QRELS, GOOD_RUN, ["-m", "map", "-m", "nDCG@10"], "'nDCG@10' are not trec_eval names"),
    (GOOD_QRELS, GOOD_RUN, ["-m", "yaap"], "illegal measure 'yaap': yaap is not implemented yet"),
    (GOOD_QRELS, GOOD_RUN, ["-R", "prefs"], "-R prefs: only -R qrels is supported"),
]


@pytest.mark.parametrize("qrels, run, args, message", BAD_INPUTS, ids=[
    "short-qrels-line", "non-numeric-grade", "nan-grade", "judged-twice", "short-run-line",
    "non-numeric-score", "retrieved-twice", "no-common-query", "unknown-measure", "zero-cut-off",
    "not-utf8", "long-qrels-line", "short-run-line-after-comment", "mixed-names", "missing-measure",
    "prefs-format"])
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


def trec_lines(*rows: tuple[str, str, object]) -> str:
    """trec_eval's `%-22s\t%s\t%6.4f` lines (`%ld` for ints)."""
    return "".join(f"{m:<22}\t{q}\t{v if isinstance(v, (int, str)) else format(v, '6.4f')}\n" for m, q, v in rows)


def test_comment_lines_and_trailing_fields_are_read_as_trec_eval_reads_them(tmp_path):
    clean_q, clean_r = tmp_path / "q", tmp_path / "r"
    clean_q.write_text("q1 0 d1 1\nq1 0 d2 0\nq1 0 d3 1\n")
    clean_r.write_text("q1 Q0 d1 1 3 t\nq1 Q0 d2 2 2 t\nq1 Q0 d4 3 1 t\n")
    odd_q, odd_r = tmp_path / "q2", tmp_path / "r2"
    odd_q.write_text("# judged by\n# two comment lines\nq1 0 d1 1\nq1 0 d2 0\n# docno CR#93\nq1 0 d3 1")
    odd_r.write_text("# a run\nq1 Q0 d1 1 3 t extra fields\n\n   # indented comment\nq1 Q0 d2 2 2 t x\n"
                     "q1\tQ0\td4\t3\t1\tt\n")
    want = run_cli("eval", "-q", "-m", "all_trec", str(clean_q), str(clean_r))
    got = run_cli("eval", "-q", "-m", "all_trec", str(odd_q), str(odd_r))
    assert got.returncode == 0, got.stderr
    assert got.stdout == want.stdout and "num_ret               \tq1\t3\n" in got.stdout
    piped = subprocess.run([RANKMETER, "eval", "-q", "-m", "all_trec", str(odd_q), "-"], input=odd_r.read_text(),
                           capture_output=True, text=True, timeout=120)
    assert piped.stdout == want.stdout


def tiny(tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "q").write_text("q1 0 d1 1\nq1 0 d2 0\nq1 0 d3 1\nq2 0 d1 1\n")
    (tmp_path / "r").write_text("q1 Q0 d1 1 3 run-a\nq1 Q0 d2 2 2 run-a\nq1 Q0 d4 3 1 run-b\n")
    return str(tmp_path / "q"), str(tmp_path / "r")


def test_trec_eval_names_print_trec_eval_lines_in_its_order(tmp_path):
    q, r = tiny(tmp_path)
    # q1: d1 (rel), d2 (non-rel), d4 (unjudged); R = 2. AP = 1/2, P_5 = 1/5, P_10 = 1/10.
    want = trec_lines(("num_ret", "q1", 3), ("map", "q1", 0.5), ("P_5", "q1", 0.2), ("P_10", "q1", 0.1),
                      ("runid", "all", "run-b"),  # the last line's tag, as trec_eval's
                      ("num_ret", "all", 3), ("map", "all", 0.5),
                      ("P_5", "all", 0.2), ("P_10", "all", 0.1))
    for measures in (["-m", "P.5,10", "-m", "map", "-m", "num_ret", "-m", "runid"],
                     ["-m", "P_10", "-m", "runid", "-m", "P_5", "-m", "num_ret", "-m", "map"],
                     ["-m", "P.10", "-m", "map", "-m", "P.5", "-m", "num_ret", "-m", "runid"]):
        got = run_cli("eval", "-q", *measures, q, r)
        assert got.returncode == 0, got.stderr
        assert got.stdout == want, measures


def test_trec_eval_flags(tmp_path):
    q, r = tiny(tmp_path)
    base = ["eval", "-m", "num_q", "-m", "num_ret", "-m", "map", "-m", "gm_map"]
    # -c: q2 (judged, not retrieved) counts with 0 everywhere; gm_map takes it as 0.00001.
    got = run_cli(*base, "-c", q, r).stdout
    assert got == trec_lines(("num_q", "all", 2), ("num_ret", "all", 3), ("map", "all", 0.25),
                             ("gm_map", "all", (0.5 * 0.00001) ** 0.5))
    # -M 1: only d1; -J: d4 (unjudged) dropped; -n: no `all` lines.
    assert run_cli(*base, "-M", "1", q, r).stdout == trec_lines(
        ("num_q", "all", 1), ("num_ret", "all", 1), ("map", "all", 0.5), ("gm_map", "all", 0.5))
    assert run_cli(*base, "-J", q, r).stdout.splitlines()[1] == trec_lines(("num_ret", "all", 2)).rstrip("\n")
    assert run_cli(*base, "-q", "-n", q, r).stdout == trec_lines(("num_ret", "q1", 3), ("map", "q1", 0.5))
    # Without -m: trec_eval's official set, starting with runid.
    assert run_cli("eval", q, r).stdout.startswith("runid                 \tall\trun-b\nnum_q   ")


def test_iprec_rounding_option(tmp_path):
    # R = 4, relevant at ranks 1, 3, 6, 10: recall 0.6 is 2 relevant (lround) or 3 (legacy).
    (tmp_path / "q").write_text("".join(f"q 0 d{i} 1\n" for i in (1, 3, 6, 10)))
    (tmp_path / "r").write_text("".join(f"q Q0 d{i} {i} {20 - i} t\n" for i in range(1, 11)))
    args = [str(tmp_path / "q"), str(tmp_path / "r")]
    assert run_cli("eval", "-m", "iprec_at_recall.0.6", *args).stdout == trec_lines(
        ("iprec_at_recall_0.60", "all", 2 / 3))
    assert run_cli("eval", "-m", "iprec_at_recall.0.6", "--iprec-rounding", "legacy", *args).stdout == trec_lines(
        ("iprec_at_recall_0.60", "all", 0.5))
    assert run_cli("eval", "-m", "IPrec@0.6", *args).stdout == "IPrec@0.6\tall\t0.5000\n"
    assert run_cli("eval", "-m", "IPrec@0.6", "--iprec-rounding", "lround", *args).stdout == \
        "IPrec(rounding=lround)@0.6\tall\t0.6667\n"
