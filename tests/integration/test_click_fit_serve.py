"""The fit test on the real services (issue 22): two rankers over the same query texts,
clicks from position-based users in one deployment and from cascade users in another,
produced into the real Kafka, `rankmeter serve --event-clock` into the real Redis. The pbm
deployment exports the corrected value (`rankmeter_debias_valid{reason="ok"}` 1, the
debiased gap wider than the raw one); the cascade one prefers the cascade-capable model
(held-out perplexity), which finds nothing below a click examined, and withdraws the
debiased series (`reason="unexamined_below_clicks"`). A small synthetic corpus rather than the simulator's, so that each deployment takes
seconds."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
import uuid

import numpy as np
import pytest
from kafka import KafkaProducer

from rankmeter.simulator.clicks import cascade, pbm

from serving import Serve, quality, unique_topics, wait_until

pytestmark = pytest.mark.integration

TEXTS, DOCS, K = 30, 15, 10
ATTRACTIVE = np.array([0.04, 0.25, 0.55, 0.85])  # P(click | examined, grade), as the simulator's
LEARN, EVALUATE = 2000, 600                      # queries, one every 0.5 s of event time
ENV = {"RANKMETER_WINDOWS_ATTRIBUTION": "2m", "RANKMETER_WINDOWS_GRACE": "10s",
       "RANKMETER_WINDOWS_JUDGMENTS": "5m", "RANKMETER_WINDOWS_SIZES": "5m",
       "RANKMETER_DEBIAS_HARVEST_SHARE": "1"}


def stream(click_model, start_ms: int, seed: int = 5) -> list[tuple[int, str, str, dict]]:
    """(timestamp, stream, key, value) of LEARN + EVALUATE searches: "good" ranks a text's
    documents by grade with some noise, "bad" with much more (both show each document at
    several ranks: the harvest's interventions); clicks by `click_model`."""
    rng = np.random.default_rng(seed)
    grades = rng.choice(4, size=(TEXTS, DOCS), p=[0.5, 0.25, 0.15, 0.1])
    out = []
    for q in range(LEARN + EVALUATE):
        t, ranker = int(rng.integers(TEXTS)), ("good", "bad")[int(rng.integers(2))]
        noise = 0.8 if ranker == "good" else 4.0
        order = np.argsort(-(grades[t] + rng.normal(0, noise, DOCS)))[:K]
        results = [f"t{t}d{d}" for d in order]
        ts, qid = start_ms + q * 500, f"{seed}-{q}"
        out.append((ts, "impressions", qid, {"query_id": qid, "ranker": ranker, "timestamp": ts,
                                             "results": results, "user_query": f"text {t}"}))
        for i, r in enumerate(click_model(list(ATTRACTIVE[grades[t][order]]), rng)):
            out.append((ts + 1000 * (i + 1), "feedback", qid, {"query_id": qid, "action": "click", "timestamp": ts + 1000 * (i + 1),
                                                               "doc_id": results[r], "event_id": f"{qid}.{i}"}))
    return sorted(out, key=lambda e: e[0])


def debiased(metrics: dict, ranker: str) -> float | None:
    labels = frozenset({"metric": "nDCG@10", "grading": "ipw", "ranker": ranker, "window": "5m",
                        "average": "macro", "segment": ""}.items())
    return metrics.get(("rankmeter_debiased_quality", labels))


def by_label(metrics: dict, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: v for (n, labels), v in metrics.items() if n == name}


def deploy(services, tmp_path, click_model) -> dict:
    """One deployment fed LEARN searches, then (its fit looked at) EVALUATE more: /metrics."""
    start_ms = int(time.time() * 1000) - 3_600_000
    events = stream(click_model, start_ms)
    topics = unique_topics(services.kafka_bootstrap, partitions=2)
    learn_ms = start_ms + LEARN * 500
    producer = KafkaProducer(bootstrap_servers=services.kafka_bootstrap, acks="all", linger_ms=20)

    def produce(phase: list) -> None:
        for ts, kind, key, value in phase:
            producer.send(topics.impressions if kind == "impressions" else topics.feedback, key=key.encode(),
                          value=json.dumps(value).encode(), timestamp_ms=ts)
        producer.flush()

    learn = [e for e in events if e[0] < learn_ms]
    # Held-out queries are scored only once a look has estimated the models: the first
    # half of the learning phase first, so that the second's held-out queries are scored.
    first, second = learn[:len(learn) // 2], learn[len(learn) // 2:]
    with Serve(services.kafka_bootstrap, services.redis_url, topics, f"g{uuid.uuid4().hex[:8]}",
               f"rm{uuid.uuid4().hex[:8]}", extra_env=ENV, log_path=tmp_path / f"serve-{click_model.__name__}.log"
               ).start(create_topics=None, args=["--event-clock"]) as serve:
        # The look (every 5 s of processing time) decides on the learning phase's harvest
        # before the evaluated searches are shown: a replay would otherwise outrun it.
        produce(first)
        serve.wait_for_events(len(first), seconds=60)
        wait_until(lambda: any(k[0] == "rankmeter_propensity" for k in serve.metrics()), 60, "propensities estimated")
        produce(second)
        serve.wait_for_events(len(learn), seconds=60)
        wait_until(lambda: len(by_label(serve.metrics(), "rankmeter_click_model_perplexity", "model")) == 2,
                   30, "both click models scored")
        produce(events[len(learn):])
        serve.wait_for_events(len(events), seconds=60)
        wait_until(lambda: sum(by_label(serve.metrics(), "rankmeter_debias_valid", "reason").values()) == 1,
                   30, "the fit test's reason exported")
        metrics = serve.metrics()
    producer.close()
    return metrics


def test_pbm_users_get_the_corrected_value_and_cascade_users_the_series_withdrawn(services, tmp_path):
    # The two deployments side by side (own topics, group and key prefix): half the time.
    with ThreadPoolExecutor(2) as pool:
        deployed = [pool.submit(deploy, services, tmp_path, model) for model in (pbm, cascade)]
        pbm_metrics, cascade_metrics = (f.result() for f in deployed)
    metrics = pbm_metrics
    valid = by_label(metrics, "rankmeter_debias_valid", "reason")
    assert valid["ok"] == 1 and sum(valid.values()) == 1, valid
    raw = quality(metrics, "nDCG@10", "good", "5m") - quality(metrics, "nDCG@10", "bad", "5m")
    corrected = debiased(metrics, "good") - debiased(metrics, "bad")
    assert 0 < raw < corrected, (raw, corrected)

    metrics = cascade_metrics
    perplexity = by_label(metrics, "rankmeter_click_model_perplexity", "model")
    assert perplexity["ubm"] < perplexity["pbm"], perplexity
    valid = by_label(metrics, "rankmeter_debias_valid", "reason")
    # ubm says cascade users examine nothing below a click: withdrawn, no series at all.
    assert valid["unexamined_below_clicks"] == 1 and sum(valid.values()) == 1, valid
    assert by_label(metrics, "rankmeter_click_model_chosen", "model") == {"pbm": 0.0, "ubm": 1.0}
    assert debiased(metrics, "good") is None and debiased(metrics, "bad") is None
    assert not [k for k in metrics if k[0] == "rankmeter_debiased_quality"]
