"""Replaying: every record of the files sent, in file order, to its topic keyed by its
`query_id` with its event time as the record's timestamp; to Kafka (`KafkaSink`) or to the
embedded bus."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable

from rankmeter.config import Settings
from rankmeter.kafka.producer import REPLAY, REPLAY_PINNED, KafkaPythonProducer
from rankmeter.replay.formats import Input
from rankmeter.replay.judgments import Judgments, judgment_events
from rankmeter.replay.messages import FEEDBACK, IMPRESSIONS, Skipped
from rankmeter.replay.summary import Progress, Summary
from rankmeter.source import SourceUnavailable

# send(topic, key, value, timestamp_ms): a Kafka producer, or the embedded bus.
Send = Callable[[str, bytes, bytes, int], None]


def replay(inputs: Iterable[Input], send: Send, topics: dict[str, str], judgments: Judgments | None = None,
           progress: Progress | None = None) -> Summary:
    """Send every record of the files, each judgment after its query; `topics` maps
    IMPRESSIONS and FEEDBACK to topic names."""
    summary = Summary()
    for s in judgments.skipped if judgments else []:
        summary.skip(s._replace(record=False))
    inputs = list(inputs)
    done_before = 0
    for inp in inputs:
        summary.files += 1
        for n, item in enumerate(inp.items()):
            if isinstance(item, Skipped):
                summary.skip(item)
                continue
            summary.read += 1
            messages = [item] + (judgment_events(item, judgments) if judgments and item.stream == IMPRESSIONS
                                 else [])
            for m in messages:
                topic = topics[m.stream]
                send(topic, m.key.encode(), json.dumps(m.value).encode(), m.timestamp_ms)
                summary.produced[topic] += 1
            summary.judgments += len(messages) - 1
            if progress is not None and n % 256 == 0:
                progress(done_before + inp.position(), f"{summary.read:,} records  {inp.path}")
        done_before += inp.size
    if progress is not None:
        progress(done_before, f"{summary.read:,} records", force=True)
    return summary


def topic_names(settings: Settings) -> dict[str, str]:
    return {IMPRESSIONS: settings.kafka.impressions_topic, FEEDBACK: settings.kafka.feedback_topic}


class KafkaSink:
    """`send` to Kafka with acks from every replica (the producer's REPLAY options), each
    failed delivery counted per topic in `failed` rather than lost unnoticed."""

    def __init__(self, settings: Settings) -> None:
        self.producer = KafkaPythonProducer(settings.kafka, REPLAY, pinned=REPLAY_PINNED)

    @property
    def failed(self) -> Counter[str]:
        return self.producer.failed

    @property
    def error(self) -> str:
        return self.producer.error

    def __call__(self, topic: str, key: bytes, value: bytes, timestamp_ms: int) -> None:
        try:
            self.producer.send(topic, key, value, timestamp_ms=timestamp_ms)
        except SourceUnavailable as e:
            # kafka-python's own error, which `rankmeter replay` reports in one line as it
            # does a broker it cannot reach at start.
            raise (e.__cause__ or e) from None

    def close(self) -> None:
        self.producer.close()
