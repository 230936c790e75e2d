"""The Kafka adapter on confluent-kafka (librdkafka), `kafka.backend: confluent`: the same
source as `kafka_python.KafkaSource`, with fetching in librdkafka's threads, so the next
batch is being read while the pipeline works on this one.

Offsets, as with kafka-python, are resumed from the store: each assignment is claimed in
the rebalance callback (which librdkafka runs on the thread calling `consume()`, so it may
block on Redis) and the partitions start at the stored offsets. Kafka's committed offsets
are written after each batch (one commit in flight at a time), for lag tooling only.

The rebalance protocol is the eager one, with range assignment: a member gets the same
partition numbers of both co-partitioned topics, and every rebalance revokes everything
before assigning, as `serve` (and the pipeline's claim and fencing) expects.

`kafka.client` keeps kafka-python's spelling for both backends: `common.librdkafka_settings`
maps it to librdkafka's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from rankmeter.config import ConfigError
from rankmeter.config import Kafka as KafkaSettings
from rankmeter.kafka.common import (COMMITTED_TIMEOUT_MS, LAG_SETTLE_S, PRODUCE_BLOCK_MS, CoordinatorWatch,
                                    KafkaUnreachable, copartitioned, librdkafka_settings,
                                    librdkafka_text)
from rankmeter.kafka.producer import ConfluentProducer, Outbox, Producer
from rankmeter.source import NO_HEADERS, OnAssign, OnRevoke, Record

log = logging.getLogger("rankmeter.kafka")
librdkafka_log = logging.getLogger("librdkafka")  # the library's own lines, as kafka-python's are "kafka"

# librdkafka reports the group coordinator's state in its statistics, once this often.
STATS_INTERVAL_MS = 1000
BOOTSTRAP_TIMEOUT_MS = 30_000  # kafka-python's default bootstrap_timeout_ms, kept for both backends
COMMIT_ANSWER_S = 65.0  # an offset commit's answer, at the latest (librdkafka's request timeout: 60 s)


class ConfluentSource:
    def __init__(self, settings: KafkaSettings, client_id: str = "rankmeter") -> None:
        consumer_settings, producer_settings = librdkafka_settings(settings.client)
        common = {"bootstrap.servers": settings.bootstrap_servers, "client.id": client_id,
                  "error_cb": self._on_error, "logger": librdkafka_log,
                  "log.connection.close": False}  # brokers close idle connections: not news
        try:
            self.consumer = Consumer({
                **common,
                "group.id": settings.group_id,
                # The store's offsets are the truth; Kafka's commit follows them, explicitly.
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
                # Range, hence eager: the same partition numbers of both topics (co-partitioned),
                # and revoke-everything-then-assign rebalances, as the pipeline's claims expect.
                "partition.assignment.strategy": "range",
                "statistics.interval.ms": STATS_INTERVAL_MS,
                "stats_cb": self._on_stats,
                "on_commit": self._on_commit,
                **consumer_settings})
            self.producer: Producer = ConfluentProducer(
                common, producer_settings, int(settings.client.get("max_block_ms", PRODUCE_BLOCK_MS)) / 1000)
            self.outbox = Outbox(self.producer)  # dead letters, kept until acknowledged
        except KafkaException as e:  # a setting librdkafka refuses (a name, or a value)
            raise ConfigError(f"invalid configuration: kafka.client: {librdkafka_text(e)}") from None
        self._bootstrap_timeout_s = int(settings.client.get("bootstrap_timeout_ms", BOOTSTRAP_TIMEOUT_MS)) / 1000
        self._topics: list[str] = []
        self._on_assign: OnAssign = lambda partitions: {}
        self._on_revoke: OnRevoke = lambda partitions: None
        # (topic, partition) consumed now: assigned, claimed, not paused. Records of any other
        # partition that a batch still holds (revoked or paused during it) are dropped.
        self._live: set[tuple[str, int]] = set()
        self._assignment: list[TopicPartition] = []
        self._unclaimed: list[int] | None = None  # assigned, paused: the claim failed, retried
        # The offset each live partition was (re)started at: a record below it was read before.
        self._floors: dict[tuple[str, int], int] = {}
        self._seeked_at: dict[tuple[str, int], float] = {}
        # A rebalance, seek or pause since the last batch was handed out: the next one is
        # checked record by record (else every record is of a live partition, in order).
        self._changed = False
        self._coordinator_up = False
        self._watch = CoordinatorWatch(settings.bootstrap_servers)
        self._commits = OneCommitInFlight(self.consumer)

    # ---- librdkafka's callbacks (all run on the thread calling consume/poll/list_topics)

    def _on_error(self, error: KafkaError) -> None:
        # Connection errors repeat at the reconnect backoff while the broker is away; problem()
        # reports the outage once. Refused credentials and fatal errors are worth a line.
        if error.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE):
            log.debug("Kafka connection error; the client reconnects", extra={"error": error.str()})
        else:
            log.warning("Kafka client error", extra={"error": error.str(), "fatal": error.fatal()})

    def _on_commit(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        self._commits.answered(error)

    def _on_stats(self, stats: str) -> None:
        # The group coordinator's state, as kafka_python.py reads kafka-python's: "up" once a
        # broker has answered as the coordinator and its connection holds.
        self._coordinator_up = json.loads(stats).get("cgrp", {}).get("state") == "up"

    def _assigned_cb(self, consumer: Consumer, assignment: list[TopicPartition]) -> None:
        # Called with an empty list too: a member without partitions has still joined.
        self._changed = True
        self._assignment = list(assignment)
        self._live = set()
        partitions = sorted({tp.partition for tp in assignment})
        try:
            offsets = self._on_assign(partitions)
        except KafkaException as e:  # the committed offsets (broker away): claimed again at the next poll
            log.debug("claiming the assigned partitions failed; retrying", extra={"error": librdkafka_text(e)})
            consumer.assign(assignment)
            consumer.pause(assignment)
            self._unclaimed = partitions
            return
        self._unclaimed = None
        # Assigned at the stored offsets directly (no fetch from Kafka's committed ones first);
        # the partitions the claim refused are assigned paused.
        chosen = [TopicPartition(tp.topic, tp.partition, offsets[(tp.topic, tp.partition)])
                  for tp in assignment if (tp.topic, tp.partition) in offsets]
        refused = [tp for tp in assignment if (tp.topic, tp.partition) not in offsets]
        consumer.assign(chosen + refused)
        # A partition's pause outlives assign() (one refused earlier, given back now).
        if chosen:
            consumer.resume(chosen)
        if refused:
            consumer.pause(refused)
        self._started(offsets)

    def _revoked_cb(self, consumer: Consumer, revoked: list[TopicPartition]) -> None:
        # Eager protocol: everything goes. Also called for partitions lost (the session expired,
        # or this member stalled past max.poll.interval.ms): the store's fencing refuses
        # whatever the pipeline still writes for them.
        self._changed = True
        self._live = set()
        self._assignment = []
        self._unclaimed = None
        if revoked:
            self._on_revoke(sorted({tp.partition for tp in revoked}))
        self._commits.flush()  # the partitions' last offsets, while they are still ours

    # ---- the source

    def check_topics(self, topics: Sequence[str], wait_s: float = 15.0) -> int:
        return copartitioned(topics, self._partitions_for, wait_s)

    def _partitions_for(self, topic: str) -> int:
        try:
            metadata = self.consumer.list_topics(topic, timeout=self._bootstrap_timeout_s)
        except KafkaException as e:
            # librdkafka reports refused credentials and an unreachable broker alike here.
            raise KafkaUnreachable(librdkafka_text(e)) from None
        found = metadata.topics.get(topic)
        return 0 if found is None or found.error is not None else len(found.partitions)

    def subscribe(self, topics: Sequence[str], on_assign: OnAssign, on_revoke: OnRevoke) -> None:
        self._topics, self._on_assign, self._on_revoke = list(topics), on_assign, on_revoke
        self.consumer.subscribe(self._topics, on_assign=self._assigned_cb, on_revoke=self._revoked_cb,
                                on_lost=self._revoked_cb)

    def assigned(self) -> list[int]:
        return sorted({tp.partition for tp in self._assignment})

    def seek(self, offsets: dict[tuple[str, int], int]) -> None:
        """Resume from these offsets; assigned partitions not named are paused."""
        chosen = [TopicPartition(tp.topic, tp.partition, offsets[(tp.topic, tp.partition)])
                  for tp in self._assignment if (tp.topic, tp.partition) in offsets]
        # All paused first: a paused partition's fetched records are dropped by librdkafka, so
        # nothing read before the seek is handed out after it; the refused ones stay paused.
        self.consumer.pause(self._assignment)
        for tp in chosen:
            self.consumer.seek(tp)
        if chosen:
            self.consumer.resume(chosen)
        self._started(offsets)

    def _started(self, offsets: dict[tuple[str, int], int]) -> None:
        now = time.monotonic()
        self._changed = True
        self._live = {(tp.topic, tp.partition) for tp in self._assignment if (tp.topic, tp.partition) in offsets}
        self._floors = {key: offsets[key] for key in self._live}
        for key in self._live:
            self._seeked_at[key] = now

    def committed(self, partitions: list[int]) -> dict[tuple[str, int], int]:
        return _committed(self.consumer, self._topics, partitions)

    def bounds(self, partitions: list[int]) -> dict[tuple[str, int], tuple[int, int]]:
        return _bounds(self.consumer, self._topics, partitions)

    def pause(self, partitions: list[int]) -> None:
        chosen = [tp for tp in self._assignment if tp.partition in partitions]
        self.consumer.pause(chosen)
        self._changed = True
        self._live -= {(tp.topic, tp.partition) for tp in chosen}

    def rejoin(self) -> None:
        # Leaving makes the coordinator rebalance now; the next consume joins again and the
        # assignment callback claims whatever this member is given, from the stored state.
        self._live, self._assignment, self._unclaimed, self._changed = set(), [], None, True
        self.consumer.unsubscribe()
        self.consumer.subscribe(self._topics, on_assign=self._assigned_cb, on_revoke=self._revoked_cb,
                                on_lost=self._revoked_cb)

    def poll(self, timeout_ms: int, max_records: int) -> list[Record]:
        try:
            # What librdkafka has fetched already, without waiting; else wait for one record
            # (consume() would wait out its whole timeout for a partial batch) and take the rest.
            messages = self.consumer.consume(max_records, 0)
            if not messages:
                first = self.consumer.poll(timeout_ms / 1000)
                if first is not None:
                    messages = [first, *self.consumer.consume(max_records - 1, 0)] if max_records > 1 else [first]
            if self._unclaimed is not None:
                claimed = self._unclaimed
                self.seek(self._on_assign(claimed))  # raising (the broker away): tried again next poll
                self._unclaimed = None
        except KafkaException as e:
            if e.args and isinstance(e.args[0], KafkaError) and e.args[0].fatal():
                raise
            log.debug("poll failed; the client reconnects", extra={"error": librdkafka_text(e)})
            return []
        records = self._checked(messages) if self._changed else _records(messages)
        self._changed = False
        if len(records) < len(messages):
            _log_errors(messages)
        return records

    def _checked(self, messages: list[Message]) -> list[Record]:
        # Only partitions consumed now, from where they were (re)started: one consume() may
        # hold records fetched before a rebalance or pause it served, of partitions since
        # revoked or paused (dropped), or re-assigned at a stored offset (those below it dropped;
        # Kafka's log being immutable, the rest are the records the new claim reads next, once).
        live, next_offset = self._live, dict(self._floors)
        records = []
        for m in messages:
            key = (m.topic(), m.partition())
            if m.error() is not None or key not in live or m.offset() < next_offset[key]:
                continue
            records.append(_record(m))
            next_offset[key] = m.offset() + 1
        return records

    def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        self._commits.give(offsets)

    def produce(self, topic: str, key: bytes | None, value: bytes | None,
                headers: list[tuple[str, bytes]]) -> None:
        self.outbox.send(topic, key, value, headers)

    def delivered(self, timeout_s: float) -> bool:
        return self.outbox.delivered(timeout_s)

    def problem(self) -> str:
        return self._watch.problem(self._coordinator_up)

    def lag(self) -> dict[tuple[str, int], int]:
        # From the high watermark of librdkafka's last fetch and the position it has handed
        # out (both kept locally: no network), of the partitions consumed now. Unknown just
        # after a seek, as in kafka_python.
        now = time.monotonic()
        settled = [TopicPartition(t, p) for t, p in self._live
                   if now - self._seeked_at.get((t, p), 0.0) >= LAG_SETTLE_S]
        if not settled:
            return {}
        lags = {}
        try:
            positions = self.consumer.position(settled)
        except KafkaException:
            return {}
        for tp in positions:
            key = (tp.topic, tp.partition)
            # No record handed out since the partition (re)started: it is where it started.
            position = tp.offset if tp.offset >= 0 else self._floors.get(key)
            try:
                _, high = self.consumer.get_watermark_offsets(tp, cached=True)
            except KafkaException:
                continue
            if high >= 0 and position is not None:
                lags[key] = max(high - position, 0)
        return lags

    def close(self) -> None:
        self.producer.close(timeout_s=10)
        self._commits.flush()
        self.consumer.close()  # runs the revocation callback: the pipeline lets go of its partitions


class OneCommitInFlight:
    """Offsets committed to the broker one commit at a time, those given meanwhile sent with
    the next. Caught up, a batch may be one record: a commit per batch (hundreds a second)
    queues the heartbeats behind them on the coordinator's connection until the session
    times out (seen on a loaded machine: a 14 s rebalance at 5,000 events/s)."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.unanswered = 0  # (a flush may send one while another is out)
        self.sent_at = 0.0
        self.waiting: dict[tuple[str, int], int] = {}

    def give(self, offsets: dict[tuple[str, int], int]) -> None:
        self.waiting.update(offsets)
        # (Commits whose answers never came, past librdkafka's own request timeout: not waited for.)
        if self.unanswered and time.monotonic() - self.sent_at > COMMIT_ANSWER_S:
            self.unanswered = 0
        if not self.unanswered:
            self._send()

    def answered(self, error: KafkaError | None) -> None:
        """librdkafka's commit callback (on the polling thread)."""
        self.unanswered = max(self.unanswered - 1, 0)
        if error is not None:
            log.debug("commit to Kafka failed", extra={"error": error.str()})
        if not self.unanswered:
            self._send()

    def flush(self) -> None:
        """What waits, sent now without waiting for an answer (never blocking: the broker may be away)."""
        self._send()

    def _send(self) -> None:
        if not self.waiting:
            return
        offsets, self.waiting = self.waiting, {}
        try:
            self.consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                 asynchronous=True)
            self.unanswered += 1
            self.sent_at = time.monotonic()
        except KafkaException as e:
            # For lag tooling only: the next batch's commit carries these offsets too.
            log.debug("commit to Kafka failed", extra={"error": librdkafka_text(e)})


_new = tuple.__new__


def _record(m: Message) -> Record:
    return _new(Record, (m.topic(), m.partition(), m.offset(), m.key(), m.value(), m.headers() or NO_HEADERS,
                         m.timestamp()[1]))


def _records(messages: list[Message]) -> list[Record]:
    # The hot path, a few method calls a record: tuple.__new__ skips NamedTuple's Python-level
    # __new__ (measured: 15% of the conversion).
    return [_new(Record, (m.topic(), m.partition(), m.offset(), m.key(), m.value(), m.headers() or NO_HEADERS,
                          m.timestamp()[1])) for m in messages if m.error() is None]


def _committed(consumer: Consumer, topics: list[str], partitions: list[int]) -> dict[tuple[str, int], int]:
    wanted = [TopicPartition(t, p) for t in topics for p in partitions]
    if not wanted:
        return {}
    # Bounded: with the broker away this raises, and the claim is tried again.
    found = consumer.committed(wanted, timeout=COMMITTED_TIMEOUT_MS / 1000)
    return {(tp.topic, tp.partition): tp.offset for tp in found if tp.offset >= 0 and tp.error is None}


def _bounds(consumer: Consumer, topics: list[str], partitions: list[int]) -> dict[tuple[str, int], tuple[int, int]]:
    found = {}
    for t in topics:
        for p in partitions:
            # From the broker, not librdkafka's cache: the log may have been deleted or recreated since.
            start, end = consumer.get_watermark_offsets(TopicPartition(t, p), timeout=COMMITTED_TIMEOUT_MS / 1000,
                                                        cached=False)
            if start >= 0 and end >= 0:
                found[(t, p)] = (start, end)
    return found


def _log_errors(messages: list[Message]) -> None:
    for m in messages:
        error = m.error()
        if error is not None and error.code() != KafkaError._PARTITION_EOF:
            log.warning("Kafka consumer error", extra={"error": error.str()})
