"""`redact`: URL passwords and password settings become ***, users and the rest stay."""

from __future__ import annotations

import json
import logging

import pytest

from rankmeter.logs import JsonFormatter
from rankmeter.redaction import redact


@pytest.mark.parametrize("text, expected", [
    ("redis://:s3cretPass@127.0.0.1:1/0", "redis://:***@127.0.0.1:1/0"),
    ("cannot reach Redis at rediss://rankmeter:p@ss@10.0.0.1:6380/0?ssl_ca_certs=/etc/ca.pem: refused",
     "cannot reach Redis at rediss://rankmeter:***@10.0.0.1:6380/0?ssl_ca_certs=/etc/ca.pem: refused"),
    ("redis://localhost:6379/0", "redis://localhost:6379/0"),
    ("redis://rankmeter@localhost:6379/0", "redis://rankmeter@localhost:6379/0"),
    ("unix:///run/redis.sock?db=0&password=abc", "unix:///run/redis.sock?db=0&password=***"),
    ("security_protocol=SASL_SSL,sasl_plain_username=rm,sasl_plain_password=abc123,ssl_cafile=/ca.pem",
     "security_protocol=SASL_SSL,sasl_plain_username=rm,sasl_plain_password=***,ssl_cafile=/ca.pem"),
    (str({"sasl_plain_password": "abc", "ssl_password": "def", "retries": 5}),
     str({"sasl_plain_password": "***", "ssl_password": "***", "retries": 5})),
    ("cannot reach Kafka at 127.0.0.1:9092: timeout", "cannot reach Kafka at 127.0.0.1:9092: timeout"),
    # A quoted value is masked whole: what follows a comma, a space or a brace in it too.
    (str({"sasl_plain_password": "abc,def", "retries": 5}), str({"sasl_plain_password": "***", "retries": 5})),
    (str({"ssl_password": "abc def}x"}), str({"ssl_password": "***"})),
    ('{"password": "a,b c}d", "user": "rm"}', '{"password": "***", "user": "rm"}'),
    (json.dumps({"msg": str({"sasl_plain_password": "abc,def"})}), json.dumps({"msg": "{'sasl_plain_password': '***'}"})),
    # librdkafka's secret settings, not only *password*.
    ("sasl.oauthbearer.client.secret=s3cr3t,acks=1", "sasl.oauthbearer.client.secret=***,acks=1"),
    (str({"sasl.oauthbearer.client.secret": "s3,cr3t"}), str({"sasl.oauthbearer.client.secret": "***"})),
    ("ssl.key.password=k1 sasl.password=k2&ssl.keystore.password=k3",
     "ssl.key.password=*** sasl.password=***&ssl.keystore.password=***"),
    (str({"ssl.key.pem": "-----BEGIN PRIVATE KEY-----\nMIIEv QIB,ADAN}\n-----END PRIVATE KEY-----"}),
     str({"ssl.key.pem": "***"})),
    ("key: -----BEGIN RSA PRIVATE KEY-----\nMIIE abc\n-----END RSA PRIVATE KEY----- end", "key: *** end"),
    ("sasl.oauthbearer.config=principal=rm clientSecret=x", "sasl.oauthbearer.config=*** clientSecret=***"),
    ("password='cut off", "password='*** off"),
])
def test_redact(text, expected):
    assert redact(text) == expected


def test_log_lines_lose_their_secrets():
    # kafka-python's admin client logs its whole configuration at DEBUG; any extra field too.
    record = logging.makeLogRecord({
        "name": "kafka.admin.client", "levelno": logging.DEBUG, "levelname": "DEBUG",
        "msg": "Starting KafkaAdminClient with configuration: %s",
        "args": ({"sasl_plain_username": "rm", "sasl_plain_password": "kafkaSecret"},),
        "url": "rediss://rm:redisSecret@host:6380/0"})
    line = JsonFormatter().format(record)
    assert "kafkaSecret" not in line and "redisSecret" not in line
    entry = json.loads(line)  # still valid JSON
    assert entry["url"] == "rediss://rm:***@host:6380/0"
    assert "'sasl_plain_username': 'rm', 'sasl_plain_password': '***'" in entry["msg"]
