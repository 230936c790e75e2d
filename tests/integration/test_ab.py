"""A/B experiment end to end on the real Kafka and Redis: `rankmeter serve` with an
experiment configured, its exported `rankmeter_ab_*` series against statistics computed
here from the stream alone (per-query values by hand, checked against pytrec_eval; Welch
with SciPy; the delta method, the normal-mixture mSPRT and the Dirichlet-multinomial SRM
test implemented here from their formulas, not with rankmeter.ab.stats)."""

from __future__ import annotations

import math
import random
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import pytrec_eval
from scipy import special, stats

from serving import Serve, produce, unique_topics, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.long]

BASE, NEW = "base", "new"
SEGMENTS = ("desktop", "mobile")
QUALITY = ("nDCG@10", "P@10", "AP", "RR", "R@10")    # evaluation.measures' default
ONLINE = ("CTR", "Abandonment", "Clicks", "FirstClickRank")  # always measured
MEASURES = QUALITY + ONLINE
ALPHA, SCALE = 0.05, 1e-3                           # ab.alpha's and ab.mixture_scale's defaults
SRM_CONCENTRATION = 100.0                           # the SRM test's Dirichlet prior: k·split
GRADES = {"click": 1, "long_click": 2, "add_to_cart": 2, "purchase": 3}
AB_LOOK_S = 5.0                                     # serve looks at the experiment this often
FAMILIES = ("delta", "relative_delta", "ci_lower", "ci_upper", "p_value", "mixture_variance")


# ---- the stream and what it should give ---------------------------------------------

def experiment_stream(seed: int, queries: int, now: int, start: int, new_every: tuple[int, int]):
    """Impressions of `base` and `new` in two segments, a fifth of them before `start`;
    `new` serves `new_every[0]` of every `new_every[1]` queries. Feedback: clicks (short and
    long), carts, purchases and editors' judgments (grade 0 too, and of documents never
    shown); about a quarter of the queries get none, others only non-relevant ones."""
    rnd = random.Random(seed)
    impressions, feedback, truth = [], [], []
    before = queries // 5
    for q in range(queries):
        qid = f"q{seed}-{q}"
        ranker = NEW if q % new_every[1] < new_every[0] else BASE
        segment = SEGMENTS[(q // new_every[1]) % 2]
        t = start - rnd.randrange(1, 120_000) if q < before else start + rnd.randrange(0, 240_000)
        results = [f"d{n}" for n in rnd.sample(range(300), 10)]
        impressions.append((qid, {"query_id": qid, "ranker": ranker, "timestamp": t, "results": results,
                                  "segment": segment}))
        grades: dict[str, int] = {}
        clicked: list[str] = []
        if rnd.random() > 0.25:
            for rank, doc in enumerate(results):
                chance = (0.35 if ranker == NEW else 0.25) / (1 + 0.4 * rank)
                if rnd.random() >= chance:
                    continue
                kind = rnd.choice(["click", "click", "long_click", "add_to_cart", "purchase", "judgment"])
                event = {"query_id": qid, "doc_id": doc, "timestamp": t + 1000 + rank,
                         "event_id": f"{qid}-{doc}"}
                if kind == "judgment":
                    grade = rnd.randint(0, 3)
                    event.update(action="judgment", grade=grade)
                elif kind.endswith("click"):
                    grade = GRADES[kind]
                    event.update(action="click", dwell_ms=40_000 if kind == "long_click" else 5_000)
                    clicked.append(doc)
                else:
                    grade = GRADES[kind]
                    event.update(action=kind)
                grades[doc] = grade
                feedback.append((qid, event))
            if rnd.random() < 0.15:  # an editor judges a document the ranker did not show
                doc = f"x{q}"
                grades[doc] = rnd.randint(1, 3)
                feedback.append((qid, {"query_id": qid, "doc_id": doc, "timestamp": t + 2000,
                                       "action": "judgment", "grade": grades[doc], "event_id": f"{qid}-{doc}"}))
        truth.append((qid, ranker, segment, t, results, grades, clicked))
    return impressions, feedback, truth


def per_query(results: list[str], grades: dict[str, int], clicked: list[str]) -> dict[str, tuple[float, float]]:
    """(numerator, denominator) of each measure, by hand: trec_eval's definitions for the
    quality measures; CTR = clicked / shown, Abandonment = no click, Clicks = click events,
    FirstClickRank = rank of the first clicked result (denominator 0: undefined)."""
    rel = [grades.get(d, 0) >= 1 for d in results]
    r = sum(g >= 1 for g in grades.values())
    hits = np.cumsum(rel)
    ap = sum(hits[i] / (i + 1) for i in range(len(rel)) if rel[i])
    dcg = sum(grades.get(d, 0) / math.log2(i + 2) for i, d in enumerate(results[:10]))
    ideal = sorted((g for g in grades.values() if g > 0), reverse=True)[:10]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    first = next((i for i, x in enumerate(rel) if x), None)
    return {"nDCG@10": (dcg, idcg), "P@10": (float(hits[9]), 10.0), "AP": (ap, float(r)),
            "RR": (0.0 if first is None else 1.0 / (first + 1), 1.0), "R@10": (float(hits[9]), float(r)),
            "CTR": (float(len(clicked)), float(len(results))), "Abandonment": (float(not clicked), 1.0),
            "Clicks": (float(len(clicked)), 1.0),
            "FirstClickRank": (min((results.index(d) + 1 for d in clicked), default=0.0), float(bool(clicked)))}


def check_against_pytrec_eval(truth) -> None:
    qrels = {qid: {d: g for d, g in grades.items()} for qid, _, _, _, _, grades, _ in truth if grades}
    run = {qid: {d: float(100 - i) for i, d in enumerate(results)} for qid, _, _, _, results, _, _ in truth}
    names = {"nDCG@10": "ndcg_cut_10", "P@10": "P_10", "AP": "map", "RR": "recip_rank", "R@10": "recall_10"}
    got = pytrec_eval.RelevanceEvaluator(qrels, set(names.values()), relevance_level=1).evaluate(run)
    for qid, _, _, _, results, grades, clicked in truth:
        for measure in QUALITY:
            num, den = per_query(results, grades, clicked)[measure]
            value = num / den if den else 0.0
            assert value == pytest.approx(got.get(qid, {}).get(names[measure], 0.0), abs=1e-12), (qid, measure)


class ArmData:
    def __init__(self, rows) -> None:
        self.queries = len(rows)
        self.judged = sum(any(g >= 1 for g in grades.values()) for *_, grades, _ in rows)
        ratios = [per_query(results, grades, clicked) for *_, results, grades, clicked in rows]
        self.num = {m: np.array([x[m][0] for x in ratios]) for m in MEASURES}
        self.den = {m: np.array([x[m][1] for x in ratios]) for m in MEASURES}
        # unjudged queries (den 0) count as 0, trec_eval's convention
        self.value = {m: np.divide(self.num[m], self.den[m], out=np.zeros(len(rows)), where=self.den[m] != 0)
                      for m in MEASURES}
        # ... except for the first click's rank, undefined without a click: such queries are left out
        has = self.den["FirstClickRank"] > 0
        for d in (self.num, self.den, self.value):
            d["FirstClickRank"] = d["FirstClickRank"][has]


def arms(truth, start: int) -> dict[tuple[str, str], ArmData]:
    return {(ranker, segment): ArmData([row for row in truth if row[1] == ranker and row[2] == segment
                                        and row[3] >= start])
            for ranker in (BASE, NEW) for segment in SEGMENTS}


def welch(t: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """The difference of means; its variance the larger of Welch's and the pooled one (both
    arms one sample: the null's), as ab/stats.py takes it."""
    delta = float(t.mean() - b.mean())
    v = float(stats.sem(t) ** 2 + stats.sem(b) ** 2)
    assert delta / math.sqrt(v) == pytest.approx(stats.ttest_ind(t, b, equal_var=False).statistic, rel=1e-9)
    pooled = float(np.var(np.concatenate([t, b]), ddof=1) * (1 / len(t) + 1 / len(b)))
    return delta, delta / float(b.mean()), max(v, pooled)


def ratio_and_variance(y: np.ndarray, z: np.ndarray) -> tuple[float, float]:
    """Σy/Σz and its delta-method variance (Deng, Knoblich & Lu 2018)."""
    r = y.sum() / z.sum()
    cov = np.cov(np.vstack([y, z]), ddof=1)
    return float(r), float((cov[0, 0] - 2 * r * cov[0, 1] + r * r * cov[1, 1]) / (len(y) * z.mean() ** 2))


def msprt(delta: float, v: float, tau2: float) -> tuple[float, float, float, float]:
    """Λ = √(V/(V+τ²))·exp(τ²θ̂²/(2V(V+τ²))); p = min(1, 1/Λ);
    CS θ̂ ± √(V(V+τ²)/τ² · (2 ln(1/α) + ln((V+τ²)/V))); and τ² itself."""
    log_lambda = 0.5 * math.log(v / (v + tau2)) + tau2 * delta ** 2 / (2 * v * (v + tau2))
    p = min(1.0, math.exp(-log_lambda))
    radius = math.sqrt(v * (v + tau2) / tau2 * (2 * math.log(1 / ALPHA) + math.log((v + tau2) / v)))
    return p, delta - radius, delta + radius, tau2


def srm_p(counts: list[float], split: list[float]) -> float:
    """min(1, 1/BF), BF = Dirichlet-multinomial over multinomial likelihood (Lindon & Malek)."""
    theta = np.array(split) / sum(split)
    x, a = np.array(counts, dtype=float), SRM_CONCENTRATION * theta
    log_bf = (special.gammaln(a + x).sum() - special.gammaln((a + x).sum())
              - special.gammaln(a).sum() + special.gammaln(a.sum()) - (x * np.log(theta)).sum())
    return float(min(1.0, math.exp(-log_bf)))


def expected(truth, start: int, split: dict[str, float], tau2: float | None = None) -> dict:
    """Final-look statistics per (metric, segment, average) and the arms and SRM per segment.
    τ²: `tau2`, else per metric (ab.mixture_scale times the per-query variance of both arms
    as one sample; of the pooled ratio's linearisation for micro), as a first look at the
    whole stream fixes it."""
    data = arms(truth, start)
    out = {"comparisons": {}, "arms": {}, "srm": {}}
    for segment in SEGMENTS:
        t, b = data[(NEW, segment)], data[(BASE, segment)]
        for measure in MEASURES:
            delta, relative, v = welch(t.value[measure], b.value[measure])
            pooled = np.var(np.concatenate([t.value[measure], b.value[measure]]), ddof=1)
            out["comparisons"][(measure, segment, "macro")] = (delta, relative, v,
                                                               *msprt(delta, v, tau2 or SCALE * pooled))
            (r_t, v_t), (r_b, v_b) = (ratio_and_variance(a.num[measure], a.den[measure]) for a in (t, b))
            n_t, n_b = len(t.num[measure]), len(b.num[measure])
            both = ratio_and_variance(np.concatenate([t.num[measure], b.num[measure]]),
                                      np.concatenate([t.den[measure], b.den[measure]]))[1]
            v = max(v_t + v_b, (n_t + n_b) * both * (1 / n_t + 1 / n_b))
            delta = r_t - r_b
            out["comparisons"][(measure, segment, "micro")] = (delta, delta / r_b, v,
                                                               *msprt(delta, v, tau2 or SCALE * (n_t + n_b) * both))
        for ranker, arm in ((BASE, b), (NEW, t)):
            out["arms"][(ranker, segment)] = (arm.queries, arm.judged / arm.queries)
        out["srm"][segment] = srm_p([data[(r, segment)].queries for r in split], list(split.values()))
    return out


# ---- what serve exports ----------------------------------------------------------------

def ab_series(serve: Serve) -> dict:
    """The experiment's series (partition 0's holder's), not the counters every replica
    keeps of its own: running statistics it found lost, impressions without a user."""
    own = ("rankmeter_ab_running_lost_total", "rankmeter_ab_units_missing_total")
    return {k: v for k, v in serve.metrics().items() if k[0].startswith("rankmeter_ab_") and k[0] not in own}


def comparison_values(series: dict) -> dict:
    """(metric, segment, average) -> {family: value}"""
    out: dict = {}
    for (name, labels), value in series.items():
        family = name[len("rankmeter_ab_"):]
        if family in FAMILIES:
            d = dict(labels)
            assert (d["ranker"], d["baseline"]) == (NEW, BASE), d
            out.setdefault((d["metric"], d["segment"], d["average"]), {})[family] = value
    return out


def arm_values(series: dict) -> dict:
    out: dict = {}
    for (name, labels), value in series.items():
        d = dict(labels)
        if name in ("rankmeter_ab_queries", "rankmeter_ab_judged_share"):
            assert d["baseline"] == BASE
            out.setdefault((d["ranker"], d["segment"]), {})[name[len("rankmeter_ab_"):]] = value
    return out


def srm_values(series: dict) -> dict:
    return {dict(labels)["segment"]: v for (name, labels), v in series.items() if name == "rankmeter_ab_srm_p_value"}


def consumed(replicas: list[Serve], arms_expected: dict) -> bool:
    """Every partition caught up on both topics, and the arms' sizes as expected."""
    metrics = [r.metrics() for r in replicas]
    lags = [v for m in metrics for (name, _), v in m.items() if name == "rankmeter_consumer_lag"]
    if len(lags) != 8 or sum(lags):
        return False
    for m in metrics:
        got = arm_values({k: v for k, v in m.items() if k[0].startswith("rankmeter_ab_")})
        if got and all(got.get(a, {}).get("queries") == n for a, (n, _) in arms_expected.items()):
            return True
    return False


def settled(replicas: list[Serve], arms_expected: dict) -> None:
    """Wait for the stream to be consumed, then for one more look at the experiment."""
    wait_until(lambda: consumed(replicas, arms_expected), 90, "the stream to be consumed")
    time.sleep(AB_LOOK_S + 0.5)


def check_exact_quantities(series: dict, want: dict) -> dict:
    """Delta, relative delta, arm sizes and judged shares are functions of the current sums
    alone: equal to the final look's. Returns the exported comparisons."""
    got = comparison_values(series)
    assert set(got) == set(want["comparisons"]), sorted(set(got) ^ set(want["comparisons"]))
    for key, (delta, relative, *_) in want["comparisons"].items():
        assert set(got[key]) == set(FAMILIES), key
        assert got[key]["delta"] == pytest.approx(delta, rel=1e-9, abs=1e-12), key
        assert got[key]["relative_delta"] == pytest.approx(relative, rel=1e-9, abs=1e-12), key
    arms_got = arm_values(series)
    assert set(arms_got) == set(want["arms"])
    for key, (queries, share) in want["arms"].items():
        assert arms_got[key]["queries"] == queries, key
        assert arms_got[key]["judged_share"] == pytest.approx(share, rel=1e-12), key
    return got


# ---- the tests -------------------------------------------------------------------------

def test_ab_series_equal_an_independent_computation_and_survive_a_restart(kafka_bootstrap, redis_url,
                                                                         tmp_path: Path):
    """Balanced 50/50. First a run that consumes the stream with statistics held back
    (min_queries unreachable), then one that publishes them: its first look sees the full
    stream, so p-value and confidence sequence equal the final look's exactly (there are
    no earlier looks to take a minimum or intersection with). Then a restart: the same."""
    now = int(time.time() * 1000)
    start = now - 300_000
    impressions, feedback, truth = experiment_stream(31, 3000, now, start, new_every=(1, 2))
    check_against_pytrec_eval(truth)
    split = {BASE: 0.5, NEW: 0.5}
    want = expected(truth, start, split)
    assert min(n for n, _ in want["arms"].values()) >= 250
    assert all(share < 0.9 for _, share in want["arms"].values())  # many queries with nothing relevant
    assert any(c[3] < ALPHA for c in want["comparisons"].values())     # something to detect ...
    assert any(c[3] == 1.0 for c in want["comparisons"].values())      # ... and something not

    topics = unique_topics(kafka_bootstrap)
    produce(kafka_bootstrap, topics.impressions, impressions)
    produce(kafka_bootstrap, topics.feedback, feedback)
    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    env = {"RANKMETER_AB_BASELINE": BASE, "RANKMETER_AB_UNIT": "query", "RANKMETER_AB_SPLIT": f"{BASE}=0.5,{NEW}=0.5",
           "RANKMETER_AB_START": str(start), "RANKMETER_AB_MIN_QUERIES": "50",
           "RANKMETER_AB_MIXTURE_AFTER": "0s"}  # (the first look with statistics sees every click)

    held_back = Serve(kafka_bootstrap, redis_url, topics, group, prefix,
                      {**env, "RANKMETER_AB_MIN_QUERIES": "1000000"}, log_path=tmp_path / "held.log").start()
    try:
        wait_until(lambda: consumed([held_back], want["arms"]), 90, "the stream to be consumed")
        series = ab_series(held_back)
        assert not comparison_values(series) and not srm_values(series)  # arms only, below min_queries
    finally:
        held_back.stop()

    runs = []
    for name in ("first", "restarted"):
        serve = Serve(kafka_bootstrap, redis_url, topics, group, prefix, env, log_path=tmp_path / f"{name}.log").start()
        try:
            try:
                wait_until(lambda: len(comparison_values(ab_series(serve))) == len(want["comparisons"]), 60,
                           "the experiment's statistics")
            except TimeoutError:
                log = (tmp_path / f"{name}.log").read_text()[-3000:]
                pytest.fail(f"{name}: no statistics; exported {sorted(arm_values(ab_series(serve)).items())}\n{log}")
            runs.append(ab_series(serve))
        finally:
            serve.stop()

    got = check_exact_quantities(runs[0], want)
    for key, (delta, _, _, p, lower, upper, tau2) in want["comparisons"].items():
        assert got[key]["mixture_variance"] == pytest.approx(tau2, rel=1e-9), key   # τ² per metric
        assert got[key]["p_value"] == pytest.approx(p, rel=1e-9), key
        assert got[key]["ci_lower"] == pytest.approx(lower, rel=1e-9, abs=1e-12), key
        assert got[key]["ci_upper"] == pytest.approx(upper, rel=1e-9, abs=1e-12), key
    srm = srm_values(runs[0])
    assert srm.keys() == set(SEGMENTS)
    for segment in SEGMENTS:
        assert srm[segment] == pytest.approx(want["srm"][segment], rel=1e-9)
        assert srm[segment] >= ALPHA  # the configured split is right
    assert runs[1] == runs[0]         # persisted: running minimum and intersection included


def test_skewed_split_fires_srm_and_only_the_replica_with_partition_0_exports(kafka_bootstrap, redis_url,
                                                                              tmp_path: Path):
    """60/40 traffic against a configured 50/50, looked at while the stream is consumed by
    two replicas. The p-value and confidence sequence are then a running minimum and
    intersection over looks made along the way: the exported p is at most the final
    look's, the sequence lies within the final look's interval."""
    now = int(time.time() * 1000)
    start = now - 300_000
    impressions, feedback, truth = experiment_stream(47, 3000, now, start, new_every=(2, 5))
    split = {BASE: 0.5, NEW: 0.5}
    # One τ² for every metric: looks along the way would fix a per-metric one on partial data.
    want = expected(truth, start, split, tau2=1e-4)
    assert all(p < 1e-6 for p in want["srm"].values())

    topics = unique_topics(kafka_bootstrap)
    produce(kafka_bootstrap, topics.impressions, impressions)
    produce(kafka_bootstrap, topics.feedback, feedback)
    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    env = {"RANKMETER_AB_BASELINE": BASE, "RANKMETER_AB_UNIT": "query", "RANKMETER_AB_SPLIT": f"{BASE}=0.5,{NEW}=0.5",
           "RANKMETER_AB_START": str(start), "RANKMETER_AB_MIN_QUERIES": "50", "RANKMETER_AB_MIXTURE_VARIANCE": "1e-4",
           "RANKMETER_KAFKA_MAX_POLL_RECORDS": "200"}  # many batches: many looks along the way
    replicas = [Serve(kafka_bootstrap, redis_url, topics, group, prefix, env,
                      log_path=tmp_path / f"replica-{i}.log").start() for i in range(2)]
    try:
        def split_between_them() -> bool:
            held = [v for r in replicas for (n, _), v in r.metrics().items() if n == "rankmeter_assigned_partitions"]
            return held == [2, 2]
        wait_until(split_between_them, 60, "two replicas to share the partitions")
        settled(replicas, want["arms"])
        wait_until(lambda: sum(bool(ab_series(r)) for r in replicas) == 1, 2 * AB_LOOK_S + 2,
                   "only the replica with partition 0 to export the experiment")
        series = [ab_series(r) for r in replicas]
    finally:
        for r in replicas:
            r.stop()

    exporting = [s for s in series if s]
    assert len(exporting) == 1
    got = check_exact_quantities(exporting[0], want)
    for key, (delta, _, _, p, lower, upper, _) in want["comparisons"].items():
        assert got[key]["mixture_variance"] == 1e-4, key
        assert 0 < got[key]["p_value"] <= p * (1 + 1e-9), key
        assert lower - 1e-12 <= got[key]["ci_lower"] <= got[key]["ci_upper"] <= upper + 1e-12, key
    srm = srm_values(exporting[0])
    assert srm.keys() == set(SEGMENTS)
    for segment in SEGMENTS:
        assert srm[segment] <= want["srm"][segment] * (1 + 1e-9)
        assert srm[segment] < ALPHA  # the experiment cannot be trusted
