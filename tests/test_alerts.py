"""rankmeter's own evaluation of the quality alerts (what the demo shows) is the rule
file's: the same constants, rules, bounds and `for:` semantics."""

import math
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from rankmeter import alerts
from rankmeter.windows import Sums, WindowView
from test_prometheus_rules import promtool  # noqa: F401 (the fixture)

RULES_FILE = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "rules.yml"


def rule_file() -> dict:
    rules = [r for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"]]
    return {r.get("record") or r["alert"]: r for r in rules}


def test_the_constants_are_the_rule_files():
    rules = rule_file()

    def constant(name: str) -> float:
        return float(re.fullmatch(r"\s*vector\((.+)\)\s*", rules[name]["expr"])[1])

    assert alerts.Z_SCORE == constant("rankmeter:alert_z_score:threshold")
    assert alerts.MARGIN == constant("rankmeter:quality_drop_margin:ratio")
    assert alerts.MIN_SAMPLES == constant("rankmeter:alert_min_samples:count")


def test_the_rules_are_the_rule_files():
    rules = rule_file()
    for rule in alerts.RULES:
        expr = rules[rule.alert]["expr"]
        assert f'metric="{rule.metric}", window="{rule.window}"' in expr
        assert ("> rankmeter:quality_baseline:mean * (1 +" in expr) == rule.rise
        hold = rules[rule.alert]["for"]
        assert rule.hold_s == int(hold[:-1]) * {"m": 60, "s": 1}[hold[-1]]


def view(window: str, values: list[float], ranker: str = "r", segment: str = "") -> WindowView:
    n, s1, s2 = len(values), sum(values), sum(v * v for v in values)
    return WindowView(ranker, segment, window, n, n, {"nDCG@10": Sums(s1, n, s1, n, s2)}, {})


def fast(found):
    return [c for c in found if c.rule.alert == "RankmeterQualityDropFast"]


def with_history(hours: float, values: list[float], step_s: float = 60.0) -> alerts.Evaluator:
    """An evaluator that has seen the 15m window at `values` every minute for `hours`."""
    evaluator = alerts.Evaluator()
    for i in range(int(hours * 3600 / step_s) + 1):
        evaluator.conditions([view("15m", values)], i * step_s)
    return evaluator


def test_the_bound_is_the_larger_of_the_margin_and_z_standard_errors():
    usual = [0.8, 0.9] * 200                     # mean 0.85, sd 0.05, 400 queries
    for now, margin_binds in (([0.78, 0.82] * 60, True), ([0.0, 1.6] * 60, False)):
        evaluator = with_history(3, usual)
        [c] = fast(evaluator.conditions([view("15m", now)], 3 * 3600 + 60))
        mean, n = 0.8, len(now)
        sd = math.sqrt(sum((v - mean) ** 2 for v in now) / n)
        # The baseline: the median of the last day's values (the new one among them), its
        # error 1.25 × their median error / sqrt(3 hours of history).
        baseline_error = 1.25 * (0.05 / math.sqrt(400)) / math.sqrt(3 + 2 / 60)
        z_band = alerts.Z_SCORE * math.hypot(sd / math.sqrt(n), baseline_error)
        assert c.baseline == pytest.approx(0.85)
        assert c.bound == pytest.approx(0.85 - max(alerts.MARGIN * 0.85, z_band))
        assert (alerts.MARGIN * 0.85 > z_band) == margin_binds
        assert c.value == pytest.approx(mean) and c.holds == (mean < c.bound)


def test_just_past_the_bound_holds_just_short_does_not_and_few_queries_never():
    usual = [0.85] * 400
    # With no spread the bound is the margin's: 0.85 × 0.95 = 0.8075.
    for now, holds in (([0.807] * 100, True), ([0.808] * 100, False), ([0.1] * 99, False)):
        [c] = fast(with_history(3, usual).conditions([view("15m", now)], 3 * 3600 + 60))
        assert c.holds == holds
    # Segments are summed: two halves of 50 queries are 100.
    halves = [view("15m", [0.807] * 50, segment="a"), view("15m", [0.807] * 50, segment="b")]
    assert fast(with_history(3, usual).conditions(halves, 3 * 3600 + 60))[0].holds


def test_no_baseline_before_an_hour_of_history_and_a_day_at_most():
    usual = [0.85] * 400
    # 59 values a minute apart are not an hour of them; 60 are.
    assert fast(with_history(57 / 60, usual).conditions([view("15m", [0.5] * 100)], 58 * 60)) == []
    assert fast(with_history(58 / 60, usual).conditions([view("15m", [0.5] * 100)], 59 * 60))[0].holds
    # Two bad hours within the day do not move the median; values older than a day are gone.
    evaluator = with_history(22, usual)
    for i in range(1, 121):
        evaluator.conditions([view("15m", [0.5] * 400)], 22 * 3600 + i * 60)
    [c] = fast(evaluator.conditions([view("15m", [0.5] * 400)], 24 * 3600 + 60))
    assert c.baseline == pytest.approx(0.85)
    later = 24 * 3600 + 60 + 23 * 3600  # the good hours have left the day
    [c] = fast(evaluator.conditions([view("15m", [0.5] * 400)], later))
    assert c.baseline == pytest.approx(0.5)


def test_pending_until_the_rules_for_then_firing_and_gone_when_it_stops_holding():
    usual, bad = [0.85] * 400, [0.5] * 100
    evaluator = with_history(3, usual)
    t0 = 3 * 3600 + 60
    states = [[(c.rule.alert, s) for c, s in evaluator.update([view("15m", bad)], t0 + dt)] for dt in (0, 60, 240)]
    assert all(s == [("RankmeterQualityDropFast", "pending")] for s in states)
    assert [(c.rule.alert, s) for c, s in evaluator.update([view("15m", bad)], t0 + 300)] == [
        ("RankmeterQualityDropFast", "firing")]
    assert evaluator.update([view("15m", usual)], t0 + 360) == []
    assert [s for _, s in evaluator.update([view("15m", bad)], t0 + 420)] == ["pending"]  # held anew


def test_rankmeter_and_prometheus_fire_the_same_minutes(promtool, tmp_path):
    """A differential test: the same minutes of window sums through alerts.Evaluator and
    through the rule file under promtool (annotations left out: the conditions are compared)."""
    minutes = 160

    def window(t: int, queries: float) -> tuple[float, float, float]:
        """(Σ value, queries, Σ value²): nDCG@10 0.85 (sd 0.2), sliding to 0.73 from minute
        90 to 120, back at 0.85 from 135; the traffic breathes."""
        mean = 0.85 - 0.004 * min(max(t - 90, 0), 30) if t < 135 else 0.85
        n = round(queries * (1 + 0.2 * math.sin(t / 7)))
        return mean * n, n, n * (0.04 + mean ** 2)

    sizes = {"15m": 300, "1h": 1200}
    evaluator = alerts.Evaluator()
    firing: dict[int, set[tuple[str, str]]] = {}
    for t in range(minutes):
        views = [WindowView("r", "", w, 0, 0, {"nDCG@10": Sums(s1, n, s1, n, s2)}, {})
                 for w, (s1, n, s2) in ((w, window(t, q)) for w, q in sizes.items())]
        firing[t] = {(c.rule.alert, c.rule.window) for c, state in evaluator.update(views, t * 60.0)
                     if state == "firing"}
    fired = {a for states in firing.values() for a in states}
    assert ("RankmeterQualityDropFast", "15m") in fired and ("RankmeterQualityDrop", "1h") in fired
    assert not firing[80] and not firing[minutes - 1]

    rules = yaml.safe_load(RULES_FILE.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    series = []
    for w in sizes:
        values = [window(t, sizes[w]) for t in range(minutes)]
        labels = f'metric="nDCG@10",ranker="r",segment="",window="{w}"'
        series += [{"series": f'rankmeter_quality_numerator{{{labels},average="macro"}}',
                    "values": " ".join(repr(v[0]) for v in values)},
                   {"series": f'rankmeter_quality_denominator{{{labels},average="macro"}}',
                    "values": " ".join(repr(float(v[1])) for v in values)},
                   {"series": f"rankmeter_quality_squares{{{labels}}}", "values": " ".join(repr(v[2]) for v in values)}]
    series.append({"series": 'rankmeter_ranker_info{ranker="r",role="production"}', "values": f"1x{minutes}"})
    checks = [{"eval_time": f"{t}m", "alertname": alert,
               "exp_alerts": [{"exp_labels": {"severity": "page", "metric": "nDCG@10", "ranker": "r", "window": w}}]
               if (alert, w) in firing[t] else []}
              for t in range(50, minutes) for alert, w in (("RankmeterQualityDropFast", "15m"),
                                                           ("RankmeterQualityDrop", "1h"))]
    (tmp_path / "test.yml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yml"], "evaluation_interval": "1m",
        # As a rule group reads its own earlier rules: the recordings of this minute, then the
        # alerts (by default promtool may evaluate the alert group first, a minute behind).
        "group_eval_order": [g["name"] for g in rules["groups"]],
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}]}))
    out = subprocess.run([promtool, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
