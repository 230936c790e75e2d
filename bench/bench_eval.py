"""`rankmeter eval` against pytrec_eval, both from the same files, in one run.

    .venv/bin/python bench/bench_eval.py [--queries 10000] [--docs 100] [--repeat 3] [--trec-eval PATH]

Both sides go from TREC files to per-query values and their means for nDCG@10, P@10 and
AP: rankmeter with `rankmeter.offline.evaluate_files`, pytrec_eval with its own
`parse_qrel`/`parse_run` and `RelevanceEvaluator`. The two alternate, each timed
`--repeat` times; the ratio of the medians is the figure to report, since the machine
is shared and absolute times drift. The values are checked equal before timing.

With `--trec-eval PATH` (a trec_eval binary built from usnistgov/trec_eval), the two
commands are timed too, end to end as a user runs them (process start-up included):
`trec_eval -m map -m P.10 -m ndcg_cut.10`, `trec_eval -q -m all_trec` and `trec_eval -m
all_trec` against `rankmeter eval` with the same arguments, whose outputs must be identical.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import pytrec_eval

from rankmeter.engine import parse_all
from rankmeter.offline import evaluate_files

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from summary import save  # noqa: E402  (bench/results/eval.json for bench/summary.py)

MEASURES = {"nDCG@10": "ndcg_cut_10", "P@10": "P_10", "AP": "map"}


def write_files(directory: str, queries: int, docs: int, seed: int = 42) -> tuple[str, str]:
    rnd = random.Random(seed)
    qrels_path, run_path = os.path.join(directory, "qrels"), os.path.join(directory, "run")
    with open(qrels_path, "w") as qrels, open(run_path, "w") as run:
        for q in range(queries):
            shown = rnd.sample(range(docs * 3), docs)
            for d in rnd.sample(range(docs * 3), docs // 2):  # half as many judged, partly overlapping
                qrels.write(f"q{q} 0 d{d} {rnd.choice((0, 0, 1, 2, 3))}\n")
            for rank, d in enumerate(shown, start=1):
                run.write(f"q{q} Q0 d{d} {rank} {rnd.randrange(1000) / 10} bench\n")
    return qrels_path, run_path


def rankmeter_eval(qrels: str, run: str) -> dict[str, float]:
    report = evaluate_files(qrels, run, parse_all(MEASURES))
    return {str(m): v for m, v in report.overall.items()}


def pytrec_eval_eval(qrels: str, run: str) -> dict[str, float]:
    with open(qrels) as f:
        judgments = pytrec_eval.parse_qrel(f)
    with open(run) as f:
        results = pytrec_eval.parse_run(f)
    per_query = pytrec_eval.RelevanceEvaluator(judgments, {"ndcg_cut.10", "P.10", "map"}).evaluate(results)
    return {ours: statistics.fmean(v[theirs] for v in per_query.values()) for ours, theirs in MEASURES.items()}


def timed(fn, *args) -> tuple[float, dict[str, float]]:
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


TREC_ARGS = ["-m", "map", "-m", "P.10", "-m", "ndcg_cut.10"]
ALL_TREC_ARGS = ["-q", "-m", "all_trec"]  # every measure, every query's lines: the printing too
SUMMARY_ARGS = ["-m", "all_trec"]  # every measure, the `all` lines only


def commands(trec_eval: str, qrels: str, run: str) -> dict[str, list[str]]:
    rankmeter = shutil.which("rankmeter", path=os.path.dirname(sys.executable)) or "rankmeter"
    return {"trec_eval": [trec_eval, *TREC_ARGS, qrels, run], "rankmeter eval": [rankmeter, "eval", *TREC_ARGS, qrels, run],
            "trec_eval -q all_trec": [trec_eval, *ALL_TREC_ARGS, qrels, run],
            "rankmeter eval -q all_trec": [rankmeter, "eval", *ALL_TREC_ARGS, qrels, run],
            "trec_eval all_trec": [trec_eval, *SUMMARY_ARGS, qrels, run],
            "rankmeter eval all_trec": [rankmeter, "eval", *SUMMARY_ARGS, qrels, run]}


def compare_commands(trec_eval: str, qrels: str, run: str, repeat: int) -> dict[str, float]:
    cmds = commands(trec_eval, qrels, run)
    outputs = {name: subprocess.run(cmd, capture_output=True, check=True).stdout for name, cmd in cmds.items()}
    assert outputs["trec_eval"] == outputs["rankmeter eval"], "outputs differ (-m map -m P.10 -m ndcg_cut.10)"
    assert outputs["trec_eval -q all_trec"] == outputs["rankmeter eval -q all_trec"], "outputs differ (-q all_trec)"
    assert outputs["trec_eval all_trec"] == outputs["rankmeter eval all_trec"], "outputs differ (all_trec)"
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for _ in range(repeat):
        for name, cmd in cmds.items():
            start = time.perf_counter()
            subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=10_000)
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--trec-eval", metavar="PATH", help="a trec_eval binary to time against")
    args = ap.parse_args()
    command_times: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"writing {args.queries} queries x {args.docs} documents ...", file=sys.stderr)
        qrels, run = write_files(tmp, args.queries, args.docs)
        ours, theirs = rankmeter_eval(qrels, run), pytrec_eval_eval(qrels, run)
        for name in MEASURES:
            assert abs(ours[name] - theirs[name]) < 1e-9, (name, ours[name], theirs[name])
        times: dict[str, list[float]] = {"rankmeter": [], "pytrec_eval": []}
        for i in range(args.repeat):
            times["rankmeter"].append(timed(rankmeter_eval, qrels, run)[0])
            times["pytrec_eval"].append(timed(pytrec_eval_eval, qrels, run)[0])
            print(f"round {i + 1}/{args.repeat}: rankmeter {times['rankmeter'][-1]:.2f} s, "
                  f"pytrec_eval {times['pytrec_eval'][-1]:.2f} s", file=sys.stderr)
        if args.trec_eval:
            command_times = compare_commands(args.trec_eval, qrels, run, args.repeat)
    ours_s, theirs_s = statistics.median(times["rankmeter"]), statistics.median(times["pytrec_eval"])
    print(f"queries={args.queries} docs_per_query={args.docs} measures={','.join(MEASURES)}")
    print(f"rankmeter_eval_seconds={ours_s:.3f}")
    print(f"pytrec_eval_seconds={theirs_s:.3f}")
    print(f"speedup_vs_pytrec_eval={theirs_s / ours_s:.2f}")
    result = {"queries": args.queries, "docs_per_query": args.docs, "repeat": args.repeat,
              "rankmeter_eval_seconds": ours_s, "pytrec_eval_seconds": theirs_s,
              "speedup_vs_pytrec_eval": theirs_s / ours_s}
    if command_times:
        ours_cmd, theirs_cmd = command_times["rankmeter eval"], command_times["trec_eval"]
        print(f"rankmeter_eval_command_seconds={ours_cmd:.3f}")
        print(f"trec_eval_command_seconds={theirs_cmd:.3f}")
        print(f"speedup_vs_trec_eval={theirs_cmd / ours_cmd:.2f}")
        ours_all, theirs_all = command_times["rankmeter eval -q all_trec"], command_times["trec_eval -q all_trec"]
        print(f"rankmeter_eval_all_trec_command_seconds={ours_all:.3f}")
        print(f"trec_eval_all_trec_command_seconds={theirs_all:.3f}")
        print(f"speedup_vs_trec_eval_all_trec={theirs_all / ours_all:.2f}")
        ours_sum, theirs_sum = command_times["rankmeter eval all_trec"], command_times["trec_eval all_trec"]
        print(f"rankmeter_eval_all_trec_summary_command_seconds={ours_sum:.3f}")
        print(f"trec_eval_all_trec_summary_command_seconds={theirs_sum:.3f}")
        print(f"speedup_vs_trec_eval_all_trec_summary={theirs_sum / ours_sum:.2f}")
        result.update({"rankmeter_eval_all_trec_summary_command_seconds": ours_sum,
                       "trec_eval_all_trec_summary_command_seconds": theirs_sum,
                       "speedup_vs_trec_eval_all_trec_summary": theirs_sum / ours_sum})
        result.update({"rankmeter_eval_command_seconds": ours_cmd, "trec_eval_command_seconds": theirs_cmd,
                       "speedup_vs_trec_eval": theirs_cmd / ours_cmd,
                       "rankmeter_eval_all_trec_command_seconds": ours_all,
                       "trec_eval_all_trec_command_seconds": theirs_all,
                       "speedup_vs_trec_eval_all_trec": theirs_all / ours_all})
    save("eval", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
