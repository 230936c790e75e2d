"""Scoring: the changed queries evaluated together (the engine's measures, the online
signals, the debiased measures), their experiment sums moved, and their window
contributions' deltas added to the buckets."""

from __future__ import annotations

import threading

import numpy as np

from rankmeter.config import Settings
from rankmeter.engine import QueryState, evaluate, evaluate_online, parse_all, stack
from rankmeter.join import clicks_of, pack_scores
from rankmeter.pipeline.context import Batch
from rankmeter.pipeline.experiments import Experiments
from rankmeter.pipeline.layouts import Layouts
from rankmeter.pipeline.position_bias import PositionBias
from rankmeter.pipeline.records import Records
from rankmeter.pipeline.state import PartitionState
from rankmeter.windows import MINUTE_MS, SLOTS, BucketKey


class Scoring:
    def __init__(self, settings: Settings, held: dict[int, PartitionState], layouts: Layouts, records: Records,
                 experiments: Experiments, position_bias: PositionBias, lock: threading.Lock) -> None:
        self.held = held
        self.layout = layouts.current
        self.records = records
        self.experiments = experiments
        self.position_bias = position_bias
        self.lock = lock  # the buckets: a scrape reads them
        self.measures = parse_all(settings.evaluation.measures)
        self.debiased = bool(position_bias.measures)
        self.level = settings.evaluation.relevance_level

    def evaluate(self, batch: Batch) -> None:
        """Recompute the changed queries' metrics together and move their window
        contributions by the difference (into `dirty_buckets`)."""
        changed = batch.changed
        keys = list(changed)
        if not keys:
            return
        records = list(map(batch.touched.__getitem__, keys))
        level = self.level
        states = []
        for (p, qid), record, docs in zip(keys, records, changed.values()):
            cache = self.held[p].states
            state = cache.get(qid)
            if state is None or docs is None:
                state = cache[qid] = QueryState.from_grades(record.impression.results, record.grades(),
                                                            level, shown_grade=0)
            else:  # incremental: only the documents this batch's feedback touched
                for doc in docs:
                    state.set_grade(doc, record.grade(doc))
            states.append(state)
        scored = stack(states)
        names = self.layout.names
        values = np.empty((len(keys), len(names)))
        nums, dens = np.empty_like(values), np.empty_like(values)
        ratios = {**evaluate(self.measures, scored), **evaluate_online(clicks_of(records, [s.rank_of for s in states]))}
        for i, (m, ratio) in enumerate(ratios.items()):   # in the layout's order: measures, then signals
            values[:, i], nums[:, i], dens[:, i] = m.values(ratio), ratio.num, ratio.den
        debiased = slice(len(ratios), len(names))  # ... then the debiased measures
        if self.debiased:
            self.position_bias.values(records, values[:, debiased], nums[:, debiased], dens[:, debiased])
            held = self.position_bias.population(records, values[:, debiased])
        judged = scored.num_rel > 0
        self.experiments.move(keys, records, values, nums, dens, judged)
        self.experiments.credit_interleaving(keys, records)
        previous = self.records.previous(records)
        if self.debiased and held.any():  # in the debiased measures, no value now: keep the last
            _keep_last(held, debiased, previous, values, nums, dens)
        deltas = self.layout.contributions(values, nums, dens, judged) - previous

        # Sum the deltas per bucket first: a batch touches few buckets and many queries.
        buckets = [(p, r.ranker_label, r.segment_label, r.impression.timestamp_ms // MINUTE_MS)
                   for (p, _), r in zip(keys, records)]
        index = {b: i for i, b in enumerate(dict.fromkeys(buckets))}
        # Rows grouped by bucket (a stable sort), summed per group: several times faster
        # than np.add.at; the same sums to rounding (reduceat adds in its own order: the
        # last bits may differ, counts are exact).
        rows = np.fromiter(map(index.__getitem__, buckets), np.intp, len(buckets))
        order = np.argsort(rows, kind="stable")
        starts = np.flatnonzero(np.diff(rows[order], prepend=-1))
        totals = np.add.reduceat(deltas[order], starts, axis=0)
        # What is stored is the scores the contribution is a function of (a quarter of its size).
        for record, scores in zip(records, pack_scores(values, nums, dens, judged)):
            record.contribution = scores
        dirty = batch.dirty_buckets
        with self.lock:
            for (p, *key), i in index.items():
                bucket = BucketKey(*key)
                sums = self.held[p].buckets.get(bucket)
                if sums is None:
                    sums = self.held[p].buckets[bucket] = np.zeros(self.layout.size)
                sums += totals[i]
                dirty.setdefault(p, set()).add(bucket)


def _keep_last(rows: np.ndarray, columns: slice, previous: np.ndarray, values: np.ndarray,
               nums: np.ndarray, dens: np.ndarray) -> None:
    """Give `rows` the value, numerator and denominator they had in `columns` (measures
    averaged over all queries, without histogram bins: the debiased ones), read back
    from their previous contribution: [value, counted, numerator, denominator, value²]
    per measure, value NaN where it was not counted. The contribution rebuilt from
    them, and the scores stored, are then the previous ones in those columns."""
    last = previous[np.ix_(rows, range(SLOTS * columns.start, SLOTS * columns.stop))]
    last = last.reshape(len(last), columns.stop - columns.start, SLOTS)
    counted = last[:, :, 1] != 0
    values[rows, columns] = np.where(counted, last[:, :, 0], np.nan)
    nums[rows, columns] = np.where(counted, last[:, :, 2], 0.0)
    dens[rows, columns] = np.where(counted, last[:, :, 3], 0.0)
