"""Gain tables: trec_eval's `level=gain` parameters of ndcg, G, ndcg_rel and Rndcg
(gain_init.c's setup_gains and get_gain).

By default a judged grade's gain is the grade itself (0 below 1, unjudged documents 0).
A table such as `1:3;2:9;4:4.5` (engine notation; trec_eval writes `ndcg.1=3,2=9,4=4.5`)
replaces the gain of the levels it names; the others keep their default. Gains may be 0
or negative. The ideal ranking is every known document of positive gain, by gain
descending. (trec_eval sorts its gain table with an integer comparison, (int)(a − b), so
gains less than 1 apart may come out of order there; here the order is exact.)
"""

from __future__ import annotations

import math

import numpy as np

from rankmeter.engine.batch import Batch


def finite_number(text: str, what: str = "") -> float:
    """`text` as a finite float, else ValueError naming it (`what` first)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what}{text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{what}{text!r} is not a finite number")
    return value


def parse_gains(text: str) -> tuple[tuple[int, float], ...]:
    """`1:3;2:9` -> ((1, 3.0), (2, 9.0)), sorted by level; ValueError when malformed."""
    table: dict[int, float] = {}
    for item in text.split(";") if text else []:
        level, sep, gain = item.partition(":")
        level = level.strip()
        if not sep or not (level.lstrip("+").isascii() and level.lstrip("+").isdigit()):
            raise ValueError(f"a gain is level:gain with a level of 0 or more, not {item!r}")
        value = finite_number(gain, f"the gain of level {level}: ")
        if int(level) in table:
            raise ValueError(f"level {int(level)} is given two gains")
        if int(level) == 0 and value > 0:
            # A level-0 document would join the ideal ranking; the Batch keeps only positive grades.
            raise ValueError("a positive gain for level 0 is not implemented")
        table[int(level)] = value
    return tuple(sorted(table.items()))


def gain_text(table: tuple[tuple[int, float], ...], exact) -> str:
    """The table's canonical engine text (`exact`: measures._exact, a number's text)."""
    return ";".join(f"{level}:{exact(repr(gain))}" for level, gain in table)


def gain_rows(b: Batch, gains: str) -> tuple[np.ndarray, np.ndarray]:
    """Each ranked document's gain [Q, N], and the ideal gains [Q, M]: positive, descending,
    0-padded. Without a table: the positive grades and the Batch's ideal."""
    if not gains:
        return np.where(b.grades > 0, b.grades, 0.0), b.ideal
    table = parse_gains(gains)
    graded = b.judged & (b.grades >= 0)  # unjudged and pooled-unjudged documents gain 0
    results = np.where(graded & (b.grades > 0), b.grades, 0.0)
    ideal = b.ideal.copy()
    for level, gain in table:  # masks from the original grades: a mapped gain is never remapped
        results[graded & (b.grades == level)] = gain
        ideal[b.ideal == level] = gain
    ideal = np.where(ideal > 0, ideal, 0.0)
    return results, -np.sort(-ideal, axis=1)
