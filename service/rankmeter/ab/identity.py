"""An A/B experiment's identity: what defines it, never how a release stores its sums.

An experiment is one phase of a comparison: its baseline, its start, the split of the
phase and when that split took effect (a ramp from 50/50 to 90/10 is a new phase, a new
experiment: never one estimate pooled over two splits), and the configured measures it
compares with what their values depend on (grading):

    name = baseline@start@since@split@unit@measures-hash

The online signals (CTR, Clicks, ...) are left out of the name: a release may add one,
and that must not restart a running experiment. Which measures an experiment's stored
vectors hold is its *definition* (`definition`), stored once when it begins
(pipeline/phases.py); a measure the running configuration has and the definition lacks
is compared from the next experiment on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import NamedTuple

from rankmeter.config import AB, time_ms
from rankmeter.windows import Layout


def split_text(split: Mapping[str, float]) -> str:
    """The split's canonical text: rankers sorted, shares normalised to sum 1 (50/50 and
    0.5/0.5 are one split), e.g. `base=0.9,new=0.1`; `-` without a split."""
    total = sum(split.values())
    if not split or total <= 0:
        return "-"
    return ",".join(f"{ranker}={share / total:.6g}" for ranker, share in sorted(split.items()))


class Phase(NamedTuple):
    baseline: str
    start_ms: int
    since_ms: int    # impressions from here on are enrolled: ab.split_since, else ab.start
    split: str       # split_text
    unit: str        # ab.unit: query or user (its sums are kept per user bucket)

    @property
    def prefix(self) -> str:
        """What every experiment of this phase's baseline, start and since begins with."""
        return f"{self.baseline}@{self.start_ms}@{self.since_ms}@"

    def name(self, layout: Layout) -> str:
        measures = sorted(i for i in layout.ids if "#" in i) + [layout.judged_id]
        tag = hashlib.sha256(json.dumps(measures).encode()).hexdigest()[:8]
        return f"{self.prefix}{self.split}@{self.unit}@{tag}"


def phase(settings: AB) -> Phase | None:
    """This configuration's phase; None without an experiment (no baseline or start)."""
    if not settings.baseline or not settings.start:
        return None
    start = time_ms(settings.start)
    since = time_ms(settings.split_since) if settings.split_since else start
    return Phase(settings.baseline, start, max(start, since), split_text(settings.split), settings.unit or "query")


def definition(layout: Layout) -> list[str]:
    """The measure identities an experiment's vectors hold, in order (A/B layout ids)."""
    return list(layout.ids)


def read_definition(text: str) -> list[str] | None:
    """A stored definition, or None when it is not a JSON list of strings."""
    try:
        ids = json.loads(text)
    except ValueError:
        return None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        return None
    return ids
