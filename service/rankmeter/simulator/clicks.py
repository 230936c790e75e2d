"""Click models: which ranks of a shown list a user clicks, from each rank's attractiveness
(P(attractive | true grade), times any presentation problem). Each returns the clicked
ranks, 0-based, in the order the user clicked them (top-down).

Chuklin, Markov & de Rijke, Click Models for Web Search (2015), compares them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

ClickModel = Callable[[Sequence[float], np.random.Generator], list[int]]

EXAMINE = 1.0 / np.arange(1, 101) ** 0.9  # PBM: P(examine rank r) = 1 / r^0.9
# DCM: P(go on scanning | clicked at rank r), decreasing with r: a click low in the list
# more often satisfies (or exhausts) the user.
CONTINUE = 0.6 * 0.85 ** np.arange(100)


def pbm(attractive: Sequence[float], rng: np.random.Generator) -> list[int]:
    """Position-based model (Craswell, Zoeter, Taylor & Ramsey, WSDM 2008; Richardson et al.,
    WWW 2007): rank r is examined with P = 1 / r^0.9, independently of the other ranks, and
    clicked when examined and attractive. Several clicks per query are common."""
    u = rng.random(len(attractive))
    return [r for r, a in enumerate(attractive) if u[r] < a * EXAMINE[r]]


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
