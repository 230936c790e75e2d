"""The simulated users: who searches, in which session, how readily they click, and (per-user
assignment) which arm they are in."""

from __future__ import annotations

import hashlib
import math
from typing import NamedTuple

import numpy as np

SESSION_GAP_MS = 30 * 60_000    # a user's queries this far apart start a new session
PROPENSITY_SIGMA = 0.3          # σ of the users' click propensity (lognormal, mean 1)


class Visit(NamedTuple):
    client: str        # client_id
    session: str       # session_id
    propensity: float  # this user's clicks: a factor on every result's attractiveness


class Users:
    """A user population with skewed activity: user i is picked with a weight drawn from a
    lognormal (σ 1.5: a few heavy users, a long tail of occasional ones), and clicks with a
    propensity of their own (lognormal, mean 1, σ `propensity_sigma`, default 0.3), so that
    one heavy user's queries are alike, as real users' are, and a window's queries are not
    independent. A user's queries less than 30 minutes apart form one session; a longer gap
    starts a new one."""

    def __init__(self, count: int, rng: np.random.Generator, first: int = 0,
                 session_gap_ms: int = SESSION_GAP_MS, propensity_sigma: float = PROPENSITY_SIGMA) -> None:
        if not propensity_sigma >= 0.0:
            raise ValueError(f"user sigma must be >= 0, got {propensity_sigma!r}")
        weights = rng.lognormal(0.0, 1.5, count)
        sigma = propensity_sigma
        self.propensity = rng.lognormal(-sigma ** 2 / 2, sigma, count)
        self.cumulative = np.cumsum(weights) / weights.sum()
        self.first, self.gap_ms = first, session_gap_ms
        self.last_ms: dict[int, int] = {}
        self.session_start: dict[int, int] = {}

    def visit(self, rng: np.random.Generator, now_ms: int) -> Visit:
        """A user's query at `now_ms` (called in time order)."""
        i = min(int(np.searchsorted(self.cumulative, rng.random(), side="right")), len(self.cumulative) - 1)
        last = self.last_ms.get(i)
        if last is None or now_ms - last >= self.gap_ms:
            self.session_start[i] = now_ms
        self.last_ms[i] = now_ms
        user = self.first + i
        # Named by its start: unique across runs, and the same for the same seed and times.
        return Visit(f"u{user}", f"u{user}-{self.session_start[i]}", float(self.propensity[i]))


def arm_share(client_id: str) -> float:
    """A user's place in [0, 1) for sticky per-user assignment: BLAKE2b of the UTF-8
    client_id, personalised so that it is independent of rankmeter's own bucket hash
    (`rankmeter.ab.clusters.bucket_of`), as a platform's assignment hash would be. The user
    is in the first arm when it is below the split: the same arm at every query."""
    digest = hashlib.blake2b(client_id.encode("utf-8"), digest_size=8, person=b"rm-assign").digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


TEXT_SIGMA = 0.5   # σ of the log of a query's click factor with `persistence` (lognormal, mean 1)


class TextDifficulty:
    """Persistent query-text difficulty (`persistence`, CUPED's world: bench/ab_decision.py
    --persistence): each query's clicks are scaled by exp(σ(√p·d_text + √(1 − p)·ε) − σ²/2),
    d_text drawn once per text and ε per query, both N(0, 1): with p = 1 a text's click
    level is the same at every query (its past predicts its future), with p = 0 it is new
    noise at each query. None (the default): no such factor, the traffic as before. The
    text's hidden grades persist either way, as do the users' click propensities
    (`user_sigma`)."""

    def __init__(self, persistence: float | None) -> None:
        if persistence is not None and not 0.0 <= persistence <= 1.0:
            raise ValueError(f"persistence must be from 0 to 1, got {persistence!r}")
        self.persistence = persistence
        self._d: dict[str, float] = {}

    def factor(self, text: str, rng: np.random.Generator) -> float:
        p = self.persistence
        if p is None:
            return 1.0
        d = self._d.get(text)
        if d is None:
            d = self._d[text] = float(rng.normal())
        z = math.sqrt(p) * d + math.sqrt(1.0 - p) * float(rng.normal())
        return math.exp(TEXT_SIGMA * z - TEXT_SIGMA ** 2 / 2)
