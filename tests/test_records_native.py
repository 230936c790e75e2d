"""The newest Kafka timestamp per partition of consumed records in C (rankmeter/_events.c
`newest`) equals lag.py's Python loop (`Lag.see`), on hypothesis-drawn batches of
confluent-kafka's messages."""

from __future__ import annotations

import os

import confluent_kafka
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankmeter.kafka import confluent
from rankmeter.source import NO_HEADERS, Record

try:
    from rankmeter import _events
except ImportError:
    _events = None

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
pytestmark = pytest.mark.skipif(_events is None and not IN_CI,
                                reason="the C module is not built (scripts/build_native.py)")

EOF_ERROR = confluent_kafka.KafkaError(confluent_kafka.KafkaError._PARTITION_EOF)
messages = st.lists(st.builds(
    lambda topic, partition, offset, key, value, headers, ts, error: confluent_kafka.Message(
        topic=topic, partition=partition, offset=offset, key=key, value=value, headers=headers, timestamp=ts,
        error=EOF_ERROR if error else None),
    st.sampled_from(["a.impressions", "a.feedback"]), st.integers(0, 300), st.integers(0, 10 ** 12),
    st.one_of(st.none(), st.binary(max_size=8)), st.one_of(st.none(), st.binary(max_size=8)),
    st.one_of(st.none(), st.just([]), st.just([("h", b"1")])),
    st.tuples(st.integers(0, 2), st.integers(-1, 10 ** 13)), st.booleans()), max_size=30)


def python_records(batch: list) -> list[Record]:
    return [tuple.__new__(Record, (m.topic(), m.partition(), m.offset(), m.key(), m.value(),
                                   m.headers() or NO_HEADERS, m.timestamp()[1]))
            for m in batch if m.error() is None]


@settings(max_examples=300, deadline=None)
@given(messages, st.dictionaries(st.tuples(st.sampled_from(["a.impressions", "a.feedback"]), st.integers(0, 300)),
                                 st.integers(-2, 10 ** 13), max_size=4))
def test_the_newest_timestamps_as_in_python(batch: list, known: dict) -> None:
    records = python_records(batch)
    expected = dict(known)
    for r in records:
        if r.timestamp > expected.get((r.topic, r.partition), -1):
            expected[(r.topic, r.partition)] = r.timestamp
    got = dict(known)
    assert _events.newest(records, got, Record) is True
    assert got == expected


def test_records_of_another_type_are_left_to_python() -> None:
    """kafka-python's ConsumerRecord has other fields at Record's places: never read by index."""
    from kafka.consumer.fetcher import ConsumerRecord

    other = ConsumerRecord("t", 0, -1, 5, 1000, 0, b"k", b"v", [], None, 1, 1, -1)
    record = Record("t", 0, 5, b"k", b"v", [], 1000)
    into: dict = {}
    assert _events.newest([record, other], into, Record) is False and into == {}
    assert _events.run_end([other, other], 0, Record) == 1 and _events.run_end([record, other], 0, Record) == 1


def test_an_unhashable_partition_raises_type_error() -> None:
    with pytest.raises(TypeError, match="unhashable"):
        _events.newest([Record("t", [1], 0, None, b"", [], 5)], {}, Record)
