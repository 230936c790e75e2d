"""What a Prometheus scrape of `rankmeter serve`'s /metrics costs, and that it does not grow
with the number of open queries:

    .venv/bin/python bench/bench_scrape.py [--open 1000 --open 100000] [--scrapes 10]

The pipeline's state is built in memory (in-process bus, in-memory store, no Kafka or
Redis): 100 rankers × 3 windows (5m, 1h, 24h) × 10 measures (6 quality measures and the 4
online signals), with as many open queries as `--open` says (impressions of 10 results, a
click on a third of them, all inside every window). Then the exporter serves it over HTTP
exactly as serve does (`Exporter.start`) and the scrape is timed as a client sees it, for
each format Prometheus may negotiate: the text format and OpenMetrics, each plain and
gzipped. Medians over `--scrapes`; the figure to read is the ratio of the scrape time
with the most open queries to that with the fewest, in the same run. In process, means:
collect + render with serve's writer (`rankmeter.exposition`) and with prometheus_client's
(`generate_latest`), and collect alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client import generate_latest

from rankmeter import config
from rankmeter.exporter import Exporter, Health
from rankmeter.pipeline import Pipeline
from rankmeter.gc_tuning import tune as tune_gc
from rankmeter.source import Bus
from rankmeter.store import MemoryStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summary import save  # noqa: E402  (bench/results/scrape.json for bench/summary.py)

RANKERS = 100
WINDOWS = ["5m", "1h", "24h"]
MEASURES = ["nDCG@10", "P@10", "AP", "RR", "R@10", "DCG@10"]  # + CTR, Abandonment, Clicks, FirstClickRank
FORMATS = {  # name -> request headers, as Prometheus sends them
    "text": {"Accept": "text/plain;version=0.0.4"},
    "text+gzip": {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "gzip"},
    "openmetrics": {"Accept": "application/openmetrics-text;version=1.0.0"},
    "openmetrics+gzip": {"Accept": "application/openmetrics-text;version=1.0.0", "Accept-Encoding": "gzip"},
}


def build(open_queries: int) -> Pipeline:
    settings = config.load(None, {})
    settings.limits.max_rankers = RANKERS
    settings.windows.sizes = WINDOWS
    settings.evaluation.measures = MEASURES
    bus = Bus(partitions=4)
    now = int(time.time() * 1000)
    for q in range(open_queries):
        qid = f"q{q}".encode()
        results = [f"d{(q * 7 + i) % 5000}" for i in range(10)]
        bus.send(settings.kafka.impressions_topic, qid, json.dumps(
            {"query_id": qid.decode(), "ranker": f"ranker-{q % RANKERS}", "timestamp": now,
             "results": results}).encode())
        if q % 3 == 0:
            bus.send(settings.kafka.feedback_topic, qid, json.dumps(
                {"query_id": qid.decode(), "doc_id": results[q % 10], "timestamp": now, "action": "click",
                 "event_id": f"{q}-c"}).encode())
    store = MemoryStore()
    pipeline = Pipeline(settings, store, lambda record, reason: None)
    bus.subscribe([settings.kafka.impressions_topic, settings.kafka.feedback_topic], pipeline.assign, pipeline.revoke)
    for batch in iter(lambda: bus.poll(0, 5000), []):
        pipeline.process(batch)
    for p, state in pipeline.partitions.items():  # what the next sweep would count
        state.open_queries = len(store.deadlines.get(p, {}))
    assert pipeline.open_queries() == open_queries, (pipeline.open_queries(), open_queries)
    return pipeline


def scrape(port: int, headers: dict[str, str]) -> tuple[float, int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=30) as response:
        body = response.read()
        encoding = response.headers.get("Content-Encoding", "")
    return time.perf_counter() - started, len(body), encoding


def measure(open_queries: int, scrapes: int) -> dict[str, tuple[float, int]]:
    pipeline = build(open_queries)
    exporter = Exporter(pipeline.readout, Health(), dict)
    port = exporter.start("127.0.0.1", 0)
    try:
        series = sum(1 for line in exporter.render().splitlines() if line and not line.startswith(b"#"))
        results = {"series": (0.0, series, "")}
        for name, headers in FORMATS.items():
            scrape(port, headers)  # warm
            times, sizes, encodings = [], set(), set()
            for _ in range(scrapes):
                seconds, size, encoding = scrape(port, headers)
                times.append(seconds)
                sizes.add(size)
                encodings.add(encoding or "identity")
            results[name] = (statistics.median(times), max(sizes), ",".join(sorted(encodings)))
        for key, render in (("render", exporter.render), ("render_prometheus_client", lambda: generate_latest(exporter.registry)),
                            ("collect", lambda: list(exporter.registry.collect()))):
            started = time.perf_counter()
            for _ in range(scrapes):
                render()
            results[key] = ((time.perf_counter() - started) / scrapes, 0, "")
    finally:
        exporter.stop()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--open", type=int, action="append", help="open queries (repeatable; default 1000 and 100000)")
    ap.add_argument("--scrapes", type=int, default=10)
    args = ap.parse_args()
    tune_gc()
    sizes = sorted(args.open or [1_000, 100_000])
    runs = {}
    for n in sizes:
        print(f"building {n} open queries, {RANKERS} rankers ...", file=sys.stderr)
        runs[n] = measure(n, args.scrapes)
    print(f"rankers={RANKERS} windows={','.join(WINDOWS)} measures={len(MEASURES) + 4} "
          f"series={runs[sizes[0]]['series'][1]} scrapes={args.scrapes}")
    print("| open queries | request | scrape (median) | bytes | Content-Encoding |")
    print("|---|---|---|---|---|")
    for n in sizes:
        for name in FORMATS:
            seconds, size, encoding = runs[n][name]
            print(f"| {n:,} | {name} | {seconds * 1000:.1f} ms | {size:,} | {encoding} |")
        print(f"| {n:,} | collect + render only, in process | {runs[n]['render'][0] * 1000:.1f} ms | | |")
        print(f"| {n:,} | the same with prometheus_client's writer | {runs[n]['render_prometheus_client'][0] * 1000:.1f} ms | | |")
        print(f"| {n:,} | collect only (the families, no text) | {runs[n]['collect'][0] * 1000:.1f} ms | | |")
    low, high = sizes[0], sizes[-1]
    for name in FORMATS:
        print(f"scrape_ratio_{name.replace('+', '_')}_{high}_vs_{low}={runs[high][name][0] / runs[low][name][0]:.2f}")
    print(f"writer_ratio_ours_vs_prometheus_client={runs[high]['render'][0] / runs[high]['render_prometheus_client'][0]:.2f}")
    print(f"gzip_bytes_ratio_text={runs[high]['text+gzip'][1] / runs[high]['text'][1]:.3f}")
    save("scrape", {"low": low, "high": high, "series": runs[low]["series"][1], "scrapes": args.scrapes,
                    "scrape_seconds": {str(n): {name: runs[n][name][0] for name in FORMATS} for n in sizes},
                    "scrape_ratios": {name: runs[high][name][0] / runs[low][name][0] for name in FORMATS},
                    "render_seconds": {str(n): runs[n]["render"][0] for n in sizes}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
