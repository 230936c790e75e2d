"""What a replay shows as it goes and says at the end: a progress bar on stderr, and the
summary of what was read, produced and skipped."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TextIO

from rankmeter.replay.messages import Skipped

MAX_LISTED = 20           # skipped records listed one by one in the summary; the rest counted


class Progress:
    """A plain-text bar on stderr, redrawn at most four times a second on a terminal (once
    a second, a line each, elsewhere). `out=None`: silent."""

    def __init__(self, total: int, out: TextIO | None, label: str = "replay",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.out, self.label, self.clock = max(total, 1), out, label, clock
        self.tty = out is not None and out.isatty()
        self.interval = 0.25 if self.tty else 1.0
        self.last = float("-inf")
        self.began = clock()
        self.drawn = False

    def __call__(self, done: int, note: str = "", force: bool = False) -> None:
        if self.out is None:
            return
        now = self.clock()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        share = min(done / self.total, 1.0)
        bar = "#" * int(share * 24)
        line = f"{self.label} [{bar:<24}] {share:4.0%} {note} ({now - self.began:.0f} s)"
        self.out.write(f"\r{line}\x1b[K" if self.tty else line + "\n")
        self.out.flush()
        self.drawn = True

    def close(self) -> None:
        if self.out is not None and self.tty and self.drawn:
            self.out.write("\n")
            self.out.flush()


class Summary:
    """What was read, produced and skipped."""

    def __init__(self) -> None:
        self.read = 0
        self.files = 0
        self.produced: Counter[str] = Counter()   # topic -> messages
        self.judgments = 0
        self.reasons: Counter[str] = Counter()    # kind of problem -> records
        self.listed: list[Skipped] = []           # the first MAX_LISTED, by FILE:LINE

    @property
    def skipped(self) -> int:
        return sum(self.reasons.values())

    def skip(self, item: Skipped) -> None:
        self.read += item.record
        self.reasons[item.reason] += 1
        if len(self.listed) < MAX_LISTED:
            self.listed.append(item)

    def text(self, failed: Counter[str] | None = None) -> str:
        produced = sum(self.produced.values()) - sum((failed or {}).values())
        lines = [f"read {self.read:,} record{'s' if self.read != 1 else ''} from {self.files} "
                 f"file{'s' if self.files != 1 else ''}"
                 + (f"; produced {produced:,}" if produced else "; produced nothing")
                 + (f", {self.skipped:,} skipped (below)" if self.skipped else "")]
        for topic, n in self.produced.items():
            lost = (failed or {}).get(topic, 0)
            lines.append(f"  {n - lost:>10,}  to {topic}" + (f"  ({lost:,} failed)" if lost else ""))
        if self.judgments:
            lines.append(f"  {'':>10}  (judgments among them: {self.judgments:,})")
        if self.skipped:
            lines.append("skipped:")
            lines += [f"  {n:>10,}  {reason}" for reason, n in self.reasons.most_common()]
            for s in self.listed:
                lines.append(f"  {s.where}: {s.reason}" + (f": {s.detail}" if s.detail else ""))
            if self.skipped > len(self.listed):
                lines.append(f"  … and {self.skipped - len(self.listed):,} more")
        return "\n".join(lines)
