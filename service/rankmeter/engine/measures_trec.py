"""The measures trec_eval has beyond measures.py's: counts, set measures, infAP, RBP,
relative precision, precision at multiples of R, utility and unjudged shares.

The same registry and the same ratio shape (value = num / den, 0 when den is 0) as
measures.py, so `rankmeter serve` can use them too. Each follows its trec_eval source
file (usnistgov/trec_eval 10.0), operation for operation where floating point could
tell, so values match trec_eval's to the last bit. Grades below 0 are trec_eval's
"pooled, not judged" (RELVALUE_UNJUDGED); documents without a grade are "not pooled".
"""

from __future__ import annotations

import numpy as np

from rankmeter.engine.batch import Batch
from rankmeter.engine.gains import gain_rows
from rankmeter.engine.measures import Ratio, family

INFAP_EPSILON = 0.00001  # trec_eval.h


def _count(x: np.ndarray) -> np.ndarray:
    return np.count_nonzero(x, axis=1).astype(float)


def _ones(b: Batch) -> np.ndarray:
    return np.ones(b.size)


@family("NumRet")
def num_ret(b: Batch) -> Ratio:
    """Documents retrieved (after -M / -J). trec_eval `num_ret` (m_num_ret.c); summed, not
    averaged, in trec_eval's `all` line."""
    return Ratio(b.length.astype(float), _ones(b))


@family("NumRel")
def num_rel(b: Batch) -> Ratio:
    """R: relevant documents known for the query. trec_eval `num_rel` (m_num_rel.c)."""
    return Ratio(b.num_rel.astype(float), _ones(b))


@family("NumRelRet")
def num_rel_ret(b: Batch) -> Ratio:
    """Relevant documents retrieved. trec_eval `num_rel_ret` (m_num_rel_ret.c)."""
    return Ratio(_count(b.rel), _ones(b))


@family("NumNonRelJudgedRet")
def num_nonrel_judged_ret(b: Batch) -> Ratio:
    """Judged non-relevant documents retrieved (grade >= 0 below the relevance level).
    trec_eval `num_nonrel_judged_ret` (m_num_nonrel_judged_ret.c)."""
    return Ratio(_count(b.judged_nonrel), _ones(b))


@family("SetAP")
def set_map(b: Batch) -> Ratio:
    """Unranked set AP: relevant retrieved² / (retrieved · R) — set precision times set
    recall. trec_eval `set_map` (m_set_map.c)."""
    hits = _count(b.rel)
    return Ratio(hits * hits, b.length.astype(float) * b.num_rel)


@family("SetRelP")
def set_relative_precision(b: Batch) -> Ratio:
    """Relevant retrieved / min(retrieved, R): set precision over the best possible for a
    set of that size. trec_eval `set_relative_P` (m_set_rel_P.c)."""
    return Ratio(_count(b.rel), np.minimum(b.length, b.num_rel).astype(float))


@family("RelP", cutoff="required")
def relative_precision(b: Batch, cutoff: int) -> Ratio:
    """Relevant in the top k / min(k, R): precision up to R, recall beyond it.
    trec_eval `relative_P_k` (m_rel_P.c)."""
    return Ratio(_count(b.rel[:, :cutoff]), np.minimum(cutoff, b.num_rel).astype(float))


@family("RprecMult", cutoff="required", cutoff_type=float)
def r_precision_mult(b: Batch, cutoff: float) -> Ratio:
    """Precision at rank c = (long)(m·R + 0.9), a multiple m of R (ranks past the list
    count as non-relevant); 0 when c is 0. trec_eval `Rprec_mult_m` (m_Rprec_mult.c),
    whose rounding trec_eval 10 kept."""
    at = np.floor(cutoff * b.num_rel + 0.9).astype(np.int64)
    cum = np.cumsum(b.rel, axis=1)
    hits = np.where(at > 0, cum[np.arange(b.size), np.clip(np.minimum(at, b.width) - 1, 0, None)], 0)
    return Ratio(hits.astype(float), at.astype(float))


@family("Utility", params={"p1": "1", "p2": "-1", "p3": "0", "p4": "0", "N": "0"})
def utility(b: Batch, p1: str, p2: str, p3: str, p4: str, N: str) -> Ratio:
    """Set utility p1·(relevant retrieved) + p2·(non-relevant retrieved) + p3·(relevant
    not retrieved) + p4·(non-relevant not retrieved), N the collection size (trec_eval's
    -N). trec_eval `utility.p1,p2,p3,p4` (m_utility.c)."""
    rr, ret, rel = _count(b.rel), b.length.astype(float), b.num_rel.astype(float)
    value = (float(p1) * rr + float(p2) * (ret - rr) + float(p3) * (rel - rr)
             + float(p4) * (float(N) + rr - ret - rel))
    return Ratio(value, _ones(b))


@family("infAP")
def inferred_ap(b: Batch) -> Ratio:
    """Inferred AP (Yilmaz & Aslam, CIKM 2006), trec_eval's: at each relevant retrieved
    document at 0-based rank j > 0, 1/(j+1) + j/(j+1) · (judged above)/j · (relevant
    above + ε)/(judged relevant-or-not above + 2ε), where "judged above" counts pooled
    unjudged documents and unpooled ones are skipped; 1 at rank 0; summed, over R.
    trec_eval `infAP` (m_infap.c)."""
    pooled_unjudged = b.judged & (b.grades < 0)
    rel_above = np.cumsum(b.rel, axis=1) - 1  # rel_so_far - 1 at a relevant document
    nonrel_above = np.cumsum(b.judged_nonrel, axis=1)
    unjudged_above = np.cumsum(pooled_unjudged, axis=1)
    j = np.arange(b.width, dtype=float)
    safe_j = np.where(j == 0, 1.0, j)
    with np.errstate(divide="ignore", invalid="ignore"):
        term = (1.0 / (j + 1.0) + (j / (j + 1.0)) * ((rel_above + nonrel_above + unjudged_above) / safe_j)
                * ((rel_above + INFAP_EPSILON) / (rel_above + nonrel_above + 2 * INFAP_EPSILON)))
    term = np.where(j == 0, 1.0, term)
    total = np.cumsum(np.where(b.rel, term, 0.0), axis=1)[:, -1]
    return Ratio(total, b.num_rel.astype(float))


@family("Unjudged", cutoff="required")
def unjudged(b: Batch, cutoff: int) -> Ratio:
    """Share of the top k without a judgment (no grade, or a negative one); ranks past the
    list count as judged. trec_eval `unj_k` (m_unjudged.c)."""
    unj = b.shown & ~(b.judged & (b.grades >= 0))
    return Ratio(_count(unj[:, :cutoff]), np.full(b.size, float(cutoff)))


def _persistence_powers(b: Batch, p: float) -> np.ndarray:
    # p^i by repeated multiplication, as trec_eval's loop (cur_p = cur_p * p), i = 0..width.
    return np.cumprod(np.concatenate(([1.0], np.full(b.width, p))))


@family("RBP", params={"p": "0.9"})
def rbp(b: Batch, p: str) -> Ratio:
    """Rank-biased precision (Moffat & Zobel, TOIS 2008): (1 − p) Σ gain_i p^(i−1), the
    gain a grade over the query's highest known grade when that is above 1 (trec_eval's
    normalisation of gains to 0..1), else the grade. trec_eval `rbp` (m_rbp.c)."""
    persistence = float(p)
    top = b.ideal[:, :1]
    gains = np.where(b.grades > 0, b.grades, 0.0)
    gains = np.where(top > 1, gains / np.where(top > 1, top, 1.0), gains)
    powers = _persistence_powers(b, persistence)[:-1]
    total = np.cumsum(np.where(gains != 0, gains * powers, 0.0), axis=1)[:, -1]
    return Ratio((1.0 - persistence) * total, _ones(b))


@family("RBPResid", params={"p": "0.9"})
def rbp_residual(b: Batch, p: str) -> Ratio:
    """RBP's residual: the most RBP could still rise if every unjudged retrieved document
    had the full gain, p^n + (1 − p) Σ_unjudged p^(i−1) (n retrieved); 0 when all are
    judged. trec_eval `rbp_resid` (m_rbp_resid.c)."""
    persistence = float(p)
    powers = _persistence_powers(b, persistence)
    unj = b.shown & ~(b.judged & (b.grades >= 0))
    total = np.cumsum(np.where(unj, powers[:-1], 0.0), axis=1)[:, -1]
    value = powers[b.length] + (1.0 - persistence) * total
    return Ratio(np.where(unj.any(axis=1), value, 0.0), _ones(b))


def _padded(x: np.ndarray, width: int) -> np.ndarray:
    """`x` cut or 0-padded to `width` columns."""
    if x.shape[1] >= width:
        return x[:, :width]
    return np.pad(x, ((0, 0), (0, width - x.shape[1])))


def _discounts(width: int) -> np.ndarray:
    return np.log2(np.arange(2, width + 2, dtype=float))  # log2(i + 2) at 0-based rank i


def _cum_dcg(gains: np.ndarray) -> np.ndarray:
    """DCG at each rank, summed in rank order as trec_eval's loops (zero gains add 0.0)."""
    return np.cumsum(gains / _discounts(gains.shape[1]), axis=1)


@family("BinG")
def binary_g(b: Batch) -> Ratio:
    """Binary G (experimental, trec_eval 4/10/2008): Σ over relevant retrieved documents of
    1 / log2(2 + non-relevant-or-unjudged documents above it), over R. trec_eval `binG`
    (m_binG.c: 1/log2(3 + i − relevant so far) at 0-based rank i)."""
    seen = np.cumsum(b.rel, axis=1)
    term = 1.0 / np.log2(3.0 + np.arange(b.width) - seen)
    return Ratio(np.cumsum(np.where(b.rel, term, 0.0), axis=1)[:, -1], b.num_rel.astype(float))


@family("G", params={"gains": ""})
def normalized_gain(b: Batch, gains: str) -> Ratio:
    """Normalised gain G (experimental, trec_eval 4/10/2008), between AP and nDCG: each
    retrieved document of gain g at 0-based rank i adds g / log2(2 + cost_i − gain_i), where
    gain_i sums the list's gains to rank i and cost_i the ideal's, each ideal gain below 1
    counted as 1; the sum over the ideal's total gain. `gains` as nDCG's. trec_eval `G`
    (m_G.c, gain_init.c)."""
    shown, ideal = gain_rows(b, gains)
    cost = np.cumsum(np.maximum(_padded(ideal, b.width), 1.0), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        term = shown / np.log2((2.0 + cost) - np.cumsum(shown, axis=1))
    total = np.cumsum(np.where(shown != 0, term, 0.0), axis=1)[:, -1]
    return Ratio(total, np.cumsum(ideal, axis=1)[:, -1])


@family("nDCGRel", params={"gains": ""})
def ndcg_rel(b: Batch, gains: str) -> Ratio:
    """nDCG averaged over the relevant documents (experimental): nDCG at the rank of each
    retrieved document of positive gain, and the whole list's DCG over the whole ideal DCG
    for each such document not retrieved; the sum over the ideal's count of positive gains.
    `gains` as nDCG's. trec_eval `ndcg_rel` (m_ndcg_rel.c)."""
    shown, ideal = gain_rows(b, gains)
    width = max(b.width, ideal.shape[1])
    dcg = _cum_dcg(_padded(shown, width))
    ideal_dcg = _cum_dcg(_padded(ideal, width))
    positive = shown > 0
    num_ideal = np.count_nonzero(ideal > 0, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        at_rel = np.where(positive, dcg[:, :b.width] / ideal_dcg[:, :b.width], 0.0)
        missed = (num_ideal - np.count_nonzero(positive, axis=1)).astype(float) * dcg[:, -1] / ideal_dcg[:, -1]
    total = np.cumsum(np.concatenate((at_rel, missed[:, None]), axis=1), axis=1)[:, -1]
    # trec_eval sets the value only when the sum is > 0 (0/0 with an empty ideal is NaN there).
    return Ratio(np.where(total > 0, total, 0.0), num_ideal.astype(float))


@family("RnDCG", params={"gains": ""})
def r_ndcg(b: Batch, gains: str) -> Ratio:
    """nDCG averaged at the R levels (experimental): at each rank k where the ideal ranking
    passes from one gain to the next (the last: to no gain), nDCG@k; plus the whole list's
    nDCG when the ideal ends at least two ranks before the list does (m_Rndcg.c's loops: it
    ends one rank before, the list's last document is never counted); the mean of those.
    0 when R is 0. `gains` as nDCG's. trec_eval `Rndcg` (m_Rndcg.c)."""
    shown, ideal = gain_rows(b, gains)
    width = max(b.width, ideal.shape[1])
    dcg = _cum_dcg(_padded(shown, width))
    ideal_gain = _padded(ideal, width + 1)
    ideal_dcg = _cum_dcg(ideal_gain[:, :width])
    # A change at 0-based rank i (1 <= i <= the ideal's length) scores the nDCG of ranks < i.
    change = (ideal_gain[:, 1:] != ideal_gain[:, :-1]) & (ideal_dcg > 0)
    num_ideal = np.count_nonzero(ideal > 0, axis=1)
    last = np.maximum(b.length - 1, 0)
    rows = np.arange(b.size)
    whole = (num_ideal >= 1) & (num_ideal + 1 < b.length)
    with np.errstate(divide="ignore", invalid="ignore"):
        at_change = np.where(change, dcg / ideal_dcg, 0.0)
        at_end = np.where(whole, dcg[rows, last] / ideal_dcg[:, -1], 0.0)
    total = np.cumsum(np.concatenate((at_change, at_end[:, None]), axis=1), axis=1)[:, -1]
    count = np.count_nonzero(change, axis=1) + whole
    judged = b.num_rel > 0
    return Ratio(np.where(judged, total, 0.0), np.where(judged, count, 0).astype(float))
