"""The declared decision of an experiment (`ab.primary`, `ab.guardrails`): what is declared,
the levels its tests run at, and the verdict's types. Pure; the verdict is ab/decision.py.

Syntax, one entry a metric (a YAML list, or commas in RANKMETER_AB_PRIMARY / _GUARDRAILS):

    primary:    "METRIC [macro|micro] increase|decrease"         (which way is better)
    guardrails: "METRIC [macro|micro] [increase|decrease] MARGIN"  (MARGIN: 0.01 or 2%)

A guardrail's direction defaults to the metric's (lower is better for Abandonment and
FirstClickRank). Its margin is absolute in metric units (`0.01`: at most 0.01 worse), or
relative to the baseline (`2%`: the treatment at least 98% of the baseline), tested
exactly as the difference of means T − 0.98·B ≥ 0 (no estimated baseline in the margin).

Error control (docs/ab-testing.md): with k primaries and g guardrails, a primary is
*better* when its confidence sequence at α/k lies above 0 (Bonferroni: the false-ship
rate ≤ α), a guardrail *holds* when its sequence at α lies above −margin (no correction:
"ship" needs every guardrail, an intersection-union test, Berger 1982; Schultzberg,
Ankargren & Frånberg 2024), and a primary *worse* or a guardrail *failed* is read on
sequences at α/(k + g) (Bonferroni over the k + g ways to stop: the false-stop rate ≤ α).
"""

from __future__ import annotations

import math
from typing import NamedTuple

LOWER_IS_BETTER = frozenset({"Abandonment", "FirstClickRank"})
DECISIONS = ("ship", "do_not_ship", "keep_running", "invalid_srm", "undeclared")


class Declared(NamedTuple):
    metric: str
    average: str     # macro or micro
    role: str        # primary or guardrail
    better: int      # +1: an increase is better, −1: a decrease
    margin: float    # a guardrail's, > 0 (nan for a primary)
    relative: bool   # the margin is a share of the baseline's value
    text: str        # as configured

    @property
    def margin_text(self) -> str:
        if self.role != "guardrail":
            return "-"
        return f"{self.margin:.4g}%" if self.relative else f"{self.margin:.4g}"


class Test(NamedTuple):
    """One running confidence sequence a declared metric is decided on: at `level`, of
    treatment − `scale`·baseline (scale ≠ 1: a relative margin)."""
    level: float
    scale: float


class Reason(NamedTuple):
    """A declared metric in one decision: its evidence and what it says."""
    declared: Declared
    outcome: str                   # better, worse, holds, failed, inconclusive, waiting, invalid
    lower: float                   # the decisive sequence, oriented (better is up), shifted by an
    upper: float                   # absolute margin: the claim is about its side of 0
    level: float                   # its level
    why: str


class Decision(NamedTuple):
    treatment: str
    segment: str
    decision: str                  # one of DECISIONS
    reasons: tuple[Reason, ...]


def _entry(text: str, role: str, known: frozenset[str] | None) -> Declared:
    tokens = text.split()
    if not tokens:
        raise ValueError("an empty entry")
    metric, rest = tokens[0], tokens[1:]
    if known is not None and metric not in known:
        raise ValueError(f"{metric!r} is not a measure of this experiment ({', '.join(sorted(known))})")
    average = rest.pop(0) if rest and rest[0] in ("macro", "micro") else "macro"
    direction = rest.pop(0) if rest and rest[0] in ("increase", "decrease") else ""
    if role == "primary":
        if not direction or rest:
            raise ValueError(f"{text!r}: expected METRIC [macro|micro] increase|decrease")
        return Declared(metric, average, role, 1 if direction == "increase" else -1, math.nan, False, text)
    if len(rest) != 1:
        raise ValueError(f"{text!r}: expected METRIC [macro|micro] [increase|decrease] MARGIN (0.01, or 2%)")
    relative = rest[0].endswith("%")
    try:
        margin = float(rest[0][:-1] if relative else rest[0])
    except ValueError:
        raise ValueError(f"{text!r}: the margin {rest[0]!r} is not a number (0.01, or 2%)") from None
    if not (math.isfinite(margin) and margin > 0) or relative and margin >= 100:
        raise ValueError(f"{text!r}: the margin must be > 0" + (" and below 100%" if relative else ""))
    better = (1 if direction == "increase" else -1) if direction else (-1 if metric in LOWER_IS_BETTER else 1)
    return Declared(metric, average, role, better, margin, relative, text)


def parse(primary: list[str], guardrails: list[str], known: frozenset[str] | None = None) -> list[Declared]:
    """The declared metrics, primaries first. ValueError("setting: problem") when one is
    not valid: unknown, malformed, a margin ≤ 0, declared twice or in both roles."""
    out: list[Declared] = []
    for setting, role, entries in (("ab.primary", "primary", primary), ("ab.guardrails", "guardrail", guardrails)):
        for text in entries:
            try:
                d = _entry(text, role, known)
            except ValueError as e:
                raise ValueError(f"{setting}: {e}") from None
            clash = next((o for o in out if o.metric == d.metric), None)
            if clash is not None:
                both = "twice" if clash.role == role else "both a primary and a guardrail"
                raise ValueError(f"{setting}: {d.metric} is declared {both}")
            out.append(d)
    if guardrails and not primary:
        raise ValueError("ab.guardrails: needs ab.primary (a decision ships on a primary)")
    return out


class Levels(NamedTuple):
    ship: float   # a primary better: α/k
    hold: float   # a guardrail non-inferior: α
    stop: float   # a primary worse, a guardrail failed: α/(k + g)


def levels(declared: list[Declared], alpha: float) -> Levels:
    k = sum(d.role == "primary" for d in declared)
    g = len(declared) - k
    return Levels(alpha / max(k, 1), alpha, alpha / max(k + g, 1))


def scale(d: Declared) -> float:
    """The baseline's multiplier a guardrail is tested with: 1 − m (1 + m when lower is
    better) for a relative margin, else 1."""
    return 1.0 - d.better * d.margin / 100.0 if d.relative else 1.0


def tests(declared: list[Declared], alpha: float) -> dict[tuple[str, str], dict[str, Test]]:
    """(metric, average) -> its running sequences by name: a primary's `ship` and `stop`, a
    guardrail's `hold` and `stop`."""
    at = levels(declared, alpha)
    return {(d.metric, d.average): ({"ship": Test(at.ship, 1.0), "stop": Test(at.stop, 1.0)}
                                    if d.role == "primary" else
                                    {"hold": Test(at.hold, scale(d)), "stop": Test(at.stop, scale(d))})
            for d in declared}
