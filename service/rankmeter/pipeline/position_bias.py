"""Position bias (debias/): the harvest of queries whose clicks are final, the debiased
measures' values and population, the pooled ideals, and the look at the click models and
their fit test (debias/fit.py): while it fails, the debiased series are withdrawn."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from rankmeter.config import Debias, Settings
from rankmeter.debias import ipw, segments
from rankmeter.debias.clickmodels import slots
from rankmeter.debias.fit import Look, from_fields, to_fields
from rankmeter.debias.propensity import Harvester, Propensities, Steps
from rankmeter.debias.tables import ModelTables, deciding, upgrade
from rankmeter.debias.tables import unreadable as pairs_unreadable
from rankmeter.engine import parse_all
from rankmeter.join import QueryRecord
from rankmeter.pipeline.state import PAIRS, PartitionState
from rankmeter.store import PartitionCheckpoint, Store
from rankmeter.unreadable import Unreadable

# A cached ideal is weighed anew once its text's harvest has grown by this factor: an
# ideal over a thin harvest overstates (the top of noisy estimates), and a replay or a
# catch-up reads hours of traffic between two looks.
IDEAL_REFRESH_GROWTH = 1.25


class _Pending(NamedTuple):
    """A look's estimate under way (`PositionBias.advance`): its steps, its time, and the
    claim of partition 0 it was begun under."""
    steps: Steps[tuple[Look, dict[str, list[float]]]]  # (`looking`: the look and the segments' curves)
    at: float
    epoch: int


class PositionBias:
    def __init__(self, settings: Settings, store: Store, held: dict[int, PartitionState],
                 unreadable: Unreadable | None = None) -> None:
        self.settings = settings
        self.unreadable = unreadable if unreadable is not None else Unreadable()
        self.store = store
        self.held = held
        self.measures = parse_all(settings.debias.measures)
        d = settings.debias
        # The click models' tables (one for every partition held: a query text's impressions
        # are spread over partitions, keyed by query_id, and its pooled ideal needs them
        # together), and the last look: examination per rank (pbm) and per slot (ubm), the
        # model chosen, the fit test's reason; decided by partition 0's holder from every
        # partition's sums, read by all.
        self.tables = self._tables()
        # (query text, depth) -> (pooled ideal DCG, the text's support when weighed)
        self._ideals: dict[tuple[str, int], tuple[float | None, float]] = {}
        self._looked = False
        self._segment_kept: dict[str, tuple[float, list[float] | None]] = {}  # (segments.curves)
        self.harvested = 0  # queries observed by the harvest, since start (a batch refused later too)
        self._pending: _Pending | None = None  # partition 0's holder: the estimate under way

    def _tables(self) -> ModelTables:
        d = self.settings.debias
        # One segment table per label the label cap admits, and `other` (none when off).
        limit = self.settings.limits.max_segments + 1 if d.segment_curves else 0
        return ModelTables(d.ranks, d.capacity, d.max_weight, segment_capacity=d.segment_capacity,
                           segment_limit=limit)

    @property
    def per_segment(self) -> bool:
        """Per-segment curves on (`debias.segment_curves`): else no segment table, field or curve."""
        return self.settings.debias.segment_curves

    @property
    def segment_curves(self) -> dict[str, list[float]]:
        """The segments with their own curve (debias/segments.py), from the last look."""
        return self.tables.curves

    @property
    def segment_status(self) -> dict[str, bool]:
        """Each segment harvested here or with a curve: whether its own curve weighs now (only
        with pbm chosen and the debiased series not withdrawn: `ModelTables.weights`)."""
        curves, look = self.tables.curves, self.tables.look
        used = look.model == "pbm" and look.valid and look.chosen.relative[0] is not None
        return {s: used and s in curves for s in sorted(set(self.tables.segments.tables) | set(curves))}

    @property
    def harvester(self) -> Harvester | None:
        """The pbm table (`debias.propensity.Harvester`), None with the measures off."""
        return self.tables.pbm if self.measures else None

    @property
    def propensities(self) -> Propensities:
        return self.tables.look.pbm

    @propensities.setter
    def propensities(self, found: Propensities) -> None:
        """pbm propensities set by hand (tests): trusted, pbm weighs."""
        self.tables.looked(self.tables.look._replace(pbm=found, model="pbm", reason="ok"))
        self._ideals = {}

    @property
    def look_result(self) -> Look:
        return self.tables.look

    def restart(self) -> None:
        """New tables, as after a store failure: the ones kept may hold a batch that was
        never stored (and will be replayed); the stored sums are what counts. The last
        look's parameters stay."""
        look, curves = self.tables.look, self.tables.curves
        self.tables, self._pending = self._tables(), None
        self.tables.looked(look, curves)
        self._ideals = {}

    def forget_ideals(self) -> None:
        """Weigh the ideals anew, with the harvest since the last look."""
        self._ideals = {}

    def harvest_into(self, due: Mapping[int, Mapping[str, QueryRecord]],
                     payloads: Mapping[int, PartitionCheckpoint]) -> None:
        """`harvest`, as the batch's checkpoint is sent (`Checkpoint.send`, before the commit):
        the pair sums it moves go into that checkpoint's `payloads` (built, not yet sent).
        In serve this runs on the checkpoint's thread while the next batch is read, off the
        consuming thread's path; the next batch is applied (and weighs with these tables)
        only once it is done."""
        self.harvest(due)
        for p in due:
            ps = self.held.get(p)
            if ps is None or p not in payloads:
                continue
            moved = [f for f in ps.dirty_ab if f == PAIRS or (self.per_segment and segments.segment_of(f))]
            for f in moved:
                payloads[p].ab[f] = ps.ab[f].tobytes()
                ps.dirty_ab.discard(f)

    def harvest(self, due: Mapping[int, Mapping[str, QueryRecord]]) -> None:
        """Queries whose clicks are final (their implicit attribution is over) into the
        position-bias harvest, once each (`debias.propensity`); what they add to the pair
        sums goes to their partition's, stored with its checkpoint (`harvest_into`).
        `due`: partition -> query_id -> its record, as the batch held it when its
        checkpoint was built (an expired one is no longer in the cache)."""
        if not self.measures:
            return
        on = self.per_segment
        for p, records in due.items():
            ps = self.held.get(p)
            if ps is None or ps.pair_sums is None:
                continue
            before, segments_before = self.tables.vector(), self.tables.segments.vectors() if on else {}
            for qid, record in records.items():
                if record.impression is not None:
                    self.tables.observe(qid, record.impression.query_hash, record.impression.results,
                                        set(record.clicked), record.implicit, record.segment_label if on else "")
                    self.harvested += 1
            ps.pair_sums = ps.pair_sums + (self.tables.vector() - before)
            ps.ab[PAIRS] = ps.pair_sums
            ps.dirty_ab.add(PAIRS)
            if on:
                segment_deltas(self.tables, self.settings.debias.ranks, self.unreadable, p, ps, segments_before)

    def values(self, records: list[QueryRecord], values: np.ndarray, nums: np.ndarray,
               dens: np.ndarray) -> None:
        """The IPW variants (debias/ipw.py), in place: each query's implicit grades times
        the clipped inverse propensity of their rank, DCG@k as the engine computes it
        (`ipw.dcg_of`, checked against it: tests/test_propensity.py). nDCG@k divides by the
        ideal DCG@k of the query text's pooled debiased grades (`Harvester.ideal_dcg`), the
        same whichever ranker answered: a list's own ideal would cancel the weights.
        Without a pooled ideal (a text not harvested yet), or before the first estimate
        of the propensities, the query has no value.
        Explicit judgments are left out: they carry no position bias, and the raw series
        has them."""
        look = self.tables.look
        if look.chosen.relative[0] is None or not look.valid:
            # Nothing to weigh with yet, or the fit test fails: no value (and a query shown
            # now never counts, as before the first estimate).
            values[:], nums[:], dens[:] = np.nan, 0.0, 0.0
            return
        depth = max(int(m.cutoff) for m in self.measures)
        for i, r in enumerate(records):
            implicit, impression = r.implicit, r.impression
            # pbm: the same weights for every list; ubm: given the clicks above each rank.
            weights = self.tables.weights(impression.results, r.clicked, depth, r.segment_label)
            ranked = list(dict.fromkeys(impression.results))[:depth]
            gains = [implicit.get(doc, 0.0) * w for doc, w in zip(ranked, weights)]
            for j, m in enumerate(self.measures):
                k = int(m.cutoff)
                dcg = ipw.dcg_of(gains, k)
                if m.family == "DCG":
                    values[i, j], nums[i, j], dens[i, j] = dcg, dcg, 1.0
                    continue
                ideal = self._ideal(impression.query_hash, k)
                if ideal:
                    values[i, j], nums[i, j], dens[i, j] = dcg / ideal, dcg, ideal
                else:
                    values[i, j], nums[i, j], dens[i, j] = np.nan, 0.0, 0.0

    def population(self, records: list[QueryRecord], values: np.ndarray) -> np.ndarray:
        """Which queries count in the debiased measures is decided once, at a query's first
        evaluation (at its list, before any click): those with a value then (the
        propensities estimated, its text's ideal known) count from then on, the others
        never. Deciding again at each click would let clicked queries in and keep the
        unclicked out, and bias the average up. Returns the queries that count but have
        no value now (the table restarted, their text evicted): they keep their last."""
        defined = ~np.isnan(values).any(axis=1)
        held = np.zeros(len(records), dtype=bool)
        for i, r in enumerate(records):
            if r.debiased == 0:
                # (a query evaluated before, by a version or configuration without the
                # debiased measures, is decided at a click now: it stays out)
                r.debiased = 1 if defined[i] and not r.contribution else 2
            if r.debiased == 2:
                values[i] = np.nan
            elif not defined[i]:
                held[i] = True
        return held

    def _ideal(self, query: str, depth: int) -> float | None:
        """The query text's pooled ideal DCG under the chosen model, cached until the next
        look (every 5 s in serve) or until its harvest has grown by IDEAL_REFRESH_GROWTH
        (recomputing a popular text's ideal at each of its harvests cost more than the
        rest of the correction; a few times per doubling costs little)."""
        if not self.measures or not query:
            return None
        key, support = (query, depth), self.tables.support(query)
        cached = self._ideals.get(key)
        if cached is None or (support > cached[1] and support >= IDEAL_REFRESH_GROWTH * cached[1]):
            cached = self._ideals[key] = (self.tables.ideal_dcg(query, depth), support)
        return cached[0]

    def look(self, estimate_here: bool, now: float = 0.0, budget_s: float = math.inf) -> None:
        """Refresh the click models the debiased measures use. Partition 0's holder
        estimates both from every partition's stored sums, runs the fit test (its previous
        decision, stored with the estimate, picks the thresholds: a new holder carries on
        the hysteresis) and stores the result; the others read it, so all weigh and
        withdraw alike. `now`: the estimate's time (epoch seconds; 0: not known). The
        estimate runs for `budget_s` now and the rest in `advance` (serve: a few ms a
        batch); a look begun meanwhile only advances it."""
        d = self.settings.debias
        if not self.measures or self._pending is not None:
            self.advance(budget_s)
            return
        if estimate_here and 0 in self.held:  # partition 0's holder, fenced by its claim
            vectors = global_sums(self.store, d.ranks, self.unreadable)
            if not vectors:
                return
            previous = self.tables.look if self._looked else from_fields(self.store.load_running(self._name), d.ranks, slots(d.ranks))
            by_segment = held_segment_sums(self.held, self.tables, self.store, d.ranks, self.unreadable) if d.segment_curves else None
            self._pending = _Pending(looking(d, sum(vectors), previous, by_segment, self._segment_kept), now, self.held[0].epoch)
            self.advance(budget_s)
            return
        stored = self.store.load_running(self._name)
        if (kept := from_fields(stored, d.ranks, slots(d.ranks))) is not None:
            self._apply(kept, segments.from_field(stored.get(segments.KEY), d.ranks, kept.at) if d.segment_curves else {})

    def advance(self, budget_s: float) -> None:
        """The estimate under way for `budget_s` more (an EM iteration at least); once it
        ends, stored and applied, unless partition 0 was claimed again meanwhile."""
        pending = self._pending
        if pending is None:
            return
        ends = time.perf_counter() + budget_s
        try:
            while True:
                next(pending.steps)
                if time.perf_counter() >= ends:
                    return
        except StopIteration as done:
            found, curves = done.value
            found = found._replace(at=pending.at)
        except BaseException:
            self._pending = None  # (its generator is dead: it would fail every later look)
            raise
        self._pending = None
        held = self.held.get(0)
        if held is None or held.epoch != pending.epoch:
            return
        fields = to_fields(found)
        if self.settings.debias.segment_curves:
            fields[segments.KEY] = segments.to_field(curves, found.at)
        if self.store.save_running(self._name, fields, pending.epoch):  # (False: fenced, another holder's)
            self._apply(found, curves)

    @property
    def _name(self) -> str:
        return f"propensity|ranks={self.settings.debias.ranks}|min_pairs={self.settings.debias.min_pairs}"

    def _apply(self, found: Look, curves: dict[str, list[float]]) -> None:
        self._looked, self._ideals = True, {}  # (ideals weighed anew, with the harvest since the last look)
        self.tables.looked(found, curves)


def looking(d: Debias, vector: np.ndarray, previous: Look | None, segment_sums: dict[str, np.ndarray] | None,
            kept: dict[str, tuple[float, list[float] | None]]) -> Steps[tuple[Look, dict[str, list[float]]]]:
    """A look's estimate: both click models and the fit test, then the segments' curves
    (from the sums read at its start), yielding between EM iterations."""
    found = yield from deciding(vector, d.ranks, d.min_pairs, previous)
    curves: dict[str, list[float]] = {}
    if segment_sums is not None:
        curves = yield from segments.curving(segment_sums, d.ranks, d.segment_min_pairs, kept)
    return found, curves


def held_segment_sums(held: Mapping[int, PartitionState], tables: ModelTables, store: Store, ranks: int,
                      unreadable: Unreadable) -> dict[str, np.ndarray]:
    """Each segment's pair sums over every partition. The segments read: those whose sums
    a `held` partition holds (partition 0's holder holds partition 0, and a segment with
    enough support has queries in every partition), this process's, and the last look's."""
    known = {s for ps in held.values() for f in ps.ab if (s := segments.segment_of(f)) is not None}
    known |= set(tables.segments.tables) | set(tables.curves)
    return segment_sums(store, known, ranks, unreadable)


def segment_deltas(tables: ModelTables, ranks: int, unreadable: Unreadable, p: int, ps: PartitionState,
                   before: dict[str, np.ndarray]) -> None:
    """What partition `p`'s queries moved in each segment's sums (`tables` now against
    `before`), into its stored ones (unreadable ones, `segments.unreadable`, counted and
    started afresh)."""
    for segment, after in tables.segments.vectors().items():
        moved = after - before[segment] if segment in before else after
        if not moved.any():
            continue
        f = segments.field(segment)
        stored = ps.ab.get(f)
        if stored is not None and (why := segments.unreadable(stored, ranks)) is not None:
            unreadable.skip("experiment", f"{{{p}}}:ab", f, why)
            stored = None
        ps.ab[f] = (stored if stored is not None else np.zeros(2 * ranks ** 2)) + moved
        ps.dirty_ab.add(f)


def global_sums(store: Store, ranks: int, unreadable: Unreadable) -> list[np.ndarray]:
    """Every partition's stored `PAIRS` that can be read (`tables.unreadable`: the wrong
    length, not finite, past 1e15, a negative pair count), today's length; the others
    counted and left out (their holder starts them afresh at its claim)."""
    out = []
    for p, fields in store.load_ab(store.partitions(), only=(PAIRS,)).items():
        if PAIRS not in fields:
            continue
        data = fields[PAIRS]
        vector = np.frombuffer(data[:len(data) - len(data) % 8])
        if (why := pairs_unreadable(vector, ranks) if len(data) % 8 == 0 else f"{len(data)} bytes") is not None:
            unreadable.skip("experiment", f"{{{p}}}:ab", PAIRS, why)
            continue
        out.append(upgrade(vector, ranks))
    return out


def segment_sums(store: Store, known: set[str], ranks: int, unreadable: Unreadable) -> dict[str, np.ndarray]:
    """The `known` segments' stored sums over every partition, the unreadable left out and
    counted: a partition's (its holder rewrites it, `_segment_deltas`), or a total's (which
    partition is wrong is not known)."""
    fields = [segments.field(s) for s in sorted(known)]
    out: dict[str, np.ndarray] = {}
    for p, stored in (store.load_ab(store.partitions(), only=fields) if fields else {}).items():
        for f, data in stored.items():
            if (segment := segments.segment_of(f)) is None:
                continue
            vector = np.frombuffer(data[:len(data) - len(data) % 8])
            if (why := segments.unreadable(vector, ranks)) is not None:
                unreadable.skip("experiment", f"{{{p}}}:ab", f, why)
                continue
            out[segment] = out.get(segment, 0) + vector
    for segment in list(out):
        if (why := segments.inconsistent(out[segment], ranks)) is not None:
            unreadable.skip("experiment", "ab", segments.field(segment), why)
            del out[segment]
    return out
