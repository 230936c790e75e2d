"""The Kafka broker restarted mid-stream (issue 9, "Restarts of the services"): `serve`
stays alive and reports not ready while the broker is away, recovers by itself once it
is back, and ends with the aggregates and event counts of an uninterrupted run.

The broker is a private one from the harness (`scripts/services.sh kafka-alt-up`), never
the shared broker other tests use."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving import Serve, free_port, unique_topics, wait_until
from test_faults import assert_exact, messages_of, produce_chunk, reference, split
from test_restart import FAST_FAILOVER, aggregates, caught_up

pytestmark = [pytest.mark.integration, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "services.sh")


class PrivateBroker:
    """A single-node KRaft broker of this test's own, stopped (SIGTERM) and started again on its data."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.bootstrap = ""

    def _run(self, *args: str) -> str:
        out = subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=180)
        if out.returncode != 0:
            raise RuntimeError(f"services.sh {args[0]} failed: {out.stderr.strip()[-2000:]}")
        return out.stdout

    def up(self) -> PrivateBroker:
        port = free_port()
        controller = free_port()
        settings = dict(line.split("=", 1) for line in
                        self._run("kafka-alt-up", str(self.directory), str(port), str(controller)).splitlines()
                        if "=" in line)
        self.bootstrap = settings["RANKMETER_KAFKA_BOOTSTRAP_SERVERS"]
        return self

    def stop(self) -> None:
        self._run("kafka-alt-stop", str(self.directory))

    def start(self) -> None:
        self._run("kafka-alt-start", str(self.directory))


@pytest.fixture
def private_broker(tmp_path: Path) -> Iterator[PrivateBroker]:
    if not shutil.which("java") or not (ROOT / ".cache" / "kafka-jars" / ".complete").exists():
        message = "no Java or Kafka jars for a private broker (scripts/services.sh install)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    broker = PrivateBroker(tmp_path / "kafka")
    try:
        yield broker.up()
    finally:
        broker.stop()


def test_kafka_broker_restarted_mid_stream_recovers_exactly(private_broker, redis_url, kafka_backend, tmp_path):
    bootstrap = private_broker.bootstrap
    topics = unique_topics(bootstrap)
    first, second, third = split(messages_of(topics, seed=53, queries=3000), 0.5, 0.8)
    log_path = tmp_path / "serve.log"
    serve = Serve(bootstrap, redis_url, topics, f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}",
                  {**FAST_FAILOVER, "RANKMETER_KAFKA_MAX_POLL_RECORDS": "100", **kafka_backend}, log_path=log_path)
    try:
        serve.start()
        produce_chunk(bootstrap, topics, first)
        wait_until(lambda: sum(serve.events().values()) >= len(first) / 4, 60, "serve to be mid-stream",
                   interval=0.01)
        log_before = len(log_path.read_text())
        private_broker.stop()  # SIGTERM, data kept
        stopped = time.monotonic()
        wait_until(lambda: serve.get("/readyz")[0] == 503, 30, "/readyz to fail while Kafka is away")
        time.sleep(max(0.0, 12 - (time.monotonic() - stopped)))  # past the session timeout (6 s)
        status, body = serve.get("/readyz")
        assert status == 503 and "Kafka unavailable" in body, body
        assert serve.get("/healthz")[0] == 200
        assert serve.process.poll() is None, "serve died with Kafka away"
        during = log_path.read_text()[log_before:].splitlines()
        assert not any("Traceback" in line for line in during), during[-30:]
        # No log loop either: rankmeter says it once; the client's reconnect errors follow
        # its reconnect backoff (a few lines a second).
        ours = [line for line in during if '"logger": "rankmeter.' in line and '"progress"' not in line]
        assert len(ours) <= 3, ours
        assert len(during) < 30 * (time.monotonic() - stopped), len(during)

        private_broker.start()  # same data: topics, offsets and the group come back
        wait_until(lambda: serve.get("/readyz")[0] == 200, 60, "serve to recover by itself")
        produce_chunk(bootstrap, topics, second)
        produce_chunk(bootstrap, topics, third)
        # Every message counts once in rankmeter_events_total (every query has its
        # impression): the lag gauge alone may still show the moment before the produce.
        total = len(first) + len(second) + len(third)
        wait_until(lambda: sum(serve.events().values()) >= total, 60, "serve to count every message")
        wait_until(lambda: caught_up(serve), 60, "serve to catch up after the restart")
        time.sleep(1.5)  # the lag gauge is sampled every second: let the last batch land
        got, got_events = aggregates(serve), serve.events()
    finally:
        if serve.process is not None:
            serve.stop()
    log = log_path.read_text()
    assert "Kafka is out of reach" in log and "Kafka answers again" in log
    assert log.count("Traceback") == 0, log[-3000:]

    expected, expected_events = reference(bootstrap, redis_url, topics, tmp_path)
    assert_exact(got, expected)
    assert got_events == expected_events, {k: (got_events.get(k), v) for k, v in expected_events.items()}
