"""The rules every event is checked against, whatever its shape (native or UBI): the
limits (query ids, result counts, how old or new a timestamp may be) and the grades
its action gives (brief §3)."""

from __future__ import annotations

import hashlib
import unicodedata
from datetime import datetime, timedelta, timezone

from rankmeter.ab.clusters import bucket_of, user_hash
from rankmeter.config import MAX_GRADE, Settings, duration_ms
from rankmeter.engine.query import first_occurrences
from rankmeter.events.model import IMPRESSION_ACTION, Feedback, Impression, Rejected

# What a message's strings may hold (docs/events.md, docs/security.md). Names become label
# values, stored field parts and log fields; ids are stored in query records.
MAX_NAME = 128       # ranker, segment, interleaving experiment and team names, judgment labels
MAX_ID = 512         # event_id, doc_id, the results' and UBI object ids, UBI message_id
# Control characters (\x00, \n, the field separator \x1f, …), format characters (bidi
# overrides, zero-width) and line/paragraph separators: never in a name or a key part.
_FORBIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp"})


class Rules:
    """Turns an event's fields, once read from its shape, into an `Impression` or a
    `Feedback`, or a `Rejected` saying which rule it breaks; `now_ms` bounds timestamps."""

    def __init__(self, settings: Settings) -> None:
        self.max_results = settings.limits.max_results
        self.by_user = settings.ab.unit == "user"  # (the user's bucket: a hash, paid only when used)
        self.labels = dict(settings.evaluation.labels)
        self.grades = dict(settings.evaluation.grades)
        self.long_dwell_ms = settings.evaluation.long_dwell_ms
        self.long_dwell_grade = settings.evaluation.long_dwell_grade
        self.reject_unknown = settings.evaluation.reject_unknown_actions
        self.max_past_ms = duration_ms(settings.windows.max_past)
        self.max_future_ms = duration_ms(settings.windows.max_future)

    def impression(self, query_id: str, ranker: str, timestamp: str | int, results: list[str],
                   segment: str, now_ms: int, user_query: str | None = None,
                   client_id: str | None = None) -> Impression | Rejected:
        problem = check_query_id(query_id)
        if problem:
            return Rejected("invalid", problem)
        if not ranker:
            return Rejected("invalid", "ranker is empty")
        if len(results) > self.max_results:
            return Rejected("invalid", f"{len(results)} results, more than the limit of {self.max_results}")
        # (client_id has no limit: only its bucket is kept, never the id)
        problem = check_name("ranker", ranker) or check_name("segment", segment) or check_ids("results", results)
        if problem:
            return Rejected("invalid", problem)
        ts = self.timestamp(timestamp, now_ms)
        if isinstance(ts, Rejected):
            return ts
        # A document repeated in the list keeps its first rank (brief §2).
        # The user's hash (a BLAKE2b, 1.1 µs): paid only with ab.unit: user, which uses it.
        user = user_hash(client_id) if client_id and self.by_user else -1
        return Impression(query_id, ranker, ts, first_occurrences(results), segment,
                          query_hash=query_hash(user_query) if user_query else "",
                          user_bucket=bucket_of(user) if user != -1 else -1, user_hash=user)

    def known(self, action: str) -> bool:
        return action in ("judgment", IMPRESSION_ACTION) or action in self.grades

    def feedback(self, event_id: str | None, query_id: str, timestamp: str | int, action: str,
                 doc_id: str, position: int | None, dwell_ms: int | None, grade: float | None,
                 label: str | None, value: bytes, now_ms: int, first_position: int = 1) -> Feedback | Rejected:
        if not self.known(action):
            if self.reject_unknown:
                return Rejected("invalid", f"unknown action {action[:100]!r}")
            return Rejected("ignored", f"action {action[:100]!r} is not in the grade map")
        problem = check_query_id(query_id)
        if problem:
            return Rejected("invalid", problem)
        if not doc_id:
            return Rejected("invalid", "doc_id is empty")
        problem = check_id("doc_id", doc_id) or (check_id("event_id", event_id) if event_id else None)
        if problem:
            return Rejected("invalid", problem)
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
                problem = check_name("label", label)
                if problem:
                    return Rejected("invalid", problem)
                if label not in self.labels:
                    return Rejected("invalid", f"judgment label {label[:100]!r} is not in evaluation.labels")
                grade = self.labels[label]
            if grade is None:
                return Rejected("invalid", "a judgment needs a grade (or a label in evaluation.labels)")
            if not 0 <= grade <= MAX_GRADE:  # (NaN and inf too)
                return Rejected("invalid", f"grade {grade} is not a number >= 0 and <= {MAX_GRADE:g}")
            event_grade, explicit = float(grade), True
        else:
            event_grade, explicit = self.grades[action], False
            if action == "click" and dwell_ms is not None and dwell_ms >= self.long_dwell_ms:
                event_grade = max(event_grade, self.long_dwell_grade)
        ts = self.timestamp(timestamp, now_ms)
        if isinstance(ts, Rejected):
            return ts
        if not event_id:  # idempotency key: the content itself
            event_id = hashlib.blake2b(value, digest_size=12).hexdigest()
        return Feedback(event_id, query_id, ts, action, doc_id, event_grade, explicit, position)

    def timestamp(self, timestamp: str | int, now_ms: int) -> int | Rejected:
        try:
            ms = event_time_ms(timestamp)
        except ValueError as e:
            return Rejected("invalid", str(e))
        if ms < now_ms - self.max_past_ms:
            return Rejected("invalid", f"timestamp {_shown(timestamp)} is too far in the past")
        if ms > now_ms + self.max_future_ms:
            return Rejected("invalid", f"timestamp {_shown(timestamp)} is too far in the future")
        return ms


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def event_time_ms(value: object) -> int:
    """An event's `timestamp` in epoch ms: integer epoch milliseconds, or an RFC 3339 string
    with a time zone (exactly: no float rounding). Raises ValueError saying why not."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise ValueError("no timestamp" if value is None else f"timestamp {_shown(value)} is not RFC 3339 or epoch milliseconds")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"timestamp {_shown(value)} is not RFC 3339 or epoch milliseconds") from None
    if parsed.tzinfo is None:
        raise ValueError(f"timestamp {_shown(value)} has no time zone")
    return (parsed - _EPOCH) // timedelta(milliseconds=1)


def query_hash(text: str) -> str:
    """64 bits of the query text, case and spacing folded: what the position-bias
    harvest groups impressions by (a record keeps 16 characters, not the text)."""
    folded = " ".join(text.casefold().split())
    return hashlib.blake2b(folded.encode(), digest_size=8).hexdigest()


def check_query_id(query_id: str) -> str | None:
    if not 1 <= len(query_id) <= 256:
        return f"query_id must have 1 to 256 characters, not {len(query_id)}"
    return _characters("query_id", query_id)


def check_name(field: str, value: str) -> str | None:
    """Why a name (a label value, a stored field's part) is refused, or None."""
    if len(value) > MAX_NAME:
        return f"{field} has {len(value)} characters, more than the limit of {MAX_NAME}: {_shown(value)}"
    return _characters(field, value)


def check_id(field: str, value: str) -> str | None:
    if len(value) > MAX_ID:
        return f"{field} has {len(value)} characters, more than the limit of {MAX_ID}: {_shown(value)}"
    return None


def check_ids(field: str, values: list[str]) -> str | None:
    if not values or max(map(len, values)) <= MAX_ID:  # the common case, at C speed
        return None
    return next((problem for v in values if (problem := check_id(field, v))), None)


def _characters(field: str, value: str) -> str | None:
    if value.isprintable():  # the common case, at C speed: no Cc, Cf, Zl, Zp (nor other separators)
        return None
    bad = next((c for c in value if unicodedata.category(c) in _FORBIDDEN), None)
    if bad is None:  # only other spaces (Zs), private-use or unassigned characters: allowed
        return None
    return f"{field} holds the control character U+{ord(bad):04X} ({unicodedata.category(bad)}): {_shown(value)}"


def _shown(value: object) -> str:
    """A value in a reason: its first 100 characters, quoted (a reason never carries a hostile string whole)."""
    if not isinstance(value, str):
        return repr(value)[:100]
    return repr(value[:100]) + ("…" if len(value) > 100 else "")
