"""The checkpoint: everything one poll batch changed in one partition, committed at once.

A partition's state (query records, their deadlines, window buckets), the offsets of both
topics that produced it, the event-time watermarks, the owner's epoch and the layout the
sums are written in travel together, and the store applies a checkpoint in one atomic
step (one Lua script on the partition's hash tag in Redis), in this order:

    1. check the epoch: the partition is still ours. A newer owner has claimed it (this
       process stalled past the poll interval: a zombie) -> refused, nothing written
       (store.FENCED). The epoch is gone (Redis lost its data) -> refused (store.LOST).
    2. write the records that changed, with their event-time deadlines;
    3. delete the records that closed (or were orphaned);
    4. write the buckets that changed, delete the ones past every window, write the
       experiment's arm sums that changed;
    5. record the layout fingerprint the buckets are written in (and, after a
       configuration change, the partition's layout history and the new description),
       the checkpoint's mark (its owner's epoch and a number), and the queries
       assembling their lists;
    6. record the new offsets and watermarks.

A crash before the step keeps the previous checkpoint whole; replay after a restart
skips what a stored offset says was applied (exactly-once effect). Kafka's own commit
follows, for lag tooling only: offsets are resumed from the store.
"""

from __future__ import annotations

from typing import NamedTuple


class Checkpoint(NamedTuple):
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
                                    # checkpoint's mark (pipeline._unsure), lists assembling
    meta_deleted: list[str] = []    # metadata fields to delete (lists settled)
