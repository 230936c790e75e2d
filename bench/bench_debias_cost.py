"""The position-bias estimator's cost (issues 10 and 11's `make bench`): one partition's
`Harvester` at full capacity (50,000 (query text, document) entries, evicting), on
position-based synthetic traffic (Zipf query texts, 10 results a query, one or two clicks).

    .venv/bin/python bench/bench_debias_cost.py [--queries 20000] [--texts 20000] [--seed 1]

Prints, one line each: µs per closed query for `Harvester.observe` (with the implicit
grades, as the pipeline calls it, and without: the harvest alone), ms per `estimate` (the
AllPairs EM on the K×K sums), µs per `ideal_dcg` (the pooled ideal of one query text),
µs per `ipw.dcg` and the table's bytes per entry (tracemalloc, filling it). Then the
price per event in the pipeline: the in-memory pipeline (`Pipeline` on the `Bus` and
`MemoryStore`, event clock) over the simulator's traffic with `debias.measures` empty and
with the defaults, alternated `--repeats` times: µs per event each way and their ratio,
from the same run. Times are the process's CPU time (`time.process_time`), so other work
on a shared machine does not inflate them. Figures also go to bench/results/debias_cost.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from rankmeter import config
from rankmeter.debias import DEFAULT_CAPACITY, Harvester, dcg, estimate, grades, weights
from rankmeter.pipeline import Pipeline
from rankmeter.simulator.clicks import EXAMINE, pbm
from rankmeter.simulator.traffic import Simulator
from rankmeter.source import Bus
from rankmeter.store import MemoryStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summary import save  # noqa: E402


def traffic(rng: np.random.Generator, n: int, texts: int, docs: int = 40):
    """`n` closed queries: a Zipf-drawn text, its 10 results (a noisy order of `docs`
    candidates, so a document moves between ranks), pbm clicks, grade 1 or 2 per click."""
    relevance = rng.uniform(0.0, 0.8, docs) ** 2
    for _ in range(n):
        q = int(rng.zipf(1.1)) % texts
        order = np.argsort(-(relevance + rng.normal(0, 0.3, docs)))[:10]
        shown = [f"d{(q * 7 + int(d)) % 100_000}" for d in order]
        clicked = [shown[r] for r in pbm(relevance[order], rng, EXAMINE)]
        yield f"{q:016x}", shown, set(clicked), {d: float(rng.integers(1, 3)) for d in clicked}


def per_call(fn, calls: int) -> float:
    started = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - started) / calls


def pipeline_cost(queries: int, repeats: int, seed: int) -> tuple[float, float]:
    """CPU µs per event of the in-memory pipeline, debias off and on (the defaults: a
    quarter of the queries harvested), on the same simulated stream; the median of
    `repeats` alternated runs each."""
    sim = Simulator(seed=seed, examination="power-0.9", judgment_share=0.0, run_id="bench")
    start_ms = 1_800_000_000_000
    events = sorted(((e.timestamp_ms, i, e) for q in range(queries)
                     for i, e in enumerate(sim.query_events(start_ms + q * 100, q * 0.1))),
                    key=lambda t: (t[0], t[1]))
    env = {"RANKMETER_WINDOWS_ATTRIBUTION": "5m", "RANKMETER_WINDOWS_GRACE": "1m",
           "RANKMETER_WINDOWS_JUDGMENTS": "10m", "RANKMETER_WINDOWS_SIZES": "1h"}
    off = config.load(None, {**env, "RANKMETER_DEBIAS_MEASURES": ""})
    on = config.load(None, env)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(repeats):
        for name, settings in (("off", off), ("on", on)):
            now = [start_ms / 1000]
            bus = Bus(partitions=4)
            pipeline = Pipeline(settings, MemoryStore(), lambda r, why: None, lambda: now[0])
            bus.subscribe([settings.kafka.impressions_topic, settings.kafka.feedback_topic],
                          pipeline.assign, pipeline.revoke)
            topics = {"impressions": settings.kafka.impressions_topic, "feedback": settings.kafka.feedback_topic}
            for ts, _, e in events:
                bus.send(topics[e.stream], e.key.encode(), json.dumps(e.value).encode(), timestamp_ms=ts)
            started, n, batches = time.process_time(), 0, 0
            while records := bus.poll(0, 1000):
                now[0] = max(r.timestamp for r in records) / 1000
                pipeline.process(records)
                n += len(records)
                batches += 1
                if batches % 20 == 0:  # serve looks every 5 s: here every 20,000 events
                    pipeline.look_at_position_bias(estimate_here=True)
            times[name].append((time.process_time() - started) / n)
    return float(np.median(times["off"])), float(np.median(times["on"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=20_000, help="closed queries timed")
    parser.add_argument("--texts", type=int, default=20_000, help="distinct query texts")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pipeline-queries", type=int, default=40_000,
                        help="simulated searches through the pipeline (one every 0.1 s of event time)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)

    # Fill to capacity (and past it: eviction in steady state), measuring the table's memory.
    h = Harvester()
    tracemalloc.start()
    filled = 0
    for q, shown, clicked, implicit in traffic(rng, 10**7, args.texts):
        h.observe(q, shown, clicked, implicit)
        filled += 1
        if len(h.entries) >= DEFAULT_CAPACITY:
            break
    table_bytes, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    log = list(traffic(rng, args.queries, args.texts))
    started = time.process_time()
    for q, shown, clicked, implicit in log:
        h.observe(q, shown, clicked, implicit)
    with_grades = (time.process_time() - started) / len(log)
    started = time.process_time()
    for q, shown, clicked, _ in log:
        h.observe(q, shown, clicked)
    without = (time.process_time() - started) / len(log)

    est = estimate(h.sums)
    estimate_s = per_call(lambda: estimate(h.sums), 5)
    w = weights(est.relative, 10)
    texts = [q for q, *_ in log[:2000]]
    started = time.process_time()
    for q in texts:
        h.ideal_dcg(q, w)
    ideal_s = (time.process_time() - started) / len(texts)
    docs_per_text = np.mean([len(h.by_query.get(q, ())) for q in texts])
    q, shown, clicked, implicit = log[0]
    g = grades(shown, implicit, est.relative)
    dcg_s = per_call(lambda: dcg(shown, g), 20_000)

    print(f"Harvester at capacity {DEFAULT_CAPACITY:,} entries ({filled:,} queries to fill it), then "
          f"{args.queries:,} queries of 10 results twice ({h.evicted:,} evictions in all), {args.texts:,} texts")
    print(f"observe with grades:    {with_grades * 1e6:8.1f} µs/query")
    print(f"observe without grades: {without * 1e6:8.1f} µs/query")
    print(f"estimate (AllPairs EM): {estimate_s * 1e3:8.1f} ms/estimate ({est.iterations} iterations)")
    print(f"ideal_dcg:              {ideal_s * 1e6:8.1f} µs/query ({docs_per_text:.1f} documents per text, "
          "query-weighted)")
    print(f"ipw.dcg:                {dcg_s * 1e6:8.1f} µs/query")
    print(f"table:                  {table_bytes / len(h.entries):8.0f} bytes/entry "
          f"({table_bytes / 2**20:.1f} MiB at capacity)")
    off, on = pipeline_cost(args.pipeline_queries, args.repeats, args.seed)
    print(f"pipeline, debias off:   {off * 1e6:8.1f} µs/event")
    print(f"pipeline, debias on:    {on * 1e6:8.1f} µs/event ({on / off:.2f}× off, {(on - off) * 1e6:.1f} µs/event more)")
    save("debias_cost", {"observe_us_per_query": with_grades * 1e6, "estimate_ms": estimate_s * 1e3,
                         "ideal_dcg_us": ideal_s * 1e6, "table_bytes_per_entry": table_bytes / len(h.entries),
                         "pipeline_us_per_event_off": off * 1e6, "pipeline_us_per_event_on": on * 1e6,
                         "pipeline_ratio_on_off": on / off})
    return 0


if __name__ == "__main__":
    sys.exit(main())
