"""Label admission: a ranker or segment value is exported as itself while fewer than the
cap are in use across replicas (the store decides), else folded into `other`."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from rankmeter.config import Settings, duration_ms
from rankmeter.store import Store

log = logging.getLogger("rankmeter.pipeline")

OTHER = "other"             # the label of rankers and segments past the cap
LABEL_REFRESH_MS = 60_000   # how often an admitted label's last use is refreshed in the store


class Labels:
    def __init__(self, settings: Settings, store: Store, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock
        self.caps = {"ranker": settings.limits.max_rankers, "segment": settings.limits.max_segments}
        self.idle_ms = duration_ms(settings.limits.label_idle)
        self.folded: Counter[str] = Counter()  # label kind -> values folded
        self._cache: dict[tuple[str, str], tuple[str, int]] = {}  # -> (label, checked at ms)

    def label(self, kind: str, value: str) -> str:
        """The value itself while fewer than the cap are in use (across replicas, within
        `limits.label_idle`), else `other`. Checked again every LABEL_REFRESH_MS, which
        also keeps an admitted value's last use fresh."""
        now_ms = int(self.clock() * 1000)
        cached = self._cache.get((kind, value))
        if cached is not None and now_ms - cached[1] < LABEL_REFRESH_MS:
            return cached[0]
        admitted = value != OTHER and self.store.admit_label(kind, value, self.caps[kind], now_ms, self.idle_ms)
        label = value if admitted else OTHER
        if not admitted and (cached is None or cached[0] != OTHER):
            self.folded[kind] += 1
            log.warning("label folded into 'other'", extra={"kind": kind, "value": value[:100]})
        self._cache[(kind, value)] = (label, now_ms)
        return label
