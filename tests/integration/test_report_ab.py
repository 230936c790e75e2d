"""`rankmeter report --ab` on the real services: what it prints is what serve exported,
read back from Redis with serve stopped, with verdicts, and an HTML page with plots."""

from __future__ import annotations

import json
import random
import subprocess
import time
import uuid

import pytest

from serving import RANKMETER, Serve, produce, unique_topics, wait_until

pytestmark = pytest.mark.integration


def test_report_ab_prints_the_exported_statistics_and_writes_html(kafka_bootstrap, redis_url, tmp_path):
    topics = unique_topics()
    now = int(time.time() * 1000)
    rnd = random.Random(17)
    impressions, feedback = [], []
    for q in range(1200):
        qid, ranker = f"q{q}", ("base" if q % 2 else "new")
        results = [f"d{i}" for i in range(10)]
        impressions.append((qid, {"query_id": qid, "ranker": ranker, "timestamp": now, "results": results}))
        for i, doc in enumerate(results):   # "new" gets clearly more clicks near the top
            if rnd.random() < (0.35 if ranker == "new" else 0.1) / (1 + i):
                feedback.append((qid, {"query_id": qid, "action": "click", "doc_id": doc, "timestamp": now}))
    env = {"RANKMETER_AB_BASELINE": "base", "RANKMETER_AB_UNIT": "query", "RANKMETER_AB_SPLIT": "base=0.5,new=0.5",
           "RANKMETER_AB_MIN_QUERIES": "100", "RANKMETER_AB_START": str(now - 60_000),
           "RANKMETER_AB_MIXTURE_AFTER": "0s"}
    prefix = f"rm-{uuid.uuid4().hex[:6]}"
    with Serve(kafka_bootstrap, redis_url, topics, f"g-{uuid.uuid4().hex[:6]}", prefix, extra_env=env,
               log_path=tmp_path / "serve.log") as serve:
        produce(kafka_bootstrap, topics.impressions, impressions)
        produce(kafka_bootstrap, topics.feedback, feedback)
        serve.wait_for_events(len(impressions) + len(feedback))

        def looked() -> bool:
            arms = {dict(k[1])["ranker"]: v for k, v in serve.metrics().items() if k[0] == "rankmeter_ab_queries"}
            return arms == {"base": 600, "new": 600}

        wait_until(looked, 30, "a look at the whole experiment")
        exported = {(dict(k[1])["metric"], dict(k[1])["average"]): v for k, v in serve.metrics().items()
                    if k[0] == "rankmeter_ab_delta" and dict(k[1])["ranker"] == "new"}

    report = subprocess.run([RANKMETER, "report", "--ab", "--format", "json", "--html", str(tmp_path / "ab.html")],
                            capture_output=True, text=True, timeout=120,
                            env={**serve.env, **env})
    assert report.returncode == 0, report.stderr
    result = json.loads(report.stdout)
    assert {a["ranker"]: a["queries"] for a in result["arms"]} == {"base": 600, "new": 600}
    deltas = {(c["metric"], c["average"]): c["estimate"]["delta"] for c in result["comparisons"]}
    assert deltas.keys() == exported.keys()
    for key, value in exported.items():
        assert deltas[key] == pytest.approx(value, abs=1e-12), key
    verdicts = {(c["metric"], c["average"]): c["verdict"] for c in result["comparisons"]}
    # Many more clicks for "new": CTR better, abandonment lower (better); a 50/50 split holds.
    assert verdicts[("CTR", "micro")] == "better" and verdicts[("Abandonment", "macro")] == "better"
    assert result["srm"][""] > 0.05
    page = (tmp_path / "ab.html").read_text()
    assert page.count("data:image/png;base64,") >= 2 and "A/B experiment base@" in page

    table = subprocess.run([RANKMETER, "report", "--ab"], capture_output=True, text=True, timeout=120,
                           env={**serve.env, **env})
    assert table.returncode == 0 and "CTR" in table.stdout and "better" in table.stdout
