"""Writes the Grafana dashboards in dashboards/ (run it after changing a panel):

    .venv/bin/python scripts/dashboards.py

Three dashboards — overview, A/B, operations — share the template variables and the
rule that every quality query sums numerators and denominators before dividing, so
several replicas (and segments) combine exactly; the A/B dashboard shows the always-valid
statistics the service exports for the configured experiment (rankmeter_ab_*), with no
fixed-horizon test computed in PromQL. tests/test_deploy.py checks the files are up to date; tests/integration/test_dashboards.py runs every panel's query
against a real Prometheus scraping a real `rankmeter serve`.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}


def selector(**matchers: str) -> str:
    """Label matchers with their operators: selector(metric='="AP"') -> 'metric="AP", …'."""
    labels = {"ranker": '=~"$ranker"', "window": '="$window"', "average": '="macro"', **matchers}
    return ", ".join(f"{k}{v}" for k, v in labels.items() if v)


def ratio(by: str, metric: str, family: str = "rankmeter_quality", **matchers: str) -> str:
    """Σ numerator / Σ denominator of `metric` (a name, or a matcher like '=~"$metric"'):
    exact across replicas and segments."""
    sel = selector(metric=metric if metric[0] in "=!" else f'="{metric}"', **matchers)
    return (f"sum by ({by}) ({family}_numerator{{{sel}}})\n"
            f"  / sum by ({by}) ({family}_denominator{{{sel}}})")


def panel(title: str, exprs: list[tuple[str, str]], x: int, y: int, w: int = 12, h: int = 8,
          kind: str = "timeseries", unit: str | None = None, description: str = "", **extra) -> dict:
    p = {"type": kind, "title": title, "description": description, "datasource": DS,
         "gridPos": {"x": x, "y": y, "w": w, "h": h},
         "targets": [{"refId": chr(65 + i), "expr": e, "legendFormat": legend, "datasource": DS}
                     for i, (e, legend) in enumerate(exprs)],
         "fieldConfig": {"defaults": {"unit": unit} if unit else {}, "overrides": []},
         "options": {}}
    p.update(extra)
    return p


def variables(*names: str) -> dict:
    known = {
        "datasource": {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
                       "current": {}, "hide": 0},
        "ranker": _query_var("ranker", "label_values(rankmeter_quality, ranker)", multi=True),
        "baseline": _query_var("baseline", "label_values(rankmeter_quality, ranker)", label="Baseline ranker"),
        "challenger": _query_var("challenger", "label_values(rankmeter_quality, ranker)", label="Ranker"),
        "metric": _query_var("metric", "label_values(rankmeter_quality, metric)"),
        # The A/B board lists what the experiment exports (rankmeter_ab_*), not every ranker.
        "ab_baseline": _query_var("baseline", "label_values(rankmeter_ab_queries, baseline)", label="Baseline ranker"),
        "ab_challenger": _query_var("challenger", 'label_values(rankmeter_ab_delta{baseline="$baseline"}, ranker)',
                                    multi=True, label="Treatment"),
        "ab_segment": _query_var("segment", 'label_values(rankmeter_ab_queries{baseline="$baseline"}, segment)',
                                 multi=True),
        "ab_metric": _query_var("metric", 'label_values(rankmeter_ab_delta{baseline="$baseline"}, metric)',
                                multi=True, label="Measure"),
        "ab_average": {"name": "average", "label": "Average", "type": "custom", "query": "macro,micro",
                       "current": {"text": "macro", "value": "macro"},
                       "options": [{"text": a, "value": a, "selected": a == "macro"} for a in ("macro", "micro")]},
        "window": {"name": "window", "label": "Window", "type": "custom", "query": "5m,1h,24h",
                   "current": {"text": "1h", "value": "1h"},
                   "options": [{"text": w, "value": w, "selected": w == "1h"} for w in ("5m", "1h", "24h")]},
    }
    return {"list": [known[n] for n in names]}


def _query_var(name: str, query: str, multi: bool = False, label: str | None = None) -> dict:
    return {"name": name, "label": label or name.capitalize(), "type": "query", "datasource": DS,
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2, "sort": 1,
            "multi": multi, "includeAll": multi, **({"allValue": ".*"} if multi else {})}


def dashboard(uid: str, title: str, description: str, panels: list[dict], templating: dict) -> dict:
    for i, p in enumerate(panels, start=1):
        p["id"] = i
    return {"uid": uid, "title": title, "description": description, "tags": ["rankmeter"],
            "editable": True, "schemaVersion": 39, "version": 1, "refresh": "30s",
            "time": {"from": "now-6h", "to": "now"}, "timezone": "", "graphTooltip": 1,
            "templating": templating, "annotations": {"list": []}, "panels": panels, "links": []}


def overview() -> dict:
    quality = ["nDCG@10", "P@10", "AP", "RR", "R@10"]
    return dashboard(
        "rankmeter-overview", "rankmeter — overview",
        "Search quality per ranker: the headline measures over time, each window, micro vs macro, "
        "online signals, and the distribution of per-query nDCG@10.",
        [
            panel("nDCG@10 per ranker", [(ratio("ranker", "nDCG@10"), "{{ranker}}")], 0, 0, unit="percentunit",
                  description="Mean per-query nDCG@10 (macro) over the queries shown in the window and judged."),
            panel("P@10, AP, RR, R@10 per ranker",
                  [(ratio("ranker, metric", m), "{{ranker}} {{metric}}") for m in quality[1:]], 12, 0,
                  unit="percentunit"),
            panel("Now, per ranker and measure (macro)",
                  [(ratio("ranker, metric", m), "{{ranker}} {{metric}}") for m in quality], 0, 8, 24, 6,
                  kind="table", unit="percentunit", description="The latest value of each measure."),
            panel("$metric in every window",
                  [(ratio("ranker, window", "$metric", window='=~"5m|1h|24h"'), "{{ranker}} {{window}}")], 0, 14,
                  unit="percentunit", description="The same measure over 5 minutes, 1 hour and 24 hours."),
            panel("$metric: micro vs macro",
                  [(ratio("ranker, average", "$metric", average='=~"micro|macro"'), "{{ranker}} {{average}}")],
                  12, 14, unit="percentunit",
                  description="Macro = mean of per-query values; micro = summed numerators over summed denominators."),
            panel("CTR (micro) and abandonment",
                  [(ratio("ranker", "CTR", average='="micro"'), "{{ranker}} CTR"),
                   (ratio("ranker", "Abandonment"), "{{ranker}} abandonment")], 0, 22, unit="percentunit"),
            panel("Queries in the window",
                  [('sum by (ranker, population) (rankmeter_queries{ranker=~"$ranker", window="$window"})',
                    "{{ranker}} {{population}}")], 12, 22, unit="short",
                  description="All queries, and those with a relevant document known (judged)."),
            panel("Distribution of per-query nDCG@10",
                  [('sum by (le) (rankmeter_query_quality_bucket{metric="nDCG@10", ranker=~"$ranker", window="$window"})',
                    "{{le}}")], 0, 30, 12, 8, kind="bargauge", unit="short",
                  description="Judged queries whose nDCG@10 is at most `le` (cumulative).",
                  options={"displayMode": "gradient", "orientation": "vertical"}),
            panel("Median and 10th percentile of per-query nDCG@10",
                  [(f'histogram_quantile({q}, sum by (ranker, le) (rankmeter_query_quality_bucket{{metric="nDCG@10", '
                    f'ranker=~"$ranker", window="$window"}}))', f"{{{{ranker}}}} p{int(q * 100)}") for q in (0.5, 0.1)],
                  12, 30, unit="percentunit",
                  description="Interpolated within tenths: a falling p10 with a steady median means some queries broke."),
            panel("nDCG@10: raw clicks and position-bias corrected",
                  [(ratio("ranker", "nDCG@10"), "{{ranker}} raw"),
                   (ratio("ranker", "nDCG@10", family="rankmeter_debiased_quality", grading='="ipw"'),
                    "{{ranker}} debiased"),
                   ("max by (reason) (rankmeter_debias_valid) == 1", "debiased valid: {{reason}}")],
                  0, 38, unit="percentunit",
                  description="Raw: the grades as users gave them (clicks favour the top ranks). Debiased "
                              "(grading=\"ipw\"): each click weighted by 1 / the estimated examination of its rank "
                              "(given the clicks above it, when the cascade-capable click model fits better), over "
                              "the query text's pooled ideal. Compare the rankers' gap: raw click metrics compress "
                              "it. The debiased series are exported only while the fit test holds; \"debiased "
                              "valid\" names the reason they are exported (ok) or withdrawn "
                              "(insufficient_support, implausible_propensities, poor_fit, click_reactive_ranker, "
                              "unexamined_below_clicks, dependent_clicks: "
                              "docs/debiasing.md)."),
            panel("Examination by rank (estimated)",
                  [("max by (rank) (rankmeter_propensity)", "rank {{rank}}")], 12, 38, kind="bargauge",
                  unit="percentunit",
                  description="How likely a user is to look at each rank, relative to rank 1, estimated from the "
                              "stream (intervention harvesting across rankers): the weights of the debiased measures.",
                  options={"displayMode": "gradient", "orientation": "vertical"}),
        ],
        variables("datasource", "ranker", "window", "metric"))


def ab() -> dict:
    """The always-valid statistics `rankmeter serve` exports for the configured experiment
    (rankmeter_ab_*): nothing here is a fixed-horizon test, so the board may be watched
    continuously. One replica exports them (the one holding partition 0); `max by` keeps a
    scrape during a handover from showing the same series twice."""
    def ab_series(name: str, by: str, **matchers: str) -> str:
        labels = {"baseline": '="$baseline"', **matchers}
        return f"max by ({by}) (rankmeter_{name}{{{', '.join(f'{k}{v}' for k, v in labels.items())}}})"

    comparison = {"ranker": '=~"$challenger"', "segment": '=~"$segment"', "average": '="$average"'}
    arms = {"ranker": '=~"$baseline|$challenger"', "segment": '=~"$segment"'}
    band = [(ab_series(name, "metric, ranker, segment", metric='=~"$metric"', **comparison),
             f"{{{{ranker}}}} {{{{segment}}}} {{{{metric}}}} {legend}")
            for name, legend in (("ab_delta", "Δ"), ("ab_ci_lower", "lower"), ("ab_ci_upper", "upper"))]
    dashed = {"matcher": {"id": "byRegexp", "options": ".* (lower|upper)$"},
              "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                             {"id": "custom.lineWidth", "value": 1}]}
    zero_line = {"mode": "absolute", "steps": [{"color": "transparent", "value": None}, {"color": "text", "value": 0}]}
    alpha_line = {"mode": "absolute", "steps": [{"color": "red", "value": None}, {"color": "transparent", "value": 0.05}]}
    srm_steps = {"mode": "absolute", "steps": [{"color": "red", "value": None}, {"color": "green", "value": 0.05}]}
    decision_colors = [{"matcher": {"id": "byRegexp", "options": f".*: {name}$"},
                        "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": color}}]}
                       for name, color in (("ship", "green"), ("do_not_ship", "red"), ("keep_running", "blue"),
                                           ("invalid_srm", "orange"), ("undeclared", "gray"))]
    decision = ('max by (treatment, segment, decision) (rankmeter_ab_decision{treatment=~"$challenger", '
                'segment=~"$segment"}) == 1')
    how_to_read = (
        "### How to read this experiment\n\n"
        "**The decision** (top) is the one to act on: `ship` once a declared primary metric is better and "
        "every guardrail is shown within its margin, `do_not_ship` once a primary is worse or a guardrail "
        "beyond its margin, else `keep_running` (`ab.primary`, `ab.guardrails`; error rates at most α "
        "across the declared metrics). Every other comparison below is *exploratory* (`role` label): "
        "with 18 of them, some A/A difference looks significant far more often than α.\n\n"
        "Every impression of each arm counts from the moment the experiment started; the statistics are "
        "**cumulative** and **always valid** (mSPRT, α = 0.05): the p-value and the confidence sequence stay "
        "correct however often you look, so watching this board continuously and stopping as soon as it is "
        "decided is fine. They appear once each arm has `ab.min_queries` queries and "
        "`ab.mixture_after` (70 min by default) has passed since the phase began.\n\n"
        "1. **Sample ratio first.** While the SRM p-value is below α (red), the arms are not the split you "
        "configured: the experiment is **invalid**, whatever the other panels say.\n"
        "2. **Δ = treatment − baseline**, with its 95% confidence sequence (dashed). Entirely above 0: the "
        "treatment is higher; entirely below: lower; across 0: not decided yet, wait for more queries.\n"
        "3. **Direction:** higher is better for nDCG@10, P@10, AP, RR, R@10, CTR and Clicks; **lower is better "
        "for Abandonment and FirstClickRank** (an increase there is a regression).\n"
        "4. **Always-valid p-value** below the α line: the difference is significant (it is a running minimum, "
        "so it never goes back up).\n"
        "5. **Judged share per arm:** quality measures count a query with no relevant document as 0; a gap in "
        "judged share between arms is part of the effect, not noise.\n\n"
        "How to set up and run an experiment: docs/ab-testing.md, *Running an A/B experiment*.")
    return dashboard(
        "rankmeter-ab", "rankmeter — A/B",
        "The configured A/B experiment (ab.baseline against every other ranker): always-valid deltas with their "
        "confidence sequences, p-values, arm sizes, judged shares and the sample-ratio check. Safe to watch "
        "continuously.",
        [
            panel("How to read this board", [], 0, 0, 24, 9, kind="text",
                  options={"mode": "markdown", "content": how_to_read}),
            panel("Decision per treatment and segment (ab.primary, ab.guardrails)",
                  [(decision, "{{treatment}} {{segment}}: {{decision}}")], 0, 9, 24, 4, kind="stat",
                  description="The declared decision: ship, do_not_ship, keep_running, invalid_srm (the sample "
                              "ratio test rejects the split) or undeclared (no ab.primary). `rankmeter report --ab` "
                              "shows each declared metric's interval, margin and why.",
                  fieldConfig={"defaults": {"unit": "none"}, "overrides": decision_colors},
                  options={"colorMode": "background", "graphMode": "none", "textMode": "name",
                           "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}),
            panel("Sample ratio mismatch (SRM): experiment invalid while below α = 0.05",
                  [(ab_series("ab_srm_p_value", "segment", segment='=~"$segment"'), "SRM p {{segment}}")],
                  0, 13, 8, 7, kind="stat",
                  description="Always-valid p-value of the arms' query counts against ab.split (sequential "
                              "multinomial test, running minimum). Red (below α): the traffic split is not the "
                              "configured one, and the experiment cannot be trusted until the cause is fixed and it "
                              "is restarted.",
                  fieldConfig={"defaults": {"unit": "none", "decimals": 4, "min": 0, "max": 1,
                                            "thresholds": srm_steps, "color": {"mode": "thresholds"}},
                               "overrides": []},
                  options={"colorMode": "background", "graphMode": "area", "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}),
            panel("Queries per arm since the experiment started",
                  [(ab_series("ab_queries", "ranker, segment", **arms), "{{ranker}} {{segment}}")], 8, 13, 8, 7,
                  unit="short", description="Cumulative, from the experiment's start: the arm sizes behind every "
                                            "statistic (none is shown before each arm has ab.min_queries, nor before ab.mixture_after)."),
            panel("Judged share per arm",
                  [(ab_series("ab_judged_share", "ranker, segment", **arms), "{{ranker}} {{segment}}")], 16, 13, 8, 7,
                  unit="percentunit", description="Share of each arm's queries with a relevant document known. "
                                                  "Unjudged queries count 0 in the A/B quality measures."),
            panel("$metric: Δ ($challenger − $baseline) with its always-valid 95% confidence sequence", band,
                  0, 20, 12, 9, repeat="metric", repeatDirection="h", maxPerRow=2,
                  description="Treatment minus baseline, cumulative since the start; dashed: the confidence sequence "
                              "(valid at every look). Above 0 = treatment higher; lower is better for Abandonment "
                              "and FirstClickRank.",
                  fieldConfig={"defaults": {"unit": "none", "decimals": 4, "thresholds": zero_line,
                                            "custom": {"thresholdsStyle": {"mode": "line"}}},
                               "overrides": [dashed]}),
            panel("Always-valid p-value per treatment and measure (α = 0.05 line)",
                  [(ab_series("ab_p_value", "metric, ranker, segment", metric='=~"$metric"', **comparison),
                    "{{ranker}} {{segment}} {{metric}}")], 0, 29, 24, 9,
                  description="mSPRT p-value for Δ ≠ 0, a running minimum: below the red line the difference is "
                              "significant, and it stays valid however often it is read. Read the direction from Δ.",
                  fieldConfig={"defaults": {"unit": "none", "max": 1, "thresholds": alpha_line,
                                            "custom": {"thresholdsStyle": {"mode": "line+area"},
                                                       "scaleDistribution": {"type": "log", "log": 10}}},
                               "overrides": []}),
            panel("Relative Δ per treatment and measure",
                  [(ab_series("ab_relative_delta", "metric, ranker, segment", metric='=~"$metric"', **comparison),
                    "{{ranker}} {{segment}} {{metric}}")], 0, 38, 24, 8, unit="percentunit",
                  description="Δ relative to the baseline's value (lower is better for Abandonment and "
                              "FirstClickRank)."),
        ],
        variables("datasource", "ab_baseline", "ab_challenger", "ab_segment", "ab_metric", "ab_average"))


def operations() -> dict:
    rate = "[$__rate_interval]"
    return dashboard(
        "rankmeter-operations", "rankmeter — operations",
        "Is rankmeter keeping up: throughput, outcomes, lag, batch latency, open queries.",
        [
            panel("Events consumed per second", [(f"sum by (stream) (rate(rankmeter_events_total{rate}))", "{{stream}}")],
                  0, 0, unit="ops"),
            panel("Outcomes other than applied",
                  [(f'sum by (stream, outcome) (rate(rankmeter_events_total{{outcome!="applied"}}{rate}))',
                    "{{stream}} {{outcome}}")], 12, 0, unit="ops"),
            panel("Invalid, late and duplicate shares",
                  [(f'sum by (outcome) (rate(rankmeter_events_total{{outcome=~"invalid|late|duplicate"}}{rate}))\n'
                    f"  / scalar(sum(rate(rankmeter_events_total{rate})))", "{{outcome}}")], 0, 8, unit="percentunit"),
            panel("Consumer lag", [("sum by (topic) (rankmeter_consumer_lag)", "{{topic}}")], 12, 8, unit="short"),
            panel("Batch duration", [(f"histogram_quantile({q}, sum by (le) (rate(rankmeter_batch_duration_seconds_bucket{rate})))",
                                      f"p{int(q * 100)}") for q in (0.5, 0.99)], 0, 16, unit="s"),
            panel("Open queries and partitions", [("sum(rankmeter_open_queries)", "open queries"),
                                                  ("sum(rankmeter_assigned_partitions)", "assigned partitions")],
                  12, 16, unit="short"),
        ],
        variables("datasource"))


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    builders = {"rankmeter-overview": overview, "rankmeter-ab": ab, "rankmeter-operations": operations}
    return {f"{name}.json": json.dumps(build(), indent=2) + "\n" for name, build in builders.items()}


def main() -> None:
    for name, text in render().items():
        (OUT / name).write_text(text)


if __name__ == "__main__":
    main()
