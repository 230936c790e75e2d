"""The verdict of `rankmeter report --ab` (ab/report.py) takes its side from the running
confidence sequence, never from the current delta (issue 20): the running p-value is a
minimum over looks and the sequence an intersection, while the delta moves at every look."""

from __future__ import annotations

import math

import numpy as np

from rankmeter.ab.experiment import Comparison, Look
from rankmeter.ab.report import verdict
from rankmeter.ab.stats import Estimate, MeanSums, Running, mean_difference, msprt, update

ALPHA = 0.05


def judged(metric: str, delta: float, running: Running, srm: float = 0.5) -> str:
    c = Comparison(metric, "new", "", "macro", Estimate(delta, math.nan, 1e-4), running)
    return verdict(c, Look("e", "base", [], [c], {"": srm}), ALPHA)


def test_the_side_of_the_running_sequence_decides_not_the_current_delta():
    above = Running(0.01, 0.002, 0.04)   # significant earlier, on the positive side
    assert judged("nDCG@10", -0.001, above) == "better"      # the delta crossed 0 since
    assert judged("FirstClickRank", -0.001, above) == "worse"  # higher is worse there
    below = Running(0.01, -0.04, -0.002)
    assert judged("nDCG@10", +0.001, below) == "worse"
    assert judged("Abandonment", +0.001, below) == "better"
    assert judged("nDCG@10", 0.03, Running(0.2, -0.01, 0.05)) == "inconclusive"
    assert judged("nDCG@10", 0.03, Running(0.04, 0.0, 0.05)) == "inconclusive"   # 0 not excluded
    assert judged("nDCG@10", 0.03, Running(0.001, 0.02, 0.01)) == "invalid: empty confidence sequence"
    assert judged("nDCG@10", 0.03, Running(0.001, 0.02, 0.05), srm=0.01) == "invalid: SRM"
    assert judged("nDCG@10", math.nan, Running()) == "inconclusive"


def test_the_sequence_excludes_0_exactly_when_the_running_p_is_below_alpha():
    """What makes the sequence's side a verdict at all: along any run of looks, the running
    intersection excludes 0 if and only if the running minimum p is below alpha."""
    rng = np.random.default_rng(3)
    agreed = significant = 0
    for _ in range(300):
        effect = rng.choice([0.0, 0.01, -0.02])
        running, sums = Running(), [MeanSums(0, 0.0, 0.0), MeanSums(0, 0.0, 0.0)]
        for _ in range(20):
            for arm, mu in ((0, 0.3 + effect), (1, 0.3)):
                x = np.clip(rng.normal(mu, 0.3, 200), 0, 1)
                n, s, s2 = sums[arm]
                sums[arm] = MeanSums(n + x.size, s + x.sum(), s2 + (x ** 2).sum())
            running = update(running, msprt(mean_difference(*sums), alpha=ALPHA))
            excludes = running.ci_lower > 0 or running.ci_upper < 0
            assert excludes == (running.p_value < ALPHA), running
            agreed += 1
            significant += excludes
    assert agreed == 6000 and 300 < significant < 5700   # both cases seen, many times
