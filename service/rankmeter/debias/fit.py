"""The fit test that decides whether the debiased series may be exported, and which click
model weighs them (`judge`, at every look at the propensities).

The debiased measures carry `grading="ipw"` only while the fit holds; otherwise they are
withdrawn and `rankmeter_debias_valid{reason}` says why (1 for the current reason):

- `insufficient_support`: the chosen model has no estimate of rank 1 yet (too few
  harvested pairs, `debias.min_pairs`).
- `click_reactive_ranker`: the reaction probe (`clickmodels.ReactionProbe`) sees documents
  gain (or lose) ranks in the next list of their text after a click, against the same
  document at the same earlier rank without one. Harvesting assumes a rank does not depend
  on clicks; any reaction the probe detects withdraws, also one too small to bias the
  estimate (review: a reaction of 0.15 withdrew a curve within 0.03 of the truth).
- `implausible_propensities`: pbm's examination probability of a rank relative to rank 1
  above `MAX_RATIO` (a rank examined more than the top one: the weights, held at ≥ 1,
  silently stop correcting), or rising from a rank to the next by more than `MAX_RISE`
  (the curve must not rise), each beyond the noise of its support (`_excess`); with ubm
  chosen, also a ubm slot above `MAX_UBM_RATIO` (looser: its slots are thinner, and those
  without a click above needn't fall with rank, cascade and dcm users examine every rank
  until they click).
  A stored sum that is not a finite number makes every estimate implausible.
- `poor_fit`: the chosen model, on the held-out queries, predicts the clicks below a
  click, or with no click above, off by more than `CALIBRATION` (observed / expected)
  plus `CALIBRATION_Z` times 1/√expected (the ratio's SD at most, were the clicks Poisson:
  0.18 at the 30 expected clicks a class needs to be judged; the check is
  repeated at every look, so without the margin noise alone withdrew, `miscalibrated`).
  Position-based weights on cascade users fail this way: they expect clicks below a click
  that cascade users never make (observed/expected about 0).
- `unexamined_below_clicks`: ubm chosen, and it finds (almost) nothing below a click
  examined: `below_clicks` under `BELOW_CLICKS`. Cascade users: their clicks say nothing of
  the documents below the first one clicked, so no weighting recovers the gap, and the
  weighted value is only a noisier copy of the raw one (bench: 7% of the true gap at a gap
  of 0.05, against raw clicks' 24%).
- `dependent_clicks`: ubm chosen, and its examination below a click is under
  `DEPENDENT_CLICKS` of the same rank with none above, beyond the noise of its support
  (2/√pairs): dependent-click users (0.27–0.34 in the bench; position-based ones
  1.0–1.6), whose examination below a click depends on the results skipped since it (a
  user who skipped attractive results has likelier stopped). One value per slot then
  over-weighs the worse ranker's deep clicks: the weighted value ranked the rankers right
  in 34/40 seeds at a gap of 0.37 and 21/40 at 0.05, against raw clicks' 40/40 and 34/40.
  A dependent click model proper (the examination between clicks inferred per list) is
  not built.
- `ok`: otherwise.

Each check has a withdraw threshold and a stricter restore one (hysteresis):
once withdrawn, a series comes back only when every check passes the restore threshold,
so an estimate hovering at a threshold does not make the series flap. A check with too
little evidence (fewer than `MIN_EXPECTED` expected clicks in a class, `MIN_REACTION_WEIGHT`
of the probe's weight) passes: the bench and the in-process test measure how soon each
gets its evidence.

Why these values (docs/debiasing.md, "The fit test"): under position-based users the
40-seed bench's worst estimates were within 0.05 of the truth and never rose by more than
0.05 from a rank to the next, the pbm observed/expected within 0.85–1.15 (users' own click
propensities make clicks below a click a little likelier than the model says), and the
probe's contrast within ±0.3 ranks; cascade users put pbm's observed/expected below a
click at about 0 (dcm users at 0.62–1.08 only: not a poor fit, review s11), a reactive
ranker's contrast at several ranks. `CALIBRATION_Z`
(bench/fit_noise.py, every look judged, a withdrawal at any look counted): without it,
tests/integration/test_dashboards.py's traffic (~1,200 harvested queries, clicks final
after 2 s; observed/expected with no click above 0.6–0.75 at 30–65 expected clicks: noise,
and the attractiveness prior's pull on documents seen a few times) was withdrawn as a poor
fit in 124 of 400 runs; with 3, in none (Wilson 95% upper bound 0.95%), nor any of 400
harvests of the bench's 6,000 queries (1/400 without).

The model (`MODELS`): the lower held-out perplexity once `MIN_SCORED` ranks are scored
(until then, and when ubm has no estimate, pbm: today's model), switched only when the
other is lower by `SWITCH_MARGIN` (relative), for the same reason as the hysteresis.
"""

from __future__ import annotations

import json
import logging
import math
from typing import NamedTuple

import numpy as np

from rankmeter.debias.clickmodels import MODELS, UBM_DISTANCES, FitLayout, slot
from rankmeter.debias.propensity import Propensities
from rankmeter.logs import error_once

log = logging.getLogger("rankmeter.store")
MAX_TEXT = 100_000  # a stored field longer than this is unreadable (27 numbers: < 1 KB)

REASONS = ("ok", "insufficient_support", "implausible_propensities", "poor_fit", "click_reactive_ranker",
           "unexamined_below_clicks", "dependent_clicks")
# (withdraw, restore) thresholds.
MAX_RATIO = (1.2, 1.1)
MAX_UBM_RATIO = (1.6, 1.4)
MAX_RISE = (0.15, 0.08)
CALIBRATION = ((0.6, 1.6), (0.75, 1.33))
CALIBRATION_Z = 3.0         # the calibration bounds widened by this many times 1/√expected
REACTION = (0.5, 0.25)      # ranks gained after a click
BELOW_CLICKS = (0.1, 0.15)  # ubm: examination below a click relative to none above, at the same rank
DEPENDENT_CLICKS = (0.7, 0.8)  # the same, plus 2/√pairs
MIN_EXPECTED = 30.0         # expected clicks a calibration class needs to be judged
MIN_REACTION_WEIGHT = 300.0
MIN_SCORED = 500.0          # ranks scored before the perplexities choose
SWITCH_MARGIN = 0.002


class Look(NamedTuple):
    """What a look decides: both models' estimates, the model chosen, the reason (`ok`: the
    series are exported), the held-out perplexities, and the checks' values (for logs)."""
    pbm: Propensities
    ubm: Propensities
    model: str
    reason: str
    perplexity: dict[str, float | None]
    checks: dict[str, float | None]
    at: float = 0.0  # when partition 0's holder estimated it (epoch seconds; 0: not known)

    @property
    def valid(self) -> bool:
        return self.reason == "ok"

    @property
    def chosen(self) -> Propensities:
        return self.ubm if self.model == "ubm" else self.pbm


def initial(ranks: int, ubm_slots: int) -> Look:
    """Before any look: nothing estimated, pbm."""
    return Look(Propensities([None] * ranks, [0.0] * ranks, 0),
                Propensities([None] * ubm_slots, [0.0] * ubm_slots, 0), "pbm", "insufficient_support",
                {m: None for m in MODELS}, {})


def _choose(layout: FitLayout, fit: np.ndarray, ubm: Propensities, previous: str) -> tuple[str, dict]:
    perplexity = {m: layout.perplexity(fit, i) for i, m in enumerate(MODELS)}
    model = previous if previous in MODELS else "pbm"
    if fit[layout.scored()].sum() >= MIN_SCORED and None not in perplexity.values():
        other = "ubm" if model == "pbm" else "pbm"
        if perplexity[other] < perplexity[model] * (1.0 - SWITCH_MARGIN):  # type: ignore[operator]
            model = other
    if model == "ubm" and ubm.relative[0] is None:
        model = "pbm"
    return model, perplexity


def _excess(found: Propensities, t: int, ratio_limit: tuple[float, float], monotone: bool,
            noise: float) -> tuple[float, float]:
    """How far the estimates go beyond plausible, each against its threshold plus the
    noise of its support (a ratio of click rates over n harvested pairs: about `noise`/√n):
    the largest ratio − `ratio_limit` − noise/√n, and (`monotone`) the largest rise from an
    estimated rank to the next one − MAX_RISE − 1.5·noise/√n. Positive: implausible."""
    est = [(p, n) for p, n in zip(found.relative, found.support) if p is not None]
    if not all(math.isfinite(p) and math.isfinite(n) for p, n in est):
        return math.inf, math.inf  # (a stored sum that is not a number: nothing to weigh with)
    ratio = max((p - ratio_limit[t] - noise / math.sqrt(max(n, 1.0)) for p, n in est), default=-1.0)
    rise = -1.0
    if monotone:
        rise = max(((b - a) - MAX_RISE[t] - 1.5 * noise / math.sqrt(max(min(n, m), 1.0))
                    for (a, n), (b, m) in zip(est, est[1:])), default=-1.0)
    return ratio, rise


def below_clicks(ubm: Propensities, ranks: int) -> tuple[float, float] | None:
    """ubm's examination below a click relative to the same rank with none above, the
    mean over slots weighted by their support, and that support (None: no such slot
    estimated). Not capped: a slot with none above whose estimate collapsed makes it read
    huge (1e183 seen), which errs towards keeping the series; capping each ratio at 4
    withdrew the dashboards test's thin traffic as `dependent_clicks` (review s11-2 M1)."""
    total = weight = 0.0
    for r in range(1, ranks):
        top = ubm.relative[slot(r, 0)]
        for d in range(1, min(r, UBM_DISTANCES) + 1):
            g, n = ubm.relative[slot(r, d)], ubm.support[slot(r, d)]
            if g is not None and top:
                total, weight = total + n * g / top, weight + n
    return (total / weight, weight) if weight and math.isfinite(total) else None


def miscalibrated(observed_over_expected: float | None, expected: float, t: int,
                  z: float = CALIBRATION_Z) -> bool:
    """Whether a calibration class's observed/expected is outside `CALIBRATION[t]` by more
    than `z` times 1/√expected, the ratio's SD were the clicks Poisson (0.18 at 30 expected
    clicks, where the class is first judged); Bernoulli clicks make the true SD 0.6–0.9 of
    that, so the margin is looser than `z` SDs (docs/debiasing.md)."""
    if observed_over_expected is None:
        return False
    low, high = CALIBRATION[t]
    noise = z / math.sqrt(max(expected, 1.0))
    return not low - noise <= observed_over_expected <= high + noise


def judge(pbm: Propensities, ubm: Propensities, fit: np.ndarray, layout: FitLayout,
          previous: Look | None, z: float = CALIBRATION_Z) -> Look:
    """The look's decision from both estimates and the fit sums of every partition; the
    previous look's reason picks the thresholds (withdraw while valid, restore while not).
    `z`: the calibration's noise margin (`CALIBRATION_Z`; the bench varies it)."""
    model, perplexity = _choose(layout, fit, ubm, previous.model if previous else "pbm")
    chosen = ubm if model == "ubm" else pbm
    t = 0 if previous is None or previous.valid else 1
    # pbm's curve always (a ranker reacting to clicks inflates it whichever model is
    # chosen); ubm's slots, thinner and noisier (a slot's pairs with a slot below a click
    # constrain little), only against a looser bound.
    ratio, rise = _excess(pbm, t, MAX_RATIO, True, 2.0)
    if model == "ubm":
        ratio = max(ratio, _excess(ubm, t, MAX_UBM_RATIO, False, 4.0)[0])
    m = MODELS.index(model)
    calibration = [layout.observed_over_expected(fit, m, cls, MIN_EXPECTED) for cls in (0, 1)]
    expected = [layout.expected(fit, m, cls) for cls in (0, 1)]
    contrast = layout.reaction_contrast(fit, MIN_REACTION_WEIGHT)
    found = below_clicks(ubm, layout.ranks)
    below, below_noise = (found[0], 2.0 / math.sqrt(max(found[1], 1.0))) if found else (None, 0.0)
    checks = {"ratio_excess": ratio, "rise_excess": rise, "calibration_no_click_above": calibration[0],
              "calibration_click_above": calibration[1], "reaction_ranks": contrast, "below_clicks": below}
    if model != "ubm":
        below = None
    if chosen.relative[0] is None:
        reason = "insufficient_support"
    elif contrast is not None and abs(contrast) > REACTION[t]:  # promoted or demoted after a click
        reason = "click_reactive_ranker"
    elif ratio > 0 or rise > 0:
        reason = "implausible_propensities"
    elif any(miscalibrated(c, e, t, z) for c, e in zip(calibration, expected)):
        reason = "poor_fit"
    elif below is not None and below < BELOW_CLICKS[t]:
        reason = "unexamined_below_clicks"
    elif below is not None and below + below_noise < DEPENDENT_CLICKS[t]:
        reason = "dependent_clicks"
    else:
        reason = "ok"
    return Look(pbm, ubm, model, reason, perplexity, checks)


def to_fields(look: Look) -> dict[str, str]:
    """A look as the running record partition 0's holder stores (`relative`, `support`:
    pbm's, as before; the rest new)."""
    return {"relative": json.dumps(look.pbm.relative), "support": json.dumps(look.pbm.support),
            "ubm_relative": json.dumps(look.ubm.relative), "ubm_support": json.dumps(look.ubm.support),
            "model": look.model, "reason": look.reason, "perplexity": json.dumps(look.perplexity),
            "checks": json.dumps(look.checks), "at": repr(float(look.at))}


def _numbers(text: str | None, length: int, none: bool) -> list | None:
    try:
        if text is not None and len(text) > MAX_TEXT:
            raise ValueError(f"{len(text)} characters")
        values = json.loads(text) if text is not None else None
        if not isinstance(values, list) or len(values) != length:
            return None
        ok = all((v is None and none) or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                          and math.isfinite(v)) for v in values)
    except (ValueError, RecursionError, OverflowError, TypeError) as e:
        # (a stored text must never stop a look: a 400-digit number, a deep nesting)
        error_once(log, "skipping an unreadable stored look", why=repr(e)[:200])
        return None
    return values if ok else None


def from_fields(fields: dict[str, str] | None, ranks: int, ubm_slots: int) -> Look | None:
    """The stored look, or None when there is none or it is unreadable. A record of an
    older version (pbm only) reads as pbm, `ok`: what that version exported."""
    if not fields:
        return None
    relative, support = _numbers(fields.get("relative"), ranks, True), _numbers(fields.get("support"), ranks, False)
    if relative is None or support is None:
        return None
    start = initial(ranks, ubm_slots)
    ubm_relative = _numbers(fields.get("ubm_relative"), ubm_slots, True)
    ubm_support = _numbers(fields.get("ubm_support"), ubm_slots, False)
    ubm = start.ubm if ubm_relative is None or ubm_support is None else Propensities(ubm_relative, ubm_support, 0)
    model = fields.get("model", "pbm")
    reason = fields.get("reason", "ok")
    if model not in MODELS or reason not in REASONS or (model == "ubm" and ubm_relative is None):
        model, reason = "pbm", "ok" if "reason" not in fields else "insufficient_support"
    return Look(Propensities(relative, support, 0), ubm, model, reason, _perplexity(fields.get("perplexity")),
                {}, _epoch_seconds(fields.get("at")))


def _perplexity(text: str | None) -> dict[str, float | None]:
    """A stored look's perplexities: finite numbers only, else None (review s11 M2: a deep
    nesting raised out of every look, a 400-digit integer out of every scrape)."""
    found: dict[str, float | None] = {m: None for m in MODELS}
    if text is None or len(text) > MAX_TEXT:
        return found
    try:
        stored = json.loads(text)
    except (ValueError, RecursionError):
        return found
    for m, v in (stored.items() if isinstance(stored, dict) else ()):
        if m in MODELS and isinstance(v, (int, float)) and not isinstance(v, bool):
            try:
                value = float(v)
            except OverflowError:
                continue
            found[m] = value if math.isfinite(value) else None
    return found


def _epoch_seconds(text: str | None) -> float:
    """A stored look's time, 0 when absent (an older version's) or not a time."""
    try:
        at = float(text) if text is not None and len(text) <= 32 else 0.0
    except ValueError:
        return 0.0
    return at if math.isfinite(at) and at > 0 else 0.0
