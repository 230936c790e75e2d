"""The simulated users: who searches, in which session, how readily they click."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

SESSION_GAP_MS = 30 * 60_000    # a user's queries this far apart start a new session


class Visit(NamedTuple):
    client: str        # client_id
    session: str       # session_id
    propensity: float  # this user's clicks: a factor on every result's attractiveness


class Users:
    """A user population with skewed activity: user i is picked with a weight drawn from a
    lognormal (σ 1.5: a few heavy users, a long tail of occasional ones), and clicks with a
    propensity of their own (lognormal, mean 1, σ 0.3), so that one heavy user's queries are
    alike, as real users' are, and a window's queries are not independent. A user's queries
    less than 30 minutes apart form one session; a longer gap starts a new one."""

    def __init__(self, count: int, rng: np.random.Generator, first: int = 0,
                 session_gap_ms: int = SESSION_GAP_MS) -> None:
        weights = rng.lognormal(0.0, 1.5, count)
        self.propensity = rng.lognormal(-0.3 ** 2 / 2, 0.3, count)
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
