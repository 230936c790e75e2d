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
