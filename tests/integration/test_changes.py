"""What production does to a running service, on the real Kafka and Redis (issue 9):

1. the measures and the grade map change while queries are still open (rankmeter serve
   stopped and restarted with the same group and key prefix, as a redeploy does);
2. a 40-minute outage, with the service's clock moved on by 40 minutes when it comes
   back (an injected clock: serve.run(..., clock=...)), and a backlog to join.
"""

from __future__ import annotations

import threading
import time
import urllib.request
import uuid

import pytest
import pytrec_eval
import redis
from kafka.partitioner.default import murmur2

from rankmeter import config
from rankmeter.kafka import KafkaSource
from rankmeter.redis_store import RedisStore
from rankmeter.serve import run

from serving import FAST_FAILOVER, Serve, free_port, parse_metrics, produce, quality, unique_topics, wait_until

pytestmark = pytest.mark.integration

RESULTS = [f"d{i}" for i in range(10)]  # every query of test 1 shows the same ten documents


def evaluated(grades: dict[str, dict[str, int]]) -> dict[str, dict[str, float]]:
    """trec_eval's per-query nDCG@10, P@5, P@10, RR and R@10 of RESULTS (in this order)
    under these grades (relevance level 1, as rankmeter's default)."""
    run_ = {q: {d: float(len(RESULTS) - i) for i, d in enumerate(RESULTS)} for q in grades}
    measures = {"ndcg_cut.10", "P.5", "P.10", "recip_rank", "recall.10"}
    per_query = pytrec_eval.RelevanceEvaluator(grades, measures).evaluate(run_)
    return {q: {"nDCG@10": v["ndcg_cut_10"], "P@5": v["P_5"], "P@10": v["P_10"], "RR": v["recip_rank"],
                "R@10": v["recall_10"]} for q, v in per_query.items()}


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def sums(metrics: dict, metric: str, window: str = "1h", average: str = "macro") -> tuple[float, float]:
    """(numerator, denominator) of rankmeter_quality for ranker r1."""
    labels = frozenset({"metric": metric, "ranker": "r1", "window": window, "average": average,
                        "segment": ""}.items())
    return (metrics[("rankmeter_quality_numerator", labels)], metrics[("rankmeter_quality_denominator", labels)])


def exported_measures(metrics: dict) -> set[str]:
    return {dict(labels)["metric"] for name, labels in metrics
            if name == "rankmeter_quality" and dict(labels)["ranker"] == "r1"}


def consumed(serve: Serve, total: int) -> dict:
    """Wait for `total` events counted by this process, failing at once if it died."""
    def done() -> bool:
        if serve.process.poll() is not None:
            raise AssertionError(f"rankmeter serve exited with {serve.process.returncode} (see its log)")
        return sum(serve.events().values()) >= total
    wait_until(done, 60, f"{total} events to be consumed")
    return serve.metrics()


def test_measures_and_grade_map_change_with_queries_open(kafka_bootstrap, redis_url, tmp_path):
    """Phase 1 measures nDCG@10, P@10, AP; phase 2 (restart, same group and prefix)
    nDCG@10, P@5, RR: AP removed, RR added, P@10 swapped for P@5; as many measures as
    before, so the vectors keep their size and positions would silently relabel P@10's
    sums as P@5's (issue 9, failure 2). Phase 3 changes the grade map and adds R@10: the
    vectors change size (before the fix, the first batch crashed with `cannot reshape
    array`, and so did every restart: failure 1).

    The rule asserted (issue 9, pipeline.layout_for / windows.Layout):
    - a measure whose identity is unchanged (nDCG@10 in phase 2; the online signals in
      every phase) carries on: its value equals trec_eval's over ALL the queries, old ones
      included, with each open query's latest grades (the old contribution is replaced, not
      added to);
    - a new measure (P@5, RR) counts from the change: exactly the queries evaluated after
      it (new impressions, and open queries that got feedback), each with its full value;
    - a removed measure (P@10, AP) is no longer exported, and its sums never appear under
      another name: P@5's denominator is the number of queries evaluated since the change,
      not P@10's;
    - a quality measure's identity includes the grade map: after a grade-map change every
      quality measure starts afresh (only queries evaluated since count), since a mean over
      values computed under two grade maps would mean neither. Stored feedback keeps the
      grade it was decoded with (the map applies to events as they arrive); the online
      signals (CTR…) do not depend on grades and carry on.
    """
    topics = unique_topics(kafka_bootstrap)
    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    now = int(time.time() * 1000)
    imp = lambda q, t=now: (q, {"query_id": q, "ranker": "r1", "timestamp": t, "results": RESULTS})
    fb = lambda q, action, doc, t=now: (q, {"query_id": q, "action": action, "doc_id": doc, "timestamp": t + 1000,
                                           "event_id": f"{q}-{action}-{doc}"})

    def serve(measures: str, log: str, **more: str) -> Serve:
        env = {"RANKMETER_EVALUATION_MEASURES": measures, **more}
        return Serve(kafka_bootstrap, redis_url, topics, group, prefix, env, log_path=tmp_path / log).start()

    # Phase 1: six queries, all open (attribution 30 min + 5 min grace); q2 has no feedback yet.
    phase1 = [fb("q0", "click", "d0"), fb("q0", "purchase", "d3"), fb("q1", "click", "d6"),
              fb("q3", "add_to_cart", "d1"), fb("q4", "click", "d2"), fb("q5", "click", "d8")]
    produce(kafka_bootstrap, topics.impressions, [imp(f"q{i}") for i in range(6)])
    produce(kafka_bootstrap, topics.feedback, phase1)
    first = serve("nDCG@10,P@10,AP", "phase1.log")
    metrics = consumed(first, 6 + len(phase1))
    assert first.stop() == 0
    grades = {"q0": {"d0": 1, "d3": 3}, "q1": {"d6": 1}, "q3": {"d1": 2}, "q4": {"d2": 1}, "q5": {"d8": 1}}
    expected = evaluated(grades)
    assert quality(metrics, "P@10", "r1", "1h") == pytest.approx(mean([v["P@10"] for v in expected.values()]))
    assert sums(metrics, "P@10")[1] == 5

    # Phase 2: the rest of the feedback for open queries, and a new query.
    phase2 = [fb("q2", "click", "d7"), fb("q3", "click", "d4"), fb("q4", "purchase", "d0"),
              fb("q6", "click", "d1"), fb("q6", "click", "d9")]
    produce(kafka_bootstrap, topics.impressions, [imp("q6")])
    produce(kafka_bootstrap, topics.feedback, phase2)
    second = serve("nDCG@10,P@5,RR", "phase2.log")  # before the fix: `cannot reshape array`, a crash loop
    metrics = consumed(second, 1 + len(phase2))
    assert second.stop() == 0
    grades.update({"q2": {"d7": 1}, "q3": {"d1": 2, "d4": 1}, "q4": {"d2": 1, "d0": 3}, "q6": {"d1": 1, "d9": 1}})
    expected = evaluated(grades)
    since_change = ["q2", "q3", "q4", "q6"]  # evaluated after the change
    assert {"P@10", "AP"}.isdisjoint(exported_measures(metrics))
    assert {"nDCG@10", "P@5", "RR"} <= exported_measures(metrics)
    # nDCG@10 carried on: every judged query (q0…q6), each with its latest grades.
    assert sums(metrics, "nDCG@10") == pytest.approx((sum(v["nDCG@10"] for v in expected.values()), 7))
    assert quality(metrics, "nDCG@10", "r1", "1h") == pytest.approx(mean([v["nDCG@10"] for v in expected.values()]))
    # P@5 and RR from the change: 4 queries (P@10's sums were over 5: none of them leaked in).
    for measure in ("P@5", "RR"):
        assert sums(metrics, measure) == pytest.approx((sum(expected[q][measure] for q in since_change), 4)), measure
        assert quality(metrics, measure, "r1", "1h") == pytest.approx(
            mean([expected[q][measure] for q in since_change]))

    # Phase 3: the grade map changes (a click now grades 2), R@10 is added: every quality
    # measure starts afresh.
    phase3 = [fb("q1", "click", "d0"), fb("q7", "click", "d3")]
    produce(kafka_bootstrap, topics.impressions, [imp("q7")])
    produce(kafka_bootstrap, topics.feedback, phase3)
    third = serve("nDCG@10,P@5,RR,R@10", "phase3.log", RANKMETER_EVALUATION_GRADES="click=2,add_to_cart=2,purchase=3")
    metrics = consumed(third, 1 + len(phase3))
    assert third.stop() == 0
    # q1's earlier click keeps the grade 1 it was decoded with; its new click grades 2.
    fresh = evaluated({"q1": {"d6": 1, "d0": 2}, "q7": {"d3": 2}})
    for measure in ("nDCG@10", "P@5", "RR", "R@10"):
        assert sums(metrics, measure) == pytest.approx((sum(v[measure] for v in fresh.values()), 2)), measure
    # The online signals do not depend on grades: CTR carries on over all eight queries.
    # Clicked shown results (clicks only; add_to_cart and purchase are not clicks):
    # q0 1, q1 2, q2 1, q3 1, q4 1, q5 1, q6 2, q7 1.
    assert sums(metrics, "CTR", average="micro") == (10, 8 * len(RESULTS))
    assert sums(metrics, "Abandonment") == (0, 8)


# ---- 2. an outage longer than the attribution window ----------------------------------

MINUTE = 60_000
OUTAGE = 40 * MINUTE


def ids_covering(partitions: int, stem: str) -> list[str]:
    """One query id per partition (kafka-python's default partitioner: murmur2 of the key),
    so every partition's event-time watermark moves past the outage."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < partitions:
        qid = f"{stem}{i}"
        found.setdefault((murmur2(qid.encode()) & 0x7FFFFFFF) % partitions, qid)
        i += 1
    return [found[p] for p in range(partitions)]


class Running:
    """serve.run in a thread with a clock `offset_ms` ahead of the wall clock."""

    def __init__(self, env: dict[str, str], redis_url: str, prefix: str, offset_ms: int) -> None:
        self.port = free_port()
        self.settings = config.load(None, {**env, "RANKMETER_METRICS_PORT": str(self.port)})
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.pipeline = None
        clock = lambda: time.time() + offset_ms / 1000

        def main() -> None:
            try:
                run(self.settings, KafkaSource(self.settings.kafka), RedisStore(redis_url, prefix),
                    stop=self.stop_event, on_start=lambda p, _: setattr(self, "pipeline", p), clock=clock)
            except BaseException as e:  # reported by the test
                self.error = e

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()

    def metrics(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def consume(self, impressions: int, feedback: int) -> dict[tuple[str, str], float]:
        """Wait until the topics are read up to these offsets (summed over the partitions),
        then return the events counted: a lost click shows in what is counted, not as a
        timeout."""
        k = self.settings.kafka

        def read() -> bool:
            assert self.error is None, self.error
            parts = list(self.pipeline.partitions.values()) if self.pipeline is not None else []
            return (sum(ps.offsets.get(k.impressions_topic, 0) for ps in parts) >= impressions
                    and sum(ps.offsets.get(k.feedback_topic, 0) for ps in parts) >= feedback)
        # Up to kafka-python's join watchdog (session timeout + 15 s) and a join after it.
        wait_until(read, 120, f"{impressions} impressions and {feedback} feedback events to be read")
        time.sleep(0.5)  # the batch that read them counts its events once it is stored
        return dict(self.pipeline.events)

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(60)
        assert not self.thread.is_alive() and self.error is None, self.error


def test_an_outage_longer_than_the_attribution_window_loses_nothing(kafka_bootstrap, redis_url):
    """Phase 1 (the service's clock is the wall clock, T): N queries shown at T, half of
    them clicked at T+1 min. Then the service is down for 40 minutes. The backlog it finds
    when it comes back (its clock now T+40 min): a click on each of the N queries stamped
    T+10 min (inside their attribution window: 30 min + 5 min grace), and the traffic of
    the moment, impressions and clicks stamped T+40 min.

    Why the old code lost these clicks: it gave each record a deadline of *processing
    time* + 35 min (written at T, so T+35 min) and swept the records whose deadline the
    wall clock had passed. Back from the outage its clock reads T+40 min: the first batch's
    sweep closed every one of the N queries and deleted their records, although their
    feedback, stamped T+10 min, was still waiting in Kafka. Each backlog click not in that
    first batch (with max_poll_records=5, nearly all of them) then found no record, waited
    as `pending` for an impression that had already been consumed, and was orphaned:
    the CTR lost N clicks. Now a query closes when its partition's event-time watermark
    (the lower of the two topics' highest event timestamps) passes impression + 35 min:
    a partition's backlog clicks (T+10) are read before its T+40 events, so they join
    exactly as they would have live, and the N queries close afterwards.
    """
    topics = unique_topics(kafka_bootstrap, partitions=4)
    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    env = {"RANKMETER_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "RANKMETER_KAFKA_GROUP_ID": group,
           "RANKMETER_KAFKA_IMPRESSIONS_TOPIC": topics.impressions, "RANKMETER_KAFKA_FEEDBACK_TOPIC": topics.feedback,
           "RANKMETER_KAFKA_DEAD_LETTER_TOPIC": topics.dead_letter, "RANKMETER_METRICS_BIND_ADDRESS": "127.0.0.1",
           "RANKMETER_REDIS_URL": redis_url, "RANKMETER_REDIS_KEY_PREFIX": prefix,
           "RANKMETER_KAFKA_MAX_POLL_RECORDS": "5",  # the backlog spreads over many batches
           **FAST_FAILOVER}
    if "judgments" in config.Windows.__struct_fields__:
        # Explicit judgments may keep a query open longer (windows.judgments); this stream
        # has none, and the close asserted below is the click attribution window's.
        env["RANKMETER_WINDOWS_JUDGMENTS"] = "30m"
    T = int(time.time() * 1000)
    imp = lambda q, t, results: (q, {"query_id": q, "ranker": "r1", "timestamp": t, "results": results})
    click = lambda q, t, doc: (q, {"query_id": q, "action": "click", "doc_id": doc, "timestamp": t,
                                   "event_id": f"{q}-{doc}"})
    before = [f"q{i}" for i in range(12)]
    after = ids_covering(4, "after-")

    produce(kafka_bootstrap, topics.impressions, [imp(q, T, list("abcde")) for q in before])
    produce(kafka_bootstrap, topics.feedback, [click(q, T + MINUTE, "a") for q in before[::2]])
    live = Running(env, redis_url, prefix, offset_ms=0)
    try:
        assert live.consume(12, 6) == {("impressions", "applied"): 12, ("feedback", "applied"): 6}
    finally:
        live.stop()

    # The outage's backlog, in the order it was produced.
    produce(kafka_bootstrap, topics.feedback, [click(q, T + 10 * MINUTE, "b") for q in before])
    produce(kafka_bootstrap, topics.impressions, [imp(q, T + OUTAGE, list("abcd")) for q in after])
    produce(kafka_bootstrap, topics.feedback, [click(q, T + OUTAGE, "a") for q in after])
    back = Running(env, redis_url, prefix, offset_ms=OUTAGE)
    try:
        # Every backlog click applied: none pending, orphaned or late.
        assert back.consume(12 + len(after), 6 + 12 + len(after)) == {
            ("impressions", "applied"): len(after), ("feedback", "applied"): 12 + len(after)}
        # Queries close at the sweep of a batch (at most once a second): live traffic goes on.
        time.sleep(1.5)
        produce(kafka_bootstrap, topics.impressions, [("tick", {"query_id": "tick", "ranker": "r1",
                                                                "timestamp": T + OUTAGE, "results": list("xyz")})])
        back.consume(12 + len(after) + 1, 6 + 12 + len(after))
        metrics = back.metrics()
    finally:
        back.stop()

    events = {(dict(labels)["stream"], dict(labels)["outcome"]): v
              for (name, labels), v in metrics.items() if name == "rankmeter_events_total"}
    assert events == {("impressions", "applied"): len(after) + 1, ("feedback", "applied"): 12 + len(after)}
    # 1h window (ending at the service's now, T+40 min): phase 1's clicks (6 × a), the backlog
    # (12 × b), the new queries' clicks; shown: 12 × 5 + 4 × 4 + tick's 3.
    assert sums(metrics, "CTR", "1h", "micro") == (6 + 12 + len(after), 12 * 5 + len(after) * 4 + 3)
    # 5m window: (T+35, T+40] by the service's clock: only the queries after the outage.
    assert sums(metrics, "CTR", "5m", "micro") == (len(after), len(after) * 4 + 3)
    # The watermark passed T+35 min: the N queries closed (their records left the store,
    # their contribution stayed in the windows above); the new ones stay open.
    assert metrics[("rankmeter_open_queries", frozenset())] == len(after)
    client = redis.Redis.from_url(redis_url)
    try:
        open_ids = {q.decode() for p in range(4) for q in client.zrange(f"{prefix}:{{{prefix}:{p}}}:open", 0, -1)}
        stored = {q.decode() for p in range(4) for q in client.hkeys(f"{prefix}:{{{prefix}:{p}}}:queries")}
    finally:
        client.close()
    assert open_ids == stored == set(after) | {"tick"}
