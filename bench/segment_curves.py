"""Per-segment examination curves (debias/segments.py) against the truth, over many seeds.

    .venv/bin/python bench/segment_curves.py [--seeds 40] [--first-seed 1] [--queries 6000]
        [--share 0.3] [--texts 200] [--same] [--cost]

Per seed: `--queries` pbm queries over `--texts` texts (lists of 10 of 15 documents, a noisy
ranking: tests/test_debias_segments.py's traffic), a share `--share` by users of the geometric
curve 0.75^(r-1) (segment `mobile`; with `--same` the desktop one), the rest by 1/r^0.9 users (`desktop`), every query
harvested into `ModelTables` with the default settings (debias.segment_capacity,
debias.segment_min_pairs). Prints, per seed, whether mobile got its own curve, its pairs
(the fewest of any rank), the largest error of its curve and of the global one against
mobile's truth, and desktop's (the majority's) own and global errors against its truth; then the seeds with their own curve, and those within `--tolerance`, with
Clopper–Pearson 95% intervals. `--cost`: only the harvest's cost a query, without and with
the segments' tables.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import beta

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rankmeter.config import Debias  # noqa: E402
from rankmeter.debias import segments  # noqa: E402
from rankmeter.debias.tables import ModelTables, decide  # noqa: E402
from test_debias_segments import CURVES, K, traffic  # noqa: E402


def clopper_pearson(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    low = 0.0 if k == 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
    high = 1.0 if k == n else float(beta.ppf(1 - alpha / 2, k + 1, n - k))
    return low, high


def one(seed: int, queries: int, share: float, texts: int, same: bool) -> tuple[bool, float, float | None, float, str]:
    d = Debias()
    tables = ModelTables(K, d.capacity, segment_capacity=d.segment_capacity, segment_limit=21)
    truth = {"mobile": CURVES["desktop"] if same else CURVES["mobile"], "desktop": CURVES["desktop"]}
    for qid, t, shown, clicked, segment in traffic(queries, seed, share, texts, truth):
        tables.observe(qid, f"t{t}", shown, set(clicked), {doc: 1.0 for doc in clicked}, segment)
    look = decide(tables.vector(), K, d.min_pairs, None)
    found = segments.curves(tables.segments.vectors(), K, d.segment_min_pairs)
    pairs = float(tables.segments.tables["mobile"].sums.pairs.sum(axis=1).min())
    own = found.get("mobile")
    error = None if own is None else float(np.abs(np.array(own) - truth["mobile"]).max())
    glob = np.array(look.pbm.relative, dtype=float)
    # desktop, the majority: its own curve against the global one, both against its truth
    desk = found.get("desktop")
    desktop = "" if desk is None else (f"{np.abs(np.array(desk) - CURVES['desktop']).max():.3f} / "
                                       f"{np.abs(glob - CURVES['desktop']).max():.3f}")
    return own is not None, pairs, error, float(np.abs(glob - truth["mobile"]).max()), desktop


def cost(queries: int, texts: int) -> None:
    """The harvest's cost a query, without and with its segment's table (half the queries
    mobile, the rest desktop)."""
    items = list(traffic(queries, 1, 0.5, texts))
    d = Debias()
    for label, with_segments in (("global only", False), ("with segments", True)):
        tables = ModelTables(K, d.capacity, segment_capacity=d.segment_capacity, segment_limit=21)
        start = time.perf_counter()
        for qid, t, shown, clicked, segment in items:
            tables.observe(qid, f"t{t}", shown, set(clicked), {doc: 1.0 for doc in clicked},
                           segment if with_segments else "")
        print(f"{label}: {(time.perf_counter() - start) / len(items) * 1e6:.0f} µs a query")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--queries", type=int, default=6000)
    parser.add_argument("--share", type=float, default=0.3)
    parser.add_argument("--texts", type=int, default=200)
    parser.add_argument("--tolerance", type=float, default=0.08)
    parser.add_argument("--same", action="store_true", help="mobile users examine as desktop ones do")
    parser.add_argument("--cost", action="store_true", help="only time the harvest, without and with segments")
    args = parser.parse_args()
    if args.cost:
        cost(args.queries, args.texts)
        return
    rows = []
    print("| seed | mobile: own curve | pairs (fewest rank) | own curve's error | global curve's error "
          "| desktop: own / global error |")
    print("|---|---|---|---|---|---|")
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        own, pairs, error, glob, desktop = one(seed, args.queries, args.share, args.texts, args.same)
        rows.append((own, error, glob))
        print(f"| {seed} | {'yes' if own else 'no'} | {pairs:.0f} | {'' if error is None else f'{error:.3f}'} "
              f"| {glob:.3f} | {desktop} |", flush=True)
    n = len(rows)
    has = sum(own for own, _, _ in rows)
    within = sum(1 for own, error, _ in rows if own and error is not None and error < args.tolerance)
    errors = [e for _, e, _ in rows if e is not None]
    print()
    print(f"own curve {has}/{n} (95% CI {clopper_pearson(has, n)[0]:.3f}–{clopper_pearson(has, n)[1]:.3f}); "
          f"within {args.tolerance} {within}/{n} (95% CI {clopper_pearson(within, n)[0]:.3f}–"
          f"{clopper_pearson(within, n)[1]:.3f}); own error median {np.median(errors) if errors else float('nan'):.3f} "
          f"max {max(errors) if errors else float('nan'):.3f}; global error median "
          f"{np.median([g for _, _, g in rows]):.3f}")


if __name__ == "__main__":
    main()
