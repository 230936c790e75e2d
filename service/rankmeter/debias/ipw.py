"""Inverse-propensity-weighted (IPW) click grades, for the same metric engine.

Joachims, Swaminathan & Schnabel, "Unbiased Learning-to-Rank with Biased Feedback", WSDM
2017: under the position-based model a click at rank k is seen with probability p_k times
the document's relevance, so counting it 1 / p_k makes its expected weight the relevance,
whatever the rank. Those weights are unbounded as p_k → 0, and an estimated p_k is noisy
where it is small, so the weight is clipped (their §4, after Strehl, Langford, Li &
Kakade, NeurIPS 2010): w_k = min(1 / p_k, `max_weight`), default 10 (p_k ≥ 0.1 counts in
full). It is also held at ≥ 1: rank 1 is the reference (p_1 = 1), and a weight below 1 (an
estimate above rank 1's, noise) would push a click under the relevance level and change P@k
and AP, which weights ≥ 1 never do.

Which measures move: a weight ≥ 1 keeps every click relevant, so binary measures (P@k, AP,
RR, R@k) are unchanged; the graded ones (nDCG, DCG) move. The grades feed
`QueryState.from_grades` unchanged: nothing of the engine is duplicated.

IPW nDCG: the engine's nDCG divides by the ideal DCG of the same list's (weighted) grades,
so one click's weight cancels and the result is not debiased (docs/benchmarks.md,
"Position-bias correction"). The debiased nDCG@k is `dcg(shown, grades(...))` over the
query text's pooled ideal, `Harvester.ideal_dcg`: both estimate DCG of E[grade | examined].
`dcg` is the engine's DCG@k (gain = grade when > 0, discount log2(rank + 1), summed in rank
order: bit for bit `parse("DCG@k")` on `QueryState.from_grades(shown, grades, shown_grade=0)`),
for one list without building a batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from rankmeter.engine.query import first_occurrences

DEFAULT_MAX_WEIGHT = 10.0
# The engine's discount log2(rank + 1), by np.log2 as there (same bits), ranks 1..100.
_LOG2 = np.log2(np.arange(1, 101, dtype=float) + 1.0).tolist()


def dcg_of(gains: Iterable[float], depth: int = 10) -> float:
    """DCG@`depth` of grades in rank order, as the engine's DCG: positive grades only
    (trec_eval), each over log2(rank + 1), added top-down."""
    total = 0.0
    for rank, g in enumerate(gains):
        if rank >= depth:
            break
        if g > 0:
            total += g / (_LOG2[rank] if rank < len(_LOG2) else float(np.log2(rank + 2.0)))
    return total


def dcg(shown: Sequence[str], grades: Mapping[str, float], depth: int = 10) -> float:
    """DCG@`depth` of one shown list (a repeated id keeps its first rank) with `grades`
    (missing: 0). Equal to the engine's `DCG@depth` of `QueryState.from_grades(shown, grades,
    shown_grade=0)`."""
    return dcg_of((grades.get(doc, 0.0) for doc in first_occurrences(shown)), depth)


def weights(propensities: Sequence[float | None], length: int,
            max_weight: float = DEFAULT_MAX_WEIGHT) -> list[float]:
    """The clipped weight of a click at each rank 1..`length`. A rank without an estimate
    (None, or past the estimated ranks) takes the deepest estimated rank above it: the
    examination curve is assumed not to rise with rank. All 1 when nothing is estimated."""
    out: list[float] = []
    last = 1.0
    for rank in range(length):
        p = propensities[rank] if rank < len(propensities) else None
        if p is not None:
            last = min(max(1.0 / p, 1.0), max_weight) if p > 0 else max_weight
        out.append(last)
    return out


def grades(shown: Sequence[str], implicit: Mapping[str, float], propensities: Sequence[float | None],
           explicit: Mapping[str, float] | None = None,
           max_weight: float = DEFAULT_MAX_WEIGHT) -> dict[str, float]:
    """The IPW grades of one query: each shown document's implicit grade (from its clicks,
    carts, purchases: brief §3) times the weight of its rank; explicit judgments as they
    are (an editor's grade has no position bias), and they win, as in `QueryRecord.grade`.

    `propensities[k]` is P(examine rank k+1) relative to rank 1 (`Propensities.relative`).
    A document shown twice keeps its first rank, as in `QueryState`.
    """
    ranking = list(dict.fromkeys(shown))
    w = weights(propensities, len(ranking), max_weight)
    out = {doc: implicit[doc] * w[rank] for rank, doc in enumerate(ranking)
           if implicit.get(doc, 0.0) > 0}
    if explicit:
        out.update(explicit)
    return out
