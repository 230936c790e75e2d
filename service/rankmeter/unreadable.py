"""Stored values this version cannot read (a field split into the wrong number of parts, a
minute that is not an integer, sums of the wrong size): counted by kind
(`rankmeter_store_unreadable_total{kind}`), logged once per key and field, and skipped.
Nothing a stored value holds may stop a claim, a look, a report or a scrape."""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("rankmeter.store")

# exported even at 0
KINDS = ("bucket", "experiment", "interleaving", "layout", "history", "offsets", "watermark", "epoch", "list",
         "key", "query")
LOGGED_LIMIT = 10_000  # (key, field)s remembered as logged; past it, further ones are counted only


class Unreadable:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter({kind: 0 for kind in KINDS})
        self._logged: set[tuple[str, str]] = set()

    def skip(self, kind: str, key: str, field: str, why: object) -> None:
        """Count an unreadable stored field of `kind` under `key` and log it the first time."""
        self.counts[kind] += 1
        if (key, field) in self._logged or len(self._logged) >= LOGGED_LIMIT:
            return
        self._logged.add((key, field))
        log.error("skipping an unreadable stored field", extra={
            "kind": kind, "key": key, "field": repr(field[:200]), "why": str(why)[:200]})
