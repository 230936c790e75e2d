"""The ranking-quality measures: one small definition each, named in ir_measures notation.

Every measure is a ratio per query: `value = num / den`. That one shape gives both
averages: macro is the mean of per-query values, micro is sum(num) / sum(den). It also
makes window aggregates additive in the live service, and exact across replicas in
PromQL. When `den` is 0 the value is the family's `undefined` (0, as trec_eval
reports; NaN for AUC, which is then left out of averages).

Semantics are trec_eval's (pytrec_eval is the oracle in tests/test_conformance.py).
Names: `P@10`, `R@10`, `AP`, `AP@10`, `nDCG`, `nDCG@10`, `nDCG(dcg=exp-log2)@10`,
`DCG@10`, `RR`, `Rprec`, `Bpref`, `IPrec@0.5`, `IPrec` (the 11-point mean), `SetP`,
`SetR`, `SetF`, `SetF(beta=0.5)`, `E(beta=0.5)`, `Success@10`, `AUC`; aliases `P`, `R`
(set precision and recall) and `F1`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

from rankmeter.engine.batch import Batch
from rankmeter.engine.gains import gain_rows, gain_text, parse_gains


class Ratio(NamedTuple):
    num: np.ndarray  # [Q]
    den: np.ndarray  # [Q]


class Family(NamedTuple):
    name: str
    compute: Callable[..., Ratio]
    cutoff: str            # "none", "required" or "optional"
    cutoff_type: type      # int (ranks) or float (recall points)
    params: dict[str, str]  # parameter name -> default
    undefined: float       # the value when den == 0
    online: bool = False   # computed from clicks (engine/online.py), not from grades


FAMILIES: dict[str, Family] = {}
ALIASES = {"P": "SetP", "R": "SetR", "F1": "SetF"}  # only when written without a cut-off
RECALL_POINTS = tuple(i / 10 for i in range(11))
NUMERIC_PARAMS = {"p", "p1", "p2", "p3", "p4", "N"}  # parameters of measures_trec.py's families


def register(fam: Family) -> None:
    FAMILIES[fam.name] = fam


def family(name: str, cutoff: str = "none", cutoff_type: type = int,
           params: dict[str, str] | None = None, undefined: float = 0.0):
    def add(fn: Callable[..., Ratio]) -> Callable[..., Ratio]:
        register(Family(name, fn, cutoff, cutoff_type, params or {}, undefined))
        return fn
    return add


# ---- shared building blocks ------------------------------------------------------

def _rowsum(x: np.ndarray) -> np.ndarray:
    # Sequential (cumsum) rather than pairwise summation: trailing padding then never
    # changes a value's last bit, so a query scores the same in any batch.
    return np.cumsum(x, axis=1, dtype=float)[:, -1]


def _ones(b: Batch) -> np.ndarray:
    return np.ones(b.size)


def _ranks(width: int) -> np.ndarray:
    return np.arange(1, width + 1, dtype=float)


def _gains(grades: np.ndarray, dcg: str) -> np.ndarray:
    positive = grades > 0  # only positive grades contribute (trec_eval)
    if dcg == "log2":
        return np.where(positive, grades, 0.0)
    if dcg == "exp-log2":
        return np.where(positive, np.exp2(grades) - 1.0, 0.0)
    raise ValueError(f"dcg must be log2 or exp-log2, not {dcg!r}")


def _dcg(grades: np.ndarray, dcg: str, k: int | None) -> np.ndarray:
    g = _gains(grades[:, :k], dcg)
    return _rowsum(g / np.log2(_ranks(g.shape[1]) + 1.0))


_AT_RANKS: list[tuple[np.ndarray, ...]] = []  # the last batch's (rel, cum, prec)


def _precision_at_ranks(b: Batch) -> tuple[np.ndarray, np.ndarray]:
    """Relevant documents at or above each rank, and precision at each rank. AP@k and IPrec@r
    share the last batch's, kept with its `rel` if read-only (stack's: not changed in place)."""
    last = _AT_RANKS[-1] if _AT_RANKS else (None,)
    if last[0] is not b.rel or b.rel.flags.writeable:
        cum = np.cumsum(b.rel, axis=1)
        last = (b.rel, cum, cum / _ranks(b.width))
        cum.flags.writeable = last[2].flags.writeable = False
        _AT_RANKS[:] = [last]
    return last[1], last[2]


# ---- the measures ----------------------------------------------------------------

@family("P", cutoff="required")
def precision(b: Batch, cutoff: int) -> Ratio:
    """Precision at k: relevant documents in the top k, over k; a shorter list counts as
    padded with non-relevant ones. trec_eval `P_k` (m_P.c)."""
    return Ratio(_rowsum(b.rel[:, :cutoff]), np.full(b.size, float(cutoff)))


@family("R", cutoff="required")
def recall(b: Batch, cutoff: int) -> Ratio:
    """Recall at k: relevant documents in the top k, over R (all known relevant, shown
    or not). trec_eval `recall_k` (m_recall.c)."""
    return Ratio(_rowsum(b.rel[:, :cutoff]), b.num_rel.astype(float))


@family("SetP")
def set_precision(b: Batch) -> Ratio:
    """Set precision: relevant shown documents over shown documents. trec_eval `set_P`."""
    return Ratio(_rowsum(b.rel), b.length.astype(float))


@family("SetR")
def set_recall(b: Batch) -> Ratio:
    """Set recall: relevant shown documents over R. trec_eval `set_recall`."""
    return Ratio(_rowsum(b.rel), b.num_rel.astype(float))


def _f_ratio(b: Batch, beta: float) -> Ratio:
    # F = (1+b²)PR / (b²P + R) with P = TP/n and R = TP/R equals (1+b²)TP / (b²R + n):
    # a ratio of sums, so micro F is the F of the summed counts (van Rijsbergen 1979).
    b2 = beta * beta
    return Ratio((1.0 + b2) * _rowsum(b.rel), b2 * b.num_rel + b.length)


@family("SetF", params={"beta": "1"})
def set_f(b: Batch, beta: str) -> Ratio:
    """F-beta of set precision and set recall, (1+β²)·P·R / (β²·P + R); `F1` is β = 1.
    trec_eval `set_F` (m_set_F.c); van Rijsbergen, Information Retrieval, 1979."""
    return _f_ratio(b, float(beta))


@family("E", params={"beta": "1"}, undefined=1.0)
def e_measure(b: Batch, beta: str) -> Ratio:
    """van Rijsbergen's effectiveness measure E = 1 − F-beta (lower is better)."""
    f = _f_ratio(b, float(beta))
    return Ratio(f.den - f.num, f.den)


@family("AP", cutoff="optional")
def average_precision(b: Batch, cutoff: int | None) -> Ratio:
    """Average precision: the sum of P@i over the ranks i of relevant shown documents
    (i <= k for `AP@k`), over R, so unretrieved relevant documents count as zero.
    trec_eval `map` and `map_cut_k` (m_map.c); Harman, TREC-2, 1993."""
    _, prec = _precision_at_ranks(b)
    return Ratio(_rowsum(np.where(b.rel, prec, 0.0)[:, :cutoff]), b.num_rel.astype(float))


@family("DCG", cutoff="optional", params={"dcg": "log2"})
def dcg(b: Batch, cutoff: int | None, dcg: str) -> Ratio:
    """Discounted cumulated gain, Σ_{i<=k} gain(g_i) / log2(i+1), gain(g) = g (`log2`)
    or 2^g − 1 (`exp-log2`). Järvelin & Kekäläinen, TOIS 2002."""
    return Ratio(_dcg(b.grades, dcg, cutoff), _ones(b))


@family("nDCG", cutoff="optional", params={"dcg": "log2", "gains": ""})
def ndcg(b: Batch, cutoff: int | None, dcg: str, gains: str) -> Ratio:
    """DCG@k over the ideal DCG@k of all known grades sorted descending (shown or not);
    without a cut-off, the whole list against the whole ideal. Grades count whatever
    the relevance level. `gains` (`1:3;2:9`, engine/gains.py) sets the gain of grade
    levels (0 or negative allowed: such documents count in the list, not in the ideal).
    trec_eval `ndcg` / `ndcg.1=3,2=9` / `ndcg_cut_k` (m_ndcg.c, gain_init.c); Järvelin &
    Kekäläinen, TOIS 2002."""
    if gains:
        shown, ideal = gain_rows(b, gains)
        shown = shown[:, :cutoff]
        return Ratio(_rowsum(shown / np.log2(_ranks(shown.shape[1]) + 1.0)), _dcg(ideal, "log2", cutoff))
    return Ratio(_dcg(b.grades, dcg, cutoff), _dcg(b.ideal, dcg, cutoff))


@family("RR")
def reciprocal_rank(b: Batch) -> Ratio:
    """Reciprocal rank of the first relevant document, 0 if none is shown.
    trec_eval `recip_rank`; Voorhees, TREC-8 QA, 1999."""
    first = np.argmax(b.rel, axis=1)
    return Ratio(np.where(b.rel.any(axis=1), 1.0 / (first + 1.0), 0.0), _ones(b))


@family("Rprec")
def r_precision(b: Batch) -> Ratio:
    """Precision at rank R: relevant documents in the top R, over R. trec_eval `Rprec`."""
    cum = np.cumsum(b.rel, axis=1)
    at = np.clip(np.minimum(b.num_rel, b.width) - 1, 0, None)
    hits = np.where(b.num_rel > 0, cum[np.arange(b.size), at], 0)
    return Ratio(hits.astype(float), b.num_rel.astype(float))


@family("Bpref")
def bpref(b: Batch) -> Ratio:
    """Binary preference: for each relevant shown document, 1 − (judged non-relevant
    documents above it, at most R) / min(judged non-relevant, R); summed over R.
    Unjudged documents are ignored. trec_eval `bpref` (m_bpref.c); Buckley & Voorhees,
    SIGIR 2004."""
    nonrel_above = np.cumsum(b.judged_nonrel, axis=1)
    r = b.num_rel[:, None]
    norm = np.maximum(np.minimum(b.num_nonrel, b.num_rel), 1)[:, None]
    term = np.where(nonrel_above > 0, 1.0 - np.minimum(nonrel_above, r) / norm, 1.0)
    return Ratio(_rowsum(np.where(b.rel, term, 0.0)), b.num_rel.astype(float))


def _relevant_needed(point: float, num_rel: np.ndarray, rounding: str) -> np.ndarray:
    """The recall point as a count of relevant documents, in doubles as trec_eval does:
    `legacy` is (long)(point·R + 0.9), trec_eval 9's and pytrec_eval's; `lround` is
    trec_eval 10's lround(point·R) (halves away from zero; its CHANGELOG, 10.0)."""
    x = point * num_rel
    if rounding == "legacy":
        return np.floor(x + 0.9)
    if rounding == "lround":
        down = np.floor(x)
        return np.where(x - down >= 0.5, down + 1.0, down)
    raise ValueError(f"rounding must be legacy or lround, not {rounding!r}")


def _interpolated_precision(b: Batch, point: float, rounding: str) -> np.ndarray:
    cum, prec = _precision_at_ranks(b)
    # The best precision at or below the rank where the needed count of relevant
    # documents is reached (a count of 0 means any rank; never reached: 0).
    reached = cum >= _relevant_needed(point, b.num_rel, rounding)[:, None]
    return np.where(reached, prec, 0.0).max(axis=1)


@family("IPrec", cutoff="optional", cutoff_type=float, params={"rounding": "legacy"})
def interpolated_precision(b: Batch, cutoff: float | None, rounding: str) -> Ratio:
    """Interpolated precision at recall r: the highest precision at any rank whose recall
    reaches r (0 if the list never does). Without r: the mean over the 11 points 0.0,
    0.1, …, 1.0. `rounding` turns r into a count of relevant documents: `legacy`
    (pytrec_eval, trec_eval <= 9, the default) or `lround` (trec_eval 10).
    trec_eval `iprec_at_recall_r` and `11pt_avg` (m_iprec_at_recall.c, m_11pt_avg.c)."""
    if cutoff is not None:
        return Ratio(_interpolated_precision(b, cutoff, rounding), _ones(b))
    total = np.zeros(b.size)
    for point in RECALL_POINTS:
        total += _interpolated_precision(b, point, rounding)
    return Ratio(total / len(RECALL_POINTS), _ones(b))


@family("Success", cutoff="required")
def success(b: Batch, cutoff: int) -> Ratio:
    """1 when any relevant document is in the top k, else 0. trec_eval `success_k`."""
    return Ratio(b.rel[:, :cutoff].any(axis=1).astype(float), _ones(b))


@family("AUC", undefined=float("nan"))
def auc(b: Batch) -> Ratio:
    """ROC AUC over the judged documents of the list: the share of (relevant, judged
    non-relevant) pairs in which the relevant one ranks higher. Undefined (NaN, left
    out of averages) when either class is empty. Hanley & McNeil, Radiology 1982."""
    nonrel = b.judged_nonrel
    rel_above = np.cumsum(b.rel, axis=1)
    ordered = _rowsum(np.where(nonrel, rel_above, 0))
    pairs = _rowsum(b.rel) * _rowsum(nonrel)
    return Ratio(ordered, pairs)


# ---- names -----------------------------------------------------------------------

_NAME = re.compile(r"^(?P<family>[A-Za-z][A-Za-z0-9_]*)(?:\((?P<params>[^()]*)\))?"
                   r"(?:@(?P<cutoff>[0-9]+(?:\.[0-9]+)?))?$")


class Measure(NamedTuple):
    """A parsed measure name: family, cut-off and parameters (defaults left out)."""
    family: str
    cutoff: int | float | None = None
    params: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        name = self.family
        if self.params:
            name += "(" + ",".join(f"{k}={v}" for k, v in self.params) + ")"
        if self.cutoff is not None:
            name += f"@{self.cutoff}"
        return name

    @property
    def undefined(self) -> float:
        return FAMILIES[self.family].undefined

    def compute(self, batch: Batch) -> Ratio:
        fam = FAMILIES[self.family]
        kwargs = dict(fam.params)
        kwargs.update(self.params)
        if fam.cutoff != "none":
            kwargs["cutoff"] = self.cutoff
        return fam.compute(batch, **kwargs)

    def values(self, ratio: Ratio) -> np.ndarray:
        """Per-query values of a computed ratio."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(ratio.den != 0, ratio.num / ratio.den, self.undefined)


def parse(name: str) -> Measure:
    """Parse an ir_measures-style name such as `nDCG@10`, `AP`, `SetF(beta=0.5)`."""
    m = _NAME.match(name.strip())
    if not m:
        raise ValueError(f"unknown measure {name!r}: expected a name like nDCG@10, P@10, AP")
    fam_name, raw_params, raw_cutoff = m["family"], m["params"], m["cutoff"]
    if raw_cutoff is None and fam_name in ALIASES:
        fam_name = ALIASES[fam_name]
    fam = FAMILIES.get(fam_name)
    if fam is None:
        known = ", ".join(sorted(f for f, v in FAMILIES.items() if not v.online))
        raise ValueError(f"unknown measure {name!r}: families are {known}")
    if fam.online:
        raise ValueError(f"measure {name!r} is an online signal (from clicks): the live service exports it "
                         f"always; it is not computed from grades")
    cutoff: int | float | None = None
    if raw_cutoff is not None:
        if fam.cutoff == "none":
            raise ValueError(f"measure {name!r}: {fam_name} takes no @cut-off")
        if fam.cutoff_type is int:
            if not (raw_cutoff.isascii() and raw_cutoff.isdigit()) or int(raw_cutoff) < 1:
                raise ValueError(f"measure {name!r}: the cut-off must be a whole number >= 1")
            cutoff = int(raw_cutoff)
        else:
            cutoff = float(raw_cutoff)
            if fam_name == "IPrec" and not 0.0 <= cutoff <= 1.0:
                raise ValueError(f"measure {name!r}: the recall point must be in 0.0..1.0")
    elif fam.cutoff == "required":
        raise ValueError(f"measure {name!r}: {fam_name} needs a cut-off, e.g. {fam_name}@10")
    params = _parse_params(name, fam, raw_params)
    return Measure(fam_name, cutoff, params)


def _parse_params(name: str, fam: Family, raw: str | None) -> tuple[tuple[str, str], ...]:
    if not raw:
        return ()
    given: dict[str, str] = {}
    for item in raw.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip().strip("'\"")
        if not sep or key not in fam.params:
            allowed = ", ".join(fam.params) or "none"
            raise ValueError(f"measure {name!r}: unknown parameter {item.strip()!r} "
                             f"(parameters of {fam.name}: {allowed})")
        given[key] = value
    if "beta" in given:
        try:
            if float(given["beta"]) <= 0:
                raise ValueError
            given["beta"] = _exact(given["beta"])
        except ValueError:
            raise ValueError(f"measure {name!r}: beta must be a positive number") from None
    if "dcg" in given and given["dcg"] not in ("log2", "exp-log2"):
        raise ValueError(f"measure {name!r}: dcg must be log2 or exp-log2")
    if "gains" in given:
        try:
            given["gains"] = gain_text(parse_gains(given["gains"]), _exact)
        except ValueError as e:
            raise ValueError(f"measure {name!r}: {e}") from None
        if given.get("dcg", "log2") != "log2":
            raise ValueError(f"measure {name!r}: gains are for dcg=log2")
    if "rounding" in given and given["rounding"] not in ("legacy", "lround"):
        raise ValueError(f"measure {name!r}: rounding must be legacy or lround")
    for key in set(given) & NUMERIC_PARAMS:
        try:
            given[key] = _exact(given[key])
        except ValueError:
            raise ValueError(f"measure {name!r}: {key} must be a finite number") from None
    # Defaults are left out so `SetF(beta=1)` and `SetF` are one measure.
    return tuple(sorted((k, v) for k, v in given.items() if v != fam.params[k]))


def _exact(text: str) -> str:
    """A number's canonical text, its value kept exactly (GOV2's N = 25205179 must not
    become 2.52052e+07): a whole number as one, else `:g`'s short form when it is exact,
    else every digit (repr)."""
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(text)
    if x.is_integer() and abs(x) < 2 ** 53:
        return str(int(x))
    return f"{x:g}" if float(f"{x:g}") == x else repr(x)


def parse_all(names: Iterable[str]) -> list[Measure]:
    """Parse several names, dropping repeats, keeping the order given."""
    return list(dict.fromkeys(parse(n) for n in names))


def evaluate(measures: Iterable[Measure], batch: Batch) -> dict[Measure, Ratio]:
    """Compute every measure for every query of the batch."""
    return {m: m.compute(batch) for m in measures}
