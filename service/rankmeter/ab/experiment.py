"""One look at an experiment: from the arms' cumulative sums to always-valid statistics.

Every ranker other than the baseline is compared with it, per segment and measure,
macro (difference of means) and micro (difference of ratios, delta method). A look
updates what persists between looks (`Running`: the running minimum p-value and the
intersection of the confidence sequence), so the statistics stay valid however often
someone looks. Nothing is computed for a comparison until both arms have
`ab.min_queries` queries: a plug-in variance from a handful is unreliable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from rankmeter.ab import sums as ab_sums
from rankmeter.ab.stats import (DEFAULT_TAU2, INTERLEAVING_TAU2, Estimate, Running, Sequential, mean_difference,
                                msprt, preference, ratio_difference, srm_p_value, update)
from rankmeter.config import AB
from rankmeter.windows import Layout


class Comparison(NamedTuple):
    metric: str
    ranker: str
    segment: str
    average: str          # macro or micro
    estimate: Estimate
    running: Running      # always-valid p and confidence sequence, as of this look


class ArmView(NamedTuple):
    ranker: str
    segment: str
    queries: float
    judged: float


class Look(NamedTuple):
    experiment: str
    baseline: str
    arms: list[ArmView]
    comparisons: list[Comparison]
    srm: dict[str, float]  # segment -> always-valid SRM p-value (running minimum)


def look(experiment: str, baseline: str, vectors: Mapping[tuple[str, str], np.ndarray], layout: Layout,
         settings: AB, running: Mapping[str, str]) -> tuple[Look, dict[str, str]]:
    """`vectors`: (ranker, segment) -> the arm's summed vector over every partition.
    `running`: what earlier looks kept; returns the look and what to keep now."""
    tau2 = settings.mixture_variance or DEFAULT_TAU2
    arms = {key: ab_sums.arm(v, layout) for key, v in vectors.items()}
    kept: dict[str, str] = {}
    comparisons = []
    for (ranker, segment), arm in sorted(arms.items()):
        control = arms.get((baseline, segment))
        if ranker == baseline or control is None:
            continue
        for metric in layout.names:
            for average in ("macro", "micro"):
                if average == "macro":
                    t, c = arm.means[metric], control.means[metric]
                else:
                    t, c = arm.ratios[metric], control.ratios[metric]
                if min(t.n, c.n) < settings.min_queries:
                    continue
                estimate = mean_difference(t, c) if average == "macro" else ratio_difference(t, c)
                if not math.isfinite(estimate.variance) or estimate.variance <= 0:
                    continue
                key = "\x1f".join((metric, ranker, segment, average))
                before = _decode(running.get(key))
                now = update(before, msprt(estimate, tau2, settings.alpha))
                kept[key] = _encode(now)
                comparisons.append(Comparison(metric, ranker, segment, average, estimate, now))
    srm = {}
    if settings.split:
        shares = settings.split
        for segment in sorted({s for _, s in arms}):
            counts = [arms[(r, segment)].queries if (r, segment) in arms else 0.0 for r in shares]
            if sum(counts) < settings.min_queries:
                continue
            key = "\x1f".join(("srm", segment))
            before = _decode(running.get(key))
            p = min(before.p_value, srm_p_value(counts, list(shares.values())))
            kept[key] = _encode(before._replace(p_value=p))
            srm[segment] = p
    views = [ArmView(r, s, a.queries, a.judged) for (r, s), a in sorted(arms.items())]
    return Look(experiment, baseline, views, comparisons, srm), kept


class Preference(NamedTuple):
    """A team-draft interleaving experiment between two rankers (teams)."""
    experiment: str
    team_a: str
    team_b: str
    wins_a: float
    wins_b: float
    ties: float
    estimate: Estimate        # Δ = (wins_A − wins_B) / (wins + ties); None before min_queries
    running: Running | None   # always-valid p and confidence sequence for Δ


def interleaving_look(vectors: Mapping[tuple[str, str, str], np.ndarray], settings: AB,
                      running: Mapping[str, str]) -> tuple[list[Preference], dict[str, str]]:
    """`vectors`: (experiment, team A, team B) -> [wins A, wins B, ties] over every
    partition (queries with a click; a tie when both teams' clicks are equal)."""
    out, kept = [], {}
    for (experiment, a, b), (wins_a, wins_b, ties) in sorted((k, v.tolist()) for k, v in vectors.items()):
        estimate = preference(wins_a, wins_b, ties)
        now = None
        if wins_a + wins_b + ties >= settings.min_queries and estimate.variance > 0:
            key = "\x1f".join(("interleaving", experiment, a, b))
            now = update(_decode(running.get(key)), msprt(estimate, INTERLEAVING_TAU2, settings.alpha))
            kept[key] = _encode(now)
        out.append(Preference(experiment, a, b, wins_a, wins_b, ties, estimate, now))
    return out, kept


def _encode(r: Running) -> str:
    return f"{r.p_value!r} {r.ci_lower!r} {r.ci_upper!r}"


def _decode(text: str | None) -> Running:
    if not text or not readable(text):
        return Running()
    p, lo, hi = (float(x) for x in text.split())
    return Running(p, lo, hi)


def readable(text: str) -> bool:
    """Whether a stored running value is three numbers (else: skipped, as none)."""
    try:
        p, lo, hi = (float(x) for x in text.split())
    except ValueError:
        return False
    return not any(math.isnan(x) for x in (p, lo, hi))


def tighter(a: str | None, b: str | None) -> str:
    """Two records of the same running statistics combined as one more look would: the
    smaller p, the narrower sequence. Whatever each holds, the result never loosens either."""
    return _encode(update(_decode(a), Sequential(*_decode(b))))
