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
from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple, TextIO

from rankmeter.engine import Measure, parse, stack_scored
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


def _relstring(grades: Sequence[float], judged: Sequence[bool]) -> str:
    """m_relstring.c: a digit per grade, `>` above 9, `.` pooled but unjudged, `-` unpooled."""
    out = []
    for g, j in zip(grades, judged):
        out.append("-" if not j else "." if g < 0 else ">" if g > 9 else str(int(g)))
    return "".join(out)


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
    bogus = [q not in run for q in qids]
    values: dict[Measure, list[float]] = {}

    def per_query(m: Measure) -> list[float]:
        if m not in values:
            values[m] = m.values(m.compute(batch)).tolist()
        return values[m]

    table: list[tuple[Column, list]] = []
    for col in cols:
        if col.points:  # 11pt_avg: summed from the highest recall point down, as m_11pt_avg.c
            rounding = "(rounding=lround)" if flags.rounding == "lround" else ""
            rows = [per_query(parse(f"IPrec{rounding}@{cutoff_text(p)}")) for p in sorted(col.points, reverse=True)]
            table.append((col, [_sum(r) / len(rows) for r in zip(*rows)]))
        elif col.beta2 is not None:
            table.append((col, _set_f(col.beta2, *(per_query(parse(m)) for m in ("NumRelRet", "NumRet", "NumRel")))))
        elif col.label.startswith("relstring"):
            n = int(col.kind)
            table.append((col, [_relstring(batch.grades[i, :min(n, batch.length[i])],
                                           batch.judged[i, :min(n, batch.length[i])]) for i in range(len(qids))]))
        elif col.measure is not None:
            v = per_query(col.measure)
            if col.label.startswith("utility"):
                v = [0.0 if b else x for x, b in zip(v, bogus)]  # trec_eval zeroes a missing query's
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


def per_query_lines(qids: list[str], table: list[tuple[Column, list]]) -> str:
    """Every query's lines, query by query, each in the table's column order: by the C
    formatter (_treader.c, `lines`: C's printf, as trec_eval prints), else in Python."""
    try:
        from rankmeter._treader import lines
    except ImportError:
        return python_per_query_lines(qids, table)
    columns = []
    for col, vals in table:
        prefix = f"{col.label:<22}\t"
        if isinstance(vals[0], str):
            columns.append((prefix, "s", [f"'{v}'" for v in vals]))
        else:
            columns.append((prefix, "d" if col.kind == "long" else "f", vals))
    return lines(qids, columns)


def python_per_query_lines(qids: list[str], table: list[tuple[Column, list]]) -> str:
    """`per_query_lines` without the C formatter: a column at a time through one %-format
    (millions of lines), then query by query."""
    columns = [map(_format(col, vals[0]).__mod__, zip(qids, vals)) for col, vals in table]
    return "".join(chain.from_iterable(zip(*columns)))


def _set_f(x: float, rel_ret: list[float], ret: list[float], rel: list[float]) -> list[float]:
    """m_set_F.c: (x + 1)·P·R / (x·P + R) with x = β², in its order (0 with no relevant retrieved)."""
    out = []
    for hits, n, r in zip(rel_ret, ret, rel):
        p, recall = (hits / n, hits / r) if hits else (0.0, 1.0)
        out.append((x + 1.0) * p * recall / (x * p + recall))
    return out


def _sum(values) -> float:
    total = 0.0
    for v in values:  # in order, as trec_eval accumulates (no pairwise summation)
        total += v
    return total


def _summary(col: Column, vals: list, qids: list[str], qrels: dict, tag: str, flags: Flags):
    n = len(qids)
    if col.summary == "runid":
        return tag
    if col.summary == "count":
        return n
    if col.summary == "sum":
        if col.label == "num_rel" and flags.complete:  # m_num_rel.c: with -c, every grade > 0
            return sum(1 for q in qrels.values() for g in q.values() if g >= 1)
        return sum(int(v) for v in vals)
    if col.summary == "gm":
        return math.exp(_sum(math.log(max(v, MIN_GEO_MEAN)) for v in vals) / n)
    return _sum(vals) / n


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
