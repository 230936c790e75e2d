"""The declared decision (ab/declared.py, ab/decision.py): each verdict and each boundary of
the rule, the levels the error control needs, the relative margin tested as T − (1 − m)·B,
the settings' validation, the exported series and the report."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rankmeter.ab import declared
from rankmeter.ab.decision import decide
from rankmeter.ab.experiment import ArmView, Comparison, Look
from rankmeter.ab.experiment import look as ab_look
from rankmeter.ab.export import experiment_metrics
from rankmeter.ab.report import decisions_json, table
from rankmeter.ab.stats import Estimate, MeanSums, Running, mean_difference, msprt, update
from rankmeter.config import AB, ConfigError, load

PRIMARY = ["nDCG@10 increase", "AP increase"]
GUARDRAILS = ["Abandonment 0.02", "CTR micro 5%", "FirstClickRank 0.5"]   # k = 2, g = 3
SETTINGS = AB(baseline="base", unit="query", primary=PRIMARY, guardrails=GUARDRAILS)
HOLDS = Running(0.5, -0.03, 0.01)   # Abandonment (lower is better, margin 0.02): oriented [−0.01, +0.03] + 0.02


def comparison(metric: str, average: str = "macro", good: Running = Running(0.5, -0.01, 0.01),
               stop: Running | None = None, segment: str = "") -> Comparison:
    name = "ship" if metric in ("nDCG@10", "AP") else "hold"
    return Comparison(metric, "new", segment, average, Estimate(0.0, 0.0, 1e-4), good, 1e-4,
                      {name: good, "stop": stop or good})


def world(**override: Comparison | None) -> list[Comparison]:
    """Every declared metric inconclusive / holding, then the overrides (None: no statistics)."""
    cs = {"nDCG@10": comparison("nDCG@10"), "AP": comparison("AP"),
          "Abandonment": comparison("Abandonment", good=HOLDS),
          "CTR": comparison("CTR", "micro", good=Running(0.5, 0.001, 0.05)),        # T − 0.95·B > 0
          "FirstClickRank": comparison("FirstClickRank", good=Running(0.5, -0.2, 0.3))}  # within 0.5
    cs.update(override)
    return [c for c in cs.values() if c is not None]


def decision(comparisons: list[Comparison], srm: float = 0.5, settings: AB = SETTINGS) -> str:
    arms = [ArmView("base", "", 1000, 500), ArmView("new", "", 1000, 500)]
    [d] = decide(Look("e", "base", arms, comparisons, {"": srm}), settings)
    return d.decision


def test_levels_bonferroni_over_primaries_to_ship_over_everything_to_stop_none_to_hold():
    at = declared.levels(declared.parse(PRIMARY, GUARDRAILS), 0.05)
    assert at == (0.025, 0.05, 0.01)   # α/k, α, α/(k + g)
    tests = declared.tests(declared.parse(PRIMARY, GUARDRAILS), 0.05)
    assert tests[("nDCG@10", "macro")] == {"ship": (0.025, 1.0), "stop": (0.01, 1.0)}
    assert tests[("CTR", "micro")] == {"hold": (0.05, 0.95), "stop": (0.01, 0.95)}        # T − 0.95·B
    assert declared.scale(declared.parse(["AP increase"], ["Abandonment 10%"])[1]) == pytest.approx(1.1)


def test_each_verdict():
    better = Running(0.001, 0.004, 0.03)
    assert decision(world()) == "keep_running"
    assert decision(world(AP=comparison("AP", good=better))) == "ship"
    assert decision(world(AP=comparison("AP", good=better)), srm=0.01) == "invalid_srm"
    worse = Running(0.001, -0.03, -0.004)
    assert decision(world(AP=comparison("AP", good=worse))) == "do_not_ship"
    failed = Running(0.001, 0.025, 0.06)  # Abandonment up by more than its margin 0.02
    assert decision(world(AP=comparison("AP", good=better), Abandonment=comparison("Abandonment", good=failed))) \
        == "do_not_ship"
    assert decision(world(AP=comparison("AP", good=better)), settings=AB(baseline="base", unit="query")) \
        == "undeclared"


def test_boundaries():
    better = Running(0.001, 0.004, 0.03)
    ship = comparison("AP", good=better)
    # a primary's ship sequence touching 0 is not better
    assert decision(world(AP=comparison("AP", good=Running(0.02, 0.0, 0.03)))) == "keep_running"
    # lower is better: FirstClickRank's better is down, a guardrail's margin is added
    assert decision(world(AP=ship, FirstClickRank=comparison("FirstClickRank", good=Running(0.5, -0.2, 0.49)))) == "ship"
    assert decision(world(AP=ship, FirstClickRank=comparison("FirstClickRank", good=Running(0.5, -0.2, 0.5)))) \
        == "keep_running"
    assert decision(world(AP=ship, FirstClickRank=comparison("FirstClickRank", good=Running(0.5, 0.5, 0.9),
                                                             stop=Running(0.5, 0.50001, 0.9)))) == "do_not_ship"
    # a relative guardrail is decided on T − 0.95·B: its sequence must lie above 0
    assert decision(world(AP=ship, CTR=comparison("CTR", "micro", good=Running(0.5, 0.0, 0.05)))) == "keep_running"
    # one guardrail without statistics yet: no ship
    assert decision(world(AP=ship, CTR=None)) == "keep_running"
    # the worse side is read on the stricter stop sequence, not the ship one
    assert decision(world(AP=comparison("AP", good=Running(0.02, -0.03, -0.001), stop=Running(0.02, -0.04, 0.002)))) \
        == "keep_running"
    # a primary better and another worse: do not ship
    assert decision(world(AP=ship, **{"nDCG@10": comparison("nDCG@10", good=Running(0.001, -0.03, -0.004))})) \
        == "do_not_ship"
    # the SRM boundary: a p-value of exactly α is not a mismatch
    assert decision(world(AP=ship), srm=0.05) == "ship"
    # an empty sequence makes no claim
    assert decision(world(AP=comparison("AP", good=Running(0.001, 0.03, 0.004)))) == "keep_running"


def _arm_vector(rng: np.random.Generator, n: int, mean: float) -> np.ndarray:
    """One measure (an A/B definition of one slot): [n, Σx, Σx², Σy, Σz, Σy², Σz², Σyz, queries, judged]."""
    x = np.clip(rng.normal(mean, 0.3, n), 0, 1)
    return np.array([n, x.sum(), (x * x).sum(), x.sum(), n, (x * x).sum(), n, x.sum(), n, n], dtype=float)


def test_the_look_keeps_each_test_at_its_level_and_tests_a_relative_margin_on_t_minus_scaled_b():
    rng = np.random.default_rng(5)
    vectors = {("base", ""): _arm_vector(rng, 2000, 0.30), ("new", ""): _arm_vector(rng, 2000, 0.33)}
    ab = AB(baseline="base", unit="query", primary=["nDCG@10 increase"], guardrails=[], mixture_variance=1e-4)
    look, kept = ab_look("e", "base", vectors, ["nDCG@10"], ab, {})
    [c] = [c for c in look.comparisons if c.average == "macro"]
    t, b = (MeanSums(*vectors[k][:3]) for k in (("new", ""), ("base", "")))
    assert c.tests["ship"] == msprt(mean_difference(t, b), 1e-4, 0.05)[:]     # k = 1: α
    assert c.tests["stop"] == update(Running(), msprt(mean_difference(t, b), 1e-4, 0.05))
    assert decide(look, ab)[0].decision == "ship"
    # a relative guardrail (10% of the baseline): treatment − 0.9·baseline, its own variance
    ab = AB(baseline="base", unit="query", primary=["AP increase"], guardrails=["nDCG@10 10%"], mixture_variance=1e-4)
    look, kept = ab_look("e", "base", vectors, ["nDCG@10", "AP"][:1] + [None], ab, {})
    [c] = [c for c in look.comparisons if c.average == "macro"]
    scaled = MeanSums(b.n, 0.9 * b.sum_x, 0.81 * b.sum_x2)
    want = msprt(mean_difference(t, scaled), 1e-4, 0.05 / 2)
    assert c.tests["stop"] == Running(*want)
    assert c.tests["hold"] == Running(*msprt(mean_difference(t, scaled), 1e-4, 0.05))
    assert c.tests["hold"] != Running(*msprt(mean_difference(t, b), 1e-4, 0.05))
    # kept with the running statistics, under a field naming the test, its level and scale
    assert f"nDCG@10\x1fnew\x1f\x1fmacro\x1fstop\x1f{0.025!r}\x1f{0.9!r}" in kept
    # and read back as a running intersection at the next look
    again, _ = ab_look("e", "base", vectors, ["nDCG@10", None], ab,
                       {f"nDCG@10\x1fnew\x1f\x1fmacro\x1fhold\x1f{0.05!r}\x1f{0.9!r}": "0.5 -0.5 0.05 0.0001"})
    [again_c] = [c for c in again.comparisons if c.average == "macro"]
    assert again_c.tests["hold"] == update(Running(0.5, -0.5, 0.05), msprt(mean_difference(t, scaled), 1e-4, 0.05))
    assert again_c.tests["hold"].ci_upper == 0.05 and again_c.tests["stop"] == c.tests["stop"]


@pytest.mark.parametrize("primary, guardrails, problem", [
    ("nDCG@11 increase", "", "ab.primary: 'nDCG@11' is not a measure"),
    ("nDCG@10", "", "ab.primary: 'nDCG@10': expected METRIC"),
    ("nDCG@10 up", "", "ab.primary: 'nDCG@10 up': expected METRIC"),
    ("nDCG@10 increase", "CTR 0", "ab.guardrails: 'CTR 0': the margin must be > 0"),
    ("nDCG@10 increase", "CTR -1%", "ab.guardrails: 'CTR -1%': the margin must be > 0"),
    ("nDCG@10 increase", "CTR 100%", "below 100%"),
    ("nDCG@10 increase", "CTR x", "is not a number"),
    ("nDCG@10 increase", "CTR", "expected METRIC [macro|micro] [increase|decrease] MARGIN"),
    ("nDCG@10 increase", "nDCG@10 micro 1%", "ab.guardrails: nDCG@10 is declared both a primary and a guardrail"),
    ("nDCG@10 increase,nDCG@10 decrease", "", "ab.primary: nDCG@10 is declared twice"),
    ("", "CTR 1%", "ab.guardrails: needs ab.primary"),
])
def test_invalid_declarations_are_one_line_config_errors_naming_the_setting(primary, guardrails, problem):
    env = {"RANKMETER_AB_PRIMARY": primary, "RANKMETER_AB_GUARDRAILS": guardrails}
    with pytest.raises(ConfigError) as e:
        load(environ=env)
    assert problem in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("invalid configuration: ab.")


def test_declarations_from_the_environment():
    s = load(environ={"RANKMETER_AB_PRIMARY": "nDCG@10 increase, FirstClickRank decrease",
                      "RANKMETER_AB_GUARDRAILS": "CTR micro 2%,Abandonment 0.01"}).ab
    d = declared.parse(s.primary, s.guardrails)
    assert [(x.metric, x.average, x.role, x.better, x.margin, x.relative) for x in d] == [
        ("nDCG@10", "macro", "primary", 1, math.nan, False)[:4] + (d[0].margin, False),
        ("FirstClickRank", "macro", "primary", -1, d[1].margin, False),
        ("CTR", "micro", "guardrail", 1, 2.0, True), ("Abandonment", "macro", "guardrail", -1, 0.01, False)]


def _scrape(look: Look) -> str:
    class One:
        def collect(self):
            yield from experiment_metrics(look)
    registry = CollectorRegistry()
    registry.register(One())
    return generate_latest(registry).decode()


def test_exported_decision_and_roles():
    better = Running(0.001, 0.004, 0.03)
    comparisons = world(AP=comparison("AP", good=better)) + [comparison("RR"), comparison("AP", "micro")]
    arms = [ArmView("base", "", 1000, 500), ArmView("new", "", 1000, 500)]
    look = Look("exp1", "base", arms, comparisons, {"": 0.5})
    look = look._replace(decisions=decide(look, SETTINGS))
    text = _scrape(look)
    for name in declared.DECISIONS:
        value = 1.0 if name == "ship" else 0.0
        assert f'rankmeter_ab_decision{{decision="{name}",experiment="exp1",segment="",treatment="new"}} {value}' in text
    assert 'rankmeter_ab_delta{average="macro",baseline="base",metric="AP",ranker="new",role="primary",segment=""}' in text
    assert 'role="guardrail",segment=""' in text.split('metric="CTR"')[1].split("\n")[0]
    assert 'rankmeter_ab_p_value{average="macro",baseline="base",metric="RR",ranker="new",role="exploratory"' in text
    assert 'rankmeter_ab_p_value{average="micro",baseline="base",metric="AP",ranker="new",role="exploratory"' in text


def test_report_shows_the_decision_with_each_declared_metric():
    better = Running(0.001, 0.004, 0.03)
    arms = [ArmView("base", "", 1000, 500), ArmView("new", "", 1000, 500)]
    look = Look("exp1", "base", arms, world(AP=comparison("AP", good=better), CTR=None), {"": 0.5})
    look = look._replace(decisions=decide(look, SETTINGS))
    text = table(look, 0.05)
    assert "new               -         KEEP_RUNNING" in text
    ap = next(line for line in text.splitlines() if line.strip().startswith("primary") and " AP " in line)
    assert "[+0.0040, +0.0300] at 0.025" in ap and "better" in ap
    ctr = next(line for line in text.splitlines() if "CTR" in line and "guardrail" in line)
    assert "margin 5%" in ctr and "waiting" in ctr
    ab = next(line for line in text.splitlines() if "Abandonment" in line and "guardrail" in line)
    assert "[+0.0100, +0.0500] at 0.05" in ab and "holds" in ab and "margin 0.02" in ab   # oriented, + margin
    [d] = json.loads(json.dumps(decisions_json(look)))
    assert d["decision"] == "keep_running" and [r["role"] for r in d["reasons"]] == ["primary"] * 2 + ["guardrail"] * 3
