"""False withdrawals of the fit test on position-based users: in how many seeds a look
withdraws the debiased series as `poor_fit` (or for any reason after a first `ok`) although
the simulator's users are position-based, as a function of the calibration's noise margin
`z` (fit.CALIBRATION_Z) and of the traffic.

    PYTHONPATH=service .venv/bin/python bench/fit_noise.py --mode serve [--seeds 200]
        [--traffic-seed 7] [--rate 400] [--duration 15] [--z 0,1,2,2.5,3] [--min-expected 30]
    PYTHONPATH=service .venv/bin/python bench/fit_noise.py --mode bench [--queries 6000]

Figures and commands: docs/debiasing.md, "The fit test".

Every look is judged as the service judges it, and a withdrawal at any look counts.

- `serve`: tests/integration/test_dashboards.py's traffic, in process: `rankmeter
  simulate --rate 400 --duration 15`'s simulator (its defaults; each seed its own traffic
  and query ids, so its own held-out queries), every event sent as the simulator sends it
  (at once, the clicks stamped later), 4 partitions, the `Pipeline` with the test's
  settings (attribution 2 s, grace 0 s, every query harvested, `debias.min_pairs` 10),
  read every 0.25 s, a look every 5 s (at a random phase), and two more after the last
  event (the test waits on the series for 30 s more: the sums no longer change).
- `bench`: bench/debias_agreement.py's harvest (`ModelTables`, every query with all its
  clicks, a look every 500 queries), `--queries` of them.

For each rule (z, and `fit.MIN_EXPECTED`: `--min-expected`), one chain of decisions
(`fit.judge` with it, its own previous look) at every look of the same run: the sums and
the model chosen do not depend on the decisions. Prints, per rule, the seeds withdrawn as `poor_fit` at some look and the seeds withdrawn for
any reason after a first `ok`, with Wilson 95% intervals; and the smallest calibration
margin (in SDs, (ratio − bound)·√expected) over the looks, its quantiles over seeds.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from unittest import mock

import numpy as np

from rankmeter import config
from rankmeter.debias import DEFAULT_CAPACITY, DEFAULT_MIN_PAIRS, fit, tables as tables_module
from rankmeter.debias.clickmodels import MODELS, FitLayout
from rankmeter.debias.tables import ModelTables, split
from rankmeter.pipeline import Pipeline
from rankmeter.pipeline import position_bias
from rankmeter.simulator.traffic import Simulator
from rankmeter.source import Bus
from rankmeter.store import MemoryStore

K = 10
START_MS = 1_800_000_000_000
# tests/integration/test_dashboards.py's EXPERIMENT (the position-bias part).
SERVE_ENV = {"RANKMETER_WINDOWS_ATTRIBUTION": "2s", "RANKMETER_WINDOWS_GRACE": "0s",
             "RANKMETER_DEBIAS_HARVEST_SHARE": "1", "RANKMETER_DEBIAS_MIN_PAIRS": "10"}
LOOK_EVERY_S = 5.0      # serve's look at the propensities
READ_EVERY_S = 0.25
BENCH_LOOK_EVERY = 500  # bench/debias_agreement.py's LOOK_EVERY


Rule = tuple[float, float]  # (z, MIN_EXPECTED)


class Chains:
    """One sequence of decisions per rule (z, fit.MIN_EXPECTED), fed every look's
    estimates and sums."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = rules
        self.previous: dict[Rule, fit.Look | None] = {r: None for r in rules}
        self.reasons: dict[Rule, list[str]] = {r: [] for r in rules}
        self.margins: list[float] = []  # per look: the smallest (ratio − bound)·√expected, withdraw bounds

    def judge(self, vector: np.ndarray, look: fit.Look) -> None:
        fit_sums = split(vector, K)[2]
        layout = FitLayout(K)
        for rule in self.rules:
            z, min_expected = rule
            with mock.patch.object(fit, "MIN_EXPECTED", min_expected):
                self.previous[rule] = fit.judge(look.pbm, look.ubm, fit_sums, layout, self.previous[rule], z)
            self.reasons[rule].append(self.previous[rule].reason)
        m = MODELS.index(look.model)
        margin = math.inf
        for cls in (0, 1):
            ratio = layout.observed_over_expected(fit_sums, m, cls, fit.MIN_EXPECTED)
            if ratio is not None:
                low, high = fit.CALIBRATION[0]
                margin = min(margin, min(ratio - low, high - ratio) * math.sqrt(layout.expected(fit_sums, m, cls)))
        self.margins.append(margin)


def withdrawn(reasons: list[str]) -> tuple[bool, bool]:
    """(poor_fit at some look, any withdrawal after a first ok)."""
    first_ok = reasons.index("ok") if "ok" in reasons else len(reasons)
    return "poor_fit" in reasons, any(r != "ok" for r in reasons[first_ok:])


def run_serve(seed: int, zs: list[Rule], rate: float, duration: float, traffic_seed: int | None = None) -> Chains:
    settings = config.load(None, SERVE_ENV)
    rng = np.random.default_rng(10_000 + seed)
    # `rankmeter simulate`'s defaults; its --seed (7) fixes the traffic, the run id (random)
    # the query ids, and so the held-out queries.
    sim = Simulator(seed=seed if traffic_seed is None else traffic_seed, run_id=f"n{seed}")
    now = [START_MS / 1000]
    store, bus = MemoryStore(), Bus(partitions=4)
    pipeline = Pipeline(settings, store, lambda r, why: None, lambda: now[0], lambda: now[0])
    topics = {"impressions": settings.kafka.impressions_topic, "feedback": settings.kafka.feedback_topic}
    bus.subscribe(list(topics.values()), pipeline.assign, pipeline.revoke)
    chains = Chains(zs)
    real_deciding = tables_module.deciding

    def deciding(vector, ranks, min_pairs, previous):
        look = yield from real_deciding(vector, ranks, min_pairs, previous)
        chains.judge(vector, look)
        return look

    def read() -> None:
        while records := bus.poll(0, 10_000):
            pipeline.process(records)

    sent, next_read = 0, 0.0
    next_look = float(rng.uniform(0, LOOK_EVERY_S))
    with mock.patch.object(position_bias, "deciding", deciding):
        while (elapsed := sent / rate) < duration:
            now[0] = START_MS / 1000 + elapsed
            for event in sim.query_events(int(now[0] * 1000), elapsed):  # as Simulator.run sends them
                bus.send(topics[event.stream], event.key.encode(), json.dumps(event.value).encode(),
                         timestamp_ms=int(now[0] * 1000))
                sent += 1
            if elapsed >= next_read:
                read()
                next_read += READ_EVERY_S
            if elapsed >= next_look:
                pipeline.look_at_position_bias(estimate_here=True)
                next_look += LOOK_EVERY_S
        # Read to the end (the topics caught up: the last queries' clicks are final), and
        # the looks while the test waits.
        pipeline.caught_up = {(t, p) for t in topics.values() for p in range(4)}
        for _ in range(2):
            now[0] += LOOK_EVERY_S
            read()
            pipeline.process([])
            pipeline.look_at_position_bias(estimate_here=True)
    return chains


def run_bench(seed: int, zs: list[Rule], queries: int) -> Chains:
    sim = Simulator(seed=seed, run_id=f"s{seed}", tally=False)
    tables = ModelTables(K, DEFAULT_CAPACITY)
    chains = Chains(zs)
    look = None
    for i in range(queries + 1):
        if i % BENCH_LOOK_EVERY == 0 and i > 0:
            look = tables_module.decide(tables.vector(), K, DEFAULT_MIN_PAIRS, look)
            tables.looked(look)
            chains.judge(tables.vector(), look)
        if i == queries:
            break
        events = sim.query_events(1_700_000_000_000 + i * 500, i * 0.5)
        impression = next(e.value for e in events if e.stream == "impressions")
        clicked = {e.value["doc_id"] for e in events if e.stream == "feedback" and e.value["action"] == "click"}
        tables.observe(impression["query_id"], impression["user_query"], impression["results"], clicked,
                       {d: 1.0 for d in clicked})
    return chains


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("serve", "bench"), default="serve")
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--rate", type=float, default=400.0, help="serve: events a second")
    parser.add_argument("--duration", type=float, default=15.0, help="serve: seconds of traffic")
    parser.add_argument("--traffic-seed", type=int, default=None,
                        help="serve: the simulator's seed for every run (`rankmeter simulate`'s default: 7); "
                             "each seed then only draws the query ids and the looks' phase")
    parser.add_argument("--queries", type=int, default=6000, help="bench: queries harvested")
    parser.add_argument("--z", default="0,1,1.5,2,2.5,3", help="calibration margins, comma-separated")
    parser.add_argument("--min-expected", default=str(fit.MIN_EXPECTED),
                        help="expected clicks a class needs to be judged, comma-separated")
    args = parser.parse_args(argv)
    zs = [(float(z), float(m)) for m in args.min_expected.split(",") for z in args.z.split(",")]
    started = time.monotonic()
    runs: list[Chains] = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        runs.append(run_serve(seed, zs, args.rate, args.duration, args.traffic_seed) if args.mode == "serve"
                    else run_bench(seed, zs, args.queries))
        print(f"\rseed {seed} ({time.monotonic() - started:.0f} s)", end="", file=sys.stderr)
    print(file=sys.stderr)
    n = len(runs)
    fixed = "" if args.traffic_seed is None else f", traffic seed {args.traffic_seed}"
    traffic = (f"{args.rate:g} events/s for {args.duration:g} s{fixed}" if args.mode == "serve"
               else f"{args.queries} queries, a look every {BENCH_LOOK_EVERY}")
    looks = [len(r.margins) for r in runs]
    print(f"### {args.mode}: {traffic}, {n} seeds ({args.first_seed}-{args.first_seed + n - 1}), "
          f"{min(looks)}-{max(looks)} looks a seed\n")
    print("| z | min expected | poor_fit at some look | 95% CI | withdrawn after a first ok (any reason) | 95% CI | never ok |")
    print("|---|---|---|---|---|---|---|")
    for z in zs:
        poor = sum(withdrawn(r.reasons[z])[0] for r in runs)
        after = sum(withdrawn(r.reasons[z])[1] for r in runs)
        never = sum("ok" not in r.reasons[z] for r in runs)
        (pl, ph), (al, ah) = wilson(poor, n), wilson(after, n)
        print(f"| {z[0]:g} | {z[1]:g} | {poor}/{n} | {pl:.1%}–{ph:.1%} | {after}/{n} | {al:.1%}–{ah:.1%} | {never} |")
    worst = np.array([min(r.margins) for r in runs])
    judged = worst[np.isfinite(worst)]
    if len(judged):
        q = np.quantile(judged, [0.0, 0.01, 0.05, 0.5])
        print(f"\nsmallest calibration margin over a seed's looks, (ratio − withdraw bound)·√expected, "
              f"over {len(judged)} seeds judged: min {q[0]:.2f}, 1% {q[1]:.2f}, 5% {q[2]:.2f}, median {q[3]:.2f}")
    reasons = sorted({x for r in runs for x in r.reasons[zs[-1]]})
    print(f"reasons seen at z={zs[-1][0]:g}, min expected {zs[-1][1]:g}: " + ", ".join(
        f"{x} {sum(x in r.reasons[zs[-1]] for r in runs)}" for x in reasons))
    return 0


if __name__ == "__main__":
    sys.exit(main())
