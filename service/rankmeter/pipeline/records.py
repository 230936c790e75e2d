"""The held partitions' query records: read into the cache (one store read per batch),
brought to this configuration's layout, their previous contributions expanded, encoded
for the checkpoint, and the cache bounded."""

from __future__ import annotations

from itertools import filterfalse

import msgspec
import numpy as np

from rankmeter.join import SCORES, QueryRecord, unpack_scores
from rankmeter.pipeline.context import Batch
from rankmeter.pipeline.layouts import Layouts
from rankmeter.pipeline.state import PartitionState
from rankmeter.store import Store

CACHE_LIMIT = 200_000       # query records kept in memory per partition


class Records:
    def __init__(self, store: Store, held: dict[int, PartitionState], layouts: Layouts) -> None:
        self.store = store
        self.held = held
        self.layouts = layouts
        layout = layouts.current
        self.encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(QueryRecord).decode
        self._scores_bytes = 8 * (3 * len(layout.names) + 1)  # a record's packed scores (join.pack_scores)

    def load(self, batch: Batch) -> None:
        """Bring the records the batch needs (and the swept ones: to count orphans, or to
        settle their lists, or to harvest them) into the cache: one read for all partitions."""
        # Each query once, in first-seen order (the cache's order: `trim` drops its oldest).
        needed = {p: {event.query_id: None for _, event in items} for p, items in batch.work.items()}
        for p, qids in batch.swept().items():
            needed.setdefault(p, {}).update(dict.fromkeys(qids))
        wanted = {p: list(filterfalse(self.held[p].records.__contains__, qids)) for p, qids in needed.items()}
        wanted = {p: qids for p, qids in wanted.items() if qids}
        if not wanted:
            return
        decode = self._decode
        for p, found in self.store.read(wanted).items():
            ps = self.held[p]
            cache = ps.records
            for qid, data in zip(wanted[p], found):
                cache[qid] = self._in_layout(decode(data), ps.history) if data is not None else QueryRecord()

    def _in_layout(self, record: QueryRecord, history: list[str]) -> QueryRecord:
        """A record written under an earlier configuration of its partition (`layout`: its
        index in the partition's history): its contributions converted through every
        configuration since, as the buckets were, so the next delta moves only what they
        all share. One whose layout is unknown adds its whole value again; its bucket was
        dropped (see `Claims._load_buckets`)."""
        current = len(history) - 1
        generation = int(record.layout) if record.layout.isascii() and record.layout.isdigit() else -1
        if generation == current:
            return record
        legacy = isinstance(record.contribution, bytes)  # format 1: the vector itself
        if generation < 0 or generation > current:
            if legacy and len(record.contribution) == 8 * self.layouts.current.size and not record.layout:
                return record  # written before layouts were recorded, in this one
            record.contribution = b""
            return record
        vector = np.frombuffer(record.contribution) if legacy else self._unpacked(record.contribution, history[generation])
        for before, after in zip(history[generation:], history[generation + 1:]):
            old, new = self.layouts.get(before), self.layouts.get(after)
            if old is None or new is None or len(vector) != old.size:
                record.contribution = b""
                return record
            vector = new.convert(vector, old)
        # Its A/B contribution stays: it belongs to the experiment of the old layout.
        record.contribution = vector.tobytes()
        return record

    def _unpacked(self, scores: msgspec.msgpack.Ext, fingerprint: str) -> np.ndarray:
        """A format-2 record's contribution vector in the layout it was written in (empty
        when that layout, or the scores, cannot be read)."""
        if scores.code != SCORES:  # (a future format: taken as zero it would count the query twice)
            raise ValueError(f"query record in an unknown format (msgpack ext {scores.code})")
        layout = self.layouts.get(fingerprint)
        m = len(layout.names) if layout is not None else 0
        if layout is None or len(scores.data) != 8 * (3 * m + 1):
            return np.empty(0)
        return layout.contributions(*unpack_scores([scores], m))[0]

    def previous(self, records: list[QueryRecord]) -> np.ndarray:
        """[Q, size]: what each record adds to its window bucket now (in this layout, which
        `_in_layout` brought it to), zero before its first evaluation. Packed scores
        (format 2) are expanded together, in one call."""
        layout = self.layouts.current
        previous = np.zeros((len(records), layout.size))
        packed = []
        for i, record in enumerate(records):
            c = record.contribution
            if isinstance(c, bytes):
                if c:
                    previous[i] = np.frombuffer(c)
            elif c.code == SCORES and len(c.data) == self._scores_bytes:
                packed.append(i)
            else:  # a format this version cannot read: taken as zero it would count the query twice
                raise ValueError(f"query record in an unknown format (msgpack ext {c.code}, {len(c.data)} bytes)")
        if packed:
            previous[packed] = layout.contributions(
                *unpack_scores([records[i].contribution for i in packed], len(layout.names)))
        return previous

    def trim(self) -> None:
        """Bound the cache: forget the oldest entries (they are in the store)."""
        for ps in self.held.values():
            records, states = ps.records, ps.states
            excess = len(records) - CACHE_LIMIT
            if excess > 0:
                for qid in list(records)[:excess]:
                    del records[qid]
                    states.pop(qid, None)
