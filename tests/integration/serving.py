"""Helpers for tests that run the real `rankmeter serve` against real Kafka and Redis."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families

RANKMETER = shutil.which("rankmeter", path=str(Path(sys.executable).parent))


class Topics(NamedTuple):
    impressions: str
    feedback: str
    dead_letter: str


def unique_topics(bootstrap: str | None = None, partitions: int = 4) -> Topics:
    """Fresh topic names; created now when `bootstrap` is given (else `serve` creates them)."""
    run = uuid.uuid4().hex[:8]
    topics = Topics(f"t{run}.impressions", f"t{run}.feedback", f"t{run}.dlq")
    if bootstrap:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        admin.create_topics([NewTopic(t, num_partitions=partitions, replication_factor=1) for t in topics])
        admin.close()
    return topics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def produce(bootstrap: str, topic: str, messages: Iterable[tuple[str, bytes | dict]],
            client: dict | None = None) -> int:
    """Send (key, value) pairs; dict values are JSON-encoded, bytes sent as they are.
    `client`: kafka-python settings such as SASL_SSL's (as rankmeter's `kafka.client`)."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, **(client or {}))
    n = 0
    for key, value in messages:
        data = value if isinstance(value, bytes) else json.dumps(value).encode()
        producer.send(topic, key=key.encode(), value=data)
        n += 1
    producer.flush()
    producer.close()
    return n


# A member that stops heartbeating is out of its group after 6 s, not the client's 45: a
# process killed and started again, and kafka-python's join that sometimes never completes
# (its watchdog: the session timeout + 15 s, in kafka/kafka_python.py), cost 6 s and 21 s,
# not 45 s and 60 s (seen 6 times in one CI run). Every Serve has it unless it sets its own.
FAST_FAILOVER = {"RANKMETER_KAFKA_CLIENT": "session_timeout_ms=6000,heartbeat_interval_ms=1000"}


class Serve:
    """`rankmeter serve` as a real process, with its own topics, group and Redis prefix."""

    def __init__(self, bootstrap: str, redis_url: str, topics: Topics, group: str, prefix: str,
                 extra_env: dict[str, str] | None = None, log_path: Path | None = None) -> None:
        self.port = free_port()
        self.env = {**os.environ,
                    "RANKMETER_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
                    "RANKMETER_KAFKA_IMPRESSIONS_TOPIC": topics.impressions,
                    "RANKMETER_KAFKA_FEEDBACK_TOPIC": topics.feedback,
                    "RANKMETER_KAFKA_DEAD_LETTER_TOPIC": topics.dead_letter,
                    "RANKMETER_KAFKA_GROUP_ID": group,
                    "RANKMETER_REDIS_URL": redis_url,
                    "RANKMETER_REDIS_KEY_PREFIX": prefix,
                    "RANKMETER_METRICS_PORT": str(self.port),
                    "RANKMETER_METRICS_BIND_ADDRESS": "127.0.0.1",
                    **FAST_FAILOVER,
                    **(extra_env or {})}
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self, create_topics: int | None = 4, args: Iterable[str] = (), wait_ready: bool = True) -> Serve:
        """`args`: more `serve` options (`--rebuild`). `wait_ready=False`: return once
        /healthz answers, for a process that is meant not to become ready."""
        command = [RANKMETER, "serve"] + (["--create-topics", str(create_topics)] if create_topics else []) + list(args)
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(command, env=self.env, stdout=log, stderr=log)
        if wait_ready:
            # Up to the client's rejoin watchdog (session timeout + 15 s) and a join after it.
            wait_until(lambda: self._answers("/readyz"), 120, "rankmeter serve to become ready")
        else:
            wait_until(lambda: self._answers("/healthz"), 60, "rankmeter serve to answer")
        return self

    def get(self, path: str) -> tuple[int, str]:
        """Status and body of one of the endpoints (503s included)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def _answers(self, path: str) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"rankmeter serve exited with {self.process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return r.read().decode()

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        return parse_metrics(self.metrics_text())

    def events(self) -> dict[tuple[str, str], float]:
        return {(dict(labels)["stream"], dict(labels)["outcome"]): v
                for (name, labels), v in self.metrics().items() if name == "rankmeter_events_total"}

    def wait_for_events(self, total: int, seconds: float = 120) -> dict[tuple[str, str], float]:
        wait_until(lambda: sum(self.events().values()) >= total, seconds,
                   f"{total} events to be consumed")
        return self.events()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process is None:
            return 0
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=60)
        finally:
            self.process = None

    def __enter__(self) -> Serve:
        # `with serve.start(...)` is started already: a second process would fail to bind
        # the port while the first answered for it, and be left running after the test.
        return self if self.process is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.stop()


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def quality(metrics: dict, metric: str, ranker: str, window: str = "5m", average: str = "macro",
            segment: str = "") -> float:
    labels = frozenset({"metric": metric, "ranker": ranker, "window": window, "average": average,
                        "segment": segment}.items())
    return metrics[("rankmeter_quality", labels)]


# The running test's waits, (what, seconds): tests/conftest.py lists the suite's longest.
WAITS: list[tuple[str, float]] = []


def wait_until(condition: Callable[[], bool], seconds: float, what: str, interval: float = 0.2) -> None:
    start = time.monotonic()
    deadline = start + seconds
    try:
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(interval)
        raise TimeoutError(f"timed out after {seconds} s waiting for {what}")
    finally:
        WAITS.append((what, time.monotonic() - start))
