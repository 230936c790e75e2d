"""trec_eval's own test suite: each line of its `make quicktest` (usnistgov/trec_eval 10.0
Makefile), run through `rankmeter eval` with the same flags, equals trec_eval's expected
output byte for byte, every measure of `all_trec` included (G, binG, ndcg_rel, Rndcg and
`ndcg` with gain parameters since issue 23's last part). The data is in
tests/fixtures/trec_eval (see its README). The quicktest lines for preference files
(-R prefs, -R qrels_prefs), judgment groups (-R qrels_jg) and z-scores (-Z) are refused
with one clear line, checked below."""

import gzip
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "trec_eval"
RANKMETER = shutil.which("rankmeter", path=str(Path(sys.executable).parent))

# (expected output, flags, qrels, run) — the quicktest lines, in the Makefile's order.
QUICKTEST = [
    ("out.test", [], "qrels.test", "results.test"),
    ("out.test", [], "qrels.test.with-comments", "results.test"),
    ("out.comment.test", [], "qrels.comment.test", "results.comment.test"),
    ("out.test.a", ["-m", "all_trec"], "qrels.test", "results.test"),
    ("out.test.aq", ["-m", "all_trec", "-q"], "qrels.test", "results.test"),
    ("out.test.aqc", ["-m", "all_trec", "-q", "-c"], "qrels.test", "results.trunc"),
    ("out.test.aqcM", ["-m", "all_trec", "-q", "-c", "-M100"], "qrels.test", "results.trunc"),
    ("out.test.aql", ["-m", "all_trec", "-mrelstring.20", "-q", "-l2"], "qrels.rel_level", "results.test"),
    ("out.test.meas_params",
     ["-q", "-miprec_at_recall..10,.20,.25,.75,.50", "-m", "P.5,7,3", "-m", "recall.20,2000",
      "-m", "Rprec_mult.5.0,0.2,0.35", "-mutility.2,-1,0,0", "-m", "11pt_avg..25,.5,.75",
      "-mndcg.1=3,2=9,4=4.5", "-mndcg_cut.10,20,23.4", "-msuccess.2,5,20"],
     "qrels.test", "results.test"),
]
REFUSED = [
    (["-m", "all_prefs", "-q", "-R", "prefs"], "prefs.test", "prefs.results.test", "-R prefs"),
    (["-m", "all_prefs", "-q", "-R", "prefs"], "prefs.comment.test", "prefs.results.test", "-R prefs"),
    (["-m", "all_prefs", "-q", "-R", "qrels_prefs"], "qrels.test", "results.test", "-R qrels_prefs"),
    (["-m", "qrels_jg", "-q", "-R", "qrels_jg"], "qrels.123", "results.test", "-R qrels_jg"),
    (["-m", "qrels_jg", "-q", "-R", "qrels_jg"], "qrels.comments.123", "results.test", "-R qrels_jg"),
    (["-q", "-m", "all_trec", "-Z", "zscores_file"], "qrels.test", "results.test", "-Z"),
]


def fixture(name: str, tmp_path: Path) -> str:
    path = FIXTURES / name
    if not path.exists():  # stored gzipped
        path = tmp_path / name
        path.write_bytes(gzip.decompress((FIXTURES / f"{name}.gz").read_bytes()))
    return str(path)


def expected(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


@pytest.mark.parametrize("out, flags, qrels, run", QUICKTEST,
                         ids=[f"{i}-{q[0]}" for i, q in enumerate(QUICKTEST)])
def test_quicktest_line_prints_what_trec_eval_prints(tmp_path, out, flags, qrels, run):
    got = subprocess.run([RANKMETER, "eval", *flags, fixture(qrels, tmp_path), fixture(run, tmp_path)],
                         capture_output=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout == expected(out)
    assert got.stderr == b""  # nothing of all_trec is left out


def test_the_gain_parameters_and_the_new_measures_are_in_the_expected_outputs():
    # The comparison above covers them: the shipped outputs hold their lines.
    names = {line.split()[0].decode() for line in expected("out.test.aq").splitlines()}
    assert {"G", "binG", "ndcg_rel", "Rndcg"} <= names
    assert b"ndcg_1=3,2=9,4=4.5    \tall\t0.4021\n" in expected("out.test.meas_params")


@pytest.mark.parametrize("flags, qrels, run, named", REFUSED, ids=[" ".join(r[0]) for r in REFUSED])
def test_unsupported_quicktest_lines_are_refused_in_one_line(tmp_path, flags, qrels, run, named):
    got = subprocess.run([RANKMETER, "eval", *flags, fixture(qrels, tmp_path), fixture(run, tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert (got.returncode, got.stdout) == (2, "")
    assert len(got.stderr.splitlines()) == 1 and "Traceback" not in got.stderr
    assert named in got.stderr
