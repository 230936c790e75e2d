"""`rankmeter eval`: a TREC run against TREC qrels, as trec_eval does."""

from __future__ import annotations

import argparse
import sys

from rankmeter.cli.common import UsageError
from rankmeter.engine import parse_all

DEFAULT_MEASURES = ["nDCG@10", "P@10", "AP", "RR", "R@10"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    ev = commands.add_parser(
        "eval", help="evaluate a TREC run against TREC qrels (like trec_eval)",
        description="Evaluate a TREC run (qid Q0 docid rank score tag) against TREC qrels "
                    "(qid iter docid grade) with trec_eval's semantics. Documents are ordered "
                    "by score, ties by document id descending, as trec_eval does; only "
                    "queries present in both files are evaluated.")
    ev.add_argument("qrels", metavar="QRELS")
    ev.add_argument("run", metavar="RUN")
    ev.add_argument("-m", "--measure", action="append", metavar="MEASURE",
                    help="a measure in ir_measures notation, e.g. nDCG@10, P@10, AP, "
                         "SetF(beta=0.5); repeatable (default: %s)" % " ".join(DEFAULT_MEASURES))
    ev.add_argument("-l", "--relevance-level", type=float, default=1.0, metavar="N",
                    help="the lowest grade that counts as relevant (trec_eval's -l; default 1)")
    ev.add_argument("-q", "--per-query", action="store_true",
                    help="print every query's values too (trec_eval's -q)")
    ev.add_argument("--average", choices=["macro", "micro"], default="macro",
                    help="the `all` line: mean of per-query values (macro, trec_eval's) or "
                         "summed numerators over summed denominators (micro)")
    ev.add_argument("--format", choices=["tsv", "json"], default="tsv")
    ev.add_argument("--digits", type=int, default=4, metavar="N",
                    help="decimal places in tsv output (default 4, as trec_eval)")
    ev.set_defaults(run_command=run)


def run(args: argparse.Namespace) -> int:
    from rankmeter.offline import evaluate_files, write_json, write_tsv

    try:
        measures = parse_all(args.measure or DEFAULT_MEASURES)
    except ValueError as e:
        raise UsageError(str(e)) from None
    report = evaluate_files(args.qrels, args.run, measures, args.relevance_level, args.average)
    if args.format == "json":
        write_json(report, sys.stdout, args.per_query)
    else:
        write_tsv(report, sys.stdout, args.per_query, args.digits)
    return 0
