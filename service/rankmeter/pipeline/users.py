"""Distinct users per arm, with `ab.unit: user`: what a checkpoint adds, what a look merges.

A query's user is added to its arm's HyperLogLog when the query is first counted in the
experiment (`enrolled`), in the partition's checkpoint (`PartitionCheckpoint.users`),
so it is written atomically with the sums: Redis PFADDs it in the commit script into
`P:{P:p}:users:<experiment>␟<ranker>␟<segment>` (the partition's hash tag: one slot). A
batch replayed after a crash adds the same users again, which changes nothing (a set
union); a Redis that lost its last writes is repaired by the same replay. A look reads
every partition's key of each arm and merges them (`arm_users`, ab/hll.py)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rankmeter.ab import hll
from rankmeter.join import QueryRecord
from rankmeter.pipeline.state import PartitionState
from rankmeter.unreadable import Unreadable

Arm = tuple[str, str]  # (ranker, segment)


def enrolled(ps: PartitionState, arm: str, record: QueryRecord) -> None:
    """The query is counted in `arm` (experiment␟ranker␟segment) for the first time: its
    user is added at the partition's next checkpoint."""
    user = record.impression.user_hash if record.impression is not None else -1
    if not record.ab_contribution and user >= 0:
        ps.users.setdefault(arm, set()).add(user)


def arm_users(store: object, stored: Mapping[int, Mapping[str, bytes]], experiment: str,
              unreadable: Unreadable) -> dict[Arm, np.ndarray | None] | None:
    """Each arm's registers, merged over the partitions holding its sums; None when the
    store does not count users (it has no `load_users`). An arm whose count is unreadable
    (counted in `unreadable`) or missing on a partition holding its sums maps to None: a
    user's queries land on every partition, so a partial union would lose users and read
    as a mismatch (kept for good by the running minimum). No count at all: {}."""
    load = getattr(store, "load_users", None)
    if load is None:
        return None
    wanted = {p: sorted({"\x1f".join(f.split("\x1f")[:3]) for f in fields if f.split("\x1f")[0] == experiment})
              for p, fields in stored.items()}
    out: dict[Arm, np.ndarray] = {}
    incomplete: set[Arm] = set()
    wanted = {p: arms for p, arms in wanted.items() if arms}
    found_all = load(wanted)
    for p, arms in wanted.items():
        found = found_all.get(p, {})
        for arm in arms:
            _, ranker, segment = arm.split("\x1f")
            if arm not in found:
                incomplete.add((ranker, segment))
                continue
            try:
                registers = hll.parse(found[arm])
            except ValueError as e:
                unreadable.skip("experiment", f"{{{p}}}:users", arm, str(e))
                incomplete.add((ranker, segment))
                continue
            merged = out.setdefault((ranker, segment), np.zeros(hll.REGISTERS, np.uint8))
            np.maximum(merged, registers, out=merged)
    if not out:  # no count at all: a phase begun before users were counted
        return {}
    return {**out, **{arm: None for arm in incomplete}}
