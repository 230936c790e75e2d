"""rankmeter's own evaluation of the quality alerts (what the demo shows) is the rule
file's: the same constants, rules, bounds and `for:` semantics."""

import math
import re
from pathlib import Path

import pytest
import yaml

from rankmeter import alerts
from rankmeter.windows import Sums, WindowView

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
    return next(c for c in found if c.rule.alert == "RankmeterQualityDropFast")


def test_the_bound_is_the_larger_of_the_margin_and_z_standard_errors():
    day = [0.8, 0.9] * 400                      # the rest of the day: mean 0.85, sd 0.05
    for now, margin_binds in (([0.78, 0.82] * 60, True), ([0.0, 1.6] * 60, False)):
        found = alerts.conditions([view("15m", now), view("24h", day + now)])
        c = fast(found)
        mean, n = 0.8, len(now)
        sd = math.sqrt(sum((v - mean) ** 2 for v in now) / n)
        z_band = alerts.Z_SCORE * math.hypot(sd / math.sqrt(n), 0.05 / math.sqrt(len(day)))
        assert c.baseline == pytest.approx(0.85)
        assert c.bound == pytest.approx(0.85 - max(alerts.MARGIN * 0.85, z_band))
        assert (alerts.MARGIN * 0.85 > z_band) == margin_binds
        assert c.value == pytest.approx(mean) and c.holds == (mean < c.bound)


def test_just_past_the_bound_holds_just_short_does_not_and_few_queries_never():
    day = [0.85] * 800
    # With no spread the bound is the margin's: 0.85 × 0.95 = 0.8075.
    below, above = [0.807] * 100, [0.808] * 100
    assert fast(alerts.conditions([view("15m", below), view("24h", day + below)])).holds
    assert not fast(alerts.conditions([view("15m", above), view("24h", day + above)])).holds
    few = [0.1] * 99  # far below, on one query too few
    assert not fast(alerts.conditions([view("15m", few), view("24h", day + few)])).holds
    # Segments are summed: two halves of 50 queries are 100.
    halves = [view("15m", [0.807] * 50, segment="a"), view("15m", [0.807] * 50, segment="b"),
              view("24h", day + below)]
    assert fast(alerts.conditions(halves)).holds
    # A rest of the day on fewer queries than an alert needs is no baseline.
    assert not [c for c in alerts.conditions([view("15m", below), view("24h", [0.85] * 99 + below)])
                if c.rule.alert == "RankmeterQualityDropFast"]


def test_pending_until_the_rules_for_then_firing_and_gone_when_it_stops_holding():
    day, bad = [0.85] * 800, [0.5] * 100
    holding = alerts.conditions([view("15m", bad), view("24h", day + bad)])
    quiet = alerts.conditions([view("15m", day[:100]), view("24h", day + day[:100])])
    watch = alerts.Watch()
    states = [(t, [(c.rule.alert, s) for c, s in watch.update(holding, t)]) for t in (0, 60, 299)]
    assert all(s == [("RankmeterQualityDropFast", "pending")] for _, s in states)
    assert [(c.rule.alert, s) for c, s in watch.update(holding, 300)] == [("RankmeterQualityDropFast", "firing")]
    assert watch.update(quiet, 360) == []
    assert [s for _, s in watch.update(holding, 420)] == ["pending"]  # held anew from 420
