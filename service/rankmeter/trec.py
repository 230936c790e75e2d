"""TREC file formats: qrels (`qid iter docid grade`) and runs (`qid Q0 docid rank score tag`).

Problems are raised as `InputError` naming the file and line, for a one-line message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


class InputError(Exception):
    """Bad input, phrased for the user as `path:line: problem`."""

    def __init__(self, path: str, line: int | None, problem: str) -> None:
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {problem}")


def rank(scores: Mapping[str, float]) -> list[str]:
    """Documents in trec_eval's order: score descending, ties by document id descending
    (byte order, as trec_eval's strcmp). The run's own rank column is ignored, as there."""
    return sorted(scores, key=lambda doc: (scores[doc], doc), reverse=True)


def _number(path: str, line_no: int, field: str, what: str) -> float:
    try:
        value = float(field)
    except ValueError:
        raise InputError(path, line_no, f"{what} {field!r} is not a number") from None
    if not math.isfinite(value):
        raise InputError(path, line_no, f"{what} {field!r} is not a finite number")
    return value


def _lines(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            yield from enumerate(f, start=1)
    except FileNotFoundError:
        raise InputError(path, None, "no such file") from None
    except IsADirectoryError:
        raise InputError(path, None, "is a directory, not a file") from None
    except PermissionError:
        raise InputError(path, None, "permission denied") from None
    except UnicodeDecodeError as e:
        raise InputError(path, None, f"not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_qrels(path: str) -> dict[str, dict[str, float]]:
    """`qid iter docid grade` per line -> {qid: {docid: grade}}."""
    qrels: dict[str, dict[str, float]] = {}
    for line_no, line in _lines(path):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 4:
            raise InputError(path, line_no, f"expected 4 fields (qid iter docid grade), got {len(fields)}")
        qid, _, doc, grade = fields
        docs = qrels.setdefault(qid, {})
        if doc in docs:
            raise InputError(path, line_no, f"document {doc!r} judged twice for query {qid!r}")
        docs[doc] = _number(path, line_no, grade, "grade")
    return qrels


def read_run(path: str) -> dict[str, dict[str, float]]:
    """`qid Q0 docid rank score tag` per line -> {qid: {docid: score}}."""
    run: dict[str, dict[str, float]] = {}
    for line_no, line in _lines(path):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 6:
            raise InputError(path, line_no,
                             f"expected 6 fields (qid Q0 docid rank score tag), got {len(fields)}")
        qid, _, doc, _, score, _ = fields
        docs = run.setdefault(qid, {})
        if doc in docs:  # trec_eval refuses these too
            raise InputError(path, line_no, f"document {doc!r} retrieved twice for query {qid!r}")
        docs[doc] = _number(path, line_no, score, "score")
    return run
