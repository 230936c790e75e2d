"""What a replayed file's lines become: a Message for a topic, or a Skipped record, and
which stream (impressions or feedback) a record belongs to."""

from __future__ import annotations

from typing import Any, NamedTuple

from rankmeter.events import UBI_QUERY_KEYS, event_time_ms

IMPRESSIONS, FEEDBACK = "impressions", "feedback"


class Message(NamedTuple):
    stream: str           # IMPRESSIONS or FEEDBACK
    key: str              # the query_id
    timestamp_ms: int     # the record's event time, its Kafka timestamp
    value: dict[str, Any]  # the record as it is sent
    where: str            # FILE:LINE


class Skipped(NamedTuple):
    where: str            # FILE:LINE
    reason: str           # what kind of problem: counted per kind in the summary
    detail: str = ""      # this record's particulars, for its line in the summary
    record: bool = True   # a record was lost (not, e.g., an action line without one)


def to_message(record: Any, stream: str, where: str) -> Message | Skipped:
    if not isinstance(record, dict):
        return Skipped(where, "not a JSON object")
    query_id = record.get("query_id")
    if not isinstance(query_id, str) or not query_id:
        return Skipped(where, "no query_id")
    try:
        ts = event_time_ms(record.get("timestamp"))
    except ValueError as e:
        return Skipped(where, "bad timestamp", str(e))
    return Message(stream, query_id, ts, record, where)


def recognise(record: dict[str, Any]) -> str | None:
    """The stream of a record in plain ndjson, from its fields."""
    if "action_name" in record or "action" in record:
        return FEEDBACK
    if "results" in record or "user_query" in record or UBI_QUERY_KEYS & record.keys():
        return IMPRESSIONS
    return None


def index_stream(index: str) -> str | None:
    """`ubi_queries` (or any name ending in `queries`) and `ubi_events` (… `events`)."""
    if index.endswith("queries"):
        return IMPRESSIONS
    if index.endswith("events"):
        return FEEDBACK
    return None
