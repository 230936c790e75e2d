"""The cycle collector for a process whose state is many long-lived objects.

`rankmeter serve` holds every open query (its record, its state, its buckets' entries)
for as long as its attribution or judgment window: hundreds of thousands of objects that
CPython's default thresholds would rescan again and again (measured: the pipeline alone
goes from ~98,000 to ~150,000 events/s with fewer collections). Fewer collections are not
enough: a collection of generation 1 walks every object that survived the young
generation since the last one, which is the open state itself: 380–660 ms with every
thread stopped, with the pipeline alone after 1 M events (`bench/gc_pauses.py
--no-freeze`). So whatever survives a young collection is frozen (`gc.freeze`): no collection
walks it again; reference counting still frees it when its query closes.

The price: a reference cycle that survives one young collection is never collected. The
pipeline makes none among its state (measured: `gc.unfreeze(); gc.collect()` after 1 M
events of the pipeline alone finds 0 unreachable objects), nor does a failed commit
(`inflight.py` breaks the one its traceback made: 40 failed 5 MB batches kept 207 MB
alive before, review s14); `tests/test_gc_tuning.py` checks both in a process of its own.
bench_soak's RSS over 5 M events is the check on the rest.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

YOUNG_THRESHOLD = 50_000  # allocations between young collections (CPython's default: 700)

_tuned: list[tuple[int, ...]] = []  # the thresholds before each tune() still in force
_lock = threading.Lock()  # (serve runs in threads of one process in tests)


def _freeze_survivors(phase: str, info: dict[str, Any]) -> None:
    if phase == "stop" and info["generation"] == 0:
        gc.freeze()


def tune() -> None:
    """Freeze what exists now and what survives each young collection from now on; collect
    the young rarely. Nested or concurrent (tests run serve many times in one process):
    in force until the last `untune`."""
    with _lock:
        gc.freeze()
        _tuned.append(gc.get_threshold())
        gc.set_threshold(YOUNG_THRESHOLD, 50, 1000)
        if _freeze_survivors not in gc.callbacks:
            gc.callbacks.append(_freeze_survivors)


def untune() -> None:
    """The thresholds from before the first `tune` once each has been undone (the end of
    serve inside a longer-lived process); what was frozen stays frozen."""
    with _lock:
        if not _tuned:
            return
        before = _tuned.pop()
        if not _tuned:
            gc.set_threshold(*before)
            if _freeze_survivors in gc.callbacks:
                gc.callbacks.remove(_freeze_survivors)
