"""CUPED's covariate (ab/cuped.py, `ab.cuped`): each query text's mean value per measure
before `ab.start`, and the per-arm sums Σx, Σx², Σxy beside the A/B sums.

The pre-period table. A query text is known by the hash the position-bias harvest keeps
(`events.query_hash`: case and spacing folded); it lands in one of `ab.cuped_buckets`
buckets (the hash modulo B), each holding (queries counted, Σ value) per measure of the
A/B layout. Texts that collide merge: the covariate is weaker, never invalid (it is still
a function of pre-period data alone). Each partition keeps its share as one field of its
A/B sums (`PRE`: three parts, so a version without CUPED skips it, as it does `PAIRS`),
moved by each pre-period query's new minus old values (kept in its record), and stored
with the partition's checkpoint, before its offsets are committed to Kafka; the
partitions' tables add up. Memory: 16 bytes × buckets × measures per partition (65,536
buckets, 9 measures: 9.4 MB), read by each look with the A/B sums.

Frozen at `ab.start`: only queries shown before it count, and a partition's table stops
moving once any of its topics has reached `ab.start` (a later click on a pre-period query
must not carry the treatment's effect into the covariate). A pre-period event read after
that is left out: a smaller sample, never a contaminated one.

During the experiment a query's x per measure is its text bucket's mean over every
partition's table, read once when this process first needs it (the tables are frozen by
then; a process started later may read a partition that had more of its pre-period in:
x stays a function of pre-period data, and each query's contribution is taken back as
it was added). A text without pre-period data gets the table's pooled mean: x − x̄ ≈ 0,
so it is adjusted by almost nothing. An unreadable table (another size: another
`ab.cuped_buckets` or layout) is left out and counted (rankmeter_store_unreadable_total).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from rankmeter.ab.cuped import COVARIATE_SLOTS
from rankmeter.config import Settings, time_ms
from rankmeter.join import QueryRecord
from rankmeter.pipeline.context import Touched
from rankmeter.pipeline.state import PartitionState
from rankmeter.store import Store
from rankmeter.unreadable import Unreadable

PRE = "cuped\x1f\x1fpre"   # a partition's pre-period table, with its A/B sums
SUFFIX = "#cuped"          # an arm's covariate sums: the experiment's name + SUFFIX, ranker, segment[, bucket]


def bucket(query_hash: str, buckets: int) -> int:
    """The table bucket of a text (its `events.query_hash`, 16 hex digits); -1 without one."""
    try:
        return int(query_hash, 16) % buckets if 0 < len(query_hash) <= 16 else -1
    except ValueError:
        return -1


class Covariates:
    def __init__(self, settings: Settings, store: Store, held: dict[int, PartitionState], measures: int,
                 unreadable: Unreadable) -> None:
        self.on = settings.ab.cuped and bool(settings.ab.start)
        self.start_ms = time_ms(settings.ab.start) if self.on else 0
        self.buckets = settings.ab.cuped_buckets
        self.measures = measures   # the A/B layout's columns
        self.store, self.held, self.unreadable = store, held, unreadable
        self._means: np.ndarray | None = None   # [buckets, measures], once read

    @property
    def size(self) -> int:
        return self.buckets * self.measures * 2

    def observe(self, partition: int, records: list[QueryRecord], values: np.ndarray,
                enrolled: Callable[[QueryRecord], bool]) -> None:
        """Pre-period queries of one partition into its table: values [Q, measures] of the
        A/B layout (nan: not counted)."""
        ps = self.held[partition]
        if not self.on or (ps.watermarks and max(ps.watermarks.values()) >= self.start_ms):
            return   # frozen
        table = ps.ab.get(PRE)
        if table is None or len(table) != self.size:
            table = ps.ab[PRE] = np.zeros(self.size)
        cells = table.reshape(self.buckets, self.measures, 2)
        moved = False
        for record, row in zip(records, values):
            impression = record.impression
            if impression is None or impression.timestamp_ms >= self.start_ms or enrolled(record):
                continue
            b = bucket(impression.query_hash, self.buckets)
            if b < 0:
                continue
            counted = ~np.isnan(row)
            new = np.stack([counted, np.where(counted, row, 0.0)], -1)
            old = np.frombuffer(record.pre_contribution).reshape(-1, 2) if record.pre_contribution else 0.0
            if record.pre_contribution and len(record.pre_contribution) != new.nbytes:
                continue   # another layout's: cannot be taken back
            cells[b] += new - old
            record.pre_contribution = new.tobytes()
            moved = True
        if moved:
            ps.dirty_ab.add(PRE)

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
        new = self.contributions([records[i] for i in rows], columns, values[rows])
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

    def means(self) -> np.ndarray:
        """[buckets, measures] pre-period means over every partition's table; a bucket
        without queries gets the pooled mean (0 with no table: a constant, no adjustment)."""
        if self._means is None:
            total = np.zeros((self.buckets, self.measures, 2))
            stored = self.store.load_ab(self.store.partitions())
            for p, ps in list(self.held.items()):   # a held partition's own table: newer than its checkpoint
                if PRE in ps.ab:
                    stored[p] = {**stored.get(p, {}), PRE: ps.ab[PRE].tobytes()}
            for p, fields in stored.items():
                data = fields.get(PRE)
                if data is None:
                    continue
                if len(data) != 8 * self.size:
                    self.unreadable.skip("experiment", f"{{{p}}}:ab", PRE,
                                         f"{len(data)} bytes, not {8 * self.size} (ab.cuped_buckets × measures × 16)")
                    continue
                table = np.frombuffer(data).reshape(self.buckets, self.measures, 2)
                counts = table[..., 0]
                if not np.isfinite(table).all() or (counts < 0).any() or (counts != np.round(counts)).any():
                    self.unreadable.skip("experiment", f"{{{p}}}:ab", PRE,
                                         "a count below 0 or not whole, or a value not finite")
                    continue
                total += table
            n, s = total[..., 0], total[..., 1]
            pooled = np.divide(s.sum(0), n.sum(0), out=np.zeros(self.measures), where=n.sum(0) > 0)
            self._means = np.where(n > 0, s / np.where(n > 0, n, 1.0), pooled)
        return self._means

    def forget(self) -> None:
        self._means = None

    def contributions(self, records: list[QueryRecord], columns: list[int | None], values: np.ndarray) -> np.ndarray:
        """[Q, definition measures, 3]: each query's Σx, Σx², Σxy per measure of the
        experiment's definition (`columns`: its column in the A/B layout, None: not
        computed here, 0), for the measures the query counts."""
        means = self.means()
        out = np.zeros((len(records), len(columns), COVARIATE_SLOTS))
        for i, record in enumerate(records):
            b = bucket(record.impression.query_hash, self.buckets) if record.impression else -1
            for k, c in enumerate(columns):
                if c is None or np.isnan(values[i, c]):
                    continue
                # A text without a hash (none sent): the pooled mean, as one without pre-period data.
                x = means[b, c] if b >= 0 else _pooled(means, c)
                if not np.isfinite(x * x * values[i, c]):  # (tables that add up past floats: left out)
                    continue
                out[i, k] = (x, x * x, x * values[i, c])
        return out


def _pooled(means: np.ndarray, column: int) -> float:
    return float(means[:, column].mean())


def arm_covariates(stored: Mapping[int, Mapping[str, bytes]], experiment: str, measures: int, by_user: bool,
                   buckets: int, skip: Callable[[int, str, str], None]) -> dict[tuple[str, str], np.ndarray]:
    """Each arm's covariate sums over every partition: (ranker, segment) -> [measures, 3],
    or with user buckets [buckets, measures, 3]."""
    out: dict[tuple[str, str], np.ndarray] = {}
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
            if by_user:
                out.setdefault((ranker, segment), np.zeros((buckets, measures, COVARIATE_SLOTS)))[int(bucket_[0])] += vector
            else:
                out[(ranker, segment)] = out.get((ranker, segment), 0) + vector
    return out
