"""Reading the files `rankmeter replay` takes: OpenSearch bulk ndjson (the UBI data
generator's `--generate-ndjson`, `_bulk` exports), plain ndjson, and the generator's CSVs.
Each yields, in file order, a Message per record or a Skipped one (by FILE:LINE)."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator, Sequence
from typing import IO, Any

from rankmeter.replay.messages import FEEDBACK, IMPRESSIONS, Message, Skipped, index_stream, recognise, to_message
from rankmeter.trec import InputError

FORMATS = ("bulk", "ndjson", "csv")
BULK_ACTIONS = ("index", "create", "update", "delete")

# The UBI data generator's CSV columns (`to_csv(index=False)` of its data frames).
QUERY_COLUMNS = ("application", "query_id", "client_id", "user_query", "timestamp")
EVENT_COLUMNS = ("object_id", "position", "object_id_field", "application", "action_name", "query_id",
                 "user_query", "session_id", "client_id", "timestamp", "search_config")


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
            yield to_message(record, stream, where)


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
    return to_message(record, stream, where)


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
        yield to_message(record, FEEDBACK if events else IMPRESSIONS, where)


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
