"""Position-bias correction against the truth: raw click nDCG@10, IPW click nDCG@10 (with
estimated and with true propensities) and the hidden grades' nDCG@10, over many seeds.

    .venv/bin/python bench/debias_agreement.py [--config pbm/power-0.9 ...] [--seeds 40]
        [--first-seed 1] [--learn 6000] [--window 600]

Per configuration (click model / examination curve) and seed, one `Simulator` run
(`rankmeter simulate`'s traffic: corpus and traffic seed, bm25-tuned and bm25-degraded by a
50/50 split, users with their own click propensities, dwell, carts, purchases, 3% of
queries with the top five judged):

- the estimator (`rankmeter.debias.Harvester`, one partition) harvests every query of
  `--learn` + `--window` queries, with its final clicks; `estimate` gives p_k / p_1.
- the last `--window` queries are evaluated as the service does: grades by the default
  grade map (brief §3: click 1, a click with dwell ≥ 30 s 2, add_to_cart 2, purchase 3,
  a judgment its grade and it wins), `QueryState.from_grades(list, grades, shown_grade=0)`,
  nDCG@10 and DCG@10 by the engine, macro over the judged queries (`empty_query_policy: skip`).
  IPW: the same with `rankmeter.debias.grades` (clip 10). Truth: the hidden grades of every
  document (IDCG over all of them), macro over queries with a relevant document, as the
  simulator's `TruthTally`.

The demo's scale: `rankmeter demo` sends 500 events/s at 60× event time, about 4.2 events
a query, so a 5-minute window holds about 600 queries (the default `--window`) and an hour
7,200; the estimator has harvested 6,000 before the window (the default `--learn`: 50
minutes of the demo).

Per configuration and measure it prints: the mean gap (tuned − degraded) with a 95%
t-interval over seeds; the relative gap (mean gap / bm25-tuned's mean value), and its share
of the truth's relative gap (for nDCG@10, whose values are on the truth's scale, about the
share of the true gap; for DCG@10, whose click gains are not the hidden grades, the only
comparable one); the seeds in which each ranks the rankers right with a Wilson 95%
interval; and the estimated propensities' error per rank
(mean and 95% interval of estimated − true p_k/p_1 over seeds). Markdown on stdout,
progress on stderr.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Mapping, Sequence

import numpy as np

from rankmeter.config import Evaluation
from rankmeter.debias import DEFAULT_CAPACITY, DEFAULT_MIN_PAIRS, dcg, dcg_of, weights
from rankmeter.debias import grades as ipw_grades
from rankmeter.debias.tables import ModelTables, decide
from rankmeter.engine import QueryState, evaluate, parse, stack
from rankmeter.engine.query import first_occurrences
from rankmeter.simulator.traffic import DEFAULT_RANKERS, Simulator

MEASURES = [parse("nDCG@10"), parse("DCG@10")]
# The issue-22 configurations by short name (model, examination curve, click reaction β);
# the older "model/curve" names are accepted too.
NAMED = {"pbm": ("pbm", "power-0.9", 0.0), "pbm2": ("pbm", "power-1.5", 0.0), "cascade": ("cascade", None, 0.0),
         "dcm": ("dcm", None, 0.0), "reactive": ("pbm", "power-0.9", 1.0)}
CONFIGS = (*NAMED, "pbm/power-0.9", "pbm/power-1.5", "pbm/exp-0.75", "pbm/plateau-3")
# The true nDCG@10 gap with every bm25-degraded query on its own list (pbm/power-0.9, 40
# seeds): --gap g shows the degraded list in a share g / FULL_GAP of its queries.
FULL_GAP = 0.372
SERIES = ("truth", "raw", "ipw-estimated", "ipw-true")
# nDCG@10 with a normaliser that does not come from the list: the pooled per-query-text
# ideal (`Harvester.ideal_dcg`), and a constant (the ideal DCG@10 of ten grade-3 results).
EXTRA = ("ipw-pooled-estimated", "ipw-pooled-true", "ipw-constant-estimated", "ipw-pooled-estimated-micro")
ROWS = [("nDCG@10", s) for s in SERIES + EXTRA] + [("DCG@10", s) for s in SERIES]
MAX_GRADE = 3.0  # the default grade map's highest grade (purchase; judgments 0-3)
CONSTANT_IDEAL = dcg_of([MAX_GRADE] * 10, 10)
# The pooled variants measured (sensitivity table): minimum graded impressions per document,
# capped at 1 or not, explicit judgments in the numerator or not; estimated propensities.
SUPPORTS = (1, 3, 10, 30)
# "micro": Σ DCG / Σ ideal over a ranker's queries (the engine's micro average) instead of
# the mean of the per-query ratios.
VARIANTS = [(m, agg, explicit) for m in SUPPORTS for agg in ("macro", "cap 1", "micro")
            for explicit in (False, True)]
TUNED, DEGRADED = (r.name for r in DEFAULT_RANKERS)
LOOK_EVERY = 500  # queries between two looks at the propensities and the fit


class Query:
    """One evaluated query: its list, the service's grades (implicit and explicit) and the
    hidden ones."""
    __slots__ = ("ranker", "results", "implicit", "explicit", "truth", "ideal", "exported", "exported_parts")

    def __init__(self, ranker: str, results: list[str], truth: Mapping[str, int]) -> None:
        self.ranker, self.results, self.truth = ranker, results, truth
        self.implicit: dict[str, float] = {}
        self.explicit: dict[str, float] = {}
        self.ideal: dict[tuple[int, str], float | None] = {}  # (min support, weights) -> pooled ideal
        self.exported: float | None = None  # the service's debiased nDCG@10 (the chosen click model)
        self.exported_parts: tuple[float, float] | None = None  # its DCG@10 and pooled ideal (micro's terms)


def grade_of(value: dict, rules: Evaluation) -> float:
    """The implicit grade of one feedback event by the default grade map (brief §3)."""
    if value["action"] == "click" and value.get("dwell_ms", 0) >= rules.long_dwell_ms:
        return rules.long_dwell_grade
    return rules.grades.get(value["action"], 0.0)


def macro(queries: Sequence[Query], grades_of) -> dict[str, dict[str, float]]:
    """Each measure's value per ranker, macro over the queries with a relevant document
    (`empty_query_policy: skip`), by the engine."""
    states = [QueryState.from_grades(q.results, grades_of(q), shown_grade=0) for q in queries]
    ratios = evaluate(MEASURES, stack(states))
    out: dict[str, dict[str, float]] = {}
    for m in MEASURES:
        values = m.values(ratios[m])
        out[str(m)] = {}
        for ranker in (TUNED, DEGRADED):
            judged = [v for q, s, v in zip(queries, states, values) if q.ranker == ranker and s.num_rel > 0]
            out[str(m)][ranker] = float(np.mean(judged)) if judged else float("nan")
    return out


def per_ranker(queries: Sequence[Query], values: Sequence[float | None]) -> dict[str, float]:
    """Mean per ranker of the queries' values, leaving out None (not judged)."""
    out = {}
    for ranker in (TUNED, DEGRADED):
        kept = [v for q, v in zip(queries, values) if q.ranker == ranker and v is not None]
        out[ranker] = float(np.mean(kept)) if kept else float("nan")
    return out


def pooled(q: Query, w: list[float], p: Sequence[float | None], support: int, cap: bool,
           explicit: bool, which: str) -> float | None:
    """Debiased nDCG@10 of one query: DCG@10 of its IPW grades over its text's pooled ideal
    (None when the harvest gave no ideal: not judged)."""
    ideal = q.ideal[(support, which)]
    if ideal is None:
        return None
    value = dcg(q.results, ipw_grades(q.results, q.implicit, p, q.explicit if explicit else None)) / ideal
    return min(value, 1.0) if cap else value


def run_seed(model: str, curve: str | None, seed: int, learn: int, window: int,
             main: tuple[int, bool, bool], degrade_share: float = 1.0, react: float = 0.0,
             lean: bool = False) -> dict:
    sim = Simulator(seed=seed, run_id=f"s{seed}", click_model=model, examination=curve,
                    track_examination=True, degrade_share=degrade_share, react=react,
                    tally=False)  # the truth below is the window's own
    rules = Evaluation()
    tables = ModelTables(10, DEFAULT_CAPACITY)
    harvester = tables.pbm  # the pbm table: the rows of the list's own ideal and the pooled variants
    look = None
    window_queries: list[Query] = []
    by_text = {q.text: q for q in sim.corpus.queries}
    estimated: list[float | None] = []
    true: list[float | None] = []
    w: dict[str, list[float]] = {}
    for i in range(learn + window):
        if i % LOOK_EVERY == 0 and 0 < i <= learn:
            # A look, as the service's (every 5 s; here every LOOK_EVERY queries): both
            # models' estimates, the fit test, the model chosen.
            look = decide(tables.vector(), 10, DEFAULT_MIN_PAIRS, look)
            tables.looked(look)
        if i == learn:
            # The propensities of the window: estimated from the harvest before it (as the
            # live service refreshes them now and then), and the simulator's so far.
            estimated = tables.look.pbm.relative
            t = sim.true_examination()
            true = (t / t[0]).tolist()
            w = {"estimated": weights(estimated, 10), "true": weights(true, 10)}
        events = sim.query_events(1_700_000_000_000 + i * 500, i * 0.5)
        impression = next(e.value for e in events if e.stream == "impressions")
        query = Query(impression["ranker"], impression["results"],
                      sim.true_grades(by_text[impression["user_query"]]))
        clicked = set()
        for e in events:
            v = e.value
            if e.stream != "feedback":
                continue
            if v["action"] == "judgment":
                query.explicit[v["doc_id"]] = float(v["grade"])
                continue
            if v["action"] == "click":
                clicked.add(v["doc_id"])
            g = grade_of(v, rules)
            if g > query.implicit.get(v["doc_id"], 0.0):
                query.implicit[v["doc_id"]] = g
        # As the pipeline will: when the query closes, harvest it with its implicit grades,
        # then read its text's pooled ideal (this query included).
        text = impression["user_query"]
        tables.observe(impression["query_id"], text, impression["results"], clicked, query.implicit)
        if i >= learn:
            for support in (main[0],) if lean else SUPPORTS:
                harvester.min_support = support
                for which in ("estimated", "true"):
                    query.ideal[(support, which)] = harvester.ideal_dcg(text, w[which])
            harvester.min_support = tables.ubm.min_support = main[0]
            ideal = tables.ideal_dcg(text, 10)
            if ideal:
                weighted = tables.weights(query.results, clicked, 10)
                gains = [query.implicit.get(d, 0.0) * x for d, x in zip(first_occurrences(query.results), weighted)]
                query.exported_parts = (dcg_of(gains, 10), ideal)
                query.exported = query.exported_parts[0] / ideal
            window_queries.append(query)
    values = {
        "truth": macro(window_queries, lambda q: q.truth),
        "raw": macro(window_queries, lambda q: {**q.implicit, **q.explicit}),
        "ipw-estimated": macro(window_queries, lambda q: ipw_grades(q.results, q.implicit, estimated, q.explicit)),
        "ipw-true": macro(window_queries, lambda q: ipw_grades(q.results, q.implicit, true, q.explicit)),
    }
    wq = window_queries
    support, cap, explicit = main
    values["ipw-pooled-estimated"] = {"nDCG@10": per_ranker(wq, [q.exported for q in wq])}
    # The same series' average="micro": Σ DCG@10 / Σ pooled ideal over a ranker's queries.
    num = per_ranker(wq, [q.exported_parts and q.exported_parts[0] for q in wq])
    den = per_ranker(wq, [q.exported_parts and q.exported_parts[1] for q in wq])
    values["ipw-pooled-estimated-micro"] = {"nDCG@10": {r: num[r] / den[r] for r in num}}
    values["ipw-pooled-true"] = {"nDCG@10": per_ranker(wq, [
        pooled(q, w["true"], true, support, cap, explicit, "true") for q in wq])}
    # DCG@10 over a constant: every query counts (a query without a click scores 0).
    values["ipw-constant-estimated"] = {"nDCG@10": per_ranker(wq, [
        dcg(q.results, ipw_grades(q.results, q.implicit, estimated, q.explicit)) / CONSTANT_IDEAL for q in wq])}
    sensitivity = {}
    for v in () if lean else VARIANTS:
        support, agg, explicit = v
        per_query = [pooled(q, w["estimated"], estimated, support, agg == "cap 1", explicit, "estimated")
                     for q in wq]
        means = per_ranker(wq, per_query)
        if agg == "micro":  # Σ value·ideal / Σ ideal
            ideals = [q.ideal[(support, "estimated")] for q in wq]
            num = per_ranker(wq, [None if x is None else x * i for x, i in zip(per_query, ideals)])
            den = per_ranker(wq, ideals)
            means = {r: num[r] / den[r] for r in num}
        sensitivity[v] = (means[TUNED] - means[DEGRADED], means[TUNED],
                          float(np.mean([x is not None for x in per_query])))
    return {"gap": {row: values[row[1]][row[0]][TUNED] - values[row[1]][row[0]][DEGRADED] for row in ROWS},
            "tuned": {row: values[row[1]][row[0]][TUNED] for row in ROWS},
            "sensitivity": sensitivity, "valid": tables.look.valid, "reason": tables.look.reason,
            "model": tables.look.model, "perplexity": tables.look.perplexity, "checks": tables.look.checks,
            "ubm": tables.look.ubm.relative, "ubm_support": tables.look.ubm.support,
            "estimated": [np.nan if p is None else p for p in estimated], "true": true}


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson, JASA 1927)."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def t_interval(x: np.ndarray) -> tuple[float, float, float]:
    """Mean and its 95% Student-t interval over seeds."""
    from scipy.stats import t  # the bench's only SciPy use (installed with the test extras)
    n = len(x)
    half = t.ppf(0.975, n - 1) * x.std(ddof=1) / math.sqrt(n)
    return float(x.mean()), float(x.mean() - half), float(x.mean() + half)


def report(config: str, runs: list[dict], main: tuple[int, bool, bool]) -> str:
    lines = [f"### {config}: {len(runs)} seeds", "",
             "| measure | grades | gap tuned − degraded (95% CI) | relative gap | share of the true relative gap "
             "| share of the true gap | right order | 95% CI |",
             "|---|---|---|---|---|---|---|---|"]
    relative = {}
    truth_gap = {m: np.mean([r["gap"][(m, "truth")] for r in runs]) for m in ("nDCG@10", "DCG@10")}
    for row in ROWS:
        m, s = row
        gaps = np.array([r["gap"][row] for r in runs])
        relative[row] = gaps.mean() / np.mean([r["tuned"][row] for r in runs])
        mean, lo, hi = t_interval(gaps)
        right = int(np.sum(gaps > 0))
        wl, wh = wilson(right, len(runs))
        # Absolute share only where the values are on the truth's scale (nDCG's 0-1).
        absolute = f"{mean / truth_gap[m]:.0%}" if m == "nDCG@10" and s != "ipw-constant-estimated" else "–"
        lines.append(f"| {m} | {s} | {mean:.3f} ({lo:.3f}, {hi:.3f}) | {relative[row]:.1%} | "
                     f"{relative[row] / relative[(m, 'truth')]:.0%} | {absolute} | {right}/{len(runs)} | "
                     f"{wl:.0%}–{wh:.0%} |")
    support, cap, explicit = main
    lines += ["", f"ipw-pooled: minimum support {support} graded impressions per document, "
              f"{'capped at 1' if cap else 'not capped'}, explicit judgments "
              f"{'in' if explicit else 'not in'} the numerator; ipw-constant: DCG@10 / {CONSTANT_IDEAL:.3f} "
              "(ten grade-3 results).", "",
              "| pooled variant (estimated p; macro = mean of per-query values) | gap (95% CI) | share of the true gap | right order | 95% CI "
              "| queries judged |", "|---|---|---|---|---|---|"]
    for v in VARIANTS if runs[0]["sensitivity"] else ():
        gaps = np.array([r["sensitivity"][v][0] for r in runs])
        mean, lo, hi = t_interval(gaps)
        right = int(np.sum(gaps > 0))
        wl, wh = wilson(right, len(runs))
        judged = np.mean([r["sensitivity"][v][2] for r in runs])
        lines.append(f"| support ≥ {v[0]}, {v[1]}, "
                     f"{'explicit' if v[2] else 'implicit only'} | {mean:.3f} ({lo:.3f}, {hi:.3f}) | "
                     f"{mean / truth_gap['nDCG@10']:.0%} | {right}/{len(runs)} | {wl:.0%}–{wh:.0%} | {judged:.0%} |")
    est = np.array([r["estimated"] for r in runs])
    true = np.array([r["true"] for r in runs])
    err = est - true
    lines += ["", "| rank | " + " | ".join(str(k + 1) for k in range(est.shape[1])) + " |",
              "|---|" + "---|" * est.shape[1]]
    lines.append("| true p_k/p_1 | " + " | ".join(f"{v:.3f}" for v in true.mean(axis=0)) + " |")
    lines.append("| estimated, mean | " + " | ".join(f"{v:.3f}" for v in np.nanmean(est, axis=0)) + " |")
    cells = []
    for k in range(est.shape[1]):
        e = err[:, k][~np.isnan(err[:, k])]
        if len(e) < 2:
            cells.append("n/a")
            continue
        mean, lo, hi = t_interval(e)
        cells.append(f"{mean:+.3f} ({lo:+.3f}, {hi:+.3f})")
    lines.append("| error (95% CI) | " + " | ".join(cells) + " |")
    lines.append("| mean abs. relative error | " + " | ".join(
        f"{v:.0%}" for v in np.nanmean(np.abs(err) / true, axis=0)) + " |")
    missing = int(np.isnan(est).sum())
    if missing:
        lines.append(f"\n{missing} (seed, rank) estimates withheld for too little support.")
    return "\n".join(lines)


def summary(runs: list[dict], config: str, gap: float) -> str:
    """The configuration's last line: the exported value (pooled IPW nDCG@10, where the fit
    test kept it; average="macro") right in how many seeds, its share of the true gap, the
    seeds withdrawn; the same for its average="micro"; then raw click nDCG@10's, overall
    and in the withdrawn seeds."""
    n = len(runs)
    exported, raw, truth = (("nDCG@10", s) for s in ("ipw-pooled-estimated", "raw", "truth"))
    kept = [r for r in runs if r["valid"]]
    withdrawn = [r for r in runs if not r["valid"]]
    right = sum(r["gap"][exported] > 0 for r in kept)
    truth_gap = float(np.mean([r["gap"][truth] for r in runs]))
    share = float(np.mean([r["gap"][exported] for r in kept])) / truth_gap if kept else float("nan")
    micro = ("nDCG@10", "ipw-pooled-estimated-micro")
    micro_right = sum(r["gap"][micro] > 0 for r in kept)
    micro_share = float(np.mean([r["gap"][micro] for r in kept])) / truth_gap if kept else float("nan")
    mlo, mhi = wilson(micro_right, n)
    raw_right = sum(r["gap"][raw] > 0 for r in runs)
    raw_share = float(np.mean([r["gap"][raw] for r in runs])) / truth_gap
    lo, hi = wilson(right, n)
    rlo, rhi = wilson(raw_right, n)
    reasons = ",".join(f"{x} {sum(r['reason'] == x for r in withdrawn)}"
                       for x in sorted({r["reason"] for r in withdrawn})) or "-"
    models = ", ".join(f"{m} {sum(r['model'] == m for r in runs)}" for m in sorted({r["model"] for r in runs}))
    return (f"right={right}/{n} share={share:.2f} withdrawn={len(withdrawn)} ({config}, gap {gap:g}; "
            f"right 95% CI {lo:.0%}-{hi:.0%}; micro right={micro_right}/{n} {mlo:.0%}-{mhi:.0%} "
            f"share={micro_share:.2f}; true gap {truth_gap:.3f}; "
            f"raw right={raw_right}/{n} {rlo:.0%}-{rhi:.0%} share={raw_share:.2f}; "
            f"raw right where withdrawn={sum(r['gap'][raw] > 0 for r in withdrawn)}/{len(withdrawn)}; "
            f"reasons {reasons}; model chosen: {models})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", choices=CONFIGS,
                        help="click model/examination curve (repeatable; default all)")
    parser.add_argument("--gap", type=float, default=FULL_GAP,
                        help=f"true nDCG@10 gap between the rankers, about (at most {FULL_GAP})")
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--learn", type=int, default=6000, help="queries harvested before the window")
    parser.add_argument("--window", type=int, default=600, help="queries evaluated (and harvested)")
    parser.add_argument("--min-support", type=int, default=10, choices=SUPPORTS,
                        help="ipw-pooled rows: graded impressions a document needs to enter the ideal")
    parser.add_argument("--cap", action="store_true", help="ipw-pooled rows: cap each query's value at 1")
    parser.add_argument("--explicit", action="store_true",
                        help="ipw-pooled rows: explicit judgments in the numerator (they win)")
    parser.add_argument("--lean", action="store_true",
                        help="leave out the pooled variants' sensitivity table (a third faster)")
    args = parser.parse_args(argv)
    main = (args.min_support, args.cap, args.explicit)
    share = min(max(args.gap / FULL_GAP, 0.0), 1.0)
    for config in args.config or tuple(NAMED):
        model, curve, react = NAMED.get(config) or (*config.partition("/")[::2], 0.0)
        started = time.monotonic()
        runs = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            runs.append(run_seed(model, curve or None, seed, args.learn, args.window, main, share, react, args.lean))
            print(f"\r{config}: seed {seed} ({time.monotonic() - started:.0f} s)", end="", file=sys.stderr)
        print(file=sys.stderr)
        print(f"{report(config, runs, main)}\n\n{summary(runs, config, args.gap)}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
