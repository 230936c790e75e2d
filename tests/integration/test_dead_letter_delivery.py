"""Dead letters at least once, on the real broker and Redis (issue 19, item 5): a SIGKILL
right after invalid records were consumed loses none of their dead letters, and a dead
letter over the size limit arrives cut, with a header saying so, instead of being lost."""

from __future__ import annotations

import signal
import time
import uuid

import pytest
import redis
from kafka import KafkaConsumer
from kafka.admin import KafkaAdminClient, NewTopic

from rankmeter import config
from rankmeter.events import Decoder
from serving import Serve, Topics, produce, unique_topics, wait_until

pytestmark = pytest.mark.integration

DECODER = Decoder(config.load(None, {}))
# The dead-letter producer holds what it buffers for 30 s: without a flush before the
# checkpoint, the batch's offsets are stored long before its dead letters are sent.
SLOW_PRODUCER = {"RANKMETER_KAFKA_CLIENT": "linger_ms=30000,session_timeout_ms=6000,heartbeat_interval_ms=1000"}


def dead_letters(bootstrap: str, topic: str, at_least: int, seconds: float = 30) -> list:
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None,
                             enable_auto_commit=False, fetch_max_bytes=4 * 1024 * 1024)
    found: list = []
    deadline = time.monotonic() + seconds
    try:
        while len(found) < at_least and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                found += batch
    finally:
        consumer.close()
    return found


def stored_offsets(client: redis.Redis, prefix: str, topic: str, partitions: int = 4) -> int:
    return sum(int(client.hget(f"{prefix}:{{{prefix}:{p}}}:offsets", topic) or 0) for p in range(partitions))


def headers_of(message) -> dict[str, bytes]:
    return dict(message.headers or [])


def test_dead_letters_survive_a_sigkill_right_after_their_records_were_consumed(kafka_bootstrap, redis_url,
                                                                                kafka_backend, tmp_path):
    topics = unique_topics(kafka_bootstrap)
    now_ms = int(time.time() * 1000)
    invalid = [(f"bad{i}", f"{{broken {i}".encode()) for i in range(40)]
    valid = [(f"q{i}", {"query_id": f"q{i}", "ranker": "a", "timestamp": now_ms, "results": ["x", "y"]})
             for i in range(40)]
    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    env = {**kafka_backend, **SLOW_PRODUCER}
    client = redis.Redis.from_url(redis_url)
    serve = Serve(kafka_bootstrap, redis_url, topics, group, prefix, env, log_path=tmp_path / "serve.log").start()
    try:
        produce(kafka_bootstrap, topics.impressions, [m for pair in zip(invalid, valid) for m in pair])
        # Every record consumed and its checkpoint stored: killed at once, before the
        # producer's linger would have sent anything it only buffered.
        wait_until(lambda: stored_offsets(client, prefix, topics.impressions) == 80, 60,
                   "serve to store the batch's offsets", interval=0.005)
        serve.stop(signal.SIGKILL)
        restarted = Serve(kafka_bootstrap, redis_url, topics, group, prefix, env,
                          log_path=tmp_path / "serve.log").start()
        try:
            letters = dead_letters(kafka_bootstrap, topics.dead_letter, len(invalid))
        finally:
            restarted.stop()
    finally:
        if serve.process is not None:
            serve.stop()
        client.close()
    by_value = {}
    for m in letters:  # duplicates allowed (at least once), none missing
        h = headers_of(m)
        assert h["rankmeter.source.topic"] == topics.impressions.encode()
        by_value.setdefault(m.value, set()).add(h["rankmeter.reason"].decode())
    assert set(by_value) == {value for _, value in invalid}, f"{len(by_value)} of {len(invalid)} dead letters"
    for value, reasons in by_value.items():
        assert reasons == {DECODER.impression(value, now_ms).reason}


def topics_with_a_dead_letter_limit(bootstrap: str, max_message_bytes: int | None) -> Topics:
    topics = unique_topics()
    limit = {"max.message.bytes": str(max_message_bytes)} if max_message_bytes else {}
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topics.impressions, 4, 1), NewTopic(topics.feedback, 4, 1),
                         NewTopic(topics.dead_letter, 4, 1, topic_configs=limit)])
    admin.close()
    return topics


@pytest.mark.parametrize("value_bytes, topic_limit", [
    # Within the broker's limit as it came (1,048,588 bytes), over the producer's (kafka-python's
    # max_request_size, 1 MiB; librdkafka's message.max.bytes, 1,000,000) with rankmeter's headers.
    (1_048_400, None),
    (100_000, 20_000),  # over the dead-letter topic's max.message.bytes: the broker refuses it
])
def test_a_dead_letter_too_large_to_send_arrives_cut_with_a_header(kafka_bootstrap, redis_url, kafka_backend,
                                                                    tmp_path, value_bytes, topic_limit):
    topics = topics_with_a_dead_letter_limit(kafka_bootstrap, topic_limit)
    value = b"{" + b"x" * (value_bytes - 1)   # not JSON: a dead letter
    now_ms = int(time.time() * 1000)
    ok = {"query_id": "q1", "ranker": "a", "timestamp": now_ms, "results": ["x"]}
    serve = Serve(kafka_bootstrap, redis_url, topics, f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}",
                  kafka_backend, log_path=tmp_path / "serve.log").start()
    try:
        produce(kafka_bootstrap, topics.impressions, [("big", value), ("q1", ok)],
                client={"max_request_size": 2 * 1024 * 1024})
        wait_until(lambda: serve.events().get(("impressions", "applied"), 0) == 1, 60, "serve to go past it")
        letters = dead_letters(kafka_bootstrap, topics.dead_letter, 1)
        assert serve.process.poll() is None
    finally:
        serve.stop()
    assert len(letters) >= 1
    h = headers_of(letters[0])
    assert h["rankmeter.truncated"] == str(value_bytes).encode()
    assert h["rankmeter.reason"].decode() == DECODER.impression(value, now_ms).reason
    assert h["rankmeter.source.topic"] == topics.impressions.encode() and letters[0].key == b"big"
    assert 0 < len(letters[0].value) < min(value_bytes, topic_limit or value_bytes)
    assert value.startswith(letters[0].value)
    assert "Traceback" not in (tmp_path / "serve.log").read_text()

