"""Smoke tests against the real Kafka, Redis and Prometheus (no mocks)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
import uuid
from collections import defaultdict

import pytest
import redis
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

pytestmark = pytest.mark.integration


def consume(consumer: KafkaConsumer, want: int, seconds: float = 60) -> list:
    records, deadline = [], time.monotonic() + seconds
    while len(records) < want and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=500).values():
            records.extend(batch)
    return records


def test_kafka_keyed_messages_in_a_consumer_group_with_committed_offsets(kafka_bootstrap):
    topic, group = f"smoke-{uuid.uuid4().hex[:8]}", f"smoke-group-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, client_id="rankmeter-smoke")
    try:
        admin.create_topics([NewTopic(topic, num_partitions=4, replication_factor=1)])
        deadline = time.monotonic() + 30  # the controller takes a moment to publish a new topic
        while len(admin.describe_topics([topic])[0]["partitions"]) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(admin.describe_topics([topic])[0]["partitions"]) == 4

        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        sent = [(f"query-{i % 25}", i) for i in range(200)]
        for key, i in sent:
            producer.send(topic, key=key.encode(), value=json.dumps({"n": i}).encode())
        producer.flush()
        producer.close()

        consumer = KafkaConsumer(topic, bootstrap_servers=kafka_bootstrap, group_id=group,
                                 auto_offset_reset="earliest", enable_auto_commit=False)
        records = consume(consumer, len(sent))
        assert len(records) == len(sent)
        partitions_of_key = defaultdict(set)
        order_of_key = defaultdict(list)
        for r in records:
            partitions_of_key[r.key.decode()].add(r.partition)
            order_of_key[r.key.decode()].append(json.loads(r.value)["n"])
        # Keyed: a key always lands in one partition, so its messages keep their order.
        assert all(len(p) == 1 for p in partitions_of_key.values())
        assert len({next(iter(p)) for p in partitions_of_key.values()}) > 1
        for key, ns in order_of_key.items():
            assert ns == [i for k, i in sent if k == key]
        consumer.commit()
        partitions = [TopicPartition(topic, p) for p in range(4)]
        end = consumer.end_offsets(partitions)
        assert {tp: consumer.committed(tp) for tp in partitions} == end
        assert sum(end.values()) == len(sent)
        consumer.close()

        # A new member of the same group resumes from the committed offsets: nothing is redelivered.
        again = KafkaConsumer(topic, bootstrap_servers=kafka_bootstrap, group_id=group,
                              auto_offset_reset="earliest", enable_auto_commit=False)
        assert consume(again, 1, seconds=8) == []
        again.close()
    finally:
        admin.delete_topics([topic])
        admin.close()


def test_redis_pipeline_round_trip_and_transaction(redis_url):
    client = redis.Redis.from_url(redis_url)
    assert client.ping()
    tag = f"{{smoke-{uuid.uuid4().hex[:8]}}}"  # one hash tag: one slot, as the live service uses
    with client.pipeline(transaction=True) as pipe:
        pipe.hset(f"{tag}:query:q1", mapping={"ranker": "bm25", "n": 3})
        pipe.hincrbyfloat(f"{tag}:agg", "ndcg_sum", 0.75)
        pipe.hincrbyfloat(f"{tag}:agg", "ndcg_sum", 0.25)
        pipe.set(f"{tag}:offsets", "17")
        pipe.expire(f"{tag}:query:q1", 60)
        results = pipe.execute()
    assert results == [2, 0.75, 1.0, True, True]
    with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(f"{tag}:query:q1")
        pipe.hget(f"{tag}:agg", "ndcg_sum")
        pipe.get(f"{tag}:offsets")
        pipe.ttl(f"{tag}:query:q1")
        query, total, offsets, ttl = pipe.execute()
    assert query == {b"ranker": b"bm25", b"n": b"3"}
    assert (float(total), offsets) == (1.0, b"17")
    assert 0 < ttl <= 60
    client.delete(f"{tag}:query:q1", f"{tag}:agg", f"{tag}:offsets")


def test_prometheus_answers_queries_and_promtool_is_installed(prometheus_url):
    with urllib.request.urlopen(f"{prometheus_url}/api/v1/query?query=vector(1)", timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success"
    assert body["data"]["result"][0]["value"][1] == "1"
    good = "# HELP rankmeter_smoke_total Smoke.\n# TYPE rankmeter_smoke_total counter\nrankmeter_smoke_total 1\n"
    bad = "# HELP rankmeter_smoke Smoke.\n# TYPE rankmeter_smoke counter\nrankmeter_smoke 1\n"
    check = lambda text: subprocess.run(["promtool", "check", "metrics"], input=text,
                                        capture_output=True, text=True)
    assert check(good).returncode == 0
    flagged = check(bad)  # counters must end in _total: promtool says so
    assert "_total" in flagged.stdout + flagged.stderr
