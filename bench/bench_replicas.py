"""Scaling: 1, 2 and 3 `rankmeter serve` replicas in one consumer group on the same topics,
and where the CPU goes (rankmeter, the Kafka broker, Redis), on the real Kafka and Redis:

    make bench-replicas    # or, with services up:
    RANKMETER_KAFKA_BOOTSTRAP_SERVERS=... RANKMETER_REDIS_URL=... \\
        .venv/bin/python bench/bench_replicas.py [--events 1000000] [--partitions 6] [--replicas 1 --replicas 2 --replicas 3] \\
        [--backend confluent --backend kafka-python]

1. A backlog of `--events` of bench_serve's mix (an impression of 10 results, then 1–7
   clicks, add-to-carts, purchases or judgments) is produced once into fresh topics of
   `--partitions` partitions (6: 3 replicas hold 2 each, 2 hold 3).
2. Per backend and replica count: that many `rankmeter serve` processes with one group
   id and one Redis prefix (as replicas of one deployment) are started together. The
   window measured opens once every replica holds partitions and all the partitions are
   held (each replica's `rankmeter_assigned_partitions`: after the group's rebalances)
   and closes when 95% of the events are consumed (the last partitions to finish would
   otherwise leave replicas idle); consumption is read from the offsets the replicas
   checkpoint in Redis (a /metrics scrape would cost serve 20–40 ms each time).
3. Over that window: events/s, and each process's CPU time from /proc/<pid>/stat
   (utime + stime, all threads): the serve replicas together, the broker (the java
   process of scripts/services.sh), redis-server, this bench process, and the rest of the
   machine (/proc/stat's busy time minus those: other engineers' work on the shared
   cores). As cores (CPU seconds per second) and as µs per event.
4. The model of docs/capacity.md for this machine, Xₙ = min(n / s, free / (s + b + c))
   with s, b, c the CPU per event of serve, the broker and Redis and `free` the cores the
   rest of the machine left: from the one-replica run's figures (the prediction one would
   make beforehand), and from each run's own. The second equals the measured rate
   whenever the machine was saturated (no idle time): it checks that, not the model.

The replicas are stopped (also on failure), each run's Redis keys deleted, and the topics
deleted at the end. Figures go to bench/results/replicas.json for bench/summary.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))
from bench_freshness import cpu_seconds  # noqa: E402
from bench_soak import PacedProducer, consumed, delete_prefix, delete_topics  # noqa: E402
from progress import Progress  # noqa: E402
from serving import Serve, unique_topics, wait_until  # noqa: E402
from summary import save  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CLK = os.sysconf("SC_CLK_TCK")


def broker_pid() -> int | None:
    """The harness's broker (its pid file), else any java process running kafka.Kafka."""
    pid_file = ROOT / ".services" / "kafka" / "pid"
    candidates = [int(pid_file.read_text())] if pid_file.exists() else []
    candidates += [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    for pid in candidates:
        try:
            if b"kafka.Kafka" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent not idle (all cores), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK


def cpu_or_zero(pid: int | None) -> float:
    try:
        return cpu_seconds(pid) if pid else 0.0
    except OSError:
        return 0.0


def snapshot(serve_pids: list[int], broker: int | None, redis_pid: int | None) -> dict[str, float]:
    return {"rankmeter": sum(cpu_or_zero(p) for p in serve_pids), "broker": cpu_or_zero(broker),
            "redis": cpu_or_zero(redis_pid), "bench": cpu_or_zero(os.getpid()), "machine": machine_busy_seconds(),
            "t": time.perf_counter()}


def assigned(serve: Serve) -> float:
    return sum(v for (name, _), v in serve.metrics().items() if name == "rankmeter_assigned_partitions")


def run(bootstrap: str, redis_url: str, topics, partitions: int, total: int, replicas: int, backend: str,
        logs: Path, broker: int | None, redis_pid: int | None) -> dict:
    client = redis.Redis.from_url(redis_url)
    group, prefix = f"replicas-{uuid.uuid4().hex[:6]}", f"replicas-{uuid.uuid4().hex[:6]}"
    processes = [Serve(bootstrap, redis_url, topics, group, prefix, {"RANKMETER_KAFKA_BACKEND": backend},
                       log_path=logs / f"{backend}-x{replicas}-{i}.log") for i in range(replicas)]
    progress = Progress(f"[{backend} x{replicas}] consumed", total, "events")
    try:
        for serve in processes:  # all at once: they join the group together
            serve.start(create_topics=None, wait_ready=False)
        for serve in processes:
            wait_until(lambda s=serve: s.get("/readyz")[0] == 200, 120, "a replica to become ready")

        def settled() -> bool:
            held = [assigned(s) for s in processes]
            return all(h > 0 for h in held[:partitions]) and sum(held) >= partitions

        wait_until(settled, 120, "every replica to hold partitions", interval=0.25)
        before = snapshot([s.process.pid for s in processes], broker, redis_pid)
        start_done = consumed(client, prefix, partitions)
        end_at = int(0.95 * total)
        while True:
            done = consumed(client, prefix, partitions)
            progress(min(done, total))
            if done >= end_at:
                break
            for s in processes:
                if s.process.poll() is not None:
                    raise RuntimeError(f"a replica exited with {s.process.returncode} (log: {s.log_path})")
            time.sleep(0.1)
        after = snapshot([s.process.pid for s in processes], broker, redis_pid)
        held_at_end = [assigned(s) for s in processes]
    finally:
        for serve in processes:
            if serve.process is not None:
                serve.stop()
        delete_prefix(client, prefix)
    seconds, events = after["t"] - before["t"], done - start_done
    cpu = {k: after[k] - before[k] for k in ("rankmeter", "broker", "redis", "bench", "machine")}
    cpu["other"] = max(0.0, cpu["machine"] - cpu["rankmeter"] - cpu["broker"] - cpu["redis"] - cpu["bench"])
    return {"replicas": replicas, "events": events, "skipped_before_window": start_done, "seconds": seconds,
            "events_per_second": events / seconds, "held_at_end": held_at_end,
            "cpu_cores": {k: v / seconds for k, v in cpu.items()},
            "cpu_us_per_event": {k: v / events * 1e6 for k, v in cpu.items()}}


def model(costs: dict, free: float, n: int) -> float:
    """docs/capacity.md's model for this machine: a replica is one Python thread, so n
    replicas take at most n / s; all of them, the broker and Redis share the cores the rest
    of the machine leaves: Xₙ = min(n / s, free / (s + b + c)), with s, b, c the CPU seconds
    per event of serve, the broker and Redis."""
    s, b, c = (costs[k] / 1e6 for k in ("rankmeter", "broker", "redis"))
    return min(n / s, free / (s + b + c))


def free_cores(run: dict, cores: int) -> float:
    """What the rest of the machine (others' work, this bench) left for serve, the broker and Redis."""
    return cores - run["cpu_cores"]["other"] - run["cpu_cores"]["bench"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--replicas", type=int, action="append", help="replica counts (default 1, 2, 3)")
    ap.add_argument("--backend", action="append", choices=("confluent", "kafka-python"))
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/replicas.json")
    args = ap.parse_args()
    # SIGTERM (a background job ignores SIGINT) unwinds like Ctrl-C: serve stopped, topics and keys deleted.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if importlib.util.find_spec("confluent_kafka") is None:
        print("confluent-kafka is needed (pip install -e '.[confluent]'): it produces the backlog", file=sys.stderr)
        return 2
    bootstrap = os.environ["RANKMETER_KAFKA_BOOTSTRAP_SERVERS"]
    redis_url = os.environ["RANKMETER_REDIS_URL"]
    counts = sorted(set(args.replicas or [1, 2, 3]))
    backends = args.backend or ["confluent", "kafka-python"]
    broker, redis_pid = broker_pid(), int(redis.Redis.from_url(redis_url).info("server")["process_id"])
    if broker is None:
        print("no Kafka broker process found on this machine: its CPU is not counted", file=sys.stderr)
    if not Path(f"/proc/{redis_pid}").exists():
        print(f"Redis (pid {redis_pid}) is not on this machine: its CPU is not counted", file=sys.stderr)
        redis_pid = None
    cores = os.cpu_count() or 1
    logs = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    print(f"logs in {logs}", file=sys.stderr)
    topics = unique_topics(bootstrap, partitions=args.partitions)
    results: dict[str, dict[int, dict]] = {}
    try:
        print(f"producing {args.events:,} events into {args.partitions}-partition topics ...", file=sys.stderr)
        backlog = PacedProducer(bootstrap, topics, args.events, rate=1e12, qps=10**12,
                                start_ms=int(time.time() * 1000), tag=f"rep{uuid.uuid4().hex[:4]}", max_lag=10**15)
        backlog.run()  # here, not as a thread: all of it before any replica starts
        if backlog.error is not None:
            raise backlog.error
        total = backlog.sent
        for backend in backends:
            results[backend] = {}
            for n in counts:
                r = run(bootstrap, redis_url, topics, args.partitions, total, n, backend, logs, broker, redis_pid)
                results[backend][n] = r
                c = r["cpu_cores"]
                print(f"[{backend} x{n}] {r['events_per_second']:,.0f} events/s; cores: rankmeter {c['rankmeter']:.2f}, "
                      f"broker {c['broker']:.2f}, Redis {c['redis']:.2f}, bench {c['bench']:.2f}, "
                      f"others {c['other']:.2f}", file=sys.stderr)
    finally:
        delete_topics(bootstrap, topics)
    print(f"events={total} partitions={args.partitions} cores={cores} load_average={os.getloadavg()[0]:.1f}")
    print("| backend | replicas | events/s | × 1 replica | model, from the 1-replica run | model, this run's costs "
          "| free cores | rankmeter (cores) | broker | Redis | bench | others | rankmeter µs/event | broker µs/event "
          "| Redis µs/event |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    saved: dict[str, dict] = {}
    for backend, runs in results.items():
        one = runs.get(1)
        key = backend.replace("-", "_")
        saved[key] = {"events_per_second": {}, "cpu_cores": {}, "cpu_us_per_event": {}, "ratio_to_one": {},
                      "model_events_per_second": {}, "model_own_run_events_per_second": {}, "free_cores": {}}
        for n, r in runs.items():
            c, us = r["cpu_cores"], r["cpu_us_per_event"]
            ratio = r["events_per_second"] / one["events_per_second"] if one else None
            # Predicted before the fact: the one-replica run's costs and free cores, for n replicas.
            ahead = model(one["cpu_us_per_event"], free_cores(one, cores), n) if one else None
            # The cost model alone: this run's own costs and free cores (others' load moves between runs).
            own = model(us, free_cores(r, cores), n)
            saved[key]["events_per_second"][str(n)] = r["events_per_second"]
            saved[key]["cpu_cores"][str(n)] = c
            saved[key]["cpu_us_per_event"][str(n)] = us
            saved[key]["ratio_to_one"][str(n)] = ratio
            saved[key]["model_events_per_second"][str(n)] = ahead
            saved[key]["model_own_run_events_per_second"][str(n)] = own
            saved[key]["free_cores"][str(n)] = free_cores(r, cores)
            print(f"| {backend} | {n} | {r['events_per_second']:,.0f} | "
                  f"{'—' if ratio is None else f'{ratio:.2f}'} | {'—' if ahead is None else f'{ahead:,.0f}'} | "
                  f"{own:,.0f} | {free_cores(r, cores):.2f} | "
                  f"{c['rankmeter']:.2f} | {c['broker']:.2f} | {c['redis']:.2f} | {c['bench']:.2f} | {c['other']:.2f} | "
                  f"{us['rankmeter']:.1f} | {us['broker']:.1f} | {us['redis']:.1f} |")
    if not args.no_save:
        save("replicas", {"events": total, "partitions": args.partitions, "cores": cores, "backends": saved})
    return 0


if __name__ == "__main__":
    sys.exit(main())
