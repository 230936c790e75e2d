"""Rolling micro/macro aggregates over event-time windows, from one-minute buckets.

Each query contributes one vector to the bucket of its impression minute (per ranker
and segment label). For every measure the vector holds five sums (`Sums`):

    [Σ value, number of queries averaged, Σ numerator, Σ denominator, Σ value²]

(macro = Σ value / count, micro = Σ num / Σ den; Σ value² gives the variance behind an
A/B confidence interval), then, for the quality measures, how
many queries have a value in each tenth of [0, 1] (the per-query distribution), and
last two query counts, `all` and `judged`. When feedback changes a query's metrics, the bucket gets the difference
between its new and old vector (brief §5, §8). A window is the sum of the buckets whose
minute lies in it, computed when Prometheus scrapes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np

SLOTS = 5  # per measure: the fields of Sums
BINS = 11  # per distributed measure: queries with value in [0, .1], (.1, .2], …, (.9, 1], above 1
BIN_EDGES = ("0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9", "1.0", "+Inf")
# Upper bounds, inclusive as Prometheus' `le` is: 0.5 falls in the bin exported as le="0.5".
_UPPER = np.array([float(e) for e in BIN_EDGES[:-1]])
MINUTE_MS = 60_000


class Sums(NamedTuple):
    """One measure's sums over the queries of a window."""
    value_sum: float     # Σ per-query value         (macro numerator)
    count: float         # queries averaged          (macro denominator)
    numerator: float     # Σ per-query numerator     (micro numerator)
    denominator: float   # Σ per-query denominator   (micro denominator)
    value_squares: float  # Σ per-query value²

    def macro(self) -> float:
        return self.value_sum / self.count if self.count else float("nan")

    def micro(self) -> float:
        return self.numerator / self.denominator if self.denominator else float("nan")


class BucketKey(NamedTuple):
    ranker: str
    segment: str
    minute: int  # impression time // 60 s

    def encode(self) -> str:
        return f"{self.ranker}\x1f{self.segment}\x1f{self.minute}"

    @classmethod
    def decode(cls, field: str) -> BucketKey:
        """Raises ValueError for a field that is not ranker␟segment␟minute."""
        ranker, segment, minute = field.split("\x1f")
        return cls(ranker, segment, int(minute))


class Layout:
    """Where each measure's sums sit in a contribution vector.

    Stored sums are tied to the layout that wrote them by `fingerprint`. Each measure has
    an identity (`ids`): its name, plus, for quality measures, what its values depend on
    (grade map, relevance level, empty-query policy). When the configuration changes,
    `remap` carries the sums of every measure whose identity is unchanged, starts new
    ones at zero and drops removed ones, so a sum is never exported under another name.
    """

    def __init__(self, metric_names: list[str], averaged_over_all: Iterable[str],
                 distributed: Iterable[str] = (), ids: list[str] | None = None,
                 judged_id: str = "judged") -> None:
        self.names = metric_names
        self.ids = ids if ids is not None else list(metric_names)
        self.judged_id = judged_id  # "judged" depends on the grades too: tagged like quality measures
        over_all = set(averaged_over_all)
        self.over_all = np.array([n in over_all for n in metric_names])
        self.distributed = [n for n in metric_names if n in set(distributed)]
        self._distributed_columns = [metric_names.index(n) for n in self.distributed]
        self.bins_start = SLOTS * len(metric_names)
        self.size = self.bins_start + BINS * len(self.distributed) + 2
        self.all_slot, self.judged_slot = self.size - 2, self.size - 1
        self.description = json.dumps({"ids": self.ids, "over_all": sorted(over_all & set(metric_names)),
                                       "distributed": [self.ids[c] for c in self._distributed_columns],
                                       "names": metric_names, "judged": judged_id}, sort_keys=True)
        self.fingerprint = hashlib.sha256(self.description.encode()).hexdigest()[:16]

    @classmethod
    def from_description(cls, description: str) -> Layout:
        d = json.loads(description)
        distributed = {d["names"][d["ids"].index(i)] for i in d["distributed"]}
        return cls(d["names"], d["over_all"], distributed, d["ids"], d.get("judged", "judged"))

    def _slots(self) -> dict[tuple[str, int], int]:
        """(identity, k) -> index: k < SLOTS for the sums, SLOTS + b for bin b, and the two
        query counts under their own identities."""
        slots = {(i, k): SLOTS * c + k for c, i in enumerate(self.ids) for k in range(SLOTS)}
        for j, c in enumerate(self._distributed_columns):
            slots.update({(self.ids[c], SLOTS + b): self.bins_start + BINS * j + b for b in range(BINS)})
        slots[("queries", 0)], slots[(self.judged_id, 0)] = self.all_slot, self.judged_slot
        return slots

    def remap(self, old: Layout) -> tuple[np.ndarray, np.ndarray]:
        """Index arrays (target, source): `new[target] = old_vector[source]` carries what
        both layouts share; the rest of a new vector starts at zero."""
        mine, theirs = self._slots(), old._slots()
        shared = [k for k in mine if k in theirs]
        return np.array([mine[k] for k in shared], dtype=int), np.array([theirs[k] for k in shared], dtype=int)

    def convert(self, vector: np.ndarray, old: Layout) -> np.ndarray:
        target, source = self.remap(old)
        out = np.zeros(self.size)
        out[target] = vector[source]
        return out

    def contributions(self, values: np.ndarray, nums: np.ndarray, dens: np.ndarray,
                      judged: np.ndarray) -> np.ndarray:
        """[Q, size] vectors from per-query [Q, M] values, numerators and denominators.
        A query counts in a measure's averages when the value is defined and the query is
        in the measure's population (judged, or all for online signals)."""
        q, m = values.shape
        counted = ~np.isnan(values) & (self.over_all[None, :] | judged[:, None])
        out = np.zeros((q, self.size))
        sums = out[:, :SLOTS * m].reshape(q, m, SLOTS)
        sums[:, :, 0] = np.where(counted, values, 0.0)
        sums[:, :, 1] = counted
        sums[:, :, 2] = np.where(counted, nums, 0.0)
        sums[:, :, 3] = np.where(counted, dens, 0.0)
        sums[:, :, 4] = np.where(counted, values * values, 0.0)
        rows = np.arange(q)
        for j, col in enumerate(self._distributed_columns):
            bin_index = np.searchsorted(_UPPER, np.nan_to_num(values[:, col]), side="left")
            out[rows, self.bins_start + BINS * j + bin_index] = counted[:, col]
        out[:, self.all_slot] = 1.0
        out[:, self.judged_slot] = judged
        return out


class WindowView(NamedTuple):
    """One (ranker, segment, window) aggregate, ready to export."""
    ranker: str
    segment: str
    window: str
    queries_all: float
    queries_judged: float
    sums: dict[str, Sums]
    distributions: dict[str, list[float]]  # metric -> queries per bin (BIN_EDGES), not cumulative


def window_views(buckets: Iterable[Mapping[BucketKey, np.ndarray]], layout: Layout,
                 windows: Mapping[str, int], now_ms: int) -> list[WindowView]:
    """Sum the buckets of every (ranker, segment) over each window ending now.
    The window of `size` holds the minutes (now − size, now]: buckets stamped in the
    future (clock skew, within `windows.max_future`) count once their minute has come."""
    now_minute = now_ms // MINUTE_MS
    groups: dict[tuple[str, str], list[tuple[int, np.ndarray]]] = {}
    for partition_buckets in buckets:
        for key, vector in partition_buckets.items():
            groups.setdefault((key.ranker, key.segment), []).append((key.minute, vector))
    views = []
    for (ranker, segment), entries in sorted(groups.items()):
        minutes = np.array([m for m, _ in entries])
        vectors = np.stack([v for _, v in entries])
        for window, size_ms in windows.items():
            inside = (minutes > now_minute - size_ms // MINUTE_MS) & (minutes <= now_minute)
            total = vectors[inside].sum(axis=0) if inside.any() else np.zeros(layout.size)
            sums = {name: Sums(*total[SLOTS * i:SLOTS * i + SLOTS].tolist())
                    for i, name in enumerate(layout.names)}
            distributions = {
                name: total[layout.bins_start + BINS * j:layout.bins_start + BINS * (j + 1)].tolist()
                for j, name in enumerate(layout.distributed)}
            views.append(WindowView(ranker, segment, window, float(total[layout.all_slot]),
                                    float(total[layout.judged_slot]), sums, distributions))
    return views
