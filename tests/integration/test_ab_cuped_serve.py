"""CUPED end to end on the real Kafka and Redis (issue 21, part 2): query texts with a
persistent click propensity, shown before ab.start (the pre-period: serve builds its
covariate table, stores it in Redis and stops), then the experiment, read by a new
process, whose treatment lifts clicks. Exported: the θ-adjusted difference of Clicks
(macro) and its variance reduction, each equal to statsmodels OLS (`y ~ arm + x`, x the
text's pre-period mean computed here from the events) to 1e-9, and `ship` on the
declared primary."""

from __future__ import annotations

import hashlib
import random
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import statsmodels.api as sm

from rankmeter.ab.clusters import user_hash
from serving import Serve, produce, unique_topics, wait_until
from test_ab import ab_series

pytestmark = [pytest.mark.integration, pytest.mark.long]

BASE, NEW, TEXTS = "base", "new", 40


def stream(seed: int, pre: int, during: int, start: int, users: int = 0):
    """Texts (or, with `users`, users on one ranker each, a tenth without a pre-period query)
    with a persistent click propensity: ({phase: (impressions, feedback)}, truth per query:
    phase, ranker, where x is kept (the text, or the user's hash bucket), clicks)."""
    rnd = random.Random(seed)
    propensity = [rnd.random() for _ in range(users or TEXTS)]
    phases: dict[str, tuple[list, list]] = {"pre": ([], []), "during": ([], [])}
    truth = []
    for q in range(pre + during):
        phase = "pre" if q < pre else "during"
        if users:
            unit = rnd.randrange(users * 9 // 10) if phase == "pre" else rnd.randrange(users)
            ranker, who = (NEW if unit % 2 else BASE), {"client_id": f"user-{unit}"}
            where = user_hash(f"user-{unit}") % 65_536
        else:
            unit = where = rnd.randrange(TEXTS)
            ranker, who = (NEW if q % 2 else BASE), {"user_query": f"Text  {unit}"}  # (case and spacing folded)
        qid = f"c{seed}-{q}"
        # (the pre-period: 1 to 3 hours before the start, past the attribution window and its grace)
        t = start - 3 * 3_600_000 + rnd.randrange(2 * 3_600_000) if phase == "pre" else start + rnd.randrange(200_000)
        results = [f"doc{n}" for n in rnd.sample(range(300), 10)]
        lift = 0.05 if (phase, ranker) == ("during", NEW) else 0.0
        clicked = [d for d in results if rnd.random() < 0.4 * propensity[unit] + lift]
        impressions, feedback = phases[phase]
        impressions.append((qid, {"query_id": qid, "ranker": ranker, "timestamp": t, "results": results, **who}))
        feedback += [(qid, {"query_id": qid, "doc_id": d, "timestamp": t + 1000, "action": "click",
                            "event_id": f"{qid}-{d}"}) for d in clicked]
        truth.append((phase, ranker, where, len(clicked)))
    return phases, truth


def expected(truth) -> dict:
    """Independently: x = the text's bucket mean of Clicks before the start (65,536 buckets of
    the folded text's BLAKE2b hash), OLS of y on arm and x."""
    where = {t: int(hashlib.blake2b(f"text {t}".encode(), digest_size=8).hexdigest(), 16) % 65_536
             for t in range(TEXTS)}
    pre: dict[int, list[int]] = {}
    for phase, _, text, clicks in truth:
        if phase == "pre":
            pre.setdefault(where[text], []).append(clicks)
    pooled = float(np.mean([c for v in pre.values() for c in v]))
    rows = [(ranker == NEW, np.mean(pre.get(where[text], [pooled])), clicks)
            for phase, ranker, text, clicks in truth if phase == "during"]
    arm, x, y = (np.array(c, dtype=float) for c in zip(*rows))
    fit = sm.OLS(y, np.column_stack([np.ones_like(y), arm, x])).fit()

    def variance(v: np.ndarray) -> float:   # Welch (HC2 of v ~ arm) with the null's floor, as ab/stats.py
        welch = sm.OLS(v, np.column_stack([np.ones_like(v), arm])).fit(cov_type="HC2").bse[1] ** 2
        return max(welch, sm.OLS(v, np.ones_like(v)).fit().scale * (1 / arm.sum() + 1 / (1 - arm).sum()))

    adjusted = y - fit.params[2] * (x - x.mean())
    return {"delta": fit.params[1], "variance_reduction": 1 - variance(adjusted) / variance(y),
            "raw": y[arm == 1].mean() - y[arm == 0].mean(), "n": len(y)}



def clicks_series(serve) -> dict:
    """The Clicks macro comparison's exported series, the arms' query counts and the decision."""
    got = {}
    for (name, labels), v in ab_series(serve).items():
        d = dict(labels)
        if d.get("metric") == "Clicks" and d.get("average") == "macro":
            got[name] = v
        if name == "rankmeter_ab_queries":
            got[f"queries {d['ranker']}"] = v
        if name == "rankmeter_ab_decision" and v == 1:
            got["decision"] = d["decision"]
    return got

def test_the_exported_cuped_difference_and_variance_reduction_equal_ols(kafka_bootstrap, redis_url, tmp_path: Path):
    start = int(time.time() * 1000) - 300_000
    phases, truth = stream(33, 2000, 2000, start)
    want = expected(truth)
    assert want["variance_reduction"] > 0.2
    topics = unique_topics(kafka_bootstrap)
    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    env = {"RANKMETER_AB_BASELINE": BASE, "RANKMETER_AB_UNIT": "query", "RANKMETER_AB_START": str(start),
           "RANKMETER_AB_MIXTURE_AFTER": "0s", "RANKMETER_AB_CUPED": "true",
           "RANKMETER_AB_PRIMARY": "Clicks increase"}
    # The pre-period alone first: every pre-period event is in the table before the new
    # process reads it, once, to adjust its first enrolled query.
    impressions, feedback = phases["pre"]
    produce(kafka_bootstrap, topics.impressions, impressions)
    produce(kafka_bootstrap, topics.feedback, feedback)
    with Serve(kafka_bootstrap, redis_url, topics, group, prefix, env, log_path=tmp_path / "pre.log").start() as pre:
        pre.wait_for_events(len(impressions) + len(feedback))
        wait_until(lambda: sum(v for (n, _), v in pre.metrics().items() if n == "rankmeter_consumer_lag") == 0,
                   60, "the pre-period to be consumed")
    impressions, feedback = phases["during"]
    produce(kafka_bootstrap, topics.impressions, impressions)
    produce(kafka_bootstrap, topics.feedback, feedback)
    with Serve(kafka_bootstrap, redis_url, topics, group, prefix, env, log_path=tmp_path / "serve.log").start() as serve:
        wait_until(lambda: clicks_series(serve).get("queries new", 0) + clicks_series(serve).get("queries base", 0) == want["n"]
                   and "rankmeter_ab_variance_reduction" in clicks_series(serve), 90, "the experiment to be consumed")
        wait_until(lambda: clicks_series(serve).get("decision") == "ship", 30, "ship")
        got = clicks_series(serve)
    assert got["rankmeter_ab_delta"] == pytest.approx(want["delta"], abs=1e-9)
    assert got["rankmeter_ab_variance_reduction"] == pytest.approx(want["variance_reduction"], abs=1e-9)
    assert abs(want["delta"] - want["raw"]) > 1e-6   # (adjusted: not the raw difference)


def test_the_user_covariate_gives_the_ols_difference_end_to_end(kafka_bootstrap, redis_url, tmp_path: Path):
    """ab.cuped_covariate: user with ab.unit: user: x is the user's pre-period mean of
    Clicks (the user's hash modulo 65,536), the pooled mean for a user without one."""
    start = int(time.time() * 1000) - 300_000
    phases, truth = stream(34, 2000, 2000, start, users=200)
    pre: dict[int, list[int]] = {}
    for phase, _, where, clicks in truth:
        if phase == "pre":
            pre.setdefault(where, []).append(clicks)
    pooled = float(np.mean([c for v in pre.values() for c in v]))
    rows = [(ranker == NEW, np.mean(pre.get(where, [pooled])), clicks)
            for phase, ranker, where, clicks in truth if phase == "during"]
    arm, x, y = (np.array(c, dtype=float) for c in zip(*rows))
    delta = sm.OLS(y, np.column_stack([np.ones_like(y), arm, x])).fit().params[1]

    topics = unique_topics(kafka_bootstrap)
    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    env = {"RANKMETER_AB_BASELINE": BASE, "RANKMETER_AB_UNIT": "user", "RANKMETER_AB_START": str(start),
           "RANKMETER_AB_MIXTURE_AFTER": "0s", "RANKMETER_AB_CUPED": "true", "RANKMETER_AB_CUPED_COVARIATE": "user"}
    for phase, name in (("pre", "pre.log"), ("during", "serve.log")):
        impressions, feedback = phases[phase]
        produce(kafka_bootstrap, topics.impressions, impressions)
        produce(kafka_bootstrap, topics.feedback, feedback)
        serve = Serve(kafka_bootstrap, redis_url, topics, group, prefix, env, log_path=tmp_path / name).start()
        with serve:
            if phase == "pre":
                serve.wait_for_events(len(impressions) + len(feedback))
                wait_until(lambda: sum(v for (n, _), v in serve.metrics().items() if n == "rankmeter_consumer_lag") == 0,
                           60, "the pre-period to be consumed")
                continue

            wait_until(lambda: clicks_series(serve).get("queries new", 0) + clicks_series(serve).get("queries base", 0) == len(y)
                       and "rankmeter_ab_variance_reduction" in clicks_series(serve), 90, "the experiment to be consumed")
            got = clicks_series(serve)
    assert got["rankmeter_ab_delta"] == pytest.approx(delta, abs=1e-9)
    assert got["rankmeter_ab_variance_reduction"] > 0.2
