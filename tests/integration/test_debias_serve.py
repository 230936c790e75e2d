"""Position-bias correction on the real services (issue 11): the simulator's traffic (two
rankers, a power-0.9 examination curve the estimator was not built around) produced into
the real Kafka with its event times, `rankmeter serve --event-clock` into the real Redis.
What /metrics exports: `rankmeter_propensity{rank}` converging on the simulator's curve,
and `rankmeter_debiased_quality{metric="nDCG@10", grading="ipw"}` keeping the gap between
the rankers that the raw click nDCG@10 compresses seven-fold."""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import numpy as np
import pytest
from kafka import KafkaProducer

from rankmeter.simulator.traffic import DEFAULT_RANKERS, Simulator

from serving import Serve, quality, unique_topics, wait_until

pytestmark = pytest.mark.integration

TUNED, DEGRADED = (r.name for r in DEFAULT_RANKERS)
QUERIES = 12_000   # one every 0.5 s of event time: 100 minutes
LEARN_MINUTES = 70
ENV = {"RANKMETER_WINDOWS_ATTRIBUTION": "5m", "RANKMETER_WINDOWS_GRACE": "1m",
       "RANKMETER_WINDOWS_JUDGMENTS": "10m", "RANKMETER_WINDOWS_SIZES": "5m,30m,1h",
       "RANKMETER_DEBIAS_HARVEST_SHARE": "1"}   # two searches a second: harvest them all


def debiased(metrics: dict, ranker: str, window: str = "30m") -> float:
    labels = frozenset({"metric": "nDCG@10", "grading": "ipw", "ranker": ranker, "window": window,
                        "average": "macro", "segment": ""}.items())
    return metrics[("rankmeter_debiased_quality", labels)]


def propensities(metrics: dict) -> dict[int, float]:
    return {int(dict(labels)["rank"]): v for (name, labels), v in metrics.items() if name == "rankmeter_propensity"}


def estimated_at(metrics: dict) -> float:
    return metrics.get(("rankmeter_click_model_estimated_timestamp_seconds", frozenset()), 0.0)


def test_propensities_converge_and_debiased_ndcg_tracks_the_truth(services, tmp_path):
    sim = Simulator(seed=11, examination="power-0.9", track_examination=True, judgment_share=0.0,
                    duplicate_share=0.0, disorder=0.0, purchase_cap_s=240)
    start_ms = int(time.time() * 1000) - 3 * 3_600_000
    topics = unique_topics(services.kafka_bootstrap, partitions=4)
    events: list[tuple[int, int, str, str, bytes]] = []
    for q in range(QUERIES):
        for event in sim.query_events(start_ms + q * 500, q * 0.5):
            topic = topics.impressions if event.stream == "impressions" else topics.feedback
            events.append((event.timestamp_ms, len(events), topic, event.key, json.dumps(event.value).encode()))
    events.sort()
    learn_ms = start_ms + LEARN_MINUTES * 60_000
    phases = [[e for e in events if e[0] < learn_ms], [e for e in events if e[0] >= learn_ms]]
    producer = KafkaProducer(bootstrap_servers=services.kafka_bootstrap, acks="all", linger_ms=20)

    def produce(phase: list[tuple[int, int, str, str, bytes]]) -> None:
        for ts, _, topic, key, value in phase:  # in event time, each with its own: the event clock reads it
            producer.send(topic, key=key.encode(), value=value, timestamp_ms=ts)
        producer.flush()

    with Serve(services.kafka_bootstrap, services.redis_url, topics, f"g{uuid.uuid4().hex[:8]}",
               f"rm{uuid.uuid4().hex[:8]}", extra_env=ENV, log_path=tmp_path / "serve.log"
               ).start(create_topics=None, args=["--event-clock"]) as serve:
        # The propensities are re-estimated every 5 s or more of processing time (serve's
        # AB_INTERVAL_S, spaced out when looks are slow): live, every 5 s of traffic; a
        # replay at thousands of times real time would weigh its first hour before any
        # estimate, or with one made from its first minutes. So: 70 minutes of traffic, an
        # estimate made after all of it was read, then the last 30 minutes, whose window is
        # compared.
        produce(phases[0])
        serve.wait_for_events(len(phases[0]), seconds=240)
        read = time.time()
        wait_until(lambda: estimated_at(serve.metrics()) > read and len(propensities(serve.metrics())) == 10,
                   90, "an estimate of every rank's propensity made after the first 70 minutes were read")
        produce(phases[1])
        serve.wait_for_events(len(events), seconds=240)
        wait_until(lambda: len(propensities(serve.metrics())) == 10, 60, "every rank's propensity")
        metrics = serve.metrics()
        text = serve.metrics_text()
    producer.close()
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout + check.stderr == "", check.stdout + check.stderr

    true = sim.true_examination()
    true = true / true[0]
    estimated = propensities(metrics)
    errors = [abs(estimated[r] - true[r - 1]) for r in range(1, 11)]
    assert max(errors) < 0.06, (estimated, true.tolist())

    truth = sim.truth.means()
    true_gap = truth[TUNED]["nDCG@10"] - truth[DEGRADED]["nDCG@10"]
    raw_gap = quality(metrics, "nDCG@10", TUNED, "30m") - quality(metrics, "nDCG@10", DEGRADED, "30m")
    ipw_gap = debiased(metrics, TUNED) - debiased(metrics, DEGRADED)
    assert 0 < raw_gap < 0.5 * true_gap
    assert ipw_gap >= 0.5 * true_gap, (ipw_gap, raw_gap, true_gap)
    # On nDCG's scale, near the hidden grades' values (the 40-seed bench measures how near).
    for ranker in (TUNED, DEGRADED):
        assert abs(debiased(metrics, ranker) - truth[ranker]["nDCG@10"]) < 0.15, (ranker, truth)
    assert np.isfinite(list(estimated.values())).all()
