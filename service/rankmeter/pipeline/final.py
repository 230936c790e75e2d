"""The final decision, stored (review 7, F1.1). `do_not_ship` is final within an experiment
(ab/decision.py), but each look computes it from the running records, which a restart (an
unreadable record dropped), a store put back to an older copy, or a changed ab.mixture_scale
(another state key) lose: the same sums would then read `ship`. So the look that first
reaches it stores it, once, apart from them: in the running-state store under
`{experiment}|final` (the experiment alone: no α, no τ² in the key), field
`treatment␟segment`, value `do_not_ship <epoch ms>`; every later look reads it first.
`invalid_srm` still replaces it (nothing of the experiment is trusted then)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timezone

from rankmeter.ab.declared import Decision
from rankmeter.store import Store
from rankmeter.unreadable import Unreadable

FINAL = "do_not_ship"
MAX_TEXT = 40  # a stored value longer than this is not ours: unreadable, never parsed


def key(experiment: str) -> str:
    return f"{experiment}|final"


def field(d: Decision) -> str:
    return f"{d.treatment}\x1f{d.segment}"


def since_ms(text: str) -> int | None:
    """When a stored final value says do_not_ship was reached, None when it is unreadable."""
    if len(text) > MAX_TEXT:
        return None
    word, _, ms = text.partition(" ")
    # The canonical decimal the writer produces (isdigit() alone holds for "²" and "١٢").
    ok = word == FINAL and 0 < len(ms) <= 19 and ms.isascii() and ms.isdigit() and str(int(ms)) == ms
    return int(ms) if ok else None


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def apply(decisions: Iterable[Decision], stored: Mapping[str, str], now_ms: int
          ) -> tuple[tuple[Decision, ...], dict[str, str], tuple[str, ...], list[str]]:
    """The decisions with the stored final ones applied; the fields to store (those first
    reaching do_not_ship now); notes; the fields whose stored value is unreadable (an
    unknown final decision: keep_running, never ship, until an operator removes it)."""
    out, new, notes, unreadable = [], {}, [], []
    for d in decisions:
        f, text = field(d), stored.get(field(d))
        if text is not None and d.decision != "undeclared":
            ms = since_ms(text)
            if ms is None:
                unreadable.append(f)
                if d.decision in ("ship", "keep_running"):
                    notes.append(f"{d.treatment} (segment {d.segment!r}): its stored final decision is "
                                 f"unreadable: keep_running, never ship, until an operator removes it")
                    d = d._replace(decision="keep_running")
            elif d.decision != "invalid_srm":
                if d.decision != FINAL:
                    notes.append(f"{d.treatment} (segment {d.segment!r}): do_not_ship since {_when(ms)}, "
                                 f"stored (final within the experiment)")
                d = d._replace(decision=FINAL)
        elif text is None and d.decision == FINAL:
            new[f] = f"{FINAL} {now_ms}"
        out.append(d)
    return tuple(out), new, tuple(notes), unreadable


def applied(store: Store, unreadable: Unreadable, experiment: str, saved: Mapping[str, Mapping[str, str]],
            decisions: Iterable[Decision], now_ms: int) -> tuple[tuple[Decision, ...], dict[str, str], tuple[str, ...]]:
    """`apply` with the stored final decisions, what this process saved (`saved`, by state
    key) winning over a store that lost it; an unreadable one counted."""
    k = key(experiment)
    in_store, mine = store.load_running(k), saved.get(k, {})
    decisions, reached, notes, bad = apply(decisions, {**in_store, **mine}, now_ms)
    # One this process stored and the store lost (put back to an older copy): stored again,
    # or the next process to look would not know it.
    reached.update({f: text for f, text in mine.items() if f not in in_store and since_ms(text) is not None})
    for f in bad:
        unreadable.skip("experiment", f"ab:running:{k}", f, "not do_not_ship and a time")
    return decisions, reached, notes
