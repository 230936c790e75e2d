"""The "Coming from OpenSearch UBI" example of docs/events.md is true: the command prints what
the page shows, and its quality numbers are trec_eval's on the example's ESCI grades."""

from __future__ import annotations

import csv
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from statistics import fmean

import pytest
import pytrec_eval

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "ubi"
GRADES = {"E": 3, "S": 2, "C": 1, "I": 0}
RANKMETER = shutil.which("rankmeter", path=str(Path(sys.executable).parent))


def page_example() -> tuple[list[str], list[str]]:
    """The command of the page's console block and the lines it shows after it."""
    text = (ROOT / "docs" / "events.md").read_text()
    section = text[text.index("## Coming from OpenSearch UBI"):]
    block = re.search(r"```console\n\$ (.*?)\n```", section, re.S)[1]
    command, *shown = block.replace("\\\n", "").split("\n")
    return shlex.split(command), shown


def test_the_ubi_example_prints_what_the_page_shows():
    command, shown = page_example()
    assert command[0] == "rankmeter"
    out = subprocess.run([RANKMETER, *command[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n").split("\n") == shown


def test_the_ubi_example_numbers_are_trec_evals_on_the_esci_grades():
    _, shown = page_example()
    table = {line.split()[0]: line.split()[1:] for line in shown if re.match(r"esci[-_]\S+ +\d", line)}
    labels: dict[str, dict[str, int]] = defaultdict(dict)
    with open(EXAMPLE / "esci_judgments.csv") as f:
        for row in csv.DictReader(f):
            labels[row["query"]][row["product_id"]] = GRADES[row["esci_label"]]
    lines = [json.loads(line) for line in open(EXAMPLE / "ubi_queries_events.ndjson")]
    records = [r for r in lines if "index" not in r]
    queries = {r["query_id"]: r for r in records if "action_name" not in r}
    shown_at: dict[str, dict[str, int]] = defaultdict(dict)
    for r in records:
        if r.get("action_name") == "impression":
            a = r["event_attributes"]
            shown_at[r["query_id"]].setdefault(a["object"]["object_id"], a["position"]["ordinal"])
    qrels = {qid: labels[q["user_query"]] for qid, q in queries.items()}
    # trec_eval ranks by score, descending: the first position gets the highest.
    run = {qid: {doc: float(100 - position) for doc, position in docs.items()} for qid, docs in shown_at.items()}
    per_query = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut", "P", "map"}).evaluate(run)
    for ranker, row in table.items():
        qids = [qid for qid, q in queries.items() if q["application"] == ranker]
        assert int(row[0]) == len(qids)
        expected = [fmean(per_query[q][m] for q in qids) for m in ("ndcg_cut_10", "P_10", "map")]
        assert [float(v) for v in row[1:4]] == pytest.approx(expected, abs=5e-5), ranker
