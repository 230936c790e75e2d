"""Faults that production brings, on the real Kafka and Redis with the real `rankmeter
serve` (issue 9): a stalled replica (a zombie) that resumes, Redis losing its state,
Redis restarted mid-stream. Each ends with the aggregates of an uninterrupted single
`serve` over the same topics (another group and key prefix), exactly."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from rankmeter import config
from rankmeter.pipeline import Pipeline
from rankmeter.redis_store import RedisStore
from rankmeter.source import Record
from serving import RANKMETER, Serve, free_port, produce, unique_topics, wait_until
from test_restart import FAST_FAILOVER, aggregates, caught_up, stream, summed

pytestmark = [pytest.mark.integration, pytest.mark.long]


# ---- helpers ----

def messages_of(topics, seed: int, queries: int) -> list[tuple[str, tuple[str, dict]]]:
    """Impressions and feedback interleaved (much feedback before its impression)."""
    impressions, feedback = stream(seed=seed, queries=queries, now=int(time.time() * 1000))
    messages = [(topics.impressions, m) for m in impressions] + [(topics.feedback, m) for m in feedback]
    random.Random(seed).shuffle(messages)
    return messages


def produce_chunk(bootstrap: str, topics, chunk) -> None:
    for topic in (topics.impressions, topics.feedback):
        produce(bootstrap, topic, [m for t, m in chunk if t == topic])


def mid_stream(serve: Serve, bootstrap: str, topics, first: list) -> None:
    """Start `serve` and feed it the first chunk; return once it is working through it."""
    serve.start()
    produce_chunk(bootstrap, topics, first)
    wait_until(lambda: sum(serve.events().values()) >= len(first) / 4, 120, "serve to be mid-stream", interval=0.01)


def split(messages: list, *fractions: float) -> list[list]:
    cuts = [0, *(int(len(messages) * f) for f in fractions), len(messages)]
    return [messages[a:b] for a, b in zip(cuts, cuts[1:])]


def reference(bootstrap: str, redis_url: str, topics, tmp_path: Path) -> tuple[dict, dict]:
    """An uninterrupted single `serve` over the same topics: aggregates and event counts."""
    single = Serve(bootstrap, redis_url, topics, f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}",
                   log_path=tmp_path / "reference.log").start()
    try:
        wait_until(lambda: caught_up(single), 180, "the uninterrupted run to catch up")
        time.sleep(1.5)  # the lag gauge is sampled every second: let the last batch land
        return aggregates(single), single.events()
    finally:
        single.stop()


def assert_exact(got: dict, expected: dict) -> None:
    assert len(expected) > 50
    assert got.keys() == expected.keys(), set(got) ^ set(expected)
    wrong = {k: (got[k], v) for k, v in expected.items() if got[k] != pytest.approx(v, rel=1e-9, abs=1e-9)}
    assert not wrong, f"{len(wrong)} of {len(expected)} aggregates differ, e.g. {list(wrong.items())[:3]}"


def held(serve: Serve) -> float:
    return sum(v for (name, _), v in serve.metrics().items() if name == "rankmeter_assigned_partitions")


def lags(serve: Serve) -> list[float]:
    return [v for (name, _), v in serve.metrics().items() if name == "rankmeter_consumer_lag"]


def counter(serve: Serve, name: str) -> float:
    return sum(v for (n, _), v in serve.metrics().items() if n == name)


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    return client.delete(*keys) if keys else 0


class RedisServer:
    """A redis-server of this test's own (never the shared one), on a free port."""

    def __init__(self, directory: Path, *options: str) -> None:
        self.port, self.directory, self.options = free_port(), directory, options
        self.process: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.directory / "redis.log", "ab")
        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                         "--dir", str(self.directory), *self.options],
                                        stdout=log, stderr=log)

        def answers() -> bool:
            try:
                return redis.Redis.from_url(self.url, socket_timeout=1).ping()
            except redis.RedisError:  # refused, or LOADING the AOF
                return False
        wait_until(answers, 30, "redis-server to answer")
        return self

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=30)
            self.process = None


class ScriptHoldingProxy:
    """A TCP relay between one replica and the real Redis that, once armed, holds the
    replica's next Lua script call — made only inside a batch (the checkpoint, or the label
    cap's admission before it) — until released: where the stalled replica stopped is then
    certain, not a matter of timing. Everything else passes through untouched."""

    def __init__(self, redis_url: str) -> None:
        target = urlsplit(redis_url)
        self.target = (target.hostname, target.port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}{target.path}"
        self.armed = False
        self.held, self.released = threading.Event(), threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self) -> None:
        self.armed = True

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.released.set()
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, requests: bool) -> None:
        try:
            while data := source.recv(65536):
                # redis-py sends each command whole: its name is a RESP bulk string near the start.
                if requests and self.armed and (b"\r\nEVALSHA\r\n" in data or b"\r\nEVAL\r\n" in data):
                    self.armed = False
                    self.held.set()
                    self.released.wait()
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


# ---- 1. zombie fencing ----

def test_stalled_replica_resuming_is_fenced_and_the_sum_is_exact(kafka_bootstrap, redis_url, kafka_backend,
                                                                 tmp_path):
    topics = unique_topics(kafka_bootstrap)
    messages = messages_of(topics, seed=21, queries=3000)
    first, second, third = split(messages, 0.5, 0.8)
    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    # A stalled member is out of the group after 6 s of silence (its heartbeat thread
    # stops too under SIGSTOP).
    settings = {"RANKMETER_KAFKA_CLIENT": "session_timeout_ms=6000,heartbeat_interval_ms=1000,"
                                          "max_poll_interval_ms=10000",
                "RANKMETER_KAFKA_MAX_POLL_RECORDS": "500", **kafka_backend}
    proxy = ScriptHoldingProxy(redis_url)  # A's way to Redis; B's is direct
    a = Serve(kafka_bootstrap, proxy.url, topics, group, prefix, settings, log_path=tmp_path / "a.log").start()
    b = Serve(kafka_bootstrap, redis_url, topics, group, prefix, settings, log_path=tmp_path / "b.log").start()
    try:
        wait_until(lambda: held(a) == 2 and held(b) == 2, 60, "A and B to share the partitions")
        # A stalls inside a batch: its first script call of the chunk is held, then A is
        # frozen (SIGSTOP: a GC pause, a frozen VM) with that batch in hand, not yet written.
        proxy.arm()
        produce_chunk(kafka_bootstrap, topics, first)
        wait_until(proxy.held.is_set, 60, "A to be inside a batch")
        a.process.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            wait_until(lambda: held(b) == 4, 60, "B to take over A's partitions")
            # B has claimed A's partitions: A's held call reaches Redis only now (A still frozen).
            proxy.release()
            produce_chunk(kafka_bootstrap, topics, second)
            wait_until(lambda: len(lags(b)) == 8 and sum(lags(b)) == 0, 120, "B to catch up alone")
            # Past the session timeout and the poll interval: A is a zombie.
            time.sleep(max(0.0, 12 - (time.monotonic() - stopped_at)))
        finally:
            a.process.send_signal(signal.SIGCONT)
        produce_chunk(kafka_bootstrap, topics, third)

        def settled() -> bool:
            la, lb = lags(a), lags(b)
            return held(a) + held(b) == 4 and len(la) + len(lb) == 8 and sum(la) + sum(lb) == 0
        def stable() -> bool:
            # Settled twice, 2.5 s apart: a rebalance can look settled for an instant (the one
            # member rejoining holds nothing yet), and the lag gauge is sampled every second.
            if not settled():
                return False
            time.sleep(2.5)
            return settled()
        wait_until(stable, 120, "A and B to share all partitions again and catch up")
        got = summed([a, b])
        fenced = counter(a, "rankmeter_partitions_fenced_total")
    finally:
        proxy.close()
        for r in (a, b):
            if r.process is not None:
                r.process.send_signal(signal.SIGCONT)
                r.stop()
    expected, _ = reference(kafka_bootstrap, redis_url, topics, tmp_path)
    assert_exact(got, expected)
    # A resumed with a batch in hand: the store refused it rather than letting it write
    # stale sums and offsets over B's.
    assert fenced >= 1, (tmp_path / "a.log").read_text()[-3000:]


def _records(topics_and_messages: list[tuple[str, tuple[str, dict]]], first_offsets: dict[str, int]) -> list[Record]:
    offsets = dict(first_offsets)
    out = []
    for topic, (key, value) in topics_and_messages:
        out.append(Record(topic, 0, offsets[topic], key.encode(), json.dumps(value).encode()))
        offsets[topic] += 1
    return out


def _dump(client: redis.Redis, store: RedisStore) -> dict:
    keys = {name: store._key(0, name) for name in ("queries", "buckets", "offsets", "meta")}
    out = {name: client.hgetall(key) for name, key in keys.items()}
    out["open"] = client.zrange(store._key(0, "open"), 0, -1, withscores=True)
    return out


def test_a_fenced_pipeline_writes_nothing_after_the_new_claim(redis_url):
    settings = config.load(None, {})
    topics = type("T", (), {"impressions": settings.kafka.impressions_topic,
                            "feedback": settings.kafka.feedback_topic})
    messages = messages_of(topics, seed=4, queries=300)
    half = len(messages) // 2
    batch1 = _records(messages[:half], {topics.impressions: 0, topics.feedback: 0})
    n_imp = sum(1 for r in batch1 if r.topic == topics.impressions)
    batch2 = _records(messages[half:], {topics.impressions: n_imp, topics.feedback: len(batch1) - n_imp})
    client = redis.Redis.from_url(redis_url)
    prefix, ref_prefix = f"rm-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    stores = [RedisStore(redis_url, prefix), RedisStore(redis_url, prefix), RedisStore(redis_url, ref_prefix)]
    try:
        now = time.time()  # one clock for all three: their windows end at the same now
        a, b, single = (Pipeline(settings, s, lambda r, why: None, clock=lambda: now) for s in stores)
        a.assign([0])
        a.process(batch1)
        b.assign([0])                   # B claims partition 0: epoch + 1
        assert b.partitions[0].epoch == a.partitions[0].epoch + 1
        before = _dump(client, stores[0])
        assert before["offsets"] and before["buckets"] and before["queries"]
        a.process(batch2)               # A, a zombie, goes on with its next batch
        assert a.fenced == {0} and 0 not in a.partitions
        assert _dump(client, stores[0]) == before, "the zombie wrote after the new owner's claim"
        b.process(batch2)               # the new owner carries on from A's last checkpoint
        assert not b.fenced
        single.assign([0])
        single.process(batch1 + batch2)
        got = {(v.ranker, v.window, m): s for v in b.views() for m, s in v.sums.items()}
        expected = {(v.ranker, v.window, m): s for v in single.views() for m, s in v.sums.items()}
        assert got.keys() == expected.keys() and len(expected) > 10
        for key, s in expected.items():
            assert tuple(got[key]) == pytest.approx(tuple(s), rel=1e-9, abs=1e-9), key
    finally:
        for p in (prefix, ref_prefix):
            delete_prefix(client, p)
        for s in stores:
            s.close()
        client.close()


# ---- 2. state lost ----

def test_lost_state_is_refused_then_rebuilt_exactly(kafka_bootstrap, redis_url, tmp_path):
    topics = unique_topics(kafka_bootstrap)
    first, second = split(messages_of(topics, seed=31, queries=1500), 0.7)
    produce_chunk(kafka_bootstrap, topics, first)
    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    serve = Serve(kafka_bootstrap, redis_url, topics, group, prefix, FAST_FAILOVER,
                  log_path=tmp_path / "serve.log")
    serve.start()
    wait_until(lambda: caught_up(serve), 120, "serve to catch up")
    time.sleep(1.5)
    assert serve.stop() == 0
    # Redis restarted empty (or flushed) while Kafka kept the group's commits.
    client = redis.Redis.from_url(redis_url)
    try:
        assert len(list(client.scan_iter(match=f"{prefix}:{{{prefix}:*}}:*"))) >= 4 * 4
        for key in client.scan_iter(match=f"{prefix}:{{{prefix}:*}}:*"):
            client.delete(key)
    finally:
        client.close()
    produce_chunk(kafka_bootstrap, topics, second)

    serve.start(wait_ready=False)
    try:
        def refused() -> bool:
            status, body = serve.get("/readyz")
            return status == 503 and "state lost" in body
        wait_until(refused, 60, "/readyz to report the lost state")
        time.sleep(2)  # were it consuming, it would have by now
        status, body = serve.get("/readyz")
        assert status == 503 and "[0, 1, 2, 3]" in body and "--rebuild" in body, body
        metrics = serve.metrics()
        lost = {dict(labels)["partition"]: v for (name, labels), v in metrics.items() if name == "rankmeter_state_lost"}
        assert lost == {"0": 1, "1": 1, "2": 1, "3": 1}
        # Nothing consumed, nothing exported as if it were whole.
        assert sum(serve.events().values()) == 0
        assert not [k for k, v in aggregates(serve).items() if v], "aggregates exported for lost partitions"
        assert serve.process.poll() is None
    finally:
        serve.stop()

    serve.start(args=["--rebuild"])
    try:
        wait_until(lambda: caught_up(serve), 120, "the rebuild to catch up")
        time.sleep(1.5)
        assert serve.get("/readyz")[0] == 200
        assert not [k for k, v in serve.metrics().items() if k[0] == "rankmeter_state_lost" and v]
        got = aggregates(serve)
    finally:
        serve.stop()
    expected, _ = reference(kafka_bootstrap, redis_url, topics, tmp_path)
    assert_exact(got, expected)


def test_an_evicting_redis_is_refused_at_start(kafka_bootstrap, tmp_path):
    evicting = RedisServer(tmp_path / "redis", "--maxmemory-policy", "allkeys-lru", "--save", "",
                           "--appendonly", "no").start()
    try:
        env = {**os.environ, "RANKMETER_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
               "RANKMETER_REDIS_URL": evicting.url, "RANKMETER_METRICS_PORT": str(free_port())}
        out = subprocess.run([RANKMETER, "serve"], env=env, capture_output=True, text=True, timeout=60)
    finally:
        evicting.kill()
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 1, out
    assert len(lines) == 1 and "allkeys-lru" in lines[0] and "noeviction" in lines[0], lines


# ---- 3. Redis restarted mid-stream ----

def test_redis_restarted_mid_stream_recovers_exactly(kafka_bootstrap, redis_url, tmp_path):
    topics = unique_topics(kafka_bootstrap)
    messages = messages_of(topics, seed=41, queries=3000)
    first, second, third = split(messages, 0.5, 0.8)
    own = RedisServer(tmp_path / "redis", "--appendonly", "yes", "--appendfsync", "always", "--save", "").start()
    serve = Serve(kafka_bootstrap, own.url, topics, f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}",
                  {**FAST_FAILOVER, "RANKMETER_KAFKA_MAX_POLL_RECORDS": "100"}, log_path=tmp_path / "serve.log")
    try:
        mid_stream(serve, kafka_bootstrap, topics, first)
        own.kill()
        outage_started = time.monotonic()
        produce_chunk(kafka_bootstrap, topics, second)
        wait_until(lambda: serve.get("/readyz")[0] == 503, 30, "/readyz to fail while Redis is away")
        time.sleep(max(0.0, 6 - (time.monotonic() - outage_started)))
        status, body = serve.get("/readyz")
        assert status == 503 and "state store unavailable" in body, body
        assert serve.get("/healthz")[0] == 200
        assert serve.process.poll() is None, "serve died with Redis away"
        log_during = (tmp_path / "serve.log").read_text()
        retries = sum(1 for line in log_during.splitlines() if '"rankmeter.serve"' in line and "retrying" in line)
        assert 1 <= retries <= 10, retries  # bounded backoff, not a busy loop
        assert log_during.count("Traceback") <= 1, log_during[-3000:]

        own.start()  # same dir: the AOF brings the state back
        wait_until(lambda: serve.get("/readyz")[0] == 200, 60, "serve to recover by itself")
        produce_chunk(kafka_bootstrap, topics, third)
        # Every message counts once (every query has its impression): the lag gauge alone
        # may still show a moment before the produce.
        total = len(first) + len(second) + len(third)
        wait_until(lambda: sum(serve.events().values()) >= total, 120, "serve to count every message")
        wait_until(lambda: caught_up(serve), 120, "serve to catch up after the outage")
        time.sleep(1.5)
        got, got_events = aggregates(serve), serve.events()
        log_after = (tmp_path / "serve.log").read_text()
    finally:
        if serve.process is not None:
            serve.stop()
        own.kill()
    expected, expected_events = reference(kafka_bootstrap, redis_url, topics, tmp_path)
    assert_exact(got, expected)
    assert "Traceback" not in log_after[len(log_during):]
    assert got_events == expected_events, {k: (got_events.get(k), v) for k, v in expected_events.items()}


# ---- 4. Redis full (maxmemory, noeviction) mid-stream ----

def test_a_full_redis_is_not_ready_then_exact_once_memory_is_raised(kafka_bootstrap, redis_url, tmp_path):
    topics = unique_topics(kafka_bootstrap)
    messages = messages_of(topics, seed=43, queries=1500)
    first, second, third = split(messages, 0.3, 0.8)
    own = RedisServer(tmp_path / "redis", "--maxmemory-policy", "noeviction", "--save", "",
                      "--appendonly", "no").start()
    client = redis.Redis.from_url(own.url)
    serve = Serve(kafka_bootstrap, own.url, topics, f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}",
                  {**FAST_FAILOVER, "RANKMETER_KAFKA_MAX_POLL_RECORDS": "100"}, log_path=tmp_path / "serve.log")
    # The uninterrupted reference runs beside it (another group, the shared Redis).
    single = Serve(kafka_bootstrap, redis_url, topics, f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}",
                   log_path=tmp_path / "reference.log")
    try:
        single.start()
        mid_stream(serve, kafka_bootstrap, topics, first)
        client.config_set("maxmemory", client.info("memory")["used_memory"] + 64 * 1024)  # just above
        produce_chunk(kafka_bootstrap, topics, second)
        wait_until(lambda: serve.get("/readyz")[0] == 503, 30, "/readyz to fail while Redis is full")
        status, body = serve.get("/readyz")
        assert status == 503 and "redis is full (maxmemory" in body, body
        # A claim's few bytes fit where a batch's do not: serve retries with a growing wait,
        # not ready meanwhile, rather than reload and fail in a loop.
        wait_until(lambda: (tmp_path / "serve.log").read_text().count("waiting before reloading") >= 2,
                   30, "serve to back off")
        assert serve.get("/healthz")[0] == 200 and serve.process.poll() is None, "serve died with Redis full"
        assert "redis is full (maxmemory" in serve.get("/readyz")[1]
        log_during = (tmp_path / "serve.log").read_text()
        failures = log_during.count("the state store failed during a batch")
        assert 3 <= failures <= 6, failures   # bounded backoff, not a busy loop

        client.config_set("maxmemory", 0)  # memory raised
        wait_until(lambda: serve.get("/readyz")[0] == 200, 30, "serve to recover by itself")
        produce_chunk(kafka_bootstrap, topics, third)
        # Every message counts once (every query has its impression), in the batch that
        # also moved the sums: counted all, the aggregates are final.
        for run in (serve, single):
            wait_until(lambda: sum(run.events().values()) >= len(messages), 60, "serve to count every message")
        got, got_events = aggregates(serve), serve.events()
        expected, expected_events = aggregates(single), single.events()
        log_after = (tmp_path / "serve.log").read_text()
    finally:
        for run in (serve, single):
            if run.process is not None:
                run.stop()
        client.close()
        own.kill()
    assert "Traceback" not in log_during and "a batch failed" not in log_after
    assert_exact(got, expected)
    assert got_events == expected_events, {k: (got_events.get(k), v) for k, v in expected_events.items()}
