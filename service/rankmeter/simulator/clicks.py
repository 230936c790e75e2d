"""Click models: which ranks of a shown list a user clicks, from each rank's attractiveness
(P(attractive | true grade), times any presentation problem). Each returns the clicked
ranks, 0-based, in the order the user clicked them (top-down).

The position-based model's examination curve is data (`EXAMINATION`), picked by name
(`click_model("pbm", "power-1.5")`), so a position-bias estimator can be tested on a bias
it was not built around. `examination(...)` gives every model's true P(examine rank r)
for a list: the curve itself for pbm; for cascade and dcm it follows from the
attractiveness of the results above r (see there).

Chuklin, Markov & de Rijke, Click Models for Web Search (2015), compares them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

ClickModel = Callable[[Sequence[float], np.random.Generator], list[int]]

_RANKS = np.arange(1, 101, dtype=float)
# PBM examination curves, P(examine rank r) for r = 1..100. The default is the one every
# existing test and bench was measured with; the others are biases an estimator was not
# tuned on: steeper (power-1.5), geometric (exp-0.75, the shape of Wang et al. 2018's
# fitted curves), and a plateau over the first three ranks (a page where the top three
# are seen alike: no ranking among them to be corrected) then a drop.
EXAMINATION: dict[str, np.ndarray] = {
    "power-0.9": 1.0 / _RANKS ** 0.9,
    "power-1.5": 1.0 / _RANKS ** 1.5,
    "exp-0.75": 0.75 ** (_RANKS - 1),
    "plateau-3": np.where(_RANKS <= 3, 1.0, 0.5 * 0.8 ** (_RANKS - 4)),
}
DEFAULT_EXAMINATION = "power-0.9"
EXAMINE = EXAMINATION[DEFAULT_EXAMINATION]  # PBM: P(examine rank r) = 1 / r^0.9
# DCM: P(go on scanning | clicked at rank r), decreasing with r: a click low in the list
# more often satisfies (or exhausts) the user.
CONTINUE = 0.6 * 0.85 ** np.arange(100)


def pbm(attractive: Sequence[float], rng: np.random.Generator, examine: np.ndarray = EXAMINE) -> list[int]:
    """Position-based model (Craswell, Zoeter, Taylor & Ramsey, WSDM 2008; Richardson et al.,
    WWW 2007): rank r is examined with P = `examine[r]` (default 1 / r^0.9), independently of
    the other ranks, and clicked when examined and attractive. Several clicks per query are
    common."""
    u = rng.random(len(attractive))
    return [r for r, a in enumerate(attractive) if u[r] < a * examine[r]]


def cascade(attractive: Sequence[float], rng: np.random.Generator) -> list[int]:
    """Cascade model (Craswell, Zoeter, Taylor & Ramsey, "An experimental comparison of click
    position-bias models", WSDM 2008): the user scans top-down, clicks the first attractive
    result and stops. At most one click per query."""
    u = rng.random(len(attractive))
    for r, a in enumerate(attractive):
        if u[r] < a:
            return [r]
    return []


def dcm(attractive: Sequence[float], rng: np.random.Generator) -> list[int]:
    """Dependent click model (Guo, Liu & Wang, "Efficient multiple-click models in web
    search", WSDM 2009): the user scans top-down and clicks attractive results; after a click
    at rank r she goes on with probability λ_r (`CONTINUE`, decreasing with r) and stops
    otherwise; without a click she goes on. λ = 0 is the cascade model."""
    u = rng.random(len(attractive))
    go_on = rng.random(len(attractive))
    clicks: list[int] = []
    for r, a in enumerate(attractive):
        if u[r] < a:
            clicks.append(r)
            if go_on[r] >= CONTINUE[r]:
                break
    return clicks


CLICK_MODELS: dict[str, ClickModel] = {"pbm": pbm, "cascade": cascade, "dcm": dcm}


def click_model(name: str, curve: str | None = None) -> ClickModel:
    """The click model `name` (of CLICK_MODELS); for pbm with the examination curve `curve`
    (of EXAMINATION; default DEFAULT_EXAMINATION). Cascade and dcm have no curve to pick:
    their examination follows from the clicks above (`examination`)."""
    if name not in CLICK_MODELS:
        raise ValueError(f"click model {name!r}: one of {', '.join(CLICK_MODELS)}")
    if curve is None or (name == "pbm" and curve == DEFAULT_EXAMINATION):
        return CLICK_MODELS[name]  # the very function: default runs are unchanged
    if name != "pbm":
        raise ValueError(f"examination curve {curve!r}: only the pbm model has one; {name}'s "
                         "examination follows from the clicks above each rank")
    if curve not in EXAMINATION:
        raise ValueError(f"examination curve {curve!r}: one of {', '.join(EXAMINATION)}")
    return partial(pbm, examine=EXAMINATION[curve])


def examination(name: str, attractive: np.ndarray, curve: str | None = None) -> np.ndarray:
    """The true P(examine rank r) of each result, for lists of attractiveness `attractive`
    ([n] or [Q, n], rank order) under click model `name` — what a position-bias estimator is
    compared with.

    - pbm: the curve, the same for every list.
    - cascade: rank r is examined when no result above it was clicked (clicked = examined
      and attractive, and every rank above r was examined): Π_{j<r} (1 − a_j). It depends on
      the list, so a per-rank propensity is its average over the traffic.
    - dcm: rank 1 is examined; the user goes from r to r+1 unless she clicks r and stops,
      which she does with P = a_r (1 − λ_r): e_{r+1} = e_r (1 − a_r (1 − λ_r)). Also
      list-dependent.
    """
    a = np.asarray(attractive, dtype=float)
    n = a.shape[-1]
    if name == "pbm":
        curve_values = EXAMINATION[curve or DEFAULT_EXAMINATION][:n]
        return np.broadcast_to(curve_values, a.shape).copy()
    if name == "cascade":
        go_on = 1.0 - a
    elif name == "dcm":
        go_on = 1.0 - a * (1.0 - CONTINUE[:n])
    else:
        raise ValueError(f"click model {name!r}: one of {', '.join(CLICK_MODELS)}")
    # e_1 = 1, e_{r+1} = e_r · go_on_r: a cumulative product shifted by one rank.
    ones = np.ones(a.shape[:-1] + (1,))
    return np.concatenate([ones, np.cumprod(go_on, axis=-1)[..., :-1]], axis=-1)
