"""Hostile input through the real Kafka, `rankmeter serve` and Redis (issue 19): a ranker
named with \\x1f and one with a 100 KB name are dead letters with their reason; a field
planted in Redis with a \\x1f-broken layout is counted by rankmeter_store_unreadable_total
and does not stop the claim when serve restarts; /metrics stays exact on the other
rankers and small. And the stateful property test of tests/test_hostile_pipeline.py,
on Redis."""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest
import redis
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from kafka import KafkaConsumer

from rankmeter.redis_store import RedisStore
from test_hostile_pipeline import BUDGET, HostilePipeline, Unreliable

from serving import RANKMETER, Serve, produce, quality, unique_topics, wait_until

pytestmark = pytest.mark.integration


def impressions(rankers: dict[str, int], now: int) -> list[tuple[str, dict]]:
    return [(qid, {"query_id": qid, "ranker": ranker, "timestamp": now, "results": ["d1", "d2"]})
            for r, (ranker, n) in enumerate(rankers.items()) for qid in (f"{r}-{ranker[:6]!r}-{i}" for i in range(n))]


def counter(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def test_hostile_names_are_dead_letters_and_a_broken_stored_field_does_not_stop_a_restart(
        kafka_bootstrap, redis_url, tmp_path):
    now = int(time.time() * 1000)
    topics = unique_topics(kafka_bootstrap)
    run = uuid.uuid4().hex[:6]
    prefix = f"rm-{run}"
    serve = Serve(kafka_bootstrap, redis_url, topics, f"g-{run}", prefix, log_path=tmp_path / "serve.log")
    good = impressions({"good-a": 12, "good-b": 8}, now)
    clicks = [(qid, {"query_id": qid, "action": "click", "doc_id": "d1", "timestamp": now, "event_id": f"{qid}.c"})
              for qid, e in good if e["ranker"] == "good-a"]
    hostile = impressions({"sep\x1franker": 1, "h" * 100_000: 1}, now)
    client = redis.Redis.from_url(redis_url)
    with serve.start(create_topics=None):
        produce(kafka_bootstrap, topics.impressions, good + hostile)
        produce(kafka_bootstrap, topics.feedback, clicks)
        serve.wait_for_events(len(good) + len(hostile) + len(clicks), 60)
        # A field no version writes, as a ranker holding \x1f made them: planted in every
        # partition's buckets and experiment sums, before the restart claims them again.
        for p in range(4):
            client.hset(f"{prefix}:{{{prefix}:{p}}}:buckets", "sep\x1franker\x1f\x1f29000000", bytes(8 * 3))
            client.hset(f"{prefix}:{{{prefix}:{p}}}:ab", "il\x1fexperiment\x1fonly-a", bytes(24))
        serve.stop()
        serve.start(create_topics=None)  # main: serve exits in the rebalance callback, ValueError
        more = impressions({"good-c": 3}, now)
        produce(kafka_bootstrap, topics.impressions, more)
        wait_until(lambda: counter(serve.metrics(), "rankmeter_queries", ranker="good-c", segment="",
                                   window="5m", population="all") == 3, 60, "the restarted serve to go on")
        # The look at the experiments (every 5 s, partition 0's holder) skips it too: each
        # claim counts one bucket and one interleaving field per partition, each look one more.
        wait_until(lambda: counter(m := serve.metrics(), "rankmeter_store_unreadable_total", kind="interleaving")
                   > counter(m, "rankmeter_store_unreadable_total", kind="bucket"), 30,
                   "the experiment look to skip the planted field")
        text = serve.metrics_text()
        metrics = serve.metrics()
        assert serve.process.poll() is None, "serve is alive"
        assert serve.get("/readyz")[0] == 200
    assert counter(metrics, "rankmeter_store_unreadable_total", kind="bucket") >= 4  # each claim counts
    assert len(text) < 1_000_000 and "hhhhhhhhhh" not in text and "\x1f" not in text  # main: 49 MB
    rankers = {dict(labels)["ranker"] for (name, labels) in metrics if name == "rankmeter_queries"}
    assert rankers == {"good-a", "good-b", "good-c"}
    assert counter(metrics, "rankmeter_queries", ranker="good-a", segment="", window="5m", population="judged") == 12
    assert quality(metrics, "nDCG@10", "good-a") == 1.0 and quality(metrics, "P@10", "good-a") == pytest.approx(0.1)
    assert counter(metrics, "rankmeter_queries", ranker="good-b", segment="", window="5m", population="all") == 8
    assert counter(metrics, "rankmeter_queries", ranker="good-b", segment="", window="5m", population="judged") == 0
    # `rankmeter report` reads the same state without claiming it: the field is skipped there too.
    out = subprocess.run([RANKMETER, "report", "--format", "json", "--window", "5m"], capture_output=True, text=True,
                         env=serve.env, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert {v["ranker"]: v["queries_all"] for v in json.loads(out.stdout)} == {"good-a": 12, "good-b": 8, "good-c": 3}
    assert "skipping an unreadable stored field" in out.stderr
    dead = KafkaConsumer(topics.dead_letter, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
                         consumer_timeout_ms=10_000)
    letters = [m for m in dead][:3]
    dead.close()
    reasons = sorted(dict(m.headers)["rankmeter.reason"].decode() for m in letters)
    assert len(reasons) == 2
    assert reasons[0].startswith("ranker has 100000 characters, more than the limit of 128") and len(reasons[0]) < 300
    assert reasons[1].startswith("ranker holds the control character U+001F")


class UnreliableRedisStore(Unreliable, RedisStore):
    pass


def test_the_hostile_pipeline_property_holds_on_redis(redis_url):
    class OnRedis(HostilePipeline):
        def make_store(self) -> UnreliableRedisStore:
            self.prefix = f"hp-{uuid.uuid4().hex[:8]}"
            return UnreliableRedisStore(redis_url, self.prefix)

        def teardown(self) -> None:
            client = redis.Redis.from_url(redis_url)
            keys = list(client.scan_iter(match=f"{self.prefix}:*"))
            if keys:
                client.delete(*keys)
            client.close()
            self.store.close()

    run_state_machine_as_test(OnRedis, settings=settings(BUDGET, max_examples=15, stateful_step_count=15))
