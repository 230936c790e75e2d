"""Click models beside the position-based one, their held-out fit, and a probe for rankers
that react to clicks: the additive sums behind the fit test (`fit.py`).

Two click models, both estimated from the same harvest by intervention harvesting and
AllPairs (`propensity.estimate`), and compared on the same held-out queries:

- **pbm**, the position-based model (Craswell et al., WSDM 2008; Richardson et al., WWW
  2007): P(click at rank r) = p_r · α(q, d), whatever was clicked above.
- **ubm**, the user browsing model (Dupret & Piwowarski, SIGIR 2008): P(click at rank r |
  clicks above) = γ(r, d) · α(q, d), where d is the distance from r to the last click above
  (0: no click above). It expresses the cascade model (Craswell et al. 2008: γ(r, 0) = 1,
  γ(r, d > 0) = 0) and, close enough, the dependent click model (Guo, Liu & Wang, WSDM 2009:
  after a click the user goes on with a probability of her own), and contains pbm (γ(r, d)
  = p_r). Here d is capped at `UBM_DISTANCES` (2: "the click just above", "further up"):
  the table is per (query, document) and slot, and a slot needs harvested pairs of its own.
  Each (rank, capped distance) is a *slot*; the same (q, d) seen in two slots is an
  intervention as two ranks are for pbm (its clicks above are another user's luck, not its
  relevance), so `Harvester` and `estimate` work on slots unchanged, relative to slot 0
  (rank 1, nothing above).

Held-out fit (the conditional perplexity: not PyClick's, which scores each rank's
unconditional click probability; this one is the per-rank held-out log-likelihood): a share of harvested queries
(`held_out`) is not learned from; each is scored by both models with the parameters of
the last look and its documents' α from the tables (`ModelTables.score`), before it could
have been learned from: Σ log2 P(c_r | clicks above) per rank and model, the ranks scored,
and, per model, clicks observed and expected below a click and with none above (the
calibration `fit.py` tests). Perplexity at rank r = 2^(−Σ log2 P / n), the model's the
mean over ranks (lower is better; 1 is perfect). All of it is sums, added over partitions
as the pair sums are (`FitLayout`).

Reaction probe: a ranker whose lists follow clicks (a click boosts the document in the
next lists of its text) breaks harvesting, whose ranks must not depend on the clicks.
For a (text, document, rank in the earlier list) the probe compares the document's rank in
the text's next list after it was clicked and after it was not: without reaction the next
list cannot know, and the mean difference is 0 whatever the document's relevance (the same
document at the same earlier rank); with reaction it is positive (ranks gained). Summed
over groups with Mantel–Haenszel weights h = n₀n₁/(n₀+n₁): T = Σ h·D / Σ h.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections import OrderedDict
from collections.abc import Collection, Sequence

import numpy as np

MODELS = ("pbm", "ubm")
UBM_DISTANCES = 2          # distance to the last click above, capped: 1, ≥ 2 (0: none above)
HELD_OUT_SHARE = 0.2       # of harvested queries, scored instead of learned from
_HELD_OUT_BELOW = int(HELD_OUT_SHARE * 2 ** 32)
ALPHA_PRIOR = (0.5, 1.0)   # α = (clicks + 0.5) / (examined impressions + 1): no 0 or 1 at start
P_FLOOR = 1e-3             # a predicted click probability stays within [P_FLOOR, 1 − P_FLOOR]


def held_out(query_id: str) -> bool:
    """Whether a harvested query is scored instead of learned from (a hash: the same on
    every replica and replay)."""
    return zlib.crc32(b"held-out\x1f" + query_id.encode()) < _HELD_OUT_BELOW


def slots(ranks: int) -> int:
    """UBM slots for ranks 1..`ranks`: rank r (0-based) has 1 + min(r, UBM_DISTANCES)."""
    return sum(1 + min(r, UBM_DISTANCES) for r in range(ranks))


@functools.lru_cache(maxsize=4096)  # a few ranks and distances: called for every harvested document
def slot(rank: int, distance: int) -> int:
    """The slot of 0-based `rank` with the last click above `distance` ranks up (0: none)."""
    offset = sum(1 + min(r, UBM_DISTANCES) for r in range(rank))
    return offset + min(distance, UBM_DISTANCES)


def slot_ranks(ranks: int) -> list[int]:
    """The 0-based rank of each slot."""
    return [r for r in range(ranks) for _ in range(1 + min(r, UBM_DISTANCES))]


def placements(ranked: Sequence[str], clicked: Collection[str]) -> list[tuple[int, str]]:
    """(slot, document) of each document of `ranked` (distinct, rank order): its rank and
    the distance to the last clicked rank above it."""
    out, last = [], None
    for rank, doc in enumerate(ranked):
        out.append((slot(rank, 0 if last is None else rank - last), doc))
        if doc in clicked:
            last = rank
    return out


class FitLayout:
    """Where each sum sits in the fit vector (ranks K): log2-likelihood per model and rank,
    ranks scored, clicks observed/expected per model and class (0: no click above, 1: a
    click above), and the reaction probe's Σ h and Σ h·D."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.size = 3 * ranks + 4 * len(MODELS) + 2

    def ll(self, model: int) -> slice:
        return slice(model * self.ranks, (model + 1) * self.ranks)

    def scored(self) -> slice:
        return slice(2 * self.ranks, 3 * self.ranks)

    def calibration(self, model: int, cls: int) -> int:
        """Index of the clicks observed (the expected: the next one)."""
        return 3 * self.ranks + 4 * model + 2 * cls

    def reaction(self) -> int:
        """Index of Σ h (Σ h·D: the next one)."""
        return 3 * self.ranks + 4 * len(MODELS)

    def perplexity(self, fit: np.ndarray, model: int) -> float | None:
        """Mean over scored ranks of 2^(−Σ log2 P / n); None before anything is scored."""
        n, ll = fit[self.scored()], fit[self.ll(model)]
        used = n > 0
        if not used.any():
            return None
        return float(np.mean(np.exp2(-ll[used] / n[used])))

    def observed_over_expected(self, fit: np.ndarray, model: int, cls: int,
                               min_expected: float) -> float | None:
        i = self.calibration(model, cls)
        return float(fit[i] / fit[i + 1]) if fit[i + 1] >= min_expected else None

    def expected(self, fit: np.ndarray, model: int, cls: int) -> float:
        """The clicks model `model` expects in calibration class `cls`."""
        return float(fit[self.calibration(model, cls) + 1])

    def reaction_contrast(self, fit: np.ndarray, min_weight: float) -> float | None:
        i = self.reaction()
        return float(fit[i + 1] / fit[i]) if fit[i] >= min_weight else None


def score(layout: FitLayout, ranked: Sequence[str], clicked: Collection[str],
          examine: Sequence[Sequence[float]], alphas: Sequence[Sequence[float | None]]) -> np.ndarray:
    """One held-out query's addition to the fit sums. `examine[m][r]` is model m's
    examination probability of the document at rank r given the clicks above it, and
    `alphas[m][r]` its attractiveness (None: the document is not in the table yet, the
    rank is not scored by either model)."""
    out = [0.0] * layout.size  # Python floats, an array at the end: the same sums, faster
    above = False
    scored, ll = layout.scored().start, [layout.ll(m).start for m in range(len(MODELS))]
    for r, doc in enumerate(ranked[:layout.ranks]):
        c = doc in clicked
        if all(a[r] is not None for a in alphas):
            out[scored + r] += 1
            for m in range(len(MODELS)):
                p = min(max(examine[m][r] * alphas[m][r], P_FLOOR), 1.0 - P_FLOOR)  # type: ignore[operator]
                out[ll[m] + r] += math.log2(p if c else 1.0 - p)
                i = layout.calibration(m, int(above))
                out[i] += c
                out[i + 1] += p
        above = above or c
    return np.array(out)


def attractiveness(shown: Sequence[float], clicks: Sequence[float], examine: Sequence[float]) -> float:
    """α of a (q, d) entry: its clicks over its examination-weighted impressions, smoothed
    (`ALPHA_PRIOR`), within [P_FLOOR, 1 − P_FLOOR]."""
    examined = sum(n * e for n, e in zip(shown, examine))
    alpha = (sum(clicks) + ALPHA_PRIOR[0]) / (examined + ALPHA_PRIOR[1])
    return min(max(alpha, P_FLOOR), 1.0 - P_FLOOR)


class ReactionProbe:
    """The reaction probe (module docstring): the last harvested list of each text, and per
    (text, document, earlier rank) the later ranks after a click and after none; `h` and
    `hd` are Σ h and Σ h·D over every group (a group's contribution replaced as it moves,
    kept, final, when it is evicted). At most `capacity` texts and groups each."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.last: OrderedDict[str, tuple[dict[str, int], frozenset[str]]] = OrderedDict()
        self.groups: OrderedDict[tuple[str, str, int], list[float]] = OrderedDict()  # n0, s0, n1, s1
        self.h = self.hd = 0.0

    @staticmethod
    def _contribution(g: list[float]) -> tuple[float, float]:
        n0, s0, n1, s1 = g
        if not n0 or not n1:
            return 0.0, 0.0
        h = n0 * n1 / (n0 + n1)
        return h, h * (s0 / n0 - s1 / n1)  # ranks gained after a click: later rank lower

    def observe(self, text: str, ranked: Sequence[str], clicked: Collection[str]) -> None:
        before = self.last.get(text)
        if before is not None:
            ranks, was_clicked = before
            for rank, doc in enumerate(ranked):
                earlier = ranks.get(doc)
                if earlier is None:
                    continue
                key = (text, doc, earlier)
                g = self.groups.get(key)
                if g is None:
                    g = self.groups[key] = [0.0, 0.0, 0.0, 0.0]
                else:
                    self.groups.move_to_end(key)
                h0, hd0 = self._contribution(g)
                i = 2 if doc in was_clicked else 0
                g[i] += 1
                g[i + 1] += rank
                h1, hd1 = self._contribution(g)
                self.h += h1 - h0
                self.hd += hd1 - hd0
        self.last[text] = ({d: r for r, d in enumerate(ranked)}, frozenset(d for d in ranked if d in clicked))
        self.last.move_to_end(text)
        while len(self.last) > self.capacity:
            self.last.popitem(last=False)
        while len(self.groups) > self.capacity:
            self.groups.popitem(last=False)
