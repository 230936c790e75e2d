"""Every panel of every dashboard, as Grafana would ask it: a real Prometheus scraping a
real `rankmeter serve` fed by `rankmeter simulate` through the real Kafka and Redis."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import IN_CI
from serving import RANKMETER, Serve, free_port, unique_topics, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]
# What a person would pick in the dashboards' variables; `$ranker` is "All".
VARIABLES = {"ranker": ".*", "window": "1h", "metric": "nDCG@10", "baseline": "bm25-tuned",
             "challenger": "bm25-degraded", "segment": ".*", "average": "macro", "__rate_interval": "30s"}
# An experiment for the A/B dashboard: the simulator's two rankers, 50/50; statistics from
# 50 queries an arm so that they exist within the test's 15 seconds of traffic.
EXPERIMENT = {"RANKMETER_AB_BASELINE": "bm25-tuned", "RANKMETER_AB_UNIT": "query", "RANKMETER_AB_SPLIT": "bm25-tuned=0.5,bm25-degraded=0.5",
              "RANKMETER_AB_MIN_QUERIES": "50", "RANKMETER_AB_START": str(int(time.time() * 1000) - 3_600_000),
              # Position-bias panels: clicks final after 2 s (not 30 min), every query harvested,
              # propensities from 10 harvested pairs a rank, so that they exist within 15 s.
              "RANKMETER_WINDOWS_ATTRIBUTION": "2s", "RANKMETER_WINDOWS_GRACE": "0s",
              "RANKMETER_DEBIAS_HARVEST_SHARE": "1", "RANKMETER_DEBIAS_MIN_PAIRS": "10"}


def substitute(expr: str) -> str:
    for name in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace(f"${name}", VARIABLES[name])
    return expr


def api(base: str, path: str, **params: str) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


@pytest.fixture
def prometheus_for(tmp_path):
    """Starts a Prometheus of our own (Debian's package) scraping the given target every second."""
    binary = shutil.which("prometheus")
    if binary is None:
        if IN_CI:
            pytest.fail("prometheus is not installed (scripts/services.sh install)")
        pytest.skip("prometheus is not installed")
    started = []

    def start(target: str) -> str:
        port = free_port()
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(ROOT / "deploy/prometheus/rules.yml")],
                  "scrape_configs": [{"job_name": "rankmeter", "static_configs": [{"targets": [target]}]}]}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = open(tmp_path / "prometheus.log", "wb")
        process = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={tmp_path / 'data'}",
                                    f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)
        started.append(process)
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _ready(base), 60, "Prometheus to be ready")
        return base

    yield start
    for process in started:
        process.terminate()
        process.wait(timeout=30)


def _scalar(base: str, query: str) -> float:
    """The query's one value now (−inf when it has none yet)."""
    result = api(base, "/api/v1/query", query=query)["data"]["result"]
    return float(result[0]["value"][1]) if result else float("-inf")


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_every_panel_query_parses_and_returns_data(kafka_bootstrap, redis_url, prometheus_for, tmp_path):
    topics = unique_topics(kafka_bootstrap)
    with Serve(kafka_bootstrap, redis_url, topics, f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}",
               extra_env=EXPERIMENT, log_path=tmp_path / "serve.log") as serve:
        prometheus = prometheus_for(f"127.0.0.1:{serve.port}")
        env = {**os.environ, "RANKMETER_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
               "RANKMETER_KAFKA_IMPRESSIONS_TOPIC": topics.impressions,
               "RANKMETER_KAFKA_FEEDBACK_TOPIC": topics.feedback}
        simulate = subprocess.run([RANKMETER, "simulate", "--rate", "400", "--duration", "15", "--truth"],
                                  env=env, capture_output=True, text=True, timeout=120)
        assert simulate.returncode == 0, simulate.stderr
        sent = json.loads(simulate.stdout.strip().splitlines()[-1])
        assert sent["events"] > 3000
        serve.wait_for_events(sent["events"])
        consumed = time.time()
        # Prometheus has scraped every event, and twice more since (the panels' rates need
        # samples after the last event).
        wait_until(lambda: _scalar(prometheus, 'sum(rankmeter_events_total{job="rankmeter"})') >= sent["events"]
                   and _scalar(prometheus, 'timestamp(up{job="rankmeter"})') >= consumed + 2, 30,
                   "Prometheus to scrape every event")
        # The service looks at the experiment every 5 s; wait until Prometheus has scraped every
        # A/B series the dashboard draws (the SRM p-value last: it needs both arms' counts).
        for name in ("rankmeter_ab_p_value", "rankmeter_ab_ci_upper", "rankmeter_ab_queries",
                     "rankmeter_ab_judged_share", "rankmeter_ab_srm_p_value", "rankmeter_propensity",
                     'rankmeter_debiased_quality{metric="nDCG@10", window="1h", average="macro"}'):
            wait_until(lambda name=name: api(prometheus, "/api/v1/query", query=name)["data"]["result"], 30,
                       f"{name} to be scraped")

        for path in sorted((ROOT / "dashboards").glob("*.json")):
            board = json.loads(path.read_text())
            for panel in board["panels"]:
                for target in panel["targets"]:
                    expr = substitute(target["expr"])
                    answer = api(prometheus, "/api/v1/query", query=expr)
                    assert answer["status"] == "success", (path.name, panel["title"], expr)
                    result = answer["data"]["result"]
                    assert result, f"{path.name} / {panel['title']}: no data for\n{expr}"
                    assert any(s["value"][1] not in ("NaN", "+Inf", "-Inf") for s in result), (panel["title"], result)

        # The recording rules evaluate on the live data (every 30 s), and every rule is healthy.
        query = 'rankmeter:quality:ratio{metric="nDCG@10", window="1h", average="macro"}'
        wait_until(lambda: len(api(prometheus, "/api/v1/query", query=query)["data"]["result"]) == 2, 90,
                   "the recording rules to be evaluated")
        ratio = api(prometheus, "/api/v1/query", query=query)
        by_ranker = {s["metric"]["ranker"]: float(s["value"][1]) for s in ratio["data"]["result"]}
        assert by_ranker["bm25-tuned"] > by_ranker["bm25-degraded"]  # the simulator's known direction
        # A rule not yet evaluated is "unknown": the group's first evaluation may still be
        # under way when the first of its records appears (seen on a loaded machine).
        def groups() -> list[dict]:
            return api(prometheus, "/api/v1/rules")["data"]["groups"]
        wait_until(lambda: all(r["health"] != "unknown" for g in groups() for r in g["rules"]), 90,
                   "every rule to be evaluated once")
        rules = groups()
        assert {g["name"] for g in rules} == {"rankmeter-recording", "rankmeter-alerts"}
        unhealthy = [(r["name"], r["health"], r.get("lastError")) for g in rules for r in g["rules"] if r["health"] != "ok"]
        assert unhealthy == [], unhealthy
