"""Writes the Grafana dashboards in dashboards/ (run it after changing a panel):

    .venv/bin/python scripts/dashboards.py

Three dashboards — overview, A/B, operations — share the template variables and the
rule that every quality query sums numerators and denominators before dividing, so
several replicas (and segments) combine exactly. tests/test_dashboards.py checks the
files are up to date; tests/integration/test_dashboards.py runs every panel's query
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


def ratio(by: str, metric: str, **matchers: str) -> str:
    """Σ numerator / Σ denominator of `metric` (a name, or a matcher like '=~"$metric"'):
    exact across replicas and segments."""
    sel = selector(metric=metric if metric[0] in "=!" else f'="{metric}"', **matchers)
    return (f"sum by ({by}) (rankmeter_quality_numerator{{{sel}}})\n"
            f"  / sum by ({by}) (rankmeter_quality_denominator{{{sel}}})")


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
        ],
        variables("datasource", "ranker", "window", "metric"))


def ab() -> dict:
    def mean(ranker: str) -> str:
        return ratio("metric", '=~"$metric"', ranker=f'="{ranker}"')

    def variance_over_n(ranker: str) -> str:
        """Var(value) / n = (Σv²/n − mean²) / n: the squared standard error of the mean."""
        matchers = {"metric": '=~"$metric"', "ranker": f'="{ranker}"'}
        n = f"sum by (metric) (rankmeter_quality_denominator{{{selector(**matchers)}}})"
        total = f"sum by (metric) (rankmeter_quality_numerator{{{selector(**matchers)}}})"
        squares = f"sum by (metric) (rankmeter_quality_squares{{{selector(**matchers, average='')}}})"
        return f"(({squares} / {n} - ({total} / {n}) ^ 2) / {n})"

    delta = f"({mean('$challenger')})\n- ({mean('$baseline')})"
    half_width = f"1.96 * sqrt({variance_over_n('$challenger')} + {variance_over_n('$baseline')})"
    return dashboard(
        "rankmeter-ab", "rankmeter — A/B",
        "A ranker against a baseline: the difference of each measure's mean (macro) and its 95% "
        "confidence interval (Welch, from the exported sums of values and of squared values).",
        [
            panel("Difference: $challenger − $baseline", [(delta, "{{metric}} Δ"),
                                                          (f"{delta}\n- {half_width}", "{{metric}} lower 95%"),
                                                          (f"{delta}\n+ {half_width}", "{{metric}} upper 95%")],
                  0, 0, 24, 9, unit="percentunit",
                  description="Above 0: the ranker is better than the baseline. The band is the 95% interval."),
            panel("$challenger and $baseline", [(mean("$challenger"), "$challenger {{metric}}"),
                                                (mean("$baseline"), "$baseline {{metric}}")],
                  0, 9, unit="percentunit"),
            panel("Queries per ranker (traffic split)",
                  [('sum by (ranker) (rankmeter_queries{ranker=~"$challenger|$baseline", window="$window", population="all"})',
                    "{{ranker}}")], 12, 9, unit="short",
                  description="A split far from the intended one (sample ratio mismatch) makes the comparison suspect."),
        ],
        variables("datasource", "baseline", "challenger", "metric", "window"))


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
