"""What arrives on the wire: the native and the OpenSearch UBI shapes, as msgspec decodes them."""

from __future__ import annotations

from typing import Any

import msgspec


class Interleaving(msgspec.Struct):
    experiment: str
    teams: list[str]


class NativeImpression(msgspec.Struct):
    query_id: str
    ranker: str
    timestamp: str | int
    results: list[str]
    segment: str | None = None
    interleaving: Interleaving | None = None
    user_query: str | None = None
    session_id: str | None = None
    client_id: str | None = None


class UbiQuery(msgspec.Struct):
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


class NativeFeedback(msgspec.Struct):
    query_id: str
    timestamp: str | int
    action: str
    doc_id: str
    event_id: str | None = None
    position: int | None = None
    dwell_ms: int | None = None
    grade: float | None = None
    label: str | None = None  # a judgment's label (ESCI's Exact, …), graded by evaluation.labels


class UbiObject(msgspec.Struct):
    object_id: str | int | None = None


class UbiXY(msgspec.Struct):
    x: float
    y: float


class UbiPosition(msgspec.Struct):
    ordinal: int | None = None   # 1-based in the UBI schema; the UBI data generator writes 0-based
    index: int | None = None     # 0-based (what some collectors send)
    xy: UbiXY | None = None      # where on the page (the UBI JavaScript collector's alternative)


class UbiEventAttributes(msgspec.Struct):
    object: UbiObject | None = None
    position: UbiPosition | None = None
    rank: int | None = None      # 0-based (the UBI data generator's older shape)
    grade: float | None = None   # an explicit judgment's grade ...
    label: str | None = None     # ... or its label


class UbiEvent(msgspec.Struct):
    action_name: str
    query_id: str
    timestamp: str | int
    event_attributes: UbiEventAttributes | None = None
    session_id: str | None = None
    client_id: str | None = None
    message_id: str | None = None


_UBI_HIT_KEYS = ("query_response_hit_ids", "query_response_object_ids", "query_response_objects_ids")
# What tells a UBI query record from a native impression missing its `results`.
UBI_QUERY_KEYS = frozenset({*_UBI_HIT_KEYS, "application", "query_attributes", "query_response_id"})


def why(error: msgspec.ValidationError, what: str) -> str:
    """msgspec's message, saying which kind of record it was about."""
    message = str(error)
    if message.startswith("Object missing required field"):
        return f"{what}: {message[0].lower()}{message[1:]}"
    return f"{what}: {message}"
