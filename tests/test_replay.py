"""`rankmeter replay` in-process: every input format into the right (topic, key, timestamp,
value), bad records reported by FILE:LINE while the rest goes through, judgments from
ESCI labels, the progress bar, and `--embedded`'s numbers against pytrec_eval."""

from __future__ import annotations

import io
import json
import random
import subprocess
from pathlib import Path
from statistics import fmean

import msgspec
import pytest
import pytrec_eval
from kafka.errors import KafkaTimeoutError

from rankmeter import config, replay
from rankmeter.events import event_time_ms
from rankmeter.trec import InputError
from test_eval_cli import RANKMETER

TOPICS = {"impressions": "imp", "feedback": "fb"}
T0 = "2024-06-01T00:00:05.123Z"
T0_MS = 1_717_200_005_123   # 2024-06-01T00:00:00Z is 1,717,200,000 s


def write(tmp_path: Path, name: str, lines: list) -> str:
    """Lines as they are when str, else as json.dumps writes them (as the generator does)."""
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def replayed(*paths: str, fmt: str | None = None, judgments: replay.Judgments | None = None):
    sent = []
    inputs = replay.open_inputs(paths, fmt)
    try:
        summary = replay.replay(inputs, lambda t, k, v, ts: sent.append((t, k.decode(), ts, json.loads(v))),
                                TOPICS, judgments)
    finally:
        for i in inputs:
            i.close()
    return sent, summary


def generator_query(qid: str, ts: str = T0) -> dict:
    """What the UBI data generator's make_query_event writes."""
    return {"application": "esci_ubi_sample", "query_id": qid, "client_id": "c-1", "user_query": "usb c cable",
            "query_attributes": {}, "timestamp": ts}


def generator_event(qid: str, action: str, product: str, position: int, ts: str = T0) -> dict:
    """What its make_ubi_event writes (positions 0-based, as np.arange makes them)."""
    return {"application": "esci_ubi_sample", "action_name": action, "query_id": qid, "session_id": "s-1",
            "client_id": "c-1", "timestamp": ts, "user_query": "usb c cable", "message_type": None,
            "message": None,
            "event_attributes": {"object": {"object_id": product, "object_id_field": "product_id",
                                            "search_config": "teamA"},
                                 "position": {"ordinal": position}}}


# ---- formats ------------------------------------------------------------------

def test_generator_bulk_ndjson_goes_to_the_topics_by_index_keyed_with_event_time(tmp_path):
    query = generator_query("q-1")
    shown = generator_event("q-1", "impression", "B000123", 0)
    click = generator_event("q-1", "click", "B000123", 0, ts="2024-06-01T00:00:07.500Z")
    own_id = {**generator_event("q-1", "click", "B0007", 1, ts="2024-06-01T00:00:09.000Z"), "message_id": "m-7"}
    path = write(tmp_path, "ubi_queries_events.ndjson", [
        {"index": {"_index": "ubi_queries", "_id": "a1"}}, query,
        {"index": {"_index": "ubi_events", "_id": "a2"}}, shown,
        {"create": {"_index": "ubi_events", "_id": "a3"}}, click,
        {"index": {"_index": "my-shop-ubi_events", "_id": "a4"}}, own_id])
    sent, summary = replayed(path)
    assert sent == [
        ("imp", "q-1", T0_MS, query),                         # a query gets no id from _id: its key is its id
        ("fb", "q-1", T0_MS, {**shown, "message_id": "a2"}),  # an event without one is identified by _id
        ("fb", "q-1", T0_MS + 2377, {**click, "message_id": "a3"}),
        ("fb", "q-1", T0_MS + 3877, own_id),                  # its own message_id stays
    ]
    assert (summary.read, summary.skipped, dict(summary.produced)) == (4, 0, {"imp": 1, "fb": 3})


def test_plain_ndjson_is_recognised_per_record(tmp_path):
    native_impression = {"query_id": "n1", "ranker": "bm25", "timestamp": 1_700_000_000_000, "results": ["a", "b"]}
    native_click = {"query_id": "n1", "action": "click", "doc_id": "b", "timestamp": 1_700_000_001_000}
    ubi_query = {"query_id": "u1", "timestamp": "2024-06-01T02:00:00+02:00", "application": "shop",
                 "query_response_hit_ids": [101, 102]}
    collector_query = {"query_id": "u2", "timestamp": T0, "user_query": "tent", "query_response_hit_ids": []}
    ubi_click = {"query_id": "u1", "timestamp": T0, "action_name": "click",
                 "event_attributes": {"object": {"object_id": "102"}, "position": {"ordinal": 2}}}
    path = write(tmp_path, "mixed.ndjson", [native_impression, "", native_click, ubi_query, collector_query,
                                            ubi_click])
    sent, summary = replayed(path)
    assert sent == [("imp", "n1", 1_700_000_000_000, native_impression),
                    ("fb", "n1", 1_700_000_001_000, native_click),
                    ("imp", "u1", 1_717_200_000_000, ubi_query),   # 02:00 at +02:00 is midnight UTC
                    ("imp", "u2", T0_MS, collector_query),
                    ("fb", "u1", T0_MS, ubi_click)]                # plain ndjson: nothing added
    assert (summary.read, summary.skipped) == (5, 0)


def test_generator_csvs_become_exactly_the_generator_json(tmp_path):
    # As pandas' to_csv(index=False) writes the generator's frames: a query with a comma is quoted.
    queries = tmp_path / "ubi_queries.csv"
    queries.write_text("application,query_id,client_id,user_query,timestamp\n"
                       f'esci_ubi_sample,q-1,c-1,"cable, usb c",{T0}\n')
    events = tmp_path / "ubi_events.csv"
    events.write_text("object_id,position,object_id_field,application,action_name,query_id,user_query,"
                      "session_id,client_id,timestamp,search_config\n"
                      f'0012345,0,product_id,esci_ubi_sample,impression,q-1,"cable, usb c",s-1,c-1,{T0},teamA\n'
                      f'B07XYZ,1,product_id,esci_ubi_sample,impression,q-1,"cable, usb c",s-1,c-1,{T0},teamB\n'
                      'B07XYZ,1.0,product_id,esci_ubi_sample,click,q-1,"cable, usb c",s-1,c-1,'
                      '2024-06-01T00:00:06.000Z,teamA\n')
    sent, summary = replayed(str(queries), str(events))
    query = {**generator_query("q-1"), "user_query": "cable, usb c"}
    first = generator_event("q-1", "impression", "0012345", 0)   # a numeric-looking id stays a string
    second = {**generator_event("q-1", "impression", "B07XYZ", 1)}
    second["event_attributes"]["object"]["search_config"] = "teamB"
    click = generator_event("q-1", "click", "B07XYZ", 1, ts="2024-06-01T00:00:06.000Z")
    for e in (first, second, click):
        e["user_query"] = "cable, usb c"
    assert sent == [("imp", "q-1", T0_MS, query), ("fb", "q-1", T0_MS, first), ("fb", "q-1", T0_MS, second),
                    ("fb", "q-1", T0_MS + 877, click)]
    assert list(sent[0][3]) == ["application", "query_id", "client_id", "user_query", "query_attributes",
                                "timestamp"]                     # the generator's key order too
    assert isinstance(sent[3][3]["event_attributes"]["position"]["ordinal"], int)
    assert summary.skipped == 0


def test_format_is_forced_or_detected_per_file(tmp_path):
    bulk = write(tmp_path, "export.json", ["{not json", {"index": {"_index": "ubi_queries"}},
                                           generator_query("q-1")])
    plain = write(tmp_path, "plain.json", [generator_query("q-2")])
    inputs = replay.open_inputs([bulk, plain])
    assert [i.format for i in inputs] == ["bulk", "ndjson"]   # a broken first line does not decide
    for i in inputs:
        i.close()
    # Forced to plain ndjson, the action line is a record of neither kind.
    sent, summary = replayed(bulk, fmt="ndjson")
    assert [s[1] for s in sent] == ["q-1"]
    assert [(s.where, s.reason) for s in summary.listed] == [
        (f"{bulk}:1", "broken JSON"), (f"{bulk}:2", "neither a query nor an event")]


def test_a_pipe_is_read_once_its_format_is_given(tmp_path):
    record = json.dumps(generator_query("q1"))
    out = subprocess.run(["bash", "-c", f"{RANKMETER} replay --embedded --format ndjson <(echo '{record}')"],
                         capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and "read 1 record from 1 file; produced 1" in out.stdout, out.stderr
    out = subprocess.run(["bash", "-c", f"{RANKMETER} replay --embedded <(echo '{record}')"],
                         capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and out.stderr.endswith(": not a regular file: give its --format\n")
    assert out.stderr.count("\n") == 1


# ---- bad records ----------------------------------------------------------------

def test_bad_records_are_reported_by_line_and_counted_while_the_rest_goes_through(tmp_path):
    good = [generator_query(f"q{i}") for i in range(4)]
    path = write(tmp_path, "bad.ndjson", [
        {"index": {"_index": "ubi_queries", "_id": "1"}}, good[0],                  # 1-2
        {"index": {"_index": "ubi_queries", "_id": "2"}}, '{"query_id": "q9", ',    # 3-4 broken JSON
        {"index": {"_index": "ubi_queries", "_id": "3"}},                           # 5 no record: an action follows
        {"index": {"_index": "ubi_events", "_id": "4"}}, {"action_name": "click", "timestamp": T0},  # 6-7
        {"index": {"_index": "products", "_id": "5"}}, good[1],                     # 8-9 unknown index
        {"index": {"_index": "ubi_queries", "_id": "6"}}, good[2],                  # 10-11
        {"index": {"_index": "ubi_queries"}}, {**good[3], "timestamp": "2024-06-01T00:00:00"},  # 12-13
        {"index": {"_index": "ubi_queries"}}, [1, 2],                               # 14-15
        good[3],                                                                    # 16 no action line
        {"delete": {"_index": "ubi_queries", "_id": "1"}},                          # 17
        {"index": {"_index": "ubi_queries", "_id": "7"}},                           # 18 no record at the end
    ])
    sent, summary = replayed(path)
    assert [s[1] for s in sent] == ["q0", "q2"]
    assert [(s.where.rsplit(":", 1)[1], s.reason) for s in summary.listed] == [
        ("4", "broken JSON"), ("5", "action line without a record"), ("7", "no query_id"),
        ("9", "unknown index products"), ("13", "bad timestamp"), ("15", "not a JSON object"),
        ("16", "record without an action line"), ("17", "delete action"), ("18", "action line without a record")]
    assert summary.listed[4].detail == "timestamp '2024-06-01T00:00:00' has no time zone"
    assert summary.read == 2 + 6 and summary.skipped == 9   # action lines alone are no records
    text = summary.text()
    assert f"  {path}:9: unknown index products" in text and "read 8 records from 1 file; produced 2, 9 skipped" in text


def test_bad_csv_rows_are_skipped_and_a_bad_header_refuses_the_file(tmp_path):
    events = tmp_path / "ubi_events.csv"
    header = ("object_id,position,object_id_field,application,action_name,query_id,user_query,"
              "session_id,client_id,timestamp,search_config\n")
    row = "B01,{pos},product_id,app,click,{qid},shoes,s,c,{ts},teamA\n"
    events.write_bytes((header + row.format(pos=0, qid="q1", ts=T0)
                        + "B02,1,product_id,app,click,q1\n"                       # 3: too few fields
                        + row.format(pos="second", qid="q1", ts=T0)                # 4
                        + row.format(pos=2, qid="", ts=T0)                         # 5
                        + '"B03\nB04",3,product_id,app,click,q1,shoes,s,c,' + T0 + ",teamA\n"  # 6-7: one row
                        + row.format(pos=4, qid="q1", ts="yesterday")              # 8
                        + "\n").encode() + "B\xff5,5,product_id,app,click,q1,shoes,s,c,".encode("latin-1")
                       + f"{T0},teamA\n".encode() + row.format(pos=6, qid="q2", ts=T0).encode())
    sent, summary = replayed(str(events))
    assert [(s[1], s[3]["event_attributes"]["object"]["object_id"]) for s in sent] == [
        ("q1", "B01"), ("q1", "B03\nB04"), ("q2", "B01")]
    assert [(s.where.rsplit(":", 1)[1], s.reason, s.detail) for s in summary.listed] == [
        ("3", "bad CSV row", "6 fields, the header has 11"),
        ("4", "bad CSV row", "position 'second' is not an integer"),
        ("5", "no query_id", ""),
        ("8", "bad timestamp", "timestamp 'yesterday' is not RFC 3339 or epoch milliseconds"),
        ("10", "not UTF-8", "")]

    odd = tmp_path / "other.csv"
    odd.write_text("query_id,when\nq1,now\n")
    with pytest.raises(InputError, match=r"other.csv:1: not a UBI data generator CSV: no column application, "
                                         r"client_id, user_query, timestamp"):
        replay.open_inputs([str(odd)])


def test_at_most_twenty_bad_lines_are_listed_and_all_counted(tmp_path):
    path = write(tmp_path, "many.ndjson", ["{oops"] * 25 + [generator_query("q1")])
    sent, summary = replayed(path)
    text = summary.text()
    assert len(sent) == 1 and summary.skipped == 25 and len(summary.listed) == 20
    assert f"{path}:20: broken JSON" in text and f"{path}:21:" not in text and "… and 5 more" in text
    assert "          25  broken JSON" in text


# ---- judgments -----------------------------------------------------------------

def test_judgments_from_esci_labels_follow_their_query(tmp_path):
    labels = tmp_path / "examples.csv"
    labels.write_text("example_id,query,query_id,product_id,product_locale,esci_label\n"
                      "1,usb c cable,7,B01,us,E\n2,usb c cable,7,B02,us,I\n3,tent,8,B09,us,S\n"
                      "4,usb c cable,7,B01,us,S\n"   # a repeated pair: the last label wins
                      "5,usb c cable,7,,us,C\n")     # no product: skipped
    judgments = replay.load_judgments(str(labels))
    query = generator_query("q-1")
    path = write(tmp_path, "q.ndjson", [query, generator_event("q-1", "click", "B01", 0),
                                        {**generator_query("q-2"), "user_query": "unlabelled"}])
    sent, summary = replayed(path, judgments=judgments)
    judgment = {"query_id": "q-1", "timestamp": T0, "action": "judgment"}
    assert sent == [
        ("imp", "q-1", T0_MS, query),
        ("fb", "q-1", T0_MS, {"event_id": "q-1:judgment:B01", **judgment, "doc_id": "B01", "label": "S"}),
        ("fb", "q-1", T0_MS, {"event_id": "q-1:judgment:B02", **judgment, "doc_id": "B02", "label": "I"}),
        ("fb", "q-1", T0_MS, generator_event("q-1", "click", "B01", 0)),
        ("imp", "q-2", T0_MS, {**generator_query("q-2"), "user_query": "unlabelled"})]
    assert summary.judgments == 2 and summary.read == 3
    assert [(s.where, s.reason) for s in summary.listed] == [(f"{labels}:6", "bad judgment row")]

    other = tmp_path / "other.csv"
    other.write_text("user_query,doc_id,label\ntent,B09,Exact\n")
    assert replay.load_judgments(str(other)).labels == {"tent": {"B09": "Exact"}}
    other.write_text("query,product,grade\ntent,B09,3\n")
    with pytest.raises(InputError, match="other.csv:1: a judgments CSV needs the columns"):
        replay.load_judgments(str(other))


# ---- event time and progress ------------------------------------------------------

@pytest.mark.parametrize("value, ms", [(1_700_000_000_123, 1_700_000_000_123), (T0, T0_MS),
                                       ("2024-06-01T00:00:05.123456+00:00", T0_MS),
                                       ("2024-06-01T01:00:05.123+01:00", T0_MS)])
def test_event_time(value, ms):
    assert event_time_ms(value) == ms


@pytest.mark.parametrize("value", [None, True, 1.5, "2024-06-01", "2024-06-01T00:00:00", "1717200005123"])
def test_event_time_refuses_what_the_decoder_refuses(value):
    with pytest.raises(ValueError):
        event_time_ms(value)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_at_most_four_times_a_second_and_only_when_asked():
    now = [100.0]
    out = Terminal()
    progress = replay.Progress(1000, out, clock=lambda: now[0])
    for step in range(32):                 # 32 updates over 2 s (1/16 s is exact in binary)
        progress(step * 25, f"{step} records")
        now[0] += 0.0625
    progress(1000, "done", force=True)
    progress.close()
    frames = out.getvalue().split("\r")[1:]
    assert len(frames) == 9                # at 0, 0.25, …, 1.75 s, and the forced last one
    assert frames[0].startswith("replay [                        ]   0% 0 records (0 s)")
    assert frames[1].startswith("replay [##                      ]  10% 4 records (0 s)")
    assert frames[-1].startswith("replay [########################] 100% done (2 s)") and out.getvalue().endswith("\n")
    silent = replay.Progress(10, None)
    silent(5, "x", force=True)             # no stream (not a terminal, no --progress): nothing


# ---- --embedded against pytrec_eval ---------------------------------------------

def collection(seed: int, queries: int, start_ms: int):
    """UBI queries with hit ids, UBI clicks (1-based ordinals), native judgments (some of
    documents not shown), and queries without any feedback; with the qrels they make."""
    rnd = random.Random(seed)
    records, runs, qrels = [], {"bm25": {}, "ltr": {}}, {}
    for q in range(queries):
        qid, ranker = f"q{q}", ("bm25" if q % 3 else "ltr")
        ts = start_ms + q * 20_000
        shown = rnd.sample([f"d{i}" for i in range(30)], 10)
        records.append({"query_id": qid, "timestamp": ts, "application": "shop",
                        "query_attributes": {"ranker": ranker}, "query_response_hit_ids": shown})
        runs[ranker][qid] = {d: float(10 - r) for r, d in enumerate(shown)}
        grades: dict[str, float] = {}
        for doc in rnd.sample(shown, rnd.choice([0, 0, 1, 2, 3])):
            records.append({"query_id": qid, "timestamp": ts + rnd.randrange(1000, 60_000), "action_name": "click",
                            "event_attributes": {"object": {"object_id": doc},
                                                 "position": {"ordinal": shown.index(doc) + 1}}})
            grades[doc] = 1.0
        if q % 4 == 0:
            for doc in rnd.sample(shown[:5], 2) + [f"x{q}"]:  # the last was never shown
                grade = rnd.choice([0, 1, 2, 3])
                records.append({"query_id": qid, "timestamp": ts + 90_000, "action": "judgment", "doc_id": doc,
                                "grade": grade})
                grades[doc] = float(grade)   # an explicit judgment replaces the click's grade
        qrels[qid] = {d: int(g) for d, g in grades.items()}
    return records, runs, qrels


def test_embedded_numbers_equal_pytrec_eval_and_the_click_counts(tmp_path):
    records, runs, qrels = collection(seed=5, queries=60, start_ms=1_700_000_000_000)
    random.Random(1).shuffle(records)      # feedback before its query, as a merged export may have it
    path = write(tmp_path, "logged.ndjson", records)
    settings = config.load(None, environ={})
    inputs = replay.open_inputs([path])
    summary, result = replay.embedded(settings, inputs)
    inputs[0].close()
    assert summary.skipped == 0 and summary.read == len(records)

    clicked = {}   # query -> distinct clicked shown documents
    for r in records:
        if r.get("action_name") == "click":
            clicked.setdefault(r["query_id"], set()).add(r["event_attributes"]["object"]["object_id"])
    views = {v.ranker: v for v in result.views if v.window == "24h" and v.segment == ""}
    assert set(views) == {"bm25", "ltr"}
    for ranker, run in runs.items():
        judged = [q for q in run if any(g >= 1 for g in qrels[q].values())]
        per_query = pytrec_eval.RelevanceEvaluator({q: qrels[q] for q in judged},
                                                   {"ndcg_cut.10", "P.10", "map"}).evaluate(
            {q: run[q] for q in judged})
        view = views[ranker]
        assert (view.queries_all, view.queries_judged) == (len(run), len(judged))
        for ours, theirs in (("nDCG@10", "ndcg_cut_10"), ("P@10", "P_10"), ("AP", "map")):
            assert view.sums[ours].macro() == pytest.approx(fmean(per_query[q][theirs] for q in judged),
                                                            abs=1e-12), (ranker, ours)
        assert view.sums["CTR"].micro() == pytest.approx(
            sum(len(clicked.get(q, ())) for q in run) / (10 * len(run)), abs=1e-12)
        assert view.sums["Abandonment"].macro() == pytest.approx(
            sum(1 for q in run if q not in clicked) / len(run), abs=1e-12)
    assert result.now_ms == max(r["timestamp"] for r in records)   # windows end at the last event


def test_embedded_cli_prints_the_report_table_with_those_numbers(tmp_path):
    records, runs, qrels = collection(seed=8, queries=45, start_ms=1_700_000_000_000)
    path = write(tmp_path, "logged.ndjson", records + ["{broken"])
    out = subprocess.run([RANKMETER, "replay", "--embedded", "--baseline", "ltr", path], capture_output=True,
                         text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""                # no progress bar off a terminal, no log lines
    assert f"read {len(records) + 1:,} records from 1 file; produced {len(records):,}, 1 skipped" in out.stdout
    assert f"{path}:{len(records) + 1}: broken JSON" in out.stdout
    assert "window 24h ending at the last replayed event, 2023-11-14T22:" in out.stdout
    for ranker, run in runs.items():
        judged = [q for q in run if any(g >= 1 for g in qrels[q].values())]
        per_query = pytrec_eval.RelevanceEvaluator({q: qrels[q] for q in judged}, {"ndcg_cut.10", "P.10", "map"}
                                                   ).evaluate({q: run[q] for q in judged})
        row = next(line.split() for line in out.stdout.splitlines() if line.startswith(ranker + " "))
        assert int(row[1]) == len(run)
        for column, measure in ((2, "ndcg_cut_10"), (3, "P_10"), (4, "map")):
            assert row[column] == f"{fmean(per_query[q][measure] for q in judged):.4f}", (ranker, measure)
    assert "Δ vs ltr" in out.stdout


def test_embedded_judgments_from_labels_are_graded_by_the_label_map(tmp_path):
    """ESCI labels through evaluation.labels (Exact 3, Substitute 2, Complement 1, Irrelevant 0)."""
    rnd = random.Random(4)
    labels = {f"query {n}": {f"p{i}": rnd.choice("ESCI") for i in rnd.sample(range(12), 6)} for n in range(8)}
    (tmp_path / "examples.csv").write_text("query,product_id,esci_label\n" + "".join(
        f"{q},{p},{label}\n" for q, products in labels.items() for p, label in products.items()))
    records, run, qrels = [], {}, {}
    for n in range(20):
        qid, text = f"q{n}", f"query {n % 8}"
        shown = rnd.sample([f"p{i}" for i in range(12)], 8)
        records.append({"query_id": qid, "timestamp": 1_700_000_000_000 + n, "application": "shop",
                        "user_query": text, "query_response_hit_ids": shown})
        run[qid] = {d: float(8 - r) for r, d in enumerate(shown)}
        qrels[qid] = {p: {"E": 3, "S": 2, "C": 1, "I": 0}[label] for p, label in labels[text].items()}
    path = write(tmp_path, "queries.ndjson", records)
    out = subprocess.run([RANKMETER, "replay", "--embedded", "--judgments", str(tmp_path / "examples.csv"), path],
                         capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert f"(judgments among them: {sum(len(labels[f'query {n % 8}']) for n in range(20))})" in out.stdout
    judged = [q for q in run if any(g >= 1 for g in qrels[q].values())]
    per_query = pytrec_eval.RelevanceEvaluator({q: qrels[q] for q in judged}, {"ndcg_cut.10"}).evaluate(
        {q: run[q] for q in judged})
    row = next(line.split() for line in out.stdout.splitlines() if line.startswith("shop "))
    assert row[2] == f"{fmean(per_query[q]['ndcg_cut_10'] for q in judged):.4f}"
    assert "invalid" not in out.stdout     # every judgment graded: none dead-lettered


# ---- the command's errors ---------------------------------------------------------

def run_replay(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([RANKMETER, "replay", *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={"PATH": "/usr/bin:/bin"})


def test_a_record_kafka_cannot_take_is_kafka_pythons_own_error():
    # The command turns kafka-python's errors into one line (as for a broker it cannot reach
    # at start); the shared producer's SourceUnavailable is not one of them.
    settings = config.load(None, {"RANKMETER_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    # No broker: a known api_version (a tuple) builds the client; the topic's metadata never comes.
    client = {"api_version": (3, 9), "max_block_ms": 100}
    sink = replay.KafkaSink(msgspec.structs.replace(settings, kafka=msgspec.structs.replace(settings.kafka,
                                                                                            client=client)))
    try:
        with pytest.raises(KafkaTimeoutError, match="Failed to update metadata after 0.1 secs"):
            sink("imp", b"q1", b"{}", T0_MS)
    finally:
        sink.close()


def test_a_file_that_cannot_be_opened_is_one_line_and_exit_2(tmp_path):
    good = write(tmp_path, "good.ndjson", [generator_query("q1")])
    out = run_replay("--embedded", good, str(tmp_path / "missing.ndjson"))
    assert out.returncode == 2 and out.stdout == ""    # nothing replayed: every file is opened first
    assert out.stderr == f"rankmeter replay: error: {tmp_path}/missing.ndjson: cannot open: No such file or directory\n"
    odd = tmp_path / "odd.csv"
    odd.write_text("a,b\n1,2\n")
    out = run_replay("--embedded", str(odd))
    assert out.returncode == 2 and out.stderr.startswith(f"rankmeter replay: error: {odd}:1: not a UBI data")
    assert out.stderr.count("\n") == 1


def test_every_record_skipped_is_exit_2_with_the_summary(tmp_path):
    path = write(tmp_path, "bad.ndjson", ["{oops", {"user_query": "no id", "timestamp": T0}])
    out = run_replay("--embedded", path)
    assert out.returncode == 2
    assert f"{path}:1: broken JSON" in out.stdout and f"{path}:2: no query_id" in out.stdout
    assert out.stderr == "rankmeter replay: error: every record was skipped (2): nothing produced\n"


def test_any_window_with_embedded_ends_at_the_last_event(tmp_path):
    day = 86_400_000
    last = 1_700_000_000_000
    records = [{"query_id": f"q{d}", "ranker": "bm25", "timestamp": last - d * day + 1, "results": ["a"]}
               for d in range(6, -1, -1)]   # one query a day for a week, each 1 ms after a day boundary
    path = write(tmp_path, "week.ndjson", records)
    for window, queries in (("7d", 7), ("3d", 3), (None, 1)):   # default: the largest configured, 24h
        out = run_replay("--embedded", *(["--window", window] if window else []), path)
        assert out.returncode == 0, out.stderr
        row = next(line.split() for line in out.stdout.splitlines() if line.startswith("bm25 "))
        assert int(row[1]) == queries, window
    out = run_replay("--embedded", "--window", "week", path)
    assert out.returncode == 2 and out.stderr == (
        "rankmeter replay: error: --window: 'week' is not a duration like 30s, 5m, 1h, 7d or 2d14h\n")
    out = run_replay("--window", "1h", path)
    assert out.returncode == 2 and "--window and --baseline need --embedded" in out.stderr


def test_embedded_takes_a_file_spanning_more_than_max_past(tmp_path):
    # The generator's default week often spans more than 7 days: the end read first (the
    # bus hands over one topic's partition after another) must not make the start too old.
    day = 86_400_000
    last = 1_700_000_000_000
    records = [{"query_id": f"q{d}", "ranker": "bm25", "timestamp": last - d * day, "results": ["a"]}
               for d in range(12)]
    records += [{"query_id": "q11", "action": "click", "doc_id": "a", "timestamp": last - 11 * day + 1000}]
    out = run_replay("--embedded", "--window", "30d", write(tmp_path, "long.ndjson", records))
    assert out.returncode == 0, out.stderr
    assert "invalid" not in out.stdout
    row = next(line.split() for line in out.stdout.splitlines() if line.startswith("bm25 "))
    assert int(row[1]) == 12


def test_plain_ndjson_recognises_a_ubi_query_record_as_the_decoder_does():
    # No hit ids and no user_query: what makes it a UBI query is the decoder's rule too.
    record = {"application": "shop", "query_id": "q1", "timestamp": T0, "query_attributes": {"ranker": "a"}}
    assert replay.recognise(record) == replay.IMPRESSIONS
    assert replay.recognise({"query_id": "q1", "timestamp": T0}) is None
