"""The event model: impressions and feedback, native or OpenSearch UBI, decoded and checked.

`Decoder.impression(value)` and `Decoder.feedback(value)` turn one Kafka message value
into an `Impression`, a `Feedback`, or a `Rejected` (with the outcome, `invalid` or
`ignored`, and a reason a person can act on). Brief §2 and §3 are the contract.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone
from typing import Any, NamedTuple

import msgspec

from rankmeter.config import Settings, duration_ms
from rankmeter.engine.query import first_occurrences


# ---- what the pipeline works with ------------------------------------------------

class Impression(msgspec.Struct, array_like=True, frozen=True):
    query_id: str
    ranker: str
    timestamp_ms: int
    results: list[str]  # in rank order, each document once
    segment: str = ""
    experiment: str = ""     # a team-draft interleaving experiment, when the list is interleaved ...
    teams: list[str] = []    # ... and the ranker (team) that contributed each position of `results`
    # A UBI query record without its hit ids: the list comes from the query's `impression`
    # events (join.py), `results` stays empty here; `expected` is how many results the
    # record says were shown (0: not said).
    assemble: bool = False
    expected: int = 0
    # `query_hash(user_query)`: the same query text across rankers, for position-bias
    # estimation (debias/); "" when the event has no text.
    query_hash: str = ""


class Feedback(msgspec.Struct, array_like=True, frozen=True):
    event_id: str
    query_id: str
    timestamp_ms: int
    action: str
    doc_id: str
    grade: float          # the grade this event gives the document (brief §3)
    explicit: bool        # a `judgment`: replaces earlier grades instead of maxing with them
    # As sent, 1-based for native events; for UBI events see `_ubi_position`. Ranks come from
    # the impression's list; the position only orders a list assembled from impression events.
    position: int | None = None


IMPRESSION_ACTION = "impression"  # a feedback event that places a document in its query's list


class Rejected(NamedTuple):
    outcome: str  # "invalid" (dead-lettered) or "ignored" (counted, not applied)
    reason: str


# ---- what arrives on the wire ----------------------------------------------------

class _Interleaving(msgspec.Struct):
    experiment: str
    teams: list[str]


class _NativeImpression(msgspec.Struct):
    query_id: str
    ranker: str
    timestamp: str | int
    results: list[str]
    segment: str | None = None
    interleaving: _Interleaving | None = None
    user_query: str | None = None
    session_id: str | None = None
    client_id: str | None = None


class _UbiQuery(msgspec.Struct):
    query_id: str
    timestamp: str | int
    # Object ids are strings in the spec; numeric ones (SKUs, ISBNs) are taken as text.
    query_response_hit_ids: list[str | int] | None = None
    query_response_object_ids: list[str | int] | None = None   # older spellings
    query_response_objects_ids: list[str | int] | None = None
    application: str | None = None
    query_attributes: dict[str, Any] | None = None
    user_query: str | None = None
    client_id: str | None = None


class _NativeFeedback(msgspec.Struct):
    query_id: str
    timestamp: str | int
    action: str
    doc_id: str
    event_id: str | None = None
    position: int | None = None
    dwell_ms: int | None = None
    grade: float | None = None
    label: str | None = None  # a judgment's label (ESCI's Exact, …), graded by evaluation.labels


class _UbiObject(msgspec.Struct):
    object_id: str | int | None = None


class _UbiXY(msgspec.Struct):
    x: float
    y: float


class _UbiPosition(msgspec.Struct):
    ordinal: int | None = None   # 1-based in the UBI schema; the UBI data generator writes 0-based
    index: int | None = None     # 0-based (what some collectors send)
    xy: _UbiXY | None = None     # where on the page (the UBI JavaScript collector's alternative)


class _UbiEventAttributes(msgspec.Struct):
    object: _UbiObject | None = None
    position: _UbiPosition | None = None
    rank: int | None = None      # 0-based (the UBI data generator's older shape)
    grade: float | None = None   # an explicit judgment's grade ...
    label: str | None = None     # ... or its label


class _UbiEvent(msgspec.Struct):
    action_name: str
    query_id: str
    timestamp: str | int
    event_attributes: _UbiEventAttributes | None = None
    session_id: str | None = None
    client_id: str | None = None
    message_id: str | None = None


_UBI_HIT_KEYS = ("query_response_hit_ids", "query_response_object_ids", "query_response_objects_ids")
# What tells a UBI query record from a native impression missing its `results`.
UBI_QUERY_KEYS = frozenset({*_UBI_HIT_KEYS, "application", "query_attributes", "query_response_id"})


class Decoder:
    """Decodes and checks messages with one configuration; `now_ms` bounds timestamps."""

    def __init__(self, settings: Settings) -> None:
        self.max_results = settings.limits.max_results
        self.ranker_attribute = settings.limits.ubi_ranker_attribute
        self.hits_attribute = settings.limits.ubi_hits_attribute
        self.labels = dict(settings.evaluation.labels)
        self.grades = dict(settings.evaluation.grades)
        self.long_dwell_ms = settings.evaluation.long_dwell_ms
        self.long_dwell_grade = settings.evaluation.long_dwell_grade
        self.reject_unknown = settings.evaluation.reject_unknown_actions
        self.max_past_ms = duration_ms(settings.windows.max_past)
        self.max_future_ms = duration_ms(settings.windows.max_future)
        self._native_impression = msgspec.json.Decoder(_NativeImpression)
        self._native_feedback = msgspec.json.Decoder(_NativeFeedback)
        self._any = msgspec.json.Decoder()

    # -- impressions --

    def impression(self, value: bytes | None, now_ms: int) -> Impression | Rejected:
        return _never_raising(self._impression_message, value, now_ms)

    def feedback(self, value: bytes | None, now_ms: int) -> Feedback | Rejected:
        return _never_raising(self._feedback_message, value, now_ms)

    def _impression_message(self, value: bytes | None, now_ms: int) -> Impression | Rejected:
        if value is None:
            return Rejected("invalid", "empty message (no value)")
        try:
            native = self._native_impression.decode(value)
        except msgspec.ValidationError as e:  # (a DecodeError too: this clause comes first)
            raw = self._decode_any(value)
            if isinstance(raw, dict) and "results" not in raw and UBI_QUERY_KEYS & raw.keys():
                return self._ubi_query(raw, now_ms)
            return Rejected("invalid", _why(e, "impression"))
        except msgspec.DecodeError as e:
            return Rejected("invalid", f"not UTF-8 JSON: {e}")
        impression = self._impression(native.query_id, native.ranker, native.timestamp,
                                      native.results, native.segment or "", now_ms, native.user_query)
        if native.interleaving is None or isinstance(impression, Rejected):
            return impression
        return _interleaved(impression, native.results, native.interleaving)

    def _ubi_query(self, raw: dict, now_ms: int) -> Impression | Rejected:
        try:
            ubi = msgspec.convert(raw, _UbiQuery)
        except msgspec.ValidationError as e:
            return Rejected("invalid", _why(e, "UBI query"))
        hits = next((h for h in (ubi.query_response_hit_ids, ubi.query_response_object_ids,
                                 ubi.query_response_objects_ids) if h), [])
        attributes = ubi.query_attributes or {}
        ranker = attributes.get(self.ranker_attribute, ubi.application)
        if not isinstance(ranker, str) or not ranker:
            return Rejected("invalid", f"UBI query has no ranker: neither query_attributes."
                                       f"{self.ranker_attribute} nor application is a non-empty string")
        segment = attributes.get("segment")
        impression = self._impression(ubi.query_id, ranker, ubi.timestamp, [str(h) for h in hits],
                                      segment if isinstance(segment, str) else "", now_ms, ubi.user_query)
        if hits or isinstance(impression, Rejected):
            return impression
        # No hit ids (the UBI data generator, the JavaScript collector): the query's
        # impression events will say what was shown.
        expected = attributes.get(self.hits_attribute)
        expected = expected if isinstance(expected, int) and 0 < expected <= self.max_results else 0
        return msgspec.structs.replace(impression, assemble=True, expected=expected)

    def _impression(self, query_id: str, ranker: str, timestamp: str | int, results: list[str],
                    segment: str, now_ms: int, user_query: str | None = None) -> Impression | Rejected:
        problem = _check_query_id(query_id)
        if problem:
            return Rejected("invalid", problem)
        if not ranker:
            return Rejected("invalid", "ranker is empty")
        if len(results) > self.max_results:
            return Rejected("invalid", f"{len(results)} results, more than the limit of {self.max_results}")
        ts = self._timestamp(timestamp, now_ms)
        if isinstance(ts, Rejected):
            return ts
        # A document repeated in the list keeps its first rank (brief §2).
        return Impression(query_id, ranker, ts, first_occurrences(results), segment,
                          query_hash=query_hash(user_query) if user_query else "")

    # -- feedback --

    def _feedback_message(self, value: bytes | None, now_ms: int) -> Feedback | Rejected:
        if value is None:
            return Rejected("invalid", "empty message (no value)")
        try:
            native = self._native_feedback.decode(value)
        except msgspec.ValidationError as e:
            raw = self._decode_any(value)
            if isinstance(raw, dict) and "action_name" in raw and "action" not in raw:
                return self._ubi_event(raw, value, now_ms)
            return Rejected("invalid", _why(e, "feedback event"))
        except msgspec.DecodeError as e:
            return Rejected("invalid", f"not UTF-8 JSON: {e}")
        return self._feedback(native.event_id, native.query_id, native.timestamp, native.action,
                              native.doc_id, native.position, native.dwell_ms, native.grade,
                              native.label, value, now_ms)

    def _ubi_event(self, raw: dict, value: bytes, now_ms: int) -> Feedback | Rejected:
        try:
            ubi = msgspec.convert(raw, _UbiEvent)
        except msgspec.ValidationError as e:
            return Rejected("invalid", _why(e, "UBI event"))
        attributes = ubi.event_attributes or _UbiEventAttributes()
        doc_id = attributes.object.object_id if attributes.object else None
        doc_id = str(doc_id) if doc_id is not None else None
        position = _ubi_position(attributes)
        if doc_id is None and self._known(ubi.action_name):
            return Rejected("invalid", "UBI event has no event_attributes.object.object_id")
        return self._feedback(ubi.message_id, ubi.query_id, ubi.timestamp, ubi.action_name,
                              doc_id or "", position, None, attributes.grade, attributes.label, value, now_ms,
                              first_position=0)

    def _known(self, action: str) -> bool:
        return action in ("judgment", IMPRESSION_ACTION) or action in self.grades

    def _feedback(self, event_id: str | None, query_id: str, timestamp: str | int, action: str,
                  doc_id: str, position: int | None, dwell_ms: int | None, grade: float | None,
                  label: str | None, value: bytes, now_ms: int, first_position: int = 1) -> Feedback | Rejected:
        if not self._known(action):
            if self.reject_unknown:
                return Rejected("invalid", f"unknown action {action!r}")
            return Rejected("ignored", f"action {action!r} is not in the grade map")
        problem = _check_query_id(query_id)
        if problem:
            return Rejected("invalid", problem)
        if not doc_id:
            return Rejected("invalid", "doc_id is empty")
        if position is not None and position < first_position:
            return Rejected("invalid", f"position {position} is below {first_position}")
        if dwell_ms is not None and dwell_ms < 0:
            return Rejected("invalid", f"dwell_ms {dwell_ms} is negative")
        if action == IMPRESSION_ACTION:
            if position is None:
                return Rejected("ignored", "an impression event without a position cannot place its document in a list")
            event_grade, explicit = 0.0, False
        elif action == "judgment":
            if grade is None and label is not None:
                if label not in self.labels:
                    return Rejected("invalid", f"judgment label {label[:100]!r} is not in evaluation.labels")
                grade = self.labels[label]
            if grade is None:
                return Rejected("invalid", "a judgment needs a grade (or a label in evaluation.labels)")
            if not grade >= 0 or grade == float("inf"):
                return Rejected("invalid", f"grade {grade} is not a number >= 0")
            event_grade, explicit = float(grade), True
        else:
            event_grade, explicit = self.grades[action], False
            if action == "click" and dwell_ms is not None and dwell_ms >= self.long_dwell_ms:
                event_grade = max(event_grade, self.long_dwell_grade)
        ts = self._timestamp(timestamp, now_ms)
        if isinstance(ts, Rejected):
            return ts
        if not event_id:  # idempotency key: the content itself
            event_id = hashlib.blake2b(value, digest_size=12).hexdigest()
        return Feedback(event_id, query_id, ts, action, doc_id, event_grade, explicit, position)

    # -- shared --

    def _decode_any(self, value: bytes) -> Any:
        # Validation can stop before the end of the document: the rest may not be JSON.
        try:
            return self._any.decode(value)
        except (msgspec.DecodeError, RecursionError):
            return None

    def _timestamp(self, timestamp: str | int, now_ms: int) -> int | Rejected:
        try:
            ms = event_time_ms(timestamp)
        except ValueError as e:
            return Rejected("invalid", str(e))
        if ms < now_ms - self.max_past_ms:
            return Rejected("invalid", f"timestamp {timestamp!r} is too far in the past")
        if ms > now_ms + self.max_future_ms:
            return Rejected("invalid", f"timestamp {timestamp!r} is too far in the future")
        return ms


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def event_time_ms(value: object) -> int:
    """An event's `timestamp` in epoch ms: integer epoch milliseconds, or an RFC 3339 string
    with a time zone (exactly: no float rounding). Raises ValueError saying why not."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise ValueError("no timestamp" if value is None else f"timestamp {value!r} is not RFC 3339 or epoch milliseconds")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"timestamp {value!r} is not RFC 3339 or epoch milliseconds") from None
    if parsed.tzinfo is None:
        raise ValueError(f"timestamp {value!r} has no time zone")
    return (parsed - _EPOCH) // timedelta(milliseconds=1)


def _ubi_position(attributes: _UbiEventAttributes) -> int | None:
    """A UBI event's position as a sort key: `position.ordinal` as sent (1-based in the UBI
    schema, 0-based from the UBI data generator: only the order is used), else the 0-based
    `position.index` or `rank`, plus one, else `position.xy` in reading order (top to
    bottom, then left to right, to the pixel: y * 1,000,000 + x)."""
    p = attributes.position
    if p is not None and p.ordinal is not None:
        return p.ordinal
    if p is not None and p.index is None and p.xy is not None and attributes.rank is None:
        x, y = round(p.xy.x), round(p.xy.y)
        return y * 1_000_000 + x if 0 <= x < 1_000_000 and y >= 0 else -1
    zero_based = p.index if p is not None and p.index is not None else attributes.rank
    if zero_based is None:
        return None
    return zero_based + 1 if zero_based >= 0 else zero_based  # a negative one stays invalid


def query_hash(text: str) -> str:
    """64 bits of the query text, case and spacing folded: what the position-bias
    harvest groups impressions by (a record keeps 16 characters, not the text)."""
    folded = " ".join(text.casefold().split())
    return hashlib.blake2b(folded.encode(), digest_size=8).hexdigest()


def _interleaved(impression: Impression, shown: list[str], il: _Interleaving) -> Impression | Rejected:
    """Team-draft attribution (brief §2): a team per position of the list as sent, kept for
    each document's first position like the list itself; exactly two teams."""
    if len(il.teams) != len(shown):
        return Rejected("invalid", f"interleaving.teams has {len(il.teams)} entries for {len(shown)} results")
    if not il.experiment or len(set(il.teams)) != 2:
        return Rejected("invalid", "interleaving needs an experiment name and exactly two teams")
    first = {}
    for doc, team in zip(shown, il.teams):
        first.setdefault(doc, team)
    teams = [first[doc] for doc in impression.results]
    if len(set(teams)) != 2:
        return Rejected("invalid", "interleaving: once repeated documents are dropped, one team is left")
    return msgspec.structs.replace(impression, experiment=il.experiment, teams=teams)


def _never_raising(decode, value: bytes | None, now_ms: int):
    """A message must never stop the stream: whatever decoding raises is a rejection."""
    try:
        return decode(value, now_ms)
    except RecursionError:
        return Rejected("invalid", "JSON nested too deeply")
    except Exception as e:  # a bug in our checks must not become a crash loop either
        return Rejected("invalid", f"cannot decode: {e.__class__.__name__}: {e}")


def _check_query_id(query_id: str) -> str | None:
    if not 1 <= len(query_id) <= 256:
        return f"query_id must have 1 to 256 characters, not {len(query_id)}"
    return None


def _why(error: msgspec.ValidationError, what: str) -> str:
    message = str(error)
    if message.startswith("Object missing required field"):
        return f"{what}: {message[0].lower()}{message[1:]}"
    return f"{what}: {message}"
