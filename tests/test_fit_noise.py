"""The calibration check does not withdraw position-based traffic on its noise (issue: a
flaky tests/integration/test_dashboards.py): its traffic in process (bench/fit_noise.py's
`serve` mode: `rankmeter simulate --rate 400 --duration 15`'s simulator, seed 7, through
the `Pipeline` with the test's settings, a look every 5 s), judged at every look. The rate
over many runs is measured there (docs/debiasing.md, "The fit test")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fit_noise  # noqa: E402

from rankmeter.debias.fit import CALIBRATION_Z, MIN_EXPECTED  # noqa: E402

NOW, OLD = (CALIBRATION_Z, MIN_EXPECTED), (0.0, 30.0)  # the rule, and the one before the fix

RUNS = range(1, 9)  # run ids (query ids, held-out queries, the looks' phase): the same traffic


@pytest.fixture(scope="module")
def runs() -> list[fit_noise.Chains]:
    return [fit_noise.run_serve(run, [OLD, NOW], 400, 15, traffic_seed=7) for run in RUNS]


def test_the_dashboards_traffic_is_not_withdrawn_as_a_poor_fit(runs):
    for run in runs:
        reasons = run.reasons[NOW]
        assert "ok" in reasons and "poor_fit" not in reasons, reasons
        # and exported at the end, as the dashboards test needs it (no other check withdrew it)
        assert reasons[-1] == "ok", reasons
        # judged: the calibration had its 30 expected clicks at some look
        assert any(m < float("inf") for m in run.margins)


def test_without_the_noise_margin_some_would_be(runs):
    # The old rule (no margin) withdrew about 3 runs in 10 of this traffic (bench/fit_noise.py:
    # 31% of 400; run 1 of these 8 today): what made the dashboards' test flaky. Not pinned to
    # which runs, only that the traffic is one the margin matters for.
    withdrawn = [run_id for run_id, run in zip(RUNS, runs) if "poor_fit" in run.reasons[OLD]]
    assert withdrawn, "the old rule withdrew none of these runs: the test no longer shows the margin's effect"
