"""Days or weeks of search traffic in event time, as fast as the machine allows.

Traffic shape: ranker r answers `peak[r] × daily(hour of day) × weekly(day of week)`
queries per hour (UTC): a smooth daily curve with its trough, 25% of the peak, at 04:00
and its peak at 20:00; weekends at 0.8 of weekdays. Arrivals are a non-homogeneous
Poisson process: per minute a Poisson count at that minute's rate, uniform within it.

Each ranker has its own users (an A/B arm keeps its users), about `users_per_peak` per
query/hour of its peak rate. Queries, clicks, dwell, carts, purchases and their delays
come from `traffic.Simulator` (see there), `Regression`s at offsets from the start.

`History.until(t_ms)` yields every event whose time has come by `t_ms`, in event-time
order (impressions and their later feedback merged with a heap), so a caller can go one
minute of event time at a time; iterating the history yields it all, ending with the
feedback of the last queries (up to the attribution window after `end_ms`).

Disorder, on purpose and bounded: a share `disorder` of events (default 1%) is delivered
up to `MAX_DISORDER_MS` (5 s) after its timestamp, so it may follow later-stamped events,
as a producer's retry or a slow partition does. `disorder=0` gives strict event-time
order. Every event's timestamp is at most the `until` bound it was delivered under.
"""

from __future__ import annotations

import heapq
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TextIO

import numpy as np

from rankmeter.config import duration_ms
from rankmeter.simulator.bm25 import Ranker
from rankmeter.simulator.regressions import Regression, check_regression
from rankmeter.simulator.traffic import ATTRIBUTION_S, DEFAULT_RANKERS, Event, Simulator
from rankmeter.simulator.truth import TRUTH_MEASURES, TruthPoint
from rankmeter.simulator.users import Users

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
MINUTE_MS = 60_000
TROUGH, TROUGH_HOUR, PEAK_HOUR = 0.25, 4.0, 20.0
WEEKEND = 0.8
MAX_DISORDER_MS = 5_000


def daily(hour: float) -> float:
    """Share of the peak rate at `hour` (0–24, UTC): 1 at 20:00, TROUGH at 04:00, a half
    cosine up over the 16 hours between and down over the 8 after (smooth at both ends)."""
    since_trough = (hour - TROUGH_HOUR) % 24
    rise = (PEAK_HOUR - TROUGH_HOUR) % 24
    phase = since_trough / rise if since_trough <= rise else 1 - (since_trough - rise) / (24 - rise)
    return TROUGH + (1 - TROUGH) * (1 - math.cos(math.pi * phase)) / 2


def weekly(weekday: int) -> float:
    """Share of a weekday's traffic on `weekday` (Monday 0 … Sunday 6)."""
    return WEEKEND if weekday >= 5 else 1.0


def rate_per_hour(peak_per_hour: float, t_ms: float) -> float:
    """Queries per hour at time `t_ms` (epoch ms, UTC) for a ranker with this peak rate."""
    hour = (t_ms % DAY_MS) / HOUR_MS
    weekday = (int(t_ms // DAY_MS) + 3) % 7  # 1970-01-01 was a Thursday
    return peak_per_hour * daily(hour) * weekly(weekday)


def arrivals(rng: np.random.Generator, peak_per_hour: float, start_ms: int, end_ms: int) -> np.ndarray:
    """Sorted query times in [start_ms, end_ms): a non-homogeneous Poisson process, per
    minute a Poisson count at the rate of the minute's middle, uniform within the minute."""
    out = []
    for t0 in range(start_ms, end_ms, MINUTE_MS):
        t1 = min(t0 + MINUTE_MS, end_ms)
        n = rng.poisson(rate_per_hour(peak_per_hour, (t0 + t1) / 2) * (t1 - t0) / HOUR_MS)
        out.append(np.sort(rng.integers(t0, t1, n)))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def resolve_rankers(names: Sequence[str]) -> dict[str, Ranker]:
    """A simulator ranker per name: `bm25-tuned` and `bm25-degraded` are themselves; any
    other name (a canary, an A/A arm) is bm25-tuned's parameters under that name."""
    known = {r.name: r for r in DEFAULT_RANKERS}
    return {n: known.get(n, known["bm25-tuned"]._replace(name=n)) for n in names}


def parse_regression(text: str) -> Regression:
    """`RANKER:KIND:SIZE@START/DURATION`, e.g. `bm25-tuned:ranking:0.3@2d14h/2h`."""
    m = re.fullmatch(r"([^:@/]+):([a-z]+):([0-9.]+)@([0-9a-z.]+)/([0-9a-z.]+)", text.strip())
    if not m:
        raise ValueError(f"{text!r} is not RANKER:KIND:SIZE@START/DURATION, e.g. bm25-tuned:ranking:0.3@2d14h/2h")
    ranker, kind, size, start, duration = m.groups()
    regression = Regression(duration_ms(start) / 1000, duration_ms(duration) / 1000, ranker, kind, float(size))
    check_regression(regression)  # its ranker is checked by the traffic it applies to
    return regression


class History:
    """Event-time traffic from `start_ms` to `end_ms` for rankers with these peak rates
    (queries per hour at the daily peak of a weekday), e.g. `{"bm25-tuned": 1000,
    "bm25-canary": 20}`; `rankers` maps a name to its simulator ranker (default
    `resolve_rankers`). Regressions start at offsets from `start_ms`."""

    def __init__(self, start_ms: int, end_ms: int, peaks: Mapping[str, float], *,
                 rankers: Mapping[str, Ranker] | None = None, regressions: Sequence[Regression] = (),
                 click_model: str = "pbm", seed: int = 7, users_per_peak: float = 10.0,
                 disorder: float = 0.01, purchase_cap_s: float = ATTRIBUTION_S,
                 run_id: str | None = None) -> None:
        if not peaks or any(not p > 0 for p in peaks.values()):
            raise ValueError("peaks: at least one ranker, each with a peak rate > 0 queries/hour")
        self.start_ms, self.end_ms = start_ms, end_ms
        self.peaks = dict(peaks)
        self.rankers = dict(rankers) if rankers is not None else resolve_rankers(list(peaks))
        self.simulator = Simulator(seed=seed, rankers=tuple(self.rankers[n] for n in self.peaks),
                                   click_model=click_model, regressions=regressions, users=1,
                                   disorder=0.0,  # the heap orders a query's events by time
                                   purchase_cap_s=purchase_cap_s, run_id=run_id, truth_log=True)
        rng = self.simulator.rng
        self.rng = rng
        self.users: dict[str, Users] = {}
        first = 0
        for name, peak in self.peaks.items():
            count = max(1, round(peak * users_per_peak))
            self.users[name] = Users(count, rng, first=first)
            first += count
        self.disorder = disorder
        self._delivery_rng = np.random.default_rng([seed, 1])  # disorder leaves the traffic as it is
        self.queries = 0
        self.events = 0
        self._next_ms = start_ms  # the start of the next minute to generate
        self._heap: list[tuple[int, int, Event]] = []  # (delivery time, sequence, event)
        self._sequence = 0

    @property
    def truth(self) -> dict[str, dict[str, float]]:
        """The true TRUTH_MEASURES per ranker over everything generated so far."""
        return self.simulator.truth.means()

    @property
    def truth_log(self) -> list[TruthPoint]:
        """Per generated query with a relevant document: its time, ranker and true measures."""
        assert self.simulator.truth_log is not None
        return self.simulator.truth_log

    def truth_between(self, ranker: str, start_ms: int, end_ms: int) -> dict[str, float]:
        """Mean true measures of `ranker`'s queries in [start_ms, end_ms) (those generated)."""
        values = [p.values for p in self.truth_log if p.ranker == ranker and start_ms <= p.timestamp_ms < end_ms]
        if not values:
            return {}
        return dict(zip(TRUTH_MEASURES, np.mean(values, axis=0).tolist()))

    def __iter__(self) -> Iterator[Event]:
        return self.until(math.inf)

    def until(self, t_ms: float) -> Iterator[Event]:
        """Every not yet delivered event due by `t_ms`, in delivery (≈ event-time) order,
        generated a minute at a time (the heap holds about an attribution window)."""
        heap = self._heap
        while True:
            # Events never precede their query: all those due before the first minute not
            # yet generated are on the heap.
            generated = self._next_ms - 1 if self._next_ms < self.end_ms else math.inf
            bound = min(t_ms, generated)
            while heap and heap[0][0] <= bound:
                yield heapq.heappop(heap)[2]
            if self._next_ms >= self.end_ms or self._next_ms > t_ms:
                return
            self._generate(self._next_ms, min(self._next_ms + MINUTE_MS, self.end_ms))
            self._next_ms += MINUTE_MS

    def _generate(self, t0: int, t1: int) -> None:
        """One minute's queries of every ranker, in time order (sessions need it)."""
        rng, sim = self.rng, self.simulator
        times: list[tuple[int, str]] = []
        for name, peak in self.peaks.items():
            times.extend((int(t), name) for t in arrivals(rng, peak, t0, t1))
        times.sort()
        for t, name in times:
            self.queries += 1
            for event in sim.answer(self.rankers[name], t, (t - self.start_ms) / 1000, self.users[name]):
                due = event.timestamp_ms
                if self.disorder and self._delivery_rng.random() < self.disorder:
                    due += int(self._delivery_rng.integers(1, MAX_DISORDER_MS))
                self._sequence += 1
                self.events += 1
                heapq.heappush(self._heap, (due, self._sequence, event))


Sender = Callable[[Event], None]  # with a `flush()` attribute


def file_sender(out: TextIO) -> Sender:
    """One JSON line per event: {"stream": ..., "key": ..., "value": {...}}."""
    def send(event: Event) -> None:
        out.write(json.dumps(event._asdict()) + "\n")

    send.flush = out.flush  # type: ignore[attr-defined]
    return send
