"""Real services for integration tests, found in this order:

1. `RANKMETER_KAFKA_BOOTSTRAP_SERVERS` and `RANKMETER_REDIS_URL` (and optionally
   `RANKMETER_PROMETHEUS_URL`) from the environment — `make test` sets them;
2. containers through testcontainers, when a Docker engine answers;
3. the project's own harness, `scripts/services.sh up` (stopped again at the end).

When none can be had, integration tests skip on a developer's machine and fail under
`CI=true`: in CI they never skip.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import settings as hypothesis_settings

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# In CI the property tests draw the same examples every run (and keep no example database):
# CI is not red at random; a failure found while developing becomes an explicit example.
hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if IN_CI:
    hypothesis_settings.load_profile("ci")


class Services(NamedTuple):
    kafka_bootstrap: str
    redis_url: str
    prometheus_url: str | None
    origin: str  # environment, testcontainers or harness


def _from_environment() -> Services | None:
    kafka, redis = os.environ.get("RANKMETER_KAFKA_BOOTSTRAP_SERVERS"), os.environ.get("RANKMETER_REDIS_URL")
    if kafka and redis:
        return Services(kafka, redis, os.environ.get("RANKMETER_PROMETHEUS_URL"), "environment")
    return None


def _docker_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


def _from_testcontainers(stack: list) -> Services:
    from testcontainers.kafka import KafkaContainer
    from testcontainers.redis import RedisContainer

    kafka = KafkaContainer("apache/kafka:4.1.1").with_kraft()
    redis = RedisContainer("redis:7")
    for container in (kafka, redis):
        container.start()
        stack.append(container.stop)
    host, port = redis.get_container_host_ip(), redis.get_exposed_port(6379)
    return Services(kafka.get_bootstrap_server(), f"redis://{host}:{port}/0", None, "testcontainers")


def _from_harness(stack: list) -> Services:
    script = str(ROOT / "scripts" / "services.sh")
    already_up = subprocess.run([script, "status"], capture_output=True).returncode == 0
    out = subprocess.run([script, "up"], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"scripts/services.sh up failed: {out.stderr.strip()[-2000:]}")
    if not already_up:
        stack.append(lambda: subprocess.run([script, "down"], capture_output=True))
    settings = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    return Services(settings["RANKMETER_KAFKA_BOOTSTRAP_SERVERS"], settings["RANKMETER_REDIS_URL"],
                    settings.get("RANKMETER_PROMETHEUS_URL"), "harness")


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    cleanup: list = []
    found = _from_environment()
    problems = []
    if found is None and _docker_answers():
        try:
            found = _from_testcontainers(cleanup)
        except Exception as e:  # fall through to the harness
            problems.append(f"testcontainers: {e}")
    if found is None:
        try:
            found = _from_harness(cleanup)
        except Exception as e:
            problems.append(f"harness: {e}")
    if found is None:
        message = "no Kafka/Redis for integration tests: " + "; ".join(problems)
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    try:
        yield found
    finally:
        for stop in reversed(cleanup):
            stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(services: Services) -> str:
    return services.kafka_bootstrap


@pytest.fixture(scope="session")
def redis_url(services: Services) -> str:
    return services.redis_url


@pytest.fixture(scope="session")
def prometheus_url(services: Services) -> str:
    if services.prometheus_url is None:
        message = f"no Prometheus from {services.origin} (set RANKMETER_PROMETHEUS_URL)"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return services.prometheus_url


@pytest.fixture(params=["kafka-python", "confluent"])
def kafka_backend(request: pytest.FixtureRequest) -> dict[str, str]:
    """Each Kafka client backend in turn, as the environment that selects it for `rankmeter
    serve`: the end-to-end, crash, fencing, broker-restart and security tests hold on both.
    confluent-kafka is an extra (in `.[test]`): never skipped in CI."""
    if request.param == "confluent" and importlib.util.find_spec("confluent_kafka") is None:
        message = "confluent-kafka is not installed (pip install -e '.[test]')"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return {"RANKMETER_KAFKA_BACKEND": request.param}
