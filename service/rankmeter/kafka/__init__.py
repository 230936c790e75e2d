"""rankmeter's Kafka adapters: the event source on kafka-python (`kafka_python.py`, the
default) or on confluent-kafka (`confluent.py`, librdkafka), chosen by `kafka.backend`;
what both share (`common.py`); and the one producer (`producer.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rankmeter.config import ConfigError
from rankmeter.config import Kafka as KafkaSettings
from rankmeter.kafka.common import KafkaUnreachable, TopicMismatch, create_topics
from rankmeter.kafka.kafka_python import KafkaSource

if TYPE_CHECKING:
    from rankmeter.kafka.confluent import ConfluentSource

__all__ = ["KafkaSource", "KafkaUnreachable", "TopicMismatch", "create_topics", "open_source"]


def open_source(settings: KafkaSettings, client_id: str = "rankmeter") -> KafkaSource | ConfluentSource:
    """The source of `kafka.backend`: kafka-python (the default) or confluent (librdkafka,
    an extra: imported only when chosen)."""
    if settings.backend == "confluent":
        try:
            from rankmeter.kafka.confluent import ConfluentSource
        except ImportError as e:
            if e.name is None or not e.name.startswith("confluent_kafka"):
                raise
            raise ConfigError("invalid configuration: kafka.backend: confluent needs the confluent-kafka "
                              "package: pip install 'rankmeter[confluent]'") from None
        return ConfluentSource(settings, client_id)
    return KafkaSource(settings, client_id)
