"""A held partition's state in memory (`PartitionState`): what the stages read and change,
and what the partition's checkpoint writes back."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rankmeter.engine import QueryState
from rankmeter.join import QueryRecord
from rankmeter.windows import BucketKey

# A partition's harvested pair sums (debias/), with its A/B sums; three parts, as an
# experiment's fields, so that a version without debias skips it (a rollback is safe).
PAIRS = "propensity\x1f\x1fpairs"


class Reset(NamedTuple):
    """A stored offset Kafka's log no longer held, resumed past (pipeline/offsets.py)."""
    topic: str
    cause: str     # recreated | truncated
    skipped: int   # offsets between the stored one and the new log's start


class PartitionState:
    """A partition while this process owns it: its epoch, offsets, event-time watermarks,
    window buckets, and a write-through cache of its query records."""

    def __init__(self, epoch: int, offsets: dict[str, int], watermarks: dict[str, int],
                 buckets: dict[BucketKey, np.ndarray]) -> None:
        self.epoch = epoch
        self.offsets = offsets
        self.watermarks = watermarks
        self.buckets = buckets
        self.ab: dict[str, np.ndarray] = {}     # experiment␟ranker␟segment -> cumulative arm sums
        self.dirty_ab: set[str] = set()
        self.users: dict[str, set[int]] = {}    # experiment␟ranker␟segment -> users its next checkpoint adds
        self.rewrite_buckets = False             # converted from another layout: the next checkpoint writes all
        self.history: list[str] = []             # layout fingerprints, oldest first (records name an index)
        self.meta: dict[str, str] = {}           # partition metadata the next checkpoint writes
        self.drop_fields: list[str] = []         # unreadable stored buckets the next checkpoint deletes
        self.records: dict[str, QueryRecord] = {}
        self.states: dict[str, QueryState] = {}
        self.open_queries = 0
        # Queries assembling their list from impression events -> their time; in the
        # store's metadata too (joining.LIST).
        self.lists: dict[str, int] = {}
        self.shown_wall_ms = 0.0  # when the last impression event came (wall clock, ms)
        self.checkpoints = 0  # written by this owner (their mark: epoch and number, checkpoint.Ledger)
        # The mark of the last checkpoint this owner sent (at claim: the stored one): the store
        # refuses a checkpoint unless it still holds it (store.REWOUND: it lost writes).
        self.mark = ""
        self.offsets_moved = False  # offsets reset to a new log (pipeline/offsets.py): checkpoint them
        # The resets resumed past, counted once the checkpoint with the new offsets is stored:
        # a claim lost to a rebalance before it finds them again (counted once, not twice).
        self.resets: list[Reset] = []
        self.meta_deleted: list[str] = []  # metadata fields the next checkpoint deletes
        # Position bias (debias/): the pair sums this partition's queries have added to the
        # harvest (stored with the A/B sums: PAIRS), and the queries waiting for their clicks
        # to be final, (attribution end, query id), soonest first. The queue is in memory
        # only: after a restart the queries open then are not harvested (a smaller sample,
        # never a biased one).
        self.pair_sums: np.ndarray | None = None
        self.harvest_queue: list[tuple[int, str]] = []

    def watermark(self, topics: tuple[str, str], caught_up: set[str]) -> int | None:
        """How far event time has certainly come in this partition: the lower of the two
        topics' highest timestamps, so a topic read ahead of the other (a backlog) closes
        nothing early. A topic read to its end (`caught_up`) holds nothing back: a quiet
        feedback topic must not keep every query open. None (close nothing) while a topic
        with records still to read has not been seen."""
        behind = [t for t in topics if t not in caught_up]
        if any(t not in self.watermarks for t in behind):
            return None
        seen = [self.watermarks[t] for t in (behind or topics) if t in self.watermarks]
        return (min if behind else max)(seen) if seen else None
