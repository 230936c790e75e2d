"""An experiment by user (`ab.unit: user`) on the pipeline: each arm's sums per user
bucket, impressions without a client_id counted and left out, a client_id over the
length limit refused like any other field (the statistics against statsmodels are in
tests/integration/test_ab_users.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rankmeter import config
from rankmeter.ab import clusters, hll
from rankmeter.ab.users import srm_users_p_value
from rankmeter.events import Decoder, Rejected
from rankmeter.events.rules import MAX_ID
from rankmeter.source import Bus
from rankmeter.store import MemoryStore

from test_ab_pipeline import ENV, NOW_MS, START_MS, experiment_stream, feed, started


def by_user(events, anonymous_every: int = 10):
    """The stream with a client_id per impression (users with several queries), every
    `anonymous_every`-th without one."""
    out = []
    for n, (stream, key, event) in enumerate(events):
        if stream == "impressions" and n % anonymous_every:
            event = {**event, "client_id": f"user{int(key[1:]) // 3}"}
        out.append((stream, key, event))
    return out


def test_an_experiment_by_user_keeps_each_arm_per_user_bucket():
    settings = config.load(None, {**ENV, "RANKMETER_AB_START": str(START_MS), "RANKMETER_AB_UNIT": "user"})
    events = by_user(experiment_stream(3, 600, START_MS)[0])
    store, bus = MemoryStore(), Bus(partitions=2)
    pipeline = started(settings, store, bus)
    feed(pipeline, bus, events)
    look = pipeline.ab_look()
    shown = [e for stream, _, e in events if stream == "impressions" and e["timestamp"] >= START_MS]
    missing = sum("client_id" not in e for e in shown)
    assert missing > 0 and pipeline.experiments.units_missing == missing
    assert sum(a.queries for a in look.arms) == len(shown) - missing
    # Every stored field names its user bucket; each user's queries are in one bucket.
    fields = [f for p in store.ab.values() for f in p if f.startswith(look.experiment)]
    buckets = {int(f.rsplit("\x1f", 1)[1]) for f in fields}
    users = {e["client_id"] for e in shown if "client_id" in e}
    assert fields and all(f.count("\x1f") == 3 for f in fields)
    assert buckets == {clusters.bucket_of(u) for u in users}
    assert look.unit == "user" and "@user@" in look.experiment


@pytest.mark.parametrize("per_user, compared", [(60, False), (3, True)])
def test_a_comparison_by_user_waits_for_enough_users_in_each_arm(per_user, compared):
    # 600 queries: 10 users of 60 queries each (each arm's cluster-robust variance from
    # about 5 users: far too small too often), or 200 users of 3.
    settings = config.load(None, {**ENV, "RANKMETER_AB_START": str(START_MS), "RANKMETER_AB_UNIT": "user"})
    events = [(stream, key, {**e, "client_id": f"user{int(key[1:]) // per_user}"} if stream == "impressions" else e)
              for stream, key, e in experiment_stream(3, 600, START_MS)[0]]
    store, bus = MemoryStore(), Bus(partitions=2)
    pipeline = started(settings, store, bus)
    feed(pipeline, bus, events)
    look = pipeline.ab_look()
    assert min(a.queries for a in look.arms) >= settings.ab.min_queries  # the query guard passes either way
    assert bool(look.comparisons) == compared


def test_a_client_id_of_any_length_is_kept_as_its_bucket_and_none_is_no_user():
    # The id is hashed and dropped (never a key, label or log): a long one (a JWT, 800
    # characters) must not cost the impression, as a limit did for every configuration.
    decoder = Decoder(config.load(None, {"RANKMETER_AB_UNIT": "user"}))
    event = {"query_id": "q", "ranker": "a", "timestamp": NOW_MS, "results": ["d"]}
    assert Decoder(config.load(None, {})).impression(json.dumps({**event, "client_id": "u"}).encode(),
                                                     NOW_MS).user_bucket == -1  # not by user: no hash
    for client in ("u42", "u" * (MAX_ID + 1), "e" * 800, "ü\u00a0x"):
        kept = decoder.impression(json.dumps({**event, "client_id": client}).encode(), NOW_MS)
        assert not isinstance(kept, Rejected) and kept.user_bucket == clusters.bucket_of(client), client
    assert decoder.impression(json.dumps(event).encode(), NOW_MS).user_bucket == -1
    assert decoder.impression(json.dumps({**event, "client_id": ""}).encode(), NOW_MS).user_bucket == -1


def test_the_unit_is_required_with_a_baseline():
    with pytest.raises(config.ConfigError, match="ab.unit: required with ab.baseline"):
        config.load(None, {**{k: v for k, v in ENV.items() if k != "RANKMETER_AB_UNIT"},
                           "RANKMETER_AB_START": str(START_MS)})
    np.testing.assert_equal(config.load(None, {**ENV, "RANKMETER_AB_START": str(START_MS)}).ab.unit, "query")


def test_a_stored_bucket_or_start_that_is_not_the_canonical_decimal_is_unreadable_not_a_crash():
    # str.isdigit() holds for "²" (int() refuses it: it crashed every claim and look) and
    # "١٢" (int() reads 12: a field the service never writes, mixed into bucket 12).
    from rankmeter.pipeline.experiments import ab_problem
    sums = np.zeros(4).tobytes()
    assert ab_problem("e\x1fbm25\x1f\x1f12", sums) is None
    for bucket in ("²", "١٢", "007", "128", "-1", "x", ""):
        assert ab_problem(f"e\x1fbm25\x1f\x1f{bucket}", sums) is not None, bucket
    counts = np.zeros(3).tobytes()
    assert ab_problem("il\x1fe\x1fa\x1fb\x1f1800000000000", counts) is None
    assert ab_problem("il\x1fe\x1fa\x1fb\x1f18²", counts) is not None
    # Over 4,300 digits int() raises instead of converting: refused by length first.
    assert ab_problem("e\x1fbm25\x1f\x1f" + "1" * 5000, sums) is not None
    assert ab_problem("il\x1fe\x1fa\x1fb\x1f" + "1" * 5000, counts) is not None


def test_a_slow_look_is_spaced_so_looks_take_a_tenth_of_the_consuming_thread(caplog):
    # With ab.unit: user a look reads 128 fields per arm, segment and partition: at scale it
    # takes seconds, on the thread that consumes.
    from rankmeter.serve import AB_INTERVAL_S, AB_MAX_INTERVAL_S, _next_look_interval
    assert _next_look_interval(0.01, AB_INTERVAL_S) == AB_INTERVAL_S
    assert _next_look_interval(2.0, AB_INTERVAL_S) == pytest.approx(20.0)
    assert [r.getMessage() for r in caplog.records] == ["the experiment's look is slow: looking less often"]
    assert _next_look_interval(2.1, 20.0) == pytest.approx(21.0)  # no new line for a small change
    assert _next_look_interval(0.1, 21.0) == AB_INTERVAL_S and len(caplog.records) == 1
    assert _next_look_interval(30.0, AB_INTERVAL_S) == AB_MAX_INTERVAL_S  # a look a minute at least


def test_a_look_by_user_equals_statsmodels_cluster_robust_variance_over_the_buckets():
    # Every statistic through the pipeline by user, against an independent computation from
    # the stream: P@10 per query from its clicks, the arms' variances statsmodels' CRV1 over
    # the user buckets, never below the null's (both arms pooled), the SRM of the buckets'
    # query counts. (Swapped arms, per-query statistics, Σx² for Σx, judged counts for the
    # SRM: each fails here.)
    import statsmodels.api as sm

    from rankmeter.engine import QueryState, parse, stack

    settings = config.load(None, {**ENV, "RANKMETER_AB_START": str(START_MS), "RANKMETER_AB_UNIT": "user"})
    stream, truth = experiment_stream(8, 1200, START_MS)
    user = {q: f"user{int(q[1:]) // 4}" for q in truth}
    arm = {q: "new" if int(q[1:]) // 4 % 3 == 0 else "base" for q in truth}  # sticky, about 1/3 new
    events = [(s, k, {**e, "client_id": user[k], "ranker": arm[k]} if s == "impressions" else e) for s, k, e in stream]
    store, bus = MemoryStore(), Bus(partitions=3)
    pipeline = started(settings, store, bus)
    feed(pipeline, bus, events)
    look = pipeline.ab_look()

    p10 = parse("P@10")
    shown = [q for q, (_, t, _, _) in truth.items() if t >= START_MS]
    values = p10.values(p10.compute(stack([QueryState.from_grades(truth[q][2], {d: 1.0 for d in truth[q][3]},
                                                                    shown_grade=0) for q in shown])))
    y = dict(zip(shown, values))
    bucket = {q: clusters.bucket_of(user[q]) for q in shown}

    def crv1(qids: list[str], groups) -> float:
        fit = sm.OLS(np.array([y[q] for q in qids]), np.ones(len(qids))).fit(
            cov_type="cluster", cov_kwds={"groups": np.array(groups)})
        return float(fit.cov_params()[0, 0])

    arms = {r: [q for q in shown if arm[q] == r] for r in ("base", "new")}
    delta = np.mean([y[q] for q in arms["new"]]) - np.mean([y[q] for q in arms["base"]])
    own = crv1(arms["new"], [bucket[q] for q in arms["new"]]) + crv1(arms["base"], [bucket[q] for q in arms["base"]])
    both = arms["new"] + arms["base"]
    pooled = len(both) * crv1(both, [(arm[q] == "new") * 1000 + bucket[q] for q in both]) * (
        1 / len(arms["new"]) + 1 / len(arms["base"]))
    for average in ("macro", "micro"):  # P@10's micro is its macro (every query's denominator is 10)
        [c] = [c for c in look.comparisons if c.metric == "P@10" and c.average == average]
        assert c.estimate.delta == pytest.approx(delta, abs=1e-12), average
        assert c.estimate.variance == pytest.approx(max(own, pooled), rel=1e-9), average
    counts = [np.bincount([bucket[q] for q in arms[r]], minlength=clusters.BUCKETS) for r in ("base", "new")]
    split = [settings.ab.split[r] for r in ("base", "new")]
    by_queries = clusters.srm_query_share_p_value(counts, split, min_queries=20)
    # and the arms' distinct users (HyperLogLog registers of the arm's users, merged over the
    # partitions by the look), Bonferroni with the query shares
    regs = {r: np.zeros(hll.REGISTERS, np.uint8) for r in ("base", "new")}
    for r in regs:
        hll.add(regs[r], np.array(sorted({clusters.user_hash(user[q]) for q in arms[r]}), dtype=np.uint64))
    users = [hll.count(regs["base"]), hll.count(regs["new"])]
    for r, n in zip(("base", "new"), users):
        [view] = [a for a in look.arms if a.ranker == r]
        assert view.users == n and abs(n - len({user[q] for q in arms[r]})) <= 2
    by_users = srm_users_p_value(users, users[::-1], split)
    assert look.srm[""] == pytest.approx(min(1.0, 2 * min(by_queries, by_users)), rel=1e-12)
