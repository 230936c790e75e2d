"""What the pipeline works with: a decoded impression, a decoded feedback event, or why not."""

from __future__ import annotations

from typing import NamedTuple

import msgspec


class Impression(msgspec.Struct, array_like=True, frozen=True):
    query_id: str
    ranker: str
    timestamp_ms: int
    results: list[str]  # in rank order, each document once
    segment: str = ""
    experiment: str = ""     # a team-draft interleaving experiment, when the list is interleaved ...
    teams: list[str] = []    # ... and the ranker (team) that contributed each position of `results`
    # A UBI query record without its hit ids: the list comes from the query's `impression`
    # events (join.py), `results` stays empty here; `expected` is how many results the
    # record says were shown (0: not said).
    assemble: bool = False
    expected: int = 0
    # `query_hash(user_query)`: the same query text across rankers, for position-bias
    # estimation (debias/); "" when the event has no text.
    query_hash: str = ""
    # The user's bucket, ab/clusters.py `bucket_of(client_id)`, for experiments by user; -1
    # without a client_id. (The id itself is not kept: the bucket is all they need ...
    user_bucket: int = -1
    # ... and its 64-bit hash, `user_hash(client_id)`, which the arm's distinct users are
    # counted by (ab/hll.py; -1 without one, or in a record stored before it was kept).
    user_hash: int = -1


class Feedback(msgspec.Struct, array_like=True, frozen=True):
    event_id: str
    query_id: str
    timestamp_ms: int
    action: str
    doc_id: str
    grade: float          # the grade this event gives the document (brief §3)
    explicit: bool        # a `judgment`: replaces earlier grades instead of maxing with them
    # As sent, 1-based for native events; for UBI events see `ubi.position`. Ranks come from
    # the impression's list; the position only orders a list assembled from impression events.
    position: int | None = None


IMPRESSION_ACTION = "impression"  # a feedback event that places a document in its query's list


class Rejected(NamedTuple):
    outcome: str  # "invalid" (dead-lettered) or "ignored" (counted, not applied)
    reason: str
