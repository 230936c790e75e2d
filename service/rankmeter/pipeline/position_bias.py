"""Position bias (debias/): the harvest of queries whose clicks are final, the debiased
measures' values and population, the pooled ideals, and the look at the propensities."""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np

from rankmeter.config import Settings
from rankmeter.debias import ipw
from rankmeter.debias.propensity import Harvester, PairSums, Propensities, estimate, merge
from rankmeter.engine import parse_all
from rankmeter.join import QueryRecord
from rankmeter.pipeline.state import PAIRS, PartitionState
from rankmeter.store import Store


class PositionBias:
    def __init__(self, settings: Settings, store: Store, held: dict[int, PartitionState]) -> None:
        self.settings = settings
        self.store = store
        self.held = held
        self.measures = parse_all(settings.debias.measures)
        # Examination propensity per rank, relative to rank 1 (None: not estimated yet),
        # from every partition's harvest: estimated by partition 0's holder, read by all.
        self.propensities = Propensities([None] * settings.debias.ranks, [0.0] * settings.debias.ranks, 0)
        self.harvester: Harvester | None = None
        self._ideals: dict[tuple[str, int], float | None] = {}  # (query text, depth) -> pooled ideal DCG
        self.restart()

    def restart(self) -> None:
        """A new harvest table, as after a store failure: the one kept may hold a batch that
        was never stored (and will be replayed); the stored pair sums are what counts.
        One harvest table for every partition held: a query text's impressions are spread
        over partitions (keyed by query_id), and its pooled ideal needs them together."""
        d = self.settings.debias
        self.harvester = Harvester(d.ranks, d.capacity) if self.measures else None
        self._ideals = {}

    def forget_ideals(self) -> None:
        """Weigh the ideals anew, with the harvest since the last look."""
        self._ideals = {}

    def harvest(self, due: Mapping[int, list[str]]) -> None:
        """Queries whose clicks are final (their implicit attribution is over) into the
        position-bias harvest, once each (`debias.propensity`); what they add to the pair
        sums goes to their partition's, stored with its next checkpoint."""
        for p, qids in due.items():
            ps = self.held.get(p)
            if ps is None or ps.pair_sums is None or self.harvester is None:
                continue
            before = self.harvester.sums.to_vector()
            for qid in qids:
                record = ps.records.get(qid)
                if record is not None and record.impression is not None:
                    self.harvester.observe(record.impression.query_hash, record.impression.results,
                                           set(record.clicked), record.implicit)
            ps.pair_sums = ps.pair_sums + (self.harvester.sums.to_vector() - before)
            ps.ab[PAIRS] = ps.pair_sums
            ps.dirty_ab.add(PAIRS)

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
        if self.propensities.relative[0] is None:
            values[:], nums[:], dens[:] = np.nan, 0.0, 0.0  # nothing to weigh with yet: no value
            return
        depth = max(int(m.cutoff) for m in self.measures)
        weights = ipw.weights(self.propensities.relative, max(depth, self.settings.debias.ranks),
                              self.settings.debias.max_weight)
        for i, r in enumerate(records):
            implicit, impression = r.implicit, r.impression
            gains = [implicit.get(doc, 0.0) * w for doc, w in zip(impression.results[:depth], weights)]
            for j, m in enumerate(self.measures):
                k = int(m.cutoff)
                dcg = ipw.dcg_of(gains, k)
                if m.family == "DCG":
                    values[i, j], nums[i, j], dens[i, j] = dcg, dcg, 1.0
                    continue
                ideal = self._ideal(impression.query_hash, weights, k)
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

    def _ideal(self, query: str, weights: list[float], depth: int) -> float | None:
        """The query text's pooled ideal DCG, cached until the propensities are looked at
        again (every 5 s in serve): what that text's harvest adds meanwhile waits until
        then (recomputing a popular text's ideal at each of its harvests cost more than
        the rest of the correction)."""
        if self.harvester is None or not query:
            return None
        key = (query, depth)
        if key not in self._ideals:
            self._ideals[key] = self.harvester.ideal_dcg(query, weights, depth)
        return self._ideals[key]

    def look(self, estimate_here: bool) -> None:
        """Refresh the propensities the debiased measures use. Partition 0's holder
        estimates them from every partition's stored pair sums and stores the estimate
        (`rankmeter_propensity`); the other replicas read it, so all weigh alike."""
        d = self.settings.debias
        if not self.measures:
            return
        name = f"propensity|ranks={d.ranks}|min_pairs={d.min_pairs}"
        if estimate_here and 0 in self.held:  # partition 0's holder, fenced by its claim
            size = 2 * d.ranks ** 2
            sums = [PairSums.from_vector(np.frombuffer(fields[PAIRS]))
                    for fields in self.store.load_ab(self.store.partitions()).values()
                    if PAIRS in fields and len(fields[PAIRS]) == 8 * size]
            if not sums:
                return
            found = estimate(merge(sums), d.min_pairs)
            self.store.save_running(name, {"relative": json.dumps(found.relative),
                                           "support": json.dumps(found.support)}, self.held[0].epoch)
        else:
            kept = self.store.load_running(name)
            if not kept:
                return
            relative, support = json.loads(kept["relative"]), json.loads(kept["support"])
            if len(relative) != d.ranks:
                return
            found = Propensities(relative, support, 0)
        self._ideals = {}  # weighed anew, with the harvest since the last look
        self.propensities = found
