"""A ramp on a running service (review of issue 20, F6): serve runs a 50/50 experiment, is
restarted with `ab.split` 90/10 from `ab.split_since` (the config-change path: a new
process reading the same Redis and consumer group). The new phase is a new experiment:
its sums hold only the queries shown from `ab.split_since` on, none of the first phase's
(nor those shown before it and read after the restart),
and the first phase's stay stored, read by `rankmeter report --ab` with its settings."""

from __future__ import annotations

import json
import random
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from serving import RANKMETER, Serve, produce, unique_topics, wait_until

pytestmark = [pytest.mark.integration]

BASE, NEW = "base", "new"


def traffic(rnd: random.Random, n: int, since: int, until: int, share_new: float, tag: str):
    impressions, feedback, arms = [], [], Counter()
    for i in range(n):
        qid, t = f"{tag}-{i}", rnd.randrange(since, until)
        ranker = NEW if rnd.random() < share_new else BASE
        arms[ranker] += 1
        results = [f"d{k}" for k in rnd.sample(range(100), 10)]
        impressions.append((qid, {"query_id": qid, "ranker": ranker, "timestamp": t, "results": results}))
        if rnd.random() < 0.5:
            feedback.append((qid, {"query_id": qid, "doc_id": results[0], "timestamp": t + 500, "action": "click",
                                   "event_id": f"{qid}-c"}))
    return impressions, feedback, arms


def arm_queries(serve: Serve) -> tuple[dict[str, float], dict[str, str]]:
    metrics = serve.metrics()
    queries = {dict(labels)["ranker"]: v for (n, labels), v in metrics.items() if n == "rankmeter_ab_queries"}
    info = [dict(labels) for (n, labels), _ in metrics.items() if n == "rankmeter_ab_experiment_info"]
    return queries, (info[0] if len(info) == 1 else {})


def test_a_ramp_on_a_running_service_starts_a_new_phase_and_keeps_the_old_one(kafka_bootstrap, redis_url,
                                                                               tmp_path: Path):
    rnd = random.Random(20)
    now = int(time.time() * 1000)
    start, ramp = now - 600_000, now - 300_000
    first = traffic(rnd, 400, start, ramp, 0.5, "p1")
    second = traffic(rnd, 500, ramp, now, 0.1, "p2")
    late = traffic(rnd, 60, start, ramp, 0.5, "late")  # shown before the ramp, read after the restart
    topics = unique_topics(kafka_bootstrap)
    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    common = {"RANKMETER_AB_BASELINE": BASE, "RANKMETER_AB_UNIT": "query", "RANKMETER_AB_START": str(start),
              "RANKMETER_AB_MIXTURE_AFTER": "0s"}
    fifty = {**common, "RANKMETER_AB_SPLIT": f"{BASE}=0.5,{NEW}=0.5"}
    ninety = {**common, "RANKMETER_AB_SPLIT": f"{BASE}=0.9,{NEW}=0.1", "RANKMETER_AB_SPLIT_SINCE": str(ramp)}

    with Serve(kafka_bootstrap, redis_url, topics, group, prefix, fifty, log_path=tmp_path / "fifty.log").start() as serve:
        produce(kafka_bootstrap, topics.impressions, first[0])
        produce(kafka_bootstrap, topics.feedback, first[1])
        wait_until(lambda: arm_queries(serve)[0] == dict(first[2]), 90, "the first phase's queries")
        old = arm_queries(serve)[1]
    assert old["split"] == f"{BASE}=0.5,{NEW}=0.5"

    # The ramp: the same Redis and group, a new process with the new split, then the new traffic.
    with Serve(kafka_bootstrap, redis_url, topics, group, prefix, ninety, log_path=tmp_path / "ninety.log",
               ).start(create_topics=None) as serve:
        produce(kafka_bootstrap, topics.impressions, late[0] + second[0])
        produce(kafka_bootstrap, topics.feedback, late[1] + second[1])
        serve.wait_for_events(len(late[0] + late[1] + second[0] + second[1]))  # this process's: all read
        wait_until(lambda: arm_queries(serve)[0] == dict(second[2]), 90, "the second phase's queries, alone")
        new = arm_queries(serve)[1]
    assert (new["split"], new["since"]) == (f"{BASE}=0.9,{NEW}=0.1", str(ramp))
    assert new["experiment"] != old["experiment"]

    # The first phase is still stored: read with its own settings, its counts are unchanged.
    report = subprocess.run([RANKMETER, "report", "--ab", "--format", "json"], capture_output=True, text=True,
                            timeout=60, env={**{k: v for k, v in serve.env.items() if k not in ninety}, **fifty})
    assert report.returncode == 0, report.stderr
    got = json.loads(report.stdout)
    assert got["experiment"] == old["experiment"]
    assert {a["ranker"]: a["queries"] for a in got["arms"]} == dict(first[2])
