"""The declared decision end to end on the real Kafka and Redis (issue 21): one experiment,
two segments. The treatment ranks better in both (more relevant documents near the top:
the primary nDCG@10 up); on desktop its users click as much as the baseline's, on mobile
far less (the guardrails Abandonment and CTR regress). Declared: nDCG@10 primary,
Abandonment (absolute margin 0.1) and CTR micro (relative margin 30%) guardrails. Exported:
`ship` on desktop, `do_not_ship` on mobile; the role label on every comparison; and
`rankmeter report --ab` prints the decision's sequences, each equal to an independent
computation (per-query values by hand, Welch with SciPy, the delta method and the
normal-mixture mSPRT from their formulas, the relative margin as T − 0.7·B)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from serving import RANKMETER, Serve, produce, unique_topics, wait_until
from test_ab import SCALE, ab_series, consumed, per_query, ratio_and_variance, welch

pytestmark = [pytest.mark.integration, pytest.mark.long]

BASE, NEW = "base", "new"
ALPHA = 0.05
DECLARED = {"RANKMETER_AB_PRIMARY": "nDCG@10 increase",
            "RANKMETER_AB_GUARDRAILS": "Abandonment 0.1,CTR micro 30%"}
K, G = 1, 2


def stream(seed: int, queries: int, start: int):
    """Every shown document judged (so clicks never change a grade); clicks by segment."""
    rnd = random.Random(seed)
    impressions, feedback, truth = [], [], []
    for q in range(queries):
        qid, ranker, segment = f"d{seed}-{q}", (NEW if q % 2 else BASE), ("desktop", "mobile")[(q // 2) % 2]
        t = start + rnd.randrange(0, 200_000)
        results = [f"doc{n}" for n in rnd.sample(range(300), 10)]
        impressions.append((qid, {"query_id": qid, "ranker": ranker, "timestamp": t, "results": results,
                                  "segment": segment}))
        relevant = 0.6 if ranker == NEW else 0.35
        click = 0.08 if (ranker, segment) == (NEW, "mobile") else 0.3
        grades, clicked = {}, []
        for rank, doc in enumerate(results):
            grades[doc] = int(rnd.random() < relevant / (1 + 0.3 * rank))
            feedback.append((qid, {"query_id": qid, "doc_id": doc, "timestamp": t + 500, "action": "judgment",
                                   "grade": grades[doc], "event_id": f"{qid}-{doc}-j"}))
            if rnd.random() < click / (1 + 0.4 * rank):
                clicked.append(doc)
                feedback.append((qid, {"query_id": qid, "doc_id": doc, "timestamp": t + 1000 + rank,
                                       "action": "click", "dwell_ms": 5_000, "event_id": f"{qid}-{doc}-c"}))
        truth.append((ranker, segment, per_query(results, grades, clicked)))
    return impressions, feedback, truth


def sequence(delta: float, v: float, tau2: float, level: float) -> tuple[float, float]:
    """The normal-mixture confidence sequence at `level`: θ̂ ± √(V(V+τ²)/τ² (2 ln(1/level) + ln((V+τ²)/V)))."""
    radius = math.sqrt(v * (v + tau2) / tau2 * (2 * math.log(1 / level) + math.log((v + tau2) / v)))
    return delta - radius, delta + radius


def expected(truth, segment: str) -> dict:
    """Per declared metric: the decisive sequences (oriented: better up; an absolute margin added)."""
    arm = {r: [m for ranker, s, m in truth if (ranker, s) == (r, segment)] for r in (BASE, NEW)}

    def macro(measure: str, r: str) -> np.ndarray:
        return np.array([num / den if den else 0.0 for num, den in (m[measure] for m in arm[r])])

    out = {}
    ship, hold, stop = ALPHA / K, ALPHA, ALPHA / (K + G)
    t, b = macro("nDCG@10", NEW), macro("nDCG@10", BASE)
    delta, _, v = welch(t, b)
    tau2 = SCALE * np.var(np.concatenate([t, b]), ddof=1)
    out["nDCG@10"] = {"ship": sequence(delta, v, tau2, ship), "stop": sequence(delta, v, tau2, stop)}
    t, b = macro("Abandonment", NEW), macro("Abandonment", BASE)
    delta, _, v = welch(t, b)
    tau2 = SCALE * np.var(np.concatenate([t, b]), ddof=1)
    flip = lambda lo_hi: (-lo_hi[1] + 0.1, -lo_hi[0] + 0.1)  # noqa: E731 (lower is better; margin 0.1)
    out["Abandonment"] = {"hold": flip(sequence(delta, v, tau2, hold)), "stop": flip(sequence(delta, v, tau2, stop))}
    y = {r: np.array([m["CTR"][0] for m in arm[r]]) for r in arm}
    z = {r: np.array([m["CTR"][1] for m in arm[r]]) for r in arm}
    (r_t, v_t), (r_b, v_b) = ratio_and_variance(y[NEW], z[NEW]), ratio_and_variance(y[BASE], z[BASE])
    n_t, n_b = len(y[NEW]), len(y[BASE])
    both = ratio_and_variance(np.concatenate([y[NEW], 0.7 * y[BASE]]), np.concatenate([z[NEW], z[BASE]]))[1]
    v = max(v_t + 0.49 * v_b, (n_t + n_b) * both * (1 / n_t + 1 / n_b))   # T − 0.7·B, the null's floor
    unscaled = ratio_and_variance(np.concatenate([y[NEW], y[BASE]]), np.concatenate([z[NEW], z[BASE]]))[1]
    tau2 = SCALE * (n_t + n_b) * unscaled
    d = r_t - 0.7 * r_b
    out["CTR"] = {"hold": sequence(d, v, tau2, hold), "stop": sequence(d, v, tau2, stop)}
    return out


def decision(want: dict) -> str:
    if want["nDCG@10"]["stop"][1] < 0 or any(want[g]["stop"][1] < 0 for g in ("Abandonment", "CTR")):
        return "do_not_ship"
    if want["nDCG@10"]["ship"][0] > 0 and all(want[g]["hold"][0] > 0 for g in ("Abandonment", "CTR")):
        return "ship"
    return "keep_running"


def test_ship_on_an_improvement_and_do_not_ship_on_a_guardrail_regression(kafka_bootstrap, redis_url,
                                                                         tmp_path: Path):
    start = int(time.time() * 1000) - 300_000
    impressions, feedback, truth = stream(21, 3000, start)
    want = {s: expected(truth, s) for s in ("desktop", "mobile")}
    assert decision(want["desktop"]) == "ship" and decision(want["mobile"]) == "do_not_ship"
    assert want["mobile"]["nDCG@10"]["ship"][0] > 0   # the primary is better on mobile too: a guardrail stops it
    arms = {(r, s): sum((ranker, seg) == (r, s) for ranker, seg, _ in truth)
            for r in (BASE, NEW) for s in ("desktop", "mobile")}

    topics = unique_topics(kafka_bootstrap)
    produce(kafka_bootstrap, topics.impressions, impressions)
    produce(kafka_bootstrap, topics.feedback, feedback)
    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    env = {"RANKMETER_AB_BASELINE": BASE, "RANKMETER_AB_UNIT": "query", "RANKMETER_AB_START": str(start),
           "RANKMETER_AB_MIXTURE_AFTER": "0s", "RANKMETER_AB_MIN_QUERIES": "1000000", **DECLARED}
    # First consumed with statistics held back, then published: the first look sees the whole
    # stream, so every sequence equals the one-look formula (no running intersection with earlier looks).
    held_back = Serve(kafka_bootstrap, redis_url, topics, group, prefix, env, log_path=tmp_path / "held.log").start()
    try:
        wait_until(lambda: consumed([held_back], {a: (n, 0) for a, n in arms.items()}), 60, "the stream to be consumed")
        assert {dict(k[1])["decision"] for k, v in ab_series(held_back).items()
                if k[0] == "rankmeter_ab_decision" and v == 1} == {"keep_running"}
    finally:
        held_back.stop()
    env["RANKMETER_AB_MIN_QUERIES"] = "100"
    serve = Serve(kafka_bootstrap, redis_url, topics, group, prefix, env, log_path=tmp_path / "serve.log").start()
    try:
        def decided() -> dict:
            return {dict(k[1])["segment"]: dict(k[1])["decision"] for k, v in ab_series(serve).items()
                    if k[0] == "rankmeter_ab_decision" and v == 1}
        wait_until(lambda: decided() == {"desktop": "ship", "mobile": "do_not_ship"}, 30, "the decisions")
        series = ab_series(serve)
    finally:
        serve.stop()
    decisions = [dict(k[1]) | {"value": v} for k, v in series.items() if k[0] == "rankmeter_ab_decision"]
    assert len(decisions) == 2 * 5 and sum(d["value"] for d in decisions) == 2
    assert {d["treatment"] for d in decisions} == {NEW}
    roles = {(dict(k[1])["metric"], dict(k[1])["average"]): dict(k[1])["role"] for k in series
             if k[0] == "rankmeter_ab_p_value"}
    assert roles.pop(("nDCG@10", "macro")) == "primary"
    assert roles.pop(("Abandonment", "macro")) == roles.pop(("CTR", "micro")) == "guardrail"
    assert set(roles.values()) == {"exploratory"} and len(roles) >= 12   # (a constant one is not compared)

    report = subprocess.run([RANKMETER, "report", "--ab", "--format", "json"], capture_output=True, text=True,
                            timeout=60, env={**serve.env, **env})
    assert report.returncode == 0, report.stderr
    got = {(d["segment"], r["metric"]): r for d in json.loads(report.stdout)["decisions"] for r in d["reasons"]}
    for segment, metrics in want.items():
        for metric, tests in metrics.items():
            r = got[(segment, metric)]
            decisive = "stop" if r["outcome"] in ("worse", "failed") else ("ship" if metric == "nDCG@10" else "hold")
            assert (r["lower"], r["upper"]) == pytest.approx(tests[decisive], rel=1e-9, abs=1e-12), (segment, metric)
    assert got[("mobile", "Abandonment")]["outcome"] == "failed" and got[("desktop", "CTR")]["outcome"] == "holds"
