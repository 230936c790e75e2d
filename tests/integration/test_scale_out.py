"""Scale-out on Redis Cluster: three `rankmeter serve` replicas share 12-partition topics,
with replicas stopped (SIGTERM, SIGKILL) and started mid-stream; the sums over the live
replicas equal one uninterrupted replica's over the same topics (on the plain Redis)."""

from __future__ import annotations

import random
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import IN_CI, ROOT

from serving import Serve, produce, unique_topics, wait_until
from test_restart import FAST_FAILOVER, aggregates, caught_up, stream, summed

pytestmark = [pytest.mark.integration, pytest.mark.long]

PARTITIONS = 12


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A Redis Cluster of three masters from the harness (stopped again if it started it)."""
    script = str(ROOT / "scripts" / "services.sh")
    already_up = subprocess.run([script, "cluster-status"], capture_output=True).returncode == 0
    out = subprocess.run([script, "cluster-up"], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        message = f"no Redis Cluster: scripts/services.sh cluster-up failed: {out.stderr.strip()[-2000:]}"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    settings = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    try:
        yield settings["RANKMETER_REDIS_URL"]
    finally:
        if not already_up:
            subprocess.run([script, "cluster-down"], capture_output=True)


def _gauges(serve: Serve, name: str) -> list[float]:
    return [v for (n, _), v in serve.metrics().items() if n == name]


def all_held_and_caught_up(replicas: list[Serve]) -> bool:
    """Every partition held by exactly one live replica, and no lag on any of them."""
    held = sum(sum(_gauges(r, "rankmeter_assigned_partitions")) for r in replicas)
    lags = [v for r in replicas for v in _gauges(r, "rankmeter_consumer_lag")]
    return held == PARTITIONS and len(lags) == 2 * PARTITIONS and sum(lags) == 0


def processed(replicas: list[Serve]) -> float:
    return sum(sum(r.events().values()) for r in replicas)


def test_replicas_come_and_go_on_redis_cluster_and_sum_to_one_replica(
        kafka_bootstrap, redis_url, redis_cluster_url, tmp_path: Path):
    topics = unique_topics(kafka_bootstrap, partitions=PARTITIONS)
    impressions, feedback = stream(seed=12, queries=3000, now=int(time.time() * 1000))
    messages = [(topics.impressions, m) for m in impressions] + [(topics.feedback, m) for m in feedback]
    random.Random(12).shuffle(messages)  # much feedback comes before its impression
    quarter = len(messages) // 4
    chunks = [messages[i * quarter:(i + 1) * quarter] for i in range(3)] + [messages[3 * quarter:]]

    def produce_chunk(chunk: list) -> None:
        for topic in (topics.impressions, topics.feedback):
            produce(kafka_bootstrap, topic, [m for t, m in chunk if t == topic])

    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    on_cluster = {**FAST_FAILOVER, "RANKMETER_REDIS_CLUSTER": "true",
                  "RANKMETER_KAFKA_MAX_POLL_RECORDS": "100"}  # many batches: many places to stop
    names = iter("ABCDEF")

    def replica() -> Serve:
        name = next(names)
        return Serve(kafka_bootstrap, redis_cluster_url, topics, group, prefix, on_cluster,
                     log_path=tmp_path / f"replica-{name}.log").start(create_topics=None)

    live: list[Serve] = []
    stopped_at: list[float] = []  # events the victims had processed when stopped

    def stop(victim: Serve, sig: int) -> None:
        stopped_at.append(sum(victim.events().values()))
        live.remove(victim)
        assert victim.stop(sig) == (-sig if sig == signal.SIGKILL else 0)

    def feed(chunk: list) -> None:
        """Produce `chunk`, then wait until the live replicas are a third of the way into it."""
        start = processed(live)
        produce_chunk(chunk)
        wait_until(lambda: processed(live) >= start + len(chunk) / 3, 120,
                   "the replicas to work through a third of the chunk", interval=0.05)

    try:
        live += [replica(), replica()]                 # A, B share the partitions
        feed(chunks[0])
        live.append(replica())                         # C joins: a rebalance mid-stream
        feed(chunks[1])
        stop(live[0], signal.SIGTERM)                  # A leaves cleanly: revoked, flushed
        feed(chunks[2])
        stop(live[0], signal.SIGKILL)                  # B dies: its partitions wait for its session to expire
        live.append(replica())                         # D joins while B's partitions are orphaned
        feed(chunks[3])
        live.append(replica())                         # E: three live replicas again (C, D, E)
        wait_until(lambda: all_held_and_caught_up(live), 180,
                   "three live replicas to hold all 12 partitions and catch up")
        time.sleep(2)  # the lag gauge is sampled every second: let the last batch land
        assert all_held_and_caught_up(live)
        held = [sum(_gauges(r, "rankmeter_assigned_partitions")) for r in live]
        got = summed(live)
    finally:
        for r in live:
            r.stop()

    reference = Serve(kafka_bootstrap, redis_url, topics, f"g-{uuid.uuid4().hex[:6]}",
                      f"rm-{uuid.uuid4().hex[:6]}", {"RANKMETER_REDIS_CLUSTER": "false"},
                      log_path=tmp_path / "reference.log").start(create_topics=None)
    try:
        wait_until(lambda: caught_up(reference, PARTITIONS), 180, "the uninterrupted replica to catch up")
        time.sleep(2)
        expected = aggregates(reference)
    finally:
        reference.stop()

    assert len(held) == 3 and all(h > 0 for h in held), held
    assert all(n < len(messages) for n in stopped_at), stopped_at
    assert got.keys() == expected.keys()
    assert len(expected) > 100
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key
