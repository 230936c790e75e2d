"""The layout of the window sums under this configuration, and the layouts met before.

A layout names the measures a bucket's vector holds and their order (windows.Layout); its
fingerprint is stored with the buckets and in each partition's history, so that records
and buckets written under an earlier configuration are converted, not misread.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from rankmeter.config import Evaluation, Settings
from rankmeter.engine import ONLINE_SIGNALS, parse_all
from rankmeter.unreadable import Unreadable
from rankmeter.windows import Layout

IPW = "ipw:"  # layout names of the debiased measures: ipw:nDCG@10


def layout_for(settings: Settings, debiased: bool = True) -> Layout:
    """The layout of this configuration. A quality measure's identity includes what its
    values depend on (grade map, relevance level, empty-query policy), so changing those
    starts it afresh rather than mixing old and new values under one name. The debiased
    measures (`ipw:…`) come last; `debiased=False` leaves them out (the A/B layout: an
    experiment's name, and its sums, do not change when they are turned on)."""
    e = settings.evaluation
    measures = [str(m) for m in parse_all(e.measures)]
    grading = json.dumps([sorted(e.grades.items()), e.long_dwell_ms, e.long_dwell_grade,
                          e.relevance_level, e.empty_query_policy]
                         # (the default labels leave the fingerprints as they were before labels)
                         + ([sorted(e.labels.items())] if e.labels != Evaluation().labels else []))
    tag = hashlib.sha256(grading.encode()).hexdigest()[:8]
    names = measures + list(ONLINE_SIGNALS)
    over_all = names if e.empty_query_policy == "zero" else list(ONLINE_SIGNALS)
    ids = [f"{m}#{tag}" for m in measures] + list(ONLINE_SIGNALS)
    if debiased and settings.debias.measures:
        d = settings.debias
        weighting = json.dumps([sorted(e.grades.items()), e.long_dwell_ms, e.long_dwell_grade,
                                d.ranks, d.max_weight, d.min_pairs])
        ipw_tag = hashlib.sha256(weighting.encode()).hexdigest()[:8]
        debiased_names = [IPW + str(m) for m in parse_all(d.measures)]
        names = names + debiased_names
        # Over every impression whose query has what the measure needs (module `ipw`):
        # an impression without a click counts 0, or the average would be biased upwards.
        over_all = list(over_all) + debiased_names
        ids = ids + [f"{n}#{ipw_tag}" for n in debiased_names]
    return Layout(names, over_all, distributed=measures, ids=ids, judged_id=f"judged#{tag}")


class Layouts:
    """This configuration's layout (`current`), the A/B layout (`ab`: measures and signals
    only), and every layout the held partitions' histories name, by fingerprint (None: a
    fingerprint whose description could not be read)."""

    def __init__(self, settings: Settings) -> None:
        self.current = layout_for(settings)
        self.ab = layout_for(settings, debiased=False)
        self.known: dict[str, Layout | None] = {self.current.fingerprint: self.current}

    def learn(self, descriptions: Mapping[str, str], unreadable: Unreadable, partition: int) -> None:
        """The partition's stored layout descriptions; one that cannot be read is counted
        and skipped (its layout stays unknown, as one never described)."""
        for fingerprint, description in descriptions.items():
            if fingerprint not in self.known:
                try:
                    self.known[fingerprint] = Layout.from_description(description)
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    unreadable.skip("layout", f"{{{partition}}}:meta", f"layout:{fingerprint}", repr(e))

    def get(self, fingerprint: str) -> Layout | None:
        return self.known.get(fingerprint)
