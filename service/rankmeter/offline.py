"""`rankmeter eval`: a TREC run against TREC qrels, with the same engine as the live service."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import NamedTuple, TextIO

from rankmeter.engine import Measure, evaluate, macro, micro, stack_scored
from rankmeter.trec import InputError, gc_paused, read_qrels, read_run


class Report(NamedTuple):
    measures: list[Measure]
    qids: list[str]                       # the evaluated queries, in trec_eval's order
    per_query: dict[Measure, list[float]]  # aligned with qids
    overall: dict[Measure, float]          # the `all` line (macro or micro)


def evaluate_files(qrels_path: str, run_path: str, measures: Sequence[Measure],
                   relevance_level: float = 1, average: str = "macro") -> Report:
    """Evaluate like trec_eval: only queries that are in both the run and the qrels."""
    with gc_paused():
        qrels = read_qrels(qrels_path)
        run = read_run(run_path)
        qids = sorted(q for q in run if q in qrels)
        if not qids:
            raise InputError(run_path, None, f"no query of this run has judgments in {qrels_path}")
        batch = stack_scored([run[q] for q in qids], [qrels[q] for q in qids], relevance_level)
    ratios = evaluate(measures, batch)
    aggregate = macro if average == "macro" else micro
    return Report(
        list(measures), qids,
        {m: m.values(r).tolist() for m, r in ratios.items()},
        {m: aggregate(m, r).value for m, r in ratios.items()},
    )


def write_tsv(report: Report, out: TextIO, per_query: bool, digits: int) -> None:
    """`measure<TAB>qid<TAB>value` lines like `trec_eval -q`, then the `all` lines."""
    lines = []
    if per_query:
        for row, qid in enumerate(report.qids):
            for m in report.measures:
                lines.append(f"{m}\t{qid}\t{report.per_query[m][row]:.{digits}f}\n")
    for m in report.measures:
        lines.append(f"{m}\tall\t{report.overall[m]:.{digits}f}\n")
    out.write("".join(lines))


def write_json(report: Report, out: TextIO, per_query: bool) -> None:
    def clean(x: float) -> float | None:  # JSON has no NaN: an undefined value is null
        return None if math.isnan(x) else x

    doc: dict = {"num_queries": len(report.qids),
                 "all": {str(m): clean(report.overall[m]) for m in report.measures}}
    if per_query:
        doc["queries"] = {
            qid: {str(m): clean(report.per_query[m][row]) for m in report.measures}
            for row, qid in enumerate(report.qids)}
    json.dump(doc, out, indent=1)
    out.write("\n")
