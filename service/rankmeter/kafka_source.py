"""The Kafka adapter (kafka-python): one consumer in a group on both topics, and a
producer for the dead-letter topic.

Offsets are resumed from the store, not from Kafka: the store keeps them atomically
with the state they produced. Kafka's committed offsets are still written after each
batch, so the usual lag tooling works.

While the broker is away the client reconnects by itself: polls return nothing, commits
fail (harmless: offsets resume from the store), the dead-letter producer buffers, and
`problem()` says so once the group coordinator has been out of reach for a few seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaConfigurationError, KafkaError, KafkaTimeoutError, TopicAlreadyExistsError
from kafka.structs import OffsetAndMetadata

from rankmeter.config import Kafka as KafkaSettings
from rankmeter.source import OnAssign, OnRevoke, Record, SourceUnavailable

log = logging.getLogger("rankmeter.kafka")

# The coordinator is looked up again after any disconnection (a rebalance, a broker's
# restart): only this long without one counts as the broker being away.
COORDINATOR_GRACE_S = 5.0
# How long a dead-letter send may block (producer buffer full, topic metadata unknown)
# before the caller is told to retry; kafka-python's default, 60 s, would starve /healthz.
PRODUCE_BLOCK_MS = 5000


class TopicMismatch(Exception):
    """The two topics are missing or not co-partitioned."""


class _Listener(ConsumerRebalanceListener):
    def __init__(self, source: KafkaSource, on_assign: OnAssign, on_revoke: OnRevoke) -> None:
        self.source, self.on_assign, self.on_revoke = source, on_assign, on_revoke

    def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        if revoked:
            self.on_revoke(sorted({tp.partition for tp in revoked}))

    def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        # Called with an empty set too: a member without partitions has still joined.
        self.source.seek(self.on_assign(sorted({tp.partition for tp in assigned})))


class KafkaSource:
    def __init__(self, settings: KafkaSettings, client_id: str = "rankmeter") -> None:
        unknown = set(settings.client) - set(KafkaConsumer.DEFAULT_CONFIG) - set(KafkaProducer.DEFAULT_CONFIG)
        if unknown:
            raise KafkaConfigurationError(f"kafka.client has settings kafka-python does not know: {sorted(unknown)}")
        common: dict[str, Any] = {"bootstrap_servers": settings.bootstrap_servers.split(","), "client_id": client_id}
        # Each client takes the settings it knows: security for both, session ones for the consumer.
        only = lambda defaults: {k: v for k, v in settings.client.items() if k in defaults}
        self.consumer = KafkaConsumer(
            group_id=settings.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # Range assignment gives a member the same partition numbers of both
            # co-partitioned topics, so a query's impression and feedback meet here.
            partition_assignment_strategy=[RangePartitionAssignor],
            max_poll_records=settings.max_poll_records,
            **common, **only(KafkaConsumer.DEFAULT_CONFIG))
        self.producer = KafkaProducer(**{"acks": "all", "linger_ms": 20, "max_block_ms": PRODUCE_BLOCK_MS,
                                         **common, **only(KafkaProducer.DEFAULT_CONFIG)})
        self._bootstrap = settings.bootstrap_servers
        self._no_coordinator_since: float | None = None
        # The group's committed offsets are read while the consumer's rebalance callback
        # runs on its IO thread, where the consumer itself cannot block: a second client,
        # which never joins the group, asks for them.
        self._offsets = KafkaConsumer(group_id=settings.group_id, enable_auto_commit=False,
                                      **common, **only(KafkaConsumer.DEFAULT_CONFIG))

    def check_topics(self, topics: Sequence[str], wait_s: float = 15.0) -> int:
        """Both topics exist with the same partition count (brief §2); returns it. Waits a
        little for topics that were just created: their metadata takes a moment to spread."""
        counts = {}
        for topic in topics:
            deadline = time.monotonic() + wait_s
            partitions = self.consumer.partitions_for_topic(topic)
            while not partitions and time.monotonic() < deadline:
                time.sleep(0.2)
                partitions = self.consumer.partitions_for_topic(topic)
            if not partitions:
                raise TopicMismatch(f"topic {topic!r} does not exist (create it with as many "
                                    f"partitions as the other one)")
            counts[topic] = len(partitions)
        if len(set(counts.values())) != 1:
            raise TopicMismatch("topics are not co-partitioned: "
                                + ", ".join(f"{t} has {n}" for t, n in counts.items()))
        return next(iter(counts.values()))

    def subscribe(self, topics: Sequence[str], on_assign: OnAssign, on_revoke: OnRevoke) -> None:
        self._subscription = (list(topics), _Listener(self, on_assign, on_revoke))
        self.consumer.subscribe(self._subscription[0], listener=self._subscription[1])

    def assigned(self) -> list[int]:
        return sorted({tp.partition for tp in self.consumer.assignment()})

    def seek(self, offsets: dict[tuple[str, int], int]) -> None:
        refused = []
        for tp in self.consumer.assignment():
            offset = offsets.get((tp.topic, tp.partition))
            if offset is None:
                refused.append(tp)
            else:
                self.consumer.seek(tp, offset)
        self.consumer.resume(*[tp for tp in self.consumer.assignment() if tp not in refused])
        if refused:
            self.consumer.pause(*refused)

    def committed(self, partitions: list[int]) -> dict[tuple[str, int], int]:
        found = {}
        for topic in self._subscription[0]:
            for p in partitions:
                offset = self._offsets.committed(TopicPartition(topic, p))
                if offset is not None:
                    found[(topic, p)] = offset
        return found

    def pause(self, partitions: list[int]) -> None:
        self.consumer.pause(*[tp for tp in self.consumer.assignment() if tp.partition in partitions])

    def rejoin(self) -> None:
        # Leaving makes the coordinator rebalance now; the next poll joins again and the
        # listener claims whatever this member is given, from the stored state.
        self.consumer.unsubscribe()
        self.consumer.subscribe(self._subscription[0], listener=self._subscription[1])

    def poll(self, timeout_ms: int, max_records: int) -> list[Record]:
        # kafka-python's ConsumerRecord has Record's fields: passed on as it is.
        try:
            batches = self.consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        except KafkaError as e:
            if not e.retriable:
                raise
            # The broker went away under this poll (a connection error escapes the coordinator
            # lookup): the client reconnects by itself and problem() reports it. A poll's
            # worth of waiting, so that the loop does not spin.
            log.debug("poll failed; the client reconnects", extra={"error": type(e).__name__})
            time.sleep(timeout_ms / 1000)
            return []
        return [r for records in batches.values() for r in records]

    def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        if not offsets:
            return
        try:
            self.consumer.commit_async({TopicPartition(t, p): OffsetAndMetadata(o, "", -1)
                                        for (t, p), o in offsets.items()})
        except KafkaError as e:
            # For lag tooling only: the next batch's commit carries these offsets too.
            log.debug("commit to Kafka failed", extra={"error": type(e).__name__})

    def produce(self, topic: str, key: bytes | None, value: bytes | None,
                headers: list[tuple[str, bytes]]) -> None:
        try:
            self.producer.send(topic, key=key, value=value, headers=headers)
        except KafkaTimeoutError as e:  # buffer full, or no metadata for the topic, for max_block_ms
            raise SourceUnavailable(f"cannot produce to {topic!r}: {e}") from None

    def problem(self) -> str:
        if self._coordinator_known():
            self._no_coordinator_since = None
            return ""
        now = time.monotonic()
        if self._no_coordinator_since is None:
            self._no_coordinator_since = now
        away = now - self._no_coordinator_since
        if away < COORDINATOR_GRACE_S:
            return ""
        return (f"Kafka unavailable: no connection to the group coordinator for {away:.0f} s "
                f"(bootstrap {self._bootstrap}); reconnecting")

    def _coordinator_known(self) -> bool:
        # kafka-python 3.0 has no public "connected" API (bootstrap_connected() only covers
        # the bootstrap phase; metrics() counts connections still being attempted). The
        # group coordinator's own check is cheap and local: it forgets the coordinator once
        # that node's connection is down and waiting out its reconnect backoff, and learns it
        # again only from a broker's answer.
        return not self.consumer._coordinator.coordinator_unknown()

    def lag(self) -> dict[tuple[str, int], int]:
        lags = {}
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            if high is not None:
                lags[(tp.topic, tp.partition)] = max(high - self.consumer.position(tp), 0)
        return lags

    def close(self) -> None:
        self.producer.flush(timeout=10)
        self.producer.close(timeout=10)
        self.consumer.close(autocommit=False)
        self._offsets.close(autocommit=False)


def create_topics(settings: KafkaSettings, partitions: int) -> None:
    """Create the three topics when missing (impressions and feedback co-partitioned)."""
    security = {k: v for k, v in settings.client.items() if k in KafkaAdminClient.DEFAULT_CONFIG}
    admin = KafkaAdminClient(bootstrap_servers=settings.bootstrap_servers.split(","),
                             client_id="rankmeter-admin", **security)
    try:
        existing = set(admin.list_topics())
        k = settings
        missing = [NewTopic(t, num_partitions=partitions, replication_factor=1)
                   for t in (k.impressions_topic, k.feedback_topic, k.dead_letter_topic)
                   if t not in existing]
        if missing:
            try:
                admin.create_topics(missing)
            except TopicAlreadyExistsError:
                pass  # another replica was first
            log.info("topics created", extra={"topics": [t.name for t in missing], "partitions": partitions})
    finally:
        admin.close()
