"""Rules and alerts: promtool checks them and runs their unit tests (every alert, firing
and quiet: deploy/prometheus/rules.test.yml)."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import IN_CI

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "deploy" / "prometheus"


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


def test_rules_are_valid(promtool):
    out = run(promtool, "check", "rules", "rules.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 12 rules found" in out.stdout


def test_every_alert_has_a_unit_test_and_they_pass(promtool):
    out = run(promtool, "test", "rules", "rules.test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    alerts = {r["alert"] for g in yaml.safe_load((PROMETHEUS / "rules.yml").read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    tested = {t["alertname"] for test in yaml.safe_load((PROMETHEUS / "rules.test.yml").read_text())["tests"]
              for t in test.get("alert_rule_test", [])}
    assert alerts == tested
    fired = {t["alertname"] for test in yaml.safe_load((PROMETHEUS / "rules.test.yml").read_text())["tests"]
             for t in test.get("alert_rule_test", []) if t["exp_alerts"]}
    assert fired == alerts  # each one is shown firing, not only quiet


def test_compose_prometheus_config_is_valid(promtool, tmp_path):
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    config["rule_files"] = [str(PROMETHEUS / "rules.yml")]  # the path it has inside the container
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    out = run(promtool, "check", "config", str(tmp_path / "prometheus.yml"), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
