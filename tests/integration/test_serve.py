"""`rankmeter serve` end to end on the real Kafka and Redis: aggregates against trec_eval,
a mixed stream's outcome counts and values, and the output's Prometheus hygiene."""

from __future__ import annotations

import json
import math
import random
import subprocess
import time
import uuid
from statistics import fmean

import pytest
import pytrec_eval
from kafka import KafkaConsumer

from rankmeter.trec import rank

from serving import RANKMETER, Serve, produce, quality, unique_topics, wait_until

pytestmark = pytest.mark.integration


def random_collection(seed: int, queries: int):
    """Runs from two rankers over shared qrels: graded 0..3, ties, judged documents that
    were never shown, and some queries with no relevant document at all."""
    rnd = random.Random(seed)
    qrels, runs = {}, {"bm25-a": {}, "bm25-b": {}}
    for q in range(queries):
        qid = f"q{seed}-{q}"
        pool = [f"d{rnd.randrange(60)}" for _ in range(30)]
        no_relevant = q % 7 == 0
        qrels[qid] = {d: (0 if no_relevant else rnd.choice([0, 0, 1, 2, 3])) for d in pool[:15]}
        ranker = "bm25-a" if q % 2 else "bm25-b"
        shown = list(dict.fromkeys(pool[3:] + [f"x{rnd.randrange(100)}" for _ in range(5)]))
        runs[ranker][qid] = {d: float(rnd.randrange(10)) for d in shown}
    return qrels, runs


def test_macro_quality_per_ranker_equals_trec_eval(kafka_bootstrap, redis_url, kafka_backend, tmp_path):
    qrels, runs = random_collection(seed=11, queries=240)
    topics = unique_topics()
    now = int(time.time() * 1000)
    impressions, judgments = [], []
    for ranker, run in runs.items():
        for qid, scores in run.items():
            impressions.append((qid, {"query_id": qid, "ranker": ranker, "timestamp": now,
                                      "results": rank(scores)}))
            judgments += [(qid, {"query_id": qid, "action": "judgment", "doc_id": d, "grade": g,
                                 "timestamp": now + 1}) for d, g in qrels[qid].items()]
    random.Random(3).shuffle(judgments)  # much feedback arrives before its impression
    prefix = f"rm-{uuid.uuid4().hex[:6]}"
    with Serve(kafka_bootstrap, redis_url, topics, f"g-{uuid.uuid4().hex[:6]}", prefix, kafka_backend,
               log_path=tmp_path / "serve.log") as serve:
        produce(kafka_bootstrap, topics.feedback, judgments)
        produce(kafka_bootstrap, topics.impressions, impressions)
        events = serve.wait_for_events(len(impressions) + len(judgments))  # each counted once
        metrics = serve.metrics()

    assert events[("impressions", "applied")] == len(impressions)
    assert events[("feedback", "applied")] == len(judgments)  # every one, pending or not
    for ranker, run in runs.items():
        per_query = pytrec_eval.RelevanceEvaluator(
            {q: qrels[q] for q in run}, {"ndcg_cut.10", "P.10", "map", "recip_rank", "recall.10"}
        ).evaluate(run)
        # Default policy `skip`: quality averages over queries with a relevant document.
        judged = [q for q in run if any(g >= 1 for g in qrels[q].values())]
        assert 0 < len(judged) < len(run)
        for ours, theirs in [("nDCG@10", "ndcg_cut_10"), ("P@10", "P_10"), ("AP", "map"),
                             ("RR", "recip_rank"), ("R@10", "recall_10")]:
            expected = fmean(per_query[q][theirs] for q in judged)
            for window in ("5m", "15m", "1h", "24h"):
                assert quality(metrics, ours, ranker, window) == pytest.approx(expected, abs=1e-9), (ours, ranker)
        queries = {dict(k[1])["population"]: v for k, v in metrics.items()
                   if k[0] == "rankmeter_queries" and dict(k[1])["ranker"] == ranker
                   and dict(k[1])["window"] == "1h"}
        assert queries == {"all": len(run), "judged": len(judged)}
        # Micro P@10 equals macro; micro R@10 is Σ relevant in top 10 / Σ R.
        assert quality(metrics, "P@10", ranker, average="micro") == pytest.approx(
            quality(metrics, "P@10", ranker), abs=1e-12)
        hits = sum(sum(1 for d in rank(run[q])[:10] if qrels[q].get(d, 0) >= 1) for q in judged)
        relevant = sum(sum(1 for g in qrels[q].values() if g >= 1) for q in judged)
        assert quality(metrics, "R@10", ranker, average="micro") == pytest.approx(hits / relevant, abs=1e-12)

    # `rankmeter report` reads the same aggregates back from Redis, with serve stopped.
    out = subprocess.run([RANKMETER, "report", "--format", "json", "--window", "1h"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "RANKMETER_REDIS_URL": redis_url,
                              "RANKMETER_REDIS_KEY_PREFIX": prefix}, timeout=60)
    assert out.returncode == 0, out.stderr
    reported = {v["ranker"]: v for v in json.loads(out.stdout)}
    assert set(reported) == set(runs)
    for ranker in runs:
        s = reported[ranker]["sums"]["nDCG@10"]
        assert s["value_sum"] / s["count"] == pytest.approx(quality(metrics, "nDCG@10", ranker, "1h"), abs=1e-12)


def ts(now_ms: int, minutes: float = 0) -> int:
    return int(now_ms + minutes * 60_000)


def test_mixed_stream_counts_and_values(kafka_bootstrap, redis_url, kafka_backend, tmp_path):
    topics = unique_topics()
    now = int(time.time() * 1000)
    imp = lambda q, results, ranker="r1", t=now, **kw: (q, {"query_id": q, "ranker": ranker, "timestamp": t, "results": results, **kw})
    fb = lambda q, action, doc, t=now, **kw: (q, {"query_id": q, "action": action, "doc_id": doc, "timestamp": t, **kw})
    impressions = [
        imp("q1", ["a", "b", "c", "d"]),
        imp("q1", ["a", "b", "c", "d"]),                 # duplicate
        imp("q1", ["d", "c"]),                           # conflict: the first wins
        imp("q2", ["x", "y", "x", "z"]),                 # repeated id: first occurrence kept
        imp("q3", ["m", "n"], t=ts(now, -50)),           # old enough for late feedback
        imp("q7", ["a"], ranker="r3", t=ts(now, 30)),    # from a fast clock: in no window before its time
        ("q4", {"query_id": "q4", "timestamp": now, "client_id": "c1", "application": "shop",
                "query_attributes": {"ranker": "r2"}, "query_response_hit_ids": ["u", "v", "w"]}),  # UBI query
        ("bad", b"\xff\xfe not json"),                   # invalid: not UTF-8 JSON
        ("bad", {"query_id": "q9", "ranker": "r1", "timestamp": now}),                           # invalid: no results
        ("bad", {"query_id": "q9", "ranker": "r1", "timestamp": now, "results": "a b"}),         # invalid: wrong type
        ("bad", {"query_id": "q9", "ranker": "r1", "timestamp": now, "results": ["z"] * 1001}),  # invalid: too long
        ("bad", {"query_id": "q9", "ranker": "r1", "timestamp": "1999-01-01T00:00:00Z", "results": ["z"]}),  # invalid: absurd time
    ]
    feedback = [
        fb("q5", "click", "k"),                          # pending: its impression comes later
        fb("q1", "click", "b", event_id="e1"),
        fb("q1", "click", "b", event_id="e1"),           # duplicate (same event_id)
        fb("q1", "purchase", "c", position=7),           # the impression's rank wins over position
        fb("q1", "click", "zz"),                         # unmatched: not shown
        fb("q1", "judgment", "unshown", grade=3),        # applied: counts towards R and ideal DCG
        fb("q2", "click", "y", dwell_ms=45_000),         # long dwell: grade 2
        fb("q3", "click", "m", t=ts(now, -5)),           # late: 45 min after its impression
        fb("q2", "view", "y"),                           # ignored: not in the grade map
        ("q4", {"action_name": "click", "query_id": "q4", "timestamp": now, "message_id": "ubi-1",
                "event_attributes": {"object": {"object_id": "v"}, "position": {"ordinal": 2}}}),  # UBI event
        fb("q6", "judgment", "a", grade=-1),             # invalid: negative grade
        fb("q6", "click", "a", position=0),              # invalid: position < 1
        ("q6", b'{"query_id": "q6", "action": "click"}'),  # invalid: no doc_id, no timestamp
    ]
    late_impression = [imp("q5", ["k", "l"])]
    with Serve(kafka_bootstrap, redis_url, topics, f"g-{uuid.uuid4().hex[:6]}",
               f"rm-{uuid.uuid4().hex[:6]}", kafka_backend, log_path=tmp_path / "serve.log") as serve:
        produce(kafka_bootstrap, topics.impressions, impressions)
        produce(kafka_bootstrap, topics.feedback, feedback)
        serve.wait_for_events(len(impressions) + len(feedback) - 1)  # q5's click waits, uncounted
        produce(kafka_bootstrap, topics.impressions, late_impression)
        events = serve.wait_for_events(len(impressions) + len(feedback) + 1)  # + q5's impression
        metrics = serve.metrics()
        text = serve.metrics_text()

    assert events == {
        ("impressions", "applied"): 6, ("impressions", "duplicate"): 1, ("impressions", "conflict"): 1,
        ("impressions", "invalid"): 5,
        ("feedback", "applied"): 6, ("feedback", "duplicate"): 1,
        ("feedback", "unmatched"): 1, ("feedback", "late"): 1, ("feedback", "ignored"): 1,
        ("feedback", "invalid"): 3,
    }
    # r1: q1 grades a0 b1 c3 d0 (+ unshown 3): P@10 = 2/10; q2 (x, y, z): y = 2 -> 1/10;
    # q5 (k, l): k = 1 -> 1/10; q3 has no relevant document (its click was late).
    assert quality(metrics, "P@10", "r1") == pytest.approx((0.2 + 0.1 + 0.1) / 3)
    assert quality(metrics, "RR", "r1") == pytest.approx((1 / 2 + 1 / 2 + 1) / 3)
    # q1: DCG = 1/log2 3 + 3/2; IDCG over all known grades (3, 3, 1) = 3 + 3/log2 3 + 1/2.
    ndcg_q1 = (1 / math.log2(3) + 3 / 2) / (3 + 3 / math.log2(3) + 1 / 2)
    ndcg_q2 = (2 / math.log2(3)) / 2
    ndcg_q5 = 1.0
    assert quality(metrics, "nDCG@10", "r1") == pytest.approx((ndcg_q1 + ndcg_q2 + ndcg_q5) / 3)
    # CTR over all queries of r1: clicked shown results / shown results. q3's impression
    # is 50 minutes old: in the 1h window, not in the 5m one.
    assert quality(metrics, "CTR", "r1", "1h", "micro") == pytest.approx((1 + 1 + 0 + 1) / (4 + 3 + 2 + 2))
    assert quality(metrics, "CTR", "r1", "5m", "micro") == pytest.approx((1 + 1 + 1) / (4 + 3 + 2))
    assert quality(metrics, "Abandonment", "r1", "1h") == pytest.approx(1 / 4)  # q3 only
    assert quality(metrics, "Abandonment", "r1", "5m") == 0
    # The per-query distribution: a bucket le=e counts the values <= e (r1's P@10: 0.2, 0.1, 0.1).
    buckets = {dict(k[1])["le"]: v for k, v in metrics.items() if k[0] == "rankmeter_query_quality_bucket"
               and dict(k[1])["metric"] == "P@10" and dict(k[1])["ranker"] == "r1" and dict(k[1])["window"] == "1h"}
    assert (buckets["0.1"], buckets["0.2"], buckets["+Inf"]) == (2, 3, 3)
    # Windows end now: the impression stamped 30 minutes ahead is in none of them yet.
    r3 = {dict(k[1])["window"]: v for k, v in metrics.items()
          if k[0] == "rankmeter_queries" and dict(k[1])["ranker"] == "r3" and dict(k[1])["population"] == "all"}
    assert r3 == {"5m": 0, "15m": 0, "1h": 0, "24h": 0}
    # The UBI records joined: r2's q4 had its second result clicked.
    assert quality(metrics, "RR", "r2") == pytest.approx(1 / 2)
    assert quality(metrics, "FirstClickRank", "r2") == 2

    dead = KafkaConsumer(topics.dead_letter, bootstrap_servers=kafka_bootstrap,
                         auto_offset_reset="earliest", consumer_timeout_ms=10_000)
    letters = [m for m in dead][:8]
    dead.close()
    assert len(letters) == 8
    reasons = sorted(dict(m.headers)["rankmeter.reason"].decode() for m in letters)
    assert any("not UTF-8 JSON" in r for r in reasons)
    assert any("missing required field `results`" in r for r in reasons)
    assert any("1001 results, more than the limit of 1000" in r for r in reasons)
    assert any("too far in the past" in r for r in reasons)
    assert any("grade -1.0 is not a number >= 0" in r for r in reasons)
    assert any("position 0 is below 1" in r for r in reasons)
    for m in letters:
        headers = dict(m.headers)
        assert headers["rankmeter.source.topic"].decode() in (topics.impressions, topics.feedback)
        assert int(headers["rankmeter.source.offset"]) >= 0
    assert b"\xff\xfe not json" in [m.value for m in letters]  # the message itself, untouched

    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout + check.stderr == "", check.stdout + check.stderr


def test_ranker_labels_beyond_the_cap_fold_into_other(kafka_bootstrap, redis_url, tmp_path):
    topics = unique_topics()
    now = int(time.time() * 1000)
    impressions = [(f"q{i}", {"query_id": f"q{i}", "ranker": f"ranker-{i}", "timestamp": now,
                              "results": ["a", "b"]}) for i in range(6)]
    with Serve(kafka_bootstrap, redis_url, topics, f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}",
               extra_env={"RANKMETER_LIMITS_MAX_RANKERS": "2"}, log_path=tmp_path / "serve.log") as serve:
        produce(kafka_bootstrap, topics.impressions, impressions)
        serve.wait_for_events(6)
        wait_until(lambda: any(k[0] == "rankmeter_queries" for k in serve.metrics()), 10, "queries")
        metrics = serve.metrics()
    rankers = {dict(k[1])["ranker"]: v for k, v in metrics.items()
               if k[0] == "rankmeter_queries" and dict(k[1])["window"] == "5m" and dict(k[1])["population"] == "all"}
    assert len(rankers) == 3 and rankers["other"] == 4 and sum(rankers.values()) == 6
    assert metrics[("rankmeter_labels_folded_total", frozenset({"label": "ranker"}.items()))] == 4
