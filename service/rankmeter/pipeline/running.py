"""What looks keep between looks: the running statistics (`ab:running:<key>` hashes: each
comparison's running p-value, sequence and τ², the SRM's running minimum, the final
decisions), and what this process last saved of them, written apart from the
partitions' checkpoints. A look reading back less than it saved found them lost (a
restore, a failover): it goes on from the tighter of both, counted (`lost`) and logged.
`marks`: the records a look once saved (`<experiment>|tested`), so that one missing with
no process remembering it (evicted, deleted, another mixture setting) is known lost."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from rankmeter.ab.experiment import readable, tighter
from rankmeter.store import Store
from rankmeter.unreadable import Unreadable

log = logging.getLogger("rankmeter.pipeline")
LOST = "lost"  # a mark's value once its record was found missing (else: when it was first stored)


class RunningRecords:
    def __init__(self, store: Store, unreadable: Unreadable) -> None:
        self.store, self.unreadable = store, unreadable
        self.saved: dict[str, dict[str, str]] = {}  # by key, as this process last saved them
        self.lost = 0                               # looks that found what it saved lost

    def load(self, key: str) -> tuple[dict[str, str], list[str]]:
        """The stored running statistics, tightened by what this process saved last where
        the store holds less: each comparison's as the tighter of both (ab/experiment.py
        `tighter`), never loosened, so a process whose memory is older than the store
        (another holder wrote since) changes nothing. Saved back whole, comparisons a look
        did not compute (too few queries in an arm after a rewind) included, for the next
        holder. Also the fields unreadable (dropped, counted) that what this process saved
        does not replace."""
        stored, saved = self.store.load_running(key), self.saved.get(key, {})
        bad = [f for f, text in stored.items() if not readable(text)]
        for field in bad:
            self.unreadable.skip("experiment", f"ab:running:{key}", field, "not three numbers")
            del stored[field]
        merged = {**stored, **{field: tighter(stored.get(field), text) for field, text in saved.items()}}
        if any(merged[field] != stored.get(field) for field in saved):
            self.lost += 1
            log.error("the state store lost the experiment's last running statistics: going on from "
                      "what this process saved", extra={"experiment": key})
        return merged, [f for f in bad if f not in saved]

    def marks(self, key: str) -> dict[str, str]:
        """The fields of a `|tested` key (field -> when first saved; only names matter),
        with what this process saved where the store lost them."""
        return {**self.store.load_running(key), **self.saved.get(key, {})}

    def missing(self, marked: Mapping[str, str], running: Mapping[str, str], unreadable: Iterable[str],
                experiment: str) -> tuple[list[str], list[str]]:
        """The marked records missing from `running` (counted and logged, once: `mark` then
        marks them lost), and those found lost before: their treatments' no_ship is stored
        again if the store lost it too."""
        found = [f for f, text in marked.items() if f not in running and f not in unreadable and not text.startswith(LOST)]
        if found:
            self.lost += 1
            log.error("the state store lost running statistics a look had saved: they begin again "
                      "(the treatments they decide never ship)", extra={"experiment": experiment, "fields": found[:10]})
        return found, [f for f, text in marked.items() if text.startswith(LOST)]

    def mark(self, key: str, fields: Iterable[str], lost: Iterable[str], now_ms: int, owner: int) -> None:
        """Marks `fields` (just stored) in the `|tested` key, and `lost` as lost for good (after
        their no_ship was stored); marks the store lost, written back."""
        stored = self.store.load_running(key)
        marks = {**stored, **self.saved.get(key, {})}
        marks.update({f: str(now_ms) for f in fields if f not in marks})
        marks.update({f: f"{LOST} {now_ms}" for f in lost})
        if marks != stored:
            self.save(key, marks, owner)

    def save(self, key: str, running: Mapping[str, str], owner: int) -> bool:
        """Saved unless a newer holder of partition 0 has claimed it (then False)."""
        if not self.store.save_running(key, running, owner):
            return False
        self.saved[key] = dict(running)
        return True
