"""What a /metrics scrape reads, published by the pipeline (`Pipeline.readout`): the
exporter sees this and nothing of the pipeline's classes. Read only: the mappings and
sets are the pipeline's own (copy before iterating at length), the callables read now."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass

from rankmeter.ab.experiment import Look, Preference
from rankmeter.debias import fit
from rankmeter.debias.propensity import Propensities
from rankmeter.windows import WindowView


@dataclass(frozen=True)
class Readout:
    views: Callable[[], list[WindowView]]           # the window aggregates, now
    events: Mapping[tuple[str, str], int]           # (stream, outcome) -> events of stored batches
    folded: Mapping[str, int]                       # label kind -> values folded into `other`
    lost: Set[int]                                  # partitions whose stored state is gone
    checkpoints_lost: Mapping[int, int]             # partition -> losses of its last checkpoints found
    offsets_reset: Mapping[tuple[str, int, str], int]   # (topic, partition, cause) -> resets found
    offsets_skipped: Mapping[tuple[str, int], int]  # (topic, partition) -> offsets skipped resuming
    ab_running_lost: Callable[[], int]              # looks that found the A/B running statistics lost
    fenced_total: Callable[[], int]                 # checkpoints refused: another replica claimed
    open_queries: Callable[[], int]
    held: Callable[[], int]                         # partitions held
    debiased: bool                                  # whether the debiased measures are on
    propensities: Callable[[], Propensities]
    ab_result: Callable[[], Look | None]            # the experiment's last look (partition 0's holder)
    interleaving_result: Callable[[], list[Preference]]
    production_rankers: tuple[str, ...]             # alerts.production_rankers
    unreadable: Mapping[str, int]                   # kind -> stored fields skipped (unreadable.py)
    click_fit: Callable[[], fit.Look] | None = None  # the click models' last look (debias/fit.py)
    ab_units_missing: Callable[[], int] = lambda: 0  # impressions of an experiment by user without a client_id
    harvested: Callable[[], int] = lambda: 0        # queries harvested into the click models by this process
    segment_curves: Callable[[], Mapping[str, bool]] = dict  # segment harvested -> whether it has its own curve
