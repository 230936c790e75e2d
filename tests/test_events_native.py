"""The C decoder of plain native messages (rankmeter/_events.c) against the Python decoder,
which is the definition: for any message, what the decoder returns with the C module is
what it returns without it (the same type, fields and field types, compared by repr),
and whatever the C module itself returns is an event the Python path also returns.
Messages drawn by hypothesis around the plain case (every field's type, bound and
character rule, keys repeated or unknown, escapes, whitespace, non-ASCII, numbers at 18
and 19 digits, floats) and byte-level mutations of plain ones; bench_serve's messages are
all taken by the C path."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankmeter import config
from rankmeter.events import Decoder, Feedback, Impression

try:
    from rankmeter import _events
except ImportError:
    _events = None

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
pytestmark = pytest.mark.skipif(_events is None and not IN_CI,
                                reason="the C decoder is not built (scripts/build_native.py)")

NOW = 1_800_000_000_000
SETTINGS = [config.load(None, {}),
            config.load(None, {"RANKMETER_AB_UNIT": "user", "RANKMETER_LIMITS_MAX_RESULTS": "5",
                               "RANKMETER_EVALUATION_LONG_DWELL_GRADE": "0.5"})]
BOTH = [(Decoder(s), Decoder(s, native=False)) for s in SETTINGS]

# Strings around the rules: empty, short, at and past the limits, printable ASCII, spaces,
# quotes and backslashes (escaped by json.dumps), controls, non-ASCII, bidi and zero-width.
texts = st.one_of(
    st.sampled_from(["", "q", "doc1", "bm25", " ", "a b", '"', "\\", "\x00", "\n", "\x1f", "\x7f", "é", "\u202e",
                     "\u200b", "\U0001f600", "\ud800", "x" * 128, "x" * 129, "x" * 256, "x" * 257, "x" * 512,
                     "x" * 513, "click", "judgment", "impression", "purchase", "add_to_cart", "Exact"]),
    st.text(max_size=20),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e), min_size=1, max_size=12))
numbers = st.one_of(st.integers(-5, 5), st.integers(-10 ** 20, 10 ** 20), st.sampled_from(
    [NOW, NOW - 1, NOW + 1, 10 ** 17, 10 ** 18 - 1, 10 ** 18, 0, -1, 30_000, 29_999, 1000, 1001]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.5, 1.0, 2.0, 1e3, -0.0]))
times = st.one_of(st.integers(NOW - 10 ** 11, NOW + 10 ** 9), st.sampled_from(
    [NOW, "2027-01-15T08:00:00Z", "2027-01-15T08:00:00", "yesterday"]))
scalars = st.one_of(st.none(), st.booleans(), texts, numbers)
values = st.one_of(scalars, st.lists(texts, max_size=4), st.dictionaries(texts, scalars, max_size=2))
ascii_ids = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e), min_size=1, max_size=12)
small = st.one_of(st.none(), st.integers(0, 60_000))
# Per field: (the plain values, the values around them); `messages` mostly draws the first.
FEEDBACK = {"query_id": (ascii_ids, texts), "timestamp": (st.integers(NOW - 10 ** 6, NOW), times),
            "action": (st.sampled_from(["click", "purchase", "add_to_cart", "judgment", "impression"]), texts),
            "doc_id": (ascii_ids, texts), "event_id": (ascii_ids, texts),
            "position": (st.one_of(st.none(), st.integers(1, 20)), numbers), "dwell_ms": (small, numbers),
            "grade": (st.one_of(st.none(), st.integers(0, 3)), numbers), "label": (st.none(), texts)}
IMPRESSION = {"query_id": (ascii_ids, texts), "ranker": (ascii_ids, texts),
              "timestamp": (st.integers(NOW - 10 ** 6, NOW), times), "segment": (st.one_of(st.none(), ascii_ids), texts),
              "results": (st.lists(st.one_of(ascii_ids, st.sampled_from(["d1", "d2", "d3"])), max_size=7),
                          st.lists(texts, max_size=7)),
              "interleaving": (st.none(), st.just({"experiment": "e", "teams": ["a", "b"]})),
              "user_query": (st.one_of(st.none(), ascii_ids), texts), "session_id": (st.none(), texts),
              "client_id": (st.one_of(st.none(), ascii_ids), texts)}


@st.composite
def messages(draw, fields: dict) -> bytes:
    """An object of the fields, each mostly plain, sometimes around it, any value or absent; maybe an unknown key."""
    message = {}
    for name, (plain, around) in fields.items():
        choice = draw(st.integers(0, 19))
        if choice == 0:
            continue  # absent
        message[name] = draw(values) if choice == 1 else draw(around) if choice < 4 else draw(plain)
    if draw(st.integers(0, 19)) == 0:
        message[draw(texts)] = draw(values)
    text = json.dumps(message, ensure_ascii=draw(st.booleans()),
                      separators=draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", "\t:\r ")])))
    return text.encode("utf-8", "surrogatepass")


@st.composite
def mutated(draw, fields: dict) -> bytes:
    """A message with a few bytes changed, cut, or a key repeated."""
    data = bytearray(draw(messages(fields)))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(data)))  # (len: bytes after the end)
        kind = draw(st.integers(0, 3))
        if kind == 0 and i < len(data):
            data[i] = draw(st.integers(0, 255))
        elif kind == 1:
            del data[i:]
        elif kind == 2:
            data[i:i] = draw(st.sampled_from([b" ", b",", b'"', b"\\", b"0", b"-", b"}", b"]", b"null", b"1e3", b"x", b"{}"]))
        elif data.endswith(b"}") and b":" in data:
            data[-1:] = b', "' + draw(st.sampled_from(list(fields))).encode() + b'": "x"}'
    return bytes(data)


def check(kind: str, value: bytes) -> None:
    for native, python in BOTH:
        expected = getattr(python, kind)(value, NOW)
        fast = getattr(native.plain, kind)(value, NOW)
        if fast is not None:  # what the C module returns is the Python path's event ...
            assert type(fast) is type(expected) and repr(fast) == repr(expected), value
        got = getattr(native, kind)(value, NOW)  # ... and the decoder returns the same either way
        assert type(got) is type(expected) and repr(got) == repr(expected), value


FAST = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(messages(FEEDBACK))
def test_feedback_as_the_python_decoder(value: bytes) -> None:
    check("feedback", value)


@FAST
@given(messages(IMPRESSION))
def test_impressions_as_the_python_decoder(value: bytes) -> None:
    check("impression", value)


@FAST
@given(st.one_of(mutated(FEEDBACK), mutated(IMPRESSION)), st.sampled_from(["feedback", "impression"]))
def test_damaged_messages_as_the_python_decoder(value: bytes, kind: str) -> None:
    check(kind, value)


RULES = BOTH[0][1].rules
PAST, FUTURE = NOW - RULES.max_past_ms, NOW + RULES.max_future_ms


def feedback(**fields) -> bytes:
    return json.dumps({"query_id": "q", "timestamp": NOW, "action": "click", "doc_id": "d", "event_id": "e",
                       **fields}).encode()


def impression(**fields) -> bytes:
    return json.dumps({"query_id": "q", "ranker": "r", "timestamp": NOW, "results": ["a", "b"], **fields}).encode()


# Each rule's bound, at it and one past it: (kind, message, whether the C path takes it).
# Past a bound the Python path refuses (C leaves it), or C is stricter by design (19 digits).
BOUNDS = [
    ("feedback", feedback(query_id="x" * 256), True), ("feedback", feedback(query_id="x" * 257), False),
    ("feedback", feedback(doc_id="x" * 512), True), ("feedback", feedback(doc_id="x" * 513), False),
    ("feedback", feedback(event_id="x" * 512), True), ("feedback", feedback(event_id="x" * 513), False),
    ("feedback", feedback(event_id=""), False), ("feedback", feedback(doc_id=""), False),
    ("feedback", feedback(query_id=""), False), ("feedback", feedback(query_id="q\x7f"), False),
    ("feedback", feedback(query_id="q\x7e"), True),
    ("feedback", feedback(timestamp=PAST), True), ("feedback", feedback(timestamp=PAST - 1), False),
    ("feedback", feedback(timestamp=FUTURE), True), ("feedback", feedback(timestamp=FUTURE + 1), False),
    ("feedback", feedback(dwell_ms=RULES.long_dwell_ms), True), ("feedback", feedback(dwell_ms=RULES.long_dwell_ms - 1), True),
    ("feedback", feedback(dwell_ms=0), True), ("feedback", feedback(dwell_ms=-1), False),
    ("feedback", feedback(position=1), True), ("feedback", feedback(position=0), False),
    ("feedback", feedback(action="judgment", grade=1000), True), ("feedback", feedback(action="judgment", grade=1001), False),
    ("feedback", feedback(action="judgment", grade=0), True), ("feedback", feedback(action="judgment", grade=-1), False),
    ("feedback", feedback(action="judgment"), False), ("feedback", feedback(action="judgment", label="Exact"), False),
    ("feedback", feedback(action="impression", position=3), True), ("feedback", feedback(action="impression"), False),
    ("feedback", feedback(action="unknown"), False), ("feedback", feedback(action="purchase", grade=7), True),
    ("feedback", feedback(position=10 ** 17), True), ("feedback", feedback(position=10 ** 18), False),
    ("feedback", feedback().replace(b'"e"}', b'"e", "position": 01}'), False),
    ("feedback", feedback().replace(b'"e"}', b'"e", "position": 1.0}'), False),
    ("feedback", feedback().replace(b'"e"}', b'"e", "position": -0}'), False),
    ("feedback", feedback() + b"x", False), ("feedback", feedback() + b" \n", True),
    ("feedback", b" \t" + feedback(), True), ("feedback", b"\xef\xbb\xbf" + feedback(), False),
    ("impression", impression(query_id="x" * 256), True), ("impression", impression(query_id="x" * 257), False),
    ("impression", impression(ranker="x" * 128), True), ("impression", impression(ranker="x" * 129), False),
    ("impression", impression(ranker=""), False), ("impression", impression(ranker="r\x7f"), False),
    ("impression", impression(segment="x" * 128), True), ("impression", impression(segment="x" * 129), False),
    ("impression", impression(results=["x" * 512]), True), ("impression", impression(results=["x" * 513]), False),
    ("impression", impression(results=[]), True), ("impression", impression(results=["a", "b", "a"]), True),
    ("impression", impression(timestamp=PAST), True), ("impression", impression(timestamp=PAST - 1), False),
    ("impression", impression(timestamp=FUTURE), True), ("impression", impression(timestamp=FUTURE + 1), False),
    ("impression", impression(interleaving=None, segment=None, user_query="Red  Shoes", session_id="s"), True),
    ("impression", impression() + b"{}", False),
]


@pytest.mark.parametrize("kind, value, taken", BOUNDS)
def test_every_bound_as_the_python_decoder(kind: str, value: bytes, taken: bool) -> None:
    native, python = BOTH[0]
    expected = getattr(python, kind)(value, NOW)
    fast = getattr(native.plain, kind)(value, NOW)
    assert (fast is not None) == taken, (value, expected)
    if fast is not None:
        assert type(fast) is type(expected) and repr(fast) == repr(expected)
    check(kind, value)


def test_results_at_the_limit_counted_before_repeats_are_dropped() -> None:
    native, python = BOTH[1]  # limits.max_results: 5
    for results, taken in ((["a", "b", "c", "d", "e"], True), (["a", "b", "c", "d", "e", "a"], False)):
        value = impression(results=results)
        fast = native.plain.impression(value, NOW)
        assert (fast is not None) == taken
        assert repr(native.impression(value, NOW)) == repr(python.impression(value, NOW))


def test_a_decoder_not_initialised_raises_instead_of_crashing() -> None:
    blank = _events.Decoder.__new__(_events.Decoder)
    with pytest.raises(RuntimeError):
        blank.feedback(feedback(), NOW)


def test_not_bytes_nor_json_is_left_to_python() -> None:
    native, _ = BOTH[0]
    for value in (None, b"", b"{", b"[]", b"null", b"{}", "{}", bytearray(b"{}"), b"\xef\xbb\xbf{}"):
        assert native.plain.feedback(value, NOW) is None and native.plain.impression(value, NOW) is None


def test_bench_serves_messages_all_take_the_c_path() -> None:
    """The plain case is the common one: every message bench_serve sends is the C module's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_serve

    native, python = BOTH[0]
    taken = sent = 0
    for stream, _, value in bench_serve.stream(3000):
        sent += 1
        kind = "impression" if stream == "impressions" else "feedback"
        now = json.loads(value)["timestamp"]
        fast = getattr(native.plain, kind)(value, now)
        assert fast is not None, value
        assert repr(fast) == repr(getattr(python, kind)(value, now))
        taken += isinstance(fast, (Impression, Feedback))
    assert taken == sent >= 3000


def test_user_ids_and_query_texts_hashed_as_in_python() -> None:
    native, python = BOTH[1]  # ab.unit: user
    value = json.dumps({"query_id": "q", "ranker": "r", "timestamp": NOW, "results": ["a", "b", "a"],
                        "segment": "mobile", "user_query": "Red  Shoes", "client_id": "u-17"}).encode()
    fast = native.plain.impression(value, NOW)
    assert fast is not None and fast.user_hash != -1 and fast.query_hash and fast.results == ["a", "b"]
    assert repr(fast) == repr(python.impression(value, NOW))


def test_a_failing_call_back_raises_its_own_error_not_a_system_error() -> None:
    """Python is never called with an exception set (a SystemError then hides the cause)."""
    def failing(value):
        raise ValueError("no hash today")

    rules = BOTH[1][1].rules
    plain = _events.Decoder(Feedback, Impression, rules.grades, rules.long_dwell_ms, rules.long_dwell_grade,
                            rules.max_past_ms, rules.max_future_ms, rules.max_results, 1000.0, True,
                            failing, failing, failing)
    with pytest.raises(ValueError, match="no hash today"):
        plain.impression(impression(user_query="shoes", client_id="u"), NOW)
    native, python = BOTH[1]  # and the decoder falls back to Python on any error of the C path
    assert repr(native.impression(impression(user_query="shoes"), NOW)) == repr(python.impression(impression(user_query="shoes"), NOW))
