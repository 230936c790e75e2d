"""The simulator's traffic shape and history mode: daily and weekly cycles, users and
sessions, click models, feedback delays, regressions, event-time order (issue 8).

Statistical checks use tolerances from the sampling noise they face (Poisson counts,
binomial shares, standard errors of means), at about four standard errors: with fixed
seeds they are deterministic, and a true bug moves them far further than that."""

import json
import math
import subprocess
from collections import defaultdict

import numpy as np
import pytest

from rankmeter import config
from rankmeter.config import duration_ms
from rankmeter.cli import parser
from rankmeter.events import Decoder, Rejected
from rankmeter.simulator.bm25 import Ranker
from rankmeter.simulator.clicks import CONTINUE, EXAMINE, cascade, dcm, pbm
from rankmeter.simulator.corpus import Corpus
from rankmeter.simulator.history import (DAY_MS, HOUR_MS, MAX_DISORDER_MS, MINUTE_MS, History, arrivals,
                                         daily, parse_regression, rate_per_hour, resolve_rankers,
                                         weekly)
from rankmeter.simulator.regressions import Regression
from rankmeter.simulator.traffic import DEFAULT_RANKERS, FIRST_CLICK_DELAY, Event, Simulator
from rankmeter.simulator.users import SESSION_GAP_MS, Users
from test_eval_cli import RANKMETER

MONDAY = 1_795_392_000_000  # 2026-11-23T00:00:00Z, a Monday
Z = 4.0                     # standard errors allowed
TUNED = DEFAULT_RANKERS[0]


def feedback_of(events: list[Event], action: str) -> list[dict]:
    """Feedback values of one action, a producer's retry (same event id) counted once."""
    seen: dict[str, dict] = {}
    for e in events:
        if e.stream == "feedback" and e.value["action"] == action:
            seen.setdefault(e.value["event_id"], e.value)
    return list(seen.values())


def clicks_per_query(events: list[Event]) -> np.ndarray:
    counts = {e.key: 0 for e in events if e.stream == "impressions"}
    for c in feedback_of(events, "click"):
        counts[c["query_id"]] += 1
    return np.array(list(counts.values()))


def live(sim: Simulator, queries: int, elapsed_s: float = 0.0, ranker: Ranker = TUNED,
         start_ms: int = MONDAY) -> list[Event]:
    return [e for i in range(queries) for e in sim.answer(ranker, start_ms + i * 1000, elapsed_s)]


# ---- traffic shape -----------------------------------------------------------------

def test_daily_curve_has_its_trough_at_four_and_its_peak_at_eight_pm():
    hours = np.arange(0, 24, 0.01)
    values = np.array([daily(h) for h in hours])
    assert daily(4) == pytest.approx(0.25) and daily(20) == pytest.approx(1.0)
    assert hours[values.argmin()] == pytest.approx(4.0) and hours[values.argmax()] == pytest.approx(20.0)
    assert values.min() == pytest.approx(0.25) and values.max() == pytest.approx(1.0)
    assert np.abs(np.diff(values)).max() < 0.01  # smooth: no jump anywhere, midnight included
    assert [weekly(d) for d in range(7)] == [1, 1, 1, 1, 1, 0.8, 0.8]
    assert rate_per_hour(1000, MONDAY + 20 * HOUR_MS) == pytest.approx(1000)
    assert rate_per_hour(1000, MONDAY + 5 * DAY_MS + 20 * HOUR_MS) == pytest.approx(800)  # Saturday


def ratio_within_poisson_noise(a: int, b: int, expected: float) -> None:
    """a/b against `expected`, a and b independent Poisson counts."""
    ratio = a / b
    assert abs(ratio - expected) < Z * ratio * math.sqrt(1 / a + 1 / b), (a, b, ratio, expected)


def test_generated_counts_follow_the_daily_and_weekly_cycles():
    rng = np.random.default_rng(1)
    times = arrivals(rng, 3000, MONDAY, MONDAY + 14 * DAY_MS)
    assert np.all(np.diff(times) >= 0) and times[0] >= MONDAY and times[-1] < MONDAY + 14 * DAY_MS
    day, hour = (times - MONDAY) // DAY_MS, ((times - MONDAY) % DAY_MS) // HOUR_MS
    weekday = day % 7 < 5
    # The hours around the trough (04:00) and the peak (20:00) on weekdays.
    trough = int(np.sum(weekday & ((hour == 3) | (hour == 4))))
    peak = int(np.sum(weekday & ((hour == 19) | (hour == 20))))
    mean_daily = lambda h0: np.mean([daily(h0 + (m + 0.5) / 60) for m in range(120)])  # noqa: E731
    expected = mean_daily(3) / mean_daily(19)
    assert abs(expected - 0.25) < 0.03  # two hours around the extremes: close to the curve's 25%
    ratio_within_poisson_noise(trough, peak, expected)
    # Weekend days against weekdays: 0.8.
    per_day = np.bincount(day, minlength=14)
    weekend_days = [d for d in range(14) if d % 7 >= 5]
    weekdays = [d for d in range(14) if d % 7 < 5]
    ratio_within_poisson_noise(int(per_day[weekend_days].sum()) * len(weekdays),
                               int(per_day[weekdays].sum()) * len(weekend_days), 0.8)
    # And the total is the integrated rate.
    expected_total = sum(rate_per_hour(3000, t + MINUTE_MS / 2) / 60 for t in range(MONDAY, MONDAY + 14 * DAY_MS,
                                                                                       MINUTE_MS))
    assert abs(len(times) - expected_total) < Z * math.sqrt(expected_total)


def test_each_ranker_gets_its_own_rate_and_users():
    history = History(MONDAY, MONDAY + DAY_MS, {"bm25-tuned": 300, "bm25-canary": 30}, seed=2, run_id="t")
    events = list(history)
    assert history.rankers == resolve_rankers(["bm25-tuned", "bm25-canary"])
    assert history.rankers["bm25-canary"] == TUNED._replace(name="bm25-canary")  # an alias: same parameters
    impressions = [e.value for e in events if e.stream == "impressions"]
    for name, peak in history.peaks.items():
        count = sum(1 for i in impressions if i["ranker"] == name)
        expected = sum(rate_per_hour(peak, t + MINUTE_MS / 2) / 60 for t in range(MONDAY, MONDAY + DAY_MS, MINUTE_MS))
        assert abs(count - expected) < Z * math.sqrt(expected), (name, count, expected)
    users = {name: {i["client_id"] for i in impressions if i["ranker"] == name} for name in history.peaks}
    assert not users["bm25-tuned"] & users["bm25-canary"]  # an A/B arm keeps its users


# ---- users and sessions --------------------------------------------------------------

def test_users_have_skewed_activity():
    users = Users(1000, np.random.default_rng(3))
    rng = np.random.default_rng(4)
    counts = defaultdict(int)
    for i in range(100_000):
        counts[users.visit(rng, i)[0]] += 1
    top = sorted(counts.values(), reverse=True)
    # A lognormal(σ 1.5) population: the busiest 1% make about 20% of the queries.
    assert sum(top[:10]) / 100_000 > 0.1
    assert len(counts) > 900  # and most users come at least once


def test_every_event_carries_its_user_and_sessions_split_after_30_minutes():
    # Few users, so that each comes back after gaps both shorter and longer than 30 minutes.
    history = History(MONDAY, MONDAY + DAY_MS, {"bm25-tuned": 20}, seed=5, users_per_peak=1, run_id="t")
    events = list(history)
    impressions = {e.key: e.value for e in events if e.stream == "impressions"}
    for e in events:
        assert e.value["client_id"] and e.value["session_id"]
        query = impressions[e.key]
        assert (e.value["client_id"], e.value["session_id"]) == (query["client_id"], query["session_id"])
    by_client = defaultdict(list)
    for q in impressions.values():
        by_client[q["client_id"]].append((q["timestamp"], q["session_id"]))
    same = new = 0
    sessions_seen: dict[str, str] = {}
    for client, queries in by_client.items():
        queries.sort()
        for (t0, s0), (t1, s1) in zip(queries, queries[1:]):
            if t1 - t0 < SESSION_GAP_MS:
                assert s1 == s0, (client, t0, t1)
                same += 1
            else:
                assert s1 != s0, (client, t0, t1)
                new += 1
        for _, s in queries:
            assert sessions_seen.setdefault(s, client) == client  # a session belongs to one user
    assert same > 50 and new > 50


# ---- click models ----------------------------------------------------------------------

def test_click_models_on_a_fixed_list_match_their_formulas():
    attractive = [0.6, 0.3, 0.5, 0.1, 0.8]
    rng = np.random.default_rng(6)
    n = 40_000

    def first_click_share(model) -> np.ndarray:
        firsts = np.zeros(len(attractive))
        for _ in range(n):
            clicks = model(attractive, rng)
            if clicks:
                firsts[clicks[0]] += 1
        return firsts / n

    def close(observed: np.ndarray, expected: np.ndarray) -> None:
        se = np.sqrt(expected * (1 - expected) / n)
        assert np.all(np.abs(observed - expected) < Z * se + 1e-12), (observed, expected)

    # Cascade and DCM: the first click is at r with P = a_r · Π_{j<r} (1 − a_j).
    not_before = np.concatenate([[1.0], np.cumprod([1 - a for a in attractive])[:-1]])
    close(first_click_share(cascade), np.array(attractive) * not_before)
    close(first_click_share(dcm), np.array(attractive) * not_before)
    # PBM: each rank independently with P = a_r · examine(r).
    counts = np.zeros(len(attractive))
    for _ in range(n):
        for r in pbm(attractive, rng):
            counts[r] += 1
    close(counts / n, np.array(attractive) * EXAMINE[:len(attractive)])
    # DCM after a click at rank 1 of a list of sure clicks: on to rank 2 with P = λ_1.
    twice = sum(len(dcm([1.0, 1.0], rng)) == 2 for _ in range(n)) / n
    assert abs(twice - CONTINUE[0]) < Z * math.sqrt(CONTINUE[0] * (1 - CONTINUE[0]) / n)
    for _ in range(100):  # sure clicks: top-down from rank 1 until the user stops
        c = dcm([1.0] * 5, rng)
        assert c == list(range(len(c)))
    assert cascade([0.0] * 10, rng) == [] and pbm([0.0] * 10, rng) == [] and dcm([0.0] * 10, rng) == []


def test_cascade_clicks_once_pbm_more_dcm_in_between():
    stats = {}
    for model in ("pbm", "cascade", "dcm"):
        counts = clicks_per_query(live(Simulator(seed=7, click_model=model, run_id="t"), 3000))
        stats[model] = (counts.mean(), (counts >= 2).mean(), counts.std() / math.sqrt(len(counts)))
    assert stats["cascade"][1] == 0  # never two clicks on one query
    assert stats["pbm"][1] > stats["dcm"][1] > 0.1
    (pbm_mean, _, pbm_se), (dcm_mean, _, dcm_se), (cascade_mean, _, cascade_se) = \
        stats["pbm"], stats["dcm"], stats["cascade"]
    assert cascade_mean + Z * math.hypot(cascade_se, dcm_se) < dcm_mean
    assert dcm_mean + Z * math.hypot(dcm_se, pbm_se) < pbm_mean
    with pytest.raises(ValueError):
        Simulator(seed=1, click_model="ubm")


# ---- feedback delays -------------------------------------------------------------------

def test_clicks_come_within_seconds_and_purchases_within_the_cap():
    sim = Simulator(seed=8, run_id="t", purchase_cap_s=600)
    events = live(sim, 4000)
    shown = {e.key: e.value["timestamp"] for e in events if e.stream == "impressions"}
    clicks = feedback_of(events, "click")
    by_query = defaultdict(list)
    for c in clicks:
        by_query[c["query_id"]].append(c)
    first = np.array([min(c["timestamp"] for c in cs) - shown[q] for q, cs in by_query.items()]) / 1000
    # Lognormal, median 4 s, σ 1: 82% within 10 s, a long tail beyond.
    median, sigma = FIRST_CLICK_DELAY
    within = (first <= 10).mean()
    expected = 0.5 * (1 + math.erf(math.log(10 / median) / sigma / math.sqrt(2)))
    assert abs(within - expected) < Z * math.sqrt(expected * (1 - expected) / len(first))
    assert within > 0.75 and first.max() > 30
    # A later click comes after the previous click's dwell.
    for cs in by_query.values():
        cs.sort(key=lambda c: int(c["event_id"].rsplit(".", 1)[1]))  # in the order clicked
        for a, b in zip(cs, cs[1:]):
            assert b["timestamp"] >= a["timestamp"] + a["dwell_ms"] or b["timestamp"] == shown[a["query_id"]] + 599_999
    carts = feedback_of(events, "add_to_cart")
    clicked = {(c["query_id"], c["doc_id"]): c for c in clicks}
    for cart in carts:
        click = clicked[(cart["query_id"], cart["doc_id"])]
        assert cart["timestamp"] == min(click["timestamp"] + click["dwell_ms"], shown[cart["query_id"]] + 599_999)
    purchases = feedback_of(events, "purchase")
    after = np.array([p["timestamp"] - shown[p["query_id"]] for p in purchases])
    assert len(purchases) > 100
    assert after.max() == 600_000 - 1  # capped: some would have come later
    assert np.median(after) > 120_000  # minutes, not seconds
    # The default cap is the attribution window, 30 minutes.
    events = live(Simulator(seed=9, run_id="t"), 3000)
    shown = {e.key: e.value["timestamp"] for e in events if e.stream == "impressions"}
    assert all(e.value["timestamp"] - shown[e.key] < 1_800_000 for e in events if e.stream == "feedback")


# ---- regressions -----------------------------------------------------------------------

def mean_and_se(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values)
    return float(a.mean()), float(a.std(ddof=1) / math.sqrt(len(a)))


def test_ranking_regression_lowers_true_ndcg_of_its_ranker_only_during_its_interval():
    start, end = MONDAY + 18 * HOUR_MS, MONDAY + 30 * HOUR_MS  # evening to night
    regression = Regression(4 * 3600, 3 * 3600, "bm25-tuned", "ranking", 0.5)
    history = History(start, end, {"bm25-tuned": 1000, "bm25-canary": 500}, regressions=[regression],
                      seed=10, run_id="t")
    for _ in history:
        pass
    a, b = start + 4 * HOUR_MS, start + 7 * HOUR_MS

    def ndcg(ranker: str, inside: bool) -> tuple[float, float]:
        return mean_and_se([p.values[0] for p in history.truth_log
                            if p.ranker == ranker and (a <= p.timestamp_ms < b) == inside])

    (t_in, t_in_se), (t_out, t_out_se) = ndcg("bm25-tuned", True), ndcg("bm25-tuned", False)
    (c_in, c_in_se), (c_out, c_out_se) = ndcg("bm25-canary", True), ndcg("bm25-canary", False)
    # Half of bm25-tuned's lists degraded (true nDCG@10 about 0.25 instead of 0.94): about 0.35 lower.
    drop = t_out - t_in
    assert abs(drop - 0.5 * (t_out - 0.25)) < 0.05 + Z * math.hypot(t_in_se, t_out_se)
    assert abs(c_out - c_in) < Z * math.hypot(c_in_se, c_out_se)  # the canary is untouched
    assert abs(c_out - t_out) < Z * math.hypot(c_out_se, t_out_se)  # and an alias of bm25-tuned
    # Only during the interval: the hours before and after look alike.
    before = mean_and_se([p.values[0] for p in history.truth_log if p.ranker == "bm25-tuned" and p.timestamp_ms < a])
    after = mean_and_se([p.values[0] for p in history.truth_log if p.ranker == "bm25-tuned" and p.timestamp_ms >= b])
    assert abs(before[0] - after[0]) < Z * math.hypot(before[1], after[1])
    assert history.truth_between("bm25-tuned", a, b)["nDCG@10"] == pytest.approx(t_in)


def test_clicks_regression_lowers_clicks_by_its_size_and_leaves_the_ranking_alone():
    size = 0.4
    regression = Regression(100, 100, "bm25-tuned", "clicks", size)
    corpus = Corpus(seed=7)

    def traffic(seed: int, elapsed_s: float, ranker: Ranker = TUNED, queries: int = 4000) -> list[Event]:
        return live(Simulator(seed=seed, corpus=corpus, regressions=[regression], run_id="t"), queries,
                    elapsed_s, ranker)

    normal, during, after = traffic(11, 50), traffic(12, 150), traffic(13, 250)
    (n_mean, n_se), (d_mean, d_se), (a_mean, a_se) = (mean_and_se(clicks_per_query(e).tolist())
                                                      for e in (normal, during, after))
    # PBM: every click's probability times 1 − size, so the expected clicks too.
    ratio = d_mean / n_mean
    ratio_se = ratio * math.hypot(n_se / n_mean, d_se / d_mean)
    assert abs(ratio - (1 - size)) < Z * ratio_se
    assert abs(a_mean - n_mean) < Z * math.hypot(a_se, n_se)
    lists = lambda events: {e.value["user_query"]: e.value["results"] for e in events if e.stream == "impressions"}  # noqa: E731
    normal_lists, during_lists = lists(normal), lists(during)
    common = normal_lists.keys() & during_lists.keys()
    assert len(common) > 50 and all(normal_lists[q] == during_lists[q] for q in common)
    # The other ranker is not affected.
    degraded = DEFAULT_RANKERS[1]
    other_n = clicks_per_query(traffic(14, 50, degraded, 3000))
    other_d = clicks_per_query(traffic(15, 150, degraded, 3000))
    assert abs(other_n.mean() - other_d.mean()) < Z * math.hypot(*(c.std() / math.sqrt(len(c)) for c in (other_n, other_d)))


def test_regression_at_is_a_ranking_regression_of_the_first_ranker_from_then_on():
    sim = Simulator(seed=1, regression_at=30)
    assert sim.regressions == [Regression(30, math.inf, "bm25-tuned", "ranking", 1.0)]
    with pytest.raises(ValueError, match="ranker 'nope'"):
        Simulator(seed=1, regressions=[Regression(0, 10, "nope")])
    with pytest.raises(ValueError):
        History(MONDAY, MONDAY + HOUR_MS, {"bm25-tuned": 10}, regressions=[Regression(0, 10, "bm25-degraded")])


# ---- event-time order, chunks, determinism, decoding ----------------------------------

def test_history_is_in_event_time_order_and_goes_minute_by_minute():
    span = (MONDAY + 19 * HOUR_MS, MONDAY + 22 * HOUR_MS)
    strict = list(History(*span, {"bm25-tuned": 1000}, seed=16, disorder=0.0, run_id="t"))
    stamps = [e.timestamp_ms for e in strict]
    assert stamps == sorted(stamps)
    assert stamps[-1] > span[1]  # the last queries' feedback, after the end

    history = History(*span, {"bm25-tuned": 1000}, seed=16, run_id="t")
    chunked: list[Event] = []
    for t in range(span[0], span[1] + 2 * HOUR_MS, MINUTE_MS):
        chunk = list(history.until(t))
        assert all(e.timestamp_ms <= t for e in chunk)
        chunked += chunk
    assert not list(history.until(math.inf))  # nothing was left behind
    assert len(chunked) == len(strict)
    assert sorted(map(repr, chunked)) == sorted(map(repr, strict))  # the same events, only delivered later
    # A little disorder, bounded: an event is at most MAX_DISORDER_MS behind one delivered before it.
    latest, late = 0, 0
    for e in chunked:
        if e.timestamp_ms < latest:
            late += 1
            assert latest - e.timestamp_ms < MAX_DISORDER_MS
        latest = max(latest, e.timestamp_ms)
    assert 0 < late < 0.03 * len(chunked)
    assert list(History(*span, {"bm25-tuned": 1000}, seed=16, run_id="t")) == chunked  # chunks change nothing


def test_same_seed_same_history():
    span = (MONDAY, MONDAY + 3 * HOUR_MS)
    one = list(History(*span, {"bm25-tuned": 500, "bm25-degraded": 500}, seed=17, run_id="t", click_model="dcm"))
    two = list(History(*span, {"bm25-tuned": 500, "bm25-degraded": 500}, seed=17, run_id="t", click_model="dcm"))
    other = list(History(*span, {"bm25-tuned": 500, "bm25-degraded": 500}, seed=18, run_id="t", click_model="dcm"))
    assert one == two and one != other


@pytest.mark.parametrize("model", ["pbm", "cascade", "dcm"])
def test_history_events_pass_the_decoder(model):
    decoder = Decoder(config.load(None, {}))
    end = MONDAY + 7 * DAY_MS
    history = History(end - 6 * HOUR_MS, end, {"bm25-tuned": 300, "bm25-degraded": 300}, seed=19,
                      click_model=model, regressions=[Regression(3600, 3600, "bm25-degraded", "clicks", 0.5)])
    events = list(history)
    assert {e.value.get("action") for e in events} >= {None, "click", "add_to_cart", "purchase", "judgment"}
    for e in events:
        data = json.dumps(e.value).encode()
        decoded = (decoder.impression if e.stream == "impressions" else decoder.feedback)(data, end)
        assert not isinstance(decoded, Rejected), (e, decoded)
        assert decoded.query_id == e.key and decoded.timestamp_ms == e.timestamp_ms


# ---- the command line ------------------------------------------------------------------

def test_spans_and_regressions_parse():
    assert duration_ms("7d") == 7 * DAY_MS and duration_ms("2d14h") == 62 * HOUR_MS and duration_ms("90s") == 90_000
    assert duration_ms("1h30m") == 90 * MINUTE_MS and duration_ms("500ms") == 500
    for bad in ("", "7", "7x", "d", "1h 30m", "-1h"):
        with pytest.raises(ValueError):
            duration_ms(bad)
    assert parse_regression("bm25-tuned:ranking:0.3@2d14h/2h") == Regression(62 * 3600, 7200, "bm25-tuned",
                                                                             "ranking", 0.3)
    assert parse_regression("bm25-canary:clicks:1@0s/30m") == Regression(0, 1800, "bm25-canary", "clicks", 1.0)
    args = parser().parse_args(["simulate", "--history", "7d", "--peak", "bm25-tuned=1000", "--peak",
                                 "bm25-canary=20", "--regression", "bm25-tuned:ranking:0.3@2d14h/2h",
                                 "--click-model", "dcm"])
    assert args.history == 7 * DAY_MS and args.peak == [("bm25-tuned", 1000.0), ("bm25-canary", 20.0)]
    assert args.regression == [Regression(62 * 3600, 7200, "bm25-tuned", "ranking", 0.3)]
    assert args.click_model == "dcm"
    live_args = parser().parse_args(["simulate"])
    assert (live_args.history, live_args.peak, live_args.regression, live_args.click_model) == (None, [], [], "pbm")
    for bad in (["--history", "7x"], ["--history", "0d"], ["--peak", "a"], ["--peak", "a=0"], ["--peak", "=3"],
                ["--regression", "bm25-tuned:ranking:0.3"], ["--regression", "bm25-tuned:rank:0.3@1h/1h"],
                ["--regression", "bm25-tuned:clicks:1.5@1h/1h"], ["--regression", "bm25-tuned:clicks:0.5@1h/0s"],
                ["--click-model", "ubm"]):
        with pytest.raises(SystemExit):
            parser().parse_args(["simulate", *bad])


def test_simulate_history_to_a_file(tmp_path):
    out = tmp_path / "events.jsonl"
    run = subprocess.run([RANKMETER, "simulate", "--history", "2h", "--peak", "bm25-tuned=600", "--peak",
                          "bm25-canary=60", "--regression", "bm25-canary:clicks:0.5@30m/1h", "--click-model",
                          "cascade", "--output", str(out), "--truth"],
                         capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["events"] == len(lines) > 100 and set(summary["truth"]) == {"bm25-tuned", "bm25-canary"}
    assert {line["value"]["ranker"] for line in lines if line["stream"] == "impressions"} == {"bm25-tuned",
                                                                                            "bm25-canary"}
    bad = subprocess.run([RANKMETER, "simulate", "--history", "2h", "--regression", "nope:clicks:0.5@30m/1h"],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "rankmeter simulate: error: regression of ranker 'nope': one of bm25-tuned, bm25-degraded"]


def test_users_click_with_a_propensity_of_their_own():
    sim = Simulator(seed=4, users=300)
    clicks: dict[str, list[float]] = defaultdict(list)
    for i in range(12_000):
        events = sim.answer(sim.rankers[0], 1_800_000_000_000 + i * 1000, 0.0)
        client = events[0].value["client_id"]
        clicks[client].append(sum(e.value.get("action") == "click" for e in events))
    propensity = {c: sim.users.propensity[int(c[1:])] for c in clicks}
    high = [n for c, ns in clicks.items() if propensity[c] >= 1.25 for n in ns]
    low = [n for c, ns in clicks.items() if propensity[c] <= 0.8 for n in ns]
    (h, h_se), (l, l_se) = mean_and_se(high), mean_and_se(low)
    assert h - l > Z * math.hypot(h_se, l_se)  # the same traffic, clicked more by keener users
    assert np.mean(sim.users.propensity) == pytest.approx(1.0, abs=Z * 0.3 / math.sqrt(300))
