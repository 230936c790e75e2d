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
import sys
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with a `long` test first, each file whole and in its order: `make test`
    hands whole files to two workers in this order (pytest-xdist, --dist loadfile), and a
    long file handed out last would keep one worker busy while the other has nothing left."""
    long_files = {item.path for item in items if item.get_closest_marker("long")}
    items.sort(key=lambda item: item.path not in long_files)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Each phase's waits (tests/integration/serving.py `wait_until`) go with its report,
    which pytest-xdist carries from the workers to the summary below."""
    outcome = yield
    serving = sys.modules.get("serving")
    if serving is not None and serving.WAITS:
        waits = [(what, round(s, 1)) for what, s in serving.WAITS if s >= 1]
        serving.WAITS.clear()
        if waits:
            outcome.get_result().user_properties.append(("waits", waits))


def pytest_terminal_summary(terminalreporter) -> None:
    """The longest waits of the suite: where its time goes beyond the CPU."""
    waits = sorted(((s, what, report.nodeid) for reports in terminalreporter.stats.values() for report in reports
                    for key, value in getattr(report, "user_properties", ()) if key == "waits"
                    for what, s in value), reverse=True)
    if waits:
        terminalreporter.write_sep("=", f"longest waits (of {len(waits)} over 1 s, {sum(w[0] for w in waits):.0f} s)")
        for s, what, nodeid in waits[:25]:
            terminalreporter.write_line(f"{s:7.1f}s  {what}  ({nodeid})")


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
    # Parallel workers are sessions of their own: each would start the harness on the
    # same ports, and the first to finish would stop it under the others.
    parallel = found is None and bool(os.environ.get("PYTEST_XDIST_WORKER"))
    if parallel:
        problems.append("parallel workers need the services started once: run through "
                        "scripts/run-tests.sh (make test does)")
    elif found is None and _docker_answers():
        try:
            found = _from_testcontainers(cleanup)
        except Exception as e:  # fall through to the harness
            problems.append(f"testcontainers: {e}")
    if found is None and not parallel:
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
