"""bench/summary.py's judgement of issue 24's freshness row "with the harvest on": met only
if the position-bias harvest ran during the level (bench_freshness records how many queries
it harvested); a run whose traffic never harvested is not a measurement of it."""

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("bench_summary", Path(__file__).resolve().parent.parent / "bench" / "summary.py")
summary = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(summary)


def harvest_row(harvested: float | None) -> tuple[str, str, str, str]:
    figures = {"p99_ms_at_80pct": 200.0, "p50_ms_at_80pct": 50.0, "rate_80pct": 30_000.0, "probes_at_80pct": 500,
               "p99_ms_at_5000": 100.0, "p50_ms_at_5000": 40.0, "probes_at_5000": 500}
    if harvested is not None:
        figures["harvested_at_80pct"] = harvested
    rows = summary.rows({"freshness": {"backends": {"confluent": figures}}})
    (row,) = [r for r in rows if "harvest on" in r[0] and "confluent" in r[0]]
    return row


def test_the_harvest_on_row_is_met_only_if_the_harvest_ran():
    assert harvest_row(1234)[2] == "met"
    assert "1,234 queries harvested" in harvest_row(1234)[1]
    assert harvest_row(0)[2] == "unmeasured (no harvest)"
    assert harvest_row(None)[2] == "unmeasured (no harvest)"  # a run from before it was recorded
