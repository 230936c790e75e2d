"""The final decisions, stored (review 7, F1.1; CUPED review F4, F1.2). `do_not_ship` is
final (ab/decision.py), but each look computes it from the running records, which a
restart (an unreadable record dropped), a store put back to an older copy, or a changed
ab.mixture_scale (another state key) lose: the same sums would then read `ship`. So the
look that first reaches it stores it, once, apart from them, in the running-state store
under `{baseline}@{ab.start}|final` (the comparison, not the experiment's name: a ramp,
a redeclaration, another ab.alpha or ab.cuped is a new experiment, and a treatment
stopped in one is not shipped by the next; a new ab.start starts over), field
`treatment␟segment`, value `do_not_ship <epoch ms>`; every later look reads it first.
`invalid_srm` still replaces it (nothing of the experiment is trusted then).

`no_ship <epoch ms>`: a running record of the treatment was unreadable at that time, so
its sequences began again and their τ² was fixed late, from data already seen: it is
never `ship` again (keep_running), `do_not_ship` can still be reached, until an operator
removes the field. A value of neither form is unreadable: keep_running, never ship,
until an operator removes it. Earlier releases stored under `{experiment}|final`: read too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timezone

from rankmeter.ab.declared import Decision
from rankmeter.store import Store
from rankmeter.unreadable import Unreadable

FINAL = "do_not_ship"
NO_SHIP = "no_ship"
MAX_TEXT = 40  # a stored value longer than this is not ours: unreadable, never parsed
MAX_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z


def key(comparison: str) -> str:
    """The state key of a comparison's final decisions (`baseline@start_ms`); an earlier
    release's, of one experiment's name, has the same form."""
    return f"{comparison}|final"


def tested_key(experiment: str) -> str:
    """The state key naming the running records a look of the experiment has saved (any of
    them missing later was lost: `treatments`)."""
    return f"{experiment}|tested"


def field(d: Decision) -> str:
    return f"{d.treatment}\x1f{d.segment}"


def treatments(running_fields: Iterable[str], declared: Mapping[tuple[str, str], str]) -> set[str]:
    """The fields (treatment␟segment) whose decision lost a running record that holds a τ²
    (`running_fields`, unreadable or missing): a declared metric's base record (metric␟treatment␟
    segment␟average[␟cuped]; its test records, at a level, take τ² from it, so losing one
    only shortens the running intersection, still valid), and the SRM's (srm␟segment: a
    mismatch it had found would be forgotten), which counts for every treatment of the
    segment (`␟segment`)."""
    out = set()
    for f in running_fields:
        parts = f.split("\x1f")
        if len(parts) == 2 and parts[0] == "srm":
            out.add("\x1f" + parts[1])
        elif (len(parts) == 4 or (len(parts) == 5 and parts[4] == "cuped")) and (parts[0], parts[3]) in declared:
            out.add("\x1f".join(parts[1:3]))
    return out


def parsed(text: str) -> tuple[str, int] | None:
    """(do_not_ship or no_ship, since when in epoch ms) of a stored value; None: unreadable."""
    if len(text) > MAX_TEXT:
        return None
    word, _, ms = text.partition(" ")
    # The canonical decimal the writer produces (isdigit() alone holds for "²" and "١٢"),
    # within the dates Python can print (a later one would stop every look).
    ok = word in (FINAL, NO_SHIP) and 0 < len(ms) <= 19 and ms.isascii() and ms.isdigit() and str(int(ms)) == ms
    return (word, int(ms)) if ok and int(ms) <= MAX_MS else None


def since_ms(text: str) -> int | None:
    """When a stored value says do_not_ship was reached; None otherwise."""
    p = parsed(text)
    return p[1] if p is not None and p[0] == FINAL else None


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def apply(decisions: Iterable[Decision], stored: Mapping[str, str], now_ms: int, lost: Iterable[str] = ()
          ) -> tuple[tuple[Decision, ...], dict[str, str], tuple[str, ...], list[str]]:
    """The decisions with the stored final ones applied; the fields to store (do_not_ship
    first reached now; no_ship for the treatments whose running records were unreadable
    at this look, `lost`); notes; the fields whose stored value is unreadable (an unknown
    final decision: keep_running, never ship, until an operator removes it)."""
    out, new, notes, unreadable = [], {}, [], []
    lost = set(lost)
    for d in decisions:
        f, text = field(d), stored.get(field(d))
        if text is None and (f in lost or f"\x1f{d.segment}" in lost) and d.decision not in (FINAL, "undeclared"):
            text = new[f] = f"{NO_SHIP} {now_ms}"
        p = parsed(text) if text is not None else None
        if text is None or d.decision == "undeclared":
            if text is None and d.decision == FINAL:
                new[f] = f"{FINAL} {now_ms}"
        elif p is None:
            unreadable.append(f)
            if d.decision in ("ship", "keep_running"):
                notes.append(f"{d.treatment} (segment {d.segment!r}): its stored final decision is "
                             f"unreadable: keep_running, never ship, until an operator removes it")
                d = d._replace(decision="keep_running")
        elif p[0] == NO_SHIP:
            if d.decision == FINAL:
                new[f] = f"{FINAL} {now_ms}"
            elif d.decision in ("ship", "keep_running"):
                notes.append(f"{d.treatment} (segment {d.segment!r}): its running statistics were unreadable "
                             f"at {_when(p[1])} and began again: never ship (do_not_ship can still be reached), "
                             f"until an operator removes the stored no_ship")
                d = d._replace(decision="keep_running")
        elif d.decision != "invalid_srm":
            if d.decision != FINAL:
                notes.append(f"{d.treatment} (segment {d.segment!r}): do_not_ship since {_when(p[1])}, "
                             f"stored (final for this baseline and ab.start, across ramps and redeclarations)")
            d = d._replace(decision=FINAL)
        out.append(d)
    return tuple(out), new, tuple(notes), unreadable


def merged(values: Iterable[tuple[str, str]]) -> tuple[dict[str, str], dict[str, str]]:
    """One value per field from several keys' (key, {field: value}) in turn: do_not_ship
    over no_ship over an unreadable value (so none hides a stronger one), the first key's
    among equals; and the key each value was read from."""
    rank = {FINAL: 0, NO_SHIP: 1}
    out: dict[str, str] = {}
    source: dict[str, str] = {}
    for k, fields in values:
        for f, text in fields.items():
            p = parsed(text)
            strength = rank[p[0]] if p else 2
            if f not in out or strength < (rank[q[0]] if (q := parsed(out[f])) else 2):
                out[f], source[f] = text, k
    return out, source


def applied(store: Store, unreadable: Unreadable, comparison: str, experiments: Iterable[str],
            saved: Mapping[str, Mapping[str, str]], decisions: Iterable[Decision], now_ms: int,
            lost: Iterable[str] = (), declared: bool = False
            ) -> tuple[tuple[Decision, ...], dict[str, str], tuple[str, ...]]:
    """`apply` with the stored final decisions of the comparison, what this process saved
    (`saved`, by state key) winning over a store that lost it, and those an earlier release
    stored under an experiment's name (`experiments`: the names stored of this comparison);
    an unreadable one counted, under the key it was read from. With `declared`, a treatment
    stored do_not_ship keeps that decision while the experiment has no arm of it yet (a new
    phase before its first impressions: the alert does not resolve)."""
    k = key(comparison)
    current = store.load_running(k)
    earlier = [(key(e), store.load_running(key(e))) for e in sorted(experiments) if e.startswith(comparison + "@")]
    values, source = merged([("this process", saved.get(k, {})), (k, current), *earlier])
    decisions = list(decisions)
    if declared:
        have = {field(d) for d in decisions}
        decisions += [Decision(*f.split("\x1f", 1), FINAL, ()) for f, text in sorted(values.items())
                      if f not in have and since_ms(text) is not None]
    decisions, reached, notes, bad = apply(decisions, values, now_ms, lost)
    # One this process stored and the store lost (put back to an older copy), or one an
    # earlier release stored under an experiment: stored (again) under the comparison.
    reached.update({f: text for f, text in values.items()
                    if current.get(f) != text and f not in reached and parsed(text) is not None})
    for f in bad:
        unreadable.skip("experiment", f"ab:running:{source[f]}", f, "not do_not_ship or no_ship and a time")
    return decisions, reached, notes
