"""The online signals, from clicks rather than grades, in the measure registry beside the
ranking measures: one small definition each, the same ratio shape (value = num / den,
micro = Σ num / Σ den), and the same rule for a zero denominator (the family's
`undefined`, applied by `Measure.values`).

They need what a grade matrix does not hold — which shown results were clicked — so
they take a `Clicks` rather than a `Batch`, and `rankmeter eval` (TREC files, no clicks)
does not offer them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rankmeter.engine.measures import Family, Measure, Ratio, register


class Clicks(NamedTuple):
    shown: np.ndarray       # [Q] results shown
    clicked: np.ndarray     # [Q] distinct shown results clicked
    clicks: np.ndarray      # [Q] click events
    first_rank: np.ndarray  # [Q] rank of the first (highest) clicked result; 0 without a click


def ctr(c: Clicks) -> Ratio:
    """Click-through rate: clicked shown results / shown results (micro: Σ clicked / Σ shown)."""
    return Ratio(c.clicked, c.shown)


def abandonment(c: Clicks) -> Ratio:
    """1 when no shown result was clicked (Radlinski, Kurup & Joachims, CIKM 2008)."""
    return Ratio((c.clicked == 0).astype(float), np.ones(len(c.shown)))


def clicks(c: Clicks) -> Ratio:
    """Click events per query."""
    return Ratio(c.clicks.astype(float), np.ones(len(c.shown)))


def first_click_rank(c: Clicks) -> Ratio:
    """Rank of the first clicked result; undefined (left out of averages) without a click."""
    return Ratio(c.first_rank.astype(float), (c.first_rank > 0).astype(float))


for _name, _compute, _undefined in (("CTR", ctr, 0.0), ("Abandonment", abandonment, 0.0),
                                    ("Clicks", clicks, 0.0), ("FirstClickRank", first_click_rank, float("nan"))):
    register(Family(_name, _compute, "none", int, {}, _undefined, online=True))

ONLINE_SIGNALS = ("CTR", "Abandonment", "Clicks", "FirstClickRank")
ONLINE_MEASURES = [Measure(name) for name in ONLINE_SIGNALS]


def evaluate_online(c: Clicks) -> dict[Measure, Ratio]:
    """Every online signal for every query."""
    return {m: m.compute(c) for m in ONLINE_MEASURES}
