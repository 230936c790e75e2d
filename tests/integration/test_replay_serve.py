"""`rankmeter replay` into the real Kafka, `rankmeter serve` from it into the real Redis,
and `rankmeter report` on that Redis: the numbers `rankmeter replay --embedded` prints for
the same file, exactly. (Named apart from tests/test_replay.py: test modules share one
namespace.)"""

from __future__ import annotations

import json
import random
import subprocess
import time
import uuid
from datetime import datetime, timezone
from collections.abc import Callable
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from rankmeter import config, replay

from serving import RANKMETER, Serve, Topics, unique_topics, wait_until

pytestmark = pytest.mark.integration

PARTITIONS = 4
CLEAN_ENV = {"PATH": "/usr/bin:/bin"}   # --embedded: no Kafka, no Redis settings at all


def native_export(path: Path, now_ms: int, seed: int) -> int:
    """An OpenSearch bulk export of native impressions and feedback from the last hour
    (serve on the wall clock takes them): two rankers, native and UBI clicks, judgments
    (some of documents not shown), a duplicate click, and two bad lines. Returns the
    number of messages a replay produces."""
    rnd = random.Random(seed)
    lines: list[object] = []
    first_click: list[object] = []
    start = now_ms - 50 * 60_000
    for q in range(240):
        qid, ts = f"q{q}", start + q * 2_000
        shown = rnd.sample([f"d{i}" for i in range(40)], 10)
        lines += [{"index": {"_index": "ubi_queries", "_id": f"i{q}"}},
                  {"query_id": qid, "ranker": "bm25" if q % 2 else "ltr-v2", "timestamp": ts, "results": shown}]
        for n, doc in enumerate(rnd.sample(shown, rnd.choice([0, 0, 1, 2, 3]))):
            click = ({"query_id": qid, "action": "click", "doc_id": doc, "timestamp": ts + 1_000 + n} if n % 2 else
                     {"query_id": qid, "action_name": "click", "timestamp": ts + 1_000 + n,
                      "event_attributes": {"object": {"object_id": doc}, "position": {"ordinal": shown.index(doc) + 1}}})
            lines += [{"index": {"_index": "ubi_events", "_id": f"c{q}-{n}"}}, click]
            first_click = first_click or lines[-2:]
        if q % 5 == 0:
            for doc in rnd.sample(shown, 2) + [f"unshown{q}"]:
                lines += [{"index": {"_index": "ubi_events"}},
                          {"query_id": qid, "action": "judgment", "doc_id": doc, "grade": rnd.choice([0, 1, 2, 3]),
                           "timestamp": ts + 60_000}]
    lines += first_click   # again, with its _id: a duplicate
    lines += ['{"query_id": "broken', {"index": {"_index": "ubi_sessions"}}, {"query_id": "q1", "timestamp": start}]
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return (len(lines) - 3) // 2


def table(output: str) -> list[str]:
    """The rows of the report table, from its column header on."""
    lines = output.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("ranker ")):]


def committed_to_the_end(bootstrap: str, group: str, topics: Topics):
    """A check that the group has committed every partition to its end (serve commits a
    batch once Redis holds it), and the number of messages in the topics."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    partitions = [TopicPartition(t, p) for t in (topics.impressions, topics.feedback) for p in range(PARTITIONS)]
    end = consumer.end_offsets(partitions)
    return (lambda: all((consumer.committed(tp) or 0) == end[tp] for tp in partitions)), sum(end.values()), consumer


def replay_serve_report(kafka_bootstrap: str, redis_url: str, tmp_path: Path, export: Path, produced: int,
                        settled: Callable[[dict], bool] = lambda events: True):
    """Replay into fresh topics and serve them into a fresh Redis prefix until committed to
    the end and `settled(serve's event outcomes)` (lists assembled from impression events
    settle once serve has read its partitions to the end and they waited windows.list_settle);
    then report. Returns (replay's output, serve's event outcomes, the report's table and JSON)."""
    topics = unique_topics()  # replay creates them
    group, prefix = f"g-{uuid.uuid4().hex[:6]}", f"rm-{uuid.uuid4().hex[:6]}"
    serve = Serve(kafka_bootstrap, redis_url, topics, group, prefix, log_path=tmp_path / "serve.log")
    out = subprocess.run([RANKMETER, "replay", "--create-topics", str(PARTITIONS), str(export)],
                         capture_output=True, text=True, timeout=60, env=serve.env)
    assert out.returncode == 0, out.stderr
    summary = out.stdout
    with serve:  # starts it (the topics exist already); stops it at the end
        done, in_topics, consumer = committed_to_the_end(kafka_bootstrap, group, topics)
        try:
            assert in_topics == produced
            wait_until(done, 60, "serve to commit both topics to their end")
        finally:
            consumer.close()
        wait_until(lambda: settled({k: v for k, v in serve.events().items() if v}), 60, "the lists to settle")
        events = {k: v for k, v in serve.events().items() if v}
    report = {}
    for fmt in ("table", "json"):
        out = subprocess.run([RANKMETER, "report", "--window", "24h", "--format", fmt], capture_output=True,
                             text=True, timeout=60, env=serve.env)
        assert out.returncode == 0, out.stderr
        report[fmt] = out.stdout
    return summary, events, table(report["table"]), json.loads(report["json"])


def embedded(files: list[Path]):
    inputs = replay.open_inputs([str(f) for f in files])
    try:
        return replay.embedded(config.load(None, environ={}), inputs)
    finally:
        for i in inputs:
            i.close()


def embedded_table(files: list[Path]) -> list[str]:
    out = subprocess.run([RANKMETER, "replay", "--embedded", *map(str, files)], capture_output=True, text=True,
                         timeout=60, env=CLEAN_ENV)
    assert out.returncode == 0, out.stderr
    return table(out.stdout)


def assert_same_numbers(views, reported: list[dict]) -> None:
    """Every sum of every ranker of the 24h window: equal up to the order of the additions
    (partitions differ: Kafka's murmur2, the in-process bus's crc32)."""
    ours = {v.ranker: v for v in views if v.window == "24h"}
    assert sorted(ours) == sorted(r["ranker"] for r in reported)
    for r in reported:
        view = ours[r["ranker"]]
        assert (view.queries_all, view.queries_judged) == (r["queries_all"], r["queries_judged"])
        assert set(view.sums) == set(r["sums"])
        for metric, sums in r["sums"].items():
            assert list(view.sums[metric]) == pytest.approx(list(sums.values()), rel=1e-12, abs=1e-12), metric


def test_replay_into_serve_reports_the_numbers_of_replay_embedded(kafka_bootstrap, redis_url, tmp_path):
    export = tmp_path / "ubi_export.ndjson"
    produced = native_export(export, int(time.time() * 1000), seed=12)
    summary, events, report_table, report_json = replay_serve_report(kafka_bootstrap, redis_url, tmp_path,
                                                                      export, produced)
    files = [export]
    assert f"produced {produced:,}, 2 skipped" in summary and "ubi_export.ndjson:" in summary
    assert embedded_table(files) == report_table       # the printed table, line for line
    assert len(report_table) == 3 and report_table[1].startswith("bm25 ") and report_table[2].startswith("ltr-v2 ")

    _, result = embedded(files)
    assert {k: float(v) for k, v in result.outcomes.items() if v} == events   # each event's fate, the same
    assert events[("feedback", "duplicate")] == 1 and events[("impressions", "applied")] == 240
    assert_same_numbers(result.views, report_json)


def iso(ms: int) -> str:
    """The UBI data generator's timestamps: `%Y-%m-%dT%H:%M:%S.%f`[:-3] + "Z"."""
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def generator_export(tmp_path: Path, now_ms: int, seed: int, queries: int) -> tuple[Path, Path]:
    """The same searches as the UBI data generator's --generate-ndjson writes them (query
    records without hit ids, the ranker in `application`; an `impression` event per shown
    product with its 0-based position; clicks) and as native events."""
    rnd = random.Random(seed)
    bulk, native = [], []
    for q in range(queries):
        qid, ranker = str(uuid.UUID(int=rnd.getrandbits(128))), ("esci_ubi_sample" if q % 2 else "esci-ltr")
        ts = now_ms - 50 * 60_000 + q * 5_000
        shown = rnd.sample([f"B0{n:05d}" for n in range(80)], rnd.randint(3, 8))
        row = {"application": ranker, "query_id": qid, "client_id": f"c{q}", "user_query": f"query {q % 7}"}
        bulk += [{"index": {"_index": "ubi_queries", "_id": str(uuid.UUID(int=rnd.getrandbits(128)))}},
                 {**row, "query_attributes": {}, "timestamp": iso(ts)}]
        native.append({"query_id": qid, "ranker": ranker, "timestamp": ts, "results": shown})

        def event(action: str, product: str, at_ms: int) -> dict:
            return {"application": ranker, "action_name": action, "query_id": qid, "session_id": f"s{q}",
                    "client_id": f"c{q}", "timestamp": iso(at_ms), "user_query": row["user_query"],
                    "message_type": None, "message": None,
                    "event_attributes": {"object": {"object_id": product, "object_id_field": "product_id",
                                                    "search_config": "teamA"},
                                         "position": {"ordinal": shown.index(product)}}}

        events = [event("impression", product, ts) for product in shown]
        at = ts
        for product in rnd.sample(shown, rnd.choice([0, 0, 1, 2])):
            at += rnd.randrange(500, 4_000)
            events.append(event("click", product, at))
            native.append({"query_id": qid, "action": "click", "doc_id": product, "timestamp": at})
        for e in events:
            bulk += [{"index": {"_index": "ubi_events", "_id": str(uuid.UUID(int=rnd.getrandbits(128)))}}, e]
    paths = tmp_path / "ubi_queries_events.ndjson", tmp_path / "native.ndjson"
    for path, lines in zip(paths, (bulk, native)):
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return paths


def test_generator_shaped_export_into_serve_reports_the_numbers_of_replay_embedded(kafka_bootstrap, redis_url,
                                                                                   tmp_path):
    queries = 150
    export, native = generator_export(tmp_path, int(time.time() * 1000), seed=21, queries=queries)
    produced = sum(1 for _ in open(export)) // 2

    def settled(events: dict) -> bool:   # every list assembled and evaluated
        return events.get(("impressions", "applied"), 0) == queries

    summary, events, report_table, report_json = replay_serve_report(
        kafka_bootstrap, redis_url, tmp_path, export, produced, settled)
    files = [export]
    assert f"produced {produced:,}" in summary and "skipped" not in summary
    assert embedded_table(files) == report_table
    # What the generator's shape says is what the native events say.
    assert embedded_table([native]) == report_table
    assert [row.split()[0] for row in report_table[1:]] == ["esci-ltr", "esci_ubi_sample"]
    assert sum(int(row.split()[1]) for row in report_table[1:]) == queries

    _, result = embedded(files)
    assert {k: float(v) for k, v in result.outcomes.items() if v} == events
    assert events[("feedback", "listed")] == produced - queries - events.get(("feedback", "applied"), 0)
    assert_same_numbers(result.views, report_json)
