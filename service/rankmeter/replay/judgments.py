"""Relevance judgments for a replay (`--judgments`): an ESCI-style CSV, and the native
judgment events each labelled product of a query becomes."""

from __future__ import annotations

import csv
from typing import NamedTuple

from rankmeter.replay.messages import FEEDBACK, Message, Skipped
from rankmeter.trec import InputError

# ESCI-style judgment files: each column under either name.
JUDGMENT_COLUMNS = {"query": ("query", "user_query"), "product": ("product_id", "doc_id"),
                    "label": ("esci_label", "label")}


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
