"""Per-segment examination curves (issue 22): the pbm harvest kept per segment label as
well as globally, and a segment's own curve where its harvest is enough (`qualifies`),
the global curve elsewhere.

- The harvest: one `Harvester` per segment label (`Impression.segment` as admitted:
  `limits.max_segments` values and `other`; the empty segment has none), of
  `debias.segment_capacity` entries, pbm pair sums only (no pooled grades: the pooled ideal
  stays global). At most `limit` tables: a segment past it is harvested only globally.
- The support rule (`qualifies`): a segment gets its own curve when its own estimate has
  every rank 1..K, each with at least `debias.segment_min_pairs` harvested pairs (the
  evidence `rankmeter_propensity_pairs` counts, as `debias.min_pairs` for the global one),
  and the curve is plausible by the fit test's bounds (`fit._excess`, at its withdraw
  thresholds). Else it uses the global curve, exactly.
- Persistence: each partition stores each segment's pair sums (a delta of the process's,
  as `PAIRS`) in its A/B sums as `field(segment)`: three parts, as an experiment's field, so
  a version without per-segment curves reads it as another experiment's and skips it.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from rankmeter.debias.fit import MAX_RATIO, _excess
from rankmeter.debias.propensity import Harvester, PairSums, Propensities, Steps, estimating, finish
from rankmeter.logs import error_once

log = logging.getLogger("rankmeter.store")

NAME = "propensity-segment"   # the first part of a segment's stored field
KEY = "segments"              # the stored look's field: segment -> its curve (JSON)
MAX_SUM = 1e15                # stored sums past this are no stream's (1e300: a flat curve)
REFRESH_GROWTH = 1.1          # a segment's curve is estimated anew once its pairs grew by this
MAX_TEXT = 1_000_000          # a stored `KEY` longer than this is unreadable (21 curves: ~6 KB)


def field(segment: str) -> str:
    """The A/B field a partition stores a segment's pair sums under."""
    return f"{NAME}\x1f{segment}\x1fpairs"


def segment_of(name: str) -> str | None:
    """The segment of a stored field of `field`'s form, else None."""
    parts = name.split("\x1f")
    return parts[1] if len(parts) == 3 and parts[0] == NAME and parts[2] == "pairs" and parts[1] else None


class SegmentHarvest:
    """The pbm harvest of each segment: bounded tables, one per segment label."""

    def __init__(self, ranks: int, capacity: int, limit: int) -> None:
        self.ranks, self.capacity, self.limit = ranks, capacity, limit
        self.tables: dict[str, Harvester] = {}
        self.refused = 0  # queries of segments past `limit` (harvested globally only)

    def observe(self, segment: str, text: str, ranked: Sequence[str], clicked: Collection[str]) -> None:
        if not segment:
            return
        table = self.tables.get(segment)
        if table is None:
            if len(self.tables) >= self.limit:
                self.refused += 1
                return
            table = self.tables[segment] = Harvester(self.ranks, self.capacity)
        table.observe(text, ranked, clicked)

    def vectors(self) -> dict[str, np.ndarray]:
        """Each segment's pair sums as stored (`PairSums.to_vector`)."""
        return {s: t.sums.to_vector() for s, t in self.tables.items()}


def unreadable(vector: np.ndarray, ranks: int) -> str | None:
    """Why a partition's stored segment sums cannot be sums (review s10 M1: a NaN disabled
    the segment's curve for good, 1e300 gave a flat one), else None. (A partition's clicks
    are deltas of a bounded table's CTRs: they may go down, their total may not,
    `inconsistent`. Its pair counts only grow (an eviction leaves the sums): a negative one
    is corrupt, review s11.)"""
    if len(vector) != 2 * ranks ** 2:
        return f"{len(vector)} numbers, not {2 * ranks ** 2}"
    return implausible(vector, (slice(ranks ** 2, 2 * ranks ** 2),))


def implausible(vector: np.ndarray, pair_counts: tuple[slice, ...]) -> str | None:
    """Why stored sums of the right size cannot be a harvest's: not finite, past `MAX_SUM`,
    or a negative cell among the `pair_counts`; else None."""
    if not np.isfinite(vector).all() or (np.abs(vector) > MAX_SUM).any():
        return "not finite or too large"
    if any((vector[s] < 0).any() for s in pair_counts):
        return "a negative pair count"
    return None


def inconsistent(total: np.ndarray, ranks: int) -> str | None:
    """Why a segment's sums over every partition cannot be pair sums, else None: negative,
    or more clicks than pairs (a CTR is at most 1), past rounding."""
    k2 = ranks ** 2
    tolerance = 1e-6 * max(1.0, float(np.abs(total).max(initial=0.0)))
    if (total < -tolerance).any():
        return "negative"
    if (total[:k2] > total[k2:] + tolerance).any():
        return "more clicks than pairs"
    return None


def qualifies(found: Propensities, min_pairs: float) -> bool:
    """The support rule (module docstring): every rank estimated on `min_pairs` pairs or
    more, and within the fit test's plausibility bounds."""
    if any(p is None for p in found.relative) or min(found.support) < min_pairs:
        return False
    ratio, rise = _excess(found, 0, MAX_RATIO, True, 2.0)
    return ratio <= 0 and rise <= 0


def curves(sums: Mapping[str, np.ndarray], ranks: int, min_pairs: float,
           kept: dict[str, tuple[float, list[float] | None]] | None = None) -> dict[str, list[float]]:
    """The segments that qualify, each with its curve (relative examination per rank).
    `kept` (segment -> its pairs when last estimated, and what that found), updated here:
    a segment is estimated anew only once its pairs have grown by `REFRESH_GROWTH` (an EM
    costs about 50 ms: 21 segments at every look, every 5 s, would cost a second each)."""
    return finish(curving(sums, ranks, min_pairs, kept))


def curving(sums: Mapping[str, np.ndarray], ranks: int, min_pairs: float,
            kept: dict[str, tuple[float, list[float] | None]] | None = None) -> Steps[dict[str, list[float]]]:
    """`curves`, yielding between the estimates' iterations (`propensity.estimating`)."""
    kept = {} if kept is None else kept
    out = {}
    for segment, vector in sorted(sums.items()):
        if unreadable(vector, ranks) is not None or inconsistent(vector, ranks) is not None:
            continue
        found = PairSums.from_vector(vector)
        pairs = float(found.pairs.sum())
        last = kept.get(segment)
        if last is None or not last[0] <= pairs < last[0] * REFRESH_GROWTH:
            curve = None
            if found.pairs.sum(axis=1).min() >= min_pairs:  # (else no EM: it cannot qualify)
                estimated = yield from estimating(found, min_pairs)
                if qualifies(estimated, min_pairs):
                    curve = [float(p) for p in estimated.relative]  # type: ignore[arg-type]
            last = kept[segment] = (pairs, curve)
        if last[1] is not None:
            out[segment] = last[1]
    return out


def to_field(found: Mapping[str, Sequence[float]], at: float) -> str:
    """The curves as the stored look keeps them, with the look's time (`Look.at`)."""
    return json.dumps({"at": at, "curves": dict(found)})


def from_field(text: str | None, ranks: int, at: float) -> dict[str, list[float]]:
    """The stored segment curves of the look made at `at`: none when they are of another
    look (a version without per-segment curves stored the look since: its replicas weigh
    with the global curve, so must this one); an unreadable curve is left out (that
    segment: the global one)."""
    try:
        return _curves(text, ranks, at)
    except (ValueError, RecursionError, OverflowError, TypeError) as e:
        # (a stored text must never stop a look: a 400-digit number, a deep nesting)
        error_once(log, "skipping the unreadable stored segment curves", why=repr(e)[:200])
        return {}


def _curves(text: str | None, ranks: int, at: float) -> dict[str, list[float]]:
    if text is not None and len(text) > MAX_TEXT:
        raise ValueError(f"{len(text)} characters")
    stored = json.loads(text) if text is not None else {}
    if not isinstance(stored, dict) or stored.get("at") != at or not isinstance(stored.get("curves"), dict):
        return {}
    return {s: c for s, c in stored["curves"].items()
            if isinstance(s, str) and s and isinstance(c, list) and len(c) == ranks
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                    for v in c)}


__all__ = ["KEY", "NAME", "SegmentHarvest", "curves", "field", "from_field", "qualifies", "segment_of",
           "inconsistent", "to_field", "unreadable"]
