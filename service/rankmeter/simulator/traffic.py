"""Search traffic: users with skewed activity and 30-minute sessions, queries by Zipf
popularity, rankers by a traffic split, clicks from a click model driven by the hidden
grades, dwell times by grade, some add-to-carts and purchases, a share of explicit
judgments, duplicates and a little disorder in delivery — the shape of a real event
pipeline.

Click models (`clicks.py`): position-based (default), cascade or dependent click model;
the position-based model's examination curve by name (`examination`, default 1/r^0.9).
Attractiveness P(attractive | true grade) is `ATTRACTIVE`. With `track_examination` the
simulator sums each rank's true examination probability over the lists it shows
(`true_examination()`), the truth a position-bias estimator is compared with.

Feedback comes later than its impression, as in real logs: a query's first click a
lognormal delay after it (median 4 s, long tail), each next click after the previous
click's dwell, an add-to-cart after the dwell, a purchase a lognormal delay after that
(median 3 min); nothing later than `purchase_cap_s` (default the attribution window,
30 min) after the impression. `query_events` returns a query's events at once, in
delivery order; `history.History` delivers them in event-time order.

`Regression`s (`regressions.py`) degrade a ranker for an interval. Users and sessions are
`users.py`'s, the true metrics `truth.py`'s.

Assignment (`assign`): `"query"` (default) draws each query's ranker at random with the
split; `"user"` is sticky per-user assignment as platforms do it: a user's arm is fixed by a
hash of their client_id and the split (`users.arm_share`), so all of a user's queries go to
one ranker. `user_sigma` is the σ of the users' click propensity (lognormal, mean 1;
default 0.3), the heterogeneity that makes one user's queries correlated.

With `interleave=(A, B)` every query is answered by a team-draft interleaving of A's and
B's lists (`interleaving.py`), carrying brief §2's
`interleaving: {"experiment": "A-vs-B", "teams": [...]}`; the click model is the same.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from rankmeter.engine import QueryState
from rankmeter.simulator.bm25 import Index, Ranker
from rankmeter.simulator.clicks import click_model as make_click_model
from rankmeter.simulator.clicks import examination as examination_of
from rankmeter.simulator.corpus import Corpus, Query, grade_of
from rankmeter.simulator.interleaving import team_draft
from rankmeter.simulator.regressions import REGRESSED_NOISE, Regression, check_regression
from rankmeter.simulator.truth import TruthPoint, TruthTally
from rankmeter.simulator.users import PROPENSITY_SIGMA, TextDifficulty, Users, Visit, arm_share

ATTRACTIVE = {0: 0.04, 1: 0.25, 2: 0.55, 3: 0.85}   # P(click | examined, true grade)
DWELL_MEDIAN_S = {0: 4.0, 1: 15.0, 2: 40.0, 3: 80.0}
CART = {2: 0.25, 3: 0.45}                            # P(add to cart | click, grade)
PURCHASE = {2: 0.3, 3: 0.5}                          # P(purchase | add to cart, grade)

# Delays, lognormal: (median in seconds, sigma of the log).
FIRST_CLICK_DELAY = (4.0, 1.0)  # impression -> first click: most within 10 s, a long tail
NEXT_CLICK_DELAY = (3.0, 0.7)   # back from a document -> the next click
PURCHASE_DELAY = (180.0, 1.0)   # add to cart -> purchase: minutes
DWELL_SIGMA = 0.5
ATTRIBUTION_S = 1800.0          # windows.attribution's default: no feedback later than this
K = 10                          # results shown per query
REACT_DECAY = 0.8               # a reactive ranker's recent clicks, decayed at each answer of the text

DEFAULT_RANKERS = (Ranker("bm25-tuned", k1=1.2, b=0.75),
                   Ranker("bm25-degraded", k1=0.3, b=0.1, noise=0.35))


class Event(NamedTuple):
    stream: str  # "impressions" or "feedback"
    key: str     # the query id: both topics are keyed by it
    value: dict

    @property
    def timestamp_ms(self) -> int:
        return self.value["timestamp"]


class Simulator:
    def __init__(self, seed: int = 7, rankers: tuple[Ranker, ...] = DEFAULT_RANKERS,
                 split: float = 0.5, regression_at: float | None = None,
                 judgment_share: float = 0.03, duplicate_share: float = 0.01,
                 disorder: float = 0.05, corpus: Corpus | None = None,
                 interleave: tuple[str, str] | None = None, click_model: str = "pbm",
                 regressions: Sequence[Regression] = (), users: int = 10_000,
                 purchase_cap_s: float = ATTRIBUTION_S, run_id: str | None = None,
                 truth_log: bool = False, examination: str | None = None,
                 track_examination: bool = False, degrade_share: float = 1.0,
                 react: float = 0.0, assign: str = "query",
                 user_sigma: float = PROPENSITY_SIGMA, persistence: float | None = None,
                 tally: bool = True) -> None:
        check_knobs(assign, interleave, degrade_share)
        self.texts = TextDifficulty(persistence)
        self.assign = assign
        self.corpus = corpus or Corpus(seed=seed)
        self.index = Index(self.corpus)
        self.rankers = list(rankers)
        by_name = {r.name: r for r in self.rankers}
        self.interleave = None if interleave is None else interleaving_pair(interleave, by_name)
        self.experiment = "" if interleave is None else f"{interleave[0]}-vs-{interleave[1]}"
        self.click_model = make_click_model(click_model, examination)  # ValueError when unknown
        self.click_model_name, self.examination = click_model, examination
        # The true gap's knob (bench --gap): the second ranker shows its own list with this
        # probability, else the first ranker's: the true gap is about this share of the full one.
        self.degrade_share = degrade_share
        # A ranker that reacts to clicks (as production rankers do through click features
        # or caches): a (query text, document)'s recent clicks c (decayed by REACT_DECAY at
        # each answer of the text) add react · c / (1 + c) of the top score to its score.
        self.react = react
        self._recent: dict[str, dict[str, float]] = {}
        # Σ true P(examine) and number of lists per rank, when tracked (the pbm curve, or the
        # list-dependent examination of cascade and dcm averaged over the traffic).
        self._examined: np.ndarray | None = np.zeros(K) if track_examination else None
        self._lists_at = np.zeros(K)
        self.regressions = list(regressions)
        if regression_at is not None:  # the old shortcut: the first ranker's list, for good
            self.regressions.append(Regression(regression_at, math.inf, self.rankers[0].name))
        for r in self.regressions:
            check_regression(r, by_name)
        self.split = split
        self.regression_at = regression_at
        self.judgment_share = judgment_share
        self.duplicate_share = duplicate_share
        self.disorder = disorder
        self.purchase_cap_ms = int(purchase_cap_s * 1000)
        self.rng = np.random.default_rng(seed)
        self.run_id = run_id or os.urandom(3).hex()  # query ids stay unique across runs
        self.users = Users(users, self.rng, propensity_sigma=user_sigma)
        self.truth = TruthTally()
        self.tally = tally  # False: no true metrics kept (`truth` stays empty), for a caller with its own
        self.truth_log: list[TruthPoint] | None = [] if truth_log else None
        self._ideal: dict[str, dict[str, int]] = {}
        self._queries = 0
        self._popularity = np.cumsum(self.corpus.popularity)
        # Caches that make a query cheap: BM25 scores per (query, k1, b), the list of a
        # noise-free ranker, the true metrics of a (query, list).
        self._scores: dict[tuple[str, float, float], tuple[np.ndarray, np.ndarray]] = {}
        self._top: dict[tuple[str, float, float], list[str]] = {}
        self._truth_values: dict[tuple[str, tuple[str, ...]], np.ndarray | None] = {}

    def true_grades(self, query: Query) -> dict[str, int]:
        """Every document with a positive true grade (they all contain a query term)."""
        grades = self._ideal.get(query.text)
        if grades is None:
            candidates = {i for t in query.terms for i, _ in self.index.postings.get(t, ())}
            # The terms present per document from the postings: `Corpus.true_grade`, faster.
            present = Counter(i for t in query.terms for i, _ in self.index.postings.get(t, ()))
            docs, n = self.corpus.documents, len(query.terms)
            grades = {docs[i].doc_id: g for i in candidates
                      if (g := grade_of(docs[i].topic == query.topic, present[i], n)) > 0}
            self._ideal[query.text] = grades
        return grades

    def query_events(self, now_ms: int, elapsed_s: float) -> list[Event]:
        """One answered search and what its user did, in delivery order; the feedback's
        timestamps are later than `now_ms` (see the module's docstring)."""
        if self.interleave is not None:
            return self._interleaved(now_ms, elapsed_s)
        if self.assign == "user":  # the user first: their arm is fixed by their client_id
            visit = self.users.visit(self.rng, now_ms)
            ranker = self.rankers[0] if arm_share(visit.client) < self.split else self.rankers[1]
            return self.answer(ranker, now_ms, elapsed_s, visit=visit)
        ranker = self.rankers[0] if self.rng.random() < self.split else self.rankers[1]
        if ranker is not self.rankers[0] and self.degrade_share < 1.0 and self.rng.random() >= self.degrade_share:
            return self.answer(ranker, now_ms, elapsed_s, lists=self.rankers[0])
        return self.answer(ranker, now_ms, elapsed_s)

    def answer(self, ranker: Ranker, now_ms: int, elapsed_s: float, users: Users | None = None,
               lists: Ranker | None = None, visit: Visit | None = None) -> list[Event]:
        """One search answered by `ranker` at `now_ms`, by `visit`'s user or else a user of
        `users` (default: all), with the list of `lists` (default: `ranker`'s own)."""
        visit = visit or (users or self.users).visit(self.rng, now_ms)
        query = self._sample_query()
        results = self.search(query, self._regressed(lists or ranker, elapsed_s))
        return self._events(ranker.name, query, results, [ranker.name] * len(results), {},
                            now_ms, elapsed_s, visit)

    def _interleaved(self, now_ms: int, elapsed_s: float) -> list[Event]:
        assert self.interleave is not None
        visit = self.users.visit(self.rng, now_ms)
        query = self._sample_query()
        a, b = (self._regressed(r, elapsed_s) for r in self.interleave)
        results, team_of = team_draft(self.search(query, a), self.search(query, b), K, self.rng)
        teams = [self.interleave[t].name for t in team_of]
        extra = {"interleaving": {"experiment": self.experiment, "teams": teams}}
        return self._events(self.experiment, query, results, teams, extra, now_ms, elapsed_s, visit)

    def _events(self, name: str, query: Query, results: list[str], teams: list[str], extra: dict,
                now_ms: int, elapsed_s: float, visit: Visit) -> list[Event]:
        self._queries += 1
        qid = f"{self.run_id}-{self._queries}"
        grades = self.true_grades(query)
        if self.tally:  # it draws nothing from the rng: the traffic is the same without it
            self._tally(name, query, results, grades, now_ms)
        user = {"client_id": visit.client, "session_id": visit.session}
        impression = Event("impressions", qid, {"query_id": qid, "ranker": name, "timestamp": now_ms,
                                                "results": results, "user_query": query.text, **user, **extra})
        presentation = {r.ranker: 1.0 - r.size for r in self.regressions
                        if r.kind == "clicks" and r.active(elapsed_s)}
        # The presentation problem last: it takes its share of every click, whoever the user.
        propensity = visit.propensity * self.texts.factor(query.text, self.rng)
        attractive = [min(ATTRACTIVE[grades.get(doc, 0)] * propensity, 1.0) * presentation.get(team, 1.0)
                      for doc, team in zip(results, teams)]
        if self._examined is not None and attractive:
            n = min(len(attractive), K)
            self._examined[:n] += examination_of(self.click_model_name, np.array(attractive[:n]), self.examination)
            self._lists_at[:n] += 1
        clicks = self.click_model(attractive, self.rng)
        if self.react:
            reacted(self._recent.setdefault(query.text, {}), [results[r] for r in clicks])
        feedback = list(self._feedback(qid, results, grades, clicks, now_ms, user))
        if self.rng.random() < self.disorder:
            return feedback + [impression]  # the feedback pipeline outran the impression
        return [impression] + feedback

    def true_examination(self) -> np.ndarray:
        """Mean true P(examine rank r), r = 1..K, over the lists shown so far (NaN at a rank
        no list reached); needs `track_examination=True`."""
        return true_examination(self._examined, self._lists_at)

    def _sample_query(self) -> Query:
        # As Corpus.sample_query (rng.choice with p draws one uniform the same way), faster.
        i = int(np.searchsorted(self._popularity, self.rng.random(), side="right"))
        return self.corpus.queries[min(i, len(self.corpus.queries) - 1)]

    def search(self, query: Query, ranker: Ranker, rng: np.random.Generator | None = None) -> list[str]:
        """`Index.search(query, ranker, K, rng)` (default: the traffic's rng), with the scores cached."""
        key = (query.text, ranker.k1, ranker.b)
        if self.react and self._recent.get(query.text):
            return reactive_search(self, query, ranker, rng or self.rng)
        if not ranker.noise and key in self._top:
            return self._top[key]
        docs, values = cached_scores(self, query, ranker)
        if not len(docs):
            return []
        if ranker.noise:
            values = values + (rng or self.rng).normal(0.0, ranker.noise * values.max(), len(values))
        documents = self.corpus.documents
        top = [documents[i].doc_id for i in docs[np.argsort(-values, kind="stable")[:K]]]
        if not ranker.noise:
            self._top[key] = top
        return top

    def _tally(self, name: str, query: Query, results: list[str], grades: dict[str, int], now_ms: int) -> None:
        key = (query.text, tuple(results))
        if key in self._truth_values:
            values = self._truth_values[key]
        else:
            if len(self._truth_values) > 200_000:  # noisy lists rarely repeat: keep it bounded
                self._truth_values.clear()
            values = self._truth_values[key] = self.truth.values(
                QueryState.from_grades(results, grades, shown_grade=0))
        self.truth.add_values(name, values)
        if self.truth_log is not None and values is not None:
            self.truth_log.append(TruthPoint(now_ms, name, values))

    def _regressed(self, ranker: Ranker, elapsed_s: float) -> Ranker:
        """A `ranking` regression of this ranker (as a team, too) that is active now."""
        for r in self.regressions:
            if r.kind == "ranking" and r.ranker == ranker.name and r.active(elapsed_s):
                if r.size >= 1.0 or self.rng.random() < r.size:
                    return ranker._replace(noise=REGRESSED_NOISE)
        return ranker

    def _lognormal_ms(self, median_sigma: tuple[float, float]) -> int:
        median, sigma = median_sigma
        return int(self.rng.lognormal(math.log(median), sigma) * 1000)

    def _feedback(self, qid: str, results: list[str], grades: dict[str, int], clicks: list[int],
                  now_ms: int, user: dict[str, str]) -> Iterator[Event]:
        last = now_ms + self.purchase_cap_ms - 1  # nothing after the attribution window
        n = 0

        def event(action: str, doc: str, ts: int, **fields) -> Event:
            nonlocal n
            n += 1
            return Event("feedback", qid, {"query_id": qid, "action": action, "doc_id": doc, **fields,
                                           "timestamp": min(ts, last), "event_id": f"{qid}.{n}", **user})

        t = now_ms
        dwell = 0
        for i, rank in enumerate(clicks):
            doc = results[rank]
            grade = grades.get(doc, 0)
            t += self._lognormal_ms(FIRST_CLICK_DELAY) if i == 0 else dwell + self._lognormal_ms(NEXT_CLICK_DELAY)
            dwell = self._lognormal_ms((DWELL_MEDIAN_S[grade], DWELL_SIGMA))
            yield from self._maybe_twice(event("click", doc, t, position=rank + 1, dwell_ms=dwell))
            if self.rng.random() < CART.get(grade, 0.0):
                yield event("add_to_cart", doc, t + dwell)
                if self.rng.random() < PURCHASE.get(grade, 0.0):
                    yield event("purchase", doc, t + dwell + self._lognormal_ms(PURCHASE_DELAY))
        if self.rng.random() < self.judgment_share:  # an editor judges the top five
            for doc in results[:5]:
                yield event("judgment", doc, t, grade=grades.get(doc, 0))

    def _maybe_twice(self, event: Event) -> Iterator[Event]:
        yield event
        if self.rng.random() < self.duplicate_share:
            yield event  # a producer retry: same event_id

    def run(self, send: Callable[[Event], None], rate: float, duration: float | None = None,
            count: int | None = None, stop: Callable[[], bool] = lambda: False,
            clock: Callable[[], float] = time.time,
            progress: Callable[[int, float], None] | None = None,
            event_time: Callable[[float], int] | None = None) -> int:
        """Send events at about `rate` per second until `duration` seconds or `count`
        events have passed, or `stop()` says so; `progress(sent, elapsed)` every 10 s.
        `event_time(elapsed)` stamps the queries (default: the clock's now, in ms; the
        demo runs event time faster). Returns the number sent."""
        start = clock()
        sent = 0
        reported = start
        while not stop():
            elapsed = clock() - start
            if (duration is not None and elapsed >= duration) or (count is not None and sent >= count):
                break
            now_ms = int(clock() * 1000) if event_time is None else event_time(elapsed)
            for event in self.query_events(now_ms, elapsed):
                send(event)
                sent += 1
            if progress is not None and clock() - reported >= 10:
                reported = clock()
                progress(sent, reported - start)
            ahead = sent / rate - (clock() - start)
            if ahead > 0:
                time.sleep(min(ahead, 0.5))
        return sent


def true_examination(examined: np.ndarray | None, lists_at: np.ndarray) -> np.ndarray:
    if examined is None:
        raise ValueError("the simulator was made without track_examination=True")
    with np.errstate(invalid="ignore", divide="ignore"):
        return examined / lists_at


def check_knobs(assign: str, interleave: tuple[str, str] | None, degrade_share: float) -> None:
    if assign not in ("query", "user"):
        raise ValueError(f"assign {assign!r}: query or user")
    if assign == "user" and interleave is not None:
        raise ValueError("--assign user assigns users to rankers; interleaving shows both to every query")
    if not 0.0 <= degrade_share <= 1.0:
        raise ValueError(f"degrade_share {degrade_share}: between 0 and 1")


def interleaving_pair(interleave: tuple[str, str], by_name: dict[str, Ranker]) -> tuple[Ranker, Ranker]:
    unknown = [n for n in interleave if n not in by_name]
    if len(interleave) != 2 or interleave[0] == interleave[1] or unknown:
        raise ValueError(f"interleave needs two different rankers of {', '.join(by_name)}; got {','.join(interleave)}")
    return by_name[interleave[0]], by_name[interleave[1]]


def cached_scores(sim: Simulator, query: Query, ranker: Ranker) -> tuple[np.ndarray, np.ndarray]:
    """`Index.scores` as arrays (documents, scores), cached per (query, k1, b)."""
    key = (query.text, ranker.k1, ranker.b)
    cached = sim._scores.get(key)
    if cached is None:
        scores = sim.index.scores(query, ranker)
        cached = sim._scores[key] = (np.fromiter(scores.keys(), dtype=np.int64),
                                     np.fromiter(scores.values(), dtype=float))
    return cached


def reactive_search(sim: Simulator, query: Query, ranker: Ranker, rng: np.random.Generator) -> list[str]:
    """`Simulator.search` with the recent clicks' boost (`react`): c / (1 + c) of the top
    score times `react`, c the (text, document)'s decayed recent clicks."""
    ids, values = cached_scores(sim, query, ranker)
    docs = sim.corpus.documents
    top = values.max()
    if ranker.noise:
        values = values + rng.normal(0.0, ranker.noise * top, len(values))
    recent = np.array([sim._recent[query.text].get(docs[i].doc_id, 0.0) for i in ids])
    values = values + sim.react * top * recent / (1.0 + recent)  # not in place: values may be the cache's
    return [docs[ids[i]].doc_id for i in np.argsort(-values, kind="stable")[:K]]


def reacted(recent: dict[str, float], clicked: list[str]) -> None:
    """A text answered: its documents' recent clicks decay, the clicked ones add 1."""
    for doc in list(recent):
        recent[doc] *= REACT_DECAY
        if recent[doc] < 0.01:
            del recent[doc]
    for doc in clicked:
        recent[doc] = recent.get(doc, 0.0) + 1.0
