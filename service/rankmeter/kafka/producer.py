"""One producer for whatever rankmeter writes to Kafka: `rankmeter replay` and the
simulator (`demo`, `simulate`) to the event topics, and serve's dead letters through the
source's `produce`. How messages are delivered is decided here, and changed here.

Each backend keeps its client's behaviour. kafka-python's send blocks for up to
`max_block_ms` while its buffer is full or the topic's metadata unknown; librdkafka's
refuses at once (BufferError), so its send waits for deliveries to make room for as long.
Either way a message that cannot be taken raises SourceUnavailable (the caller waits and
tries again). A delivery that fails later is counted per topic in `failed`, and reported to
the message's `on_done`. Serve's dead letters go through an `Outbox`: kept until their
delivery is acknowledged, sent again when refused, cut to fit when too large.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError, MessageSizeTooLargeError, RecordListTooLargeError

from rankmeter.config import Kafka as KafkaSettings
from rankmeter.dead_letters import FRAMING, fit
from rankmeter.kafka.common import PRODUCE_BLOCK_MS, known, librdkafka_text
from rankmeter.source import SourceUnavailable

log = logging.getLogger("rankmeter.kafka")

Headers = list[tuple[str, bytes]]


class Refused(NamedTuple):
    """Why a message's delivery failed; `too_large`: the producer or the broker refused its size."""
    text: str
    too_large: bool


OnDone = Callable[[Refused | None], None]  # a message's delivery: None when acknowledged


class TooLarge(Exception):
    """The producer refused a message at once for its size (over its maximum request size)."""

# What each use asks of kafka-python's producer; `kafka.client`'s settings override it
# (they are the dead-letter producer's), except what a use pins.
# Dead letters are at least once (duplicates allowed): not idempotent, since kafka-python's
# idempotent producer turns a message refused for its size into a fatal error that fails
# every later send, where the Outbox cuts it and sends it again.
DEAD_LETTERS: dict[str, Any] = {"acks": "all", "linger_ms": 20, "max_block_ms": PRODUCE_BLOCK_MS,
                                "enable_idempotence": False}
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

    max_bytes: int        # the largest message the producer sends

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers | None = None,
             timestamp_ms: int | None = None, on_done: OnDone | None = None) -> None:
        """Raises SourceUnavailable when the message cannot be taken now, TooLarge when it never can."""

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
        self.max_bytes: int = self.producer.config["max_request_size"]
        self.failed: Counter[str] = Counter()
        self.error = ""

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers | None = None,
             timestamp_ms: int | None = None, on_done: OnDone | None = None) -> None:
        try:
            future = self.producer.send(topic, key=key, value=value, headers=headers, timestamp_ms=timestamp_ms)
        except KafkaTimeoutError as e:  # buffer full, or no metadata for the topic, for max_block_ms
            raise SourceUnavailable(f"cannot produce to {topic!r}: {e}") from e
        except MessageSizeTooLargeError as e:  # over max_request_size: no retry makes it fit
            raise TooLarge(f"cannot produce to {topic!r}: {e}") from e
        future.add_errback(self._failed, topic, on_done)
        if on_done is not None:
            future.add_callback(lambda _: on_done(None))

    def _failed(self, topic: str, on_done: OnDone | None, error: BaseException) -> None:
        self.failed[topic] += 1
        self.error = self.error or f"{type(error).__name__}: {error}"
        if on_done is not None:
            on_done(Refused(f"{type(error).__name__}: {error}",
                            isinstance(error, (MessageSizeTooLargeError, RecordListTooLargeError))))

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
        from confluent_kafka import KafkaError, KafkaException, Producer

        self.producer = Producer({**common, "acks": "all", "linger.ms": 20,
                                  "message.timeout.ms": DELIVERY_TIMEOUT_MS, **settings})
        self.max_bytes = int(settings.get("message.max.bytes", 1_000_000))  # librdkafka's default
        self.refused: type[Exception] = KafkaException  # what produce() raises for a message it cannot take
        self.too_large = (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE)
        self.block_s = block_s
        self.failed: Counter[str] = Counter()
        self.error = ""

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers | None = None,
             timestamp_ms: int | None = None, on_done: OnDone | None = None) -> None:
        deadline = time.monotonic() + self.block_s
        given: dict[str, Any] = {}
        if headers is not None:
            given["headers"] = headers
        if timestamp_ms is not None:
            given["timestamp"] = timestamp_ms
        while True:
            try:
                self.producer.produce(topic, value=value, key=key,
                                      on_delivery=functools.partial(self._delivered, on_done), **given)
                break
            except BufferError:  # librdkafka's queue is full: wait for deliveries to make room
                if time.monotonic() >= deadline:
                    raise SourceUnavailable(f"cannot produce to {topic!r}: the producer's queue is full") from None
                self.producer.poll(0.1)
            except self.refused as e:
                if e.args and getattr(e.args[0], "code", lambda: None)() in self.too_large:
                    raise TooLarge(f"cannot produce to {topic!r}: {librdkafka_text(e)}") from None
                raise SourceUnavailable(f"cannot produce to {topic!r}: {librdkafka_text(e)}") from None
        self.producer.poll(0)  # delivery reports

    def _delivered(self, on_done: OnDone | None, error: Any, message: Any) -> None:
        if error is not None:
            self.failed[message.topic()] += 1
            self.error = self.error or error.str()
            log.warning("a dead-letter message was not delivered", extra={"error": error.str(), "topic": message.topic()})
        if on_done is not None:
            on_done(None if error is None else Refused(error.str(), error.code() in self.too_large))

    def flush(self, timeout_s: float | None = None) -> None:
        self.producer.flush(-1 if timeout_s is None else timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        self.flush(timeout_s)


@dataclass
class _Letter:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    limit: int  # bytes it is cut to fit in: halved each time its size is refused

    def smaller(self) -> bool:
        """Halve the limit; False when it is already the smallest (the refusal is not about size)."""
        if self.limit <= Outbox.SMALLEST:
            return False
        self.limit = max(self.limit // 2, Outbox.SMALLEST)
        return True


class Outbox:
    """Dead letters at least once (docs/delivery.md): every message is kept until its
    delivery is acknowledged. `delivered` flushes and says whether all are; a refused one
    is sent again, cut to half its size when the size was what was refused (a topic's
    max.message.bytes below the producer's limit), never dropped."""

    SMALLEST = FRAMING + 1024  # at this size a refusal is not about size: sent again as it is

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.pending: dict[int, _Letter] = {}                  # sent, not yet acknowledged
        self.refused: list[tuple[_Letter, Refused]] = []       # to send again
        self.problem = ""  # the last refusal other than for size, for /readyz
        self._numbers = itertools.count()

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers) -> None:
        """Raises SourceUnavailable when the producer cannot take the message now."""
        self._send(_Letter(topic, key, value, headers, self.producer.max_bytes))

    def _send(self, letter: _Letter) -> None:
        while True:
            key, value, headers = fit(letter.key, letter.value, letter.headers, letter.limit)
            n = next(self._numbers)
            self.pending[n] = letter
            try:
                self.producer.send(letter.topic, key, value, headers, on_done=functools.partial(self._done, n))
                return
            except TooLarge as e:
                del self.pending[n]
                if not letter.smaller():
                    raise SourceUnavailable(str(e)) from None
            except BaseException:
                del self.pending[n]
                raise

    def _done(self, n: int, refused: Refused | None) -> None:
        # On the producer's thread (kafka-python) or in its flush (librdkafka).
        letter = self.pending.pop(n, None)
        if refused is not None and letter is not None:
            self.refused.append((letter, refused))

    def delivered(self, timeout_s: float) -> bool:
        """Whether every message sent is acknowledged, waiting up to `timeout_s`. Those
        refused for their size are cut and sent again at once; the others are sent again
        and False returned (the caller waits before asking again)."""
        deadline = time.monotonic() + timeout_s
        while self.pending or self.refused:
            again, self.refused = self.refused, []
            stuck = ""  # a refusal that cutting does not answer
            for i, (letter, why) in enumerate(again):
                if not (why.too_large and letter.smaller()):
                    stuck = why.text
                log.warning("a dead-letter message was refused; sending it again",
                            extra={"error": why.text, "topic": letter.topic, "limit_bytes": letter.limit})
                try:
                    self._send(letter)
                except SourceUnavailable as e:
                    self.refused.extend(again[i:])
                    self.problem = str(e)
                    return False
            if stuck:
                self.problem = stuck
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                self.producer.flush(left)
            except KafkaTimeoutError:
                break
        if self.pending or self.refused:
            self.problem = self.problem or "dead-letter messages not acknowledged yet"
            return False
        self.problem = ""
        return True

    def flush(self, timeout_s: float | None = None) -> None:
        self.producer.flush(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        self.producer.close(timeout_s)
