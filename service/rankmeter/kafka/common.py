"""What both Kafka backends share: the coordinator watch behind `problem()`, the timeouts,
the errors start-up reports, the topics' check and creation, and `kafka.client` turned
into each client's options.

`kafka.client` keeps kafka-python's spelling for both backends; `CLIENT_SETTINGS` maps
each name to librdkafka's. A name with a dot is librdkafka's own and passed as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import TopicAlreadyExistsError

from rankmeter.config import ConfigError
from rankmeter.config import Kafka as KafkaSettings

log = logging.getLogger("rankmeter.kafka")

# The coordinator is looked up again after any disconnection (a rebalance, a broker's
# restart): only this long without one counts as the broker being away.
COORDINATOR_GRACE_S = 5.0
# How long a dead-letter send may block (producer buffer full, topic metadata unknown)
# before the caller is told to retry; kafka-python's default, 60 s, would starve /healthz.
PRODUCE_BLOCK_MS = 5000
# After a seek, how long before a partition's lag is reported (fetches renew its high
# watermark several times a second).
LAG_SETTLE_S = 2.0
COMMITTED_TIMEOUT_MS = 5000  # asking the group coordinator for committed offsets


class TopicMismatch(Exception):
    """The two topics are missing or not co-partitioned."""


class KafkaUnreachable(Exception):
    """No answer from the broker at start (down, or refusing the credentials or the TLS):
    raised by the confluent backend; kafka-python raises its own KafkaError."""


class CoordinatorWatch:
    """Kafka is reported unavailable once the group coordinator has been out of reach for
    COORDINATOR_GRACE_S: shorter blinks (a rebalance) are not an outage."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.away_since: float | None = None

    def problem(self, coordinator_up: bool) -> str:
        if coordinator_up:
            self.away_since = None
            return ""
        now = time.monotonic()
        if self.away_since is None:
            self.away_since = now
        away = now - self.away_since
        if away < COORDINATOR_GRACE_S:
            return ""
        return (f"Kafka unavailable: no connection to the group coordinator for {away:.0f} s "
                f"(bootstrap {self.bootstrap}); reconnecting")


def copartitioned(topics: Sequence[str], partitions_for: Callable[[str], int], wait_s: float = 15.0) -> int:
    """Both topics exist with the same partition count (brief §2); returns it. Waits a
    little for topics that were just created: their metadata takes a moment to spread.
    `partitions_for(topic)` is the client's count, 0 for a topic it does not know."""
    counts = {}
    for topic in topics:
        deadline = time.monotonic() + wait_s
        partitions = partitions_for(topic)
        while not partitions and time.monotonic() < deadline:
            time.sleep(0.2)
            partitions = partitions_for(topic)
        if not partitions:
            raise TopicMismatch(f"topic {topic!r} does not exist (create it with as many "
                                f"partitions as the other one)")
        counts[topic] = partitions
    if len(set(counts.values())) != 1:
        raise TopicMismatch("topics are not co-partitioned: "
                            + ", ".join(f"{t} has {n}" for t, n in counts.items()))
    return next(iter(counts.values()))


def create_topics(settings: KafkaSettings, partitions: int) -> None:
    """Create the three topics when missing (impressions and feedback co-partitioned)."""
    admin = KafkaAdminClient(bootstrap_servers=settings.bootstrap_servers.split(","),
                             client_id="rankmeter-admin", **known(settings.client, KafkaAdminClient.DEFAULT_CONFIG))
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


# ---- kafka.client -> each client's options

def known(client: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The settings of `kafka.client` a kafka-python client knows (`defaults`: its
    DEFAULT_CONFIG): security for every client, session ones for the consumer only."""
    return {k: v for k, v in client.items() if k in defaults}


def librdkafka_text(e: Exception) -> str:
    """librdkafka's message (`Failed to get metadata: Local: Broker transport failure`), not
    the KafkaError{code=…} repr: a KafkaException's first argument is its KafkaError."""
    first = e.args[0] if e.args else None
    return first.str() if callable(getattr(first, "str", None)) else str(e)


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
