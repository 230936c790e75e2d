"""CUPED's pre-period by event time (pipeline/covariates.py; review F2): the table is a
function of the events' timestamps alone, never of when they are read. A query counts if
it was shown at least the attribution window plus its grace before ab.start and none of
its feedback is from the start on; such feedback takes it out for good."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankmeter.pipeline.covariates import PRE

from test_ab_pipeline import an_experiment, feed
from test_ab_cuped_pipeline import HOUR_MS, START_MS

WINDOW_MS = 35 * 60_000   # windows.attribution (30m) + windows.grace (5m), the defaults
CUPED = {"RANKMETER_AB_CUPED": "true", "RANKMETER_AB_CUPED_BUCKETS": "512"}


def stream(seed: int, queries: int = 400):
    """Queries from 3 h before the start to 5 min after, clicks and judgments up to 40 min
    after each impression (some pre-period ones after the start: late, or judgments), in a
    random order."""
    rnd = random.Random(seed)
    out = []
    for q in range(queries):
        qid, t = f"q{q}", START_MS - rnd.randrange(-300_000, 3 * HOUR_MS)
        results = [f"d{j}" for j in range(10)]
        out.append(("impressions", qid, {"query_id": qid, "ranker": rnd.choice(["base", "new"]), "timestamp": t,
                                         "results": results, "user_query": f"text {rnd.randrange(30)}"}))
        for d in rnd.sample(results, rnd.randrange(4)):
            out.append(("feedback", qid, {"query_id": qid, "action": "click", "doc_id": d,
                                          "timestamp": t + rnd.randrange(40 * 60_000)}))
        if rnd.random() < 0.3:
            out.append(("feedback", qid, {"query_id": qid, "action": "judgment", "doc_id": rnd.choice(results),
                                          "grade": rnd.randrange(4), "timestamp": t + rnd.randrange(HOUR_MS)}))
    rnd.shuffle(out)
    return out


def tables(s) -> dict[int, bytes]:
    return {p: ps.ab[PRE].tobytes() for p, ps in s.pipeline.partitions.items() if PRE in ps.ab}


@pytest.mark.parametrize("seed", [1, 2])
def test_the_table_is_the_same_bit_for_bit_however_the_events_are_batched(seed):
    events = stream(seed)
    found = []
    for batch in (100_000, 50, 7):   # one batch spanning ab.start; many small ones
        s = an_experiment(7, 0, 2, **CUPED)
        feed(s.pipeline, s.bus, events, batch=batch)
        found.append(tables(s))
    assert found[0] and any(np.frombuffer(t).any() for t in found[0].values())
    assert found[0] == found[1] == found[2]


def pre_period(seed: int, queries: int = 120):
    """Queries shown 1 to 3 hours before the start, a few clicks each soon after."""
    rnd = random.Random(seed)
    out = []
    for q in range(queries):
        qid, t = f"p{q}", START_MS - HOUR_MS - rnd.randrange(2 * HOUR_MS)
        out.append(("impressions", qid, {"query_id": qid, "ranker": "base", "timestamp": t,
                                         "results": [f"d{j}" for j in range(10)], "user_query": f"text {q % 20}"}))
        out += [("feedback", qid, {"query_id": qid, "action": "click", "doc_id": f"d{j}", "timestamp": t + 1000 * j})
                for j in range(rnd.randrange(4))]
    return out


@pytest.mark.parametrize("action", ["click", "judgment"])
def test_feedback_from_the_start_on_takes_a_query_out_for_good(action):
    """A click at start + 1 ms (late: past the attribution window) or a judgment (accepted)
    on a pre-period query: the table is then that of the stream without the query, and an
    earlier click read afterwards does not bring it back."""
    events = pre_period(3)
    out = "p5"
    rest = [e for e in events if e[1] != out]
    s = an_experiment(7, 0, 2, **CUPED)
    feed(s.pipeline, s.bus, events)
    before = tables(s)
    feed(s.pipeline, s.bus, [("feedback", out, {"query_id": out, "action": action, "doc_id": "d9", "grade": 3,
                                                "timestamp": START_MS + 1})])
    assert tables(s) != before
    shown = next(e["timestamp"] for stream_, q, e in events if q == out and stream_ == "impressions")
    feed(s.pipeline, s.bus, [("feedback", out, {"query_id": out, "action": "click", "doc_id": "d8",
                                                "timestamp": shown + 5000})])
    without = an_experiment(7, 0, 2, **CUPED)
    feed(without.pipeline, without.bus, rest)
    assert tables(s) == tables(without)


def test_a_query_shown_less_than_the_window_before_the_start_is_not_counted():
    """Shown at start − (attribution + grace): counted; 1 s later: its clicks could come
    after the start, so not (even with every click before it)."""
    def one(qid: str, t: int):
        return [("impressions", qid, {"query_id": qid, "ranker": "base", "timestamp": t,
                                      "results": ["d0", "d1"], "user_query": "some text"}),
                ("feedback", qid, {"query_id": qid, "action": "click", "doc_id": "d0", "timestamp": t + 500})]

    s = an_experiment(7, 0, 1, **CUPED)
    feed(s.pipeline, s.bus, one("early", START_MS - WINDOW_MS) + one("close", START_MS - WINDOW_MS + 1000))
    table = np.frombuffer(s.pipeline.partitions[0].ab[PRE]).reshape(512, -1, 2)
    assert table[..., 0].max() == 1 and table[..., 0].sum() == table.shape[1]   # one query, every measure


def test_a_record_of_an_earlier_release_decodes_with_no_feedback_time():
    """QueryRecord.feedback_ms and pre_user_contribution are new trailing fields: a record
    stored without them (an earlier release's) decodes, with their defaults."""
    import msgspec

    from rankmeter.join import QueryRecord

    record = QueryRecord(ranker_label="base", pre_contribution=b"x" * 16, feedback_ms=5, pre_user_contribution=b"y")
    older = msgspec.msgpack.encode(msgspec.msgpack.decode(msgspec.msgpack.encode(record))[:-2])
    decoded = msgspec.msgpack.decode(older, type=QueryRecord)
    assert decoded.pre_contribution == b"x" * 16 and decoded.feedback_ms == 0 and decoded.pre_user_contribution == b""


def loop_sums(means, pooled, keys, columns, values):
    """The covariate sums one query and measure at a time (the loop `covariate_sums` replaced)."""
    out = np.zeros((len(keys), len(columns), 3))
    for i, b in enumerate(keys):
        for k, c in enumerate(columns):
            if c is None or np.isnan(values[i, c]):
                continue
            x = means[b, c] if b >= 0 else pooled[c]
            if not np.isfinite(x * x * values[i, c]):
                continue
            out[i, k] = (x, x * x, x * values[i, c])
    return out


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), queries=st.integers(0, 30), buckets=st.integers(1, 8),
       measures=st.integers(1, 5), huge=st.booleans())
def test_the_vectorised_covariate_sums_equal_the_loop(seed, queries, buckets, measures, huge):
    from rankmeter.pipeline.covariates import covariate_sums

    rng = np.random.default_rng(seed)
    means = rng.normal(size=(buckets, measures)) * (1e160 if huge else 1.0)   # (x²y past floats: left out)
    pooled = rng.normal(size=measures)
    keys = rng.integers(-1, buckets, size=queries)
    values = np.where(rng.random((queries, measures)) < 0.3, np.nan, rng.normal(size=(queries, measures)))
    columns = [None if rng.random() < 0.2 else int(rng.integers(measures)) for _ in range(measures + 1)]
    with np.errstate(over="ignore", invalid="ignore"):
        want = loop_sums(means, pooled, keys, columns, values)
    assert np.array_equal(covariate_sums(means, pooled, keys, columns, values), want)
