"""`rankmeter demo`: the simulator, the live pipeline and /metrics in one command, with a
live table per ranker, the A/B difference and the quality alerts that hold.

Event time runs `speed` times faster than the wall clock (default 60: a second shows a
minute of traffic), from a day back until it reaches now, then in real time; the pipeline
runs on the event clock, as history replays do, so windows and alerts see hours of traffic
within minutes. The alerts are those of deploy/prometheus/rules.yml, evaluated by
rankmeter on the same definitions (`alerts.py`).

Embedded by default — the in-process bus and the in-memory store, behind the same ports
as Kafka and Redis — or on the real services when RANKMETER_KAFKA_BOOTSTRAP_SERVERS and
RANKMETER_REDIS_URL are set (`make demo-full`).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from rankmeter import alerts
from rankmeter.clock import EventClock
from rankmeter.config import Settings, duration_ms
from rankmeter.pipeline import IPW, Pipeline
from rankmeter.serve import run
from rankmeter.simulator.traffic import Event, Simulator
from rankmeter.source import Bus, Source
from rankmeter.store import MemoryStore, Store
from rankmeter.windows import WindowView

COLUMNS = [("nDCG@10", "macro"), ("P@10", "macro"), ("AP", "macro"), ("CTR", "micro"), ("Abandonment", "macro")]


def value(view: WindowView, metric: str, average: str) -> float:
    sums = view.sums.get(metric)
    if sums is None:
        return float("nan")
    return sums.macro() if average == "macro" else sums.micro()


def render(views: list[WindowView], window: str, header: str, baseline: str | None = None,
           truth: dict[str, dict[str, float]] | None = None) -> str:
    """A table per ranker of one window, the baseline first with the others' differences
    to it; with `truth` (the demo), the position-bias-corrected nDCG@10 and a last column
    of true nDCG@10 (the simulator's hidden grades)."""
    rows = sorted((v for v in views if v.window == window and v.segment == ""),
                  key=lambda v: (v.ranker != baseline, v.ranker))
    columns = COLUMNS + ([(IPW + "nDCG@10", "macro")] if truth is not None else [])
    names = [c.replace(IPW, "ipw ") for c, _ in columns]
    lines = [header, "",
             f"{'ranker':<18}{'queries':>9}" + "".join(f"{n[:11]:>12}" for n in names)
             + (f"{'true nDCG@10':>14}" if truth is not None else "")]
    for v in rows:
        true = f"{truth.get(v.ranker, {}).get('nDCG@10', float('nan')):>14.4f}" if truth is not None else ""
        lines.append(f"{v.ranker:<18}{int(v.queries_all):>9}"
                     + "".join(f"{value(v, m, a):>12.4f}" for m, a in columns) + true)
    base = rows[0] if rows and rows[0].ranker == baseline else None
    for other in rows[1:] if base else []:
        deltas = "".join(f"{value(other, m, a) - value(base, m, a):>+12.4f}" for m, a in columns)
        lines.append(f"{'Δ vs ' + baseline:<27}{deltas}   ({other.ranker} − {baseline})")
    return "\n".join(lines)


def render_alerts(found: list[tuple[alerts.Condition, str]], now_ms: int, since: dict[tuple[str, str], float]) -> str:
    lines = ["", "Alerts (deploy/prometheus/rules.yml's quality alerts, evaluated by rankmeter; baseline: the window's last day):"]
    for c, state in sorted(found, key=lambda f: (f[1] != "firing", f[0].rule.alert, f[0].ranker)):
        held = (now_ms / 1000 - since[(c.rule.alert, c.ranker)]) / 60
        sign = ">" if c.rule.rise else "<"
        lines.append(f"  {state.upper():<8}{c.rule.alert:<27}{c.ranker:<16}{c.rule.metric} {c.rule.window} "
                     f"{c.value:.4f} {sign} {c.bound:.4f} (baseline {c.baseline:.4f}, {c.samples:.0f} queries) "
                     f"for {held:.0f} min")
    if not found:
        lines.append("  none holds")
    return "\n".join(lines)


def demo(settings: Settings, source: Source, store: Store, send: Callable[..., None], mode: str,
         rate: float, duration: float | None, regression_at: float | None, seed: int,
         out: TextIO = sys.stdout, refresh_s: float = 1.0,
         interleave: tuple[str, str] | None = None, speed: float = 60.0,
         count: int | None = None) -> dict[str, WindowView]:
    """Run until `duration` or `count` events (or Ctrl-C); returns the last views of the smallest window.
    `send(event, timestamp_ms)` delivers an event with its record's timestamp."""
    stop = threading.Event()
    started: dict = {}
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C, or SIGTERM from `docker stop` or a supervisor: stop cleanly either way.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())

    def on_start(pipeline: Pipeline, port: int) -> None:
        started.update(pipeline=pipeline, port=port)

    began_wall = time.time()
    first_ms = int((began_wall - 86_400) * 1000) if speed > 1 else int(began_wall * 1000)

    def event_now(elapsed_s: float | None = None) -> int:
        """A day back at the start, `speed` times faster than the wall clock, never past now."""
        elapsed_s = time.time() - began_wall if elapsed_s is None else elapsed_s
        return int(min(first_ms + elapsed_s * speed * 1000, (began_wall + elapsed_s) * 1000))

    clock = EventClock(first_ms, max_future_ms=duration_ms(settings.windows.max_future))
    server = threading.Thread(target=run, args=(settings, source, store, stop, on_start), kwargs={"clock": clock},
                              daemon=True)
    server.start()
    while "pipeline" not in started:
        if not server.is_alive():
            raise RuntimeError("the pipeline did not start")
        time.sleep(0.05)
    pipeline: Pipeline = started["pipeline"]
    simulator = Simulator(seed=seed, regression_at=regression_at, interleave=interleave)
    # A record's timestamp is its event's (the event clock follows it), or now for feedback
    # stamped later (delays) that a real producer sends as it happens.
    traffic = threading.Thread(target=simulator.run,
                               args=(lambda e: send(e, min(e.timestamp_ms, event_now())), rate, duration, count),
                               kwargs={"stop": stop.is_set, "event_time": event_now}, daemon=True)
    traffic.start()
    window = min(settings.windows.sizes, key=lambda s: _minutes(s))
    interactive = out.isatty()
    began, last_total, last_t = time.monotonic(), 0, time.monotonic()
    views: list[WindowView] = []
    evaluator = alerts.Evaluator()
    try:
        while (traffic.is_alive() or _lagging(source)) and not stop.is_set():
            stop.wait(refresh_s)
            total, now = sum(pipeline.events.values()), time.monotonic()
            views = pipeline.views()
            found = evaluator.update(views, clock())
            header = (f"rankmeter demo — {mode} — window {window} — {int(now - began)} s — event time "
                      f"{time.strftime('%a %H:%M', time.gmtime(clock()))} UTC ({speed:g}x until now) — "
                      f"{(total - last_total) / (now - last_t):,.0f} events/s — "
                      f"http://localhost:{started['port']}/metrics — Ctrl-C stops")
            last_total, last_t = total, now
            table = (render(views, window, header, simulator.rankers[0].name, simulator.truth.means())
                     + render_alerts(found, clock.now_ms, evaluator.since))
            out.write(("\x1b[H\x1b[2J" + table + "\n") if interactive else table + "\n\n")
            out.flush()
    finally:
        stop.set()
        traffic.join(timeout=10)
        server.join(timeout=30)
    return {v.ranker: v for v in views if v.window == window and v.segment == ""}


def _lagging(source: Source) -> bool:
    return isinstance(source, Bus) and sum(source.lag().values()) > 0


def _minutes(size: str) -> float:
    return duration_ms(size) / 60_000


def embedded(settings: Settings) -> tuple[Source, Store, Callable[..., None]]:
    bus = Bus(partitions=4)
    topics = {"impressions": settings.kafka.impressions_topic, "feedback": settings.kafka.feedback_topic}

    def send(event: Event, timestamp_ms: int | None = None) -> None:
        bus.send(topics[event.stream], event.key.encode(), json.dumps(event.value).encode(), timestamp_ms=timestamp_ms)

    return bus, MemoryStore(), send


def kafka_sender(settings: Settings, event_timestamps: bool = False) -> Callable[..., None]:
    """`send(event, timestamp_ms=None)` to the configured topics, keyed by query id; with
    `event_timestamps` each record's Kafka timestamp is its event's (history replays: topic
    retention and the event clock then follow event time)."""
    from rankmeter.kafka.producer import SIMULATOR, KafkaPythonProducer  # the embedded demo needs no Kafka client

    producer = KafkaPythonProducer(settings.kafka, SIMULATOR)
    topics = {"impressions": settings.kafka.impressions_topic, "feedback": settings.kafka.feedback_topic}

    def send(event: Event, timestamp_ms: int | None = None) -> None:
        if event_timestamps:
            timestamp_ms = event.timestamp_ms
        producer.send(topics[event.stream], event.key.encode(), json.dumps(event.value).encode(),
                      timestamp_ms=timestamp_ms)

    send.flush = producer.flush  # type: ignore[attr-defined]
    return send
