"""`rankmeter replay --embedded`: the records through the pipeline in-process, on the
embedded bus and the in-memory store (no Kafka, no Redis), and what it evaluated."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import Any, NamedTuple

import msgspec

from rankmeter.clock import EventClock
from rankmeter.config import Settings, duration_ms
from rankmeter.pipeline import Pipeline
from rankmeter.replay.formats import Input
from rankmeter.replay.judgments import Judgments
from rankmeter.replay.producing import replay, topic_names
from rankmeter.replay.summary import Progress, Summary
from rankmeter.source import Bus
from rankmeter.store import MemoryStore
from rankmeter.windows import WindowView


class Evaluated(NamedTuple):
    views: list[WindowView]
    now_ms: int                        # the last event time: where the windows end
    outcomes: Counter[tuple[str, str]]  # (stream, outcome) -> events, as rankmeter_events_total
    invalid: Counter[str]              # dead-letter reason -> events


def evaluate(settings: Settings, bus: Bus, progress: Progress | None = None) -> Evaluated:
    """Everything on the bus through the pipeline, as `serve --event-clock` would take it:
    now is the newest record consumed; then every list still being assembled is settled."""
    clock = EventClock(max_future_ms=duration_ms(settings.windows.max_future))
    invalid: Counter[str] = Counter()
    # The bus hands over one topic's partition before the next, so now (the newest record
    # read) may be the file's end while its start is still to come: a file of any span
    # is history, not records too old to take.
    settings = msgspec.structs.replace(settings, windows=msgspec.structs.replace(settings.windows, max_past="36500d"))

    def dead_letter(record: Any, reason: str) -> None:
        invalid[reason] += 1

    pipeline = Pipeline(settings, MemoryStore(), dead_letter, clock=clock)
    k = settings.kafka
    bus.subscribe([k.impressions_topic, k.feedback_topic], pipeline.assign, pipeline.revoke)
    total, done = sum(bus.lag().values()), 0
    while batch := bus.poll(0, k.max_poll_records):
        clock.see(batch)
        pipeline.process(batch).commit(bus)
        # As serve does from the consumer lag: a topic read to its end holds no query open.
        pipeline.caught_up = {tp for tp, behind in bus.lag().items() if behind == 0}
        done += len(batch)
        if progress is not None:
            progress(done, f"{done:,}/{total:,} records")
    pipeline.end_of_input().commit(bus)  # the lists still being assembled: no more impression events will come
    return Evaluated(pipeline.views(), clock.now_ms, Counter(pipeline.events), invalid)


def embedded(settings: Settings, inputs: Iterable[Input], judgments: Judgments | None = None,
             progress: Callable[[str, int], Progress | None] = lambda label, total: None
             ) -> tuple[Summary, Evaluated]:
    """Replay into the in-process bus, then evaluate (no Kafka, no Redis)."""
    inputs = list(inputs)
    bus = Bus(partitions=4)
    reading = progress("replay", sum(i.size for i in inputs))
    summary = replay(inputs, lambda t, k, v, ts: bus.send(t, k, v, timestamp_ms=ts), topic_names(settings),
                     judgments, reading)
    if reading is not None:
        reading.close()
    running = progress("evaluate", sum(summary.produced.values()))
    result = evaluate(settings, bus, running)
    if running is not None:
        running.close()
    return summary, result


def outcomes_text(result: Evaluated) -> str:
    """The events' outcomes in the pipeline, and why the invalid ones were."""
    parts = [f"{stream} {outcome} {n:,}" for (stream, outcome), n in sorted(result.outcomes.items()) if n]
    lines = ["pipeline: " + (", ".join(parts) if parts else "no events")]
    for reason, n in result.invalid.most_common(5):
        lines.append(f"  invalid {n:>8,}  {reason[:160]}")
    if len(result.invalid) > 5:
        lines.append(f"  … and {len(result.invalid) - 5} more reasons")
    return "\n".join(lines)


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
