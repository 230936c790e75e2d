"""The running experiment: its phase (ab/identity.py) and its definition, the measures
its stored sums hold, as the first replica to begin it stored them.

Every replica enrols impressions into the same name and writes vectors of the same
definition, whatever release it runs: a release that computes one more measure or
signal maps its columns onto the definition (ab/sums.py `columns`) and the experiment
goes on; the measure it adds is compared from the next experiment on. The definition is
read again at every claim: one the store lost is stored back from memory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from rankmeter.ab import identity
from rankmeter.ab import sums as ab_sums
from rankmeter.config import Settings
from rankmeter.store import Store
from rankmeter.unreadable import Unreadable
from rankmeter.windows import Layout

log = logging.getLogger("rankmeter.pipeline")


class Phase:
    def __init__(self, settings: Settings, store: Store, layout: Layout, unreadable: Unreadable) -> None:
        self.store = store
        self.layout = layout  # the A/B layout: the debiased measures are not in experiments
        self.unreadable = unreadable
        self.phase = identity.phase(settings.ab)
        self.name: str | None = self.phase.name(layout) if self.phase else None
        self.definition: list[str] = []
        self.names: list[str | None] = []  # per slot of the definition: the measure, None if not computed here
        self.columns: list[int | None] = []
        self.size = 0

    def resolve(self) -> None:
        """Reads the stored definition, or stores this process's (its own layout's at first)."""
        if self.name is None:
            return
        mine = json.dumps(self.definition or identity.definition(self.layout))
        ids = identity.read_definition(self.store.define_experiment(self.name, mine))
        if ids is None:
            self.unreadable.skip("experiment", f"ab:definition:{self.name}", "definition",
                                 "not a JSON list of measure identities: replaced")
            # (a store that refuses the write, a read-only replica: this process's own, in memory)
            ids = identity.read_definition(self.store.define_experiment(self.name, mine, replace=True)) \
                or json.loads(mine)
        if self.definition and ids != self.definition:
            log.error("the experiment's stored definition is not the one this process wrote (the store "
                      "lost it): following the stored one", extra={"experiment": self.name})
        self.definition = ids
        self.columns = ab_sums.columns(ids, self.layout)
        self.names = [None if c is None else self.layout.names[c] for c in self.columns]
        self.size = ab_sums.size(len(ids))

    def notes(self, stored_names: Iterable[str]) -> tuple[str, ...]:
        """What a reader of this experiment's results must know: measures of this
        configuration the experiment does not hold, measures it holds this configuration
        does not compute, and stored experiments of the same phase start under another
        split (ab.split changed without ab.split_since), unit or declared decision."""
        if self.phase is None or self.name is None:
            return ()
        out = []
        held = set(self.definition)
        added = [n for i, n in zip(self.layout.ids, self.layout.names) if i not in held]
        if added:
            out.append(f"not compared, added after the experiment began (compared from the next phase): "
                       f"{', '.join(added)}")
        gone = [i for i, c in zip(self.definition, self.columns) if c is None]
        if gone:
            out.append(f"not compared, not computed by this configuration: {', '.join(gone)}")
        # The same phase start stored under another split or unit (split@unit@hash).
        same_start = [parts for n in stored_names if n.startswith(self.phase.prefix) and n != self.name
                      and len(parts := n[len(self.phase.prefix):].rsplit("@", 2)) == 3]
        others = sorted({split for split, _, _ in same_start if split != self.phase.split})
        if others:
            out.append("ab.split changed without a new ab.split_since: impressions applied since are "
                       "enrolled by when they were read, not when they were shown (set ab.split_since "
                       f"to the time the split took effect); other splits stored: {len(others)}")
        measures, declaration, cuped = _tag(self.name.rsplit("@", 1)[1])
        tags = [_tag(tag) for split, unit, tag in same_start if split == self.phase.split
                and unit == self.phase.unit and _tag(tag)[0] == measures]
        declarations = {d for _, d, _ in tags if d != declaration}
        if declarations:
            out.append("the declared decision changed (ab.primary, ab.guardrails or ab.alpha): a new experiment, "
                       "whose statistics and decision count only impressions enrolled since; the earlier "
                       f"declaration's stays stored (other declarations of this phase: {len(declarations)})")
        if any(c != cuped for _, d, c in tags if d == declaration):
            out.append(f"ab.cuped or ab.cuped_covariate changed in this phase (now {cuped or 'off'}): a new experiment "
                       "(the adjusted and the unadjusted comparison are two tests), whose statistics and decision "
                       "count only impressions enrolled since; a do_not_ship reached before stays (pipeline/final.py)")
        units = sorted({unit for split, unit, _ in same_start if split == self.phase.split and unit != self.phase.unit})
        if units:
            out.append(f"the same phase is stored with ab.unit {', '.join(units)} too: another replica or an "
                       f"earlier configuration; these results hold only this configuration's share "
                       f"(changing ab.unit is a restart: set a new ab.split_since)")
        return tuple(out)


def _tag(tag: str) -> tuple[str, str, str]:
    """An experiment name's last part: (measures hash, declaration hash, cuped), each
    possibly empty (ab/identity.py `Phase.name`)."""
    measures, *rest = tag.split("+")
    cuped = next((t for t in rest if t.startswith("cuped")), "")
    return measures, next((t for t in rest if not t.startswith("cuped")), ""), cuped
