"""History replays: `serve` on the event clock (now = the newest record consumed) puts
windows where the replayed traffic is; /metrics carries the ranker roles the alerts read
and the consumer lag in seconds of event time."""

import json
import threading
import time
import urllib.request

import msgspec

from prometheus_client.parser import text_string_to_metric_families

from rankmeter import config
from rankmeter.clock import EventClock
from rankmeter.serve import run
from rankmeter.source import Bus, Record
from rankmeter.store import MemoryStore

# 30 s into a minute: windows are whole minutes ending with now's (windows.window_views), and
# now, the last click 2 s after the last query, must stay in that query's minute; off the
# minute's start, so that a bucket rounded the wrong way would show.
WEEK_AGO_MS = int(time.time() * 1000) // 60_000 * 60_000 + 30_000 - 7 * 86_400_000 + 3_600_000


def test_the_event_clock_follows_the_newest_record_and_never_goes_back():
    clock = EventClock()
    clock.see([Record("t", 0, 0, None, None, [], 5_000), Record("t", 0, 1, None, None, [], 9_000)])
    clock.see([Record("t", 0, 2, None, None, [], 7_000)])  # late
    clock.see([])
    assert clock() == 9.0


def test_a_record_stamped_beyond_max_future_of_the_wall_clock_does_not_move_it():
    wall_s = 1_800_000_000.0
    clock = EventClock(max_future_ms=3_600_000, wall=lambda: wall_s)
    clock.see([Record("t", 0, 0, None, None, [], int(wall_s * 1000) - 60_000),
               Record("t", 0, 1, None, None, [], 4_102_444_800_000)])  # 2100-01-01: a bogus producer clock
    assert clock.now_ms == int(wall_s * 1000) - 60_000
    clock.see([Record("t", 0, 2, None, None, [], int(wall_s * 1000) + 3_600_000)])  # at the limit: counts
    assert clock.now_ms == int(wall_s * 1000) + 3_600_000


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_serve_on_the_event_clock_windows_a_replayed_week_at_its_own_time():
    settings = config.load(None, {"RANKMETER_ALERTS_PRODUCTION_RANKERS": "prod"})
    settings = msgspec.structs.replace(settings, metrics=msgspec.structs.replace(settings.metrics, port=0))
    bus, store, clock, stop = Bus(partitions=2), MemoryStore(), EventClock(), threading.Event()
    started: dict = {}
    server = threading.Thread(target=run, args=(settings, bus, store, stop, lambda p, port: started.update(
        pipeline=p, port=port)), kwargs={"clock": clock}, daemon=True)
    # A week-old hour of traffic, one query a minute per ranker, then a click on each.
    for minute in range(60):
        ts = WEEK_AGO_MS + minute * 60_000
        for ranker in ("prod", "canary"):
            qid = f"{ranker}-{minute}"
            bus.send(settings.kafka.impressions_topic, qid.encode(), json.dumps(
                {"query_id": qid, "ranker": ranker, "timestamp": ts, "results": ["a", "b"]}).encode(), timestamp_ms=ts)
            bus.send(settings.kafka.feedback_topic, qid.encode(), json.dumps(
                {"query_id": qid, "action": "click", "doc_id": "a", "timestamp": ts + 2_000}).encode(),
                timestamp_ms=ts + 2_000)
    server.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and ("pipeline" not in started
                                               or sum(started["pipeline"].events.values()) < 240):
            time.sleep(0.05)
        assert clock.now_ms == WEEK_AGO_MS + 59 * 60_000 + 2_000
        samples = scrape(started["port"])
        while time.monotonic() < deadline and not any(n == "rankmeter_consumer_lag_seconds" for n, _ in samples):
            time.sleep(0.1)  # the serve loop samples the lag once a second
            samples = scrape(started["port"])
    finally:
        stop.set()
        server.join(timeout=10)

    def queries(window: str) -> float:
        return samples[("rankmeter_queries", (("population", "all"), ("ranker", "prod"), ("segment", ""),
                                              ("window", window)))]

    # On the wall clock every window would be empty: this traffic is a week old.
    assert (queries("5m"), queries("15m"), queries("1h"), queries("24h")) == (5, 15, 60, 60)
    assert samples[("rankmeter_ranker_info", (("ranker", "prod"), ("role", "production")))] == 1
    assert samples[("rankmeter_ranker_info", (("ranker", "canary"), ("role", "candidate")))] == 1
    assert not any(name == "rankmeter_ranker_info" and ("role", "production") in labels and ("ranker", "canary") in labels
                   for name, labels in samples)
    lag = {labels: v for (name, labels), v in samples.items() if name == "rankmeter_consumer_lag_seconds"}
    assert len(lag) == 4 and set(lag.values()) == {0.0}  # caught up on both topics' two partitions
