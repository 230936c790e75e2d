"""Quick, seeded subset of bench/ab_decision.py (issue 21): A/A experiments with three
primaries and five guardrails through the service's own look and decision, looked at every
100 queries: the upper Clopper–Pearson bound of the false-ship and false-stop rates is at
most α = 0.05. The full-size runs (500 experiments a configuration, 20,000 queries):
docs/benchmarks.md."""

from __future__ import annotations

import sys
from pathlib import Path

from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ab_decision  # noqa: E402

EXPERIMENTS, QUERIES = 80, 2500   # 0 of 80: upper bound 4.5%


def upper(k: int, n: int) -> float:
    return stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact").high


def test_aa_false_ship_and_false_stop_rates_stay_below_alpha():
    r = ab_decision.run("aa_correlated", EXPERIMENTS, QUERIES, seed=2112)
    print(ab_decision.line("aa_correlated", r, QUERIES))
    assert upper(r["ships"], EXPERIMENTS) <= 0.05
    assert upper(r["stops"], EXPERIMENTS) <= 0.05


def test_a_guardrail_regression_is_stopped_and_never_shipped():
    """CTR down 25% against a margin of 10%, 12 experiments of 12,000 queries."""
    r = ab_decision.run("guardrail", 12, 12_000, seed=2113)
    print(ab_decision.line("guardrail", r, 12_000))
    assert r["stops"] >= 9 and r["ships"] == 0
