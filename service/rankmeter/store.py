"""The state store port: per-partition query records, window buckets, offsets and the
owner's epoch.

Everything about partition p lives together (in Redis under one hash tag), and a poll
batch's changes are committed with the partition's new offsets as one
`PartitionCheckpoint` (built and sent by pipeline/checkpoint.py), so a crash keeps both
or neither (brief §8). `MemoryStore` is the embedded implementation for the demo and
unit tests; `RedisStore` (redis_store.py) is the real one.
"""

from __future__ import annotations

import hashlib

from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple, Protocol

import numpy as np

from rankmeter.ab import hll
from rankmeter.unreadable import Unreadable

# Why a checkpoint was refused: another owner's epoch, no state at all, or state older than
# this owner's last checkpoint (the store lost its last writes: a restore, an async failover).
FENCED, LOST, REWOUND = "fenced", "lost", "rewound"


class PartitionCheckpoint(NamedTuple):
    """Everything one poll batch changed in one partition, committed at once. Its state
    (query records, their deadlines, window buckets), the offsets of both topics that
    produced it, the event-time watermarks, the owner's epoch and the layout the sums are
    written in travel together, and the store applies it in one atomic step (one Lua
    script on the partition's hash tag in Redis), in this order:

        1. check the epoch: the partition is still ours. A newer owner has claimed it (this
           process stalled past the poll interval: a zombie) -> refused, nothing written
           (store.FENCED). The epoch is gone (Redis lost its data) -> refused (store.LOST).
           The stored mark is not `expect`, the mark of this owner's last checkpoint (the
           store lost its last writes: restored from an older copy, failed over to a replica
           behind) -> refused, nothing written (store.REWOUND).
        2. write the records that changed, with their event-time deadlines;
        3. delete the records that closed (or were orphaned);
        4. write the buckets that changed, delete the ones past every window, write the
           experiment's arm sums that changed, add the users enrolled to their arms' counts;
        5. record the layout fingerprint the buckets are written in (and, after a
           configuration change, the partition's layout history and the new description),
           the checkpoint's mark (its owner's epoch and a number), and the queries
           assembling their lists;
        6. record the new offsets and watermarks.

    A crash before the step keeps the previous checkpoint whole; replay after a restart
    skips what a stored offset says was applied (exactly-once effect). Kafka's own commit
    follows, for lag tooling only: offsets are resumed from the store.
    """

    partition: int
    epoch: int                      # the owner's claim (see Store.claim)
    layout: str                     # Layout.fingerprint of buckets and records
    offsets: dict[str, int]         # topic -> next offset to read
    watermarks: dict[str, int]      # topic -> highest event time applied (ms)
    records: dict[str, bytes]       # query id -> encoded QueryRecord
    deadlines: dict[str, int]       # query id -> event time at which it closes (ms)
    deleted: list[str]              # query ids closed or orphaned
    buckets: dict[str, bytes]       # bucket field -> encoded sums
    dropped_buckets: list[str]      # buckets past every window
    ab: dict[str, bytes] = {}       # experiment␟ranker␟segment -> cumulative arm sums (ab/sums.py)
    meta: dict[str, str] = {}       # partition metadata: the layout history and descriptions, the
                                    # checkpoint's mark (pipeline/checkpoint.py), lists assembling
    meta_deleted: list[str] = []    # metadata fields to delete (lists settled)
    expect: str = ""                # the mark the store must hold: this owner's last ("" none yet)
    # experiment␟ranker␟segment -> the 64-bit hashes of users enrolled (ab.unit: user), added to
    # the arm's distinct-user HyperLogLog (ab/hll.py; adding a user twice changes nothing)
    users: dict[str, list[int]] = {}


class PartitionSnapshot(NamedTuple):
    epoch: int                   # this claim's epoch: checkpoints carry it
    offsets: dict[str, int]      # empty: the partition has no stored state
    watermarks: dict[str, int]
    layout: str                  # fingerprint of the stored buckets' layout ("" if none)
    buckets: dict[str, bytes]
    ab: dict[str, bytes] = {}    # experiment arm sums (PartitionCheckpoint.ab)
    history: list[str] = []      # the partition's layout fingerprints, oldest first
    descriptions: dict[str, str] = {}  # fingerprint -> windows.Layout description
    mark: str = ""               # "epoch:number" of the last checkpoint stored (PartitionCheckpoint.meta)
    lists: dict[str, int] = {}   # queries assembling their list from impression events -> their time
    # Stored numbers that could not be read, (kind, field, why): skipped (the claim counts them)
    unreadable: tuple[tuple[str, str, str], ...] = ()


class Refused(Exception):
    """The store did not keep what must be stored before a batch goes on (a read-only
    replica, a full Redis answering a write with an error the call swallowed): the batch
    waits and is read again, as for any store unavailable."""


class Store(Protocol):
    # What the store raises while it cannot be reached or cannot take writes (serve waits
    # and reloads); `full`, those of them that say it is out of memory (for /readyz).
    unavailable: tuple[type[Exception], ...]
    full: tuple[type[Exception], ...]

    def claim(self, partition: int) -> PartitionSnapshot:
        """Become the partition's owner (a new epoch, atomically) and load its state."""

    def load(self, partition: int) -> PartitionSnapshot:
        """The partition's state, read only (`rankmeter report`): no claim."""

    def read(self, wanted: Mapping[int, list[str]]) -> dict[int, list[bytes | None]]:
        """Query records of several partitions in one round trip (None where unknown)."""

    def commit(self, checkpoints: Iterable[PartitionCheckpoint]) -> dict[int, str]:
        """Each checkpoint atomically; returns the refused ones: partition -> FENCED, LOST or REWOUND."""

    def marks(self, partitions: Iterable[int]) -> dict[int, str]:
        """The mark of each partition's last stored checkpoint ("" when none), in one round trip."""

    def expired(self, watermarks: Mapping[int, int], limit: int,
                unreadable: Unreadable | None = None) -> dict[int, tuple[list[str], int]]:
        """Per partition: up to `limit` query ids whose deadline is at or before the
        partition's watermark, and how many queries are open (stored ids that cannot be
        ids are removed, counted in `unreadable`)."""

    def wipe(self, partition: int, epoch: int | None = None) -> bool:
        """Delete the partition's state but its epoch (before rebuilding it from the topics),
        atomically; with `epoch`, only while it is the stored one (False: another claim
        came since, nothing deleted)."""

    def partitions(self) -> list[int]:
        """Every partition with stored state (the experiment's statistics sum them all)."""

    def load_ab(self, partitions: Iterable[int], only: Collection[str] | None = None,
                without: Collection[str] = ()) -> dict[int, dict[str, bytes]]:
        """The experiment arm sums of these partitions, read only: the fields in `only` if
        given, never those in `without` (a look needs no 9.4 MB CUPED table each time)."""

    def load_users(self, wanted: Mapping[int, list[str]]) -> dict[int, dict[str, bytes]]:
        """Per partition, the stored distinct-user HyperLogLog of each arm asked for
        (experiment␟ranker␟segment), as Redis stores one (ab/hll.py); absent ones left out."""

    def load_running(self, experiment: str) -> dict[str, str]: ...

    def define_experiment(self, experiment: str, definition: str, replace: bool = False) -> str:
        """The experiment's stored definition (the measures its sums hold): `definition`
        if none was stored (or with `replace`), stored then; else the stored one, which the
        first replica to define it chose. "" when what is stored is no text."""

    def definition(self, experiment: str) -> str:
        """The experiment's stored definition, read only; "" when none or no text."""

    def definition_digest(self, experiment: str) -> str | None:
        """The SHA-1 (hex) of the stored definition's bytes, computed where it is stored (a
        6 MB one compared without being sent); None when none is stored, "" when no text."""

    def append_look(self, experiment: str, line: str, keep: int, epoch: int | None = None) -> bool:
        """The experiment's history (for `rankmeter report --ab --html`): the last `keep`.
        With `epoch` (the writer's claim of partition 0, whose holder writes the statistics),
        only while it is partition 0's stored epoch: False, nothing written, for a stale holder."""

    def looks(self, experiment: str) -> list[str]: ...

    def save_running(self, experiment: str, running: Mapping[str, str], epoch: int | None = None) -> bool:
        """What an always-valid statistic keeps between looks (running minimum p, the
        intersection of the confidence sequence), per comparison; `epoch` as for `append_look`."""

    def admit_label(self, kind: str, value: str, cap: int, now_ms: int, idle_ms: int) -> bool:
        """Whether `value` may be its own label of `kind`: at most `cap` values seen in the
        last `idle_ms` (across replicas); admitting refreshes the value's last use."""

    def close(self) -> None: ...


def meta_state(meta: Mapping[str, str]) -> tuple[str, dict[str, int]]:
    """A partition's last checkpoint's mark and its lists being assembled (unreadable
    times left out: `numbers`)."""
    return meta.get("mark", ""), numbers({k[len("list:"):]: v for k, v in meta.items() if k.startswith("list:")})[0]


def numbers(fields: Mapping[str, str]) -> tuple[dict[str, int], list[str]]:
    """The fields that hold an integer, as integers, and the names of those that do not."""
    found, unreadable = {}, []
    for name, text in fields.items():
        try:
            found[name] = int(text)
        except ValueError:
            unreadable.append(name)
    return found, unreadable


def layout_history(meta: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """A partition's layout history and descriptions, from its metadata fields."""
    return (meta.get("history", "").split(),
            {k[len("layout:"):]: v for k, v in meta.items() if k.startswith("layout:")})


class MemoryStore:
    """The store in this process's memory: for the embedded demo and unit tests."""

    unavailable: tuple[type[Exception], ...] = (Refused,)
    full: tuple[type[Exception], ...] = ()

    def __init__(self) -> None:
        self.epochs: dict[int, int] = {}
        self.offsets: dict[int, dict[str, int]] = {}
        self.watermarks: dict[int, dict[str, int]] = {}
        self.layouts: dict[int, str] = {}
        self.meta: dict[int, dict[str, str]] = {}
        self.records: dict[int, dict[str, bytes]] = {}
        self.deadlines: dict[int, dict[str, int]] = {}
        self.buckets: dict[int, dict[str, bytes]] = {}
        self.ab: dict[int, dict[str, bytes]] = {}
        self.users: dict[int, dict[str, np.ndarray]] = {}  # Redis's registers, hash and estimator
        self.running: dict[str, dict[str, str]] = {}
        self.definitions: dict[str, str] = {}
        self.history: dict[str, list[str]] = {}
        self.labels: dict[str, dict[str, int]] = {}

    def claim(self, partition: int) -> PartitionSnapshot:
        self.epochs[partition] = self.epochs.get(partition, 0) + 1
        return self.load(partition)

    def load(self, partition: int) -> PartitionSnapshot:
        p = partition
        meta = self.meta.get(p, {})
        return PartitionSnapshot(self.epochs.get(p, 0), dict(self.offsets.get(p, {})), dict(self.watermarks.get(p, {})),
                                 self.layouts.get(p, ""), dict(self.buckets.get(p, {})), dict(self.ab.get(p, {})),
                                 *layout_history(meta), *meta_state(meta))

    def read(self, wanted: Mapping[int, list[str]]) -> dict[int, list[bytes | None]]:
        return {p: [self.records.get(p, {}).get(q) for q in qids] for p, qids in wanted.items()}

    def commit(self, checkpoints: Iterable[PartitionCheckpoint]) -> dict[int, str]:
        refused = {}
        for c in checkpoints:
            p = c.partition
            if p not in self.epochs:
                refused[p] = LOST
                continue
            if self.epochs[p] != c.epoch:
                refused[p] = FENCED
                continue
            if self.meta.get(p, {}).get("mark", "") != c.expect:
                refused[p] = REWOUND
                continue
            self.records.setdefault(p, {}).update(c.records)
            self.deadlines.setdefault(p, {}).update(c.deadlines)
            for q in c.deleted:
                self.records[p].pop(q, None)
                self.deadlines[p].pop(q, None)
            self.buckets.setdefault(p, {}).update(c.buckets)
            for field in c.dropped_buckets:
                self.buckets[p].pop(field, None)
            self.ab.setdefault(p, {}).update(c.ab)
            for arm, added in c.users.items():
                hll.add(self.users.setdefault(p, {}).setdefault(arm, np.zeros(hll.REGISTERS, np.uint8)),
                        np.array(added, dtype=np.uint64))
            self.layouts[p] = c.layout
            self.meta.setdefault(p, {}).update(c.meta)
            for field in c.meta_deleted:
                self.meta[p].pop(field, None)
            self.offsets.setdefault(p, {}).update(c.offsets)
            self.watermarks.setdefault(p, {}).update(c.watermarks)
        return refused

    def marks(self, partitions: Iterable[int]) -> dict[int, str]:
        return {p: self.meta.get(p, {}).get("mark", "") for p in partitions}

    def expired(self, watermarks: Mapping[int, int], limit: int,
                unreadable: Unreadable | None = None) -> dict[int, tuple[list[str], int]]:
        out = {}
        for p, watermark in watermarks.items():
            deadlines = self.deadlines.get(p, {})
            due = sorted((d, q) for q, d in deadlines.items() if d <= watermark)[:limit]
            out[p] = ([q for _, q in due], len(deadlines))
        return out

    def wipe(self, partition: int, epoch: int | None = None) -> bool:
        if not self._owner(partition, epoch):
            return False
        for table in (self.offsets, self.watermarks, self.layouts, self.records, self.deadlines, self.buckets, self.ab,
                      self.meta, self.users):
            table.pop(partition, None)
        return True

    def _owner(self, partition: int, epoch: int | None) -> bool:
        return epoch is None or self.epochs.get(partition) == epoch

    def partitions(self) -> list[int]:
        return sorted(self.offsets)

    def load_ab(self, partitions: Iterable[int], only: Collection[str] | None = None,
                without: Collection[str] = ()) -> dict[int, dict[str, bytes]]:
        return {p: {f: v for f, v in self.ab.get(p, {}).items() if (only is None or f in only) and f not in without}
                for p in partitions}

    def load_users(self, wanted: Mapping[int, list[str]]) -> dict[int, dict[str, bytes]]:
        held = self.users
        return {p: {a: hll.dense(held[p][a]) for a in arms if a in held.get(p, {})} for p, arms in wanted.items()}

    def load_running(self, experiment: str) -> dict[str, str]:
        return dict(self.running.get(experiment, {}))

    def define_experiment(self, experiment: str, definition: str, replace: bool = False) -> str:
        if replace:
            self.definitions[experiment] = definition
        return self.definitions.setdefault(experiment, definition)

    def definition(self, experiment: str) -> str:
        return self.definitions.get(experiment, "")

    def definition_digest(self, experiment: str) -> str | None:
        text = self.definitions.get(experiment)
        return None if text is None else hashlib.sha1(text.encode()).hexdigest()

    def save_running(self, experiment: str, running: Mapping[str, str], epoch: int | None = None) -> bool:
        if not self._owner(0, epoch):
            return False
        self.running.setdefault(experiment, {}).update(running)
        return True

    def append_look(self, experiment: str, line: str, keep: int, epoch: int | None = None) -> bool:
        if not self._owner(0, epoch):
            return False
        lines = self.history.setdefault(experiment, [])
        lines.append(line)
        del lines[:-keep]
        return True

    def looks(self, experiment: str) -> list[str]:
        return list(self.history.get(experiment, []))

    def admit_label(self, kind: str, value: str, cap: int, now_ms: int, idle_ms: int) -> bool:
        seen = self.labels.setdefault(kind, {})
        for v in [v for v, last in seen.items() if last < now_ms - idle_ms]:
            del seen[v]
        if value in seen or len(seen) < cap:
            seen[value] = now_ms
            return True
        return False

    def close(self) -> None:
        pass
