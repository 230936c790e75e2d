"""Experiments: A/B enrolment and the arms' cumulative sums, team-draft interleaving
credit, and the look at both over every partition's stored sums (`look`)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import datetime, timezone

import numpy as np

from rankmeter.ab import clusters
from rankmeter.ab import report as ab_report
from rankmeter.ab import sums as ab_sums
from rankmeter.ab.decision import decide, roles
from rankmeter.ab.experiment import Look, Preference, interleaving_look
from rankmeter.ab.experiment import look as ab_look
from rankmeter.ab.stats import INTERLEAVING_TAU2
from rankmeter.config import Settings, duration_ms, time_ms
from rankmeter.debias.segments import NAME as SEGMENT_PAIRS  # a segment's pair sums (debias/): not an arm
from rankmeter.join import QueryRecord
from rankmeter.pipeline.context import Touched
from rankmeter.pipeline import final
from rankmeter.pipeline.covariates import PRE, PRE_USER, SUFFIX, Covariates, arm_covariates
from rankmeter.pipeline.labels import Labels
from rankmeter.pipeline.phases import Phase
from rankmeter.pipeline.running import RunningRecords
from rankmeter.pipeline.state import PAIRS, PartitionState
from rankmeter.pipeline.users import arm_users, enrolled
from rankmeter.store import Store
from rankmeter.unreadable import Unreadable
from rankmeter.windows import Layout

log = logging.getLogger("rankmeter.pipeline")

HISTORY_INTERVAL_MS = 60_000  # an experiment's history: one line a minute ...
HISTORY_KEEP = 20_000         # ... for two weeks
INTERLEAVING = "il\x1f"       # the fields of interleaving counts: il␟experiment␟a␟b[␟ab.interleaving_start]
# A record's `ab_experiment` for an interleaved query it counts in no experiment: its
# experiment or a team was past the label caps when its impression was applied.
NOT_COUNTED = INTERLEAVING


def ab_problem(field: str, data: bytes) -> tuple[str, str] | None:
    """(kind, why) when a stored experiment field cannot be read, else None. Names hold
    no \x1f (the decoder refuses control characters), so each part is one name."""
    kind = "interleaving" if field.startswith(INTERLEAVING) else "experiment"
    parts, expected = field.count("\x1f") + 1, (4, 5) if kind == "interleaving" else (3, 4)
    if parts not in expected:
        return kind, f"{parts} parts separated by \\x1f, not {' or '.join(map(str, expected))}"
    last = field.rsplit("\x1f", 1)[1]
    # The canonical decimal the writer produces: str.isdigit() also holds for "²" (which
    # int() refuses) and "١٢" (which it reads as 12).
    # At most 19 digits before int(): Python refuses to convert over 4,300 (a ValueError).
    decimal = len(last) <= 19 and last.isascii() and last.isdigit() and str(int(last)) == last
    if kind == "interleaving" and parts == 5 and not decimal:
        return kind, "its start (the fifth part) is not epoch milliseconds"
    if kind == "experiment" and parts == 4 and not (decimal and int(last) < clusters.BUCKETS):
        return kind, f"its user bucket (the fourth part) is not a number below {clusters.BUCKETS}"
    if len(data) % 8 or (kind == "interleaving" and len(data) != 24):
        return kind, f"{len(data)} bytes of sums"
    return None


def mixture_after_ms(settings: Settings) -> int:
    """How long after a phase's start a τ² per metric may be fixed: once its first queries
    have their feedback (ab.mixture_after; by default twice the attribution window, with
    the grace). Read before the clicks arrive, a click metric's variance is far too small."""
    w = settings.windows
    if settings.ab.mixture_after:
        return duration_ms(settings.ab.mixture_after)
    return 2 * (duration_ms(w.attribution) + duration_ms(w.grace))


def read_past(held: Mapping[int, PartitionState], ms: int) -> bool:
    """Every held partition that has read anything has read past `ms` (and one has). (By
    its newer topic: a quiet feedback topic must not hold the statistics back for good.)"""
    marks = [max(ps.watermarks.values()) for ps in held.values() if ps.watermarks]
    return bool(marks) and min(marks) >= ms


def waiting_note(tested_from_ms: int) -> str:
    when = datetime.fromtimestamp(tested_from_ms / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return (f"no statistics before {when}: a metric's mixture variance is fixed once the phase's first "
            f"queries have their clicks (ab.mixture_after)")


def interleaving_counts(experiment: str, a: str, b: str, start: int | None) -> str:
    """The field of an interleaving experiment's counts; with `ab.interleaving_start`
    its start is part of it: a name reused with another start is another experiment.
    Without one the start is ab.start's (Experiments), so a new ab.start is a new one too."""
    since = "" if start is None else f"\x1f{start}"
    return f"{INTERLEAVING}{experiment}\x1f{a}\x1f{b}{since}"


def arm_vectors(stored: Mapping[int, Mapping[str, bytes]], experiment: str, size: int, by_user: bool,
                unreadable: Callable[[int, str, bytes], bool], skip: Callable[[int, str, str], None],
                counted: set[tuple[int, str]] | None = None) -> tuple[dict[tuple[str, str], np.ndarray], set[str]]:
    """Each arm's A/B sums over every partition ((ranker, segment) -> [size], with user
    buckets [BUCKETS, size]), and the experiment names stored (for the phase's notes).
    `counted` collects (partition, field) of each field summed."""
    vectors: dict[tuple[str, str], np.ndarray] = {}
    names: set[str] = set()
    for p, fields in stored.items():
        for field, data in fields.items():
            if field in (PAIRS, PRE, PRE_USER) or field.startswith((INTERLEAVING, SEGMENT_PAIRS + "\x1f")) \
                    or unreadable(p, field, data):
                continue
            name, ranker, segment, *bucket = field.split("\x1f")
            if name.endswith(SUFFIX):
                continue  # covariate sums (ab.cuped: pipeline/covariates.py)
            names.add(name)
            vector = np.frombuffer(data)
            if name != experiment:
                continue  # another experiment (an earlier phase), or a replica on another configuration
            if len(vector) != size:
                skip(p, field, f"{len(data)} bytes, not {8 * size}")
                continue
            if by_user != bool(bucket):
                continue  # (the unit is in the name: a field of another layout, not ours)
            arm = (ranker, segment)
            if counted is not None:
                counted.add((p, field))
            if by_user:  # one row per user bucket: the clusters of ab/clusters.py
                vectors.setdefault(arm, np.zeros((clusters.BUCKETS, size)))[int(bucket[0])] += vector
            else:
                vectors[arm] = vectors.get(arm, 0) + vector
    return vectors, names


class Experiments:
    def __init__(self, settings: Settings, store: Store, held: dict[int, PartitionState], layout: Layout,
                 clock: Callable[[], float], labels: Labels, unreadable: Unreadable) -> None:
        self.settings = settings
        self.labels = labels
        self.unreadable = unreadable
        self.store = store
        self.held = held
        self.layout = layout  # the A/B layout: the debiased measures are not in experiments
        self.clock = clock
        self.baseline = settings.ab.baseline
        # The experiment: every other ranker against the baseline, from its phase's start on.
        self.phase = Phase(settings, store, layout, unreadable)
        self.interleaving_start = time_ms(s) if (s := settings.ab.interleaving_start or settings.ab.start) else None
        self._notes: tuple[str, ...] = ()
        self.by_user = settings.ab.unit == "user"
        self.units_missing = 0  # impressions of an experiment by user without a client_id: left out
        self.result: Look | None = None               # the last look (partition 0's holder only)
        self.interleaving: list[Preference] = []
        self._last_history_ms = 0
        self.records = RunningRecords(store, unreadable)
        self.covariates = Covariates(settings, store, held, len(layout.names), unreadable)

    @property
    def name(self) -> str | None:
        """The experiment's name (ab/identity.py): its phase and configured measures, so
        that a new split or another definition of a measure starts a new experiment, and
        a release that stores more does not."""
        return self.phase.name

    def resolve(self) -> None:
        """The experiment's stored definition and covariate means, read at every claim."""
        self.phase.resolve()
        self.covariates.resolve()

    def forget(self, keep_saved: bool = False) -> None:
        """No results exported: they are partition 0's holder's. Unless this process claims
        partition 0 again at once (`keep_saved`), another holder may save them now."""
        self.result, self.interleaving = None, []
        if not keep_saved:
            self.records.saved = {}

    def enrol(self, record: QueryRecord) -> str:
        """The experiment an impression belongs to, decided once, when it is applied, by its
        time alone: every impression of a ranker from `ab.start` on, and nothing that
        feedback could select later. An interleaved list counts in its interleaving
        experiment: the field of its counts, fixed here like the ranker's label."""
        impression = record.impression
        if impression.experiment:
            if self.interleaving_start is not None and impression.timestamp_ms < self.interleaving_start:
                return NOT_COUNTED
            return self._interleaving_field(impression.experiment, impression.teams)
        phase = self.phase.phase
        if phase is None or impression.timestamp_ms < phase.since_ms:
            return ""
        if self.by_user and impression.user_bucket < 0:
            self.units_missing += 1  # no user to assign: not in the experiment (counted)
            return ""
        return self.name or ""

    def _interleaving_field(self, experiment: str, teams: list[str]) -> str:
        """The experiment and both teams under the label caps (`limits.max_experiments`,
        `limits.max_rankers`): an interleaving experiment is a label; else not counted
        (a preference between a ranker and `other` means nothing)."""
        a, b = sorted(set(teams))
        label = self.labels.label
        if label("experiment", experiment) != experiment or label("ranker", a) != a or label("ranker", b) != b:
            return NOT_COUNTED
        return interleaving_counts(experiment, a, b, self.interleaving_start)

    def move(self, keys: list[Touched], records: list[QueryRecord], values: np.ndarray,
             nums: np.ndarray, dens: np.ndarray, judged: np.ndarray) -> None:
        """Move the experiment's cumulative arm sums by the changed queries' new minus old
        A/B contributions (every enrolled impression counts, unjudged ones as 0)."""
        experiment, phase = self.name, self.phase
        inside = [experiment is not None and r.ab_experiment == experiment for r in records]
        m = len(self.layout.names)  # the debiased measures, last, are not in experiments
        if self.covariates.on:
            self.covariates.observe_batch(keys, records, values[:, :m])
        if not any(inside):
            return
        if not phase.definition:
            phase.resolve()
        size = phase.size
        old = np.zeros((len(records), size))
        for i, record in enumerate(records):
            if inside[i] and record.ab_contribution:
                if len(record.ab_contribution) == 8 * size:
                    old[i] = np.frombuffer(record.ab_contribution)
                else:  # written under another definition (one the store lost): cannot be taken back
                    inside[i] = False
                    self.unreadable.skip("experiment", f"{{{keys[i].partition}}}:queries", record.query_id,
                                         f"{len(record.ab_contribution)} bytes of A/B sums, not {8 * size}")
        new = ab_sums.contributions(phase.columns, values[:, :m], nums[:, :m], dens[:, :m], judged, old)
        for k, record, vector, before, counts in zip(keys, records, new, old, inside):
            if not counts:
                continue
            field = f"{experiment}\x1f{record.ranker_label}\x1f{record.segment_label}"
            if self.by_user:  # the user's bucket: whole users per bucket, independent clusters
                enrolled(self.held[k.partition], field, record)  # (and the arm's distinct users)
                field += f"\x1f{record.impression.user_bucket}"
            ps = self.held[k.partition]
            sums = ps.ab.get(field)
            if sums is None:
                sums = ps.ab[field] = np.zeros(size)
            if len(sums) != size:  # stored under another definition (one the store lost): never mixed in
                self.unreadable.skip("experiment", f"{{{k.partition}}}:ab", field, f"{len(sums)} sums, not {size}")
                continue
            sums += vector - before
            ps.dirty_ab.add(field)
            record.ab_contribution = vector.tobytes()
        if self.covariates.on:
            self.covariates.move(keys, records, values[:, :m], inside, experiment, phase.columns, self.by_user)

    def credit_interleaving(self, keys: list[Touched], records: list[QueryRecord]) -> None:
        """Team-draft credit (Radlinski et al., CIKM 2008): each clicked document counts for
        the team that contributed its position; the team with more clicks wins the query.
        A query's outcome moves the experiment's counts when later clicks change it."""
        for k, record in zip(keys, records):
            impression = record.impression
            if not impression.experiment:
                continue
            field = record.ab_experiment
            if field == NOT_COUNTED:
                continue
            a, b = sorted(set(impression.teams))
            credit = Counter(impression.teams[impression.results.index(doc)] for doc in record.clicked)
            outcome = -1 if not record.clicked else 0 if credit[a] > credit[b] else 1 if credit[b] > credit[a] else 2
            if outcome == record.interleaving_outcome:
                continue
            counted = record.interleaving_outcome
            if not field.startswith(INTERLEAVING):  # a record of a version that did not fix it: its
                # outcome was counted under another field, so not in this one (never below 0 here)
                field, counted = interleaving_counts(impression.experiment, a, b, self.interleaving_start), -1
            ps = self.held[k.partition]
            counts = ps.ab.setdefault(field, np.zeros(3))
            if counted >= 0:
                counts[counted] -= 1
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
        # Without the tables read elsewhere: the CUPED table once a process (covariates.py), 9.4 MB.
        stored = self.store.load_ab(self.store.partitions(), without=(PAIRS, PRE, PRE_USER))
        self._look_at_interleaving(stored, save)
        experiment, phase = self.name, self.phase
        if not self.baseline or experiment is None or phase.phase is None:
            return None
        if not phase.definition:
            phase.resolve()
        counted: set[tuple[int, str]] = set()
        vectors, names = arm_vectors(stored, experiment, phase.size, self.by_user, self._unreadable,
                                     lambda p, f, why: self.unreadable.skip("experiment", f"{{{p}}}:ab", f, why), counted)
        # What the running statistics keep depends on alpha and the mixture too.
        a = self.settings.ab
        tau2 = a.mixture_variance or f"scale={a.mixture_scale}"
        state = f"{experiment}|alpha={a.alpha}|tau2={tau2}"
        # A record a look saved (marked after it was stored, so read before it) that the store no
        # longer holds and no process remembers (evicted, deleted, another mixture setting): lost.
        marks_key, declared = final.tested_key(experiment), roles(a)
        marked = self.records.marks(marks_key)
        running, unreadable_fields = self.records.load(state)
        missing, lost_before = self.records.missing(marked, running, unreadable_fields, experiment)
        tested_from = phase.phase.since_ms + mixture_after_ms(self.settings)
        # By the data read too (a backlog has not read its clicks); rankmeter report fixes none.
        settled = save and self.clock() * 1000 >= tested_from and read_past(self.held, tested_from)
        covariates = arm_covariates(stored, experiment, len(phase.definition), self.by_user, clusters.BUCKETS,
                                    lambda p, f, why: self.unreadable.skip("experiment", f"{{{p}}}:ab", f, why),
                                    counted) if a.cuped else None
        result, kept = ab_look(experiment, self.baseline, vectors, phase.names, a, running, settled,
                               arm_users(self.store, stored, experiment, self.unreadable) if self.by_user else None,
                               covariates)
        waiting = not (settled or a.mixture_variance or result.comparisons)  # (stored τ² go on testing)
        now_ms = int(self.clock() * 1000)
        scope = phase.phase.comparison  # (a treatment whose decision's running record was unreadable: no_ship)
        decisions, reached, final_notes = final.applied(
            self.store, self.unreadable, scope, names | {experiment}, self.records.saved,
            decide(result, a, {**running, **kept}), now_ms, final.treatments([*unreadable_fields, *missing, *lost_before], declared),
            bool(a.primary))
        notes = phase.notes(names) + result.notes + ((waiting_note(tested_from),) if waiting else ()) + final_notes
        result = result._replace(split=phase.phase.split, since_ms=phase.phase.since_ms, notes=notes,
                                 unit=phase.phase.unit, decisions=decisions)
        if notes != self._notes:
            for note in notes:
                log.warning(note, extra={"experiment": experiment})
            self._notes = notes
        # Partition 0's holder keeps the running statistics, fenced by its claim: a stale
        # holder's look (read before a newer one's) must not move them back.
        owner = self.held[0].epoch if 0 in self.held else None
        if save and owner is not None and reached:  # (fenced the same way: a stale holder writes nothing)
            self.records.save(final.key(scope), {**self.records.saved.get(final.key(scope), {}), **reached}, owner)
        if save and owner is not None and self.records.save(state, {**running, **kept}, owner):
            # After the records are stored: a mark never names a record not yet written.
            self.records.mark(marks_key, [f for f in kept if final.treatments([f], declared)], missing, now_ms, owner)
            if now_ms - self._last_history_ms >= HISTORY_INTERVAL_MS:
                self.store.append_look(experiment, ab_report.snapshot(result, now_ms), HISTORY_KEEP, owner)
                self._last_history_ms = now_ms
        self.result = result
        return result

    def _look_at_interleaving(self, stored: Mapping[int, Mapping[str, bytes]], save: bool) -> None:
        vectors: dict[tuple[str, str, str], np.ndarray] = {}
        start = "" if self.interleaving_start is None else str(self.interleaving_start)
        for p, fields in stored.items():
            for field, data in fields.items():
                if field.startswith(INTERLEAVING) and not self._unreadable(p, field, data):
                    _, experiment, a, b, *since = field.split("\x1f")
                    if (since[0] if since else "") == start:  # else counts of another start
                        vectors[(experiment, a, b)] = vectors.get((experiment, a, b), 0) + np.frombuffer(data)
        if not vectors:
            self.interleaving = []
            return
        # Keyed by what the running statistics depend on: alpha, τ² and the start.
        state = f"interleaving|alpha={self.settings.ab.alpha}|tau2={INTERLEAVING_TAU2}|start={start}"
        running, _ = self.records.load(state)
        self.interleaving, kept = interleaving_look(vectors, self.settings.ab, running)
        if save and 0 in self.held:
            self.records.save(state, {**running, **kept}, self.held[0].epoch)

    def _unreadable(self, p: int, field: str, data: bytes) -> bool:
        if (problem := ab_problem(field, data)) is not None:
            self.unreadable.skip(problem[0], f"{{{p}}}:ab", field, problem[1])
        return problem is not None
