"""Settings: YAML under RANKMETER_* overrides; one clear line for a bad setting."""

import subprocess

import pytest

from rankmeter import config
from test_eval_cli import RANKMETER


def test_defaults_file_and_environment(tmp_path):
    path = tmp_path / "rankmeter.yaml"
    path.write_text("kafka:\n  group_id: from-file\n  client:\n    security_protocol: SASL_SSL\n"
                    "metrics:\n  port: 9300\nwindows:\n  sizes: [1m, 10m]\n")
    s = config.load(str(path), {"RANKMETER_METRICS_PORT": "9400",
                                "RANKMETER_KAFKA_BOOTSTRAP_SERVERS": "k1:9092,k2:9092",
                                "RANKMETER_REDIS_URL": "rediss://:secret@redis:6380/1",
                                "RANKMETER_EVALUATION_GRADES": "click=1,purchase=4",
                                "RANKMETER_KAFKA_CLIENT": "session_timeout_ms=6000,ssl_check_hostname=false"})
    assert s.kafka.group_id == "from-file"
    assert s.kafka.bootstrap_servers == "k1:9092,k2:9092"
    assert s.kafka.client == {"session_timeout_ms": 6000, "ssl_check_hostname": False}  # env replaces the map
    assert s.metrics.port == 9400
    assert s.redis.url == "rediss://:secret@redis:6380/1"
    assert s.windows.sizes == ["1m", "10m"]
    assert s.evaluation.grades == {"click": 1.0, "purchase": 4.0}
    assert config.load(None, {}).windows.sizes == ["5m", "15m", "1h", "24h"]


def test_config_file_from_environment(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("redis:\n  key_prefix: staging\n")
    assert config.load(None, {"RANKMETER_CONFIG": str(path)}).redis.key_prefix == "staging"


@pytest.mark.parametrize("env, message", [
    ({"RANKMETER_METRICS_PORT": "http"}, "invalid configuration: metrics.port: Expected `int`, got `str`"),
    ({"RANKMETER_METRICS_PORT": "70000"}, "invalid configuration: metrics.port: 70000 is not a TCP port"),
    ({"RANKMETER_KAFKA_GROUPID": "x"}, "invalid configuration: unknown setting RANKMETER_KAFKA_GROUPID"),
    ({"RANKMETER_WINDOWS_SIZES": "5m,30s"}, "windows.sizes: '30s' is shorter than the one-minute bucket"),
    ({"RANKMETER_WINDOWS_ATTRIBUTION": "half an hour"}, "windows.attribution: 'half an hour' is not a duration"),
    ({"RANKMETER_EVALUATION_MEASURES": "nDCG@10,MRR"}, "evaluation.measures: unknown measure 'MRR'"),
    ({"RANKMETER_EVALUATION_GRADES": "click=-1"}, "evaluation.grades: grades must be from 0 to 1000"),
    ({"RANKMETER_EVALUATION_EMPTY_QUERY_POLICY": "drop"}, "evaluation.empty_query_policy: must be skip or zero"),
    ({"RANKMETER_REDIS_URL": "localhost:6379"}, "redis.url: must start with redis://, rediss:// or unix://"),
    ({"RANKMETER_AB_START": "2026-12-01T09:00:00"},
     "invalid configuration: ab.start: '2026-12-01T09:00:00' has no time zone: add Z (UTC) or an offset"),
    ({"RANKMETER_AB_START": "2026-12-01 09:00"}, "ab.start: '2026-12-01 09:00' has no time zone"),
    ({"RANKMETER_AB_CUPED": "true"}, "ab.cuped: needs an experiment (ab.baseline, ab.start)"),
    ({"RANKMETER_AB_CUPED_BUCKETS": "1"}, "ab.cuped_buckets: must be from 2 to 1048576"),
    ({"RANKMETER_AB_CUPED_COVARIATE": "session"}, "ab.cuped_covariate: must be text"),
    ({"RANKMETER_AB_BASELINE": "a", "RANKMETER_AB_START": "0", "RANKMETER_AB_UNIT": "query", "RANKMETER_AB_CUPED": "true",
      "RANKMETER_AB_CUPED_COVARIATE": "user"}, "ab.cuped_covariate: user needs ab.unit: user"),
])
def test_bad_settings_name_the_setting(env, message):
    with pytest.raises(config.ConfigError) as e:
        config.load(None, env)
    assert message in str(e.value)


def test_bad_yaml_and_unknown_keys(tmp_path):
    (tmp_path / "a.yaml").write_text("kafka: [unclosed\n")
    (tmp_path / "b.yaml").write_text("kafka:\n  bootstrap: x\n")
    with pytest.raises(config.ConfigError, match="is not valid YAML"):
        config.load(str(tmp_path / "a.yaml"), {})
    with pytest.raises(config.ConfigError, match="invalid configuration: kafka: Object contains unknown field `bootstrap`"):
        config.load(str(tmp_path / "b.yaml"), {})
    with pytest.raises(config.ConfigError, match="cannot read configuration"):
        config.load(str(tmp_path / "missing.yaml"), {})


def test_serve_with_a_bad_setting_fails_in_one_line():
    out = subprocess.run([RANKMETER, "serve"], env={"RANKMETER_METRICS_PORT": "http", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr == "rankmeter serve: error: invalid configuration: metrics.port: Expected `int`, got `str`\n"


def test_serve_without_services_fails_in_one_line():
    out = subprocess.run([RANKMETER, "serve"], capture_output=True, text=True, timeout=60,
                         env={"RANKMETER_REDIS_URL": "redis://127.0.0.1:1/0", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 1
    assert out.stderr.startswith("rankmeter serve: error: cannot reach Redis at redis://127.0.0.1:1/0")
    assert len(out.stderr.splitlines()) == 1


def test_kafka_credentials_in_the_environment_stay_text():
    s = config.load(None, {"RANKMETER_KAFKA_CLIENT": "sasl_plain_username=007,sasl_plain_password=123456,"
                                                     "request_timeout_ms=5000"})
    assert s.kafka.client == {"sasl_plain_username": "007", "sasl_plain_password": "123456",
                              "request_timeout_ms": 5000}


@pytest.mark.parametrize("start, expected_ms", [
    ("2026-12-01T09:00:00Z", 1796115600000), ("2026-12-01T10:00:00+01:00", 1796115600000),
    ("1796115600000", 1796115600000)])
def test_ab_start_with_a_time_zone_or_in_epoch_ms_is_accepted(start, expected_ms):
    s = config.load(None, {"RANKMETER_AB_START": start})
    assert config.time_ms(s.ab.start) == expected_ms


def test_serve_with_ab_start_in_local_time_fails_in_one_line():
    out = subprocess.run([RANKMETER, "serve"], capture_output=True, text=True, timeout=60,
                         env={"RANKMETER_AB_START": "2026-12-01T09:00", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2
    assert out.stderr == ("rankmeter serve: error: invalid configuration: ab.start: '2026-12-01T09:00' has no "
                          "time zone: add Z (UTC) or an offset such as +01:00\n")


def test_secrets_and_strings_in_the_environment_stay_text():
    # librdkafka's dotted names, kafka-python's passwords and text settings: as typed;
    # kafka-python's numbers and booleans typed as its defaults are.
    s = config.load(None, {"RANKMETER_KAFKA_CLIENT":
                           "sasl.password=0123,ssl.key.password=1e3,sasl.oauthbearer.client.secret=0x10,"
                           "ssl_password=0123,sasl_plain_password=0.50,client_id=007,security_protocol=SSL,"
                           "session_timeout_ms=6000,ssl_check_hostname=false,acks=all,retries=3"})
    assert s.kafka.client == {
        "sasl.password": "0123", "ssl.key.password": "1e3", "sasl.oauthbearer.client.secret": "0x10",
        "ssl_password": "0123", "sasl_plain_password": "0.50", "client_id": "007", "security_protocol": "SSL",
        "session_timeout_ms": 6000, "ssl_check_hostname": False, "acks": "all", "retries": 3}
