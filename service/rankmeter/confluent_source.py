"""The Kafka adapter on confluent-kafka (librdkafka), `kafka.backend: confluent`: the same
source as `kafka_source.KafkaSource`, with fetching in librdkafka's threads, so the next
batch is being read while the pipeline works on this one.

Offsets, as with kafka-python, are resumed from the store: each assignment is claimed in
the rebalance callback (which librdkafka runs on the thread calling `consume()`, so it may
block on Redis) and the partitions start at the stored offsets. Kafka's committed offsets
are written after each batch, for lag tooling only.

The rebalance protocol is the eager one, with range assignment: a member gets the same
partition numbers of both co-partitioned topics, and every rebalance revokes everything
before assigning, as `serve` (and the pipeline's claim and fencing) expects.

`kafka.client` keeps kafka-python's spelling for both backends; `CLIENT_SETTINGS` maps
each name to librdkafka's. A name with a dot is librdkafka's own and passed as it is.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from rankmeter.config import ConfigError
from rankmeter.config import Kafka as KafkaSettings
from rankmeter.kafka_source import (COMMITTED_TIMEOUT_MS, CoordinatorWatch, LAG_SETTLE_S, PRODUCE_BLOCK_MS,
                                    KafkaUnreachable, TopicMismatch)
from rankmeter.source import OnAssign, OnRevoke, Record, SourceUnavailable

log = logging.getLogger("rankmeter.kafka")
librdkafka_log = logging.getLogger("librdkafka")  # the library's own lines, as kafka-python's are "kafka"

# librdkafka reports the group coordinator's state in its statistics, once this often.
STATS_INTERVAL_MS = 1000
BOOTSTRAP_TIMEOUT_MS = 30_000  # kafka-python's default bootstrap_timeout_ms, kept for both backends
# Dead-letter messages not delivered after this are dropped (kafka-python's delivery_timeout_ms).
DELIVERY_TIMEOUT_MS = 120_000


def _bool(value: Any) -> str:
    return "true" if value in (True, "true", "True", 1, "1") else "false"


def _hostname_check(value: Any) -> str:
    # kafka-python's ssl_check_hostname (default True) is librdkafka's endpoint identification.
    return "https" if _bool(value) == "true" else "none"


# kafka-python name -> (librdkafka name, which client takes it, value conversion).
# Names mapped to None are this adapter's own (no librdkafka equivalent).
CLIENT_SETTINGS: dict[str, tuple[str | None, str, Callable[[Any], str]]] = {
    # security, both clients
    "security_protocol": ("security.protocol", "both", str),
    "sasl_mechanism": ("sasl.mechanisms", "both", str),
    "sasl_plain_username": ("sasl.username", "both", str),
    "sasl_plain_password": ("sasl.password", "both", str),
    "sasl_kerberos_service_name": ("sasl.kerberos.service.name", "both", str),
    "ssl_cafile": ("ssl.ca.location", "both", str),
    "ssl_certfile": ("ssl.certificate.location", "both", str),
    "ssl_keyfile": ("ssl.key.location", "both", str),
    "ssl_password": ("ssl.key.password", "both", str),
    "ssl_crlfile": ("ssl.crl.location", "both", str),
    "ssl_ciphers": ("ssl.cipher.suites", "both", str),
    "ssl_check_hostname": ("ssl.endpoint.identification.algorithm", "both", _hostname_check),
    # connections, both clients
    "client_id": ("client.id", "both", str),
    "reconnect_backoff_ms": ("reconnect.backoff.ms", "both", str),
    "reconnect_backoff_max_ms": ("reconnect.backoff.max.ms", "both", str),
    "retry_backoff_ms": ("retry.backoff.ms", "both", str),
    "metadata_max_age_ms": ("metadata.max.age.ms", "both", str),
    "connections_max_idle_ms": ("connections.max.idle.ms", "both", str),
    "socket_connection_setup_timeout_ms": ("socket.connection.setup.timeout.ms", "both", str),
    # the consumer's group session and fetching
    "session_timeout_ms": ("session.timeout.ms", "consumer", str),
    "heartbeat_interval_ms": ("heartbeat.interval.ms", "consumer", str),
    "max_poll_interval_ms": ("max.poll.interval.ms", "consumer", str),
    "fetch_min_bytes": ("fetch.min.bytes", "consumer", str),
    "fetch_max_wait_ms": ("fetch.wait.max.ms", "consumer", str),
    "fetch_max_bytes": ("fetch.max.bytes", "consumer", str),
    "max_partition_fetch_bytes": ("max.partition.fetch.bytes", "consumer", str),
    "check_crcs": ("check.crcs", "consumer", _bool),
    # the dead-letter producer
    "acks": ("acks", "producer", str),
    "linger_ms": ("linger.ms", "producer", str),
    "batch_size": ("batch.size", "producer", str),
    "compression_type": ("compression.type", "producer", lambda v: "none" if v is None else str(v)),
    "delivery_timeout_ms": ("message.timeout.ms", "producer", str),
    "request_timeout_ms": ("request.timeout.ms", "producer", str),
    # this adapter's own: how long start-up waits for the broker, and a dead-letter send
    "bootstrap_timeout_ms": (None, "both", str),
    "max_block_ms": (None, "producer", str),
}


def librdkafka_settings(client: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """`kafka.client` (kafka-python's names, or librdkafka's with dots) -> the consumer's and
    the producer's librdkafka settings. A kafka-python name without an equivalent here is
    refused rather than silently dropped: a dropped security setting would fail later, obscurely."""
    unknown = sorted(k for k in client if "." not in k and k not in CLIENT_SETTINGS)
    if unknown:
        raise ConfigError(f"invalid configuration: kafka.client: {', '.join(unknown)} not supported by "
                          f"kafka.backend confluent (use librdkafka's own names, with dots, for other settings)")
    consumer: dict[str, str] = {}
    producer: dict[str, str] = {}
    for name, value in client.items():
        if "." in name:  # librdkafka's own name: both clients (each ignores the other's, with a log line)
            consumer[name] = producer[name] = _bool(value) if isinstance(value, bool) else str(value)
            continue
        target, which, convert = CLIENT_SETTINGS[name]
        if target is None:
            continue
        if which in ("both", "consumer"):
            consumer[target] = convert(value)
        if which in ("both", "producer"):
            producer[target] = convert(value)
    return consumer, producer


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
                **consumer_settings})
            self.producer = Producer({**common, "acks": "all", "linger.ms": 20,
                                      "message.timeout.ms": DELIVERY_TIMEOUT_MS, **producer_settings})
        except KafkaException as e:  # a setting librdkafka refuses (a name, or a value)
            raise ConfigError(f"invalid configuration: kafka.client: {_text(e)}") from None
        self._bootstrap_timeout_s = int(settings.client.get("bootstrap_timeout_ms", BOOTSTRAP_TIMEOUT_MS)) / 1000
        self._produce_block_s = int(settings.client.get("max_block_ms", PRODUCE_BLOCK_MS)) / 1000
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

    # ---- librdkafka's callbacks (all run on the thread calling consume/poll/list_topics)

    def _on_error(self, error: KafkaError) -> None:
        # Connection errors repeat at the reconnect backoff while the broker is away; problem()
        # reports the outage once. Refused credentials and fatal errors are worth a line.
        if error.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE):
            log.debug("Kafka connection error; the client reconnects", extra={"error": error.str()})
        else:
            log.warning("Kafka client error", extra={"error": error.str(), "fatal": error.fatal()})

    def _on_stats(self, stats: str) -> None:
        # The group coordinator's state, as kafka_source reads kafka-python's: "up" once a
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
            log.debug("claiming the assigned partitions failed; retrying", extra={"error": _text(e)})
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

    # ---- the source

    def check_topics(self, topics: Sequence[str], wait_s: float = 15.0) -> int:
        """Both topics exist with the same partition count (brief §2); returns it. Waits a
        little for topics that were just created: their metadata takes a moment to spread."""
        counts = {}
        for topic in topics:
            deadline = time.monotonic() + wait_s
            partitions = self._partitions_for(topic)
            while not partitions and time.monotonic() < deadline:
                time.sleep(0.2)
                partitions = self._partitions_for(topic)
            if not partitions:
                raise TopicMismatch(f"topic {topic!r} does not exist (create it with as many "
                                    f"partitions as the other one)")
            counts[topic] = partitions
        if len(set(counts.values())) != 1:
            raise TopicMismatch("topics are not co-partitioned: "
                                + ", ".join(f"{t} has {n}" for t, n in counts.items()))
        return next(iter(counts.values()))

    def _partitions_for(self, topic: str) -> int:
        try:
            metadata = self.consumer.list_topics(topic, timeout=self._bootstrap_timeout_s)
        except KafkaException as e:
            # librdkafka reports refused credentials and an unreachable broker alike here.
            raise KafkaUnreachable(_text(e)) from None
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
        wanted = [TopicPartition(t, p) for t in self._topics for p in partitions]
        if not wanted:
            return {}
        # Bounded: with the broker away this raises, and the claim is tried again.
        found = self.consumer.committed(wanted, timeout=COMMITTED_TIMEOUT_MS / 1000)
        return {(tp.topic, tp.partition): tp.offset for tp in found if tp.offset >= 0 and tp.error is None}

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
            log.debug("poll failed; the client reconnects", extra={"error": _text(e)})
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
        if not offsets:
            return
        try:
            self.consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                 asynchronous=True)
        except KafkaException as e:
            # For lag tooling only: the next batch's commit carries these offsets too.
            log.debug("commit to Kafka failed", extra={"error": _text(e)})

    def produce(self, topic: str, key: bytes | None, value: bytes | None,
                headers: list[tuple[str, bytes]]) -> None:
        deadline = time.monotonic() + self._produce_block_s
        while True:
            try:
                self.producer.produce(topic, value=value, key=key, headers=headers, on_delivery=_delivered)
                break
            except BufferError:  # librdkafka's queue is full: wait for deliveries to make room
                if time.monotonic() >= deadline:
                    raise SourceUnavailable(f"cannot produce to {topic!r}: the producer's queue is full") from None
                self.producer.poll(0.1)
            except KafkaException as e:
                raise SourceUnavailable(f"cannot produce to {topic!r}: {_text(e)}") from None
        self.producer.poll(0)  # delivery reports

    def problem(self) -> str:
        return self._watch.problem(self._coordinator_up)

    def lag(self) -> dict[tuple[str, int], int]:
        # From the high watermark of librdkafka's last fetch and the position it has handed
        # out (both kept locally: no network), of the partitions consumed now. Unknown just
        # after a seek, as in kafka_source.
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
        self.producer.flush(10)
        self.consumer.close()  # runs the revocation callback: the pipeline lets go of its partitions


_new = tuple.__new__
_NO_HEADERS: list[tuple[str, bytes]] = []  # shared, never changed (as Record's own default)


def _record(m: Message) -> Record:
    return _new(Record, (m.topic(), m.partition(), m.offset(), m.key(), m.value(), m.headers() or _NO_HEADERS,
                         m.timestamp()[1]))


def _records(messages: list[Message]) -> list[Record]:
    # The hot path, a few method calls a record: tuple.__new__ skips NamedTuple's Python-level
    # __new__ (measured: 15% of the conversion).
    return [_new(Record, (m.topic(), m.partition(), m.offset(), m.key(), m.value(), m.headers() or _NO_HEADERS,
                          m.timestamp()[1])) for m in messages if m.error() is None]


def _log_errors(messages: list[Message]) -> None:
    for m in messages:
        error = m.error()
        if error is not None and error.code() != KafkaError._PARTITION_EOF:
            log.warning("Kafka consumer error", extra={"error": error.str()})


def _delivered(error: KafkaError | None, message: Message) -> None:
    if error is not None:
        log.warning("a dead-letter message was not delivered", extra={"error": error.str(), "topic": message.topic()})


def _text(e: KafkaException) -> str:
    """librdkafka's message (`Failed to get metadata: Local: Broker transport failure`), not
    the KafkaError{code=…} repr."""
    first = e.args[0] if e.args else None
    return first.str() if isinstance(first, KafkaError) else str(e)
