"""Position-bias (examination propensity) estimation from logged clicks, without
interventions: intervention harvesting across rankers and the AllPairs estimator of
Agarwal, Zaitsev, Wang, Li, Najork & Joachims, "Estimating Position Bias without Intrusive
Interventions", WSDM 2019.

The position-based model: P(click on d at rank k for q) = p_k · r(q, d). When the same
(query, document) is shown at rank k in some impressions and at k' in others — because
rankmeter sees several rankers answer the same query text, or a ranker's own randomness
moves it — the ratio of its click-through rates at k and k' is p_k / p_k', whatever its
relevance. Summed over every such (q, d) (the paper's "interventional set" S_{k,k'}), with
each (q, d) weighted by 1 / its impressions at each rank (the paper's w(q, d, k), with the
empirical impression count for Σ_i n_i π_i(k | q, d)):

    clicks[k, k'] = Σ_{(q,d) ∈ S_{k,k'}} C(q, d, k) / N(q, d, k)   ≈ p_k · Σ_S r(q, d)
    pairs[k, k']  = |S_{k,k'}|                                      (weighted impressions)

so clicks[k, k'] / clicks[k', k] estimates p_k / p_k' on the same relevance mass. AllPairs
fits every pair at once by maximising (paper §4.3)

    Σ_{k≠k'} clicks[k,k'] · log(p_k c_{k,k'}) + (pairs[k,k'] − clicks[k,k']) · log(1 − p_k c_{k,k'})

with c_{k,k'} = c_{k',k} the relevance mass of S_{k,k'}. Only the ratios p_k / p_1 are
identified (p·α, c/α fit the same), so they are what `estimate` returns.

State, and how it adds up:

- `PairSums` (clicks and pairs, K×K) is additive like the A/B sums (`ab/sums.py`): each
  partition keeps its own, moved by deltas, and the estimate is made from their sum over
  partitions and replicas (`merge`). A vector form (`to_vector`/`from_vector`) is what a
  checkpoint stores.
- `Harvester` is a bounded table (query text, document) → impressions and clicks per
  rank, and the PairSums it has contributed. When an entry changes, its contribution to
  the sums is replaced (old out, new in), as a query's window contribution is. At most
  `capacity` entries: the least recently shown is evicted, and its contribution stays in
  the sums, final (its counts are frozen, still an unbiased harvest); if the pair is shown
  again it starts a new entry. The pipeline keeps one per process, for every partition it
  holds (a text's impressions are spread over partitions, keyed by query_id), and credits
  each partition's stored sums with what its own queries' observations moved.

The pipeline harvests a query (`observe(text, shown, clicked, grades)`, the text a 64-bit
hash of `user_query`, `events.query_hash`) once, when its clicks are final (its implicit
attribution over); a query without a text is not harvested.

The pooled ideal (for a debiased nDCG). With the implicit grades of a closed query
(`observe(..., grades=)`), each entry also sums, per rank k, the document's grades G_k and
the impressions N_k that carried grades. Then r̂(q, d) = Σ_k w_k G_k / Σ_k N_k, with w_k the
clipped IPW weight of rank k (`ipw.weights`), estimates E[grade | examined] under the
position-based model (E[G_k] = N_k p_k E[grade | examined]; Joachims et al., WSDM 2017),
whatever ranks the document was shown at. `ideal_dcg(q, w)` is the DCG of the query text's
r̂ sorted descending (documents with at least `min_support` graded impressions): the same
for every ranker, unlike the engine's per-list ideal, in which one click's IPW weight
cancels. An impression's DCG of its IPW grades (`ipw.dcg`) over it is the debiased nDCG.
A per-query index (query → its documents) makes it O(documents of the query). Measured
(docs/benchmarks.md, "Position-bias correction"): with ≥ 10 graded impressions per document,
it ranks the simulator's two rankers right in 39–40 of 40 seeds on every position-based
curve; the edge rules there (None: not judged; a query with an ideal and no click: 0).
The Harvester persists nothing itself: keeping its table across restarts is the caller's.

Assumption (the paper's): the rank a document gets does not depend on the user who will
click — true across rankers of an A/B split and for score noise; not for personalised
rankings, where the rank and the user's interest are confounded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Generator, Iterable, Mapping, Sequence
from typing import NamedTuple, TypeVar

import numpy as np

from rankmeter.debias.ipw import dcg_of

DEFAULT_RANKS = 10         # K: propensities for ranks 1..K
DEFAULT_CAPACITY = 50_000  # (query, document) entries per process: about 1 KB each
DEFAULT_MIN_PAIRS = 100    # harvested (q, d) pairs a rank needs for an estimate
DEFAULT_MIN_SUPPORT = 10   # graded impressions a document needs to enter a pooled ideal
# Rows of an entry, each per rank: impressions, clicks, Σ implicit grade, graded impressions.
SHOWN, CLICKED, GRADE, GRADED = range(4)


class PairSums(NamedTuple):
    """Additive sufficient statistics of the AllPairs estimator (module docstring)."""
    clicks: np.ndarray  # [K, K] Σ over S_{k,k'} of the CTR at k (row k, column k')
    pairs: np.ndarray   # [K, K] |S_{k,k'}|, symmetric, zero diagonal

    @classmethod
    def zeros(cls, k: int = DEFAULT_RANKS) -> PairSums:
        return cls(np.zeros((k, k)), np.zeros((k, k)))

    @property
    def ranks(self) -> int:
        return self.clicks.shape[0]

    def __add__(self, other: object) -> PairSums:  # type: ignore[override]
        if not isinstance(other, PairSums):
            return NotImplemented
        return PairSums(self.clicks + other.clicks, self.pairs + other.pairs)

    def to_vector(self) -> np.ndarray:
        """[2K²] float64: what a checkpoint stores for a partition."""
        return np.concatenate([self.clicks.ravel(), self.pairs.ravel()])

    @classmethod
    def from_vector(cls, vector: np.ndarray) -> PairSums:
        k = int(round((len(vector) / 2) ** 0.5))
        return cls(vector[:k * k].reshape(k, k).copy(), vector[k * k:].reshape(k, k).copy())


def merge(sums: Iterable[PairSums]) -> PairSums:
    """The sums of many partitions (and replicas): their element-wise sum."""
    total: PairSums | None = None
    for s in sums:
        total = s if total is None else total + s
    if total is None:
        raise ValueError("merge of no sums")
    return total


def contribution(shown: np.ndarray, clicked: np.ndarray) -> PairSums:
    """What one (q, d) entry adds to the sums: for every pair of ranks k ≠ k' at which it
    was shown, its CTR at k in clicks[k, k'] and 1 in pairs[k, k']. `shown` and `clicked`
    are its impressions and clicks per rank ([K])."""
    seen = shown > 0
    ctr = np.divide(clicked, shown, out=np.zeros(len(shown)), where=seen)
    both = np.outer(seen, seen)
    np.fill_diagonal(both, False)
    return PairSums(np.where(both, ctr[:, None], 0.0), both.astype(float))


class Harvester:
    """One partition's harvest: a bounded (query, document) table, the PairSums its entries
    contribute, and the pooled grades behind `ideal_dcg` (module docstring: eviction,
    partitions, the pooled ideal)."""

    def __init__(self, ranks: int = DEFAULT_RANKS, capacity: int = DEFAULT_CAPACITY,
                 min_support: float = DEFAULT_MIN_SUPPORT) -> None:
        if capacity < 1:
            raise ValueError(f"capacity {capacity}: at least 1")
        self.ranks, self.capacity, self.min_support = ranks, capacity, min_support
        # The pair sums as rows of Python floats (`sums` makes the arrays): the harvest moves
        # a few cells a document, where numpy's per-item cost was most of it.
        self._clicks = [[0.0] * ranks for _ in range(ranks)]
        self._pairs = [[0.0] * ranks for _ in range(ranks)]
        # (query, doc) -> [4, K]: the rows SHOWN, CLICKED, GRADE, GRADED per rank. Ordered
        # by last impression, least recent first: the eviction order.
        self.entries: OrderedDict[tuple[str, str], list[list[float]]] = OrderedDict()
        # query -> its documents in the table (a dict as an ordered set), kept with `entries`.
        self.by_query: dict[str, dict[str, None]] = {}
        # query -> the graded impressions its documents in the table hold (`support`).
        self.graded: dict[str, float] = {}
        self.evicted = 0
        # text -> [row of each of its documents, their GRADE rows (spare rows at the end),
        # their graded impressions]: the pooled grades as arrays, made at the text's first
        # `relevance` and moved with its entries from then on (building them at every read
        # was most of its cost); dropped when the text loses a document. About 150 bytes an
        # entry at K = 10 (docs/benchmarks.md).
        self._pool: dict[str, list] = {}

    @property
    def sums(self) -> PairSums:
        """The PairSums its entries have contributed (new arrays at every read)."""
        return PairSums(np.array(self._clicks), np.array(self._pairs))

    def observe(self, query: str, shown: Sequence[str], clicked: Collection[str],
                grades: Mapping[str, float] | None = None) -> None:
        """One closed query: the documents `shown` in rank order (ranks past K are not
        harvested), the set of those `clicked` (clicks only, not purchases or judgments:
        the estimator models the click), and, for the pooled ideal, the shown documents'
        implicit grades (brief §3's grade map; a document missing has grade 0). Explicit
        judgments stay out: they carry no position bias to pool. Without `grades` nothing
        is pooled for this query."""
        # A repeated id keeps its first rank, as the metric engine's QueryState does.
        self.observe_placed(query, list(enumerate(list(dict.fromkeys(shown))[:self.ranks])), clicked, grades)

    def observe_placed(self, query: str, placed: Sequence[tuple[int, str]], clicked: Collection[str],
                       grades: Mapping[str, float] | None = None) -> None:
        """`observe` with each document's slot given: (slot, document), slots < `ranks`,
        each document once. A slot is a rank here; for the UBM table
        (`clickmodels.placements`) a rank and the distance to the last click above."""
        clicks, pairs = self._clicks, self._pairs
        pool = self._pool.get(query)
        docs = self.by_query.setdefault(query, {})
        for rank, doc in placed:
            key = (query, doc)
            entry = self.entries.get(key)
            if entry is None:
                # Rows of Python floats, not an array: a query touches ten entries at a few
                # ranks each, where numpy's per-call cost was most of the harvest's.
                entry = self.entries[key] = [[0.0] * self.ranks for _ in range(4)]
                docs[doc] = None
            else:
                self.entries.move_to_end(key)
            n, c = entry[SHOWN], entry[CLICKED]
            grade = None if grades is None else grades.get(doc, 0.0)
            if grade is not None:
                entry[GRADE][rank] += grade
                entry[GRADED][rank] += 1
                self.graded[query] = self.graded.get(query, 0.0) + 1
            if pool is not None:
                pooled_add(pool, doc, rank, grade)
            # Only this entry's rank `rank` changes, so only its row and column of the
            # contribution (`contribution`) move; the rest is unchanged.
            others = [k for k, shown in enumerate(n) if shown and k != rank]
            new_rank = n[rank] == 0
            old_ctr = 0.0 if new_rank else c[rank] / n[rank]
            n[rank] += 1
            c[rank] += doc in clicked
            if not others:
                continue  # shown at one rank only: no pair yet
            moved = c[rank] / n[rank] - old_ctr
            for k in others:
                clicks[rank][k] += moved
                if new_rank:  # a new pair (rank, k) for every other rank k it was shown at
                    pairs[rank][k] += 1
                    pairs[k][rank] += 1
                    clicks[k][rank] += c[k] / n[k]
        if not docs:  # nothing shown
            del self.by_query[query]
        while len(self.entries) > self.capacity:
            # Least recently shown out; its contribution stays in the sums, final. Its
            # pooled grades go with it (the ideal is over the documents still held).
            (q, d), entry = self.entries.popitem(last=False)
            held = self.by_query[q]
            del held[d]
            self._pool.pop(q, None)
            if q in self.graded:
                self.graded[q] -= sum(entry[GRADED])
            if not held:
                del self.by_query[q]
                self.graded.pop(q, None)
            self.evicted += 1

    def support(self, query: str) -> float:
        """The graded impressions of the query's documents in the table: what its pooled
        ideal rests on."""
        return self.graded.get(query, 0.0)

    def relevance(self, query: str, weights: Sequence[float]) -> dict[str, float]:
        """r̂(q, d) = Σ_k w_k G_k / Σ_k N_k of each of the query's documents with at least
        `min_support` graded impressions (module docstring). `weights[k]` is the IPW weight
        of rank k+1 (`ipw.weights`), or of slot k (the ubm table's); ranks past its end
        take its last weight."""
        docs = self.by_query.get(query)
        if not docs:
            return {}
        w = np.ones(self.ranks)
        given = list(weights)[:self.ranks]
        if given:
            w[:len(given)] = given
            w[len(given):] = given[-1]
        pool = self._pool.get(query)
        if pool is None:
            rows = [self.entries[(query, d)] for d in docs]
            # Graded impressions are exact integers: summed in any order, the same.
            pool = self._pool[query] = [{d: i for i, d in enumerate(docs)},
                                        np.array([e[GRADE] for e in rows]), [sum(e[GRADED]) for e in rows]]
        index, table, graded = pool
        values = table[:len(graded)] @ w
        return {d: float(values[i] / graded[i]) for d, i in index.items()
                if graded[i] >= self.min_support and graded[i] > 0}

    def ideal_dcg(self, query: str, weights: Sequence[float], depth: int = 10) -> float | None:
        """The query text's pooled ideal DCG@`depth`: its documents' r̂ (`relevance`)
        sorted descending, by the engine's DCG (`ipw.dcg_of`). None when no document has
        `min_support` graded impressions, or when none has a positive r̂ (no relevance
        seen: the query is not judged, as the engine's `empty_query_policy: skip`)."""
        values = sorted(self.relevance(query, weights).values(), reverse=True)
        ideal = dcg_of(values, depth)
        return ideal if ideal > 0 else None


def pooled_add(pool: list, doc: str, rank: int, grade: float | None) -> None:
    """A text's pooled arrays (`Harvester._pool`) follow one observation of `doc` at
    `rank`: a row for a new document, its grade (None: shown without grades)."""
    index, table, graded = pool
    i = index.get(doc)
    if i is None:
        i = index[doc] = len(graded)
        graded.append(0.0)
        if i == len(table):  # full: twice the rows
            table = pool[1] = np.concatenate([table, np.zeros((max(len(table), 4), table.shape[1]))])
    if grade is not None:
        table[i, rank] += grade
        graded[i] += 1


class Propensities(NamedTuple):
    """Estimated P(examine rank k) / P(examine rank 1), k = 1..K; None where the harvest
    was too thin (`support` < the minimum) or not connected to rank 1."""
    relative: list[float | None]
    support: list[float]  # harvested (q, d) pairs involving each rank
    iterations: int


T = TypeVar("T")
Steps = Generator[None, None, T]  # a computation that yields between its steps and returns T


def finish(steps: Steps[T]) -> T:
    """Run `steps` to the end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def estimate(sums: PairSums, min_pairs: float = DEFAULT_MIN_PAIRS, max_iterations: int = 5000,
             tolerance: float = 1e-10) -> Propensities:
    """`estimating` at once."""
    return finish(estimating(sums, min_pairs, max_iterations, tolerance))


def estimating(sums: PairSums, min_pairs: float = DEFAULT_MIN_PAIRS, max_iterations: int = 5000,
               tolerance: float = 1e-10) -> Steps[Propensities]:
    """AllPairs (Agarwal et al. 2019, §4.3) by expectation-maximisation on the pair sums,
    yielding after each iteration: serve spreads an estimate over its batches (a few ms
    each), and the values are those of the same iterations at once.

    Each harvested impression of S_{k,k'} at rank k is a click when examined (E, P = p_k)
    and relevant (R, P = c_{k,k'}). EM over the hidden E and R (the regression-EM of Wang
    et al., WSDM 2018, with one relevance per rank pair instead of a regression): a click
    has E = R = 1; a non-click at k has E = 1 with P = p_k(1 − c)/(1 − p_k c) and R = 1 with
    P = (1 − p_k)c/(1 − p_k c); the M-step averages. Each step raises the likelihood in the
    module docstring. Ranks with fewer than `min_pairs` harvested pairs are left out (None),
    and so are ranks their pairs do not connect to rank 1.
    """
    k = sums.ranks
    support = sums.pairs.sum(axis=1)
    ok = support >= min_pairs
    if not ok[0]:
        return Propensities([None] * k, support.tolist(), 0)
    # Connected to rank 1 through pairs among supported ranks (a breadth-first search).
    linked = (sums.pairs > 0) & ok[:, None] & ok[None, :]
    reach = np.zeros(k, dtype=bool)
    reach[0] = True
    while True:
        grown = reach | linked[reach].any(axis=0)
        if (grown == reach).all():
            break
        reach = grown
    use = np.flatnonzero(reach)
    if len(use) == 1:  # rank 1 linked to no other supported rank: nothing but itself to say
        return Propensities([1.0] + [None] * (k - 1), support.tolist(), 0)
    n = sums.pairs[np.ix_(use, use)]
    c = np.minimum(sums.clicks[np.ix_(use, use)], n)  # float drift never beyond the pairs
    has = n > 0
    nc = np.where(has, n - c, 0.0)  # non-clicks, 0 where the pair has no data
    rows = n.sum(axis=1)
    p = np.full(len(use), 0.5)
    rel = np.where(has, 0.5, 0.0)
    # Loop invariants and rel_new's buffer (0 where no pair, as divide(where=has) leaves it;
    # swapped with rel): fewer operations a step, the same values.
    nn, spare, no = n + n.T, np.zeros_like(n), ~has
    iterations = 0
    for iterations in range(1, max_iterations + 1):
        pc = p[:, None]
        one_x = 1.0 - np.minimum(pc * rel, 1.0 - 1e-12)
        # Posteriors of a non-click (module docstring), 0 where no pair (a NaN p from stored
        # sums must not reach the pairs that have data through 0 × NaN: review, session 10).
        examined = pc * (1.0 - rel) / one_x
        relevant = (1.0 - pc) * rel / one_x
        examined[no] = relevant[no] = 0.0
        p_new = np.add.reduce(c + nc * examined, axis=1) / rows  # ndarray.sum's own reduction
        rel_mass = c + nc * relevant
        rel_new = np.divide(rel_mass + rel_mass.T, nn, out=spare, where=has)
        change = max(np.maximum.reduce(np.abs(p_new - p), axis=None), np.maximum.reduce(np.abs(rel_new - rel), axis=None))
        p, rel, spare = p_new, rel_new, rel
        if change < tolerance:
            break
        yield
    relative: list[float | None] = [None] * k
    for i, rank in enumerate(use):
        relative[rank] = float(p[i] / p[0])
    return Propensities(relative, support.tolist(), iterations)
