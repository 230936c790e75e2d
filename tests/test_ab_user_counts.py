"""The sample-ratio check by users (ab/users.py) and the HyperLogLog behind it (ab/hll.py):
Redis's format read back, the estimator's error, the test's validity under a correct
split whatever the HLL error (quick seeded A/A: the upper Clopper–Pearson bound ≤ 0.06),
its detection of a 52/48 assignment bug, the widening it needs (without it, A/A paths at
10⁶ users are flagged), and the pipeline counting each arm's users once (a replayed batch
adds nothing). Full size: bench/srm_users.py; against a real Redis's PFCOUNT:
tests/integration/test_ab_users_hll.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from rankmeter import config
from rankmeter.ab import hll
from rankmeter.ab.clusters import user_hash
from rankmeter.ab.experiment import user_srm
from rankmeter.ab.stats import srm_p_value
from rankmeter.ab.users import HLL_BOUND, share_interval, srm_users_p_value
from rankmeter.source import Bus
from rankmeter.store import MemoryStore, PartitionCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import srm_users  # noqa: E402

from test_ab_pipeline import ENV, START_MS, experiment_stream, feed, started  # noqa: E402

SEED = 20261203  # fixed before the first run


def _upper(k: int, n: int) -> float:
    return stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact").high


# ---------------------------------------------------------------- hll

def test_registers_round_trip_through_redis_dense_and_sparse_formats():
    rng = np.random.default_rng(SEED)
    regs = np.zeros(hll.REGISTERS, np.uint8)
    hll.add(regs, rng.integers(0, 2 ** 63, 50_000, dtype=np.uint64))
    assert (hll.parse(hll.dense(regs)) == regs).all() and regs.max() > 10
    # sparse, as Redis writes a small set: XZERO 16,384 zeros is the empty one
    assert (hll.parse(b"HYLL\x01" + bytes(11) + b"\x7f\xff") == 0).all()
    # ZERO (5 zeros), VAL (value 2, twice), XZERO for the rest (a run of n is stored as n − 1)
    rest = hll.REGISTERS - 7 - 1
    one = hll.parse(b"HYLL\x01" + bytes(11) + bytes([0x04, 0x80 | (1 << 2) | 1, 0x40 | (rest >> 8), rest & 0xFF]))
    assert one[:5].tolist() == [0, 0, 0, 0, 0] and one[5:7].tolist() == [2, 2] and one[7:].sum() == 0
    for bad in (b"", b"HYLL", b"HYLX" + bytes(12 + 12288), b"HYLL\x00" + bytes(11) + bytes(100),
                b"HYLL\x01" + bytes(11) + b"\x7f", b"HYLL\x01" + bytes(11) + b"\x00", b"HYLL\x05" + bytes(11)):
        with pytest.raises(ValueError):
            hll.parse(bad)


def test_the_count_is_exact_for_a_few_users_and_within_its_stated_error_for_many():
    rng = np.random.default_rng(SEED)
    for n in (0, 1, 7, 100, 500):   # off by whole users (two in one register): ab/users.py's slack
        regs = np.zeros(hll.REGISTERS, np.uint8)
        hll.add(regs, rng.integers(0, 2 ** 63, n, dtype=np.uint64))
        assert abs(hll.count(regs) - n) <= (0 if n < 10 else 2 if n <= 100 else 10), n
    errors = []
    for _ in range(40):
        regs = np.zeros(hll.REGISTERS, np.uint8)
        hll.add(regs, rng.integers(0, 2 ** 63, 200_000, dtype=np.uint64))
        errors.append(hll.count(regs) / 200_000 - 1)
    # the relative sd ≈ 1.04/√16384 = 0.81% (40 draws: within ±35% of it)
    assert 0.65 * hll.RELATIVE_ERROR < np.std(errors) < 1.35 * hll.RELATIVE_ERROR
    assert abs(np.mean(errors)) < 3 * hll.RELATIVE_ERROR / math.sqrt(40)
    stacked = np.stack([np.zeros(hll.REGISTERS, np.uint8), regs])
    assert hll.count(stacked).tolist() == [0.0, hll.count(regs)]


# ---------------------------------------------------------------- the test statistic

def test_the_share_interval_holds_the_true_share_within_the_bound_and_a_few_users():
    assert all(math.isnan(x) for x in share_interval(0, 0))   # no users
    low, high = share_interval(1000, 1000)
    assert low < 0.5 < high and high - 0.5 == pytest.approx(0.5 - low, rel=1e-2)
    # 10⁶ users: the width is the HLL bound (β/4 ≈ 1.15 points at 50/50), not the sampling error
    low, high = share_interval(500_000, 500_000)
    assert (high - low) / 2 == pytest.approx(math.tanh(HLL_BOUND / 2) / 2, rel=1e-3)
    assert 0.011 < (high - low) / 2 < 0.012


def test_a_correct_split_is_rarely_flagged_50_50_90_10_and_99_1():
    rng = np.random.default_rng(SEED)
    for users, split, experiments in ((2_000, 0.5, 300), (2_000, 0.9, 300), (2_000, 0.99, 300)):
        at = srm_users.looks(users)
        alarms = sum(srm_users.first_alarm(srm_users.path(rng, users, split, at)[1], split, HLL_BOUND, 0.05) >= 0
                     for _ in range(experiments))
        assert _upper(alarms, experiments) <= 0.06, (users, split, alarms)


def test_without_the_hll_widening_correct_splits_are_flagged_at_a_million_users():
    # The count's error (0.8% a count) does not shrink with the users; the sampling error of a
    # share does (0.05 points at 10⁶): the same test on the counts as exact flags A/A paths.
    rng = np.random.default_rng(SEED)
    at = np.array([200_000, 500_000, 1_000_000])
    paths = [srm_users.path(rng, 1_000_000, 0.5, at) for _ in range(12)]
    naive = sum(srm_users.first_alarm(est, 0.5, 0.0, 0.05) >= 0 for _, est in paths)
    widened = sum(srm_users.first_alarm(est, 0.5, HLL_BOUND, 0.05) >= 0 for _, est in paths)
    exact = sum(srm_users.first_alarm(true, 0.5, 0.0, 0.05) >= 0 for true, _ in paths)
    assert naive >= 6 and widened == 0 and exact <= 1
    # and deterministically: a 1.5% HLL error at 10⁶ users is a share 0.37 points off
    assert srm_users_p_value([507_500, 500_000], [500_000, 507_500], [0.5, 0.5], bound=0.0, slack=0.0) < 1e-6
    assert srm_users_p_value([507_500, 500_000], [500_000, 507_500], [0.5, 0.5]) == 1.0


def test_a_52_48_assignment_is_detected_by_200000_users():
    rng = np.random.default_rng(SEED)
    at = srm_users.looks(200_000)
    found = [srm_users.first_alarm(srm_users.path(rng, 200_000, 0.52, at)[1], 0.5, HLL_BOUND, 0.025)
             for _ in range(20)]
    assert min(found) >= 0                      # every one (Bonferroni's α/2, as in the product)
    assert np.median(at[found]) < 150_000


def test_the_users_p_value_is_the_exact_multinomial_one_where_the_bound_is_tiny():
    # bound and slack 0: Lindon & Malek's test on the counts (two arms: arm against rest)
    p = srm_users_p_value([5200, 4800], [4800, 5200], [0.5, 0.5], bound=0.0, slack=0.0)
    assert p == pytest.approx(srm_p_value([5200, 4800], [0.5, 0.5]), rel=1e-12)
    # the widened one is never smaller; the split within the interval: 1
    assert srm_users_p_value([5200, 4800], [4800, 5200], [0.5, 0.5]) > p
    assert srm_users_p_value([5050, 4950], [4950, 5050], [0.5, 0.5]) == 1.0
    # an arm that should have no users has some: 0; no users: 1; more arms: Bonferroni
    assert srm_users_p_value([10, 5], [5, 10], [1.0, 0.0]) == 0.0
    assert srm_users_p_value([0, 0], [0, 0], [0.5, 0.5]) == 1.0
    three = srm_users_p_value([5000, 2000, 3000], [5000, 8000, 7000], [0.5, 0.25, 0.25], bound=0.0, slack=0.0)
    arm = srm_p_value([2000, 8000], [0.25, 0.75])
    assert three == pytest.approx(min(1.0, 3 * min(arm, srm_p_value([3000, 7000], [0.25, 0.75]),
                                                   srm_p_value([5000, 5000], [0.5, 0.5]))), rel=1e-12)


def test_user_and_query_share_tests_combine_by_bonferroni():
    rng = np.random.default_rng(SEED)
    regs = [np.zeros(hll.REGISTERS, np.uint8) for _ in range(2)]
    hll.add(regs[0], rng.integers(0, 2 ** 63, 5600, dtype=np.uint64))
    hll.add(regs[1], rng.integers(0, 2 ** 63, 4400, dtype=np.uint64))
    users = srm_users_p_value([hll.count(regs[0]), hll.count(regs[1])], [hll.count(regs[1]), hll.count(regs[0])],
                              [0.5, 0.5])
    assert users < 1e-6
    assert user_srm(regs, [0.5, 0.5], 0.3) == pytest.approx(2 * users, rel=1e-12)
    assert user_srm(regs, [0.56, 0.44], 0.01) == pytest.approx(0.02)     # users fine: the query share's, doubled
    assert user_srm([regs[0], None], [0.5, 0.5], 1.0) < 1e-6              # an arm never counted: its users are 0


# ---------------------------------------------------------------- through the pipeline

def _by_user(store: MemoryStore, replay: bool = False):
    settings = config.load(None, {**ENV, "RANKMETER_AB_START": str(START_MS), "RANKMETER_AB_UNIT": "user"})
    stream, truth = experiment_stream(11, 1600, START_MS)
    user = {q: f"user{int(q[1:]) // 4}" for q in truth}
    arm = {q: "new" if int(q[1:]) // 4 % 2 else "base" for q in truth}
    events = [(s, k, {**e, "client_id": user[k], "ranker": arm[k]} if s == "impressions" else e) for s, k, e in stream]
    bus = Bus(partitions=3)
    pipeline = started(settings, store, bus)
    feed(pipeline, bus, events)
    shown = [q for q, (_, t, _, _) in truth.items() if t >= START_MS]
    return pipeline, {r: {user[q] for q in shown if arm[q] == r} for r in ("base", "new")}


def test_the_pipeline_counts_each_arms_users_once_in_the_store_and_exports_them():
    store = MemoryStore()
    pipeline, users = _by_user(store)
    look = pipeline.ab_look()
    for r in ("base", "new"):
        [view] = [a for a in look.arms if a.ranker == r]
        regs = np.zeros(hll.REGISTERS, np.uint8)
        hll.add(regs, np.array([user_hash(u) for u in users[r]], dtype=np.uint64))
        assert view.users == hll.count(regs) and abs(view.users - len(users[r])) <= 2, r
        assert view.users < view.queries
    # one key per partition an arm has queries in, and no user in two arms' counts
    assert {p: sorted(a.split("\x1f")[1] for a in arms) for p, arms in store.users.items()} == \
        {p: ["base", "new"] for p in range(3)}
    from prometheus_client.parser import text_string_to_metric_families

    from rankmeter.exporter import Exporter, Health
    text = Exporter(pipeline.readout, Health(), dict).render().decode()
    exported = {(s.labels["ranker"], s.labels["baseline"], s.labels["segment"]): s.value
                for f in text_string_to_metric_families(text) for s in f.samples if s.name == "rankmeter_ab_users"}
    assert exported == {(r, "base", ""): next(a.users for a in look.arms if a.ranker == r) for r in ("base", "new")}


def test_a_checkpoint_replayed_adds_no_user():
    # The same batch's checkpoint again, under the next claim (after a crash before its offsets
    # were used): the same registers, the same count (a set union).
    store = MemoryStore()
    store.claim(0)
    arm = "e\x1fbase\x1f"
    first = PartitionCheckpoint(partition=0, epoch=1, layout="L", offsets={"t": 1}, watermarks={}, records={},
                                deadlines={}, deleted=[], buckets={}, dropped_buckets=[], meta={"mark": "1:1"},
                                users={arm: [user_hash(f"u{i}") for i in range(500)]})
    assert store.commit([first]) == {}
    once = store.users[0][arm].copy()
    store.claim(0)
    assert store.commit([first._replace(epoch=2, expect="1:1", meta={"mark": "2:1"})]) == {}
    assert (store.users[0][arm] == once).all() and hll.count(once) == pytest.approx(500, abs=10)
    assert store.load_users({0: [arm, "e\x1fnew\x1f"]}) == {0: {arm: hll.dense(once)}}
    assert store.wipe(0) and store.load_users({0: [arm]}) == {0: {}}


def test_a_store_without_counts_says_so_and_tests_query_shares_only():
    store = MemoryStore()
    pipeline, _ = _by_user(store)
    counted = pipeline.ab_look()
    store.users.clear()        # a phase stored by a release that did not count users
    look = pipeline.ab_look()
    assert all(a.users is None for a in look.arms) and all(a.users is not None for a in counted.arms)
    assert [n for n in look.notes if "distinct users are not counted" in n] == [
        "distinct users are not counted in segment - (a phase begun before this release, or a store without "
        "HyperLogLog): its sample-ratio check tests query shares only"]
    assert not any("distinct users" in n for n in counted.notes)


def test_a_sparse_value_longer_than_any_count_is_refused_before_it_is_walked():
    """Each sparse opcode sets at least one register: a body longer than the registers is no
    count (a 20 MB one took 7 s to walk on the consuming thread)."""
    valid = b"HYLL\x01" + bytes(11) + bytes([0x7F, 0xFF])   # XZERO: all 16,384 registers zero
    assert hll.count(hll.parse(valid)) == 0
    with pytest.raises(ValueError, match="more than"):
        hll.parse(b"HYLL\x01" + bytes(11) + b"\x80" * (hll.REGISTERS + 1))
