"""A process's click-model tables: the pbm harvest (`Harvester` over ranks), the ubm
harvest (the same over slots, `clickmodels`), the reaction probe, and the held-out fit
sums; what they add up to as one vector (a partition's stored sums are deltas of it), and
the weights and pooled ideals of the model a look chose. The pipeline
(`pipeline/position_bias.py`) and the bench (`bench/debias_agreement.py`) share it.

The vector: [pbm pair sums 2K² | ubm pair sums 2S² | fit sums], K ranks and S slots; a
stored vector of the older length 2K² (pbm only) is read as that with the rest zero
(`upgrade`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from rankmeter.debias import ipw
from rankmeter.debias.clickmodels import (
    MODELS,
    FitLayout,
    ReactionProbe,
    attractiveness,
    held_out,
    placements,
    score,
    slot_ranks,
    slots,
)
from rankmeter.debias.fit import Look, initial, judge
from rankmeter.debias.propensity import (
    CLICKED,
    DEFAULT_MIN_SUPPORT,
    SHOWN,
    Harvester,
    PairSums,
    Steps,
    estimating,
    finish,
)
from rankmeter.debias import segments
from rankmeter.debias.segments import SegmentHarvest
from rankmeter.engine.query import first_occurrences


UBM_ITERATIONS, UBM_TOLERANCE = 1000, 1e-8


def vector_size(ranks: int) -> int:
    return 2 * ranks ** 2 + 2 * slots(ranks) ** 2 + FitLayout(ranks).size


def upgrade(stored: np.ndarray | None, ranks: int) -> np.ndarray:
    """A partition's stored vector at today's length: an older pbm-only one padded with
    zeros, anything else unreadable started afresh."""
    size = vector_size(ranks)
    if stored is not None and len(stored) == size:
        return stored
    out = np.zeros(size)
    if stored is not None and len(stored) == 2 * ranks ** 2:
        out[:len(stored)] = stored
    return out


def unreadable(stored: np.ndarray | None, ranks: int) -> str | None:
    """Why a partition's stored vector (`PAIRS`) cannot be its harvest's sums, else None:
    another length than today's or the older one, or (`segments.implausible`) a cell not
    finite or past 1e15, or a negative pair count (pbm's and ubm's only grow). One NaN kept
    would poison every look for good: its holder adds its deltas to it (review s11)."""
    if stored is None:
        return None
    k2, s2 = ranks ** 2, slots(ranks) ** 2
    if len(stored) not in (vector_size(ranks), 2 * k2):
        return f"{len(stored)} numbers, not {vector_size(ranks)}"
    return segments.implausible(stored, (slice(k2, 2 * k2), slice(2 * k2 + s2, 2 * k2 + 2 * s2))
                                if len(stored) > 2 * k2 else (slice(k2, 2 * k2),))


def split(vector: np.ndarray, ranks: int) -> tuple[PairSums, PairSums, np.ndarray]:
    """The three parts of a (merged) vector."""
    a, b = 2 * ranks ** 2, 2 * ranks ** 2 + 2 * slots(ranks) ** 2
    return PairSums.from_vector(vector[:a]), PairSums.from_vector(vector[a:b]), vector[b:]


def decide(vector: np.ndarray, ranks: int, min_pairs: float, previous: Look | None) -> Look:
    """A look from every partition's merged vector: both estimates and the fit test."""
    return finish(deciding(vector, ranks, min_pairs, previous))


def deciding(vector: np.ndarray, ranks: int, min_pairs: float, previous: Look | None) -> Steps[Look]:
    """`decide`, yielding between the estimates' iterations (`propensity.estimating`)."""
    pbm, ubm, fit = split(vector, ranks)
    # ubm's EM over its 27 slots, looser than pbm's: about 0.1 s a look, at once.
    pbm_found = yield from estimating(pbm, min_pairs)
    ubm_found = yield from estimating(ubm, min_pairs, UBM_ITERATIONS, UBM_TOLERANCE)
    return judge(pbm_found, ubm_found, fit, FitLayout(ranks), previous)


def examination(relative: Sequence[float | None]) -> list[float]:
    """Examination probabilities ≤ 1 with the gaps filled as `ipw.weights` fills them."""
    return [1.0 / w for w in ipw.weights(relative, len(relative), max_weight=1e9)]


class ModelTables:
    def __init__(self, ranks: int, capacity: int, max_weight: float = ipw.DEFAULT_MAX_WEIGHT,
                 min_support: float = DEFAULT_MIN_SUPPORT, segment_capacity: int = 2000,
                 segment_limit: int = 0) -> None:
        self.ranks, self.max_weight = ranks, max_weight
        self.layout = FitLayout(ranks)
        self.pbm = Harvester(ranks, capacity, min_support)
        self.ubm = Harvester(slots(ranks), capacity, min_support)
        self.probe = ReactionProbe(capacity)
        self.fit = np.zeros(self.layout.size)
        self._slot_rank = slot_ranks(ranks)
        self.look = initial(ranks, slots(ranks))
        self._examine: tuple[list[float], list[float]] = ([1.0] * ranks, [1.0] * slots(ranks))
        # Per-segment pbm harvest and the curves of the segments that qualify (debias/segments.py).
        self.segments = SegmentHarvest(ranks, segment_capacity, segment_limit)
        self.curves: dict[str, list[float]] = {}
        # (segment, length) -> pbm's weights ("": the global curve's), until the next look
        self._pbm_weights: dict[tuple[str, int], list[float]] = {}

    def vector(self) -> np.ndarray:
        fit = self.fit.copy()
        i = self.layout.reaction()
        fit[i], fit[i + 1] = self.probe.h, self.probe.hd
        return np.concatenate([self.pbm.sums.to_vector(), self.ubm.sums.to_vector(), fit])

    def looked(self, look: Look, curves: dict[str, list[float]] | None = None) -> None:
        """The parameters of a new look: what weighs and what predicts from now on;
        `curves`: the segments' own (None: those of the last look)."""
        self.look = look
        if curves is not None:
            self.curves = curves
        self._pbm_weights = {}
        pbm = examination(look.pbm.relative)
        # A ubm slot without an estimate takes pbm's examination of its rank.
        ubm = [g if g is not None else pbm[self._slot_rank[s]] for s, g in enumerate(look.ubm.relative)]
        self._examine = (pbm, [min(max(g, 0.0), 1.0) for g in ubm])

    def observe(self, query_id: str, text: str, shown: Sequence[str], clicked: Collection[str],
                grades: dict[str, float] | None, segment: str = "") -> None:
        """One harvested query whose clicks are final: into the probe, then scored (a
        held-out one, once the models have estimates) or learned from (also into its
        segment's pbm table)."""
        ranked = first_occurrences(shown)[:self.ranks]
        self.probe.observe(text, ranked, clicked)
        if held_out(query_id):
            if self.look.pbm.relative[0] is not None:
                self.fit += self._score(text, ranked, clicked)
            return
        self.pbm.observe(text, ranked, clicked, grades)
        self.segments.observe(segment, text, ranked, clicked)
        self.ubm.observe_placed(text, placements(ranked, clicked), clicked, grades)

    def _score(self, text: str, ranked: list[str], clicked: Collection[str]) -> np.ndarray:
        p, gamma = self._examine
        placed = placements(ranked, clicked)
        examine = [[p[r] for r in range(len(ranked))], [gamma[s] for s, _ in placed]]
        alphas: list[list[float | None]] = [[], []]
        for r, doc in enumerate(ranked):
            pbm, ubm = self.pbm.entries.get((text, doc)), self.ubm.entries.get((text, doc))
            alphas[0].append(None if pbm is None else attractiveness(pbm[SHOWN], pbm[CLICKED], p))
            alphas[1].append(None if ubm is None else attractiveness(ubm[SHOWN], ubm[CLICKED], gamma))
        return score(self.layout, ranked, clicked, examine, alphas)

    def weights(self, shown: Sequence[str], clicked: Collection[str], length: int,
                segment: str = "") -> list[float]:
        """The clipped IPW weight of each rank 1..`length` of this list under the chosen
        model: pbm's per rank (the segment's own curve where it qualifies, else the
        global one); ubm's per rank given the clicks above (`placements`)."""
        if self.look.model == "pbm":  # the same for every list until the next look: computed once
            curve = self.curves.get(segment) if segment else None
            key = (segment if curve is not None else "", length)
            found = self._pbm_weights.get(key)
            if found is None:
                relative = self.look.pbm.relative if curve is None else curve
                found = self._pbm_weights[key] = ipw.weights(relative, length, self.max_weight)
            return found
        gamma = self._examine[1]
        ranked = first_occurrences(shown)[:min(length, self.ranks)]
        out = [self._weight(gamma[s]) for s, _ in placements(ranked, clicked)]
        return out + [out[-1] if out else 1.0] * (length - len(out))

    def _weight(self, examine: float) -> float:
        return min(max(1.0 / examine, 1.0), self.max_weight) if examine > 0 else self.max_weight

    def support(self, text: str) -> float:
        """The graded impressions the text's pooled ideal rests on (both tables hold the same)."""
        return self.pbm.support(text)

    def ideal_dcg(self, text: str, depth: int) -> float | None:
        """The text's pooled ideal under the chosen model (`Harvester.ideal_dcg`): ubm's
        weighs each slot's grades by the slot's weight. (Pooling grades over examined
        impressions instead, Σ G / Σ N·γ, halved the pbm gap in the bench.)"""
        if self.look.model == "pbm":
            return self.pbm.ideal_dcg(text, ipw.weights(self.look.pbm.relative, self.ranks, self.max_weight), depth)
        return self.ubm.ideal_dcg(text, [self._weight(g) for g in self._examine[1]], depth)


__all__ = ["MODELS", "ModelTables", "decide", "split", "upgrade", "vector_size"]
