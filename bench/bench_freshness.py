"""Freshness: the delay from an event's production to its effect on /metrics, under load,
with each Kafka backend; and Redis bytes per open query. On the real Kafka and Redis:

    RANKMETER_KAFKA_BOOTSTRAP_SERVERS=... RANKMETER_REDIS_URL=... \\
        .venv/bin/python bench/bench_freshness.py [--seconds 25] [--backend kafka-python --backend confluent]

Per backend, a `rankmeter serve` process on fresh 4-partition topics:

1. **Its maximum**: a backlog of `--backlog` events (bench_serve's mix: impressions of 10
   results, then 1–7 clicks, purchases or judgments) produced before it starts, consumed
   at full speed ("catching up": events/s from the first counted to the last). Then live:
   1.2 × that offered for 10 s by the background producer below, which shares the machine;
   what serve consumes meanwhile is its live maximum. Then it catches up (lag 0).
2. **Freshness** at 5,000 events/s and at 80% of the live maximum, `--seconds` each: a
   background producer (confluent-kafka, paced every 10 ms) sends the same mix, and every
   50 ms a probe impression (ranker `probe`, a new query) is produced, all to partition 0
   (so they become visible in the order sent); /metrics is scraped 50 ms after each scrape and
   `rankmeter_queries{ranker="probe",window="5m",population="all"}` says how many are
   counted. Delay = first scrape counting a probe − the moment before it was produced (one
   clock: this process's). p50 and p99 of the probes, 500 a level at the default 25 s
   (issue 24: a p99 over 50 probes is their maximum); the resolution is the poll interval.
3. **Redis bytes per open query** at the end of the 5,000/s phase: `MEMORY USAGE` (exact:
   SAMPLES 0) of every key under this run's prefix, over `rankmeter_open_queries`; and the
   growth of Redis's `used_memory` since before the run over the same count (the Redis is
   shared, so that one includes whatever else ran beside it).
4. **Costs per event** in each probing phase, for docs/capacity.md: the serve process's CPU
   time (/proc), and Redis's CPU time, commands and bytes received (`INFO`; the Redis is
   shared, so these are upper bounds), each over the events consumed.
5. **The position-bias harvest runs** (issue 24: freshness "with the harvest on"): every
   event carries the time it was produced, and serve attributes clicks for `HARVEST_ENV`'s
   few seconds, so queries become final, and are harvested, within each level; the queries
   harvested meanwhile (`rankmeter_propensity_harvested_queries_total`) are reported with
   it, and bench/summary.py counts the row as measured only if some were.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))
from serving import Serve, unique_topics  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summary import save  # noqa: E402  (bench/results/freshness.json for bench/summary.py)

PROBE_EVERY_S = 0.05  # 500 probes in 25 s: a p99 over 50 would be the largest
POLL_S = 0.05
QUERIES = re.compile(rb'^rankmeter_queries\{([^}]*)\} (\S+)$', re.M)
PROBE_LABELS = {b'ranker="probe"', b'window="5m"', b'population="all"'}
# Clicks final 3 s after their impression (default 35 min): the harvest, on by default,
# runs within a level, as it does live. (Judgments keep their 24 h: queries stay open.)
HARVEST_ENV = {"RANKMETER_WINDOWS_ATTRIBUTION": "2s", "RANKMETER_WINDOWS_GRACE": "1s"}
HARVESTED = "rankmeter_propensity_harvested_queries_total"
TEXTS = 1000  # query texts in the mix (the harvest pools by text)


class Mix:
    """bench_serve's event mix, rendered from byte templates (cheap enough to pace 40,000/s
    from one Python thread): query ids unique per `tag`; each query's events at `now` (the
    caller's event time), else at the time it is rendered (event time moves on, and with it
    the harvest). `texts`: a query text (one of that many) on each impression, which the
    position-bias harvest needs (it pools by text and skips a query without one)."""

    def __init__(self, tag: str, seed: int = 1, texts: int = 0) -> None:
        self.tag, self.rnd, self.q, self.texts = tag, random.Random(seed), 0, texts
        self.now: int | None = None

    def query(self) -> list[tuple[str, bytes, bytes]]:
        rnd, qid = self.rnd, f"{self.tag}-{self.q}"
        self.q += 1
        now = self.now if self.now is not None else int(time.time() * 1000)
        text = ',"user_query":"text %d"' % rnd.randrange(self.texts) if self.texts else ""
        results = [f"doc{rnd.randrange(5000)}" for _ in range(10)]
        out = [("impressions", qid.encode(), (
            '{"query_id":"%s","ranker":"bm25-%d","timestamp":%d%s,"results":["%s"]}'
            % (qid, self.q % 2, now, text, '","'.join(results))).encode())]
        for i in range(rnd.randint(1, 7)):
            doc = rnd.choice(results)
            if i == 0 and rnd.random() < 0.2:
                event = '"action":"judgment","grade":%d' % rnd.randint(0, 3)
            else:
                event = '"action":"%s","dwell_ms":%d' % (
                    rnd.choice(("click", "click", "click", "add_to_cart", "purchase")), rnd.randrange(60_000))
            out.append(("feedback", qid.encode(), (
                '{"query_id":"%s","doc_id":"%s","timestamp":%d,"event_id":"%s-%d",%s}'
                % (qid, doc, now, qid, i, event)).encode()))
        return out


def producer(bootstrap: str):
    from confluent_kafka import Producer

    return Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": 1,
                     "queue.buffering.max.messages": 1_000_000})


def produce_backlog(bootstrap: str, topics, events: int) -> int:
    p, mix, sent = producer(bootstrap), Mix("backlog", texts=TEXTS), 0
    while sent < events:
        for kind, key, value in mix.query():
            p.produce(getattr(topics, kind), value, key)
            sent += 1
        p.poll(0)
    p.flush(60)
    return sent


class Load(threading.Thread):
    """`rate` events/s of the mix, sent in slices every 10 ms."""

    def __init__(self, bootstrap: str, topics, rate: float, tag: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topics, self.rate, self.tag = bootstrap, topics, rate, tag
        self.stop = threading.Event()
        self.sent = 0

    def run(self) -> None:
        p, mix, pending = producer(self.bootstrap), Mix(self.tag, texts=TEXTS), []
        started = time.perf_counter()
        while not self.stop.is_set():
            due = int(self.rate * (time.perf_counter() - started)) - self.sent
            while due > 0:
                if not pending:
                    pending = mix.query()
                kind, key, value = pending.pop()
                p.produce(getattr(self.topics, kind), value, key)
                self.sent += 1
                due -= 1
            p.poll(0)
            time.sleep(0.01)
        p.flush(30)


def probe_count(port: int, scrapes: list[float] | None = None) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read()
    if scrapes is not None:
        scrapes.append(time.perf_counter() - started)
    return sum(float(value) for labels, value in QUERIES.findall(text) if PROBE_LABELS <= set(labels.split(b",")))


def events_total(serve: Serve) -> float:
    return sum(serve.events().values())


def harvested(serve: Serve) -> float:
    return sum(v for (name, _), v in serve.metrics().items() if name == HARVESTED)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_counters(client: redis.Redis) -> tuple[float, int, int]:
    """Redis's CPU seconds, commands processed and bytes received so far."""
    info = client.info()
    return (info["used_cpu_user"] + info["used_cpu_sys"], info["total_commands_processed"],
            info["total_net_input_bytes"])


def freshness(bootstrap: str, redis_url: str, topics, serve: Serve, rate: float, seconds: float, tag: str,
              probes_sent: list[int], probing: bool = True) -> dict[str, float]:
    """`rate` events/s for `seconds` (after 2 s to settle), with a probe every 50 ms unless
    not `probing`; what was consumed and what it cost."""
    from confluent_kafka import Producer

    probe = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "acks": 1})
    load = Load(bootstrap, topics, rate, tag)
    load.start()
    time.sleep(2)  # into the steady state
    client = redis.Redis.from_url(redis_url)
    consumed_before, cpu_before, redis_before = events_total(serve), cpu_seconds(serve.process.pid), redis_counters(client)
    harvested_before = harvested(serve)
    delays, scrapes, started = [], [], time.perf_counter()
    while not probing and time.perf_counter() - started < seconds:
        time.sleep(0.1)
    sent: list[float] = []  # when each probe of this phase was produced, by the thread below
    counted_before = probes_sent[0]

    def send_probes() -> None:
        # On a schedule of their own: a scrape takes serve tens of ms when it is busy.
        while (due := started + len(sent) * PROBE_EVERY_S) < started + seconds:
            time.sleep(max(0.0, due - time.perf_counter()))
            qid = f"probe-{uuid.uuid4().hex[:8]}"
            sent.append(time.perf_counter())
            # All on partition 0, so they become visible in the order sent: the count on
            # /metrics says which have (serve applies a partition's records in order).
            probe.produce(topics.impressions, ('{"query_id":"%s","ranker":"probe","timestamp":%d,"results":["a","b"]}'
                                               % (qid, int(time.time() * 1000))).encode(), qid.encode(), partition=0)
            probe.poll(0)

    sender = threading.Thread(target=send_probes, daemon=True)
    if probing:
        sender.start()
    while probing:
        visible = int(probe_count(serve.port, scrapes)) - counted_before
        while len(delays) < min(visible, len(sent)):
            delays.append(time.perf_counter() - sent[len(delays)])
        if not sender.is_alive() and len(delays) == len(sent):
            break
        if len(delays) < len(sent) and time.perf_counter() - sent[len(delays)] > 30:  # serve is behind
            sender.join()
            delays += [30.0] * (len(sent) - len(delays))
            break
        time.sleep(POLL_S)
    probes_sent[0] += len(sent)
    probe.flush(10)
    consumed = events_total(serve) - consumed_before
    harvested_queries = harvested(serve) - harvested_before
    serve_cpu = cpu_seconds(serve.process.pid) - cpu_before
    redis_cpu, commands, received = (b - a for a, b in zip(redis_before, redis_counters(client)))
    elapsed = time.perf_counter() - started
    load.stop.set()
    load.join()
    delays = sorted(delays) or [float("nan")]
    return {"rate": rate, "sent": load.sent, "consumed": consumed, "probes": len(delays) if probing else 0,
            "consumed_per_s": consumed / elapsed, "serve_cpu_us": serve_cpu / consumed * 1e6,
            "redis_cpu_us": redis_cpu / consumed * 1e6, "redis_commands": commands / consumed,
            "redis_bytes_in": received / consumed, "harvested": harvested_queries,
            "p50": statistics.median(delays), "p99": delays[min(len(delays) - 1, int(0.99 * len(delays)))],
            "max": delays[-1], "scrape": statistics.median(scrapes) if scrapes else float("nan"),
            "scrapes_per_probe": len(scrapes) / max(len(delays), 1)}


def wait_caught_up(serve: Serve) -> None:
    """Until the consumer lag is 0 on every partition (after an overload)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        lag = [v for (n, _), v in serve.metrics().items() if n == "rankmeter_consumer_lag"]
        if lag and not any(lag):
            return
        time.sleep(0.5)
    raise RuntimeError("serve did not catch up within 120 s")


def redis_bytes(redis_url: str, prefix: str) -> int:
    client = redis.Redis.from_url(redis_url)
    return sum(client.memory_usage(key, samples=0) or 0 for key in client.scan_iter(f"{prefix}:*", count=1000))


def used_memory(redis_url: str) -> int:
    return int(redis.Redis.from_url(redis_url).info("memory")["used_memory"])


def run_backend(bootstrap: str, redis_url: str, backend: str, args, logs: Path) -> dict:
    topics = unique_topics(bootstrap, partitions=4)
    print(f"[{backend}] producing a backlog of {args.backlog} events ...", file=sys.stderr)
    backlog = produce_backlog(bootstrap, topics, args.backlog)
    memory_before = used_memory(redis_url)
    prefix = f"fresh-{uuid.uuid4().hex[:6]}"
    serve = Serve(bootstrap, redis_url, topics, f"fresh-{uuid.uuid4().hex[:6]}", prefix,
                  {"RANKMETER_KAFKA_BACKEND": backend, **HARVEST_ENV}, log_path=logs / f"serve-{backend}.log")
    out: dict = {"backend": backend}
    try:
        serve.start(create_topics=None)
        first = None
        while True:
            done = events_total(serve)
            if done and first is None:
                first, first_done = time.perf_counter(), done
            if done >= backlog:
                break
            time.sleep(0.05)
        out["max"] = (backlog - first_done) / (time.perf_counter() - first)
        print(f"[{backend}] catching up: {out['max']:,.0f} events/s", file=sys.stderr)
        probes = [int(probe_count(serve.port))]
        # Live, the producer shares the machine: the rate serve sustains then, offered more than it takes.
        over = freshness(bootstrap, redis_url, topics, serve, 1.2 * out["max"], 10, f"over-{backend}", probes,
                         probing=False)
        out["live_max"] = over["consumed_per_s"]
        print(f"[{backend}] live, offered {over['rate']:,.0f}/s: takes {out['live_max']:,.0f} events/s", file=sys.stderr)
        wait_caught_up(serve)
        for name, rate in (("5000", 5000.0), ("80pct", 0.8 * out["live_max"])):
            out[name] = freshness(bootstrap, redis_url, topics, serve, rate, args.seconds, f"{name}-{backend}", probes)
            r = out[name]
            print(f"[{backend}] {rate:,.0f}/s: p50 {r['p50'] * 1000:.0f} ms, p99 {r['p99'] * 1000:.0f} ms "
                  f"({r['probes']} probes, {r['scrapes_per_probe']:.1f} scrapes each of {r['scrape'] * 1000:.1f} ms; "
                  f"consumed {r['consumed']:,.0f} of {r['sent']:,} sent; {r['harvested']:,.0f} queries harvested)",
                  file=sys.stderr)
            if name == "5000":
                time.sleep(1.5)  # a sweep refreshes the open-query count
                open_queries = next(v for (n, _), v in serve.metrics().items() if n == "rankmeter_open_queries")
                out["open_queries"] = open_queries
                if not open_queries:  # (the group rebalanced just then: the partitions are being claimed again)
                    print(f"[{backend}] no open queries to count Redis bytes by (a rebalance?)", file=sys.stderr)
                    continue
                out["bytes_per_open_query"] = redis_bytes(redis_url, prefix) / open_queries
                out["used_memory_per_open_query"] = (used_memory(redis_url) - memory_before) / open_queries
    finally:
        serve.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=25.0, help="probing time per load level")
    ap.add_argument("--backlog", type=int, default=200_000)
    ap.add_argument("--backend", action="append", choices=("kafka-python", "confluent"))
    args = ap.parse_args()
    if importlib.util.find_spec("confluent_kafka") is None:
        print("confluent-kafka is needed (pip install -e '.[confluent]'): it produces the load", file=sys.stderr)
        return 2
    bootstrap = os.environ["RANKMETER_KAFKA_BOOTSTRAP_SERVERS"]
    redis_url = os.environ["RANKMETER_REDIS_URL"]
    logs = Path(tempfile.mkdtemp(prefix="bench-freshness-"))
    print(f"logs in {logs}", file=sys.stderr)
    results = [run_backend(bootstrap, redis_url, b, args, logs) for b in args.backend or ("kafka-python", "confluent")]
    print(f"seconds_per_level={args.seconds:g} probe_every_s={PROBE_EVERY_S} poll_s={POLL_S} backlog={args.backlog}")
    print("| backend | catching up (events/s) | live maximum | load (events/s) | consumed (events/s) | probes | p50 "
          "| p99 | max | serve CPU / event | Redis CPU / event | Redis commands / event | bytes to Redis / event "
          "| queries harvested |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for name in ("5000", "80pct"):
            f = r[name]
            print(f"| {r['backend']} | {r['max']:,.0f} | {r['live_max']:,.0f} | {f['rate']:,.0f} | {f['consumed_per_s']:,.0f} | "
                  f"{f['probes']} | {f['p50'] * 1000:.0f} ms | {f['p99'] * 1000:.0f} ms | {f['max'] * 1000:.0f} ms | "
                  f"{f['serve_cpu_us']:.1f} µs | {f['redis_cpu_us']:.2f} µs | {f['redis_commands']:.4f} | "
                  f"{f['redis_bytes_in']:.0f} | {f['harvested']:,.0f} |")
    for r in results:
        key = r["backend"].replace("-", "_")
        print(f"freshness_p99_ms_at_80pct_{key}={r['80pct']['p99'] * 1000:.0f}")
        print(f"redis_bytes_per_open_query_{key}={r['bytes_per_open_query']:.0f} "
              f"(used_memory growth: {r['used_memory_per_open_query']:.0f}; open queries {r['open_queries']:,.0f})")
    save("freshness", {"seconds_per_level": args.seconds, "backlog": args.backlog, "backends": {
        r["backend"].replace("-", "_"): {
            "catching_up": r["max"], "live_max": r["live_max"], "rate_80pct": r["80pct"]["rate"],
            "p50_ms_at_5000": r["5000"]["p50"] * 1000, "p99_ms_at_5000": r["5000"]["p99"] * 1000,
            "p50_ms_at_80pct": r["80pct"]["p50"] * 1000, "p99_ms_at_80pct": r["80pct"]["p99"] * 1000,
            "probes_at_5000": r["5000"]["probes"], "probes_at_80pct": r["80pct"]["probes"],
            "harvested_at_5000": r["5000"]["harvested"], "harvested_at_80pct": r["80pct"]["harvested"],
            "consumed_per_s_at_80pct": r["80pct"]["consumed_per_s"],
            "redis_bytes_per_open_query": r["bytes_per_open_query"],
            "used_memory_per_open_query": r["used_memory_per_open_query"], "open_queries": r["open_queries"],
            "costs": {name: {k: r[name][k] for k in ("serve_cpu_us", "redis_cpu_us", "redis_commands", "redis_bytes_in")}
                      for name in ("5000", "80pct")}}
        for r in results}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
