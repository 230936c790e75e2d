"""Exactly-once effect: `rankmeter serve` killed with SIGKILL mid-stream and restarted
ends with the same aggregates as an uninterrupted run over the same topics."""

from __future__ import annotations

import random
import signal
import time
import uuid

import pytest

from serving import FAST_FAILOVER, Serve, produce, unique_topics, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.long]


def stream(seed: int, queries: int, now: int):
    rnd = random.Random(seed)
    impressions, feedback = [], []
    for q in range(queries):
        qid = f"q{q}"
        results = [f"d{rnd.randrange(500)}" for _ in range(rnd.randint(3, 20))]
        impressions.append((qid, {"query_id": qid, "ranker": rnd.choice(["a", "b", "c"]),
                                  "timestamp": now - rnd.randrange(1_200_000), "results": results}))
        for i in range(rnd.randint(0, 8)):
            doc = rnd.choice(results + ["unshown"])
            event = {"query_id": qid, "doc_id": doc, "timestamp": now, "event_id": f"{qid}-{i}"}
            if rnd.random() < 0.3:
                event.update(action="judgment", grade=rnd.randint(0, 3))
            else:
                event.update(action=rnd.choice(["click", "click", "add_to_cart", "purchase"]),
                             dwell_ms=rnd.randrange(60_000))
            feedback.append((qid, event))
            if rnd.random() < 0.1:
                feedback.append((qid, event))  # redelivered by the producer: same event_id
    return impressions, feedback


def caught_up(serve: Serve, partitions: int = 4) -> bool:
    lags = [v for (name, _), v in serve.metrics().items() if name == "rankmeter_consumer_lag"]
    return len(lags) == 2 * partitions and sum(lags) == 0


def aggregates(serve: Serve) -> dict:
    # The 5m and 15m windows move through the data while the test runs; 1h and 24h hold
    # every impression (< 20 min old).
    return {k: v for k, v in serve.metrics().items()
            if k[0] in ("rankmeter_quality_numerator", "rankmeter_quality_denominator", "rankmeter_queries")
            and dict(k[1])["window"] not in ("5m", "15m")}


# A member killed with SIGKILL never leaves its group: the coordinator waits for its
# session to time out before the restarted one gets the partitions (serving.FAST_FAILOVER: 6 s).

def test_sigkill_mid_stream_then_restart_equals_uninterrupted_run(kafka_bootstrap, redis_url, kafka_backend,
                                                                   tmp_path):
    topics = unique_topics(kafka_bootstrap)
    impressions, feedback = stream(seed=5, queries=4000, now=int(time.time() * 1000))
    # Impressions and feedback interleaved by query, in three chunks: the first victim is
    # killed while it works through chunk 1, the second while it works through chunk 2,
    # and chunk 3 arrives only after both died.
    messages = [(topics.impressions, m) for m in impressions] + [(topics.feedback, m) for m in feedback]
    random.Random(9).shuffle(messages)  # much feedback comes before its impression
    chunks = [messages[:len(messages) * 2 // 5], messages[len(messages) * 2 // 5:len(messages) * 7 // 10],
              messages[len(messages) * 7 // 10:]]

    def produce_chunk(chunk):
        for topic in (topics.impressions, topics.feedback):
            produce(kafka_bootstrap, topic, [m for t, m in chunk if t == topic])

    settings = {**FAST_FAILOVER, "RANKMETER_KAFKA_MAX_POLL_RECORDS": "100",  # many batches: many places to die
                **kafka_backend}
    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    killed_after = []
    for chunk in chunks[:2]:
        produce_chunk(chunk)
        victim = Serve(kafka_bootstrap, redis_url, topics, group, prefix, settings,
                       log_path=tmp_path / "killed.log").start()
        wait_until(lambda: sum(victim.events().values()) >= len(chunk) / 3, 180,
                   "a third of the chunk to be processed", interval=0.01)
        killed_after.append(sum(victim.events().values()))
        assert victim.stop(signal.SIGKILL) == -signal.SIGKILL
    produce_chunk(chunks[2])
    survivor = Serve(kafka_bootstrap, redis_url, topics, group, prefix, settings,
                     log_path=tmp_path / "restarted.log").start()
    wait_until(lambda: caught_up(survivor), 180, "the restarted run to catch up")
    got = aggregates(survivor)
    survivor.stop()

    # On the default backend: the confluent one's runs must equal kafka-python's too.
    reference = Serve(kafka_bootstrap, redis_url, topics, f"g-{uuid.uuid4().hex[:6]}",
                      f"rm-{uuid.uuid4().hex[:6]}", log_path=tmp_path / "reference.log").start()
    wait_until(lambda: caught_up(reference), 180, "the uninterrupted run to catch up")
    expected = aggregates(reference)
    reference.stop()

    assert all(n < len(messages) for n in killed_after), killed_after
    assert got.keys() == expected.keys()
    assert len(expected) > 100
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


def summed(processes: list[Serve]) -> dict:
    """What PromQL's sum by (…) over the replicas gives: numerators and denominators add up."""
    total: dict = {}
    for serve in processes:
        for key, value in aggregates(serve).items():
            total[key] = total.get(key, 0.0) + value
    return total


def test_two_replicas_split_the_partitions_and_sum_to_one_replica(kafka_bootstrap, redis_url, kafka_backend,
                                                                  tmp_path):
    topics = unique_topics(kafka_bootstrap)
    impressions, feedback = stream(seed=8, queries=2000, now=int(time.time() * 1000))
    produce(kafka_bootstrap, topics.feedback, feedback[: len(feedback) // 3])
    produce(kafka_bootstrap, topics.impressions, impressions)
    produce(kafka_bootstrap, topics.feedback, feedback[len(feedback) // 3:])

    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    # Range assignment on either backend: each replica the same partition numbers of both topics.
    replicas = [Serve(kafka_bootstrap, redis_url, topics, group, prefix, {**FAST_FAILOVER, **kafka_backend},
                      log_path=tmp_path / f"replica-{i}.log").start() for i in range(2)]
    try:
        def split_and_caught_up() -> bool:
            held = [v for r in replicas for (name, _), v in r.metrics().items() if name == "rankmeter_assigned_partitions"]
            lags = [v for r in replicas for (name, _), v in r.metrics().items() if name == "rankmeter_consumer_lag"]
            return held == [2, 2] and len(lags) == 8 and sum(lags) == 0
        wait_until(split_and_caught_up, 180, "two replicas to share the partitions and catch up")
        time.sleep(2)  # the lag gauge is sampled every second: let the last batch land
        got = summed(replicas)
    finally:
        for r in replicas:
            r.stop()

    single = Serve(kafka_bootstrap, redis_url, topics, f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}",
                   log_path=tmp_path / "single.log").start()
    wait_until(lambda: caught_up(single), 180, "the single replica to catch up")
    expected = aggregates(single)
    single.stop()
    assert got.keys() == expected.keys() and len(expected) > 100
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key
