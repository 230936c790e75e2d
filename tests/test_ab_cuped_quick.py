"""Quick, seeded subset of bench/ab_decision.py's CUPED cells (issue 21, part 2): with
persistent query-text difficulty (persistence 0.5) CUPED removes at least a fifth of
nDCG@10's variance; with none it removes nothing (|VR| < 0.05), and the lines end as the
bench's do. The same per user bucket with the user covariate (each query's covariate its
user's pre-period mean, users' persistence 0.2). The full-size runs: docs/benchmarks.md."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ab_decision  # noqa: E402

LINE = re.compile(r"pre_corr=(-?[\d.]+) .* false_ship=\S+( \[[\d.]+, [\d.]+\])? false_stop=\S+( \[[\d.]+, [\d.]+\])? "
                  r"variance_reduction=(-?[\d.]+)$")


def measured(names: tuple[str, ...], seed: int) -> dict[str, tuple[float, float]]:
    """name -> (pre_corr, variance_reduction) as the bench's line prints them."""
    found = {}
    for name in names:
        r = ab_decision.run(name, 6, 3000, seed=seed)
        text = ab_decision.line(name, r, 3000)
        print(text)
        match = LINE.search(text)
        assert match, text
        found[name] = float(match.group(1)), float(match.group(4))
    return found


def test_cuped_reduces_the_variance_with_a_persistent_covariate_and_not_without():
    found = measured(("aa_cuped", "no_persistence"), seed=2121)
    assert found["aa_cuped"][0] > 0.4 and found["aa_cuped"][1] >= 0.2
    assert abs(found["no_persistence"][0]) < 0.05 and abs(found["no_persistence"][1]) < 0.05


def test_the_user_covariate_reduces_the_variance_per_user_bucket_when_users_persist():
    """By user (cluster-robust over buckets), 3,000 queries: VR about 0.19 (it grows with
    the experiment's size, as heavy users' sums dominate the variance)."""
    found = measured(("aa_cuped_user", "no_persistence_user"), seed=2122)
    assert found["aa_cuped_user"][0] > 0.15 and found["aa_cuped_user"][1] >= 0.1
    assert abs(found["no_persistence_user"][0]) < 0.05 and abs(found["no_persistence_user"][1]) < 0.05
