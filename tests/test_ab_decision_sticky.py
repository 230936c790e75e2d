"""What the declared decision keeps over looks (ab/decision.py, issue 21 review F1, F3): a
guardrail or a primary found on the bad side at the stop level stays so when its sequences
later empty (a treatment healthy, then broken), a primary worse at the stop level is never
shipped whatever its ship-level sequence says, and the A/B alert fires on what is exported."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import yaml

from rankmeter.ab.decision import decide
from rankmeter.ab.experiment import ArmView, Comparison, Look
from rankmeter.ab.experiment import look as ab_look
from rankmeter.ab.stats import Estimate, Running
from rankmeter.config import AB
from test_ab_decision import _scrape
from test_prometheus_rules import PROMETHEUS, promtool, run  # noqa: F401 (the fixture)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ab_decision as bench  # noqa: E402

ARMS = [ArmView("base", "", 1000, 500), ArmView("new", "", 1000, 500)]


def _one(look: Look, settings: AB):
    [d] = decide(look, settings)
    return d


def test_a_primary_worse_at_the_stop_level_is_never_shipped_whatever_its_ship_sequence_says():
    """The review's case: nDCG@10's stop sequence [−0.05, −0.01] wholly worse, its narrower
    ship sequence empty, AP better, CTR holding: before, nDCG@10 read `invalid` and the
    decision was `ship`."""
    settings = AB(baseline="base", unit="query", primary=["nDCG@10 increase", "AP increase"], guardrails=["CTR 0.01"])
    e = Estimate(0.0, 0.0, 1e-4)
    look = Look("e", "base", ARMS, [
        Comparison("nDCG@10", "new", "", "macro", e, Running(), 1e-4,
                   {"ship": Running(0.01, -0.03, -0.04), "stop": Running(0.01, -0.05, -0.01)}),
        Comparison("AP", "new", "", "macro", e, Running(), 1e-4,
                   {"ship": Running(0.01, 0.01, 0.03), "stop": Running(0.01, 0.005, 0.04)}),
        Comparison("CTR", "new", "", "macro", e, Running(), 1e-4,
                   {"hold": Running(0.5, -0.005, 0.01), "stop": Running(0.5, -0.008, 0.012)})], {"": 0.5})
    d = _one(look, settings)
    assert d.decision == "do_not_ship"
    assert [(r.declared.metric, r.outcome) for r in d.reasons] == [("nDCG@10", "worse"), ("AP", "better"),
                                                                   ("CTR", "holds")]
    assert (d.reasons[0].lower, d.reasons[0].upper, d.reasons[0].level) == (-0.05, -0.01, 0.05 / 3)
    # and an emptied stop sequence whose upper end lies below 0 is worse too (not invalid)
    emptied = look.comparisons[0]._replace(tests={"ship": Running(0.01, 0.01, -0.04), "stop": Running(0.01, 0.005, -0.01)})
    d = _one(look._replace(comparisons=[emptied, *look.comparisons[1:]]), settings)
    assert d.decision == "do_not_ship" and d.reasons[0].outcome == "worse" and "empty" in d.reasons[0].why
    # an emptied stop sequence on the good side makes no claim for nDCG@10 (no stop): AP ships
    moved_up = look.comparisons[0]._replace(tests={"ship": Running(0.01, 0.05, 0.02), "stop": Running(0.01, 0.04, 0.03)})
    d = _one(look._replace(comparisons=[moved_up, *look.comparisons[1:]]), settings)
    assert d.decision == "ship" and d.reasons[0].outcome == "invalid"


def _break(seed: int, healthy: int, broken: int, factor: float, worse: float = 0.0, every: int = 500) -> list[tuple]:
    """bench/ab_decision.py's A/A world (50/50, 3 primaries, 5 guardrails), healthy for
    `healthy` queries, then the treatment's CTR times `factor` (or, factor > 1, its primaries
    improved by a latent `factor − 1` sd, then worse by `worse` sd): look()+decide() every
    `every` queries. Per look: (queries, decision, CTR's outcome, nDCG@10's outcome, look)."""
    rng = np.random.default_rng(seed)
    q = healthy + broken
    treated = rng.random(q) < 0.5
    z = rng.normal(size=(q, 8))
    if factor > 1:
        x = np.vstack([bench.values(z[:healthy], treated[:healthy], False, factor - 1, 1.0),
                       bench.values(z[healthy:], treated[healthy:], False, -worse, 1.0)])
    else:
        x = np.vstack([bench.values(z[:healthy], treated[:healthy], False, 0.0, 1.0),
                       bench.values(z[healthy:], treated[healthy:], False, 0.0, factor)])
    m, looks = len(bench.METRICS), q // every
    per = np.zeros((q, bench.sums.size(m)))
    slots = per[:, :bench.sums.SLOTS * m].reshape(q, m, bench.sums.SLOTS)
    for k, column in enumerate((np.ones_like(x), x, x * x, x, np.ones_like(x), x * x, np.ones_like(x), x)):
        slots[:, :, k] = column
    per[:, -2:] = 1.0
    cell = (np.arange(q) // every) * 2 + (~treated).astype(int)
    cum = np.cumsum(np.stack([np.bincount(cell, per[:, j], minlength=looks * 2) for j in range(per.shape[1])], -1)
                    .reshape(looks, 2, -1), 0)
    settings = AB(baseline="base", split={"base": 0.5, "new": 0.5}, alpha=bench.ALPHA, primary=bench.PRIMARY,
                  guardrails=bench.GUARDRAILS)
    running: dict[str, str] = {}
    out = []
    for j in range(looks):
        look, kept = ab_look("exp", "base", {("new", ""): cum[j, 0], ("base", ""): cum[j, 1]}, bench.METRICS,
                             settings, running, settled=True)
        running.update(kept)
        look = look._replace(decisions=decide(look, settings))
        [d] = look.decisions
        outcome = {r.declared.metric: r for r in d.reasons}
        out.append(((j + 1) * every, d.decision, outcome["CTR"].outcome, outcome["nDCG@10"].outcome, look))
    return out


def _fires(promtool: str, tmp_path: Path, text: str) -> bool:
    """Whether RankmeterABDoNotShip fires on the exported rankmeter_ab_decision series (held
    for 15 minutes), under promtool with deploy/prometheus/rules.yml."""
    [sample] = [line for line in text.splitlines() if line.startswith('rankmeter_ab_decision{decision="do_not_ship"')]
    series, value = sample.rsplit(" ", 1)
    rules = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)   # the condition is compared, not the text
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    expected = [{"exp_labels": {"severity": "ticket", "experiment": "exp", "treatment": "new"}}]
    test = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": [{"series": series, "values": f"{float(value)}x20"}],
        "alert_rule_test": [{"eval_time": "15m", "alertname": "RankmeterABDoNotShip",
                             "exp_alerts": expected}]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    return run(promtool, "test", "rules", "test.yml", cwd=tmp_path).returncode == 0


def test_a_guardrail_that_breaks_mid_experiment_stops_it_for_good_and_the_alert_fires(promtool, tmp_path):
    """20,000 healthy queries (CTR holds), then the treatment's CTR falls to a fifth (30% to
    6%, against a margin of 10%): before, CTR turned `invalid` (its stop sequence emptied with
    its lower end kept above −margin) and the decision stayed keep_running, no alert."""
    history = _break(seed=0, healthy=20_000, broken=20_000, factor=0.2)
    ctr = [o for _, _, o, _, _ in history]
    assert "holds" in ctr[:40]                      # healthy: non-inferior first
    first = next(i for i, (_, d, *_) in enumerate(history) if d == "do_not_ship")
    assert history[first][0] > 20_000 and ctr[first] == "failed"
    assert all(d == "do_not_ship" for _, d, *_ in history[first:])   # final, emptied or not
    last = history[-1][4]
    reason = next(r for r in last.decisions[0].reasons if r.declared.metric == "CTR")
    assert reason.outcome == "failed" and "empty" in reason.why and reason.upper < 0
    assert _fires(promtool, tmp_path, _scrape(last))
    assert not _fires(promtool, tmp_path, _scrape(history[30][4]))   # while healthy it does not fire


def test_a_primary_better_then_worse_ends_in_do_not_ship_not_ship():
    """The primaries better by 0.1 sd for 20,000 queries (ship), then worse by 0.3 sd: the
    ship is withdrawn, and once a primary's stop-level upper end is below 0, do_not_ship."""
    history = _break(seed=1, healthy=20_000, broken=30_000, factor=1.1, worse=0.3)
    decisions = [d for _, d, *_ in history]
    assert "ship" in decisions[:40]
    first = decisions.index("do_not_ship")
    assert all(d == "do_not_ship" for d in decisions[first:])
    assert history[-1][3] == "worse"
