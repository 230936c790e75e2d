"""The Kafka adapter on kafka-python, the default `kafka.backend`: one consumer in a group
on both topics, and a producer for the dead-letter topic.

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

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.errors import KafkaConfigurationError, KafkaError, UnknownTopicOrPartitionError
from kafka.structs import OffsetAndMetadata

from rankmeter.config import Kafka as KafkaSettings
from rankmeter.kafka.common import COMMITTED_TIMEOUT_MS, LAG_SETTLE_S, CoordinatorWatch, copartitioned, known
from rankmeter.kafka.producer import DEAD_LETTERS, KafkaPythonProducer, Outbox, Producer
from rankmeter.source import NO_HEADERS, OnAssign, OnRevoke, Record

_new = tuple.__new__
log = logging.getLogger("rankmeter.kafka")

# A rebalance that has given no assignment for the session timeout (a dead member of the
# group must expire first) plus this is started again.
JOIN_WATCHDOG_MARGIN_S = 15.0
# While a rebalance is under way, polls back to back in slices of this, for up to this long.
JOIN_SLICE_MS = 100
JOIN_POLL_S = 1.0


class _Listener(ConsumerRebalanceListener):
    """kafka-python 3 runs these on its IO thread, which also sends the heartbeats: they
    must not block. Revocation only forgets memory; an assignment pauses the partitions
    and leaves claiming them (Redis, the group's committed offsets) to the next poll."""

    def __init__(self, source: KafkaSource, on_revoke: OnRevoke) -> None:
        self.source, self.on_revoke = source, on_revoke

    def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self.source._unclaimed = None
        self.source._joining_since = time.monotonic()
        if revoked:
            self.on_revoke(sorted({tp.partition for tp in revoked}))

    def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        # Called with an empty set too: a member without partitions has still joined.
        self.source.consumer.pause(*assigned)
        self.source._unclaimed = sorted({tp.partition for tp in assigned})
        self.source._joining_since = None


class KafkaSource:
    def __init__(self, settings: KafkaSettings, client_id: str = "rankmeter") -> None:
        unknown = set(settings.client) - set(KafkaConsumer.DEFAULT_CONFIG) - set(KafkaProducer.DEFAULT_CONFIG)
        if unknown:
            raise KafkaConfigurationError(f"kafka.client has settings kafka-python does not know: {sorted(unknown)}")
        self.consumer = KafkaConsumer(
            bootstrap_servers=settings.bootstrap_servers.split(","),
            client_id=client_id,
            group_id=settings.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # Range assignment gives a member the same partition numbers of both
            # co-partitioned topics, so a query's impression and feedback meet here.
            partition_assignment_strategy=[RangePartitionAssignor],
            max_poll_records=settings.max_poll_records,
            **known(settings.client, KafkaConsumer.DEFAULT_CONFIG))
        self.producer: Producer = KafkaPythonProducer(settings, DEAD_LETTERS, client_id)
        self.outbox = Outbox(self.producer)  # dead letters, kept until acknowledged
        self._watch = CoordinatorWatch(settings.bootstrap_servers)
        self._unclaimed: list[int] | None = None  # assigned, paused, not yet claimed
        self._joining_since: float | None = None   # revoked (or subscribed), no assignment since
        self._join_watchdog_s = self.consumer.config["session_timeout_ms"] / 1000 + JOIN_WATCHDOG_MARGIN_S
        self._positions: dict[tuple[str, int], int] = {}  # next offset to read, for lag()
        self._seeked_at: dict[tuple[str, int], float] = {}

    def check_topics(self, topics: Sequence[str], wait_s: float = 15.0) -> int:
        return copartitioned(topics, lambda topic: len(self.consumer.partitions_for_topic(topic) or ()), wait_s)

    def subscribe(self, topics: Sequence[str], on_assign: OnAssign, on_revoke: OnRevoke) -> None:
        self._on_assign = on_assign
        self._joining_since = time.monotonic()
        self._subscription = (list(topics), _Listener(self, on_revoke))
        self.consumer.subscribe(self._subscription[0], listener=self._subscription[1])

    def assigned(self) -> list[int]:
        # kafka-python's assignment() keeps the revoked partitions until the next join
        # completes: between a revoke and an assignment this member holds nothing (a claim
        # of them then could fence the member that owns them now; review s11 M6).
        if self._joining_since is not None:
            return []
        return sorted({tp.partition for tp in self.consumer.assignment()})

    def seek(self, offsets: dict[tuple[str, int], int]) -> None:
        refused = []
        for tp in self.consumer.assignment():
            offset = offsets.get((tp.topic, tp.partition))
            if offset is None:
                refused.append(tp)
            else:
                self.consumer.seek(tp, offset)
                self._positions[(tp.topic, tp.partition)] = offset
                self._seeked_at[(tp.topic, tp.partition)] = time.monotonic()
        self.consumer.resume(*[tp for tp in self.consumer.assignment() if tp not in refused])
        if refused:
            self.consumer.pause(*refused)

    def committed(self, partitions: list[int]) -> dict[tuple[str, int], int]:
        found = {}
        for topic in self._subscription[0]:
            for p in partitions:
                # Bounded: with the broker away this raises (retriable), and the claim is tried again.
                offset = self.consumer.committed(TopicPartition(topic, p), timeout_ms=COMMITTED_TIMEOUT_MS)
                if offset is not None:
                    found[(topic, p)] = offset
        return found

    def bounds(self, partitions: list[int]) -> dict[tuple[str, int], tuple[int, int]]:
        wanted = [TopicPartition(t, p) for t in self._subscription[0] for p in partitions]
        if not wanted:
            return {}
        try:
            starts = self.consumer.beginning_offsets(wanted, timeout_ms=COMMITTED_TIMEOUT_MS)
            ends = self.consumer.end_offsets(wanted, timeout_ms=COMMITTED_TIMEOUT_MS)
        except KeyError as e:  # kafka-python 3.0's answer for a topic it has no metadata of (deleted)
            raise UnknownTopicOrPartitionError(f"no metadata for {e}") from None
        return {(tp.topic, tp.partition): (starts[tp], ends[tp]) for tp in wanted if tp in starts and tp in ends}

    def pause(self, partitions: list[int]) -> None:
        self.consumer.pause(*[tp for tp in self.consumer.assignment() if tp.partition in partitions])

    def rejoin(self) -> None:
        # Leaving makes the coordinator rebalance now; the next poll joins again and the
        # listener claims whatever this member is given, from the stored state.
        self.consumer.unsubscribe()
        self.consumer.subscribe(self._subscription[0], listener=self._subscription[1])
        self._unclaimed, self._joining_since = None, time.monotonic()

    def poll(self, timeout_ms: int, max_records: int) -> list[Record]:
        try:
            batches = self._poll(timeout_ms, max_records)
            if self._joining_since is not None and time.monotonic() - self._joining_since > self._join_watchdog_s:
                # kafka-python 3.0 can stay in a rebalance that never completes (seen after a
                # broker restart, and when a member that left was already expelled): leaving
                # the group and joining afresh lets the coordinator drop the stale member.
                log.warning("no partition assignment for a while; rejoining the group",
                            extra={"waited_s": round(time.monotonic() - self._joining_since)})
                self.rejoin()
            elif self._joining_since is not None:
                self._keep_join()
            if self._unclaimed is not None:
                # Partitions assigned during this poll: claimed now, off the IO thread, then
                # resumed at the stored offsets. Whatever this poll read of them is dropped
                # (the seek reads it again).
                claimed = self._unclaimed
                self.seek(self._on_assign(claimed))  # raising (the broker away): tried again next poll
                self._unclaimed = None
                batches = {tp: records for tp, records in batches.items() if tp.partition not in claimed}
        except KafkaError as e:
            if not e.retriable:
                raise
            # The broker went away under this poll (a connection error escapes the coordinator
            # lookup): the client reconnects by itself and problem() reports it. A poll's
            # worth of waiting, so that the loop does not spin.
            log.debug("poll failed; the client reconnects", extra={"error": type(e).__name__})
            time.sleep(timeout_ms / 1000)
            return []
        records = []
        for tp, batch in batches.items():  # each batch in offset order: its last record says where it is
            # ConsumerRecord has Record's fields, others between them: made Records, which
            # rankmeter._events reads by index (tuple.__new__: NamedTuple's __new__ is Python).
            records += [_new(Record, (r.topic, r.partition, r.offset, r.key, r.value, r.headers or NO_HEADERS,
                                      r.timestamp)) for r in batch]
            if batch:
                self._positions[(tp.topic, tp.partition)] = batch[-1].offset + 1
        return records

    def _poll(self, timeout_ms: int, max_records: int) -> dict:
        if self._joining_since is None:
            return self.consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        # Joining: kafka-python 3.0.12 collects a JoinGroup/SyncGroup only while a poll
        # waits for it, and throws away one that finished between two polls (a new join, or
        # none at all: `_keep_join`). Polled back to back until the assignment,
        # up to JOIN_POLL_S: nothing is held meanwhile, so the loop has nothing else to do.
        deadline = time.monotonic() + max(timeout_ms / 1000, JOIN_POLL_S)
        while True:
            batches = self.consumer.poll(timeout_ms=JOIN_SLICE_MS, max_records=max_records)
            if batches or self._joining_since is None or time.monotonic() >= deadline:
                return batches
            self._keep_join()

    def _keep_join(self) -> None:
        # kafka-python 3.0.12: a poll that times out during a JoinGroup/SyncGroup leaves the
        # join to the next poll, which awaits it only while a rejoin is still "needed". A
        # rebalance started by a metadata change (a topic deleted, created, or first seen at
        # start) is needed only until the leader's assignment matches the new metadata, which
        # the join itself does: the join is never collected, the listener never told, nothing
        # fetched, until the watchdog above. Marking the rejoin needed while the join is in
        # flight makes the next poll await it; once it has finished uncollected, the mark
        # starts another join (the group rebalances once more; `_poll` makes this rare).
        coordinator = self.consumer._coordinator
        task = getattr(coordinator, "_join_task", None)
        if task is None or coordinator.need_rejoin():
            return
        if task.is_done:
            log.info("kafka-python dropped the result of a rebalance; joining again")
        coordinator.request_rejoin()

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
        self.outbox.send(topic, key, value, headers)

    def delivered(self, timeout_s: float) -> bool:
        return self.outbox.delivered(timeout_s)

    def problem(self) -> str:
        return self._watch.problem(self._coordinator_known())

    def _coordinator_known(self) -> bool:
        # kafka-python 3.0 has no public "connected" API (bootstrap_connected() only covers
        # the bootstrap phase; metrics() counts connections still being attempted). The
        # group coordinator's own check is cheap and local: it forgets the coordinator once
        # that node's connection is down and waiting out its reconnect backoff, and learns it
        # again only from a broker's answer.
        return not self.consumer._coordinator.coordinator_unknown()

    def lag(self) -> dict[tuple[str, int], int]:
        # From the high watermark the last fetch saw and the position this source tracks:
        # consumer.position() may block on the network (after a seek, or with the broker away).
        # Just after a seek the high watermark may be one seen before it (before an outage):
        # such a partition's lag is unknown until fetches have had time to renew it.
        lags: dict[tuple[str, int], int] = {}
        now = time.monotonic()
        held = set(self.assigned())  # (not kafka-python's assignment(): revoked ones too while joining)
        for tp in self.consumer.assignment():
            if tp.partition not in held:
                continue
            key = (tp.topic, tp.partition)
            high, position = self.consumer.highwater(tp), self._positions.get(key)
            if now - self._seeked_at.get(key, 0.0) < LAG_SETTLE_S:
                continue
            if high is not None and position is not None:
                lags[(tp.topic, tp.partition)] = max(high - position, 0)
        return lags

    def close(self) -> None:
        self.producer.close(timeout_s=10)
        self.consumer.close(autocommit=False)
