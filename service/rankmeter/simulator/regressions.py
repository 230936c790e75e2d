"""`Regression`s degrade a ranker for an interval: `ranking` replaces its list, with
probability `size`, by a noisy one (noise `REGRESSED_NOISE`); `clicks` (a presentation
problem) multiplies every result's attractiveness by 1 − size and leaves the list alone."""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

REGRESSED_NOISE = 1.5  # a `ranking` regression's list (what --regression-at does)
REGRESSION_KINDS = ("ranking", "clicks")


class Regression(NamedTuple):
    """`ranker` is degraded from `start_s` (seconds since the traffic's start) for `duration_s`:
    kind `ranking` = with probability `size` its list is replaced by a degraded one;
    kind `clicks` = every result's attractiveness is multiplied by 1 − size."""
    start_s: float
    duration_s: float
    ranker: str
    kind: str = "ranking"
    size: float = 1.0

    def active(self, elapsed_s: float) -> bool:
        return self.start_s <= elapsed_s < self.start_s + self.duration_s


def check_regression(r: Regression, rankers: Collection[str] | None = None) -> None:
    """ValueError, in one line, for a regression that cannot apply (to one of `rankers`)."""
    if r.kind not in REGRESSION_KINDS:
        raise ValueError(f"regression kind {r.kind!r}: one of {', '.join(REGRESSION_KINDS)}")
    if not 0.0 <= r.size <= 1.0:
        raise ValueError(f"regression size {r.size:g}: a share between 0 and 1")
    if not r.duration_s > 0 or r.start_s < 0:
        raise ValueError(f"regression at {r.start_s:g} s for {r.duration_s:g} s: a start >= 0 and a duration > 0")
    if rankers is not None and r.ranker not in rankers:
        raise ValueError(f"regression of ranker {r.ranker!r}: one of {', '.join(rankers)}")
