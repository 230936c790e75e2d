"""The position-bias estimator's cost (issues 10 and 11's `make bench`): one partition's
`Harvester` at full capacity (50,000 (query text, document) entries, evicting), on
position-based synthetic traffic (Zipf query texts, 10 results a query, one or two clicks).

    .venv/bin/python bench/bench_debias_cost.py [--queries 20000] [--texts 20000] [--seed 1]

Prints, one line each: µs per closed query for `Harvester.observe` (with the implicit
grades, as the pipeline calls it, and without: the harvest alone), ms per `estimate` (the
AllPairs EM on the K×K sums), µs per `ideal_dcg` (the pooled ideal of one query text),
µs per `ipw.dcg` and the table's bytes per entry (tracemalloc, filling it). Times are the
process's CPU time (`time.process_time`), so other work on a shared machine does not
inflate them.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc

import numpy as np

from rankmeter.debias import DEFAULT_CAPACITY, Harvester, dcg, estimate, grades, weights
from rankmeter.simulator.clicks import EXAMINE, pbm


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=20_000, help="closed queries timed")
    parser.add_argument("--texts", type=int, default=20_000, help="distinct query texts")
    parser.add_argument("--seed", type=int, default=1)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
