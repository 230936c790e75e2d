"""RSS soak: `rankmeter serve` over millions of events, its resident memory sampled as it
goes, on the real Kafka and Redis:

    make bench-soak    # or, with services up:
    RANKMETER_KAFKA_BOOTSTRAP_SERVERS=... RANKMETER_REDIS_URL=... \\
        .venv/bin/python bench/bench_soak.py [--events 5000000] [--backend confluent --backend kafka-python] [--trace]

Issue 10's target: the service's RSS flat (within 10%) over a soak of 5,000,000 events.

1. **The stream**, per backend: `--events` of bench_freshness's mix (an impression of 10
   results, then 1–7 clicks, add-to-carts, purchases or judgments) produced **live** into
   fresh 4-partition topics while serve reads them: at most `--rate` events/s, and held
   while serve is more than `--max-lag` events behind, so serve runs near its maximum yet
   reads both topics at their ends as in production (a backlog read at full speed reads
   the impressions ahead of the feedback in event time, and the watermark — the lower of
   the two — then holds every query read open: a catching-up regime, not a soak). Event
   time **advances** as real traffic's does: `--qps` queries per second of event time
   (500: about 2,500 events), from an hour before now. With a short attribution window
   (`--attribution 30s`, `--grace 5s`, judgments as long as the attribution) queries close
   about 35 event-seconds after they open, so the open queries stay bounded (about
   qps × 35 s = 17,500) and what grows, if anything, is the process's own.
2. **The soak:** one `rankmeter serve` (its own group and Redis prefix) per backend. Every
   `--events`/`--samples` events consumed (read from the offsets serve checkpoints in
   Redis, not from /metrics: a scrape allocates in serve and costs it 20–40 ms) the serve
   process's RSS (/proc/<pid>/status VmRSS), its CPU time, the open queries (ZCARD of its
   `open` zsets), the exact `MEMORY USAGE` of its keys and Redis's `used_memory` (shared:
   includes others) are sampled.
3. **Figures:** RSS at 10%, 50% and 100% of the events; the warm-up is the first 10%.
   The figure against the target ("flat within 10%") is the largest deviation of any
   sample from 10% on from the RSS at 10% (|RSS / RSS₁₀ − 1|); the peak-to-peak spread
   ((max − min) / RSS₁₀) is printed beside it; the slope of a least-squares line
   through those samples (MiB per million events) says whether anything grows steadily.
4. **`--trace`** (a debug run, slower): serve runs under tracemalloc (through this script,
   `--traced-serve`), and at 10%, 50% and 100% it writes the sizes of the pipeline's
   containers (per partition: cached records and states, buckets, lists, ...) and the
   tracemalloc diff against the 10% snapshot, by line, into the log directory.

The topics and the Redis keys of the run are deleted at the end, and serve is stopped,
also on failure. Figures go to bench/results/soak.json for bench/summary.py.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))
import serving  # noqa: E402  (the test harness's process wrapper)
from bench_freshness import Mix, cpu_seconds, producer, used_memory  # noqa: E402
from progress import Progress  # noqa: E402
from serving import Serve, unique_topics  # noqa: E402
from summary import save  # noqa: E402

MIB = 1024 * 1024
STORE_KEYS = ("queries", "open", "buckets", "offsets", "meta", "ab")


# ---- helpers shared with bench_replicas.py ----

def store_key(prefix: str, partition: int, name: str) -> str:
    """RedisStore's key layout (redis_store.py): one hash tag per partition."""
    return f"{prefix}:{{{prefix}:{partition}}}:{name}"


def consumed(client: redis.Redis, prefix: str, partitions: int) -> int:
    """Events serve has consumed and checkpointed: the sum of the next offsets it stored
    for every topic and partition (the topics were created empty, so offsets are counts).
    Reading Redis costs serve nothing; scraping /metrics would."""
    with client.pipeline(transaction=False) as pipe:
        for p in range(partitions):
            pipe.hvals(store_key(prefix, p, "offsets"))
        return sum(int(v) for values in pipe.execute() for v in values)


def open_queries(client: redis.Redis, prefix: str, partitions: int) -> int:
    with client.pipeline(transaction=False) as pipe:
        for p in range(partitions):
            pipe.zcard(store_key(prefix, p, "open"))
        return sum(pipe.execute())


def prefix_bytes(client: redis.Redis, prefix: str, partitions: int) -> int:
    """Exact MEMORY USAGE of the run's per-partition keys (no SCAN of a shared keyspace)."""
    with client.pipeline(transaction=False) as pipe:
        for p in range(partitions):
            for name in STORE_KEYS:
                pipe.memory_usage(store_key(prefix, p, name), samples=0)
        return sum(v or 0 for v in pipe.execute())


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    """Every key of the run (SCAN by its prefix; UNLINK frees in the background)."""
    n = 0
    batch = []
    for key in client.scan_iter(f"{prefix}:*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            n += client.unlink(*batch)
            batch = []
    if batch:
        n += client.unlink(*batch)
    return n


def delete_topics(bootstrap: str, topics) -> None:
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.delete_topics(list(topics))
    except Exception as e:  # noqa: BLE001 (cleanup: say so, do not hide the run's own error)
        print(f"could not delete topics {list(topics)}: {e}", file=sys.stderr)
    finally:
        admin.close()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def hwm_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class PacedProducer(threading.Thread):
    """`events` of the mix at `rate` events/s (slices every 5 ms), `qps` queries per
    second of event time from `start_ms`, held while serve is more than `max_lag` events
    behind (so the rate is the lower of `rate` and what serve sustains): live traffic, so
    that serve reads both topics at their ends, as in production (a backlog read at full speed reads the impressions
    ahead of the feedback in event time, and holds every query it read open until the
    feedback catches up)."""

    def __init__(self, bootstrap: str, topics, events: int, rate: float, qps: int, start_ms: int, tag: str,
                 max_lag: int) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topics, self.events, self.rate = bootstrap, topics, events, rate
        self.qps, self.start_ms, self.tag, self.max_lag = qps, start_ms, tag, max_lag
        self.sent = 0
        self.consumed = 0  # kept up to date by the sampling loop
        self.held_s = 0.0  # time spent waiting for serve (lag above max_lag)
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            p, mix = producer(self.bootstrap), Mix(self.tag)
            started = time.perf_counter()
            while self.sent < self.events and not self.stop.is_set():
                now = time.perf_counter()
                due = min(int(self.rate * (now - started)), self.events) - self.sent
                room = self.max_lag - (self.sent - self.consumed)
                if due > room:  # serve is behind: only what keeps the lag under max_lag, and no debt
                    due = max(room, 0)
                    started = now - (self.sent + due) / self.rate
                    self.held_s += 0.005
                while due > 0:
                    mix.now = self.start_ms + mix.q * 1000 // self.qps
                    for kind, key, value in mix.query():
                        while True:
                            try:
                                p.produce(getattr(self.topics, kind), value, key)
                                break
                            except BufferError:  # the local queue is full: let librdkafka send
                                p.poll(0.05)
                        self.sent += 1
                        due -= 1
                p.poll(0)
                time.sleep(0.005)
            if p.flush(300):
                raise RuntimeError("the producer could not deliver everything within 300 s")
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            self.error = e


class TracedServe(Serve):
    """`rankmeter serve` run through this script under tracemalloc (`--traced-serve`)."""

    def __init__(self, *args, trace_dir: Path, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trace_dir = trace_dir
        self.env = {**self.env, "SOAK_TRACE_DIR": str(trace_dir)}

    def start(self, create_topics=None, args=(), wait_ready=True):
        wrapper = self.trace_dir / "rankmeter-traced"
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" --traced-serve "$@"\n')
        wrapper.chmod(0o755)
        saved, serving.RANKMETER = serving.RANKMETER, str(wrapper)
        try:
            return super().start(create_topics, args, wait_ready)
        finally:
            serving.RANKMETER = saved


def traced_serve(argv: list[str]) -> int:
    """Inside the serve process: tracemalloc on, the pipeline remembered, and on SIGUSR1
    its containers' sizes and the tracemalloc diff against the first dump written."""
    import tracemalloc

    tracemalloc.start(int(os.environ.get("SOAK_TRACE_FRAMES", "6")))
    out = Path(os.environ["SOAK_TRACE_DIR"])
    from rankmeter import pipeline as pipeline_module

    pipelines = []
    init = pipeline_module.Pipeline.__init__

    def remember(self, *args, **kwargs):
        init(self, *args, **kwargs)
        pipelines.append(self)

    pipeline_module.Pipeline.__init__ = remember
    state = {"base": None, "n": 0}

    def sizes(obj) -> dict[str, int]:
        return {k: len(v) for k, v in vars(obj).items() if hasattr(v, "__len__") and not isinstance(v, (str, bytes))}

    def dump(signum, frame) -> None:
        state["n"] += 1
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")])
        report = {"n": state["n"], "traced_mib": tracemalloc.get_traced_memory()[0] / MIB,
                  "allocated_blocks": sys.getallocatedblocks(), "gc_objects": len(gc.get_objects()),
                  "pipelines": [{"pipeline": sizes(pl),
                                 "decoder": sizes(pl.decoder) if hasattr(pl, "decoder") else {},
                                 "partitions": {str(p): sizes(ps) for p, ps in list(pl.partitions.items())}}
                                for pl in pipelines]}
        if state["base"] is None:
            state["base"] = snapshot
            report["top"] = [str(s) for s in snapshot.statistics("lineno")[:30]]
        else:
            report["diff"] = [str(s) for s in snapshot.compare_to(state["base"], "lineno")[:40]]
            report["diff_traceback"] = [
                "\n".join([str(s)] + s.traceback.format()[-6:])
                for s in snapshot.compare_to(state["base"], "traceback")[:8]]
        (out / f"trace-{state['n']}.json").write_text(json.dumps(report, indent=1))

    signal.signal(signal.SIGUSR1, dump)
    from rankmeter.cli import main as rankmeter_main

    return rankmeter_main(argv)


def at(samples: list[dict], events: float, key: str) -> float:
    """The first sample at or past `events` consumed."""
    return next((s[key] for s in samples if s["events"] >= events), samples[-1][key])


def slope(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def soak(bootstrap: str, redis_url: str, partitions: int, backend: str, args, logs: Path) -> dict:
    client = redis.Redis.from_url(redis_url)
    total = args.events
    topics = unique_topics(bootstrap, partitions=partitions)
    prefix, group = f"soak-{uuid.uuid4().hex[:6]}", f"soak-{uuid.uuid4().hex[:6]}"
    env = {"RANKMETER_KAFKA_BACKEND": backend, "RANKMETER_WINDOWS_ATTRIBUTION": args.attribution,
           "RANKMETER_WINDOWS_GRACE": args.grace, "RANKMETER_WINDOWS_JUDGMENTS": args.attribution}
    if args.trace:
        trace_dir = logs / f"trace-{backend}"
        trace_dir.mkdir(parents=True, exist_ok=True)
        serve = TracedServe(bootstrap, redis_url, topics, group, prefix, env, log_path=logs / f"serve-{backend}.log",
                            trace_dir=trace_dir)
    else:
        trace_dir = None
        serve = Serve(bootstrap, redis_url, topics, group, prefix, env, log_path=logs / f"serve-{backend}.log")
    memory_before = used_memory(redis_url)
    step = max(1, total // args.samples)
    samples: list[dict] = []
    marks = [0.1, 0.5, 1.0]  # trace dumps
    progress = Progress(f"[{backend}] consumed", total, "events")
    out: dict = {"backend": backend, "prefix": prefix, "rate_offered": args.rate}
    load = PacedProducer(bootstrap, topics, total, args.rate, args.qps, int(time.time() * 1000) - 3_600_000,
                         f"soak{uuid.uuid4().hex[:4]}", args.max_lag)
    try:
        serve.start(create_topics=None)
        pid = serve.process.pid
        load.start()
        started, next_at, last_done, last_change = time.perf_counter(), step, -1, time.monotonic()
        while True:
            if load.error is not None:
                raise RuntimeError(f"the producer failed: {load.error!r}")
            done = load.consumed = consumed(client, prefix, partitions)
            progress(min(done, total))
            if done != last_done:
                last_done, last_change = done, time.monotonic()
            elif time.monotonic() - last_change > 120:
                raise RuntimeError(f"serve consumed nothing for 120 s at {done} of {total} (log: {serve.log_path})")
            if serve.process.poll() is not None:
                raise RuntimeError(f"serve exited with {serve.process.returncode} (log: {serve.log_path})")
            if done >= next_at or done >= total:
                samples.append({"events": done, "seconds": time.perf_counter() - started, "rss": rss_bytes(pid),
                                "lag": load.sent - done,
                                "cpu_s": cpu_seconds(pid), "open_queries": open_queries(client, prefix, partitions),
                                "redis_prefix_bytes": prefix_bytes(client, prefix, partitions),
                                "redis_used_memory": used_memory(redis_url)})
                next_at = (done // step + 1) * step
                if trace_dir is not None and marks and done >= marks[0] * total:
                    while marks and done >= marks[0] * total:
                        marks.pop(0)
                    n = len(list(trace_dir.glob("trace-*.json")))
                    os.kill(pid, signal.SIGUSR1)
                    deadline = time.monotonic() + 120
                    while len(list(trace_dir.glob("trace-*.json"))) <= n and time.monotonic() < deadline:
                        time.sleep(0.5)
            if done >= load.sent and not load.is_alive():
                break
            time.sleep(0.1)
        total = out["events"] = load.sent
        out["producer_held_s"] = load.held_s
        out["hwm"] = hwm_bytes(pid)
        out["seconds"] = samples[-1]["seconds"]
        out["outcomes"] = {f"{s}/{o}": v for (s, o), v in serve.events().items()}
        out["open_queries_gauge"] = next((v for (n, _), v in serve.metrics().items()
                                          if n == "rankmeter_open_queries"), None)
    finally:
        load.stop.set()
        if load.is_alive():
            load.join(60)
        serve.stop()
        deleted = delete_prefix(client, prefix)
        delete_topics(bootstrap, topics)
        print(f"[{backend}] serve stopped; {deleted} Redis keys under {prefix} and the topics deleted", file=sys.stderr)
    post = [s for s in samples if s["events"] >= 0.1 * total]
    rss10 = at(samples, 0.1 * total, "rss")
    out.update({
        "rss_mib_at_10pct": rss10 / MIB, "rss_mib_at_50pct": at(samples, 0.5 * total, "rss") / MIB,
        "rss_mib_at_100pct": samples[-1]["rss"] / MIB, "rss_mib_first_sample": samples[0]["rss"] / MIB,
        "rss_mib_max_after_warmup": max(s["rss"] for s in post) / MIB,
        "rss_mib_min_after_warmup": min(s["rss"] for s in post) / MIB,
        "rss_spread_after_warmup": (max(s["rss"] for s in post) - min(s["rss"] for s in post)) / rss10,
        # the target's figure: how far any sample after the warm-up strays from the RSS at 10%
        "rss_max_deviation_after_warmup": max(abs(s["rss"] / rss10 - 1) for s in post),
        "rss_growth_10_to_100pct": samples[-1]["rss"] / rss10 - 1,
        "rss_slope_mib_per_million_events": slope([s["events"] / 1e6 for s in post], [s["rss"] / MIB for s in post]),
        "hwm_mib": out.get("hwm", 0) / MIB,
        "events_per_second": (samples[-1]["events"] - samples[0]["events"]) /
                             max(samples[-1]["seconds"] - samples[0]["seconds"], 1e-9),
        "serve_cpu_us_per_event": (samples[-1]["cpu_s"] - samples[0]["cpu_s"]) /
                                  max(samples[-1]["events"] - samples[0]["events"], 1) * 1e6,
        "open_queries_at_10pct": at(samples, 0.1 * total, "open_queries"),
        "open_queries_at_50pct": at(samples, 0.5 * total, "open_queries"),
        "open_queries_at_100pct": samples[-1]["open_queries"],
        "open_queries_max": max(s["open_queries"] for s in samples),
        "lag_max": max(s["lag"] for s in samples), "lag_median": statistics.median(s["lag"] for s in samples),
        "redis_prefix_mib_at_10pct": at(samples, 0.1 * total, "redis_prefix_bytes") / MIB,
        "redis_prefix_mib_at_50pct": at(samples, 0.5 * total, "redis_prefix_bytes") / MIB,
        "redis_prefix_mib_at_100pct": samples[-1]["redis_prefix_bytes"] / MIB,
        "redis_used_memory_growth_mib_at_10pct": (at(samples, 0.1 * total, "redis_used_memory") - memory_before) / MIB,
        "redis_used_memory_growth_mib_at_50pct": (at(samples, 0.5 * total, "redis_used_memory") - memory_before) / MIB,
        "redis_used_memory_growth_mib_at_100pct": (samples[-1]["redis_used_memory"] - memory_before) / MIB,
        "redis_bytes_per_open_query_at_100pct": samples[-1]["redis_prefix_bytes"] / max(samples[-1]["open_queries"], 1),
        "samples": [[s["events"], round(s["seconds"], 2), s["rss"], s["open_queries"], s["redis_prefix_bytes"],
                     s["redis_used_memory"], s["lag"]] for s in samples],
        "samples_columns": ["events", "seconds", "rss", "open_queries", "redis_prefix_bytes", "redis_used_memory", "lag"],
    })
    if trace_dir is not None:
        out["trace_dir"] = str(trace_dir)
    out.pop("hwm", None)
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--traced-serve":
        return traced_serve(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--backend", action="append", choices=("confluent", "kafka-python"))
    ap.add_argument("--rate", type=float, default=60_000,
                    help="events/s offered at most (live; held to what serve sustains by --max-lag)")
    ap.add_argument("--max-lag", type=int, default=20_000,
                    help="the producer waits while serve is this many events behind")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--qps", type=int, default=500, help="queries per second of event time")
    ap.add_argument("--attribution", default="30s", help="windows.attribution (and windows.judgments)")
    ap.add_argument("--grace", default="5s", help="windows.grace")
    ap.add_argument("--samples", type=int, default=100, help="RSS samples over the run")
    ap.add_argument("--trace", action="store_true", help="serve under tracemalloc; dumps at 10%%, 50%%, 100%%")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/soak.json")
    args = ap.parse_args()
    # SIGTERM (a background job ignores SIGINT) unwinds like Ctrl-C: serve stopped, topics and keys deleted.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if importlib.util.find_spec("confluent_kafka") is None:
        print("confluent-kafka is needed (pip install -e '.[confluent]'): it produces the stream", file=sys.stderr)
        return 2
    bootstrap = os.environ["RANKMETER_KAFKA_BOOTSTRAP_SERVERS"]
    redis_url = os.environ["RANKMETER_REDIS_URL"]
    backends = args.backend or ["confluent", "kafka-python"]
    logs = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    print(f"logs in {logs}", file=sys.stderr)
    results = {}
    for backend in backends:
        print(f"[{backend}] {args.events:,} events offered at {args.rate:,.0f}/s ({args.qps} queries per "
              f"event-second) ...", file=sys.stderr)
        r = soak(bootstrap, redis_url, args.partitions, backend, args, logs)
        results[backend.replace("-", "_")] = r
        print(f"[{backend}] RSS {r['rss_mib_at_10pct']:.0f} / {r['rss_mib_at_50pct']:.0f} / "
              f"{r['rss_mib_at_100pct']:.0f} MiB at 10/50/100%, at most {100 * r['rss_max_deviation_after_warmup']:.1f}% "
              f"from the 10% figure, "
              f"{r['events_per_second']:,.0f} events/s, lag at most {r['lag_max']:,}", file=sys.stderr)
    total = args.events
    print(f"events={total} rate={args.rate:g} partitions={args.partitions} qps={args.qps} attribution={args.attribution} "
          f"grace={args.grace} samples={args.samples} trace={args.trace}")
    print("| backend | events/s | RSS at 10% | 50% | 100% | max after warm-up | largest deviation after warm-up | peak to peak | "
          "slope (MiB / M events) | open queries 10/50/100% (max) | lag max | Redis (run's keys) 10/50/100% | "
          "Redis used_memory growth 10/50/100% |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results.values():
        print(f"| {r['backend']} | {r['events_per_second']:,.0f} | {r['rss_mib_at_10pct']:.1f} MiB | "
              f"{r['rss_mib_at_50pct']:.1f} MiB | {r['rss_mib_at_100pct']:.1f} MiB | "
              f"{r['rss_mib_max_after_warmup']:.1f} MiB | **{100 * r['rss_max_deviation_after_warmup']:.1f}%** | "
              f"{100 * r['rss_spread_after_warmup']:.1f}% | "
              f"{r['rss_slope_mib_per_million_events']:+.2f} | {r['open_queries_at_10pct']:,} / "
              f"{r['open_queries_at_50pct']:,} / {r['open_queries_at_100pct']:,} ({r['open_queries_max']:,}) | "
              f"{r['lag_max']:,} | "
              f"{r['redis_prefix_mib_at_10pct']:.1f} / {r['redis_prefix_mib_at_50pct']:.1f} / "
              f"{r['redis_prefix_mib_at_100pct']:.1f} MiB | {r['redis_used_memory_growth_mib_at_10pct']:.1f} / "
              f"{r['redis_used_memory_growth_mib_at_50pct']:.1f} / {r['redis_used_memory_growth_mib_at_100pct']:.1f} MiB |")
    for key, r in results.items():
        print(f"rss_flat_within_10pct_{key}={r['rss_max_deviation_after_warmup'] <= 0.10} "
              f"(largest deviation from the RSS at 10%: {100 * r['rss_max_deviation_after_warmup']:.1f}%, "
              f"peak to peak {100 * r['rss_spread_after_warmup']:.1f}%; outcomes {r['outcomes']})")
    if not args.no_save and not args.trace:
        save("soak", {"events": total, "rate": args.rate, "partitions": args.partitions, "qps": args.qps,
                      "attribution": args.attribution, "grace": args.grace, "backends": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
