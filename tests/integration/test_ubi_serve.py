"""OpenSearch UBI as its own tools write it, through the real Kafka, `rankmeter serve` and
Redis (issue 12): the UBI data generator's records (query records without hit ids, one
`impression` event per shown product with a 0-based ordinal), the JavaScript collector's
(an empty `query_response_hit_ids`, `position.index`) and `event_attributes.rank` give
exactly the per-ranker metrics of the equivalent native events, also when the service is
killed while lists are being assembled."""

from __future__ import annotations

import signal
import time
import uuid

import pytest
import redis

from ubi_shapes import SHAPES, event_ms, in_time_order, native, searches

from serving import Serve, produce, unique_topics, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.long]


def sums_of(serve: Serve) -> dict[tuple, float]:
    """Every exported sum, by its labels: the exact state of the aggregates."""
    return {(name, labels): value for (name, labels), value in serve.metrics().items()
            if name in ("rankmeter_quality_numerator", "rankmeter_quality_denominator", "rankmeter_queries")}


def send(bootstrap: str, topics, stream) -> None:
    produce(bootstrap, topics.impressions, [(key, record) for kind, key, record in stream if kind == "impressions"])
    produce(bootstrap, topics.feedback, [(key, record) for kind, key, record in stream if kind == "feedback"])


def expected_events(queries, shape: bool) -> int:
    clicks = sum(len(q.clicks) for q in queries)
    return len(queries) + clicks + (sum(len(q.shown) for q in queries) if shape else 0)


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-9 for k in b)


def test_ubi_records_as_the_generator_and_the_collector_write_them_equal_native_events(
        kafka_bootstrap, redis_url, tmp_path):
    now = int(time.time() * 1000) - 30_000  # every list's settle time has passed on the wall clock
    queries = {shape: searches(seed, 80, now, rankers=(f"{shape}-a", f"{shape}-b"))
               for seed, shape in enumerate(sorted(SHAPES))}
    ubi_topics, native_topics = unique_topics(kafka_bootstrap), unique_topics(kafka_bootstrap)
    run = uuid.uuid4().hex[:6]
    ubi = Serve(kafka_bootstrap, redis_url, ubi_topics, f"g-{run}-ubi", f"rm-{run}-ubi",
                log_path=tmp_path / "ubi.log")
    reference = Serve(kafka_bootstrap, redis_url, native_topics, f"g-{run}-native", f"rm-{run}-native",
                      log_path=tmp_path / "native.log")
    # The three shapes' searches interleaved in time, as one site would send them.
    stream = in_time_order([item for shape, qs in queries.items() for item in SHAPES[shape](qs)])
    # Killed between two searches (a second apart at least) with lists open: a query cut in
    # two by a pause longer than windows.list_settle would settle with part of its list.
    times = sorted(q.timestamp_ms for qs in queries.values() for q in qs)
    cut = next((a + b) // 2 for a, b in zip(times[len(times) // 2:], times[len(times) // 2 + 1:]) if b - a > 1_000)
    half = sum(1 for _, _, record in stream if event_ms(record) < cut)
    with ubi.start(create_topics=None), reference.start(create_topics=None):
        send(kafka_bootstrap, ubi_topics, stream[:half])
        # Killed halfway, with lists open: the restarted service finds them in Redis.
        wait_until(lambda: sum(ubi.events().values()) > 0, 60, "the first half to be consumed")
        ubi.stop(signal.SIGKILL)
        ubi.start(create_topics=None)
        send(kafka_bootstrap, ubi_topics, stream[half:])
        send(kafka_bootstrap, native_topics, [item for qs in queries.values() for item in native(qs)])
        reference.wait_for_events(sum(expected_events(qs, False) for qs in queries.values()))
        # The killed process took its counters with it: wait on the aggregates themselves,
        # both scraped together each time (windows end now: a query whose minute leaves the
        # 5m or 15m window between a scrape of one and a later one of the other differs).
        scraped: dict[str, dict] = {}

        def same() -> bool:
            scraped["got"], scraped["want"] = sums_of(ubi), sums_of(reference)
            return _close(scraped["got"], scraped["want"])

        wait_until(same, 120, "the UBI aggregates to reach the native ones")
        got, want = scraped["got"], scraped["want"]
        events = ubi.events()
        assert events[("feedback", "listed")] > 0
        client = redis.Redis.from_url(redis_url)
        metas = list(client.scan_iter(match=f"rm-{run}-ubi:*:meta"))
        assert len(metas) == 4 and all(client.hget(m, "mark") for m in metas)
        assert not [f for m in metas for f in client.hkeys(m) if f.startswith(b"list:")], "every list settled"
        assert ("feedback", "late") not in events and ("feedback", "orphaned") not in events
    assert len(want) > 6 * 4 * 10, "every ranker, window and measure exported"
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-9), key
