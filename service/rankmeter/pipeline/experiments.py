"""Experiments: A/B enrolment and the arms' cumulative sums, team-draft interleaving
credit, and the look at both over every partition's stored sums (`look`)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np

from rankmeter.ab import report as ab_report
from rankmeter.ab import sums as ab_sums
from rankmeter.ab.experiment import Look, Preference, interleaving_look
from rankmeter.ab.experiment import look as ab_look
from rankmeter.config import Settings, time_ms
from rankmeter.join import QueryRecord
from rankmeter.pipeline.context import Touched
from rankmeter.pipeline.state import PAIRS, PartitionState
from rankmeter.store import Store
from rankmeter.windows import Layout

log = logging.getLogger("rankmeter.pipeline")

HISTORY_INTERVAL_MS = 60_000  # an experiment's history: one line a minute ...
HISTORY_KEEP = 20_000         # ... for two weeks
INTERLEAVING = "il\x1f"       # the fields of interleaving counts: il␟experiment␟a␟b


class Experiments:
    def __init__(self, settings: Settings, store: Store, held: dict[int, PartitionState], layout: Layout,
                 clock: Callable[[], float]) -> None:
        self.settings = settings
        self.store = store
        self.held = held
        self.layout = layout  # the A/B layout: the debiased measures are not in experiments
        self.clock = clock
        self.size = ab_sums.size(layout)
        self.baseline = settings.ab.baseline
        # The experiment: every other ranker against the baseline, from `ab.start` on.
        self.start: int | None = time_ms(settings.ab.start) if settings.ab.start else None
        self.result: Look | None = None               # the last look (partition 0's holder only)
        self.interleaving: list[Preference] = []
        self._last_history_ms = 0
        # The running statistics this process last saved (written apart from the partitions'
        # checkpoints): a look reading back something else found them lost (running_lost).
        self._saved: dict[str, dict[str, str]] = {}
        self.running_lost = 0

    @property
    def name(self) -> str | None:
        """The experiment's name: baseline, start, and the measures' layout, so that a
        configuration change starts a new experiment (sums that mix two definitions of a
        measure, or a population enrolled under another one, are no experiment)."""
        if self.start is None:
            return None
        return f"{self.baseline}@{self.start}@{self.layout.fingerprint}"

    def forget(self) -> None:
        """No results exported: they are partition 0's holder's."""
        self.result, self.interleaving = None, []
        self._saved = {}  # another holder may save them now

    def enrol(self, record: QueryRecord) -> str:
        """The experiment an impression belongs to, decided once, when it is applied, by its
        time alone: every impression of a ranker from `ab.start` on, and nothing that
        feedback could select later. Interleaved lists have their own experiment."""
        impression = record.impression
        if self.start is None or impression.experiment or impression.timestamp_ms < self.start:
            return ""
        return self.name or ""

    def move(self, keys: list[Touched], records: list[QueryRecord], values: np.ndarray,
             nums: np.ndarray, dens: np.ndarray, judged: np.ndarray) -> None:
        """Move the experiment's cumulative arm sums by the changed queries' new minus old
        A/B contributions (every enrolled impression counts, unjudged ones as 0)."""
        experiment = self.name
        inside = [experiment is not None and r.ab_experiment == experiment for r in records]
        if not any(inside):
            return
        m = len(self.layout.names)  # the debiased measures, last, are not in experiments
        new = ab_sums.contributions(self.layout, values[:, :m], nums[:, :m], dens[:, :m], judged)
        zero = bytes(8 * self.size)
        for k, record, vector, counts in zip(keys, records, new, inside):
            if not counts:
                continue
            old = record.ab_contribution or zero
            field = f"{experiment}\x1f{record.ranker_label}\x1f{record.segment_label}"
            ps = self.held[k.partition]
            sums = ps.ab.get(field)
            if sums is None:
                sums = ps.ab[field] = np.zeros(self.size)
            sums += vector - np.frombuffer(old)
            ps.dirty_ab.add(field)
            record.ab_contribution = vector.tobytes()

    def credit_interleaving(self, keys: list[Touched], records: list[QueryRecord]) -> None:
        """Team-draft credit (Radlinski et al., CIKM 2008): each clicked document counts for
        the team that contributed its position; the team with more clicks wins the query.
        A query's outcome moves the experiment's counts when later clicks change it."""
        for k, record in zip(keys, records):
            impression = record.impression
            if not impression.experiment:
                continue
            a, b = sorted(set(impression.teams))
            credit = Counter(impression.teams[impression.results.index(doc)] for doc in record.clicked)
            outcome = -1 if not record.clicked else 0 if credit[a] > credit[b] else 1 if credit[b] > credit[a] else 2
            if outcome == record.interleaving_outcome:
                continue
            field = f"{INTERLEAVING}{impression.experiment}\x1f{a}\x1f{b}"
            ps = self.held[k.partition]
            counts = ps.ab.setdefault(field, np.zeros(3))
            if record.interleaving_outcome >= 0:
                counts[record.interleaving_outcome] -= 1
            if outcome >= 0:
                counts[outcome] += 1
            ps.dirty_ab.add(field)
            record.interleaving_outcome = outcome

    def look(self, save: bool = True) -> Look | None:
        """One look at the experiment, over every partition's stored arm sums (the
        statistics are global: serve runs this on the replica that holds partition 0).
        Keeps the result for the exporter in `result`; with `save`, stores what the
        running statistics keep, and a line of history once a minute. Interleaving
        experiments are looked at too (`interleaving`)."""
        stored = self.store.load_ab(self.store.partitions())
        self._look_at_interleaving(stored, save)
        experiment = self.name
        if not self.baseline or experiment is None:
            return None
        vectors: dict[tuple[str, str], np.ndarray] = {}
        for fields in stored.values():
            for field, data in fields.items():
                if field == PAIRS or field.startswith(INTERLEAVING):
                    continue
                name, ranker, segment = field.split("\x1f", 2)
                vector = np.frombuffer(data)
                if name != experiment or len(vector) != self.size:
                    continue  # another experiment, or a replica still on another configuration
                vectors[(ranker, segment)] = vectors.get((ranker, segment), 0) + vector
        # What the running statistics keep depends on alpha, τ² and the split too.
        a = self.settings.ab
        state = f"{experiment}|alpha={a.alpha}|tau2={a.mixture_variance}|split={sorted(a.split.items())}"
        running = self._running(state)
        result, kept = ab_look(experiment, self.baseline, vectors, self.layout, a, running)
        now_ms = int(self.clock() * 1000)
        # Partition 0's holder keeps the running statistics, fenced by its claim: a stale
        # holder's look (read before a newer one's) must not move them back.
        owner = self.held[0].epoch if 0 in self.held else None
        if save and owner is not None and self._save_running(state, kept, owner):
            if now_ms - self._last_history_ms >= HISTORY_INTERVAL_MS:
                self.store.append_look(experiment, ab_report.snapshot(result, now_ms), HISTORY_KEEP, owner)
                self._last_history_ms = now_ms
        self.result = result
        return result

    def _look_at_interleaving(self, stored: Mapping[int, Mapping[str, bytes]], save: bool) -> None:
        vectors: dict[tuple[str, str, str], np.ndarray] = {}
        for fields in stored.values():
            for field, data in fields.items():
                if field.startswith(INTERLEAVING):
                    _, experiment, a, b = field.split("\x1f")
                    vectors[(experiment, a, b)] = vectors.get((experiment, a, b), 0) + np.frombuffer(data)
        if not vectors:
            self.interleaving = []
            return
        running = self._running("interleaving")
        self.interleaving, kept = interleaving_look(vectors, self.settings.ab, running)
        if save and 0 in self.held:
            self._save_running("interleaving", kept, self.held[0].epoch)

    def _running(self, key: str) -> dict[str, str]:
        """The stored running statistics; what this process saved last where the store lost
        it (a restore, a failover): counted, logged, and carried on from memory."""
        stored = self.store.load_running(key)
        saved = self._saved.get(key)
        if saved is not None and any(stored.get(k) != v for k, v in saved.items()):
            self.running_lost += 1
            log.error("the state store lost the experiment's last running statistics: going on from "
                      "what this process saved", extra={"experiment": key})
            return {**stored, **saved}
        return stored

    def _save_running(self, key: str, kept: Mapping[str, str], owner: int) -> bool:
        """Saved unless a newer holder of partition 0 has claimed it (then False)."""
        if not self.store.save_running(key, kept, owner):
            return False
        self._saved[key] = {**self._saved.get(key, {}), **kept}
        return True
