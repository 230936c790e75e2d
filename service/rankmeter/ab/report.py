"""`rankmeter report --ab`: an experiment's result as a table, or a self-contained HTML
page with plots (delta with its confidence sequence, p-value and arm sizes over time).

The verdict per comparison: `invalid: SRM` while the sample-ratio test rejects the
configured split (the arms are not what was planned: nothing else can be trusted);
`better` or `worse` once the running confidence sequence lies on one side of 0, by
that side (in the measure's direction: lower is better for Abandonment and
FirstClickRank) — never by the current delta, which can cross 0 while the running
sequence, an intersection over every look, stays where the evidence put it; `invalid:
empty confidence sequence` when the intersection is empty (the effect moved during the
experiment, or the model does not hold); else `inconclusive`. The sequence excludes 0
exactly when the running p-value is below alpha (each look's sequence excludes 0 when
its p does).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Sequence
from datetime import datetime, timezone

from rankmeter.ab.declared import LOWER_IS_BETTER
from rankmeter.ab.experiment import Comparison, Look
from rankmeter.unreadable import Unreadable


def verdict(c: Comparison, look: Look, alpha: float) -> str:
    if look.srm.get(c.segment, 1.0) < alpha:
        return "invalid: SRM"
    lower, upper = c.running.ci_lower, c.running.ci_upper
    if lower > upper:
        return "invalid: empty confidence sequence"
    if lower <= 0.0 <= upper or math.isnan(lower) or math.isnan(upper):
        return "inconclusive"
    increased = lower > 0.0
    return "better" if increased != (c.metric in LOWER_IS_BETTER) else "worse"


def table(look: Look, alpha: float, average: str = "macro") -> str:
    since = datetime.fromtimestamp(look.since_ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [f"experiment {look.experiment} — baseline {look.baseline} — alpha {alpha:g}",
             f"phase: split {look.split}, unit {look.unit}, impressions since {since}", *(f"note: {n}" for n in look.notes), ""]
    by_user = look.unit == "user"  # and its distinct users (HyperLogLog), '-' where not counted
    lines.append(f"{'ranker':<18}{'segment':<10}{'queries':>9}{'judged':>9}" + (f"{'users':>10}" if by_user else ""))
    for arm in look.arms:
        share = arm.judged / arm.queries if arm.queries else math.nan
        users = (f"{'-' if arm.users is None else f'{arm.users:,.0f}':>10}") if by_user else ""
        lines.append(f"{arm.ranker:<18}{arm.segment or '-':<10}{int(arm.queries):>9}{share:>9.1%}{users}")
    for segment, p in sorted(look.srm.items()):
        state = "MISMATCH: do not trust this experiment" if p < alpha else "ok"
        lines.append(f"sample ratio ({segment or 'all'}): p = {p:.4g}  {state}")
    lines += ["", f"{'treatment':<18}{'segment':<10}{'metric':<16}{'delta':>10}{'relative':>10}"
                  f"{'confidence sequence':>26}{'p':>10}{'var. red.':>10}  verdict"]
    for c in look.comparisons:
        if c.average != average:
            continue
        cs = f"[{c.running.ci_lower:+.4f}, {c.running.ci_upper:+.4f}]"
        # ab.cuped: the share of the variance the covariate removed; '-': not adjusted
        vr = f"{c.variance_reduction:.1%}" if math.isfinite(c.variance_reduction) else "-"
        lines.append(f"{c.ranker:<18}{c.segment or '-':<10}{c.metric:<16}{c.estimate.delta:>+10.4f}"
                     f"{c.estimate.relative:>+10.1%}{cs:>26}{c.running.p_value:>10.4g}{vr:>10}  {verdict(c, look, alpha)}")
    if not look.comparisons:
        lines.append("(no statistics yet: each arm needs ab.min_queries queries, 30 users by user, and a "
                     "metric's mixture variance is fixed ab.mixture_after past the phase's start)")
    return "\n".join(lines + decision_lines(look))


def decision_lines(look: Look) -> list[str]:
    """The declared decision per treatment and segment, and per declared metric its role,
    the sequence it is decided on (oriented: better is up; an absolute margin added, so
    the claim is its side of 0), the margin and why."""
    lines = ["", "decision (ab.primary, ab.guardrails; the per-metric verdicts above are exploratory):"]
    for d in look.decisions:
        lines.append(f"{d.treatment:<18}{d.segment or '-':<10}{d.decision.upper()}")
        for r in d.reasons:
            x = r.declared
            cs = f"[{r.lower:+.4f}, {r.upper:+.4f}]" if math.isfinite(r.level) else "-"
            level = f"{r.level:.4g}" if math.isfinite(r.level) else "-"
            lines.append(f"  {x.role:<10}{x.metric:<16}{x.average:<7}{'better: ' + ('up' if x.better > 0 else 'down'):<13}"
                         f"margin {x.margin_text:<8}{cs:>22} at {level:<8}{r.outcome:<13}{r.why}")
    if not look.decisions:
        lines.append("(no treatment arm yet)")
    return lines


def decisions_json(look: Look) -> list[dict]:
    return [{"treatment": d.treatment, "segment": d.segment, "decision": d.decision,
             "reasons": [{"metric": r.declared.metric, "average": r.declared.average, "role": r.declared.role,
                          "better": "increase" if r.declared.better > 0 else "decrease",
                          "margin": r.declared.margin_text, "outcome": r.outcome, "lower": r.lower, "upper": r.upper,
                          "level": r.level, "why": r.why} for r in d.reasons]}
            for d in look.decisions]


def snapshot(look: Look, at_ms: int) -> str:
    """One line of the experiment's history (kept in the store, one per minute)."""
    return json.dumps({"t": at_ms,
                       "arms": {f"{a.ranker}\x1f{a.segment}": a.queries for a in look.arms},
                       "srm": look.srm,
                       "c": {"\x1f".join((c.metric, c.ranker, c.segment, c.average)):
                             [c.estimate.delta, c.running.ci_lower, c.running.ci_upper, c.running.p_value]
                             for c in look.comparisons}})


def page(look: Look, history: Sequence[str], alpha: float, metrics: Sequence[str],
         unreadable: Unreadable | None = None) -> str:
    """A self-contained HTML report: the table, and per metric the macro delta with its
    confidence sequence and the p-value over time, then the arms' sizes. History lines
    and entries that cannot be read are skipped (counted in `unreadable`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = readable_history(look.experiment, history, unreadable or Unreadable())
    figures = []
    for metric in metrics:
        keys = sorted({k for p in points for k in p["c"] if k.split("\x1f")[0] == metric and k.endswith("macro")})
        if not keys:
            continue
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
        for key in keys:
            _, ranker, segment, _ = key.split("\x1f")
            rows = [(p["t"] / 3_600_000, *p["c"][key]) for p in points if key in p["c"]]
            t0 = rows[0][0]
            hours = [r[0] - t0 for r in rows]
            label = f"{ranker}{' / ' + segment if segment else ''}"
            top.plot(hours, [r[1] for r in rows], label=f"{label}: delta")
            top.fill_between(hours, [_finite(r[2]) for r in rows], [_finite(r[3]) for r in rows], alpha=0.2,
                             label=f"{label}: confidence sequence")
            bottom.plot(hours, [r[4] for r in rows], label=label)
        top.axhline(0, color="black", linewidth=0.8)
        top.set_ylabel(f"{metric} − {look.baseline}")
        top.set_title(f"{metric} (macro): treatment − baseline, always-valid {1 - alpha:.0%} confidence sequence")
        top.legend(fontsize=7)
        bottom.axhline(alpha, color="red", linestyle="--", linewidth=0.8, label=f"alpha = {alpha:g}")
        bottom.set_yscale("log")
        bottom.set_ylabel("always-valid p")
        bottom.set_xlabel("hours since the first look")
        bottom.legend(fontsize=7)
        figures.append(_png(fig))
        plt.close(fig)
    if points:
        fig, ax = plt.subplots(figsize=(8, 3))
        for arm in sorted({a for p in points for a in p["arms"]}):
            rows = [(p["t"] / 3_600_000, p["arms"][arm]) for p in points if arm in p["arms"]]
            ranker, segment = arm.split("\x1f")
            ax.plot([r[0] - rows[0][0] for r in rows], [r[1] for r in rows],
                    label=f"{ranker}{' / ' + segment if segment else ''}")
        ax.set_ylabel("queries")
        ax.set_xlabel("hours since the first look")
        ax.set_title("Arm sizes")
        ax.legend(fontsize=7)
        figures.append(_png(fig))
        plt.close(fig)
    images = "\n".join(f'<p><img alt="plot" src="data:image/png;base64,{f}"></p>' for f in figures)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>rankmeter A/B {html.escape(look.experiment)}"
            f"</title></head><body style='font-family: sans-serif'><h1>A/B experiment {html.escape(look.experiment)}</h1>"
            f"<pre>{html.escape(table(look, alpha))}</pre>{images or '<p>No history yet.</p>'}</body></html>")


def readable_history(experiment: str, history: Sequence[str], unreadable: Unreadable) -> list[dict]:
    """The history lines as `snapshot` wrote them: each comparison metric␟ranker␟segment␟average
    of four numbers, each arm ranker␟segment; any other line or entry is skipped."""
    points = []
    for line in history:
        try:
            p = json.loads(line)
            arms = {k: float(v) for k, v in p["arms"].items() if k.count("\x1f") == 1}
            c = {k: [float(x) for x in v] for k, v in p["c"].items() if k.count("\x1f") == 3 and len(v) == 4}
            if len(arms) != len(p["arms"]) or len(c) != len(p["c"]):
                raise ValueError("an entry is not in the snapshot's layout")
            points.append({"t": float(p["t"]), "arms": arms, "c": c})
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            unreadable.skip("history", f"ab:looks:{experiment}", line[:200], f"{type(e).__name__}: {e}")
    return points


def _finite(x: float) -> float:
    return x if math.isfinite(x) else math.nan


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=90)
    return base64.b64encode(buffer.getvalue()).decode()
