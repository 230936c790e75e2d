"""kafka.backend: the setting, the factory, each backend's dead-letter producer refusing
what it cannot take, and the confluent backend's mapping of `kafka.client` (kafka-python's
names) to librdkafka's. The backends themselves run the end-to-end, crash, fencing and
security tests in tests/integration on the real broker."""

from __future__ import annotations

import msgspec
import pytest

from rankmeter import config
from rankmeter.kafka import KafkaSource, open_source
from rankmeter.source import SourceUnavailable

confluent_kafka = pytest.importorskip("confluent_kafka")
from rankmeter.kafka.common import CLIENT_SETTINGS, librdkafka_settings  # noqa: E402
from rankmeter.kafka.confluent import ConfluentSource  # noqa: E402


def test_backend_setting_defaults_to_kafka_python_and_is_checked():
    assert config.load(None, {}).kafka.backend == "kafka-python"
    assert config.load(None, {"RANKMETER_KAFKA_BACKEND": "confluent"}).kafka.backend == "confluent"
    with pytest.raises(config.ConfigError) as e:
        config.load(None, {"RANKMETER_KAFKA_BACKEND": "librdkafka"})
    assert str(e.value) == "invalid configuration: kafka.backend: must be kafka-python or confluent"


UNREACHABLE = {"RANKMETER_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}
# kafka-python asks the broker its version when a client is built, unless told: a tuple,
# which the environment's strings cannot give.
KNOWN_VERSION = {"api_version": (3, 9)}


def unreachable(backend: str, client: dict) -> config.Kafka:
    settings = config.load(None, {**UNREACHABLE, "RANKMETER_KAFKA_BACKEND": backend}).kafka
    return msgspec.structs.replace(settings, client=client)


def test_the_factory_opens_the_chosen_backend():
    # Neither client connects before it is used: no broker needed to build them.
    confluent = open_source(config.load(None, {**UNREACHABLE, "RANKMETER_KAFKA_BACKEND": "confluent"}).kafka)
    try:
        assert type(confluent) is ConfluentSource
    finally:
        confluent.close()
    default = open_source(unreachable("kafka-python", KNOWN_VERSION))
    try:
        assert type(default) is KafkaSource
    finally:
        default.close()


@pytest.mark.parametrize("backend, client", [
    # kafka-python blocks max_block_ms for the topic's metadata, which no broker gives.
    ("kafka-python", {**KNOWN_VERSION, "max_block_ms": 100}),
    # librdkafka queues without a broker: a queue of one message is full at the second.
    ("confluent", {"max_block_ms": 100, "queue.buffering.max.messages": 1, "delivery_timeout_ms": 100})])
def test_a_dead_letter_the_producer_cannot_take_is_source_unavailable(backend, client):
    source = open_source(unreachable(backend, client))
    try:
        with pytest.raises(SourceUnavailable, match="cannot produce to 'rankmeter-dead-letters'"):
            for _ in range(2):
                source.produce("rankmeter-dead-letters", b"q1", b"{}", [("rankmeter.reason", b"broken JSON")])
    finally:
        source.close()


def test_the_secure_harness_settings_map_to_librdkafka():
    # As scripts/secure-services.sh prints them (RANKMETER_KAFKA_CLIENT), through config's coercion.
    client = config.load(None, {"RANKMETER_KAFKA_CLIENT":
                                "security_protocol=SASL_SSL,sasl_mechanism=SCRAM-SHA-512,sasl_plain_username=007,"
                                "sasl_plain_password=123456,ssl_cafile=/tls/ca.pem,session_timeout_ms=6000,"
                                "ssl_check_hostname=false,acks=1,bootstrap_timeout_ms=3000"}).kafka.client
    consumer, producer = librdkafka_settings(client)
    security = {"security.protocol": "SASL_SSL", "sasl.mechanisms": "SCRAM-SHA-512", "sasl.username": "007",
                "sasl.password": "123456", "ssl.ca.location": "/tls/ca.pem",
                "ssl.endpoint.identification.algorithm": "none"}
    # Each client takes its own: the session is the consumer's, acks the producer's;
    # bootstrap_timeout_ms is the adapter's start-up wait, not a librdkafka setting.
    assert consumer == {**security, "session.timeout.ms": "6000"}
    assert producer == {**security, "acks": "1"}


def test_librdkafka_names_pass_through_and_unknown_kafka_python_names_are_refused():
    consumer, producer = librdkafka_settings({"fetch.wait.max.ms": 50, "enable.ssl.certificate.verification": False})
    assert consumer == producer == {"fetch.wait.max.ms": "50", "enable.ssl.certificate.verification": "false"}
    with pytest.raises(config.ConfigError) as e:
        librdkafka_settings({"api_version": "3.9", "ssl_context": "x", "session_timeout_ms": 6000})
    assert str(e.value) == ("invalid configuration: kafka.client: api_version, ssl_context not supported by "
                            "kafka.backend confluent (use librdkafka's own names, with dots, for other settings)")


def test_librdkafka_knows_every_mapped_name():
    # Every target name and converted value is one librdkafka accepts (it refuses unknown
    # properties and bad values when a client is built). PLAINTEXT: the TLS files are not opened.
    client = {"security_protocol": "PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "u",
              "sasl_plain_password": "p", "sasl_kerberos_service_name": "kafka", "ssl_cafile": "/ca.pem",
              "ssl_certfile": "/c.pem", "ssl_keyfile": "/k.pem", "ssl_password": "k", "ssl_crlfile": "/crl.pem",
              "ssl_ciphers": "HIGH", "ssl_check_hostname": True, "client_id": "rm", "reconnect_backoff_ms": 50,
              "reconnect_backoff_max_ms": 1000, "retry_backoff_ms": 100, "metadata_max_age_ms": 300000,
              "connections_max_idle_ms": 540000, "socket_connection_setup_timeout_ms": 10000,
              "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000, "max_poll_interval_ms": 10000,
              "fetch_min_bytes": 1, "fetch_max_wait_ms": 100, "fetch_max_bytes": 52428800,
              "max_partition_fetch_bytes": 1048576, "check_crcs": False, "acks": "all", "linger_ms": 20,
              "batch_size": 16384, "compression_type": "lz4", "delivery_timeout_ms": 120000,
              "request_timeout_ms": 30000, "bootstrap_timeout_ms": 3000, "max_block_ms": 5000}
    assert set(client) == set(CLIENT_SETTINGS)
    consumer, producer = librdkafka_settings(client)
    confluent_kafka.Consumer({**consumer, "group.id": "g"}).close()
    confluent_kafka.Producer(producer).flush(0)


def test_a_setting_librdkafka_refuses_is_a_configuration_error():
    settings = config.load(None, {"RANKMETER_KAFKA_BACKEND": "confluent",
                                  "RANKMETER_KAFKA_CLIENT": "security_protocol=CARRIER_PIGEON"}).kafka
    with pytest.raises(config.ConfigError, match="invalid configuration: kafka.client: .*security.protocol"):
        open_source(settings)


def test_kafka_client_settings_reach_the_producers_but_not_past_replays_acks():
    # `kafka.client` is the dead-letter producer's (docs/security.md) and reaches the
    # simulator's too; replay keeps acks from every replica whatever it says.
    from rankmeter.replay import KafkaSink

    settings = config.load(None, UNREACHABLE)
    settings = msgspec.structs.replace(settings, kafka=msgspec.structs.replace(
        settings.kafka, client={**KNOWN_VERSION, "acks": 1, "linger_ms": 5}))
    sink = KafkaSink(settings)
    try:
        assert (sink.producer.producer.config["acks"], sink.producer.producer.config["linger_ms"]) == (-1, 5)
    finally:
        sink.producer.close(0)
    dead_letters = open_source(settings.kafka)
    try:
        assert dead_letters.producer.producer.config["acks"] == 1
    finally:
        dead_letters.close()
