"""Quick, seeded subset of bench/ab_decision.py's CUPED cells (issue 21, part 2): with
persistent query-text difficulty (persistence 0.5) CUPED removes at least a fifth of
nDCG@10's variance; with none it removes nothing (|VR| < 0.05), and the lines end as the
bench's do. The full-size runs: docs/benchmarks.md."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ab_decision  # noqa: E402

LINE = re.compile(r"pre_corr=(-?[\d.]+) .* false_ship=\S+( \[[\d.]+, [\d.]+\])? false_stop=\S+( \[[\d.]+, [\d.]+\])? "
                  r"variance_reduction=(-?[\d.]+)$")


def test_cuped_reduces_the_variance_with_a_persistent_covariate_and_not_without():
    found = {}
    for name in ("aa_cuped", "no_persistence"):
        r = ab_decision.run(name, 6, 3000, seed=2121)
        text = ab_decision.line(name, r, 3000)
        print(text)
        match = LINE.search(text)
        assert match, text
        found[name] = float(match.group(1)), float(match.group(4))
    assert found["aa_cuped"][0] > 0.4 and found["aa_cuped"][1] >= 0.2
    assert abs(found["no_persistence"][0]) < 0.05 and abs(found["no_persistence"][1]) < 0.05
