"""The A/B experiment's Prometheus families (exporter.py yields them from partition 0's
holder): every comparison, labelled with its `role` in the declared decision, the arms,
the sample-ratio test, the experiment's identity and the decision itself."""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from rankmeter.ab.declared import DECISIONS
from rankmeter.ab.experiment import Look


def experiment_metrics(result: Look) -> Iterator[Metric]:
    labels = ["metric", "ranker", "baseline", "segment", "average", "role"]
    families = {name: GaugeMetricFamily(f"rankmeter_ab_{name}", text, labels=labels) for name, text in (
        ("delta", "Treatment minus baseline, cumulative since the experiment started (every impression counts)."),
        ("relative_delta", "Delta relative to the baseline's value."),
        ("ci_lower", "Lower bound of the always-valid confidence sequence for delta (mSPRT)."),
        ("ci_upper", "Upper bound of the always-valid confidence sequence for delta (mSPRT)."),
        ("p_value", "Always-valid p-value for delta != 0 (mSPRT, running minimum): valid however often it is read."),
        ("mixture_variance", "The mSPRT mixture variance tau^2 the comparison is tested with, fixed at its "
                             "first look (ab.mixture_variance, or ab.mixture_scale times the metric's variance)."),
        ("variance_reduction", "ab.cuped: 1 - variance of the covariate-adjusted delta / variance of the unadjusted "
                               "one (the query text's pre-period mean as covariate); absent where not adjusted."))}
    # A metric's role in the declared decision: primary, guardrail, or exploratory (no decision, no alert).
    roles = {(r.declared.metric, r.declared.average): r.declared.role for d in result.decisions for r in d.reasons}
    for c in result.comparisons:
        key = [c.metric, c.ranker, result.baseline, c.segment, c.average, roles.get((c.metric, c.average), "exploratory")]
        for name, value in (("delta", c.estimate.delta), ("relative_delta", c.estimate.relative),
                            ("ci_lower", c.running.ci_lower), ("ci_upper", c.running.ci_upper),
                            ("p_value", c.running.p_value), ("mixture_variance", c.tau2),
                            ("variance_reduction", c.variance_reduction)):
            if math.isfinite(value):
                families[name].add_metric(key, value)
    yield from families.values()
    queries = GaugeMetricFamily("rankmeter_ab_queries", "Queries of each arm since the experiment started.",
                                labels=["ranker", "baseline", "segment"])
    judged = GaugeMetricFamily("rankmeter_ab_judged_share", "Share of each arm's queries with a relevant "
                               "document known.", labels=["ranker", "baseline", "segment"])
    users = GaugeMetricFamily("rankmeter_ab_users", "Distinct users of each arm (ab.unit: user; a "
                              "HyperLogLog estimate, relative error about 0.8%).", labels=["ranker", "baseline", "segment"])
    for arm in result.arms:
        queries.add_metric([arm.ranker, result.baseline, arm.segment], arm.queries)
        if arm.users is not None:
            users.add_metric([arm.ranker, result.baseline, arm.segment], arm.users)
        if arm.queries:
            judged.add_metric([arm.ranker, result.baseline, arm.segment], arm.judged / arm.queries)
    srm = GaugeMetricFamily("rankmeter_ab_srm_p_value", "Always-valid p-value of the arms' query counts (ab.unit: user: and distinct users) "
                            "against ab.split (sequential multinomial test): below alpha, the experiment "
                            "cannot be trusted.", labels=["baseline", "segment"])
    for segment, p in result.srm.items():
        srm.add_metric([result.baseline, segment], p)
    info = GaugeMetricFamily("rankmeter_ab_experiment_info", "The experiment exported: its name, and its "
                             "phase's split and start (ms): a ramp is a new phase, a new experiment.",
                             labels=["experiment", "baseline", "split", "since", "unit"])
    info.add_metric([result.experiment, result.baseline, result.split, str(result.since_ms), result.unit], 1)
    yield from (queries, judged, users, srm, info, decision_metric(result))


def decision_metric(result: Look) -> Metric:
    """1 for each treatment and segment's current decision, 0 for the other four (a stat
    panel shows the one at 1; an alert reads decision="do_not_ship" == 1)."""
    family = GaugeMetricFamily(
        "rankmeter_ab_decision", "The declared decision per treatment and segment (ab.primary, ab.guardrails): "
        "1 for the current one of ship, do_not_ship, keep_running, invalid_srm, undeclared; 0 for the others.",
        labels=["experiment", "treatment", "segment", "decision"])
    for d in result.decisions:
        for name in DECISIONS:
            family.add_metric([result.experiment, d.treatment, d.segment, name], float(name == d.decision))
    return family
