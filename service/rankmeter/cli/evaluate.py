"""`rankmeter eval`: a TREC run against TREC qrels, as trec_eval does."""

from __future__ import annotations

import argparse
import sys

from rankmeter.cli.common import UsageError


class Level(float):
    """-l's number, remembering its text: trec_eval's names read it with atol (`1e3` is 1)."""
    text = "1"


def level(text: str) -> Level:
    value = Level(text)
    value.text = text
    return value


def add_parser(commands: argparse._SubParsersAction) -> None:
    ev = commands.add_parser(
        "eval", help="evaluate a TREC run against TREC qrels (a drop-in for trec_eval)",
        description="Evaluate a TREC run (qid Q0 docid rank score tag) against TREC qrels "
                    "(qid iter docid grade) with trec_eval's semantics. Documents are ordered "
                    "by score, ties by document id descending, as trec_eval does; only "
                    "queries present in both files are evaluated (all qrels queries with -c). "
                    "trec_eval's measure names (map, P.5,10, ndcg_cut.10, official, all_trec) "
                    "and flags print trec_eval's output; ir_measures names (nDCG@10, P@10, AP) "
                    "print rankmeter's; Rprec, P and infAP, both kinds, follow the other names, else "
                    "the flags (--format json, --digits, --average: ir_measures; -c -M -J -N -n: "
                    "trec_eval), else trec_eval's. Without -m: trec_eval's `official` set, or "
                    "nDCG@10 P@10 AP RR R@10 with an ir_measures flag.")
    ev.add_argument("qrels", metavar="QRELS")
    ev.add_argument("run", metavar="RUN", help="the run; - reads standard input")
    ev.add_argument("-m", "--measure", action="append", metavar="MEASURE",
                    help="a measure: trec_eval's name[.params] (map, P.5,10, iprec_at_recall, "
                         "all_trec, official, set) or ir_measures notation (nDCG@10, P@10, AP, "
                         "SetF(beta=0.5)); repeatable, not both kinds at once (default: official, or "
                         "nDCG@10 P@10 AP RR R@10 with --format json, --digits or --average)")
    ev.add_argument("-l", "--relevance-level", type=level, default=Level(1.0), metavar="N",
                    help="the lowest grade that counts as relevant (trec_eval's -l; default 1)")
    ev.add_argument("-q", "--per-query", action="store_true",
                    help="print every query's values too (trec_eval's -q)")
    ev.add_argument("-c", dest="complete", action="store_true",
                    help="trec_eval's -c: average over every qrels query, a query the run lacks scoring 0")
    ev.add_argument("-M", dest="max_docs", type=int, metavar="N",
                    help="trec_eval's -M: evaluate only each query's top N documents")
    ev.add_argument("-J", dest="judged_only", action="store_true",
                    help="trec_eval's -J: drop unjudged documents from the rankings first")
    ev.add_argument("-N", dest="num_docs", type=int, metavar="N",
                    help="trec_eval's -N: documents in the collection (for utility)")
    ev.add_argument("-n", dest="no_summary", action="store_true", help="trec_eval's -n: no `all` lines")
    ev.add_argument("-R", dest="rel_format", default="qrels", metavar="FORMAT",
                    help="trec_eval's -R: only `qrels` (prefs, qrels_prefs, qrels_jg are refused)")
    ev.add_argument("-T", dest="results_format", default="trec_results", metavar="FORMAT",
                    help="trec_eval's -T: only `trec_results`")
    ev.add_argument("-Z", dest="zscores", metavar="FILE", help="trec_eval's -Z: refused (z-scores are not supported)")
    ev.add_argument("--iprec-rounding", choices=["lround", "legacy"],
                    help="how interpolated precision turns a recall point r into R·r relevant "
                         "documents: lround (trec_eval 10, the default for trec_eval names) or "
                         "legacy, (long)(r·R + 0.9) (pytrec_eval and trec_eval 9, the default for "
                         "ir_measures names, and the live service's)")
    ev.add_argument("--average", choices=["macro", "micro"],
                    help="ir_measures names: the `all` line is the mean of per-query values (macro, "
                         "trec_eval's, the default) or summed numerators over summed denominators (micro)")
    ev.add_argument("--format", choices=["tsv", "json"], default="tsv", help="json: ir_measures names only")
    ev.add_argument("--digits", type=int, metavar="N",
                    help="ir_measures names: decimal places in tsv output (default 4, as trec_eval)")
    ev.set_defaults(run_command=run)


# Flags that belong to one reading of the command line only (-q, -l, --iprec-rounding: both).
TREC_FLAGS = {"complete": "-c", "max_docs": "-M", "judged_only": "-J", "num_docs": "-N", "no_summary": "-n"}
IR_FLAGS = {"format": "--format json", "digits": "--digits", "average": "--average"}
IR_DEFAULT = ["nDCG@10", "P@10", "AP", "RR", "R@10"]  # rankmeter eval's default before trec_eval's names


def run(args: argparse.Namespace) -> int:
    if args.rel_format != "qrels":
        raise UsageError(f"-R {args.rel_format}: only -R qrels is supported (trec_eval's preference and "
                         f"judgment-group formats are not)")
    if args.zscores is not None:
        raise UsageError("-Z: trec_eval's z-scores are not supported")
    if args.results_format != "trec_results":
        raise UsageError(f"-T {args.results_format}: only -T trec_results is supported")
    if args.max_docs is not None and args.max_docs < 0:
        raise UsageError(f"-M {args.max_docs}: the number of documents must be 0 or more")
    if _reading(args) == "trec":
        return run_trec(args, args.measure or ["official"])
    return run_ir_measures(args, args.measure or IR_DEFAULT)


def _reading(args: argparse.Namespace) -> str:
    """`trec` or `ir`, from the whole command line: trec_eval-only and ir_measures-only
    names decide; a name of both kinds (Rprec, P, infAP) follows them; with only those,
    or none, a flag of one kind decides, and without one trec_eval's (the drop-in)."""
    from rankmeter.engine import parse
    from rankmeter.trec_eval.names import is_trec_name

    def ir_name(name: str) -> bool:
        try:
            return bool(parse(name))
        except ValueError:
            return not is_trec_name(name)  # unknown: refused by the ir_measures parser
    names = args.measure or []
    trec = [n for n in names if is_trec_name(n) and not ir_name(n)]
    ir = [n for n in names if ir_name(n) and not is_trec_name(n)]
    if trec and ir:
        raise UsageError("measures " + ", ".join(map(repr, ir)) + " are not trec_eval names: give trec_eval "
                         "names with trec_eval's flags and output, or ir_measures names only")
    trec_flags = [flag for dest, flag in TREC_FLAGS.items() if getattr(args, dest) not in (None, False)]
    ir_flags = [flag for dest, flag in IR_FLAGS.items() if getattr(args, dest) not in (None, "tsv")]
    reading = "trec" if trec else "ir" if ir else "ir" if ir_flags and not trec_flags else "trec"
    if reading == "trec" and ir_flags:
        raise UsageError(f"{ir_flags[0]} takes ir_measures names (nDCG@10, AP, ...), not trec_eval's")
    if reading == "ir" and trec_flags:
        raise UsageError(f"{trec_flags[0]} takes trec_eval names (map, P.10, ...), not ir_measures'")
    return reading


def run_trec(args: argparse.Namespace, names: list[str]) -> int:
    from rankmeter.trec import atol
    from rankmeter.trec_eval.names import Options, columns
    from rankmeter.trec_eval.report import Flags, evaluate

    rounding = args.iprec_rounding or "lround"
    try:
        cols, missing = columns(names, Options(rounding, args.num_docs or 0), skip_missing=True)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if missing:  # a nickname's measures that are not implemented: said once, on stderr
        print(f"rankmeter eval: not implemented yet, left out: {', '.join(dict.fromkeys(missing))}", file=sys.stderr)
    flags = Flags(args.per_query, args.complete, args.max_docs, args.judged_only,
                  int(atol(args.relevance_level.text)), not args.no_summary, rounding)
    evaluate(args.qrels, args.run, cols, flags, sys.stdout)
    return 0


def run_ir_measures(args: argparse.Namespace, names: list[str]) -> int:
    from rankmeter.engine import parse_all
    from rankmeter.offline import evaluate_files, write_json, write_tsv

    if args.iprec_rounding == "lround":
        names = [n.replace("IPrec@", "IPrec(rounding=lround)@") if n.startswith("IPrec@") else
                 "IPrec(rounding=lround)" if n == "IPrec" else n for n in names]
    try:
        measures = parse_all(names)
    except ValueError as e:
        raise UsageError(str(e)) from None
    report = evaluate_files(args.qrels, args.run, measures, args.relevance_level, args.average or "macro")
    if args.format == "json":
        write_json(report, sys.stdout, args.per_query)
    else:
        write_tsv(report, sys.stdout, args.per_query, 4 if args.digits is None else args.digits)
    return 0
