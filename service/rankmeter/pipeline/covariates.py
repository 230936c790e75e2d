"""CUPED's covariate (ab/cuped.py, `ab.cuped`): each query's pre-period mean value per
measure (of its query text, or with `ab.cuped_covariate: user` of its user), and the
per-arm sums Σx, Σx², Σxy beside the A/B sums.

The pre-period table. A query text is known by the hash the position-bias harvest keeps
(`events.query_hash`: case and spacing folded), a user by the 64-bit hash of its
client_id (`Impression.user_hash`); either lands in one of `ab.cuped_buckets` buckets
(the hash modulo B), each holding (queries counted, Σ value) per measure of the A/B
layout. Keys that collide merge: the covariate is weaker, never invalid (it is still a
function of pre-period data alone). Each partition keeps its share as one field of its
A/B sums (`PRE`, or `PRE_USER` for users: three parts, so a version without CUPED skips
it, as it does `PAIRS`), moved by each pre-period query's new minus old values (kept in
its record), and stored with the partition's checkpoint, before its offsets are
committed to Kafka; the partitions' tables add up. Memory: 16 bytes × buckets × measures
per partition (65,536 buckets, 9 measures: 9.4 MB), read one partition at a time by a
process once, to offer the experiment's means (a look reads the A/B sums without it).

The pre-period, by event time alone (never by when an event is read: the table must not
depend on batch boundaries, a rebuilt partition or a replica's lag). A query counts if
its impression was shown at least the attribution window plus its grace before
`ab.start` (its clicks are then all in before the start) and none of its feedback has a
timestamp at or after `ab.start` (`QueryRecord.feedback_ms`; a late judgment of the
treatment period takes the query out: its contribution goes back to 0, for good). Values
are kept on a grid of 2⁻²⁰ so that sums are exact (below 2³³): the table is the same bit
for bit however its queries were batched, added and taken back.

During the experiment a query's x per measure is its key's bucket mean over every
partition's table, **fixed once per experiment for every process**: the first process to
need it (at the first enrolled query) stores the means under
`ab:definition:<experiment>#cuped-means` (SET NX), and every process, then and after a
restart or a rebalance, uses what is stored. The tables go on moving after the start
(late pre-period events, queries taken out by feedback from the start on); were each
process to read its own means, a query evaluated again after a restart would get another
x than one that was not, and which queries are evaluated again depends on their
feedback, so on the treatment (review: a 0.3–3.8 se bias of the adjusted delta). A key without pre-period
data (or none: no text, no client_id) gets the table's pooled mean: x − x̄ ≈ 0, so it is
adjusted by almost nothing. An unreadable table (another size: another `ab.cuped_buckets`
or layout) is left out and counted (rankmeter_store_unreadable_total).
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Callable, Mapping

import numpy as np

from rankmeter.ab.cuped import COVARIATE_SLOTS
from rankmeter.config import Settings, duration_ms, time_ms
from rankmeter.join import QueryRecord
from rankmeter.pipeline.context import Touched
from rankmeter.pipeline.state import PartitionState
from rankmeter.store import Refused, Store
from rankmeter.unreadable import Unreadable

log = logging.getLogger("rankmeter.pipeline")

PRE = "cuped\x1f\x1fpre"            # a partition's pre-period table by query text, with its A/B sums
PRE_USER = "cuped\x1f\x1fpre-user"  # ... by user (ab.cuped_covariate: user)
SUFFIX = "#cuped"          # an arm's covariate sums: the experiment's name + SUFFIX, ranker, segment[, bucket]
MEANS = "#cuped-means"     # the experiment's x, fixed once: a definition (the experiment's name + MEANS)
QUANTUM = 2.0 ** -20       # the grid of the table's values: sums exact whatever their order


def bucket(query_hash: str, buckets: int) -> int:
    """The table bucket of a text (its `events.query_hash`, 16 hex digits); -1 without one."""
    try:
        return int(query_hash, 16) % buckets if 0 < len(query_hash) <= 16 else -1
    except ValueError:
        return -1


def covariate_sums(means: np.ndarray, pooled: np.ndarray, keys: np.ndarray, columns: list[int | None],
                   values: np.ndarray) -> np.ndarray:
    """[Q, definition measures, 3]: each query's x, x², xy per measure of the definition
    (`columns`: its column in the A/B layout, None: not computed here, 0), where the query
    counts (its value not nan); x its key's bucket mean (`means` [buckets, measures]), the
    pooled mean for a query without a key (-1)."""
    x_all = np.where((keys >= 0)[:, None], means[np.maximum(keys, 0)], pooled) if len(keys) else means[:0]
    out = np.zeros((len(keys), len(columns), COVARIATE_SLOTS))
    with np.errstate(over="ignore", invalid="ignore"):
        for k, c in enumerate(columns):
            if c is None:
                continue
            x, y = x_all[:, c], values[:, c]
            ok = ~np.isnan(y) & np.isfinite(x * x * y)   # (tables that add up past floats: left out)
            out[ok, k] = np.stack([x, x * x, x * y], -1)[ok]
    return out


class Covariates:
    def __init__(self, settings: Settings, store: Store, held: dict[int, PartitionState], measures: int,
                 unreadable: Unreadable) -> None:
        a, w = settings.ab, settings.windows
        self.on = a.cuped and bool(a.start)
        self.start_ms = time_ms(a.start) if self.on else 0
        # Shown this early, a query's clicks are all in before the start (attribution + grace).
        self.shown_by_ms = self.start_ms - duration_ms(w.attribution) - duration_ms(w.grace)
        self.by_user = a.cuped_covariate == "user"
        self.field = PRE_USER if self.by_user else PRE
        self.slot = "pre_user_contribution" if self.by_user else "pre_contribution"  # (its QueryRecord field)
        self.buckets = a.cuped_buckets
        self.measures = measures   # the A/B layout's columns
        self.store, self.held, self.unreadable = store, held, unreadable
        self._means: tuple[np.ndarray, np.ndarray] | None = None   # [buckets, measures], [measures], as stored
        self._text = self._key = self._digest = ""   # ... their stored text, its key and digest

    @property
    def size(self) -> int:
        return self.buckets * self.measures * 2

    def key(self, record: QueryRecord) -> int:
        """The table bucket of a query: its text's, or its user's; -1 without one."""
        impression = record.impression
        if impression is None:
            return -1
        if self.by_user:
            return impression.user_hash % self.buckets if impression.user_hash >= 0 else -1
        return bucket(impression.query_hash, self.buckets)

    def counts(self, record: QueryRecord, enrolled: bool) -> bool:
        """In the pre-period table: shown early enough, no feedback from the start on, in no experiment."""
        return (record.impression is not None and record.impression.timestamp_ms <= self.shown_by_ms
                and record.feedback_ms < self.start_ms and not enrolled)

    def observe(self, partition: int, records: list[QueryRecord], values: np.ndarray,
                enrolled: Callable[[QueryRecord], bool]) -> None:
        """Pre-period queries of one partition into its table, by their new minus old
        values [Q, measures] of the A/B layout (nan: not counted); a query no longer
        counted is taken out."""
        ps = self.held[partition]
        width = 16 * self.measures
        cells = None
        for record, row in zip(records, values):
            old: bytes = getattr(record, self.slot)
            counted = self.counts(record, enrolled(record))
            b = self.key(record)
            if not (counted or old) or b < 0 or (old and len(old) != width):
                continue   # (another layout's contribution: cannot be taken back)
            if cells is None:
                table = ps.ab.get(self.field)
                if table is not None and len(table) != self.size:   # (another ab.cuped_buckets or layout)
                    self.unreadable.skip("experiment", f"{{{partition}}}:ab", self.field,
                                         f"{len(table)} values, not {self.size}: the table starts over")
                if table is None or len(table) != self.size:
                    table = ps.ab[self.field] = np.zeros(self.size)
                cells = table.reshape(self.buckets, self.measures, 2)
            new = _cell(row) if counted else np.zeros((self.measures, 2))
            cells[b] += new - (np.frombuffer(old).reshape(-1, 2) if old else 0.0)
            setattr(record, self.slot, new.tobytes() if counted else b"")
            ps.dirty_ab.add(self.field)

    def observe_batch(self, keys: list[Touched], records: list[QueryRecord], values: np.ndarray) -> None:
        """A batch's pre-period queries into their partitions' tables."""
        by_partition: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            by_partition.setdefault(k.partition, []).append(i)
        for p, rows in by_partition.items():
            self.observe(p, [records[i] for i in rows], values[rows],
                         lambda r: bool(r.ab_experiment or r.impression.experiment))

    def move(self, keys: list[Touched], records: list[QueryRecord], values: np.ndarray, inside: list[bool],
             experiment: str, columns: list[int | None], by_user: bool) -> None:
        """The enrolled queries' Σx, Σx², Σxy moved beside their arm's A/B sums, by their
        new minus old contribution (kept in the record, like the A/B sums')."""
        rows = [i for i, counts in enumerate(inside) if counts]
        if not rows:
            return
        new = self.contributions([records[i] for i in rows], columns, values[rows], experiment)
        for vector, i in zip(new, rows):
            record, k = records[i], keys[i]
            field = f"{experiment}{SUFFIX}\x1f{record.ranker_label}\x1f{record.segment_label}"
            if by_user:
                field += f"\x1f{record.impression.user_bucket}"
            old = record.cuped_contribution
            if old and len(old) != vector.nbytes:
                continue   # another definition's: cannot be taken back
            ps = self.held[k.partition]
            sums = ps.ab.get(field)
            if sums is None or len(sums) != vector.size:
                sums = ps.ab[field] = np.zeros(vector.size)
            sums += vector.ravel() - (np.frombuffer(old) if old else 0.0)
            ps.dirty_ab.add(field)
            record.cuped_contribution = vector.tobytes()

    def means(self, experiment: str) -> tuple[np.ndarray, np.ndarray]:
        """The experiment's x: [buckets, measures] means and the pooled mean [measures], as
        the first process to need them stored them (from the tables as they were then).
        Never this process's own unless the store kept them: a store that refuses the
        write raises `Refused` (the batch waits), as x must be the same for every process."""
        if self._means is None:
            # Read first: the tables (every partition's, 0.7 s and 300 MB at 32) only if none are stored.
            key = experiment + MEANS
            text = self.store.definition(key)
            got = _decoded(text, self.buckets, self.measures)
            if got is None:
                text = self._stored(key, _encoded(*self.from_tables()))
                got = _decoded(text, self.buckets, self.measures)
            if got is None:   # (nothing stored: a read-only replica, a full Redis)
                raise Refused(f"the experiment's covariate means were not stored ({key})")
            self._means, self._text, self._key, self._digest = got, text, key, _digest(text)
        assert self._key == experiment + MEANS, "one experiment a process"
        return self._means

    def _stored(self, key: str, mine: str) -> str:
        """The means stored under `key` (`mine` if none were); ones that are not means of
        this size (not ours, empty, another type) replaced by `mine`, counted when there
        was something."""
        text = self.store.define_experiment(key, mine)
        if _decoded(text, self.buckets, self.measures) is None:
            if text:
                self.unreadable.skip("experiment", f"ab:definition:{key}", "means",
                                     f"not {self.buckets} × {self.measures} finite means: replaced")
            text = self.store.define_experiment(key, mine, replace=True)
        return text

    def resolve(self) -> None:
        """At every claim: the means this process uses stored back if the store lost them
        (else a process started later would take others, from the tables as they are now);
        ones the store holds that are not these (it lost them and another process stored
        its own first) are followed from now on, counted and logged: queries evaluated
        since then mix two x's."""
        if self._means is None:
            return
        # Compared by their digest where they are stored: the 6.3 MB (the defaults) are sent
        # again only when the store lost them, read only when it holds others.
        if self.store.definition_digest(self._key) == self._digest:
            return
        text = self._stored(self._key, self._text)
        if text and text != self._text and (got := _decoded(text, self.buckets, self.measures)) is not None:
            self.unreadable.skip("experiment", f"ab:definition:{self._key}", "means",
                                 "not the means this process adjusted with (the store lost them): following the stored")
            log.error("the experiment's covariate means in the store are not this process's", extra={"key": self._key})
            self._means, self._text, self._digest = got, text, _digest(text)

    def from_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """[buckets, measures] pre-period means over every partition's table (read one at a
        time: one table in memory at once), a bucket without queries given the pooled mean;
        and the pooled mean [measures] (0 with no table: a constant, no adjustment)."""
        total = np.zeros((self.buckets, self.measures, 2))
        field = self.field
        for p in sorted(set(self.store.partitions()) | set(self.held)):
            ps = self.held.get(p)   # a held partition's own table: newer than its checkpoint
            if ps is not None and field in ps.ab:
                data = ps.ab[field].tobytes()
            else:
                data = self.store.load_ab([p], only=(field,)).get(p, {}).get(field)
            if data is None:
                continue
            if len(data) != 8 * self.size:
                self.unreadable.skip("experiment", f"{{{p}}}:ab", field,
                                     f"{len(data)} bytes, not {8 * self.size} (ab.cuped_buckets × measures × 16)")
                continue
            table = np.frombuffer(data).reshape(self.buckets, self.measures, 2)
            counts = table[..., 0]
            if not np.isfinite(table).all() or (counts < 0).any() or (counts != np.round(counts)).any():
                self.unreadable.skip("experiment", f"{{{p}}}:ab", field,
                                     "a count below 0 or not whole, or a value not finite")
                continue
            total += table
        n, s = total[..., 0], total[..., 1]
        pooled = np.divide(s.sum(0), n.sum(0), out=np.zeros(self.measures), where=n.sum(0) > 0)
        return np.where(n > 0, s / np.where(n > 0, n, 1.0), pooled), pooled

    def contributions(self, records: list[QueryRecord], columns: list[int | None], values: np.ndarray,
                      experiment: str) -> np.ndarray:
        """[Q, definition measures, 3]: each query's Σx, Σx², Σxy (`covariate_sums`)."""
        means, pooled = self.means(experiment)
        keys = np.array([self.key(r) for r in records], dtype=np.int64)
        return covariate_sums(means, pooled, keys, columns, values)


def _digest(text: str) -> str:
    """As `Store.definition_digest` computes it."""
    return hashlib.sha1(text.encode()).hexdigest()


def _encoded(means: np.ndarray, pooled: np.ndarray) -> str:
    """The means as stored: base64 of the float64s, bucket-major, then the pooled ones."""
    return base64.b64encode(np.concatenate([means.ravel(), pooled]).tobytes()).decode("ascii")


def _decoded(text: str, buckets: int, measures: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Stored means, None unless they are exactly `buckets` × `measures` (+ pooled) finite ones."""
    if len(text) != 4 * -(-8 * (buckets + 1) * measures // 3) or not text.isascii():
        return None
    try:
        values = np.frombuffer(base64.b64decode(text, validate=True))
    except ValueError:   # (binascii.Error is one)
        return None
    if len(values) != (buckets + 1) * measures or not np.isfinite(values).all():
        return None
    return values[:-measures].reshape(buckets, measures), values[-measures:]


def _cell(row: np.ndarray) -> np.ndarray:
    """A pre-period query's (counted, value) per measure, its value on the table's grid."""
    counted = ~np.isnan(row)
    return np.stack([counted, np.where(counted, np.round(row / QUANTUM) * QUANTUM, 0.0)], -1)


def arm_covariates(stored: Mapping[int, Mapping[str, bytes]], experiment: str, measures: int, by_user: bool,
                   buckets: int, skip: Callable[[int, str, str], None],
                   ab_counted: set[tuple[int, str]] | None = None) -> dict[tuple[str, str], np.ndarray]:
    """Each arm's covariate sums over every partition: (ranker, segment) -> [measures, 3],
    or with user buckets [buckets, measures, 3]. `ab_counted`: the (partition, field) of
    the A/B sums counted (experiments.arm_vectors); an arm whose covariate sums and A/B
    sums do not cover the same partitions and buckets (one of them unreadable somewhere)
    is left out: its n and Σy would be of other queries than its Σx, Σxy (a review found a
    29-se A/A delta from one partition's covariate field lost)."""
    out: dict[tuple[str, str], np.ndarray] = {}
    mine: set[tuple[int, str]] = set()  # (partition, the A/B field) of each covariate field counted
    width = measures * COVARIATE_SLOTS
    for p, fields in stored.items():
        for field, data in fields.items():
            name, _, rest = field.partition("\x1f")
            if name != experiment + SUFFIX:
                continue
            parts = rest.split("\x1f")
            if len(parts) != (3 if by_user else 2):  # (a stored field, not ours: never unpacked blindly)
                skip(p, field, f"{len(parts)} parts after the name, not {3 if by_user else 2}")
                continue
            ranker, segment, *bucket_ = parts
            readable = not bucket_ or (len(bucket_[0]) <= 6 and bucket_[0].isascii() and bucket_[0].isdigit()
                                       and int(bucket_[0]) < buckets)
            if len(data) != 8 * width or not readable:
                skip(p, field, f"{len(data)} bytes of covariate sums, not {8 * width}, or a bucket not below {buckets}")
                continue
            vector = np.frombuffer(data).reshape(measures, COVARIATE_SLOTS)
            if not np.isfinite(vector).all():
                skip(p, field, "covariate sums not finite")
                continue
            mine.add((p, f"{experiment}\x1f{rest}"))
            if by_user:
                out.setdefault((ranker, segment), np.zeros((buckets, measures, COVARIATE_SLOTS)))[int(bucket_[0])] += vector
            else:
                out[(ranker, segment)] = out.get((ranker, segment), 0) + vector
    if ab_counted is not None:
        for _, field in mine ^ {(p, f) for p, f in ab_counted if f.startswith(experiment + "\x1f")}:
            out.pop(tuple(field.split("\x1f")[1:3]), None)
    return out
