"""An A/B experiment's identity: what defines it, never how a release stores its sums.

An experiment is one phase of a comparison: its baseline, its start, the split of the
phase and when that split took effect (a ramp from 50/50 to 90/10 is a new phase, a new
experiment: never one estimate pooled over two splits), and the configured measures it
compares with what their values depend on (grading), and its declared decision
(`ab.primary`, `ab.guardrails`, `ab.alpha`: ab/declared.py) when there is one:

    name = baseline@start@since@split@unit@measures-hash[+declaration-hash][+cuped]

The declaration is part of it because its error rates hold for one declaration fixed
before the data: a primary chosen after a look at the exploratory series, or a dropped
guardrail (which raises α/k and α/(k + g)), starts a new experiment, whose sums, running
sequences and decision count only the impressions enrolled from the change on (the
earlier experiment stays stored as it was; the report notes the change). An undeclared
experiment's name has no declaration hash, as before declarations existed.

`ab.cuped` is part of it too, with its covariate (CUPED review F5): the adjusted and the
unadjusted comparison, or two covariates, are two tests, each at α; switching
mid-experiment would test both (a stop on either), so it starts a new experiment. An
experiment without CUPED keeps the name it had before CUPED existed.

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

from rankmeter.ab import declared as decl
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
    declaration: str = ""  # declaration_text; empty when undeclared
    cuped: str = ""        # with ab.cuped: "cuped" (the text covariate) or "cuped-user"; else empty

    @property
    def comparison(self) -> str:
        """What the phases of one comparison share, whatever their split, declaration or
        CUPED: the baseline and ab.start (pipeline/final.py keeps its final decisions)."""
        return f"{self.baseline}@{self.start_ms}"

    @property
    def prefix(self) -> str:
        """What every experiment of this phase's baseline, start and since begins with."""
        return f"{self.comparison}@{self.since_ms}@"

    def name(self, layout: Layout) -> str:
        measures = sorted(i for i in layout.ids if "#" in i) + [layout.judged_id]
        tag = hashlib.sha256(json.dumps(measures).encode()).hexdigest()[:8]
        if self.declaration:
            tag += "+" + hashlib.sha256(self.declaration.encode()).hexdigest()[:8]
        if self.cuped:
            tag += "+" + self.cuped
        return f"{self.prefix}{self.split}@{self.unit}@{tag}"


def phase(settings: AB) -> Phase | None:
    """This configuration's phase; None without an experiment (no baseline or start)."""
    if not settings.baseline or not settings.start:
        return None
    start = time_ms(settings.start)
    since = time_ms(settings.split_since) if settings.split_since else start
    return Phase(settings.baseline, start, max(start, since), split_text(settings.split), settings.unit or "query",
                 declaration_text(settings), _cuped(settings))


def _cuped(settings: AB) -> str:
    """`cuped`, `cuped-user` with the user covariate, `-b<buckets>` with other than the
    default buckets (another table, other means: another covariate); empty without CUPED."""
    if not settings.cuped:
        return ""
    tag = "cuped" if settings.cuped_covariate == "text" else f"cuped-{settings.cuped_covariate}"
    return tag if settings.cuped_buckets == AB().cuped_buckets else f"{tag}-b{settings.cuped_buckets}"


def declaration_text(settings: AB) -> str:
    """The declared decision's canonical text: its metrics as parsed (how each is written,
    and their order, do not matter) and α; empty without `ab.primary`."""
    declared = decl.parse(settings.primary, settings.guardrails)
    if not declared:
        return ""
    entries = sorted(f"{d.role} {d.metric} {d.average} {d.better:+d} {d.margin!r}{'%' if d.relative else ''}"
                     for d in declared)
    return json.dumps({"alpha": settings.alpha, "declared": entries})


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
