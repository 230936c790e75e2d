"""Rules and alerts: promtool checks them and runs their unit tests (every alert firing,
pending and quiet, at its boundaries: deploy/prometheus/rules.test.yml, and the seasonal
baseline over weeks of history: rules.history.test.yml). tests/test_rule_mutations.py checks
that the tests pin every threshold, `for:` and branch."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import IN_CI

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "deploy" / "prometheus"
TEST_FILES = ("rules.test.yml", "rules.history.test.yml")


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool is not installed (scripts/services.sh install brings Debian's prometheus)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


def run(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


def rules() -> list[dict]:
    return [r for g in yaml.safe_load((PROMETHEUS / "rules.yml").read_text())["groups"] for r in g["rules"]]


def unit_test_groups() -> list[dict]:
    return [group for name in TEST_FILES for group in yaml.safe_load((PROMETHEUS / name).read_text())["tests"]]


def test_rules_are_valid(promtool):
    out = run(promtool, "check", "rules", "rules.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 31 rules found" in out.stdout
    assert out.stderr == "", out.stderr  # no warnings either


def test_every_alert_has_unit_tests_and_they_pass(promtool):
    out = run(promtool, "test", "rules", *TEST_FILES)
    assert out.returncode == 0, out.stdout + out.stderr
    alerts = {r["alert"] for r in rules() if "alert" in r}
    cases = [t for group in unit_test_groups() for t in group.get("alert_rule_test", [])]
    assert {t["alertname"] for t in cases} == alerts
    assert {t["alertname"] for t in cases if t["exp_alerts"]} == alerts  # each one shown firing,
    assert {t["alertname"] for t in cases if not t["exp_alerts"]} == alerts  # and quiet
    # and pending: ALERTS{alertstate="pending"} of each alert with a `for:` at some evaluation.
    pending = {a for group in unit_test_groups() for t in group.get("promql_expr_test", [])
               for a in alerts if f'alertname="{a}"' in t["expr"]
               and any('alertstate="pending"' in s["labels"] for s in t["exp_samples"])}
    assert pending == {r["alert"] for r in rules() if "alert" in r and "for" in r}


def test_quality_alerts_take_their_severity_from_the_ranker():
    for rule in rules():
        if "rankmeter:quality:mean" in rule.get("expr", "") and "alert" in rule:
            assert "severity" not in rule.get("labels", {}), rule["alert"]
            assert "* on (ranker) group_left (severity) rankmeter:ranker:severity" in rule["expr"], rule["alert"]
        elif "alert" in rule:
            assert rule["labels"]["severity"] in ("page", "ticket"), rule["alert"]


def test_compose_prometheus_config_is_valid(promtool, tmp_path):
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    config["rule_files"] = [str(PROMETHEUS / "rules.yml")]  # the path it has inside the container
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    out = run(promtool, "check", "config", str(tmp_path / "prometheus.yml"), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
