"""`rankmeter serve` end to end on each Kafka backend against the bare clients (kafka-python
and confluent-kafka) and a Quix Streams peer, on the real Kafka and Redis, in one run:

    make bench    # or, with the services up:
    RANKMETER_KAFKA_BOOTSTRAP_SERVERS=... RANKMETER_REDIS_URL=... .venv/bin/python bench/bench_serve.py

It produces a stream (default 500,000 events: impressions, clicks, purchases and
judgments) into fresh topics, then alternates: a bare KafkaConsumer and a bare
confluent-kafka Consumer reading the same topics with no processing, `rankmeter serve` (a
real process: consumed, decoded, joined, evaluated, persisted to Redis with its offsets)
with `kafka.backend` kafka-python and confluent, two kafka-python replicas, and the Quix
Streams peer (bench/quix_peer.py: the per-query join and nDCG@10 in its RocksDB state;
measured when quixstreams is installed, `.venv/bin/pip install quixstreams`). Each rate is
counted from the first record to the last; the ratios of the medians are the figures to
report, as the machine is shared and absolute rates drift. Beside each serve rate, the
serve processes' CPU µs per event over the same span (/proc utime + stime), and the
pipeline alone's (its process's CPU time over its batches): the cost that survives a
noisy machine (issue 24).

`--baseline DIR` (the `service/` directory of another checkout, e.g. a `git worktree` of
main) also runs serve on both backends and the pipeline alone with that code, in the same
rounds: a change's before and after, as ratios of one run. `--confluent-only`: serve on
the confluent backend only (and the bare consumers, the pipeline alone): quicker, not saved.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from kafka import KafkaConsumer, KafkaProducer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))
from serving import Serve, unique_topics  # noqa: E402  (the test harness's process wrapper)

from rankmeter import config  # noqa: E402
from rankmeter.pipeline import Pipeline  # noqa: E402
from rankmeter.gc_tuning import tune as tune_gc  # noqa: E402
from rankmeter.source import Bus  # noqa: E402
from rankmeter.store import MemoryStore  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_freshness import cpu_seconds  # noqa: E402  (/proc: the cost that survives a shared machine)
from summary import save  # noqa: E402  (bench/results/serve.json for bench/summary.py)


def stream(events: int, seed: int = 1):
    """(stream, key, value) of `events` events: impressions of 10 results, then 1–7
    clicks, add-to-carts, purchases or judgments each."""
    rnd = random.Random(seed)
    now = int(time.time() * 1000)
    sent = q = 0
    while sent < events:
        qid = f"q{q}"
        results = [f"doc{rnd.randrange(5000)}" for _ in range(10)]
        yield "impressions", qid.encode(), json.dumps(
            {"query_id": qid, "ranker": f"bm25-{q % 2}", "timestamp": now, "results": results}).encode()
        sent += 1
        for i in range(rnd.randint(1, 7)):
            doc = rnd.choice(results)
            if i == 0 and rnd.random() < 0.2:
                event = {"action": "judgment", "grade": rnd.randint(0, 3)}
            else:
                event = {"action": rnd.choice(("click", "click", "click", "add_to_cart", "purchase")),
                         "dwell_ms": rnd.randrange(60_000)}
            yield "feedback", qid.encode(), json.dumps(
                {"query_id": qid, "doc_id": doc, "timestamp": now, "event_id": f"{qid}-{i}", **event}).encode()
            sent += 1
        q += 1


def produce_stream(bootstrap: str, topics, events: int) -> int:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=50, batch_size=256 * 1024)
    sent = 0
    for kind, key, value in stream(events):
        producer.send(getattr(topics, kind), key=key, value=value)
        sent += 1
        if sent % 100_000 == 0:
            print(f"  produced {sent}", file=sys.stderr)
    producer.flush()
    producer.close()
    return sent


def pipeline_alone(events: int) -> tuple[float, float]:
    """The pipeline with neither Kafka nor Redis (in-process bus, in-memory store): what
    decoding, joining, evaluating and aggregating cost by themselves. Its rate and CPU µs
    per event (this process's, over the batches alone)."""
    tune_gc()  # as `rankmeter serve` does
    settings = config.load(None, {})
    bus = Bus(partitions=4)
    for kind, key, value in stream(events):
        bus.send(settings.kafka.impressions_topic if kind == "impressions" else settings.kafka.feedback_topic,
                 key, value)
    pipeline = Pipeline(settings, MemoryStore(), lambda record, reason: None)
    bus.subscribe([settings.kafka.impressions_topic, settings.kafka.feedback_topic], pipeline.assign, pipeline.revoke)
    batches = list(iter(lambda: bus.poll(0, 5000), []))
    started, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        pipeline.process(batch)
    n = sum(map(len, batches))
    return n / (time.perf_counter() - started), 1e6 * (time.process_time() - cpu) / n


def bare_consume(bootstrap: str, topics, total: int) -> float:
    consumer = KafkaConsumer(topics.impressions, topics.feedback, bootstrap_servers=bootstrap,
                             group_id=f"bare-{uuid.uuid4().hex[:6]}", auto_offset_reset="earliest",
                             enable_auto_commit=False, max_poll_records=5000)
    seen, first = 0, None
    while seen < total:
        for records in consumer.poll(timeout_ms=500).values():
            if first is None:
                first = time.perf_counter()
            seen += len(records)
    elapsed = time.perf_counter() - first
    consumer.close()
    return total / elapsed


def bare_confluent(bootstrap: str, topics, total: int) -> float:
    """The bare librdkafka consumer, in batches as the confluent backend reads them."""
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bare-{uuid.uuid4().hex[:6]}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([topics.impressions, topics.feedback])
    seen, first = 0, None
    while seen < total:
        messages = consumer.consume(5000, 0.5)
        if messages and first is None:
            first = time.perf_counter()
        seen += sum(1 for m in messages if m.error() is None)
    elapsed = time.perf_counter() - first
    consumer.close()
    return total / elapsed


def quix_peer(bootstrap: str, topics, total: int, log_dir: Path) -> float:
    """bench/quix_peer.py as its own process: it prints its rate, first record to last."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "quix_peer.py"), "--bootstrap", bootstrap,
                          "--impressions", topics.impressions, "--feedback", topics.feedback,
                          "--total", str(total), "--state-dir", str(log_dir / "state")],
                         capture_output=True, text=True, timeout=1800)
    (log_dir / "quix.log").write_text(out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"quix_peer.py failed: {out.stderr[-2000:]}")
    return float(dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)["events_per_second"])


def serve_consume(bootstrap: str, redis_url: str, topics, total: int, log_dir: Path, replicas: int = 1,
                  backend: str = "kafka-python", code: str | None = None) -> tuple[float, float]:
    """Events per second through `replicas` serve processes sharing one consumer group
    (`code`: another checkout's service/ directory to run instead of this one), and their
    CPU µs per event over the same span (first record to last)."""
    group, prefix = f"bench-{uuid.uuid4().hex[:6]}", f"bench-{uuid.uuid4().hex[:6]}"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {"RANKMETER_KAFKA_BACKEND": backend, **({"PYTHONPATH": code} if code else {})}
    processes = [Serve(bootstrap, redis_url, topics, group, prefix, env, log_path=log_dir / f"serve-{i}.log")
                 for i in range(replicas)]
    first = None
    try:
        for serve in processes:
            serve.start(create_topics=None)
        while True:
            done = sum(sum(serve.events().values()) for serve in processes)
            if done and first is None:
                first, first_done = time.perf_counter(), done
                cpu_first = sum(cpu_seconds(serve.process.pid) for serve in processes)
            if done >= total:
                break
            time.sleep(0.05)
        elapsed = time.perf_counter() - first
        cpu = sum(cpu_seconds(serve.process.pid) for serve in processes) - cpu_first
    finally:
        for serve in processes:
            serve.stop()
    return (total - first_done) / elapsed, 1e6 * cpu / (total - first_done)


def pipeline_alone_of(code: str, events: int) -> tuple[float, float]:
    """`pipeline_alone` with another checkout's code, in a process of its own."""
    out = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import bench_serve; "
                          "print(*bench_serve.pipeline_alone(int(sys.argv[2])))", str(Path(__file__).parent),
                          str(events)], env={**os.environ, "PYTHONPATH": code}, capture_output=True, text=True,
                         check=True)
    rate, cpu = out.stdout.split()[-2:]
    return float(rate), float(cpu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=500_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", help="service/ directory of another checkout to measure beside this one")
    ap.add_argument("--confluent-only", action="store_true",
                    help="serve on the confluent backend only (a quicker before/after; figures not saved)")
    args = ap.parse_args()
    bootstrap = os.environ["RANKMETER_KAFKA_BOOTSTRAP_SERVERS"]
    redis_url = os.environ["RANKMETER_REDIS_URL"]
    confluent = importlib.util.find_spec("confluent_kafka") is not None
    quix = importlib.util.find_spec("quixstreams") is not None
    if not confluent:
        print("confluent-kafka is not installed (pip install -e '.[confluent]'): its rows are skipped", file=sys.stderr)
    if not quix:
        print("quixstreams is not installed (.venv/bin/pip install quixstreams): the Quix peer is skipped",
              file=sys.stderr)
    topics = unique_topics(bootstrap, partitions=4)
    print(f"producing {args.events} events into {topics.impressions} / {topics.feedback} ...", file=sys.stderr)
    total = produce_stream(bootstrap, topics, args.events)
    rates: dict[str, list[float]] = {k: [] for k in ("bare", "bare_confluent", "serve", "serve_confluent",
                                                     "serve_x2", "pipeline", "quix", "serve_base",
                                                     "serve_confluent_base", "pipeline_base")}
    cpus: dict[str, list[float]] = {k: [] for k in rates}  # serve's (or the pipeline's) CPU µs per event

    def measured(key: str, rate_cpu: tuple[float, float]) -> None:
        rates[key].append(rate_cpu[0])
        cpus[key].append(rate_cpu[1])

    logs = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    print(f"logs in {logs}", file=sys.stderr)
    alone = min(total, 200_000)
    for i in range(args.rounds):
        rates["bare"].append(bare_consume(bootstrap, topics, total))
        if confluent:
            rates["bare_confluent"].append(bare_confluent(bootstrap, topics, total))
        if not args.confluent_only:
            measured("serve", serve_consume(bootstrap, redis_url, topics, total, logs / f"r{i}-x1"))
        if confluent:
            measured("serve_confluent", serve_consume(bootstrap, redis_url, topics, total, logs / f"r{i}-cf",
                                                      backend="confluent"))
        if not args.confluent_only:
            measured("serve_x2", serve_consume(bootstrap, redis_url, topics, total, logs / f"r{i}-x2", replicas=2))
        measured("pipeline", pipeline_alone(alone))
        if args.baseline:
            if not args.confluent_only:
                measured("serve_base", serve_consume(bootstrap, redis_url, topics, total, logs / f"r{i}-base",
                                                     code=args.baseline))
            if confluent:
                measured("serve_confluent_base", serve_consume(bootstrap, redis_url, topics, total,
                                                               logs / f"r{i}-cf-base", backend="confluent",
                                                               code=args.baseline))
            measured("pipeline_base", pipeline_alone_of(args.baseline, alone))
        if quix:
            rates["quix"].append(quix_peer(bootstrap, topics, total, logs / f"r{i}-quix"))
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(
            f"{k} {v[-1]:,.0f}/s" + (f" {cpus[k][-1]:.1f} µs" if cpus[k] else "") for k, v in rates.items() if v),
            file=sys.stderr)
    median = {k: statistics.median(v) for k, v in rates.items() if v}
    cpu = {k: statistics.median(v) for k, v in cpus.items() if v}
    bare, alone_rate = median["bare"], median["pipeline"]
    one, two = median.get("serve"), median.get("serve_x2")
    print(f"events={total} partitions=4 rounds={args.rounds}")
    print(f"bare_kafka_python_events_per_second={bare:.0f}")
    print(f"pipeline_alone_events_per_second={alone_rate:.0f}")
    print(f"pipeline_alone_cpu_us_per_event={cpu['pipeline']:.2f}")
    if one is not None:
        print(f"rankmeter_serve_events_per_second={one:.0f}")
        print(f"rankmeter_serve_cpu_us_per_event={cpu['serve']:.2f}")
        print(f"rankmeter_serve_two_replicas_events_per_second={two:.0f}")
        # One process does both halves in turn: consuming as the bare client does, then the
        # pipeline. Their rates bound what it can reach: 1 / (1/bare + 1/alone).
        print(f"single_process_bound_events_per_second={1 / (1 / bare + 1 / alone_rate):.0f}")
        print(f"ratio={one / bare:.2f}")
        print(f"ratio_two_replicas={two / bare:.2f}")
    if confluent:
        bare_cf, one_cf = median["bare_confluent"], median["serve_confluent"]
        print(f"bare_confluent_events_per_second={bare_cf:.0f}")
        print(f"rankmeter_serve_confluent_events_per_second={one_cf:.0f}")
        print(f"rankmeter_serve_confluent_cpu_us_per_event={cpu['serve_confluent']:.2f}")
        # librdkafka fetches in its own threads, so the bound is no longer a sum of the halves.
        print(f"ratio_confluent={one_cf / bare_cf:.2f}")
        if one is not None:
            print(f"ratio_serve_confluent_to_kafka_python={one_cf / one:.2f}")
        print(f"ratio_bare_confluent_to_kafka_python={bare_cf / bare:.2f}")
    if args.baseline:
        print(f"baseline={args.baseline}")
        print(f"baseline_pipeline_alone_events_per_second={median['pipeline_base']:.0f}")
        print(f"baseline_pipeline_alone_cpu_us_per_event={cpu['pipeline_base']:.2f}")
        print(f"speedup_pipeline_alone={alone_rate / median['pipeline_base']:.2f}")
        if one is not None:
            print(f"baseline_serve_events_per_second={median['serve_base']:.0f}")
            print(f"baseline_serve_cpu_us_per_event={cpu['serve_base']:.2f}")
            print(f"ratio_baseline={median['serve_base'] / bare:.2f}")
            print(f"speedup_serve={one / median['serve_base']:.2f}")
        if confluent:
            print(f"baseline_serve_confluent_events_per_second={median['serve_confluent_base']:.0f}")
            print(f"baseline_serve_confluent_cpu_us_per_event={cpu['serve_confluent_base']:.2f}")
            print(f"ratio_confluent_baseline={median['serve_confluent_base'] / median['bare_confluent']:.2f}")
            print(f"speedup_serve_confluent={median['serve_confluent'] / median['serve_confluent_base']:.2f}")
    best = max(one or 0.0, median.get("serve_confluent", 0.0))
    if quix:
        print(f"quix_peer_events_per_second={median['quix']:.0f}")
        print(f"ratio_best_serve_to_quix={best / median['quix']:.2f}")
    figures = {"events": total, "partitions": 4, "rounds": args.rounds, "rounds_events_per_second": rates,
               "rounds_cpu_us_per_event": cpus, "cpu_us_per_event": cpu,
               "bare_kafka_python_events_per_second": bare, "pipeline_alone_events_per_second": alone_rate}
    if one is not None:
        figures.update({"rankmeter_serve_events_per_second": one, "rankmeter_serve_two_replicas_events_per_second": two,
                        "ratio": one / bare})
    if confluent:
        figures.update({"bare_confluent_events_per_second": median["bare_confluent"],
                        "rankmeter_serve_confluent_events_per_second": median["serve_confluent"],
                        "ratio_confluent": median["serve_confluent"] / median["bare_confluent"]})
    if quix:
        figures.update({"quix_peer_events_per_second": median["quix"], "ratio_best_serve_to_quix": best / median["quix"]})
    if args.baseline:
        figures["baseline"] = {k: median[k] for k in ("serve_base", "serve_confluent_base", "pipeline_base")
                               if k in median}
    if not args.confluent_only:  # a partial run must not stand in for the table's figures
        save("serve", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
