"""What the subcommands share: the two errors `main` turns into exit statuses, the
settings, and reaching Redis and Kafka. The only module of the command that imports the
Kafka sources."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

from rankmeter.redaction import redact


class UsageError(Exception):
    """A mistake on the command line or in the settings: one line, exit status 2."""


class ServiceError(Exception):
    """A service that cannot be reached at start: one line, exit status 1."""


def load_settings(args: argparse.Namespace):
    from rankmeter import config

    try:
        return config.load(args.config)
    except config.ConfigError as e:
        raise UsageError(str(e)) from None


@contextmanager
def reaching(settings) -> Iterator[None]:
    """Turns a service that cannot be reached at start into one line (ServiceError)."""
    import redis
    from kafka.errors import KafkaError, KafkaTimeoutError

    from rankmeter.config import ConfigError
    from rankmeter.kafka import KafkaUnreachable, TopicMismatch

    try:
        yield
    except redis.RedisError as e:
        # The whole message: the URL's password, and any a driver error might quote.
        raise ServiceError(redact(f"cannot reach Redis at {settings.redis.url}: {e}")) from None
    except KafkaError as e:
        # kafka-python reports refused credentials and wrong TLS alike, as a bootstrap timeout.
        hint = " (is it up, and do kafka.client's security settings match its listener?)" \
            if isinstance(e, KafkaTimeoutError) else ""
        raise ServiceError(redact(f"cannot reach Kafka at {settings.kafka.bootstrap_servers}: {e}{hint}")) from None
    except KafkaUnreachable as e:  # the confluent backend: librdkafka's reason, as plain text
        raise ServiceError(redact(f"cannot reach Kafka at {settings.kafka.bootstrap_servers}: {e} (is it up, and "
                                  f"do kafka.client's security settings match its listener?)")) from None
    except ConfigError as e:  # kafka.client's settings the confluent backend cannot take, or it is not installed
        raise UsageError(str(e)) from None
    except TopicMismatch as e:
        raise ServiceError(str(e)) from None


def connect(settings, create_topics: int | None):
    """The real store and source, checked: Redis answers, the topics are co-partitioned."""
    from rankmeter.kafka import open_source
    from rankmeter.redis_store import RedisStore

    with reaching(settings):
        store = RedisStore(settings.redis.url, settings.redis.key_prefix, settings.redis.cluster)
        store.ping()
        check_eviction(settings, store)
        ensure_topics(settings, create_topics)
        source = open_source(settings.kafka)
        source.check_topics([settings.kafka.impressions_topic, settings.kafka.feedback_topic])
    return store, source


def check_eviction(settings, store) -> None:
    """A Redis that evicts keys would lose state piecemeal, unnoticed (docs/delivery.md)."""
    import logging

    policy = store.eviction_policy()
    if policy == "noeviction":
        return
    problem = (f"Redis maxmemory-policy is {policy}: it may evict rankmeter's state; set it to noeviction"
               if policy else "cannot read Redis maxmemory-policy (CONFIG not allowed): make sure it is noeviction")
    if policy and settings.redis.eviction_policy_check == "refuse":
        raise ServiceError(f"{problem} (or redis.eviction_policy_check: warn)")
    logging.getLogger("rankmeter.serve").warning(problem)


def ensure_topics(settings, partitions: int | None) -> None:
    """Creates the missing impressions, feedback and dead-letter topics with this many
    partitions; none when `partitions` is 0 or None."""
    from rankmeter.kafka import create_topics

    if partitions:
        create_topics(settings.kafka, partitions)
