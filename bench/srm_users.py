"""The sample-ratio check by users (ab.unit: user), measured: A/A false alarms and power.

    .venv/bin/python bench/srm_users.py [--users 2000,100000,1000000] [--split 0.5,0.9,0.99]
        [--experiments 2000] [--seed 20261203]
    .venv/bin/python bench/srm_users.py --power [--users 10000,100000] [--true 0.52,0.51]

Users arrive one after another; each is assigned to the baseline with probability
`--split` (A/A) or `--true` (power, against a configured 50/50), and has a random 64-bit
id (what BLAKE2b of a client_id is: uniform). Each arm's distinct users are counted in
HyperLogLog registers exactly as Redis counts them — `rankmeter.ab.hll.add`, MurmurHash64A
of the 8-byte element, Redis's register rule, Ertl's estimator; identical to PFCOUNT
(tests/test_ab_user_counts.py) — so the count's error is Redis's, as a fixed function of the set
of users, correlated from look to look. A look every 100 users to 2,000, then every 2% of
growth (about 240 looks to 10⁶). At each look the product's p-value
(`rankmeter.ab.users.srm_users_p_value`), running minimum, against α = 0.05:

* `widened`: the product's test (the HLL bound β = 4·√2·σ);
* `naive`: the same test on the HLL counts as if they were exact (β = 0);
* `exact`: the true user counts (no HLL: what the test would do with the set of users).

Each line ends `… rate=… ci=[…, …]` (Clopper–Pearson 95%). `--power`: the share of
experiments flagged by the end and the median users to detection, at α/2 (the product
combines the user test with the query-share test, Bonferroni: each at α/2), against a
configured 50/50. The HLL line: over every path, the largest |log(û_T/û_B) −
log(u_T/u_B)| / (√2·σ) at a look (σ = 1.04/√16384), its 99th and 99.9th percentiles and
the share of paths above HLL_SIGMAS, and the share whose true share ever left the product's
interval (`share_interval`: the bound and the slack of whole users; the δ of the guarantee). About 0.15 s an experiment per 10⁶ users on one core.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from progress import Progress  # noqa: E402

from rankmeter.ab import hll  # noqa: E402
from rankmeter.ab.stats import srm_p_value  # noqa: E402
from rankmeter.ab.users import HLL_BOUND, HLL_SIGMAS, share_interval, srm_users_p_value  # noqa: E402

ALPHA = 0.05
SIGMA_RATIO = math.sqrt(2.0) * hll.RELATIVE_ERROR


def cp(k: int, n: int) -> str:
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return f"rate={k / n:.4f} ci=[{ci.low:.4f}, {ci.high:.4f}]"


def looks(users: int) -> np.ndarray:
    """Every 100 users to 2,000, then every 2% of growth, and the last."""
    grid = list(range(100, min(users, 2000) + 1, 100))
    x = 2000.0
    while x * 1.02 < users:
        x *= 1.02
        grid.append(int(x))
    return np.unique(np.array(grid + [users]))


def path(rng: np.random.Generator, users: int, share: float, at: np.ndarray):
    """One experiment: per look, (true, estimated) users of the baseline and the treatment."""
    ids = rng.integers(0, np.iinfo(np.uint64).max, users, dtype=np.uint64, endpoint=True)
    baseline = rng.random(users) < share
    true = np.stack([np.cumsum(baseline)[at - 1], np.cumsum(~baseline)[at - 1]], -1).astype(float)
    est = np.zeros_like(true)
    regs = [np.zeros(hll.REGISTERS, np.uint8), np.zeros(hll.REGISTERS, np.uint8)]
    start = 0
    for j, end in enumerate(at):
        chunk, arm = ids[start:end], baseline[start:end]
        hll.add(regs[0], chunk[arm])
        hll.add(regs[1], chunk[~arm])
        est[j] = hll.count(regs[0]), hll.count(regs[1])
        start = end
    return true, est


def first_alarm(counts: np.ndarray, split: float, bound: float, alpha: float) -> int:
    """The first look (index) whose p-value is below alpha, or -1 (running minimum: ever).
    bound 0: the counts as exact (no slack either)."""
    for j, (b, t) in enumerate(counts):
        if srm_users_p_value([b, t], [t, b], [split, 1.0 - split], bound=bound, slack=2.0 if bound else 0.0) < alpha:
            return j
    return -1


def left_bound(true: np.ndarray, est: np.ndarray) -> bool:
    """Whether the true share left the product's interval (share_interval) at some look: the δ."""
    for (tb, tt), (b, t) in zip(true, est):
        low, high = share_interval(b, t)
        if tb + tt > 0 and not low <= tb / (tb + tt) <= high:
            return True
    return False


def aa(args, users: int, split: float, rng: np.random.Generator) -> None:
    at = looks(users)
    hits = {"widened": 0, "naive": 0, "exact": 0}
    worst, left = [], 0
    progress = Progress(f"A/A {users:,} users {split}", args.experiments, "experiments")
    for e in range(args.experiments):
        true, est = path(rng, users, split, at)
        hits["widened"] += first_alarm(est, split, HLL_BOUND, ALPHA) >= 0
        hits["naive"] += first_alarm(est, split, 0.0, ALPHA) >= 0
        hits["exact"] += first_alarm(true, split, 0.0, ALPHA) >= 0
        error = np.log(est[:, 0] / est[:, 1]) - np.log(true[:, 0] / np.maximum(true[:, 1], 1))
        worst.append(np.max(np.abs(error[(true > 0).all(-1)])) / SIGMA_RATIO)
        left += left_bound(true, est)
        progress(e + 1)
    for name, k in hits.items():
        print(f"aa users={users} split={split:g}/{1 - split:g} test={name} looks={len(at)} "
              f"experiments={args.experiments} {cp(k, args.experiments)}", flush=True)
    w = np.array(worst)
    print(f"hll users={users} split={split:g}/{1 - split:g} sup_error_sigmas p50={np.percentile(w, 50):.2f} "
          f"p99={np.percentile(w, 99):.2f} p99.9={np.percentile(w, 99.9):.2f} max={w.max():.2f} "
          f"above_{HLL_SIGMAS:g}={int((w > HLL_SIGMAS).sum())}/{len(w)} "
          f"outside_bound_with_slack={left}/{len(w)}", flush=True)


def power(args, users: int, true_share: float, rng: np.random.Generator) -> None:
    at = looks(users)
    first = {"widened": [], "exact": []}
    progress = Progress(f"power {users:,} users {true_share}", args.experiments, "experiments")
    for e in range(args.experiments):
        true, est = path(rng, users, true_share, at)
        first["widened"].append(first_alarm(est, 0.5, HLL_BOUND, ALPHA / 2))
        first["exact"].append(first_alarm(true, 0.5, 0.0, ALPHA / 2))
        progress(e + 1)
    for name, found in first.items():
        hit = [at[j] for j in found if j >= 0]
        median = f"{int(np.median(hit)):,}" if hit else "-"
        print(f"power users={users} true={true_share:g}/{1 - true_share:g} configured=0.5/0.5 test={name} "
              f"alpha={ALPHA / 2:g} median_users_to_detection={median} "
              f"experiments={args.experiments} {cp(len(hit), args.experiments)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", default=None, help="users per experiment (comma-separated)")
    ap.add_argument("--split", default="0.5,0.9,0.99", help="A/A: the baseline's share")
    ap.add_argument("--power", action="store_true", help="power against a configured 50/50")
    ap.add_argument("--true", default="0.52,0.51", help="--power: the baseline's true share")
    ap.add_argument("--experiments", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=20261203)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    sizes = [int(float(u)) for u in (args.users or ("10000,100000" if args.power else "2000,100000,1000000")).split(",")]
    for users in sizes:
        for share in map(float, (args.true if args.power else args.split).split(",")):
            (power if args.power else aa)(args, users, share, rng)


if __name__ == "__main__":
    main()
