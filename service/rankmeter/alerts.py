"""The quality alerts of deploy/prometheus/rules.yml, evaluated by rankmeter itself on the
pipeline's windows: what `rankmeter demo` shows, with no Prometheus at hand.

Same definitions as the rule file (tests/test_prometheus_rules.py checks the constants and
the rules against it): a metric's mean over the alert's window against a baseline, beyond
max(margin × baseline, z × the standard error of the difference), with at least
MIN_SAMPLES queries averaged in the window, held for the rule's `for:`. The baseline is the
rule file's fallback, the rest of the day (the 24h window minus the alert's own window):
the median of the same hour on earlier days, which the rule file prefers, needs days of
history that a demo does not have.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from rankmeter.windows import WindowView

Z_SCORE = 4.0        # rankmeter:alert_z_score:threshold
MARGIN = 0.05        # rankmeter:quality_drop_margin:ratio
MIN_SAMPLES = 100.0  # rankmeter:alert_min_samples:count


class Rule(NamedTuple):
    alert: str
    metric: str
    window: str
    rise: bool     # a rise is bad (Abandonment); else a drop is
    hold_s: float  # the rule's `for:`


RULES = (Rule("RankmeterQualityDropFast", "nDCG@10", "15m", False, 300),
         Rule("RankmeterQualityDrop", "nDCG@10", "1h", False, 600),
         Rule("RankmeterCTRDrop", "CTR", "1h", False, 600),
         Rule("RankmeterAbandonmentSpike", "Abandonment", "1h", True, 600))


class Condition(NamedTuple):
    rule: Rule
    ranker: str
    value: float     # the mean over the rule's window
    baseline: float
    bound: float     # the value beyond which the condition holds
    samples: float   # queries averaged in the window
    holds: bool


class Moments(NamedTuple):
    total: float    # Σ value
    count: float    # queries averaged
    squares: float  # Σ value²

    def mean_and_error(self) -> tuple[float, float]:
        mean = self.total / self.count
        return mean, math.sqrt(max(self.squares / self.count - mean ** 2, 0.0) / self.count)


def conditions(views: Iterable[WindowView], rules: Iterable[Rule] = RULES) -> list[Condition]:
    """Every rule for every ranker with data in the rule's window and the rest of its day."""
    moments: dict[tuple[str, str, str], Moments] = {}
    for v in views:  # summed over segments, as the rule file's `sum by (metric, ranker, window)`
        for metric, s in v.sums.items():
            key = (v.ranker, v.window, metric)
            m = moments.get(key, Moments(0.0, 0.0, 0.0))
            moments[key] = Moments(m.total + s.value_sum, m.count + s.count, m.squares + s.value_squares)
    out = []
    for rule in rules:
        for ranker in sorted({r for r, _, _ in moments}):
            now, day = moments.get((ranker, rule.window, rule.metric)), moments.get((ranker, "24h", rule.metric))
            if now is None or day is None or now.count <= 0 or day.count - now.count < MIN_SAMPLES:
                continue  # a rest of the day on fewer queries than an alert needs is no baseline
            rest = Moments(day.total - now.total, day.count - now.count, day.squares - now.squares)
            (value, error), (baseline, baseline_error) = now.mean_and_error(), rest.mean_and_error()
            band = max(MARGIN * baseline, Z_SCORE * math.hypot(error, baseline_error))
            bound = baseline + band if rule.rise else baseline - band
            beyond = value > bound if rule.rise else value < bound
            out.append(Condition(rule, ranker, value, baseline, bound, now.count, beyond and now.count >= MIN_SAMPLES))
    return out


class Watch:
    """Pending and firing as Prometheus' rule manager has them: pending from the first
    evaluation at which a condition holds, firing once it has held for the rule's `for:`,
    gone at the first evaluation at which it does not."""

    def __init__(self) -> None:
        self.since: dict[tuple[str, str], float] = {}

    def update(self, found: Iterable[Condition], now_s: float) -> list[tuple[Condition, str]]:
        """The conditions that hold, each with its state: "pending" or "firing"."""
        out, holding = [], set()
        for c in found:
            if not c.holds:
                continue
            key = (c.rule.alert, c.ranker)
            holding.add(key)
            since = self.since.setdefault(key, now_s)
            out.append((c, "firing" if now_s - since >= c.rule.hold_s else "pending"))
        self.since = {k: t for k, t in self.since.items() if k in holding}
        return out
