"""`rankmeter eval`'s start-up beside a bare interpreter and numpy's import (issue 23).

    .venv/bin/python bench/startup_eval.py [--rounds 15] [--trec-eval PATH]

Each command runs --rounds times, the commands alternated round by round (the machine is
shared: alternation spreads its drift over all of them); the medians are printed, and
`rankmeter eval` beyond a bare `python -c pass`, numpy's import included, against the
target of at most ~150 ms. The input is the smallest there is: one judgment, one line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--trec-eval", metavar="PATH", help="a trec_eval binary to time too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        qrels, run = os.path.join(tmp, "qrels"), os.path.join(tmp, "run")
        with open(qrels, "w") as f:
            f.write("q1 0 d1 1\n")
        with open(run, "w") as f:
            f.write("q1 Q0 d1 1 1.0 tag\n")
        py = sys.executable
        cmds = {"python -c pass": [py, "-c", "pass"], "python -c 'import numpy'": [py, "-c", "import numpy"],
                "rankmeter eval -m map -m P.10 -m ndcg_cut.10": [py, "-m", "rankmeter", "eval", "-m", "map", "-m",
                                                                "P.10", "-m", "ndcg_cut.10", qrels, run],
                "rankmeter eval -q -m all_trec": [py, "-m", "rankmeter", "eval", "-q", "-m", "all_trec", qrels, run]}
        if args.trec_eval:
            cmds["trec_eval -m map -m P.10 -m ndcg_cut.10"] = [args.trec_eval, "-m", "map", "-m", "P.10", "-m",
                                                               "ndcg_cut.10", qrels, run]
        times: dict[str, list[float]] = {name: [] for name in cmds}
        for _ in range(args.rounds):
            for name, cmd in cmds.items():
                start = time.perf_counter()
                subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) * 1000 for name, t in times.items()}
    for name, ms in median.items():
        print(f"{ms:8.1f} ms  {name}")
    bare = median["python -c pass"]
    for name in [n for n in median if n.startswith("rankmeter")]:
        print(f"{median[name] - bare:8.1f} ms  {name}, beyond python -c pass (target <= ~150)")
    numpy = median["python -c 'import numpy'"]
    print(f"{numpy - bare:8.1f} ms  numpy's import alone, beyond python -c pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
