"""The pipeline with the C decoder (rankmeter._events: runs of plain native messages read
at once, pipeline/intake.py) and without it (record by record in Python, as where the
module is not built) ends in the same state: the same outcome counts, dead letters (their
reasons, in order), stored records, buckets and aggregates, whatever is mixed into the
stream (native traffic, UBI records, hostile or damaged messages, wrong keys, replays)
and however it is batched."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rankmeter.events.decoder as decoder_module
from rankmeter import config
from rankmeter.pipeline import Pipeline
from rankmeter.source import Bus
from rankmeter.store import MemoryStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ubi_shapes  # noqa: E402

try:
    from rankmeter import _events
except ImportError:
    _events = None

IN_CI = __import__("os").environ.get("CI", "").lower() in ("1", "true", "yes")
pytestmark = pytest.mark.skipif(_events is None and not IN_CI,
                                reason="the C decoder is not built (scripts/build_native.py)")

NOW_MS = 1_800_000_000_000
SETTINGS = config.load(None, {"RANKMETER_AB_UNIT": "user"})
TOPIC = {"impressions": SETTINGS.kafka.impressions_topic, "feedback": SETTINGS.kafka.feedback_topic}
HOSTILE = [b"", b"not json", b"{", b"[]", b'{"query_id": 7}', b"\xff\xfe", b'{"query_id": "q\\u0000"}',
           json.dumps({"query_id": "q", "ranker": "r", "timestamp": "yesterday", "results": []}).encode()]


def stream(seed: int) -> list[tuple[str, bytes | None, bytes | None]]:
    """(stream, key, value): native searches and their clicks, in order, with messages the
    C path must leave to Python sprinkled in (plain-looking ones the rules refuse or that
    hold something else: a wrong key, an unknown action, a position 0, a label, non-ASCII, a
    user's id and text), then UBI records and damaged messages."""
    rnd = random.Random(seed)
    queries = ubi_shapes.searches(seed, 130, NOW_MS)
    out = [(kind, key.encode(), json.dumps(record).encode()) for kind, key, record in ubi_shapes.native(queries[:120])]
    for q in queries[:40]:
        judgment = {"query_id": q.query_id, "doc_id": q.shown[0], "action": "judgment",
                    "grade": rnd.randint(0, 3), "timestamp": q.timestamp_ms + 5, "event_id": f"{q.query_id}:j"}
        variant = dict(judgment, event_id=f"{q.query_id}:k", action=rnd.choice(
            ["click", "purchase", "unknown", "impression"]), position=rnd.choice([None, 0, 1, 3]),
            dwell_ms=rnd.choice([None, -1, 0, 40_000]), label=rnd.choice([None, None, "Exact", 3]),
            doc_id=rnd.choice([q.shown[-1], q.shown[-1] + "é", "x" * 513]))
        for key, record in ((q.query_id, judgment), (q.query_id, judgment),  # (redelivered)
                            (rnd.choice([q.query_id, q.query_id, "someone-else"]), variant)):
            out.insert(rnd.randrange(len(out)), ("feedback", key.encode(), json.dumps(record).encode()))
    impression = {"query_id": "q-users", "ranker": "b", "timestamp": NOW_MS - 10, "results": ["a", "b", "a"],
                  "user_query": "Red shoes", "client_id": "u-1", "segment": "mobile"}
    out.insert(rnd.randrange(len(out)), ("impressions", b"q-users", json.dumps(impression).encode()))
    out.append(("impressions", b"q-users", json.dumps(impression, ensure_ascii=False).encode()))  # a duplicate
    out.extend((kind, key.encode(), json.dumps(record).encode()) for kind, key, record in ubi_shapes.generator(queries[120:]))
    out.extend((rnd.choice(["impressions", "feedback"]), b"q", rnd.choice(HOSTILE)) for _ in range(10))
    return out


def run(events, sizes: list[int], native: bool, monkeypatch: pytest.MonkeyPatch, runs: Counter):
    letters: list[str] = []
    store = MemoryStore()
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(decoder_module, "_plain_decoder", lambda rules: None)
        pipeline = Pipeline(SETTINGS, store, lambda record, why: letters.append(why), lambda: NOW_MS / 1000)
    read_each = pipeline._intake._read_each

    def counted(batch, records, start: int, stop: int, checked) -> None:  # records read one by one
        runs["one by one"] += stop - start
        read_each(batch, records, start, stop, checked)

    pipeline._intake._read_each = counted
    assert (pipeline._intake.decoder.plain is not None) == native
    bus = Bus(partitions=3)
    for kind, key, value in events:
        bus.send(TOPIC[kind], key, value)
    bus.subscribe(list(TOPIC.values()), pipeline.assign, pipeline.revoke)
    batches = iter(sizes)
    while records := bus.poll(0, next(batches, 1000)):
        runs["records"] += len(records)
        pipeline.process(records)
    views = sorted((v.ranker, v.window, sorted(v.sums.items())) for v in pipeline.views())
    return dict(pipeline.events), letters, store.records, store.buckets, store.meta, views


RUNS = Counter()  # over every example: records read, records read one by one (the others in C)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.integers(1, 300), min_size=1, max_size=10))
def test_with_and_without_the_c_decoder_the_same_state(seed: int, sizes: list[int]) -> None:
    monkeypatch = pytest.MonkeyPatch()
    events = stream(seed)
    native = run(events, sizes, True, monkeypatch, RUNS)
    python = run(events, sizes, False, monkeypatch, Counter())
    assert native == python
    counts = native[0]
    assert counts[("impressions", "applied")] >= 120 and counts[("feedback", "duplicate")] >= 40 and counts[("feedback", "invalid")] >= 1


def test_both_ways_of_reading_were_compared() -> None:
    """(After the test above, in this module's order: both paths were taken, often.)"""
    if not RUNS:
        test_with_and_without_the_c_decoder_the_same_state()
    assert RUNS["one by one"] >= 500 and RUNS["records"] - RUNS["one by one"] >= 5000, RUNS
