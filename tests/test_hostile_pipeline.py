"""A stateful property test of the whole pipeline under hostile input (issue 19): batches
of generated messages — names and ids with control characters, the \\x1f separator,
quotes, very long strings, unicode; grades huge, negative or not numbers; messages that
are no JSON; duplicates (the same message again, or another under an event id already
used) and reordering — interleaved with restarts (a new pipeline on the same store),
rebalances, and store outages (before a commit, or with the commit's reply lost).

After every step: nothing escaped; every message consumed is counted once (by its
outcome) or still pending; exactly the hostile ones are dead-lettered, each with a
reason; the aggregates equal a from-scratch computation over the well-formed messages
alone (the engine on their final grades, as test_pipeline.py checks it); /metrics stays
small and holds no control character.
"""

from __future__ import annotations

import json
import zlib

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rankmeter import config
from rankmeter.engine import QueryState, parse, stack
from rankmeter.engine.query import first_occurrences
from rankmeter.exporter import Exporter, Health
from rankmeter.join import QueryRecord
from rankmeter.pipeline import Pipeline
from rankmeter.source import Bus
from rankmeter.store import MemoryStore

NOW_S = 1_800_000_000.0
NOW = int(NOW_S * 1000)
# One window and three quality measures: a scrape after every step stays quick.
SETTINGS = config.load(None, {"RANKMETER_WINDOWS_SIZES": "24h", "RANKMETER_EVALUATION_MEASURES": "nDCG@10,AP,RR"})
IMPRESSIONS, FEEDBACK = SETTINGS.kafka.impressions_topic, SETTINGS.kafka.feedback_topic
PARTITIONS = 2
QUALITY = list(SETTINGS.evaluation.measures)
# /metrics: no line longer than this (a label holds at most 128 characters) ...
LINE_BOUND = 1_000
# ... and at most this many samples per (ranker, segment) and window, whatever the input.
SAMPLES_PER_GROUP = 120

QUERIES = [f"q{i}" for i in range(10)]
DOCS = ["d0", "d1", "d2", "d3", "Δ-doc", "d" * 512]
# Well-formed names: unicode, quotes, backslashes, spaces (a no-break space is a separator,
# Zs, not a control character), exactly the 128-character limit.
RANKERS = ["bm25", 'quo"te\\', "n" * 128, "ранжир-🚀", "nb\u00a0sp"]
SEGMENTS = ["", "mobile ☎"]
BAD_CHARS = ["\x1f", "\x00", "\n", "\r", "\x7f", "\x85", "\u202e", "\u200b", "\u2028", "\u2029", "\ufeff"]
GRADES = {"click": 1.0, "add_to_cart": 2.0, "purchase": 3.0}

bad_name = st.one_of(
    st.tuples(st.text(max_size=8), st.sampled_from(BAD_CHARS), st.text(max_size=8)).map("".join),
    st.integers(129, 400).map(lambda n: "x" * n),
    st.just("h" * 100_000))
bad_id = st.one_of(st.integers(513, 3000).map(lambda n: "i" * n), st.just("i" * 20_000))
event_id = st.integers(0, 25).map(lambda i: f"e{i}")  # a small space: ids are reused on purpose


class Message(msgspec.Struct, frozen=True):
    topic: str
    key: bytes | None
    value: bytes | None
    valid: bool                 # well-formed: never dead-lettered
    event: dict | None = None   # what the oracle reads, for well-formed ones


def _json(topic: str, event: dict, valid: bool) -> Message:
    return Message(topic, str(event["query_id"]).encode(), json.dumps(event).encode(), valid,
                   event if valid else None)


@st.composite
def good_impression(draw) -> Message:
    event = {"query_id": draw(st.sampled_from(QUERIES)), "ranker": draw(st.sampled_from(RANKERS)),
             "timestamp": NOW - 1000 * draw(st.integers(0, 600)),
             "results": draw(st.lists(st.sampled_from(DOCS), min_size=1, max_size=6))}
    segment = draw(st.sampled_from(SEGMENTS))
    if segment:
        event["segment"] = segment
    return _json(IMPRESSIONS, event, True)


@st.composite
def good_feedback(draw) -> Message:
    event = {"query_id": draw(st.sampled_from(QUERIES)), "doc_id": draw(st.sampled_from(DOCS + ["unshown"])),
             "timestamp": NOW, "event_id": draw(event_id)}
    kind = draw(st.sampled_from(["click", "add_to_cart", "purchase", "judgment", "label", "view"]))
    if kind == "judgment":
        event.update(action="judgment", grade=draw(st.sampled_from([0, 1, 2, 3, 2.5, 1000])))
    elif kind == "label":
        event.update(action="judgment", label=draw(st.sampled_from(["Exact", "Irrelevant"])))
    else:
        event["action"] = kind  # `view` is not in the grade map: ignored, not dead-lettered
    return _json(FEEDBACK, event, True)


@st.composite
def hostile(draw) -> Message:
    qid = draw(st.sampled_from(QUERIES))
    impression = {"query_id": qid, "ranker": "bm25", "timestamp": NOW, "results": ["d0", "d1"]}
    click = {"query_id": qid, "action": "click", "doc_id": "d0", "timestamp": NOW, "event_id": draw(event_id)}
    judgment = {**click, "action": "judgment", "grade": 1}
    case = draw(st.integers(0, 11))
    if case == 0:
        return _json(IMPRESSIONS, {**impression, "ranker": draw(bad_name)}, False)
    if case == 1:
        return _json(IMPRESSIONS, {**impression, "segment": draw(bad_name)}, False)
    if case == 2:
        return _json(IMPRESSIONS, {**impression, "results": ["d0", draw(bad_id)]}, False)
    if case == 3:
        return _json(IMPRESSIONS, {**impression, "interleaving": {"experiment": draw(bad_name),
                                                                  "teams": ["bm25", "ltr-v2"]}}, False)
    if case == 4:
        bad_qid = qid + draw(st.sampled_from(BAD_CHARS))
        return _json(draw(st.sampled_from([IMPRESSIONS, FEEDBACK])), {**click, "query_id": bad_qid}, False)
    if case == 5:
        return _json(FEEDBACK, {**click, "doc_id": draw(bad_id)}, False)
    if case == 6:
        return _json(FEEDBACK, {**click, "event_id": draw(bad_id)}, False)
    if case == 7:  # huge, negative, infinite, past the bound, not a number
        grade = draw(st.sampled_from(["1e308", "-1", "1e999", "1000.5", '"3"', "-0.001"]))
        value = json.dumps(judgment).replace('"grade": 1', f'"grade": {grade}')
        return Message(FEEDBACK, qid.encode(), value.encode(), False)
    if case == 8:
        return _json(FEEDBACK, {**click, "action": "judgment", "label": draw(bad_name)}, False)
    if case == 9:
        value = draw(st.sampled_from([b"\xff\xfe{", b"{", b"[1, 2]", b"null", b'{"query_id": 5}', None]))
        return Message(draw(st.sampled_from([IMPRESSIONS, FEEDBACK])), qid.encode(), value, False)
    if case == 10:
        return _json(IMPRESSIONS, {**impression, "timestamp": draw(bad_name)}, False)
    return _json(FEEDBACK, {**click, "doc_id": ""}, False)


message = st.one_of(good_impression(), good_feedback(), hostile())


class Unreliable:
    """A store unavailable while `down`; `lose_reply`: the next commit is applied and its
    reply lost (then the store is down until recovered). Mixed into a real store class:
    it fails with the first of the store's own `unavailable` errors, as its client would."""

    down = lose_reply = False
    unavailable: tuple[type[Exception], ...]

    def _check(self) -> None:
        if self.down:
            raise self.unavailable[0]("the store is down")

    def claim(self, partition):
        self._check()
        return super().claim(partition)

    def read(self, wanted):
        self._check()
        return super().read(wanted)

    def admit_label(self, *args):
        self._check()
        return super().admit_label(*args)

    def expired(self, *args):
        self._check()
        return super().expired(*args)

    def commit(self, checkpoints):
        self._check()
        refused = super().commit(checkpoints)
        if self.lose_reply:
            self.lose_reply, self.down = False, True
            raise self.unavailable[0]("the reply was lost")
        return refused


class UnreliableMemoryStore(Unreliable, MemoryStore):
    unavailable = (ConnectionError,)


def expected_views(sent: list[tuple[tuple[str, int, int], Message]]) -> dict:
    """(ranker, segment) -> (queries, {measure: (judged queries, sum of values)}), from
    scratch: a query's first impression wins; per query, the first feedback with an event
    id counts; the latest judgment of a document wins (one timestamp for all feedback),
    else its highest implicit grade on a shown document."""
    shown: dict[str, dict] = {}
    explicit: dict[str, dict[str, float]] = {}
    implicit: dict[str, dict[str, float]] = {}
    seen: set[tuple[str, str]] = set()
    labels = SETTINGS.evaluation.labels
    for _, m in sent:  # in send order: each query's messages keep their order in its partition
        e = m.event
        if e is None or m.topic != IMPRESSIONS:
            continue
        shown.setdefault(e["query_id"], e)
    for _, m in sent:
        e = m.event
        if e is None or m.topic != FEEDBACK or e["action"] == "view" or (e["query_id"], e["event_id"]) in seen:
            continue  # (an action ignored takes no event id: a later event may use it)
        seen.add((e["query_id"], e["event_id"]))
        qid, doc = e["query_id"], e["doc_id"]
        if e["action"] == "judgment":
            explicit.setdefault(qid, {})[doc] = float(e["grade"]) if "grade" in e else labels[e["label"]]
        elif e["action"] in GRADES and qid in shown and doc in shown[qid]["results"]:
            grades = implicit.setdefault(qid, {})
            grades[doc] = max(grades.get(doc, 0.0), GRADES[e["action"]])
    groups: dict[tuple[str, str], list[QueryState]] = {}
    for qid, e in shown.items():
        grades = {**implicit.get(qid, {}), **explicit.get(qid, {})}
        state = QueryState.from_grades(first_occurrences(e["results"]), grades, shown_grade=0)
        groups.setdefault((e["ranker"], e.get("segment", "")), []).append(state)
    out = {}
    for group, states in groups.items():
        batch = stack(states)
        judged = batch.num_rel > 0
        sums = {}
        for name in QUALITY:
            measure = parse(name)
            values = measure.values(measure.compute(batch))[judged]
            sums[name] = (int(judged.sum()), float(values.sum()))
        out[group] = (len(states), sums)
    return out


class HostilePipeline(RuleBasedStateMachine):
    """On the memory store; tests/integration/test_hostile_serve.py runs it on Redis."""

    def make_store(self) -> Unreliable:
        return UnreliableMemoryStore()

    def __init__(self) -> None:
        super().__init__()
        self.store = self.make_store()
        self.bus = Bus(partitions=PARTITIONS)
        self.letters: dict[tuple[str, int, int], str] = {}   # dead letters, by message
        self.sent: list[tuple[tuple[str, int, int], Message]] = []
        self.pipelines: list[Pipeline] = []
        self.broken = False  # a batch failed on the store: serve would wait, then claim again
        self._start()

    def _start(self) -> None:
        self.pipeline = Pipeline(SETTINGS, self.store, self._dead_letter, lambda: NOW_S)
        self.pipelines.append(self.pipeline)
        self.bus.subscribe([IMPRESSIONS, FEEDBACK], self.pipeline.assign, self.pipeline.revoke)

    def _dead_letter(self, record, reason: str) -> None:
        self.letters[(record.topic, record.partition, record.offset)] = reason

    def _drain(self, batch_size: int) -> None:
        while records := self.bus.poll(0, batch_size):
            try:
                self.pipeline.process(records)
            except self.store.unavailable:
                self.broken = True
                return

    @rule(messages=st.lists(message, min_size=1, max_size=12), batch_size=st.integers(1, 15))
    def send(self, messages: list[Message], batch_size: int) -> None:
        for m in messages:
            p = zlib.crc32(m.key) % PARTITIONS if m.key is not None else 0
            self.bus.send(m.topic, m.key, m.value)
            self.sent.append(((m.topic, p, len(self.bus.logs[m.topic][p]) - 1), m))
        if not self.broken:
            self._drain(batch_size)

    @rule(picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=5))
    def redeliver(self, picks: list[int]) -> None:
        """Messages sent before, sent again (a producer's retry): new offsets, same bytes."""
        if self.sent:
            self.send([self.sent[i % len(self.sent)][1] for i in picks], 7)

    @precondition(lambda self: not self.broken)
    @rule()
    def restart(self) -> None:
        self._start()
        self._drain(10)

    @precondition(lambda self: not self.broken)
    @rule(partition=st.integers(0, PARTITIONS - 1))
    def rebalance(self, partition: int) -> None:
        self.pipeline.revoke([partition])
        offsets = {k: v for k, v in self.bus.positions.items() if k[1] != partition}
        offsets.update(self.pipeline.assign([partition]))
        self.bus.seek(offsets)
        self._drain(10)

    @precondition(lambda self: not self.broken)
    @rule(reply_lost=st.booleans(), messages=st.lists(message, min_size=1, max_size=5))
    def outage(self, reply_lost: bool, messages: list[Message]) -> None:
        if reply_lost:
            self.store.lose_reply = True
        else:
            self.store.down = True
        self.send(messages, 50)
        assert self.broken

    @precondition(lambda self: self.broken)
    @rule()
    def recover(self) -> None:
        """What serve does once the store answers: drop the partitions and claim them again."""
        self.store.down = self.store.lose_reply = False
        partitions = list(range(PARTITIONS))
        self.pipeline.revoke(partitions, reclaiming=True)
        self.bus.seek(self.pipeline.assign(partitions))
        self.broken = False
        self._drain(10)

    @invariant()
    def every_message_is_counted_once_and_only_hostile_ones_are_dead_letters(self) -> None:
        if self.broken:
            return
        counted = sum(sum(p.events.values()) for p in self.pipelines)
        decode = msgspec.msgpack.Decoder(QueryRecord).decode
        stored = self.store.read({p: QUERIES for p in range(PARTITIONS)})
        pending = sum(len(decode(r).pending) for records in stored.values() for r in records if r is not None)
        assert counted + pending == len(self.sent)
        hostile_ones = {where for where, m in self.sent if not m.valid}
        assert self.letters.keys() == hostile_ones
        assert all(0 < len(why) < 400 for why in self.letters.values())
        invalid = sum(n for p in self.pipelines for (_, outcome), n in p.events.items() if outcome == "invalid")
        assert invalid == len(hostile_ones)

    @invariant()
    def the_aggregates_are_those_of_the_well_formed_messages(self) -> None:
        if self.broken:
            return
        found = {}
        for v in self.pipeline.views(NOW):
            if v.window == "24h":
                found[(v.ranker, v.segment)] = (v.queries_all, {n: (v.sums[n].count, v.sums[n].value_sum)
                                                                for n in QUALITY})
        expected = expected_views(self.sent)
        assert found.keys() == expected.keys()
        for group, (queries, sums) in expected.items():
            assert found[group][0] == queries, group
            for name, (count, total) in sums.items():
                assert found[group][1][name][0] == count, (group, name)
                assert found[group][1][name][1] == pytest.approx(total, abs=1e-9), (group, name)

    @invariant()
    def metrics_stay_small_and_hold_no_control_character(self) -> None:
        if self.broken:
            return
        text = Exporter(self.pipeline.readout, Health(), dict).render()
        lines = text.split(b"\n")
        assert max(len(line) for line in lines) < LINE_BOUND
        groups = len({(v.ranker, v.segment) for v in self.pipeline.views(NOW)})
        assert len(lines) < SAMPLES_PER_GROUP * groups * len(SETTINGS.windows.sizes) + 300
        assert not any(b < 0x20 and b != 0x0A for b in text)
        assert "\u202e".encode() not in text and "\u2028".encode() not in text


BUDGET = settings(max_examples=30, stateful_step_count=20, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
HostilePipeline.TestCase.settings = BUDGET
TestHostilePipeline = HostilePipeline.TestCase
