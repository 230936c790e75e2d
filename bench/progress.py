"""A progress line on stderr every few seconds, for the long benchmark loops."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, unit: str = "") -> None:
        self.label, self.total, self.unit = label, total, unit
        self.t0, self.last = time.monotonic(), 0.0

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last >= 3.0 or done == self.total:
            self.last = now
            unit = f" {self.unit}" if self.unit else ""
            print(f"  {self.label}: {done}/{self.total}{unit} ({now - self.t0:.0f} s)", file=sys.stderr, flush=True)
