"""Team-draft interleaving (Radlinski, Kurup & Joachims, CIKM 2008): what the simulator's
`interleave=(A, B)` answers every query with."""

from __future__ import annotations

import numpy as np


def team_draft(a: list[str], b: list[str], k: int, rng: np.random.Generator) -> tuple[list[str], list[int]]:
    """Team-draft interleaving of two rankings (Radlinski, Kurup & Joachims, CIKM 2008).

    In each round a fair coin decides which team picks first; each team in turn adds its
    highest-ranked document not yet in the list. Stops at `k` documents, or when a team
    has nothing left to add (as the paper's algorithm does). Returns the list and the team
    (0 for `a`, 1 for `b`) of each position: every prefix's team sizes differ by at most
    one, each team's documents are in its ranker's order, no document appears twice.
    """
    lists = (a, b)
    nexts = [0, 0]  # the first not-yet-examined rank of each list
    shown: list[str] = []
    teams: list[int] = []
    seen: set[str] = set()
    while len(shown) < k:
        first = int(rng.random() < 0.5)
        for team in (first, 1 - first):
            ranking, i = lists[team], nexts[team]
            while i < len(ranking) and ranking[i] in seen:
                i += 1
            nexts[team] = i
            if i == len(ranking) or len(shown) == k:
                return shown, teams
            seen.add(ranking[i])
            shown.append(ranking[i])
            teams.append(team)
    return shown, teams
