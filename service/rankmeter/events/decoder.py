"""The decoder: a native message, or a UBI record told apart by its keys, into an event;
it never raises, whatever the message holds."""

from __future__ import annotations

from typing import Any

import msgspec

from rankmeter.ab.clusters import bucket_of, user_hash
from rankmeter.config import MAX_GRADE, Settings
from rankmeter.events.model import Feedback, Impression, Rejected
from rankmeter.events.rules import Rules, check_name, query_hash
from rankmeter.events.ubi import UbiDecoder
from rankmeter.events.wire import UBI_QUERY_KEYS, Interleaving, NativeFeedback, NativeImpression, why


class Decoder:
    """Decodes and checks messages with one configuration; `now_ms` bounds timestamps.

    `native` (the default): the plain native messages go through rankmeter._events, the
    same rules in C (5–10 times cheaper), when it is built; any other message, and any
    the rules refuse, through the Python path below, which is the definition."""

    def __init__(self, settings: Settings, native: bool = True) -> None:
        self.rules = Rules(settings)
        self.ubi = UbiDecoder(settings, self.rules)
        self._native_impression = msgspec.json.Decoder(NativeImpression)
        self._native_feedback = msgspec.json.Decoder(NativeFeedback)
        self._any = msgspec.json.Decoder()
        self.plain = _plain_decoder(self.rules) if native else None

    def impression(self, value: bytes | None, now_ms: int) -> Impression | Rejected:
        if self.plain is not None:
            try:
                event = self.plain.impression(value, now_ms)
            except Exception:  # (MemoryError, say): the Python path decides, and says why
                event = None
            if event is not None:
                return event
        return _never_raising(self._impression_message, value, now_ms)

    def feedback(self, value: bytes | None, now_ms: int) -> Feedback | Rejected:
        if self.plain is not None:
            try:
                event = self.plain.feedback(value, now_ms)
            except Exception:
                event = None
            if event is not None:
                return event
        return _never_raising(self._feedback_message, value, now_ms)

    def _impression_message(self, value: bytes | None, now_ms: int) -> Impression | Rejected:
        if value is None:
            return Rejected("invalid", "empty message (no value)")
        try:
            native = self._native_impression.decode(value)
        except msgspec.ValidationError as e:  # (a DecodeError too: this clause comes first)
            raw = self._decode_any(value)
            if isinstance(raw, dict) and "results" not in raw and UBI_QUERY_KEYS & raw.keys():
                return self.ubi.query(raw, now_ms)
            return Rejected("invalid", why(e, "impression"))
        except msgspec.DecodeError as e:
            return Rejected("invalid", f"not UTF-8 JSON: {e}")
        impression = self.rules.impression(native.query_id, native.ranker, native.timestamp,
                                           native.results, native.segment or "", now_ms, native.user_query,
                                           native.client_id)
        if native.interleaving is None or isinstance(impression, Rejected):
            return impression
        return _interleaved(impression, native.results, native.interleaving)

    def _feedback_message(self, value: bytes | None, now_ms: int) -> Feedback | Rejected:
        if value is None:
            return Rejected("invalid", "empty message (no value)")
        try:
            native = self._native_feedback.decode(value)
        except msgspec.ValidationError as e:
            raw = self._decode_any(value)
            if isinstance(raw, dict) and "action_name" in raw and "action" not in raw:
                return self.ubi.event(raw, value, now_ms)
            return Rejected("invalid", why(e, "feedback event"))
        except msgspec.DecodeError as e:
            return Rejected("invalid", f"not UTF-8 JSON: {e}")
        return self.rules.feedback(native.event_id, native.query_id, native.timestamp, native.action,
                                   native.doc_id, native.position, native.dwell_ms, native.grade,
                                   native.label, value, now_ms)

    def _decode_any(self, value: bytes) -> Any:
        # Validation can stop before the end of the document: the rest may not be JSON.
        try:
            return self._any.decode(value)
        except (msgspec.DecodeError, RecursionError):
            return None


def _plain_decoder(rules: Rules):
    """rankmeter._events' decoder with these rules, or None without the module."""
    try:
        from rankmeter._events import Decoder as PlainDecoder

        return PlainDecoder(Feedback, Impression, rules.grades, rules.long_dwell_ms, rules.long_dwell_grade,
                            rules.max_past_ms, rules.max_future_ms, rules.max_results, MAX_GRADE, rules.by_user,
                            query_hash, user_hash, bucket_of)
    except Exception:  # not built, or built from another version of _events.c (another signature)
        return None


def _interleaved(impression: Impression, shown: list[str], il: Interleaving) -> Impression | Rejected:
    """Team-draft attribution (brief §2): a team per position of the list as sent, kept for
    each document's first position like the list itself; exactly two teams."""
    if len(il.teams) != len(shown):
        return Rejected("invalid", f"interleaving.teams has {len(il.teams)} entries for {len(shown)} results")
    if not il.experiment or len(set(il.teams)) != 2:
        return Rejected("invalid", "interleaving needs an experiment name and exactly two teams")
    problem = check_name("interleaving.experiment", il.experiment) or next(
        (p for team in set(il.teams) if (p := check_name("interleaving.teams", team))), None)
    if problem:
        return Rejected("invalid", problem)
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
        return Rejected("invalid", f"cannot decode: {e.__class__.__name__}: {str(e)[:200]}")
