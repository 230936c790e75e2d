"""TREC file formats: qrels (`qid iter docid grade`) and runs (`qid Q0 docid rank score tag`).

Read as trec_eval 10 reads them (its get_qrels.c and get_trec_results.c):
- qrels: a line starting with `#` is a comment; every other line has exactly 4 fields.
  (trec_eval skips only the first of two consecutive comment lines and rejects blank
  lines; both are accepted here.)
- runs: blank lines and lines whose first field starts with `#` are skipped; a line has
  at least 6 fields, and anything after the 6th (the tag) is ignored. The run id is the
  tag of the last line, as trec_eval prints it for `runid`.
- numbers: a score may be `inf` or `-inf` (a log-probability of 0), ordered as trec_eval's
  atof and comparisons order it; a NaN score (no order) and a non-finite grade are errors.
- grades read for trec_eval's names (`read_qrels(path, atol=True)`) keep what C's atol
  makes of the field: its leading `[+-]digits` (`1e3` is 1, `2.5` is 2, `.5` is 0); the
  field must still be a finite number (`abc` and `inf` are errors, as below). Read for
  ir_measures names, a grade is the number written (`1e3` is 1000, `2.5` is 2.5).
- fields are separated by ASCII blanks only (a no-break space or \x1c is part of a field,
  as in trec_eval, not a separator as str.split() makes it), and a score is written in
  ASCII without `_` (float() reads `1_0` as 10 and Arabic-Indic digits as numbers, C's
  atof as 1 and 0): such a score is an error, not a silently different number.
- `-` as the run's path is standard input.
Problems are raised as `InputError` naming the file and line, for a one-line message.
"""

from __future__ import annotations

import gc
import math
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

_WHOLE = re.compile(r"(?:[+-]?[0-9]{1,18}\n)*[+-]?[0-9]{1,18}")  # fields atol reads whole, below 2^63
_LEADING = re.compile(r"[+-]?[0-9]+")
# What str.split() splits on beyond C's isspace (" \t\n\v\f\r"), which trec_eval does not.
_ODD_SPACE = re.compile("[\x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")
_ASCII_SPACE = re.compile("[ \t\n\v\f\r]+")
LONG_MAX = 2 ** 63 - 1


class InputError(Exception):
    """Bad input, phrased for the user as `path:line: problem`."""

    def __init__(self, path: str, line: int | None, problem: str) -> None:
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {problem}")


def rank(scores: Mapping[str, float]) -> list[str]:
    """Documents in trec_eval's order: score descending, ties by document id descending
    (byte order, as trec_eval's strcmp). The run's own rank column is ignored, as there."""
    return [doc for _, doc in sorted(zip(scores.values(), scores.keys()), reverse=True)]


def _bytes(path: str) -> bytes:
    try:
        if path == "-":
            import sys
            return sys.stdin.buffer.read()
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise InputError(path, None, "no such file") from None
    except IsADirectoryError:
        raise InputError(path, None, "is a directory, not a file") from None
    except PermissionError:
        raise InputError(path, None, "permission denied") from None


def _lines(path: str, data: bytes) -> tuple[list[str], bool, Callable[[str], list[str]]]:
    """The file's lines. Read whole: a million-line run is ~50 MB, and one decode and one
    split are several times faster than line-by-line reading. The flag: whether any line
    can be a comment (one scan of the text, so clean files skip the per-line check); the
    split: str.split, or a split on ASCII blanks only when the text holds other spaces."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = data.count(b"\n", 0, e.start) + 1
        column = e.start - data.rfind(b"\n", 0, e.start)
        raise InputError(path, line_no, f"not UTF-8 text (byte {column} of the line)") from None
    return text.split("\n"), "#" in text, _ascii_split if _ODD_SPACE.search(text) else str.split


def _ascii_split(line: str) -> list[str]:
    return [field for field in _ASCII_SPACE.split(line) if field]


def _score(text: str) -> float:
    """A score as C's atof reads it where it reads a number float() reads alike (ASCII, no `_`)."""
    if "_" in text or not text.isascii():
        raise ValueError(text)
    return float(text)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Reading and building states makes millions of small objects and no reference
    cycles; the cyclic GC would rescan them again and again (~15% of the time)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def atol(text: str) -> float:
    """A grade as trec_eval's atol reads it (its leading [+-]digits, 0 without any, clamped
    to a C long), refusing what is not a finite number at all (ValueError)."""
    if not math.isfinite(float(text)):
        raise ValueError(text)
    digits = _LEADING.match(text)
    return float(max(-LONG_MAX - 1, min(LONG_MAX, int(digits[0])))) if digits else 0.0


class Table(dict):
    """{qid: {docid: value}}, plus the tag of the file's last line (a run's id)."""
    last_tag: str = ""


@gc_paused()
def _read(path: str, columns: str, doc_field: int, value_field: int, what: str, repeated: str,
          comment_anywhere: bool, whole: bool = False) -> Table:
    # comment_anywhere: a run (infinite values allowed); whole: values read as atol reads them
    """{qid: {docid: value}} from whitespace-separated lines: exactly `columns`' fields
    when `comment_anywhere` is false (qrels, `#` comments in the first column only), at
    least as many otherwise (runs, `#` after leading blanks too, trailing fields ignored).

    This loop is the hot path of `rankmeter eval`: a query's consecutive lines are
    collected as strings and turned into one dict with C-level `zip`/`map(float)`, and
    the checks that need a line number (`_locate`) run only once something is wrong."""
    width = len(columns.split())
    data = _bytes(path)
    table = _plain(data, width, doc_field, value_field, comment_anywhere, whole)
    if table is not None:
        return table
    lines, hashes, split = _lines(path, data)
    table = Table()

    def flush(qid: str, first: int, docs: list[str], values: list[str]) -> None:
        try:
            joined = "\n".join(values)
            if whole:
                read = float if _WHOLE.fullmatch(joined) else atol
            else:
                read = float if "_" not in joined and joined.isascii() else _score
            parsed = dict(zip(docs, map(read, values)))
        except ValueError:
            parsed = {}
        known = table.get(qid)
        # all(map(...)) rather than one fsum: fsum raises on inf + -inf.
        usable = not any(map(math.isnan, parsed.values())) if comment_anywhere else \
            all(map(math.isfinite, parsed.values()))
        if (len(parsed) != len(docs) or not usable
                or (known is not None and not known.keys().isdisjoint(parsed))):
            _locate(path, lines, first, qid, known or {}, doc_field, value_field, what, repeated,
                    comment_anywhere, split, whole)
        if known is None:
            table[qid] = parsed
        else:  # the query's lines were not consecutive
            known.update(parsed)

    qid, first, docs, values, last = None, 0, [], [], None
    for index, line in enumerate(lines):
        fields = split(line)
        if len(fields) != width:
            if not fields or _comment(line, fields, comment_anywhere):
                continue
            if not comment_anywhere or len(fields) < width:  # a run's extra fields are ignored
                raise InputError(path, index + 1, f"expected {width} fields ({columns}), got {len(fields)}")
        elif hashes and _comment(line, fields, comment_anywhere):
            continue
        last = fields
        if fields[0] != qid:
            if qid is not None:
                flush(qid, first, docs, values)
            qid, first, docs, values = fields[0], index, [], []
        docs.append(fields[doc_field])
        values.append(fields[value_field])
    if qid is not None:
        flush(qid, first, docs, values)
    if last is not None:
        table.last_tag = last[width - 1]
    return table


def _plain(data: bytes, width: int, doc_field: int, value_field: int, run: bool, whole: bool) -> Table | None:
    """`_read`'s table for a plain file, by the C reader (_treader.c, built by `make venv`:
    scripts/build_native.py), ~3x faster; None without it, or when the file is not plain
    (non-ASCII, control bytes, comments, lines of another width, a repeated document, a
    value float() refuses, a grade not whole with `whole`, NaN, an infinite grade): the
    line-by-line reader then reads it, and finds and words its problems."""
    try:
        from rankmeter._treader import read
    except ImportError:
        return None
    got = read(data, width, doc_field, value_field, whole)
    if got is None:
        return None
    runs, tag = got
    table = Table()
    for qid, parsed in runs:
        usable = not any(map(math.isnan, parsed.values())) if run else all(map(math.isfinite, parsed.values()))
        known = table.get(qid)
        if not usable or (known is not None and not known.keys().isdisjoint(parsed)):
            return None
        if known is None:
            table[qid] = parsed
        else:  # the query's lines were not consecutive
            known.update(parsed)
    table.last_tag = tag
    return table


def _comment(line: str, fields: list[str], anywhere: bool) -> bool:
    return fields[0][0] == "#" if anywhere else line[:1] == "#"


def _locate(path: str, lines: list[str], first: int, qid: str, known: dict[str, float], doc_field: int,
            value_field: int, what: str, repeated: str, run: bool, split: Callable[[str], list[str]],
            whole: bool) -> None:
    """Find and raise the first problem in one query's block of lines starting at `first`
    (`run`: a run's lines, where a `#` field starts a comment anywhere and ±inf scores are
    read; in qrels only a line starting with `#` is one, as the reader skips them)."""
    seen = set(known)
    for index in range(first, len(lines)):
        fields = split(lines[index])
        if not fields or _comment(lines[index], fields, run):
            continue
        if fields[0] != qid:
            break
        doc, field = fields[doc_field], fields[value_field]
        try:
            value = float(field) if whole else _score(field)
        except ValueError:
            raise InputError(path, index + 1, f"{what} {field!r} is not a number") from None
        if math.isnan(value) and run:
            raise InputError(path, index + 1, f"{what} {field!r} is not a number trec_eval can order")
        if not math.isfinite(value) and not run:
            raise InputError(path, index + 1, f"{what} {field!r} is not a finite number")
        if doc in seen:
            raise InputError(path, index + 1, f"document {doc!r} {repeated} for query {qid!r}")
        seen.add(doc)


def read_qrels(path: str, atol: bool = False) -> Table:
    """`qid iter docid grade` per line -> {qid: {docid: grade}}; `atol`: grades as
    trec_eval reads them (whole numbers, see above)."""
    return _read(path, "qid iter docid grade", 2, 3, "grade", "judged twice", False, atol)


def read_run(path: str) -> Table:
    """`qid Q0 docid rank score tag [anything]` per line -> {qid: {docid: score}}, with
    `last_tag` the run id. A document listed twice for a query is an error, as in trec_eval."""
    return _read(path, "qid Q0 docid rank score tag", 2, 4, "score", "retrieved twice", True)
