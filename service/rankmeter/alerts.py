"""The quality alerts of deploy/prometheus/rules.yml, evaluated by rankmeter itself on the
pipeline's windows: what `rankmeter demo` shows, with no Prometheus at hand.

Same definitions as the rule file (tests/test_alerts.py checks the constants and rules
against it): a metric's mean over the alert's window against a baseline, beyond
max(margin × baseline, z × the standard error of the difference), with at least
MIN_SAMPLES queries averaged in the window, held for the rule's `for:`. The baseline is
the rule file's for a service without days of history (a demo): the median of the
window's own values over the last day, once it has an hour of them. Measured live like
the window it is compared with, it carries the same missing recent clicks (a window
ending now holds queries whose clicks are still to come), and a 2-hour incident barely
moves a day's median. Its standard error: 1.25 × the median standard error over
sqrt(hours of history, at most 24) — one independent value an hour. (The rule file
prefers the median of the same time of day over earlier days, which a demo lacks.)
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from rankmeter.windows import WindowView

Z_SCORE = 4.0        # rankmeter:alert_z_score:threshold
MARGIN = 0.05        # rankmeter:quality_drop_margin:ratio
MIN_SAMPLES = 100.0  # rankmeter:alert_min_samples:count
DAY_S = 86_400.0
HOUR_S = 3_600.0
RECORD_EVERY_S = 60.0  # the recording group's interval: the baseline's values are a minute apart


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


def window_means(views: Iterable[WindowView]) -> dict[tuple[str, str, str], tuple[float, float, float]]:
    """(ranker, window, metric) -> (mean, standard error, queries averaged), summed over
    segments as the rule file's `sum by (metric, ranker, window)`."""
    sums: dict[tuple[str, str, str], tuple[float, float, float]] = {}
    for v in views:
        for metric, s in v.sums.items():
            total, count, squares = sums.get((v.ranker, v.window, metric), (0.0, 0.0, 0.0))
            sums[(v.ranker, v.window, metric)] = (total + s.value_sum, count + s.count, squares + s.value_squares)
    out = {}
    for key, (total, count, squares) in sums.items():
        if count > 0:
            mean = total / count
            out[key] = (mean, math.sqrt(max(squares / count - mean ** 2, 0.0) / count), count)
    return out


class Evaluator:
    """Evaluates RULES at each call, as Prometheus evaluates the rule group: keeps each
    window's values over the last day (the baseline) and each alert's pending time."""

    def __init__(self, rules: Iterable[Rule] = RULES) -> None:
        self.rules = tuple(rules)
        self.history: dict[tuple[str, str, str], deque[tuple[float, float, float]]] = {}
        self.since: dict[tuple[str, str], float] = {}

    def conditions(self, views: Iterable[WindowView], now_s: float) -> list[Condition]:
        """Every rule for every ranker with a value and a baseline."""
        means = window_means(views)
        for key, (mean, error, _) in means.items():
            kept = self.history.setdefault(key, deque())
            if not kept or now_s - kept[-1][0] >= RECORD_EVERY_S:  # as the rule group records them
                kept.append((now_s, mean, error))
            while kept[0][0] <= now_s - DAY_S:
                kept.popleft()
        out = []
        for rule in self.rules:
            for (ranker, window, metric), (value, error, samples) in sorted(means.items()):
                if window != rule.window or metric != rule.metric:
                    continue
                kept = self.history[(ranker, window, metric)]
                # Hours of values a minute apart, as the rule file's count_over_time(…[1d]) / 60:
                # 60 values (59 minutes apart) are an hour.
                hours = ((now_s - kept[0][0]) + RECORD_EVERY_S) / HOUR_S
                if hours < 1:
                    continue  # an hour of history at least
                baseline = statistics.median(m for _, m, _ in kept)
                baseline_error = 1.25 * statistics.median(e for _, _, e in kept) / math.sqrt(min(hours, 24))
                band = max(MARGIN * baseline, Z_SCORE * math.hypot(error, baseline_error))
                bound = baseline + band if rule.rise else baseline - band
                beyond = value > bound if rule.rise else value < bound
                out.append(Condition(rule, ranker, value, baseline, bound, samples,
                                     beyond and samples >= MIN_SAMPLES))
        return out

    def update(self, views: Iterable[WindowView], now_s: float) -> list[tuple[Condition, str]]:
        """The conditions that hold, each "pending" (since its first evaluation holding)
        or "firing" (held for the rule's `for:`); one that stops holding starts afresh."""
        out, holding = [], set()
        for c in self.conditions(views, now_s):
            if not c.holds:
                continue
            key = (c.rule.alert, c.ranker)
            holding.add(key)
            since = self.since.setdefault(key, now_s)
            out.append((c, "firing" if now_s - since >= c.rule.hold_s else "pending"))
        self.since = {k: t for k, t in self.since.items() if k in holding}
        return out
