"""One producer for whatever rankmeter writes to Kafka: `rankmeter replay` and the
simulator (`demo`, `simulate`) to the event topics, and serve's dead letters through the
source's `produce`. How messages are delivered is decided here, and changed here.

Each backend keeps its client's behaviour. kafka-python's send blocks for up to
`max_block_ms` while its buffer is full or the topic's metadata unknown; librdkafka's
refuses at once (BufferError), so its send waits for deliveries to make room for as long.
Either way a message that cannot be taken raises SourceUnavailable (the caller waits and
tries again). A delivery that fails later is counted per topic in `failed`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Protocol

from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError

from rankmeter.config import Kafka as KafkaSettings
from rankmeter.kafka.common import PRODUCE_BLOCK_MS, known, librdkafka_text
from rankmeter.source import SourceUnavailable

log = logging.getLogger("rankmeter.kafka")

Headers = list[tuple[str, bytes]]

# What each use asks of kafka-python's producer; `kafka.client`'s settings override it
# (they are the dead-letter producer's), except what a use pins.
DEAD_LETTERS: dict[str, Any] = {"acks": "all", "linger_ms": 20, "max_block_ms": PRODUCE_BLOCK_MS}
# Every replica acknowledges a replayed record: none is lost unnoticed (`failed` counts them).
REPLAY: dict[str, Any] = {"acks": "all", "linger_ms": 20, "batch_size": 256 * 1024}
SIMULATOR: dict[str, Any] = {"linger_ms": 20, "batch_size": 256 * 1024}  # acks: the leader's (kafka-python's default)
# A replayed record is acknowledged by every replica whatever `kafka.client` says: with
# fewer, a record lost on a failover would go uncounted in `failed`.
REPLAY_PINNED: dict[str, Any] = {"acks": "all"}
# librdkafka's dead letters not delivered after this are dropped (kafka-python's delivery_timeout_ms).
DELIVERY_TIMEOUT_MS = 120_000


class Producer(Protocol):
    failed: Counter[str]  # topic -> messages whose delivery failed
    error: str            # the first of those failures

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers | None = None,
             timestamp_ms: int | None = None) -> None:
        """Raises SourceUnavailable when the message cannot be taken now."""

    def flush(self, timeout_s: float | None = None) -> None: ...

    def close(self, timeout_s: float | None = None) -> None: ...


class KafkaPythonProducer:
    """kafka-python's producer with the options of one use (DEAD_LETTERS, REPLAY, SIMULATOR)."""

    def __init__(self, settings: KafkaSettings, options: dict[str, Any], client_id: str | None = None,
                 pinned: dict[str, Any] | None = None) -> None:
        ours: dict[str, Any] = {"bootstrap_servers": settings.bootstrap_servers.split(",")}
        if client_id is not None:
            ours["client_id"] = client_id
        client = known(settings.client, KafkaProducer.DEFAULT_CONFIG)
        self.producer = KafkaProducer(**{**options, **ours, **client, **(pinned or {})})
        self.failed: Counter[str] = Counter()
        self.error = ""

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers | None = None,
             timestamp_ms: int | None = None) -> None:
        try:
            future = self.producer.send(topic, key=key, value=value, headers=headers, timestamp_ms=timestamp_ms)
        except KafkaTimeoutError as e:  # buffer full, or no metadata for the topic, for max_block_ms
            raise SourceUnavailable(f"cannot produce to {topic!r}: {e}") from e
        future.add_errback(self._failed, topic)

    def _failed(self, topic: str, error: BaseException) -> None:
        self.failed[topic] += 1
        self.error = self.error or f"{type(error).__name__}: {error}"

    def flush(self, timeout_s: float | None = None) -> None:
        self.producer.flush(timeout=timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        self.producer.flush(timeout=timeout_s)
        self.producer.close(timeout=timeout_s)


class ConfluentProducer:
    """librdkafka's producer, for dead letters: `common` is the source's settings of both its
    clients (bootstrap, callbacks), `settings` the producer's own from `kafka.client`."""

    def __init__(self, common: dict[str, Any], settings: dict[str, str], block_s: float) -> None:
        # The confluent extra, imported only for its backend (it takes a while).
        from confluent_kafka import KafkaException, Producer

        self.producer = Producer({**common, "acks": "all", "linger.ms": 20,
                                  "message.timeout.ms": DELIVERY_TIMEOUT_MS, **settings})
        self.refused: type[Exception] = KafkaException  # what produce() raises for a message it cannot take
        self.block_s = block_s
        self.failed: Counter[str] = Counter()
        self.error = ""

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers | None = None,
             timestamp_ms: int | None = None) -> None:
        deadline = time.monotonic() + self.block_s
        given: dict[str, Any] = {}
        if headers is not None:
            given["headers"] = headers
        if timestamp_ms is not None:
            given["timestamp"] = timestamp_ms
        while True:
            try:
                self.producer.produce(topic, value=value, key=key, on_delivery=self._delivered, **given)
                break
            except BufferError:  # librdkafka's queue is full: wait for deliveries to make room
                if time.monotonic() >= deadline:
                    raise SourceUnavailable(f"cannot produce to {topic!r}: the producer's queue is full") from None
                self.producer.poll(0.1)
            except self.refused as e:
                raise SourceUnavailable(f"cannot produce to {topic!r}: {librdkafka_text(e)}") from None
        self.producer.poll(0)  # delivery reports

    def _delivered(self, error: Any, message: Any) -> None:
        if error is not None:
            self.failed[message.topic()] += 1
            self.error = self.error or error.str()
            log.warning("a dead-letter message was not delivered", extra={"error": error.str(), "topic": message.topic()})

    def flush(self, timeout_s: float | None = None) -> None:
        self.producer.flush(-1 if timeout_s is None else timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        self.flush(timeout_s)
