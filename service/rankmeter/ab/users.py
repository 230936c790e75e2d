"""Sample-ratio mismatch by users: each arm's share of the distinct users against the split.

With ``ab.unit: user`` a user is assigned once, so under correct randomisation each new
user joins arm i with probability p_i independently, and the arms' user counts are a
multinomial sample: Lindon & Malek's sequential test (:func:`~rankmeter.ab.stats.srm_p_value`)
applies to them exactly. But rankmeter does not hold the set of users (their queries land
on every partition); it counts them with HyperLogLog (ab/hll.py), whose estimate û of a
count u has a relative error of σ ≈ 0.81% that does **not** shrink as users accumulate and
is a fixed function of the set (the same error, slowly changing, at every look). Tested on
û as if exact, the test's evidence would grow as n·(error)² while the error stays: at 10⁶
users a share's sampling sd is 0.05 points against the count's 0.29 (50/50), and every
A/A experiment would eventually be flagged.

So the test is made valid for the true counts whatever the HLL error, up to a bound:

* Per arm i, against the rest (the other arms' registers merged: one HLL, so one error),
  the ratio û_i/û_rest is within a factor e^{±β} of the true ratio at every look, except
  with a small probability δ. β = :data:`HLL_SIGMAS` × √2·σ (the log-ratio of two
  independent counts has sd √2·σ), and each count may be off by :data:`HLL_SLACK` users
  besides (small counts are off by whole users). Measured over the whole path of looks
  (bench/srm_users.py: 300–2,000 paths each to 2,000, 10⁵ and 10⁶ users, a look every 2%
  of growth): the largest |log-ratio error| over a path has a 99.9th percentile of about
  3.6–3.8 × √2·σ at 10⁵–10⁶ users (50/50), and the true share left the interval below
  (bound and slack) in none of the paths measured.
* The true share then lies in [lo, hi] (the ratio's interval mapped to a share). The test
  uses the point of that interval closest to the split: p-value = the Dirichlet-multinomial
  (here beta-binomial, arm against rest) p-value of the counts with that share, over the
  total user count shrunk by e^{−β}. When the interval holds the split the p-value is 1.
  Since that p-value is never below the one of the true counts while the bound holds,
  P(running minimum ≤ α) ≤ α + δ under a correct split.

The price: a mismatch smaller than the HLL bound (at 50/50, β/4 ≈ 1.15 points of share) is
never detected, however many users; a larger one is, once the sampling error is below
the margin (52/48: in 92% of experiments by 100,000 users). More than two arms: Bonferroni over the arms (two
arms: both tests are one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rankmeter.ab.hll import RELATIVE_ERROR
from rankmeter.ab.stats import DEFAULT_SRM_CONCENTRATION, srm_p_value

__all__ = ["HLL_BOUND", "HLL_SIGMAS", "HLL_SLACK", "share_interval", "srm_users_p_value"]

#: How many standard deviations of an arm-against-rest log-ratio the HLL error may take,
#: at any look, before the test's guarantee fails (with the slack: never, in the paths measured).
HLL_SIGMAS = 4.0
#: β: the bound on |log(û_i/û_rest) − log(u_i/u_rest)|, ≈ 0.046.
HLL_BOUND = HLL_SIGMAS * math.sqrt(2.0) * RELATIVE_ERROR
#: Users either count may be off by besides: below a few hundred users an estimate is off by
#: whole users (a collision of two in one register), a relative error far above 4σ at 10
#: users (measured: without it, 0.6–2% of 90/10 and 99/1 paths left the bound at their
#: first looks; with 1 user, none of 3,000).
HLL_SLACK = 2.0


def share_interval(users: float, rest: float, bound: float = HLL_BOUND,
                   slack: float = HLL_SLACK) -> tuple[float, float]:
    """The true share of an arm with ``users`` (estimated) against ``rest`` (estimated),
    when the true ratio is within [(users − slack)/(rest + slack)·e^{−bound},
    (users + slack)/(rest − slack)·e^{bound}]. (nan, nan) when no users."""
    if users < 0 or rest < 0 or users + rest <= 0:
        return math.nan, math.nan
    low = max(users - slack, 0.0) * math.exp(-bound) / (rest + slack)
    top = (users + slack) * math.exp(bound)
    high = top / (top + max(rest - slack, 0.0))
    return low / (1.0 + low), high


def srm_users_p_value(users: Sequence[float], rest: Sequence[float], split: Sequence[float],
                      concentration: float = DEFAULT_SRM_CONCENTRATION, bound: float = HLL_BOUND,
                      slack: float = HLL_SLACK) -> float:
    """The SRM p-value of the arms' distinct users at this look, valid when each arm's
    HyperLogLog ratio against the rest is within e^{±bound} (module docstring).

    ``users[i]``: arm i's estimated distinct users; ``rest[i]``: the other arms' (their
    registers merged), arms in the order of ``split``. ``bound`` and ``slack`` 0: the counts
    taken as exact. An arm whose split is 0 and has
    users: 0. Anytime-valid as the running minimum over looks. No users: 1."""
    if not len(users) == len(rest) == len(split) or any(s < 0 for s in split) or not sum(split) > 0:
        raise ValueError("one user count, rest and nonnegative split share per arm")
    shares = [s / float(sum(split)) for s in split]
    if any(p == 0.0 and u > 0 for p, u in zip(shares, users)):
        return 0.0
    ps = []
    for u, r, p in zip(users, rest, shares):
        if not 0.0 < p < 1.0:
            continue
        low, high = share_interval(u, r, bound, slack)
        if math.isnan(low):
            continue
        closest = min(max(p, low), high)
        total = max((u + r) * math.exp(-bound) - 2.0 * slack, 0.0)
        ps.append(srm_p_value([closest * total, (1.0 - closest) * total], [p, 1.0 - p], concentration))
    if not ps:
        return 1.0
    return min(1.0, min(ps) * (len(ps) if len(ps) > 2 else 1))
