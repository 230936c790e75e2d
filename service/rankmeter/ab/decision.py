"""The declared decision per treatment and segment, from one look (ab/declared.py for what
is declared and the levels). In order:

* `undeclared`: no `ab.primary`.
* `invalid_srm`: the sample-ratio test rejects the split in the segment (running minimum
  below α): the arms are not what was planned, nothing else can be trusted.
* `do_not_ship`: a primary worse (the upper end of its sequence at α/(k + g), oriented
  better-up, below 0) or a guardrail failed (that upper end below −margin), whatever its
  other sequence says and whether the intersection is empty or not.
* `ship`: no `do_not_ship`, a primary better (its sequence at α/k wholly on the good side of
  0) and every guardrail holding (its sequence at α wholly above −margin), none empty.
* `keep_running`: anything else, a declared metric without statistics yet included
  (ab.min_queries, ab.mixture_after: it waits, like the rest of the experiment).

What stays, by construction rather than memory: every sequence is a running intersection,
so its upper end only falls and its lower end only rises, and the SRM p-value is a running
minimum. A primary *worse* or a guardrail *failed* is read first, on the stop-level
sequence's upper end alone, empty or not (a treatment healthy, then broken, empties it), so
it stays: `do_not_ship` is final, except that a later `invalid_srm` supersedes it (then
nothing of the experiment is trusted, and the SRM alert fires); `invalid_srm` is final. An
empty sequence otherwise (`invalid`: the effect moved, or the model does not hold) makes no
claim for its metric, so `ship` is withdrawn to `keep_running` when a primary's ship-level
or a guardrail's hold-level sequence empties, and turns into `do_not_ship` once a declared
metric's stop-level upper end crosses to the bad side: new evidence, never a false ship.
A metric not compared this look (too few queries after a rewind, no variance) still reads
its stored stop-level record: worse (failed) there stays worse, not `waiting`. The final
`do_not_ship` itself is stored apart, for the comparison (baseline and ab.start: every
later experiment of it, a ramp or a redeclaration, reads it), and read first
(pipeline/final.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from rankmeter.ab import declared as decl
from rankmeter.ab.declared import Decision, Declared, Reason
from rankmeter.ab.experiment import Comparison, Look, decode_running
from rankmeter.ab.stats import Running
from rankmeter.config import AB


def _oriented(r: Running, d: Declared) -> tuple[float, float]:
    """The sequence with better up, an absolute margin added: the claim is its side of 0."""
    lo, hi = (r.ci_lower, r.ci_upper) if d.better > 0 else (-r.ci_upper, -r.ci_lower)
    shift = d.margin if d.role == "guardrail" and not d.relative else 0.0
    return lo + shift, hi + shift


def stored_stop(d: Declared, ranker: str, segment: str, running: Mapping[str, str], at: decl.Levels) -> Running:
    """The stored stop-level record of a metric (ab/experiment.py's field; with ab.cuped
    the adjusted one too: the tighter upper end), Running() when none is readable."""
    s = decl.scale(d) if d.role == "guardrail" else 1.0
    key = "\x1f".join((d.metric, ranker, segment, d.average))
    found = [decode_running(running.get(f"{k}\x1fstop\x1f{at.stop!r}\x1f{s!r}"))
             for k in (key, f"{key}\x1fcuped")]
    return min(found, key=lambda r: _oriented(r, d)[1])


def reason(d: Declared, c: Comparison | None, at: decl.Levels, stored: Running = Running()) -> Reason:
    """What one declared metric says, and why; `stored`: its stop-level record as stored,
    read when the comparison is skipped this look."""
    if c is None or not c.tests:
        s_lo, s_hi = _oriented(stored, d)
        if s_hi < 0:  # worse (failed) at an earlier look: final, whatever this look computed
            return Reason(d, "worse" if d.role == "primary" else "failed", s_lo, s_hi, at.stop,
                          f"its stored sequence at {at.stop:.4g} lies wholly below "
                          f"{'0' if d.role == 'primary' else '-margin'} (not compared this look)")
        return Reason(d, "waiting", math.nan, math.nan, math.nan, "no statistics yet (ab.min_queries, ab.mixture_after)")
    good = "ship" if d.role == "primary" else "hold"
    lo, hi = _oriented(c.tests[good], d)
    s_lo, s_hi = _oriented(c.tests["stop"], d)
    against = "0" if d.role == "primary" else "-margin"
    level = at.ship if good == "ship" else at.hold
    # First the stop level, empty or not: a running upper end is the least of every look's
    # upper end, so "below" means some look's sequence at α/(k + g) lay wholly on the bad
    # side, which a metric whose effect stays on the good side (of 0, of −margin) shows
    # with probability ≤ α/(k + g). It only falls: worse (failed) is final, whatever the
    # sequences do later (an emptied one included: healthy, then broken).
    if s_hi < 0:
        moved = " (and empty: the effect moved to the bad side)" if s_lo > s_hi else ""
        return Reason(d, "worse" if d.role == "primary" else "failed", s_lo, s_hi, at.stop,
                      f"its sequence at {at.stop:.4g} lies wholly below {against}{moved}")
    if lo > hi or s_lo > s_hi:
        return Reason(d, "invalid", lo, hi, level,
                      "empty confidence sequence: the effect moved, or the model does not hold")
    if lo > 0:
        return Reason(d, "better" if d.role == "primary" else "holds", lo, hi, level,
                      f"its sequence at {level:.4g} lies wholly above {against}")
    return Reason(d, "inconclusive", lo, hi, level, f"its sequence at {level:.4g} contains {against}")


def decide(look: Look, settings: AB, running: Mapping[str, str] | None = None) -> tuple[Decision, ...]:
    """One decision per treatment and segment with a baseline arm in that segment;
    `running`: the stored running records (a skipped comparison's stop level)."""
    declared = decl.parse(settings.primary, settings.guardrails)
    at = decl.levels(declared, settings.alpha)
    by_key = {(c.metric, c.ranker, c.segment, c.average): c for c in look.comparisons}
    segments_with_baseline = {a.segment for a in look.arms if a.ranker == look.baseline}
    out = []
    for arm in look.arms:
        if arm.ranker == look.baseline or arm.segment not in segments_with_baseline:
            continue
        reasons = tuple(reason(d, by_key.get((d.metric, arm.ranker, arm.segment, d.average)), at,
                               stored_stop(d, arm.ranker, arm.segment, running or {}, at)) for d in declared)
        outcomes = {r.outcome for r in reasons}
        primaries = [r.outcome for r in reasons if r.declared.role == "primary"]
        if not declared:
            decision = "undeclared"
        elif look.srm.get(arm.segment, 1.0) < settings.alpha:
            decision = "invalid_srm"
        elif outcomes & {"worse", "failed"}:
            decision = "do_not_ship"
        elif "better" in primaries and all(r.outcome == "holds" for r in reasons if r.declared.role == "guardrail"):
            decision = "ship"
        else:
            decision = "keep_running"
        out.append(Decision(arm.ranker, arm.segment, decision, reasons))
    return tuple(out)


def roles(settings: AB) -> dict[tuple[str, str], str]:
    """(metric, average) -> primary or guardrail; any other comparison is exploratory."""
    return {(d.metric, d.average): d.role for d in decl.parse(settings.primary, settings.guardrails)}
