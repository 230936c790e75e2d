"""`rankmeter replay`: logged OpenSearch UBI data into rankmeter.

Reads OpenSearch bulk ndjson (the UBI data generator's `--generate-ndjson`, `_bulk`
exports), plain ndjson, or the generator's CSVs, and produces every record to the
impressions or feedback topic, keyed by its `query_id`, with its event time as the Kafka
record timestamp — or, embedded, runs the pipeline on them in-process and evaluates.

A bad record (broken JSON, no query_id, an unknown index, …) is skipped, counted and
reported by FILE:LINE; the rest goes through. Records are sent in file order: the
pipeline joins out-of-order queries and feedback as it does live.
"""

from __future__ import annotations

import csv
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timezone
from typing import IO, Any, NamedTuple, TextIO

import msgspec

from rankmeter.clock import EventClock
from rankmeter.config import Settings, duration_ms
from rankmeter.events import UBI_QUERY_KEYS, event_time_ms
from rankmeter.pipeline import Pipeline
from rankmeter.source import Bus
from rankmeter.store import MemoryStore
from rankmeter.trec import InputError
from rankmeter.windows import WindowView

IMPRESSIONS, FEEDBACK = "impressions", "feedback"
FORMATS = ("bulk", "ndjson", "csv")
MAX_LISTED = 20           # skipped records listed one by one in the summary; the rest counted
BULK_ACTIONS = ("index", "create", "update", "delete")

# The UBI data generator's CSV columns (`to_csv(index=False)` of its data frames).
QUERY_COLUMNS = ("application", "query_id", "client_id", "user_query", "timestamp")
EVENT_COLUMNS = ("object_id", "position", "object_id_field", "application", "action_name", "query_id",
                 "user_query", "session_id", "client_id", "timestamp", "search_config")
# ESCI-style judgment files: each column under either name.
JUDGMENT_COLUMNS = {"query": ("query", "user_query"), "product": ("product_id", "doc_id"),
                    "label": ("esci_label", "label")}

# send(topic, key, value, timestamp_ms): a Kafka producer, or the embedded bus.
Send = Callable[[str, bytes, bytes, int], None]


class Message(NamedTuple):
    stream: str           # IMPRESSIONS or FEEDBACK
    key: str              # the query_id
    timestamp_ms: int     # the record's event time, its Kafka timestamp
    value: dict[str, Any]  # the record as it is sent
    where: str            # FILE:LINE


class Skipped(NamedTuple):
    where: str            # FILE:LINE
    reason: str           # what kind of problem: counted per kind in the summary
    detail: str = ""      # this record's particulars, for its line in the summary
    record: bool = True   # a record was lost (not, e.g., an action line without one)


def _message(record: Any, stream: str, where: str) -> Message | Skipped:
    if not isinstance(record, dict):
        return Skipped(where, "not a JSON object")
    query_id = record.get("query_id")
    if not isinstance(query_id, str) or not query_id:
        return Skipped(where, "no query_id")
    try:
        ts = event_time_ms(record.get("timestamp"))
    except ValueError as e:
        return Skipped(where, "bad timestamp", str(e))
    return Message(stream, query_id, ts, record, where)


def recognise(record: dict[str, Any]) -> str | None:
    """The stream of a record in plain ndjson, from its fields."""
    if "action_name" in record or "action" in record:
        return FEEDBACK
    if "results" in record or "user_query" in record or UBI_QUERY_KEYS & record.keys():
        return IMPRESSIONS
    return None


def index_stream(index: str) -> str | None:
    """`ubi_queries` (or any name ending in `queries`) and `ubi_events` (… `events`)."""
    if index.endswith("queries"):
        return IMPRESSIONS
    if index.endswith("events"):
        return FEEDBACK
    return None


# ---- input files ---------------------------------------------------------------

class Input:
    """One file to replay, opened (a file that cannot be is reported before anything is
    sent) and its format decided."""

    def __init__(self, path: str, fmt: str | None = None) -> None:
        self.path = path
        try:
            self.file: IO[bytes] = open(path, "rb")
            self.size = os.fstat(self.file.fileno()).st_size
        except OSError as e:
            raise InputError(path, None, f"cannot open: {e.strerror or e}") from None
        # A pipe (`<(zcat export.ndjson.gz)`) is read once: its format must be given.
        self.seekable = self.file.seekable()
        if fmt is None and not self.seekable and not path.lower().endswith(".csv"):
            self.file.close()
            raise InputError(path, None, "not a regular file: give its --format")
        self.format = fmt or self._detect()
        self.columns: tuple[str, ...] = ()
        if self.format == "csv":
            self.columns = self._csv_header()

    def position(self) -> int:
        """Bytes read so far (for the progress bar; a pipe's size is unknown)."""
        return self.file.tell() if self.seekable else 0

    def close(self) -> None:
        self.file.close()

    def _detect(self) -> str:
        """`.csv` by name; else bulk when the first JSON line is a bulk action line."""
        if self.path.lower().endswith(".csv"):
            return "csv"
        found = "ndjson"
        for n, line in enumerate(self.file):
            if n >= 100:
                break
            try:
                first = json.loads(line) if line.strip() else None
            except ValueError:
                continue  # a broken line: the next one decides
            if first is not None:
                found = "bulk" if _action(first) else "ndjson"
                break
        self.file.seek(0)
        return found

    def _csv_header(self) -> tuple[str, ...]:
        line = self.file.readline()
        try:
            header = next(csv.reader([line.decode("utf-8-sig")]), [])
        except (UnicodeDecodeError, csv.Error) as e:
            raise InputError(self.path, 1, f"not a CSV header: {e}") from None
        columns = tuple(c.strip() for c in header)
        wanted = EVENT_COLUMNS if "action_name" in columns else QUERY_COLUMNS
        missing = [c for c in wanted if c not in columns]
        if missing:
            raise InputError(self.path, 1, f"not a UBI data generator CSV: no column {', '.join(missing)} "
                                           f"(queries have {', '.join(QUERY_COLUMNS)}; events "
                                           f"{', '.join(EVENT_COLUMNS)})")
        return columns

    def items(self) -> Iterator[Message | Skipped]:
        if self.format == "bulk":
            return _bulk(self.path, self.file)
        if self.format == "ndjson":
            return _ndjson(self.path, self.file)
        return _csv(self.path, self.file, self.columns)


def _action(line: Any) -> tuple[str, dict[str, Any]] | None:
    """(action, its metadata) when `line` is a bulk action line: one key, an action name,
    whose value is an object."""
    if isinstance(line, dict) and len(line) == 1:
        (name, meta), = line.items()
        if name in BULK_ACTIONS and isinstance(meta, dict):
            return name, meta
    return None


def _json_lines(path: str, f: IO[bytes]) -> Iterator[tuple[str, Any | Skipped]]:
    """(FILE:LINE, the parsed line or why it is not JSON) for each non-blank line."""
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            yield where, json.loads(line)
        except UnicodeDecodeError:
            yield where, Skipped(where, "not UTF-8")
        except ValueError as e:
            yield where, Skipped(where, "broken JSON", str(e))


def _ndjson(path: str, f: IO[bytes]) -> Iterator[Message | Skipped]:
    for where, record in _json_lines(path, f):
        if isinstance(record, Skipped):
            yield record
        elif not isinstance(record, dict):
            yield Skipped(where, "not a JSON object")
        elif (stream := recognise(record)) is None:
            yield Skipped(where, "neither a query nor an event",
                          "no action_name/action, nor results/query_response_hit_ids/user_query")
        else:
            yield _message(record, stream, where)


def _bulk(path: str, f: IO[bytes]) -> Iterator[Message | Skipped]:
    """Action line, record, action line, record…: the action's `_index` decides the stream
    (without one, the record's fields do, as in plain ndjson)."""
    pending: tuple[str, str, dict[str, Any]] | None = None  # (where, action, metadata)
    for where, line in _json_lines(path, f):
        action = None if isinstance(line, Skipped) else _action(line)
        if action is not None:
            if pending is not None:
                yield Skipped(pending[0], "action line without a record", record=False)
            if action[0] == "delete":  # no record follows a delete
                yield Skipped(where, "delete action", record=False)
                pending = None
            else:
                pending = (where, *action)
            continue
        if isinstance(line, Skipped):
            pending = None  # it was that action's record
            yield line
            continue
        if pending is None:
            yield Skipped(where, "record without an action line")
            continue
        _, name, meta = pending
        pending = None
        if name == "update":
            yield Skipped(where, "update action", "a partial document, not a record")
            continue
        yield _bulk_record(line, meta, where)
    if pending is not None:
        yield Skipped(pending[0], "action line without a record", record=False)


def _bulk_record(record: Any, meta: dict[str, Any], where: str) -> Message | Skipped:
    if not isinstance(record, dict):
        return Skipped(where, "not a JSON object")
    index = meta.get("_index")
    if index is None:
        stream = recognise(record)
        if stream is None:
            return Skipped(where, "neither a query nor an event", "no _index, and the record does not tell")
    elif not isinstance(index, str) or (stream := index_stream(index)) is None:
        return Skipped(where, f"unknown index {index}")
    doc_id = meta.get("_id")
    if stream == FEEDBACK and isinstance(doc_id, str) and doc_id:
        # The document's id identifies the event when the record has none of its own:
        # replaying the same export twice then counts every event once.
        field = "message_id" if "action_name" in record else "event_id"
        if record.get("message_id") is None and record.get("event_id") is None:
            record = {**record, field: doc_id}
    return _message(record, stream, where)


def _csv(path: str, f: IO[bytes], columns: tuple[str, ...]) -> Iterator[Message | Skipped]:
    """Each row as the generator's `make_query_event` / `make_ubi_event` writes it."""
    events = "action_name" in columns
    # surrogateescape: a row with bytes that are not UTF-8 is skipped, not the whole file.
    lines = (line.decode("utf-8", "surrogateescape") for line in f)
    reader = csv.reader(lines)
    while True:
        where = f"{path}:{reader.line_num + 2}"  # the header is line 1, read apart
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            yield Skipped(where, "bad CSV row", str(e))
            continue
        if not row or not any(cell.strip() for cell in row):
            continue
        if len(row) != len(columns):
            yield Skipped(where, "bad CSV row", f"{len(row)} fields, the header has {len(columns)}")
            continue
        if any("\udc80" <= ch <= "\udcff" for cell in row for ch in cell):
            yield Skipped(where, "not UTF-8")
            continue
        cells = dict(zip(columns, row))
        if events:
            try:
                record = ubi_event(cells)
            except ValueError as e:
                yield Skipped(where, "bad CSV row", str(e))
                continue
        else:
            record = query_event(cells)
        yield _message(record, FEEDBACK if events else IMPRESSIONS, where)


def query_event(row: dict[str, str]) -> dict[str, Any]:
    """The generator's `make_query_event` of a `ubi_queries.csv` row (its `application`
    is the row's: the generator writes its configured one to both)."""
    return {"application": row["application"], "query_id": row["query_id"], "client_id": row["client_id"],
            "user_query": row["user_query"], "query_attributes": {}, "timestamp": row["timestamp"]}


def ubi_event(row: dict[str, str]) -> dict[str, Any]:
    """The generator's `make_ubi_event` of a `ubi_events.csv` row: ids stay strings
    (product ids may look numeric), the position is an integer (0-based, as written)."""
    return {"application": row["application"], "action_name": row["action_name"], "query_id": row["query_id"],
            "session_id": row["session_id"], "client_id": row["client_id"], "timestamp": row["timestamp"],
            "user_query": row["user_query"], "message_type": None, "message": None,
            "event_attributes": {
                "object": {"object_id": row["object_id"], "object_id_field": row["object_id_field"],
                           "search_config": row["search_config"]},
                "position": {"ordinal": _integer(row["position"], "position")}}}


def _integer(text: str, name: str) -> int:
    """An integer cell; `3.0` too (pandas writes an int column with gaps as floats)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} {text!r} is not an integer") from None
    if not value.is_integer():
        raise ValueError(f"{name} {text!r} is not an integer")
    return int(value)


# ---- judgments -----------------------------------------------------------------

class Judgments(NamedTuple):
    labels: dict[str, dict[str, str]]  # user query -> product id -> label
    skipped: list[Skipped]


def load_judgments(path: str) -> Judgments:
    """An ESCI-style CSV (`query`, `product_id`, `esci_label`, as Amazon's
    shopping_queries_dataset_examples; or `user_query`, `doc_id`, `label`). A repeated
    query–product pair keeps its last label, as the latest judgment wins."""
    try:
        f = open(path, encoding="utf-8-sig", newline="")
    except OSError as e:
        raise InputError(path, None, f"cannot open: {e.strerror or e}") from None
    labels: dict[str, dict[str, str]] = {}
    skipped: list[Skipped] = []
    with f:
        reader = csv.reader(f)
        try:
            header = [c.strip() for c in next(reader, [])]
        except (csv.Error, UnicodeDecodeError) as e:
            raise InputError(path, 1, f"not a CSV header: {e}") from None
        index = {}
        for role, names in JUDGMENT_COLUMNS.items():
            found = [header.index(n) for n in names if n in header]
            if not found:
                raise InputError(path, 1, "a judgments CSV needs the columns query (or user_query), "
                                          "product_id (or doc_id) and esci_label (or label)")
            index[role] = found[0]
        while True:
            where = f"{path}:{reader.line_num + 1}"
            try:
                row = next(reader)
            except StopIteration:
                break
            except (csv.Error, UnicodeDecodeError) as e:
                skipped.append(Skipped(where, "bad judgment row", str(e)))
                continue
            if not any(cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                skipped.append(Skipped(where, "bad judgment row", f"{len(row)} fields, the header has {len(header)}"))
                continue
            query, product, label = (row[index[r]] for r in ("query", "product", "label"))
            if not query or not product or not label.strip():
                skipped.append(Skipped(where, "bad judgment row", "an empty query, product id or label"))
                continue
            labels.setdefault(query, {})[product] = label.strip()
    return Judgments(labels, skipped)


def judgment_events(query: Message, judgments: Judgments) -> list[Message]:
    """A native judgment per labelled product of the query's `user_query`, at the query's
    time: the `label` is graded by `evaluation.labels` when the event is decoded."""
    user_query = query.value.get("user_query")
    if not isinstance(user_query, str):
        return []
    return [Message(FEEDBACK, query.key, query.timestamp_ms,
                    {"event_id": f"{query.key}:judgment:{product}", "query_id": query.key,
                     "timestamp": query.value["timestamp"], "action": "judgment", "doc_id": product,
                     "label": label}, query.where)
            for product, label in judgments.labels.get(user_query, {}).items()]


# ---- progress and summary ------------------------------------------------------

class Progress:
    """A plain-text bar on stderr, redrawn at most four times a second on a terminal (once
    a second, a line each, elsewhere). `out=None`: silent."""

    def __init__(self, total: int, out: TextIO | None, label: str = "replay",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.out, self.label, self.clock = max(total, 1), out, label, clock
        self.tty = out is not None and out.isatty()
        self.interval = 0.25 if self.tty else 1.0
        self.last = float("-inf")
        self.began = clock()
        self.drawn = False

    def __call__(self, done: int, note: str = "", force: bool = False) -> None:
        if self.out is None:
            return
        now = self.clock()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        share = min(done / self.total, 1.0)
        bar = "#" * int(share * 24)
        line = f"{self.label} [{bar:<24}] {share:4.0%} {note} ({now - self.began:.0f} s)"
        self.out.write(f"\r{line}\x1b[K" if self.tty else line + "\n")
        self.out.flush()
        self.drawn = True

    def close(self) -> None:
        if self.out is not None and self.tty and self.drawn:
            self.out.write("\n")
            self.out.flush()


class Summary:
    """What was read, produced and skipped."""

    def __init__(self) -> None:
        self.read = 0
        self.files = 0
        self.produced: Counter[str] = Counter()   # topic -> messages
        self.judgments = 0
        self.reasons: Counter[str] = Counter()    # kind of problem -> records
        self.listed: list[Skipped] = []           # the first MAX_LISTED, by FILE:LINE

    @property
    def skipped(self) -> int:
        return sum(self.reasons.values())

    def skip(self, item: Skipped) -> None:
        self.read += item.record
        self.reasons[item.reason] += 1
        if len(self.listed) < MAX_LISTED:
            self.listed.append(item)

    def text(self, failed: Counter[str] | None = None) -> str:
        produced = sum(self.produced.values()) - sum((failed or {}).values())
        lines = [f"read {self.read:,} record{'s' if self.read != 1 else ''} from {self.files} "
                 f"file{'s' if self.files != 1 else ''}"
                 + (f"; produced {produced:,}" if produced else "; produced nothing")
                 + (f", {self.skipped:,} skipped (below)" if self.skipped else "")]
        for topic, n in self.produced.items():
            lost = (failed or {}).get(topic, 0)
            lines.append(f"  {n - lost:>10,}  to {topic}" + (f"  ({lost:,} failed)" if lost else ""))
        if self.judgments:
            lines.append(f"  {'':>10}  (judgments among them: {self.judgments:,})")
        if self.skipped:
            lines.append("skipped:")
            lines += [f"  {n:>10,}  {reason}" for reason, n in self.reasons.most_common()]
            for s in self.listed:
                lines.append(f"  {s.where}: {s.reason}" + (f": {s.detail}" if s.detail else ""))
            if self.skipped > len(self.listed):
                lines.append(f"  … and {self.skipped - len(self.listed):,} more")
        return "\n".join(lines)


# ---- replay --------------------------------------------------------------------

def open_inputs(paths: Sequence[str], fmt: str | None = None) -> list[Input]:
    """Every file opened and its format decided before anything is sent."""
    inputs: list[Input] = []
    try:
        for path in paths:
            inputs.append(Input(path, fmt))
    except InputError:
        for i in inputs:
            i.close()
        raise
    return inputs


def replay(inputs: Iterable[Input], send: Send, topics: dict[str, str], judgments: Judgments | None = None,
           progress: Progress | None = None) -> Summary:
    """Send every record of the files, each judgment after its query; `topics` maps
    IMPRESSIONS and FEEDBACK to topic names."""
    summary = Summary()
    for s in judgments.skipped if judgments else []:
        summary.skip(s._replace(record=False))
    inputs = list(inputs)
    done_before = 0
    for inp in inputs:
        summary.files += 1
        for n, item in enumerate(inp.items()):
            if isinstance(item, Skipped):
                summary.skip(item)
                continue
            summary.read += 1
            messages = [item] + (judgment_events(item, judgments) if judgments and item.stream == IMPRESSIONS
                                 else [])
            for m in messages:
                topic = topics[m.stream]
                send(topic, m.key.encode(), json.dumps(m.value).encode(), m.timestamp_ms)
                summary.produced[topic] += 1
            summary.judgments += len(messages) - 1
            if progress is not None and n % 256 == 0:
                progress(done_before + inp.position(), f"{summary.read:,} records  {inp.path}")
        done_before += inp.size
    if progress is not None:
        progress(done_before, f"{summary.read:,} records", force=True)
    return summary


def topic_names(settings: Settings) -> dict[str, str]:
    return {IMPRESSIONS: settings.kafka.impressions_topic, FEEDBACK: settings.kafka.feedback_topic}


class KafkaSink:
    """`send` to Kafka as demo.kafka_sender does, with acks from every replica and each
    failed delivery counted (per topic) rather than lost unnoticed."""

    def __init__(self, settings: Settings) -> None:
        from kafka import KafkaProducer

        self.producer = KafkaProducer(
            bootstrap_servers=settings.kafka.bootstrap_servers.split(","), acks="all", linger_ms=20,
            batch_size=256 * 1024,
            **{k: v for k, v in settings.kafka.client.items() if k in KafkaProducer.DEFAULT_CONFIG})
        self.failed: Counter[str] = Counter()
        self.error = ""

    def __call__(self, topic: str, key: bytes, value: bytes, timestamp_ms: int) -> None:
        future = self.producer.send(topic, key=key, value=value, timestamp_ms=timestamp_ms)
        future.add_errback(self._failed, topic)

    def _failed(self, topic: str, error: BaseException) -> None:
        self.failed[topic] += 1
        self.error = self.error or f"{type(error).__name__}: {error}"

    def close(self) -> None:
        self.producer.flush()
        self.producer.close()


# ---- embedded ------------------------------------------------------------------

class Evaluated(NamedTuple):
    views: list[WindowView]
    now_ms: int                        # the last event time: where the windows end
    outcomes: Counter[tuple[str, str]]  # (stream, outcome) -> events, as rankmeter_events_total
    invalid: Counter[str]              # dead-letter reason -> events


def evaluate(settings: Settings, bus: Bus, progress: Progress | None = None) -> Evaluated:
    """Everything on the bus through the pipeline, as `serve --event-clock` would take it:
    now is the newest record consumed; then every list still being assembled is settled."""
    clock = EventClock(max_future_ms=duration_ms(settings.windows.max_future))
    invalid: Counter[str] = Counter()
    # The bus hands over one topic's partition before the next, so now (the newest record
    # read) may be the file's end while its start is still to come: a file of any span
    # is history, not records too old to take.
    settings = msgspec.structs.replace(settings, windows=msgspec.structs.replace(settings.windows, max_past="36500d"))

    def dead_letter(record: Any, reason: str) -> None:
        invalid[reason] += 1

    pipeline = Pipeline(settings, MemoryStore(), dead_letter, clock=clock)
    k = settings.kafka
    bus.subscribe([k.impressions_topic, k.feedback_topic], pipeline.assign, pipeline.revoke)
    total, done = sum(bus.lag().values()), 0
    while batch := bus.poll(0, k.max_poll_records):
        clock.see(batch)
        bus.commit(pipeline.process(batch))
        # As serve does from the consumer lag: a topic read to its end holds no query open.
        pipeline.caught_up = {tp for tp, behind in bus.lag().items() if behind == 0}
        done += len(batch)
        if progress is not None:
            progress(done, f"{done:,}/{total:,} records")
    pipeline.end_of_input()  # the lists still being assembled: no more impression events will come
    return Evaluated(pipeline.views(), clock.now_ms, Counter(pipeline.events), invalid)


def embedded(settings: Settings, inputs: Iterable[Input], judgments: Judgments | None = None,
             progress: Callable[[str, int], Progress | None] = lambda label, total: None
             ) -> tuple[Summary, Evaluated]:
    """Replay into the in-process bus, then evaluate (no Kafka, no Redis)."""
    inputs = list(inputs)
    bus = Bus(partitions=4)
    reading = progress("replay", sum(i.size for i in inputs))
    summary = replay(inputs, lambda t, k, v, ts: bus.send(t, k, v, timestamp_ms=ts), topic_names(settings),
                     judgments, reading)
    if reading is not None:
        reading.close()
    running = progress("evaluate", sum(summary.produced.values()))
    result = evaluate(settings, bus, running)
    if running is not None:
        running.close()
    return summary, result


def outcomes_text(result: Evaluated) -> str:
    """The events' outcomes in the pipeline, and why the invalid ones were."""
    parts = [f"{stream} {outcome} {n:,}" for (stream, outcome), n in sorted(result.outcomes.items()) if n]
    lines = ["pipeline: " + (", ".join(parts) if parts else "no events")]
    for reason, n in result.invalid.most_common(5):
        lines.append(f"  invalid {n:>8,}  {reason[:160]}")
    if len(result.invalid) > 5:
        lines.append(f"  … and {len(result.invalid) - 5} more reasons")
    return "\n".join(lines)


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
