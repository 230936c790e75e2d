"""OpenSearch UBI records (a query in `ubi_queries`, an event in `ubi_events`), read into
the fields the rules check."""

from __future__ import annotations

import msgspec

from rankmeter.config import Settings
from rankmeter.events.model import Feedback, Impression, Rejected
from rankmeter.events.rules import Rules
from rankmeter.events.wire import UbiEvent, UbiEventAttributes, UbiQuery, why


class UbiDecoder:
    """Reads UBI records already parsed as JSON (the decoder tells them from native ones)."""

    def __init__(self, settings: Settings, rules: Rules) -> None:
        self.rules = rules
        self.ranker_attribute = settings.limits.ubi_ranker_attribute
        self.hits_attribute = settings.limits.ubi_hits_attribute

    def query(self, raw: dict, now_ms: int) -> Impression | Rejected:
        try:
            ubi = msgspec.convert(raw, UbiQuery)
        except msgspec.ValidationError as e:
            return Rejected("invalid", why(e, "UBI query"))
        hits = next((h for h in (ubi.query_response_hit_ids, ubi.query_response_object_ids,
                                 ubi.query_response_objects_ids) if h), [])
        attributes = ubi.query_attributes or {}
        ranker = attributes.get(self.ranker_attribute, ubi.application)
        if not isinstance(ranker, str) or not ranker:
            return Rejected("invalid", f"UBI query has no ranker: neither query_attributes."
                                       f"{self.ranker_attribute} nor application is a non-empty string")
        segment = attributes.get("segment")
        impression = self.rules.impression(ubi.query_id, ranker, ubi.timestamp, [str(h) for h in hits],
                                           segment if isinstance(segment, str) else "", now_ms, ubi.user_query,
                                           ubi.client_id)
        if hits or isinstance(impression, Rejected):
            return impression
        # No hit ids (the UBI data generator, the JavaScript collector): the query's
        # impression events will say what was shown.
        expected = attributes.get(self.hits_attribute)
        expected = expected if isinstance(expected, int) and 0 < expected <= self.rules.max_results else 0
        return msgspec.structs.replace(impression, assemble=True, expected=expected)

    def event(self, raw: dict, value: bytes, now_ms: int) -> Feedback | Rejected:
        try:
            ubi = msgspec.convert(raw, UbiEvent)
        except msgspec.ValidationError as e:
            return Rejected("invalid", why(e, "UBI event"))
        attributes = ubi.event_attributes or UbiEventAttributes()
        doc_id = attributes.object.object_id if attributes.object else None
        doc_id = str(doc_id) if doc_id is not None else None
        sort_key = position(attributes)
        if doc_id is None and self.rules.known(ubi.action_name):
            return Rejected("invalid", "UBI event has no event_attributes.object.object_id")
        return self.rules.feedback(ubi.message_id, ubi.query_id, ubi.timestamp, ubi.action_name,
                                   doc_id or "", sort_key, None, attributes.grade, attributes.label,
                                   value, now_ms, first_position=0)


def position(attributes: UbiEventAttributes) -> int | None:
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

