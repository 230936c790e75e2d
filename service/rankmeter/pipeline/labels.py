"""Label admission: a ranker, segment or interleaving experiment value is exported as
itself while fewer than the cap are in use across replicas (the store decides), else
folded into `other` (an interleaving experiment past its cap is not counted)."""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable

from rankmeter.config import Settings, duration_ms
from rankmeter.store import Store

log = logging.getLogger("rankmeter.pipeline")

OTHER = "other"             # the label of rankers and segments past the cap
LABEL_REFRESH_MS = 60_000   # how often an admitted label's last use is refreshed in the store
CACHE_LIMIT = 10_000        # values whose decision is remembered (the least recently used go)
KINDS = ("ranker", "segment", "experiment")


class Labels:
    def __init__(self, settings: Settings, store: Store, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock
        limits = settings.limits
        self.caps = {"ranker": limits.max_rankers, "segment": limits.max_segments,
                     "experiment": limits.max_experiments}
        self.idle_ms = duration_ms(limits.label_idle)
        self.folded: Counter[str] = Counter()  # label kind -> values folded
        # (kind, value) -> (label, checked at ms). Bounded: a stream of new names past the
        # cap would otherwise grow it for ever; a value forgotten is asked about again.
        self._cache: OrderedDict[tuple[str, str], tuple[str, int]] = OrderedDict()

    def label(self, kind: str, value: str) -> str:
        """The value itself while fewer than the cap are in use (across replicas, within
        `limits.label_idle`), else `other`. Checked again every LABEL_REFRESH_MS, which
        also keeps an admitted value's last use fresh."""
        now_ms = int(self.clock() * 1000)
        cached = self._cache.get((kind, value))
        if cached is not None and now_ms - cached[1] < LABEL_REFRESH_MS:
            self._cache.move_to_end((kind, value))
            return cached[0]
        admitted = value != OTHER and self.store.admit_label(kind, value, self.caps[kind], now_ms, self.idle_ms)
        label = value if admitted else OTHER
        if not admitted and (cached is None or cached[0] != OTHER):
            self.folded[kind] += 1
            log.warning("label folded into 'other'", extra={"kind": kind, "value": value[:100]})
        self._cache[(kind, value)] = (label, now_ms)
        self._cache.move_to_end((kind, value))
        if len(self._cache) > CACHE_LIMIT:
            self._cache.popitem(last=False)
        return label
