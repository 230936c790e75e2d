"""trec_eval's evaluation loop and output, on the one engine (trec_eval.c, form_res_rels.c,
meas_avg.c, meas_print_single.c, meas_print_final.c).

- Queries: those in both files, in qid byte order; with -c every qrels query, a missing
  one scoring as an empty ranking (trec_eval's bogus one-document ranking, then zeroed).
- A ranking is ordered by score, ties by document id descending; -M N keeps its top N,
  then -J drops the documents without a judgment (none, or a negative one).
- Grades are whole numbers, as trec_eval's atol reads them (trec.atol: `1e3` is 1); -l too.
- Output lines are `%-22s\t%s\t%6.4f` (counts `%ld`); with -q each query's lines come
  first, in trec_eval's measure order, then the `all` lines: means over the queries,
  sums for the num_* counts, geometric means (of max(value, 0.00001)) for gm_*.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import NamedTuple, TextIO

import numpy as np

from rankmeter.engine import Batch, Measure, parse, stack_scored
from rankmeter.trec import InputError, gc_paused, rank, read_qrels, read_run
from rankmeter.trec_eval.names import Column, cutoff_text

MIN_GEO_MEAN = 0.00001  # trec_eval.h


class Flags(NamedTuple):
    per_query: bool = False       # -q
    complete: bool = False        # -c
    max_docs: int | None = None   # -M
    judged_only: bool = False     # -J
    level: int = 1                # -l
    summary: bool = True          # not -n
    rounding: str = "lround"


def _select(scores: dict[str, float], grades: dict[str, float], flags: Flags) -> dict[str, float]:
    ranked = rank(scores)
    if flags.max_docs is not None:
        ranked = ranked[:max(flags.max_docs, 0)]
    if flags.judged_only:
        ranked = [d for d in ranked if grades.get(d, -1.0) >= 0]
    return {d: scores[d] for d in ranked}


RELSTRING = np.frombuffer(b"-.0123456789>", np.uint8)  # unpooled, pooled unjudged, grades 0-9, above 9


def _relstrings(batch: Batch, n: int) -> list[str]:
    """m_relstring.c: per query, a character per document of its top n: a digit per grade,
    `>` above 9, `.` pooled but unjudged (a negative grade), `-` unpooled (no judgment)."""
    grades, judged = batch.grades[:, :n], batch.judged[:, :n]
    digit = 2 + np.clip(grades, 0, 9).astype(int)
    code = np.where(~judged, 0, np.where(grades < 0, 1, np.where(grades > 9, 12, digit)))
    text = RELSTRING[code].tobytes().decode("ascii")
    width = code.shape[1]
    return [text[i * width:i * width + k] for i, k in enumerate(np.minimum(batch.length, n).tolist())]


def evaluate(qrels_path: str, run_path: str, cols: list[Column], flags: Flags, out: TextIO) -> None:
    with gc_paused():  # millions of small objects, no cycles: see trec.gc_paused
        qrels = read_qrels(qrels_path, atol=True)
        run = read_run(run_path)
        qids = sorted(qrels) if flags.complete else sorted(q for q in run if q in qrels)
        if not qids:
            raise InputError(run_path, None, f"no query of this run has judgments in {qrels_path}")
        grades = [qrels[q] for q in qids]
        scores = [run.get(q, {}) for q in qids]
        if flags.max_docs is not None or flags.judged_only:
            scores = [_select(s, g, flags) for s, g in zip(scores, grades)]
        batch = stack_scored(scores, grades, flags.level)
    bogus = np.array([q not in run for q in qids])
    values: dict[Measure, np.ndarray] = {}

    def per_query(m: Measure) -> np.ndarray:
        if m not in values:
            values[m] = m.values(m.compute(batch))
        return values[m]

    table: list[tuple[Column, Sequence]] = []
    for col in cols:
        if col.points:  # 11pt_avg: summed from the highest recall point down, as m_11pt_avg.c
            rounding = "(rounding=lround)" if flags.rounding == "lround" else ""
            total = np.zeros(len(qids))
            for p in sorted(col.points, reverse=True):
                total += per_query(parse(f"IPrec{rounding}@{cutoff_text(p)}"))
            table.append((col, total / len(col.points)))
        elif col.beta2 is not None:
            table.append((col, _set_f(col.beta2, *(per_query(parse(m)) for m in ("NumRelRet", "NumRet", "NumRel")))))
        elif col.label.startswith("relstring"):
            table.append((col, _relstrings(batch, int(col.kind))))
        elif col.measure is not None:
            v = per_query(col.measure)
            if col.label.startswith("utility"):
                v = np.where(bogus, 0.0, v)  # trec_eval zeroes a missing query's
            table.append((col, v))
        else:
            table.append((col, []))
    lines: list[str] = []
    if flags.per_query:
        lines.append(per_query_lines(qids, [(col, vals) for col, vals in table if col.per_query]))
    if flags.summary:
        lines.extend(_line(col, "all", _summary(col, vals, qids, qrels, run.last_tag, flags)) for col, vals in table
                     if col.summary != "none")
    out.write("".join(lines))


def per_query_lines(qids: list[str], table: list[tuple[Column, Sequence]]) -> str:
    """Every query's lines, query by query, each in the table's column order: by the C
    formatter (_treader.c `lines`: `%6.4f` as trec_eval's printf rounds it), else in Python."""
    try:
        from rankmeter._treader import lines
    except ImportError:
        return python_per_query_lines(qids, table)
    columns = []
    for col, vals in table:
        prefix = f"{col.label:<22}\t"
        if isinstance(vals, np.ndarray):
            columns.append((prefix, "d" if col.kind == "long" else "f", vals.tolist()))
        else:
            columns.append((prefix, "s", [f"'{v}'" for v in vals]))
    return lines(qids, columns)


def python_per_query_lines(qids: list[str], table: list[tuple[Column, Sequence]]) -> str:
    """`per_query_lines` without the C formatter: a column at a time through one %-format
    (millions of lines), then query by query."""
    columns = [map(_format(col, vals[0]).__mod__, zip(qids, vals.tolist() if isinstance(vals, np.ndarray) else vals))
               for col, vals in table]
    return "".join(chain.from_iterable(zip(*columns)))


def _set_f(x: float, rel_ret: np.ndarray, ret: np.ndarray, rel: np.ndarray) -> np.ndarray:
    """m_set_F.c: (x + 1)·P·R / (x·P + R) with x = β², in its order (0 with no relevant retrieved)."""
    hits = rel_ret != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        p, recall = np.where(hits, rel_ret / ret, 0.0), np.where(hits, rel_ret / rel, 1.0)
    return (x + 1.0) * p * recall / (x * p + recall)


def _sum(values: Iterable[float]) -> float:
    total = 0.0
    for v in values:  # in order, as trec_eval accumulates (no pairwise summation)
        total += v
    return total


def _mean(values: np.ndarray) -> float:
    """`_sum(values) / len(values)`: cumsum adds in order as _sum does (np.sum would pair);
    + 0.0 for _sum's start of 0.0 (where -0.0s alone sum to 0.0)."""
    return (float(np.cumsum(values)[-1]) + 0.0) / len(values)


def _summary(col: Column, vals: np.ndarray, qids: list[str], qrels: dict, tag: str, flags: Flags):
    n = len(qids)
    if col.summary == "runid":
        return tag
    if col.summary == "count":
        return n
    if col.summary == "sum":
        if col.label == "num_rel" and flags.complete:  # m_num_rel.c: with -c, every grade > 0
            return sum(1 for q in qrels.values() for g in q.values() if g >= 1)
        return sum(map(int, vals.tolist()))
    if col.summary == "gm":  # math.log, as C's log: numpy's may differ in the last bit
        return math.exp(_sum(math.log(max(v, MIN_GEO_MEAN)) for v in vals.tolist()) / n)
    return _mean(vals)


def _format(col: Column, sample) -> str:
    """`_line`'s line as a %-format of (qid, value), for every value of a column like `sample`."""
    label = col.label.replace("%", "%%")
    if isinstance(sample, str):
        return f"{label:<22}\t%s\t%s\n" if col.summary == "runid" else f"{label:<22}\t%s\t'%s'\n"
    return f"{label:<22}\t%s\t%d\n" if col.kind == "long" else f"{label:<22}\t%s\t%6.4f\n"


def _line(col: Column, qid: str, value) -> str:
    if isinstance(value, str):
        if col.summary == "runid":
            return f"{col.label:<22}\t{qid}\t{value}\n"
        return f"{col.label:<22}\t{qid}\t'{value}'\n"
    if col.kind == "long":
        return f"{col.label:<22}\t{qid}\t{int(value)}\n"
    return f"{col.label:<22}\t{qid}\t{value:6.4f}\n"
