"""`rankmeter serve` end to end against a bare kafka-python consumer, on the real Kafka
and Redis, in one run:

    make bench    # or, with the services up:
    RANKMETER_KAFKA_BOOTSTRAP_SERVERS=... RANKMETER_REDIS_URL=... .venv/bin/python bench/bench_serve.py

It produces a stream (default 500,000 events: impressions, clicks, purchases and
judgments) into fresh topics, then alternates: a bare KafkaConsumer reading the same
topics with no processing, and `rankmeter serve` (a real process: consumed, decoded,
joined, evaluated, persisted to Redis with its offsets). Each rate is counted from the
first record to the last; the ratio of the medians is the figure to report, as the
machine is shared and absolute rates drift.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
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
from rankmeter.serve import tune_gc  # noqa: E402
from rankmeter.source import Bus  # noqa: E402
from rankmeter.store import MemoryStore  # noqa: E402


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


def pipeline_alone(events: int) -> float:
    """The pipeline with neither Kafka nor Redis (in-process bus, in-memory store): what
    decoding, joining, evaluating and aggregating cost by themselves."""
    tune_gc()  # as `rankmeter serve` does
    settings = config.load(None, {})
    bus = Bus(partitions=4)
    for kind, key, value in stream(events):
        bus.send(settings.kafka.impressions_topic if kind == "impressions" else settings.kafka.feedback_topic,
                 key, value)
    pipeline = Pipeline(settings, MemoryStore(), lambda record, reason: None)
    bus.subscribe([settings.kafka.impressions_topic, settings.kafka.feedback_topic], pipeline.assign, pipeline.revoke)
    batches = list(iter(lambda: bus.poll(0, 5000), []))
    started = time.perf_counter()
    for batch in batches:
        pipeline.process(batch)
    return sum(map(len, batches)) / (time.perf_counter() - started)


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


def serve_consume(bootstrap: str, redis_url: str, topics, total: int, log_dir: Path, replicas: int = 1) -> float:
    """Events per second through `replicas` serve processes sharing one consumer group."""
    group, prefix = f"bench-{uuid.uuid4().hex[:6]}", f"bench-{uuid.uuid4().hex[:6]}"
    log_dir.mkdir(parents=True, exist_ok=True)
    processes = [Serve(bootstrap, redis_url, topics, group, prefix, log_path=log_dir / f"serve-{i}.log")
                 for i in range(replicas)]
    first = None
    try:
        for serve in processes:
            serve.start(create_topics=None)
        while True:
            done = sum(sum(serve.events().values()) for serve in processes)
            if done and first is None:
                first, first_done = time.perf_counter(), done
            if done >= total:
                break
            time.sleep(0.05)
        elapsed = time.perf_counter() - first
    finally:
        for serve in processes:
            serve.stop()
    return (total - first_done) / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=500_000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    bootstrap = os.environ["RANKMETER_KAFKA_BOOTSTRAP_SERVERS"]
    redis_url = os.environ["RANKMETER_REDIS_URL"]
    topics = unique_topics(bootstrap, partitions=4)
    print(f"producing {args.events} events into {topics.impressions} / {topics.feedback} ...", file=sys.stderr)
    total = produce_stream(bootstrap, topics, args.events)
    rates: dict[str, list[float]] = {"bare": [], "serve": [], "serve_x2": [], "pipeline": []}
    logs = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    for i in range(args.rounds):
        rates["bare"].append(bare_consume(bootstrap, topics, total))
        rates["serve"].append(serve_consume(bootstrap, redis_url, topics, total, logs / f"r{i}-x1"))
        rates["serve_x2"].append(serve_consume(bootstrap, redis_url, topics, total, logs / f"r{i}-x2", replicas=2))
        rates["pipeline"].append(pipeline_alone(min(total, 200_000)))
        print(f"round {i + 1}/{args.rounds}: bare kafka-python {rates['bare'][-1]:,.0f}/s, "
              f"rankmeter serve {rates['serve'][-1]:,.0f}/s, two replicas {rates['serve_x2'][-1]:,.0f}/s, "
              f"pipeline alone {rates['pipeline'][-1]:,.0f}/s",
              file=sys.stderr)
    bare, one, two, alone = (statistics.median(rates[k]) for k in ("bare", "serve", "serve_x2", "pipeline"))
    print(f"events={total} partitions=4 rounds={args.rounds}")
    print(f"bare_kafka_python_events_per_second={bare:.0f}")
    print(f"rankmeter_serve_events_per_second={one:.0f}")
    print(f"rankmeter_serve_two_replicas_events_per_second={two:.0f}")
    print(f"pipeline_alone_events_per_second={alone:.0f}")
    # One process does both halves in turn: consuming as the bare client does, then the
    # pipeline. Their rates bound what it can reach: 1 / (1/bare + 1/alone).
    print(f"single_process_bound_events_per_second={1 / (1 / bare + 1 / alone):.0f}")
    print(f"ratio={one / bare:.2f}")
    print(f"ratio_two_replicas={two / bare:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
