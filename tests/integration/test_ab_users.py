"""An experiment by user (`ab.unit: user`) on a 90/10 ramp, end to end on the real Kafka
and Redis: users with heavy-tailed activity and their own click propensity, sticky arms,
the 90/10 phase from `ab.split_since` on (the 50/50 impressions before it are in no
phase). The exported statistics against an independent computation: per-query values by
hand (tests/integration/test_ab.py, checked against pytrec_eval there), each arm's
variance statsmodels' cluster-robust one (CRV1, groups = user buckets), the null floor
over both arms' buckets, the mSPRT from its formula."""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import statsmodels.api as sm

from rankmeter.ab.clusters import BUCKETS, bucket_of
from serving import Serve, produce, unique_topics, wait_until
from test_ab import ALPHA, MEASURES, SCALE, ab_series, comparison_values, msprt, per_query, ratio_and_variance

pytestmark = [pytest.mark.integration, pytest.mark.long]

BASE, NEW = "base", "new"
# The product's own assignment of a user to a bucket (not a copy that could drift from it).
bucket = bucket_of


def user_stream(seed: int, users: int, since: int):
    """Users with lognormal activity and click propensity; each user's arm drawn once (50/50
    before `since`, 90/10 from it: a ramp re-draws the arms). Impressions before `since`
    too, and some from `since` on without a client_id."""
    rnd = random.Random(seed)
    impressions, feedback, truth = [], [], []
    for u in range(users):
        client = f"u{seed}-{u}"
        activity = max(1, int(rnd.lognormvariate(0.5, 1.0)))
        propensity = rnd.lognormvariate(0, 0.8)
        early, late = rnd.random() < 0.5, rnd.random() < 0.1   # in `new` before / from `since`
        for q in range(activity):
            qid = f"{client}-{q}"
            t = since + rnd.randrange(-200_000, 200_000)
            ranker = NEW if (late if t >= since else early) else BASE
            anonymous = t >= since and rnd.random() < 0.02
            results = [f"d{n}" for n in rnd.sample(range(300), 10)]
            event = {"query_id": qid, "ranker": ranker, "timestamp": t, "results": results}
            if not anonymous:
                event["client_id"] = client
            impressions.append((qid, event))
            grades: dict[str, int] = {}
            clicked: list[str] = []
            for rank, doc in enumerate(results):
                if rnd.random() < min(0.9, propensity * (0.25 if ranker == NEW else 0.10) / (1 + 0.4 * rank)):
                    long_click = rnd.random() < 0.3
                    grades[doc] = 2 if long_click else 1
                    clicked.append(doc)
                    feedback.append((qid, {"query_id": qid, "doc_id": doc, "timestamp": t + 1000 + rank,
                                           "action": "click", "dwell_ms": 40_000 if long_click else 5_000,
                                           "event_id": f"{qid}-{doc}"}))
            truth.append((client, anonymous, ranker, t, results, grades, clicked))
    return impressions, feedback, truth


def crv1(values: np.ndarray, weights: np.ndarray, groups: np.ndarray) -> tuple[float, float]:
    """The weighted mean and its cluster-robust variance (statsmodels WLS on a constant)."""
    fit = sm.WLS(values, np.ones(len(values)), weights=weights).fit(cov_type="cluster", cov_kwds={"groups": groups})
    return float(fit.params[0]), float(fit.bse[0] ** 2)


def expected(truth, since: int) -> dict:
    rows = {r: [row for row in truth if row[2] == r and row[3] >= since and not row[1]] for r in (BASE, NEW)}
    out = {}
    for measure in MEASURES:
        data = {}
        for r, arm in rows.items():
            pairs = [per_query(results, grades, clicked)[measure] for *_, results, grades, clicked in arm]
            num, den = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
            groups = np.array([bucket(row[0]) for row in arm])
            keep = den > 0 if measure == "FirstClickRank" else np.ones(len(arm), bool)   # undefined without a click
            data[r] = (num[keep], den[keep], groups[keep])
        for average in ("macro", "micro"):
            parts = {}
            for r, (num, den, groups) in data.items():
                if average == "macro":   # a mean of per-query values: unjudged queries count 0
                    value = np.divide(num, den, out=np.zeros(len(num)), where=den != 0)
                    parts[r] = (value, np.ones(len(value)), groups)
                else:                    # a ratio of sums: a mean of num/den weighted by den
                    used = den > 0
                    parts[r] = (num[used] / den[used], den[used], groups[used])
            (r_t, v_t), (r_b, v_b) = (crv1(*parts[r]) for r in (NEW, BASE))
            both = [np.concatenate([parts[NEW][i], parts[BASE][i]]) for i in range(3)]
            arm_of = np.concatenate([np.ones(len(parts[NEW][0])), np.zeros(len(parts[BASE][0]))])
            _, v_0 = crv1(both[0], both[1], both[2] + BUCKETS * arm_of)   # clusters: (arm, bucket)
            w_t, w_b = parts[NEW][1].sum(), parts[BASE][1].sum()
            variance = max(v_t + v_b, (w_t + w_b) * v_0 * (1 / w_t + 1 / w_b))
            if not variance > 1e-24:
                continue   # constant in both arms (R@10 micro when every relevant document was shown)
            # τ², fixed at the first look (here: the whole stream): per query, both arms as one sample.
            if average == "macro":
                unit = np.var(both[0], ddof=1)
            else:
                num = np.concatenate([data[r][0] for r in (NEW, BASE)])
                den = np.concatenate([data[r][1] for r in (NEW, BASE)])
                unit = len(num) * ratio_and_variance(num, den)[1]
            out[(measure, "", average)] = (r_t - r_b, variance, *msprt(r_t - r_b, variance, SCALE * unit))
    return out


def test_a_90_10_ramp_by_user_equals_statsmodels_cluster_robust_statistics(kafka_bootstrap, redis_url,
                                                                           tmp_path: Path):
    now = int(time.time() * 1000)
    since = now - 300_000
    start = since - 400_000
    impressions, feedback, truth = user_stream(5, 6000, since)
    enrolled = [row for row in truth if row[3] >= since and not row[1]]
    anonymous = sum(row[1] for row in truth)
    assert anonymous > 0 and sum(row[2] == NEW for row in enrolled) > 300
    want = expected(truth, since)
    assert any(p < ALPHA for _, _, p, *_ in want.values())     # something to detect

    topics = unique_topics(kafka_bootstrap)
    produce(kafka_bootstrap, topics.impressions, impressions)
    produce(kafka_bootstrap, topics.feedback, feedback)
    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    env = {"RANKMETER_AB_BASELINE": BASE, "RANKMETER_AB_UNIT": "user", "RANKMETER_AB_START": str(start),
           "RANKMETER_AB_SPLIT": f"{BASE}=0.9,{NEW}=0.1", "RANKMETER_AB_SPLIT_SINCE": str(since),
           "RANKMETER_AB_MIN_QUERIES": "1000000",   # held back: the first look with statistics sees it all
           "RANKMETER_AB_MIXTURE_AFTER": "0s"}

    def queries(serve: Serve) -> float:
        return sum(v for (n, _), v in serve.metrics().items() if n == "rankmeter_ab_queries")

    held_back = Serve(kafka_bootstrap, redis_url, topics, group, prefix, env, log_path=tmp_path / "held.log").start()
    try:
        wait_until(lambda: queries(held_back) == len(enrolled), 90, "every enrolled impression to be counted")
        metrics = held_back.metrics()
    finally:
        held_back.stop()
    assert sum(v for (n, _), v in metrics.items() if n == "rankmeter_ab_units_missing_total") == anonymous
    [info] = [dict(labels) for (n, labels), _ in metrics.items() if n == "rankmeter_ab_experiment_info"]
    assert (info["unit"], info["split"], info["since"]) == ("user", "base=0.9,new=0.1", str(since))

    serve = Serve(kafka_bootstrap, redis_url, topics, group, prefix, {**env, "RANKMETER_AB_MIN_QUERIES": "50"},
                  log_path=tmp_path / "serve.log").start()
    try:
        wait_until(lambda: len(comparison_values(ab_series(serve))) == len(want), 60, "the experiment's statistics")
        series = ab_series(serve)
    finally:
        serve.stop()
    got = comparison_values(series)
    for key, (delta, variance, p, lower, upper, tau2) in want.items():
        assert got[key]["delta"] == pytest.approx(delta, rel=1e-9, abs=1e-12), key
        assert got[key]["mixture_variance"] == pytest.approx(tau2, rel=1e-9), key
        assert got[key]["p_value"] == pytest.approx(p, rel=1e-7), key
        assert got[key]["ci_lower"] == pytest.approx(lower, rel=1e-7, abs=1e-10), key
        assert got[key]["ci_upper"] == pytest.approx(upper, rel=1e-7, abs=1e-10), key
    srm = [v for (n, _), v in series.items() if n == "rankmeter_ab_srm_p_value"]
    assert len(srm) == 1 and srm[0] >= ALPHA   # the 90/10 split by user is right
