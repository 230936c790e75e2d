"""The alert-quality replay, small and seeded (bench/alert_quality.py): 36 hours of
simulated traffic with its daily cycle through Kafka, `rankmeter serve --event-clock` and
Redis, the shipped rule file evaluated by the real Prometheus over the backfilled history.
An nDCG@10 drop of about a fifth at the evening peak on the 1,000 queries/h ranker pages
within 30 minutes; nothing else pages, the 20 queries/h canary included."""

import shutil
import sys
from pathlib import Path

import pytest

from conftest import IN_CI

pytestmark = [pytest.mark.integration, pytest.mark.long]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import alert_quality as aq  # noqa: E402

from rankmeter.simulator.history import DAY_MS, HOUR_MS  # noqa: E402
from rankmeter.simulator.regressions import Regression  # noqa: E402


def evening_regression(start_ms: int) -> list[aq.Injected]:
    """Every list degraded from the first 19:00 UTC at least 20 hours in, for 2 hours."""
    begin = start_ms + 20 * HOUR_MS
    begin += (19 * HOUR_MS - begin % DAY_MS) % DAY_MS
    regression = Regression((begin - start_ms) / 1000, 2 * 3600, aq.BIG, "ranking", 1.0)
    return [aq.Injected("nDCG@10 -21%", begin, begin + 2 * HOUR_MS, regression)]


def test_a_real_drop_pages_within_half_an_hour_and_noise_does_not(kafka_bootstrap, redis_url, tmp_path):
    for binary in ("prometheus", "promtool"):
        if shutil.which(binary) is None:
            message = f"{binary} is not installed (scripts/services.sh install brings Debian's prometheus)"
            if IN_CI:
                pytest.fail(message)
            pytest.skip(message)
    result = aq.measure(seed=5, days=1.5, peak=1000, canary_peak=20, bootstrap=kafka_bootstrap,
                        redis_url=redis_url, keep=tmp_path, plan=evening_regression)
    report = "\n".join(result.lines)
    [delay] = result.delays.values()
    assert delay is not None and delay <= 30 * 60_000, report
    assert result.false_pages == [], report
    # The pages are the quality alerts on the regressed ranker ...
    pages = [f for f in result.firings if f.severity == "page"]
    assert {(f.alert in aq.QUALITY_ALERTS, f.labels.get("ranker")) for f in pages} == {(True, aq.BIG)}, report
    # ... and the report ends with the three figures.
    assert [line.split("=")[0] for line in result.lines[-3:]] == [
        "false_pages_per_week", "missed_regressions", "median_detection_minutes"]
