"""The kafka-python backend's source on the real broker, below `serve`: a rebalance whose
JoinGroup/SyncGroup outlasts a poll still ends in an assignment. kafka-python 3.0.12 drops
the result of such a join when a metadata change started it (the topics first seen at
start, a topic deleted and created again), and the member then holds nothing until the
join watchdog, 25 s later at the default session timeout. Polls of 1 ms make every join
outlast its poll; on a loaded machine a 100 ms poll did (CI: a recreated topic never
refused within 60 s)."""

from __future__ import annotations

import time
import uuid

import pytest

from rankmeter import config
from rankmeter.kafka.kafka_python import KafkaSource
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import TopicAlreadyExistsError
from serving import unique_topics, wait_until

pytestmark = pytest.mark.integration

# Well inside the watchdog (session timeout 10 s + 15 s): only the fix can pass in time.
ASSIGNED_WITHIN_S = 12.0


def test_a_join_outlasting_its_poll_still_assigns_at_start_and_after_a_topic_is_recreated(kafka_bootstrap):
    topics = unique_topics(kafka_bootstrap, partitions=4)
    names = [topics.impressions, topics.feedback]
    settings = config.load(None, {"RANKMETER_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
                                  "RANKMETER_KAFKA_GROUP_ID": f"g-{uuid.uuid4().hex[:6]}",
                                  "RANKMETER_KAFKA_BACKEND": "kafka-python"}).kafka
    source = KafkaSource(settings)
    claims: list[list[int]] = []
    revokes: list[list[int]] = []

    def claim(partitions: list[int]) -> dict[tuple[str, int], int]:
        claims.append(partitions)
        return {(t, p): 0 for t in names for p in partitions}

    def polled_until(condition, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            source.poll(1, 100)
            if condition():
                return True
        return False

    def assigned_both() -> bool:
        return bool(claims) and {tp.topic for tp in source.consumer.assignment()} == set(names)

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        source.subscribe(names, claim, revokes.append)
        assert polled_until(assigned_both, ASSIGNED_WITHIN_S), "no assignment of both topics at start"
        claims.clear()
        admin.delete_topics([topics.impressions])
        # The member must see the deletion (a rebalance) before the topic is back: a topic
        # recreated between two metadata refreshes changes no assignment (serve finds it by
        # its offsets, test_lost_writes_serve).
        assert polled_until(lambda: bool(revokes) and topics.impressions not in admin.list_topics(), 30)
        wait_until(lambda: _created(admin, topics.impressions), 30, "the topic to be created again")
        assert polled_until(assigned_both, ASSIGNED_WITHIN_S), "no assignment of both topics after the recreation"
        assert sorted(claims[-1]) == [0, 1, 2, 3]
    finally:
        admin.close()
        source.consumer.close()


def _created(admin: KafkaAdminClient, topic: str) -> bool:
    try:
        admin.create_topics([NewTopic(topic, num_partitions=4, replication_factor=1)])
        return True
    except TopicAlreadyExistsError:  # the deletion still under way
        return False
