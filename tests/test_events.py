"""Decoding and checking events: native and OpenSearch UBI, and every rejection's reason."""

import json

import pytest

from rankmeter import config
from rankmeter.ab.clusters import bucket_of, user_hash
from rankmeter.events import Decoder, Feedback, Impression, Rejected, query_hash

NOW = 1_800_000_000_000  # 2027-01-15T08:00:00Z
DEC = Decoder(config.load(None, {}))


def impression(**fields) -> Impression | Rejected:
    return DEC.impression(json.dumps(fields).encode(), NOW)


def feedback(**fields) -> Feedback | Rejected:
    return DEC.feedback(json.dumps(fields).encode(), NOW)


def test_native_impression_with_rfc3339_or_epoch_ms():
    a = impression(query_id="q", ranker="bm25", timestamp="2027-01-15T08:00:00Z", results=["a", "b"], segment="de")
    b = impression(query_id="q", ranker="bm25", timestamp=NOW, results=["a"], user_query="shoes")
    c = impression(query_id="q", ranker="bm25", timestamp="2027-01-15T09:00:00.250+01:00", results=[])
    assert a == Impression("q", "bm25", NOW, ["a", "b"], "de")
    # The query text is kept as a 64-bit hash, case and spacing folded (position-bias harvest).
    assert b == Impression("q", "bm25", NOW, ["a"], "", query_hash=query_hash("shoes"))
    assert query_hash("  Shoes ") == query_hash("shoes") != query_hash("shoe") and len(query_hash("x")) == 16
    assert c.timestamp_ms == NOW + 250


def test_ubi_query_record_is_an_impression():
    ubi = {"query_id": "u1", "timestamp": NOW, "client_id": "c", "application": "shop",
           "query_attributes": {"ranker": "ltr-v3"}, "query_response_hit_ids": ["x", "y"], "user_query": "tv"}
    assert DEC.impression(json.dumps(ubi).encode(), NOW) == Impression("u1", "ltr-v3", NOW, ["x", "y"], "",
                                                                        query_hash=query_hash("tv"),
                                                                        user_bucket=-1)  # (not by user)
    by_user = Decoder(config.load(None, {"RANKMETER_AB_UNIT": "user"}))
    assert by_user.impression(json.dumps(ubi).encode(), NOW).user_bucket == bucket_of("c")
    assert by_user.impression(json.dumps(ubi).encode(), NOW).user_hash == user_hash("c")
    older = {"query_id": "u2", "timestamp": NOW, "application": "shop", "query_response_object_ids": ["z"]}
    assert DEC.impression(json.dumps(older).encode(), NOW) == Impression("u2", "shop", NOW, ["z"], "")
    oldest = {"query_id": "u3", "timestamp": NOW, "application": "s", "query_response_objects_ids": ["w", 978316]}
    assert DEC.impression(json.dumps(oldest).encode(), NOW).results == ["w", "978316"]
    nameless = {"query_id": "u4", "timestamp": NOW, "query_response_hit_ids": ["w"]}
    assert DEC.impression(json.dumps(nameless).encode(), NOW) == Rejected(
        "invalid", "UBI query has no ranker: neither query_attributes.ranker nor application is a non-empty string")


def test_ubi_event_record_is_feedback():
    ubi = {"action_name": "click", "query_id": "u1", "timestamp": NOW, "session_id": "s", "client_id": "c",
           "message_id": "m1", "event_attributes": {"object": {"object_id": "x", "object_id_field": "sku"},
                                                    "position": {"ordinal": 3}}}
    assert DEC.feedback(json.dumps(ubi).encode(), NOW) == Feedback("m1", "u1", NOW, "click", "x", 1.0, False, 3)
    numeric = {"action_name": "purchase", "query_id": "u1", "timestamp": "2027-01-15T08:00:00.000Z",
               "event_attributes": {"object": {"object_id": 978316, "object_id_field": "isbn"}}}
    assert DEC.feedback(json.dumps(numeric).encode(), NOW).doc_id == "978316"
    view = {"action_name": "view", "query_id": "u1", "timestamp": NOW}
    assert DEC.feedback(json.dumps(view).encode(), NOW) == Rejected("ignored", "action 'view' is not in the grade map")


def test_grade_mapping():
    assert feedback(query_id="q", action="click", doc_id="d", timestamp=NOW).grade == 1.0
    assert feedback(query_id="q", action="click", doc_id="d", timestamp=NOW, dwell_ms=29_999).grade == 1.0
    assert feedback(query_id="q", action="click", doc_id="d", timestamp=NOW, dwell_ms=30_000).grade == 2.0
    assert feedback(query_id="q", action="add_to_cart", doc_id="d", timestamp=NOW).grade == 2.0
    assert feedback(query_id="q", action="purchase", doc_id="d", timestamp=NOW).grade == 3.0
    judged = feedback(query_id="q", action="judgment", doc_id="d", timestamp=NOW, grade=4)
    assert (judged.grade, judged.explicit) == (4.0, True)


def test_event_id_defaults_to_a_content_hash():
    a = feedback(query_id="q", action="click", doc_id="d", timestamp=NOW)
    b = feedback(query_id="q", action="click", doc_id="d", timestamp=NOW)
    c = feedback(query_id="q", action="click", doc_id="e", timestamp=NOW)
    assert a.event_id == b.event_id != c.event_id
    assert feedback(query_id="q", action="click", doc_id="d", timestamp=NOW, event_id="x").event_id == "x"


@pytest.mark.parametrize("fields, reason", [
    ({"ranker": "r", "timestamp": NOW, "results": []}, "impression: object missing required field `query_id`"),
    ({"query_id": "", "ranker": "r", "timestamp": NOW, "results": []}, "query_id must have 1 to 256 characters, not 0"),
    ({"query_id": "q" * 257, "ranker": "r", "timestamp": NOW, "results": []}, "not 257"),
    ({"query_id": "q", "ranker": "", "timestamp": NOW, "results": []}, "ranker is empty"),
    ({"query_id": "q", "ranker": "r", "timestamp": NOW, "results": [1, 2]}, "Expected `str`, got `int` - at `$.results[0]`"),
    ({"query_id": "q", "ranker": "r", "timestamp": True, "results": []}, "Expected `int | str`, got `bool`"),
    ({"query_id": "q", "ranker": "r", "timestamp": "yesterday", "results": []}, "is not RFC 3339 or epoch milliseconds"),
    ({"query_id": "q", "ranker": "r", "timestamp": "2027-01-15T08:00:00", "results": []}, "has no time zone"),
    ({"query_id": "q", "ranker": "r", "timestamp": NOW - 8 * 86_400_000, "results": []}, "too far in the past"),
    ({"query_id": "q", "ranker": "r", "timestamp": NOW + 2 * 3_600_000, "results": []}, "too far in the future"),
    ({"query_id": "q", "ranker": "r", "timestamp": NOW, "results": ["d"] * 1001}, "1001 results, more than the limit of 1000"),
])
def test_invalid_impressions_say_why(fields, reason):
    got = impression(**fields)
    assert isinstance(got, Rejected) and got.outcome == "invalid"
    assert reason in got.reason


@pytest.mark.parametrize("fields, reason", [
    ({"query_id": "q", "action": "judgment", "doc_id": "d", "timestamp": NOW}, "a judgment needs a grade"),
    ({"query_id": "q", "action": "judgment", "doc_id": "d", "timestamp": NOW, "grade": -1}, "grade -1.0 is not a number >= 0"),
    ({"query_id": "q", "action": "click", "doc_id": "d", "timestamp": NOW, "position": 0}, "position 0 is below 1"),
    ({"query_id": "q", "action": "click", "doc_id": "d", "timestamp": NOW, "dwell_ms": -5}, "dwell_ms -5 is negative"),
    ({"query_id": "q", "action": "click", "doc_id": "", "timestamp": NOW}, "doc_id is empty"),
    ({"query_id": "q", "action": "click", "timestamp": NOW}, "missing required field `doc_id`"),
])
def test_invalid_feedback_says_why(fields, reason):
    got = feedback(**fields)
    assert isinstance(got, Rejected) and got.outcome == "invalid"
    assert reason in got.reason


def test_garbage_and_unknown_actions():
    assert DEC.feedback(b"\xff\xfe", NOW).reason.startswith("not UTF-8 JSON")
    assert DEC.impression(b'{"query_id": "q", "ranker": ', NOW).reason.startswith("not UTF-8 JSON")
    assert DEC.impression(None, NOW) == Rejected("invalid", "empty message (no value)")
    assert DEC.impression(b"[1, 2]", NOW).reason == "impression: Expected `object`, got `array`"
    assert feedback(query_id="q", action="wishlist", doc_id="d", timestamp=NOW) == Rejected(
        "ignored", "action 'wishlist' is not in the grade map")
    strict = Decoder(config.load(None, {"RANKMETER_EVALUATION_REJECT_UNKNOWN_ACTIONS": "true"}))
    assert strict.feedback(json.dumps({"query_id": "q", "action": "wishlist", "doc_id": "d",
                                       "timestamp": NOW}).encode(), NOW) == Rejected("invalid", "unknown action 'wishlist'")


# ---- hostile input: nothing a producer sends may raise --------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20)
FIELDS = ["query_id", "ranker", "timestamp", "results", "action", "doc_id", "grade", "position", "dwell_ms",
          "event_id", "action_name", "query_response_hit_ids", "event_attributes", "query_attributes", "segment"]


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_rejected_not_raised(data):
    for decode in (DEC.impression, DEC.feedback):
        got = decode(data, NOW)
        assert isinstance(got, (Impression, Feedback, Rejected))


@settings(max_examples=1000, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8))
def test_arbitrary_json_objects_are_decoded_or_rejected_with_a_reason(fields):
    data = json.dumps(fields).encode()
    for decode in (DEC.impression, DEC.feedback):
        got = decode(data, NOW)
        assert isinstance(got, (Impression, Feedback, Rejected))
        if isinstance(got, Rejected):
            assert got.outcome in ("invalid", "ignored") and got.reason


def test_deeply_nested_json_is_rejected():
    data = b'{"query_id": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    assert DEC.impression(data, NOW) == Rejected("invalid", "impression: Expected `str`, got `array` - at `$.query_id`")
    assert DEC.feedback(b"[" * 100_000, NOW) == Rejected("invalid", "feedback event: Expected `object`, got `array`")
