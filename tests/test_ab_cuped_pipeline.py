"""CUPED on the pipeline (pipeline/covariates.py): the pre-period table is built by event
time from the queries shown before ab.start (tests/test_ab_cuped_period.py), each enrolled query's covariate is its
text's pre-period mean, and a look's adjusted comparison equals statsmodels OLS computed
independently from the same events."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import statsmodels.api as sm

from rankmeter.ab import cuped
from rankmeter.pipeline.covariates import PRE

from test_ab_pipeline import NOW_MS, an_experiment, feed, started

START_MS = NOW_MS - 600_000
HOUR_MS = 3_600_000
TEXTS = 60


def events(seed: int, pre: int, during: int, users: int = 0):
    """Texts (or, with `users`, users assigned whole to one ranker, the last tenth without a
    pre-period query) with a persistent click propensity; pre-period queries (before the
    start), then the experiment's. Returns (pre events, experiment events, truth per query:
    phase, ranker, the text's number or the client_id, clicks)."""
    rnd = random.Random(seed)
    propensity = [rnd.random() for _ in range(users or TEXTS)]
    arm = [rnd.choice(["base", "new"]) for _ in range(users)]
    out: dict[str, list] = {"pre": [], "during": []}
    truth = {}
    for q in range(pre + during):
        phase = "pre" if q < pre else "during"
        if users:
            unit = rnd.randrange(users * 9 // 10) if phase == "pre" else rnd.randrange(users)
            qid, ranker, who = f"q{q}", arm[unit], {"client_id": f"user{unit}"}
        else:
            qid, unit = f"q{q}", rnd.randrange(TEXTS)
            ranker, who = rnd.choice(["base", "new"]), {"user_query": f"text {unit}"}
        # (pre-period: 1 to 3 hours before the start, beyond the attribution window and its grace)
        t = START_MS - 3 * HOUR_MS + rnd.randrange(2 * HOUR_MS) if phase == "pre" else START_MS + rnd.randrange(400_000)
        results = [f"d{j}" for j in range(10)]
        lift = 0.1 if ranker == "new" and phase == "during" else 0.0
        clicked = [d for d in results if rnd.random() < 0.3 * propensity[unit] + lift]
        out[phase].append(("impressions", qid, {"query_id": qid, "ranker": ranker, "timestamp": t, "results": results,
                                                **who}))
        out[phase] += [("feedback", qid, {"query_id": qid, "action": "click", "doc_id": d, "timestamp": t + 1000})
                       for d in clicked]
        truth[qid] = (phase, ranker, f"user{unit}" if users else unit, len(clicked))
    return out["pre"], out["during"], truth


def test_the_adjusted_comparison_equals_ols_on_the_pre_period_covariate():
    s = an_experiment(7, 0, 2, RANKMETER_AB_CUPED="true", RANKMETER_AB_CUPED_BUCKETS="4096")
    pre, during, truth = events(8, 1500, 1500)
    feed(s.pipeline, s.bus, pre)
    feed(s.pipeline, s.bus, during)
    assert any(PRE in ps.ab for ps in s.pipeline.partitions.values())
    look = s.pipeline.experiments.look()
    [c] = [c for c in look.comparisons if c.metric == "Clicks" and c.average == "macro"]
    # Independently: each text bucket's mean clicks before the start (texts whose hashes
    # collide in the 4,096 buckets merge: two of these 60 do), each enrolled query's value.
    where = {t: int(hashlib.blake2b(f"text {t}".encode(), digest_size=8).hexdigest(), 16) % 4096 for t in range(TEXTS)}
    assert len(set(where.values())) < TEXTS
    pre_clicks: dict[int, list[int]] = {}
    for phase, _, text, clicks in truth.values():
        if phase == "pre":
            pre_clicks.setdefault(where[text], []).append(clicks)
    pooled = np.mean([k for v in pre_clicks.values() for k in v])
    rows = [(ranker == "new", np.mean(pre_clicks.get(where[text], [pooled])), clicks)
            for phase, ranker, text, clicks in truth.values() if phase == "during"]
    arm, x, y = (np.array(col, dtype=float) for col in zip(*rows))
    fit = sm.OLS(y, np.column_stack([np.ones_like(y), arm, x])).fit()
    assert c.estimate.delta == pytest.approx(fit.params[1], abs=1e-9)
    a = y - fit.params[2] * (x - x.mean())
    welch = sm.OLS(a, np.column_stack([np.ones_like(a), arm])).fit(cov_type="HC2").bse[1] ** 2
    floor = sm.OLS(a, np.ones_like(a)).fit().scale * (1 / arm.sum() + 1 / (1 - arm).sum())
    assert c.estimate.variance == pytest.approx(max(welch, floor), rel=1e-9)
    raw = cuped.difference(cuped.CovariateSums(arm.sum(), 0, y[arm == 1].sum(), 0, 0, (y[arm == 1] ** 2).sum()),
                           cuped.CovariateSums((1 - arm).sum(), 0, y[arm == 0].sum(), 0, 0, (y[arm == 0] ** 2).sum()))
    assert c.variance_reduction == pytest.approx(1 - c.estimate.variance / raw.unadjusted.variance, rel=1e-9)
    assert c.variance_reduction > 0.1


def test_cuped_off_keeps_no_table():
    s = an_experiment(7, 0, 2)
    pre, during, _ = events(9, 200, 200)
    feed(s.pipeline, s.bus, pre + during)
    assert not any(PRE in ps.ab for ps in s.pipeline.partitions.values())
    assert all(np.isnan(c.variance_reduction) for c in s.pipeline.experiments.look().comparisons)


# (the third: counts of 1e-300 with sums of 1e300, finite but an infinite mean: review F3)
@pytest.mark.parametrize("table", [b"\x00" * 24, np.full(4096 * 9 * 2, np.nan).tobytes(),
                                   np.tile([1e-300, 1e300], 4096 * 9).tobytes()])
def test_an_unreadable_stored_table_is_left_out_and_counted(table):
    """Another size (another ab.cuped_buckets), or values no checkpoint writes: skipped,
    counted, and the look goes on with the other partitions' tables."""
    s = an_experiment(7, 0, 2, RANKMETER_AB_CUPED="true", RANKMETER_AB_CUPED_BUCKETS="4096")
    pre, during, _ = events(10, 600, 600)
    feed(s.pipeline, s.bus, pre)
    s.pipeline.partitions[1].ab.pop(PRE, None)
    s.store.ab.setdefault(1, {})[PRE] = table    # as a stored field of partition 1
    before = s.pipeline.experiments.unreadable.counts["experiment"]
    feed(s.pipeline, s.bus, during)
    look = s.pipeline.experiments.look()
    assert any(np.isfinite(c.variance_reduction) and c.variance_reduction > 0 for c in look.comparisons)
    assert s.pipeline.experiments.unreadable.counts["experiment"] == before + 1   # read once, then cached


def test_a_malformed_covariate_field_is_skipped_and_counted_not_a_crash():
    """Review (CUPED) F1: a stored `<experiment>#cuped` field of another shape (too few or
    too many parts) crashed every look, and so serve, on every replica claiming partition 0."""
    import numpy as np

    from test_ab_pipeline import an_experiment, feed

    from rankmeter.pipeline.covariates import SUFFIX

    s = an_experiment(7, 0, 2, RANKMETER_AB_CUPED="true", RANKMETER_AB_CUPED_BUCKETS="4096")
    pre, during, _ = events(8, 300, 300)
    feed(s.pipeline, s.bus, pre)
    feed(s.pipeline, s.bus, during)
    want = s.pipeline.ab_look().comparisons
    name = s.pipeline.experiments.name
    for bad in ("\x1fbroken", "", "\x1fa\x1fb\x1f3\x1fjunk"):
        s.store.ab.setdefault(1, {})[name + SUFFIX + bad] = np.zeros(3).tobytes()
    before = s.pipeline.experiments.unreadable.counts["experiment"]
    look = s.pipeline.ab_look()
    assert [c.estimate for c in look.comparisons] == [c.estimate for c in want]
    assert s.pipeline.experiments.unreadable.counts["experiment"] >= before + 3  # (each read of the sums counts them)


def user_events(seed: int, users: int, pre: int, during: int):
    return events(seed, pre, during, users)


def test_the_user_covariate_gives_the_ols_adjusted_difference_and_theta():
    """ab.cuped_covariate: user: x is the user's pre-period mean (users whose hashes collide
    in the 4,096 buckets merge), the pooled mean for a user without one; the exported
    adjusted difference and θ are OLS's of `y ~ arm + x` computed from the events."""
    from rankmeter.ab import clusters
    from rankmeter.pipeline.covariates import PRE_USER, arm_covariates
    from rankmeter.pipeline.experiments import arm_vectors

    s = an_experiment(7, 0, 2, RANKMETER_AB_UNIT="user", RANKMETER_AB_CUPED="true",
                      RANKMETER_AB_CUPED_COVARIATE="user", RANKMETER_AB_CUPED_BUCKETS="4096")
    pre, during, truth = user_events(11, 240, 2500, 2500)
    feed(s.pipeline, s.bus, pre)
    feed(s.pipeline, s.bus, during)
    assert any(PRE_USER in ps.ab for ps in s.pipeline.partitions.values())
    assert not any(PRE in ps.ab for ps in s.pipeline.partitions.values())
    look = s.pipeline.experiments.look()
    [c] = [c for c in look.comparisons if c.metric == "Clicks" and c.average == "macro"]

    where = {u: clusters.user_hash(u) % 4096 for _, _, u, _ in truth.values()}
    pre_clicks: dict[int, list[int]] = {}
    for phase, _, user, clicks in truth.values():
        if phase == "pre":
            pre_clicks.setdefault(where[user], []).append(clicks)
    pooled = np.mean([k for v in pre_clicks.values() for k in v])
    rows = [(ranker == "new", np.mean(pre_clicks.get(where[user], [pooled])), clicks)
            for phase, ranker, user, clicks in truth.values() if phase == "during"]
    assert any(where[user] not in pre_clicks for phase, _, user, _ in truth.values() if phase == "during")
    arm, x, y = (np.array(col, dtype=float) for col in zip(*rows))
    fit = sm.OLS(y, np.column_stack([np.ones_like(y), arm, x])).fit()
    assert c.estimate.delta == pytest.approx(fit.params[1], abs=1e-9)
    assert np.isfinite(c.variance_reduction) and c.variance_reduction > 0.1

    # θ from the stored sums, as the look computes it.
    stored = s.store.load_ab(s.store.partitions())
    phase = s.pipeline.experiments.phase
    column = phase.names.index("Clicks")
    vectors, _ = arm_vectors(stored, look.experiment, phase.size, True, lambda *a: False, lambda *a: None)
    covariates = arm_covariates(stored, look.experiment, len(phase.definition), True, clusters.BUCKETS,
                                lambda *a: None)
    t, b = (cuped.arm_sums(vectors[(r, "")], covariates[(r, "")], column) for r in ("new", "base"))
    assert cuped.bucket_difference(t, b).theta == pytest.approx(fit.params[2], abs=1e-9)


def test_an_unreadable_user_table_is_left_out_and_counted():
    from rankmeter.pipeline.covariates import PRE_USER

    s = an_experiment(7, 0, 2, RANKMETER_AB_UNIT="user", RANKMETER_AB_CUPED="true",
                      RANKMETER_AB_CUPED_COVARIATE="user", RANKMETER_AB_CUPED_BUCKETS="4096")
    pre, during, _ = user_events(12, 240, 1500, 1500)
    feed(s.pipeline, s.bus, pre)
    s.pipeline.partitions[1].ab.pop(PRE_USER, None)
    s.store.ab.setdefault(1, {})[PRE_USER] = b"\x00" * 24   # another size
    before = s.pipeline.experiments.unreadable.counts["experiment"]
    feed(s.pipeline, s.bus, during)
    look = s.pipeline.experiments.look()
    assert any(np.isfinite(c.variance_reduction) and c.variance_reduction > 0 for c in look.comparisons)
    assert s.pipeline.experiments.unreadable.counts["experiment"] == before + 1


def test_a_look_reads_the_arm_sums_without_the_pre_period_table():
    """The table (9.4 MB a partition by default) is read once per process, by the
    covariate; the looks after it read the A/B sums without it."""
    s = an_experiment(7, 0, 2, RANKMETER_AB_CUPED="true", RANKMETER_AB_CUPED_BUCKETS="4096")
    pre, during, _ = events(8, 300, 300)
    feed(s.pipeline, s.bus, pre)
    feed(s.pipeline, s.bus, during)
    assert PRE in s.store.ab[0] or PRE in s.store.ab[1]
    want = s.pipeline.experiments.look().comparisons
    read = []
    load = s.store.load_ab
    s.store.load_ab = lambda *args, **kwargs: read.append(found := load(*args, **kwargs)) or found
    assert [c.estimate for c in s.pipeline.experiments.look().comparisons] == [c.estimate for c in want]
    assert read and not any(PRE in fields for found in read for fields in found.values())
    assert any(f.endswith("\x1fnew\x1f") for found in read for fields in found.values() for f in fields)


def test_an_arm_whose_covariate_sums_miss_a_partition_its_ab_sums_have_is_left_out():
    """Review (final) F4: one partition's #cuped field unreadable (skipped, counted) left the
    arm's n and Σy from every partition but Σx, Σxy from the others: a 29.7-se A/A delta.
    The arm is now left out of the adjusted comparison (not compared), as is one whose
    A/B sums miss a partition its covariate sums have."""
    from rankmeter.ab import sums as ab_sums
    from rankmeter.pipeline.covariates import arm_covariates
    from rankmeter.pipeline.experiments import arm_vectors
    size, e = ab_sums.size(1), "exp"
    ab, cov = np.ones(size).tobytes(), np.ones(3).tobytes()
    stored = {p: {f"{e}\x1f{r}\x1f": ab for r in ("base", "new")} | {f"{e}#cuped\x1f{r}\x1f": cov for r in ("base", "new")}
              for p in (0, 1)}
    stored[1][f"{e}#cuped\x1fnew\x1f"] = b"short"       # unreadable on partition 1
    del stored[0][f"{e}\x1fbase\x1f"]                   # and base's A/B sums missing on partition 0
    counted: set = set()
    skipped = []
    arm_vectors(stored, e, size, False, lambda *a: False, lambda *a: skipped.append(a), counted)
    got = arm_covariates(stored, e, 1, False, 128, lambda *a: skipped.append(a), counted)
    assert got == {} and len(skipped) == 1
    whole = {p: dict(fields) for p, fields in stored.items()}
    whole[1][f"{e}#cuped\x1fnew\x1f"], whole[0][f"{e}\x1fbase\x1f"] = cov, ab
    counted = set()
    arm_vectors(whole, e, size, False, lambda *a: False, lambda *a: None, counted)
    assert sorted(arm_covariates(whole, e, 1, False, 128, lambda *a: None, counted)) == [("base", ""), ("new", "")]


def _adjusted_clicks(seed: int, restart: bool, pre_after_enrolled: bool):
    s = an_experiment(7, 0, 2, RANKMETER_AB_CUPED="true", RANKMETER_AB_CUPED_BUCKETS="4096")
    pre, during, truth = events(seed, 1500, 1500)
    impressions = [e for e in during if e[0] == "impressions"]
    clicks = [e for e in during if e[0] == "feedback"]
    # Clicks from the start on, on pre-period queries: they take those out of the table.
    late = [("feedback", q, {"query_id": q, "action": "click", "doc_id": "d0", "timestamp": START_MS + 60_000})
            for q, (phase, _, _, k) in truth.items() if phase == "pre" and k >= 3]
    pipeline = s.pipeline
    for part in ((impressions, pre) if pre_after_enrolled else (pre, impressions)) + (late,):
        feed(pipeline, s.bus, part)
    if restart:
        pipeline = started(s.settings, s.store, s.bus)
    feed(pipeline, s.bus, clicks)
    [c] = [c for c in pipeline.experiments.look().comparisons if c.metric == "Clicks" and c.average == "macro"]
    return c


@pytest.mark.parametrize("pre_after_enrolled", [False, True])
def test_a_restart_after_the_start_does_not_move_the_adjusted_delta(pre_after_enrolled):
    """Review (CUPED) F1: each process read its own means, and the table moves after the
    start, so a query evaluated again after a restart got another x than one that was not,
    and which are evaluated again depends on their clicks, so on the treatment (0.3-0.9 se).
    The experiment's means are now stored once, for every process. With the experiment's
    first queries read before the pre-period, the means are those of an empty table: every
    query gets the pooled mean (0), nothing is adjusted, the same with or without a restart
    (review 3, M1: this case shows no reduction, it cannot show a bias)."""
    a, b = _adjusted_clicks(8, False, pre_after_enrolled), _adjusted_clicks(8, True, pre_after_enrolled)
    assert b.estimate.delta == pytest.approx(a.estimate.delta, abs=1e-9)
    if pre_after_enrolled:
        assert a.variance_reduction == b.variance_reduction == 0
    else:
        assert a.variance_reduction > 0.1 and b.variance_reduction == pytest.approx(a.variance_reduction, abs=1e-9)


@pytest.mark.parametrize("stored", ["garbage", "nan", ""])
def test_stored_means_that_are_not_the_covariates_are_replaced_and_counted(stored):
    import base64
    from rankmeter.pipeline.covariates import MEANS
    s = an_experiment(7, 0, 2, RANKMETER_AB_CUPED="true", RANKMETER_AB_CUPED_BUCKETS="4096")
    pre, during, _ = events(3, 300, 300)
    name = s.pipeline.experiments.name
    m = len(s.pipeline.experiments.layout.names)
    if stored == "nan":  # the right size, not finite
        stored = base64.b64encode(np.full(4097 * m, np.nan).tobytes()).decode()
    s.store.definitions[name + MEANS] = stored
    feed(s.pipeline, s.bus, pre + during)
    # (review 4: an empty value was never replaced, so every batch waited for good)
    assert s.pipeline.unreadable.counts["experiment"] == (1 if stored else 0)
    assert s.store.definitions[name + MEANS] != stored
    assert s.pipeline.experiments.look().comparisons
    kept = s.store.definitions[name + MEANS]
    s.store.definitions[name + MEANS] = "garbage"   # at a claim (review 4, M2): written back, counted
    s.pipeline.experiments.resolve()
    assert s.store.definitions[name + MEANS] == kept
    assert s.pipeline.unreadable.counts["experiment"] == (2 if stored else 1)


def test_means_the_store_does_not_keep_are_never_used_the_batch_waits():
    """Review 3, H1: a store refusing the write (read-only, full) gave "" and the process
    adjusted with its own means for good, another process later with others."""
    from rankmeter.store import Refused
    s = an_experiment(7, 0, 2, RANKMETER_AB_CUPED="true", RANKMETER_AB_CUPED_BUCKETS="4096")
    pre, during, _ = events(3, 300, 300)
    feed(s.pipeline, s.bus, pre)
    s.store.define_experiment = lambda name, text, replace=False: ""
    with pytest.raises(Refused):
        feed(s.pipeline, s.bus, during)
    # ... which serve's batch loop catches as the store unavailable (it waits, reloads, retries)
    from rankmeter.redis_store import RedisStore
    from rankmeter.store import MemoryStore
    assert Refused in RedisStore.unavailable and Refused in MemoryStore.unavailable


def test_means_the_store_lost_are_stored_back_at_a_claim_and_others_followed_counted():
    """Review 3, H2: a snapshot the store lost was taken again by the next process, from the
    tables as they are now; every process now writes its own back at each claim."""
    from rankmeter.pipeline.covariates import MEANS
    s = an_experiment(7, 0, 2, RANKMETER_AB_CUPED="true", RANKMETER_AB_CUPED_BUCKETS="4096")
    pre, during, _ = events(3, 300, 300)
    feed(s.pipeline, s.bus, pre + during)
    key = s.pipeline.experiments.name + MEANS
    kept = s.store.definitions.pop(key)
    s.pipeline.experiments.resolve()
    assert s.store.definitions[key] == kept and s.pipeline.unreadable.counts["experiment"] == 0
    other = started(s.settings, s.store, s.bus)   # (reads the same tables: the same means; make others)
    covariates = other.experiments.covariates
    means, pooled = covariates.means(other.experiments.name)
    from rankmeter.pipeline.covariates import _encoded
    s.store.definitions[key] = _encoded(means + 1.0, pooled)
    s.pipeline.experiments.resolve()
    assert s.pipeline.unreadable.counts["experiment"] == 1
    assert np.array_equal(s.pipeline.experiments.covariates.means(s.pipeline.experiments.name)[0], means + 1.0)


def test_a_process_finding_the_means_stored_reads_no_table_and_a_claim_sends_none(monkeypatch):
    """Review 3, L1 and review 4, M1: every process start read every partition's table (0.7 s,
    300 MB at 32 partitions) before finding the means stored, and every claim sent the
    6.3 MB means and read them back. Now the stored ones are read first, and a claim
    compares digests."""
    from rankmeter.pipeline.covariates import MEANS, Covariates
    s = an_experiment(7, 0, 2, RANKMETER_AB_CUPED="true", RANKMETER_AB_CUPED_BUCKETS="4096")
    pre, during, _ = events(3, 300, 300)
    feed(s.pipeline, s.bus, pre + during)
    key = s.pipeline.experiments.name + MEANS
    kept = s.store.definitions[key]
    defined = []
    real_define = s.store.define_experiment
    monkeypatch.setattr(s.store, "define_experiment", lambda *a, **k: (a[0].endswith(MEANS) and defined.append(a[0])) or real_define(*a, **k))
    monkeypatch.setattr(Covariates, "from_tables", lambda self: pytest.fail("read the tables"))
    other = started(s.settings, s.store, s.bus)
    means, _ = other.experiments.covariates.means(other.experiments.name)
    s.pipeline.experiments.resolve()
    other.experiments.resolve()
    assert defined == [] and s.store.definitions[key] == kept
    assert np.array_equal(means, s.pipeline.experiments.covariates.means(s.pipeline.experiments.name)[0])
    del s.store.definitions[key]   # lost: stored back at the next claim, as before
    s.pipeline.experiments.resolve()
    assert defined == [key] and s.store.definitions[key] == kept


def test_means_another_process_stored_are_followed_at_the_next_look_not_only_at_a_claim():
    """Review (session 10) M3: with no rebalance a process adjusted with its own means for
    good while the store held others, uncounted."""
    from rankmeter.pipeline.covariates import MEANS, _encoded
    from rankmeter.serve import _look_at_experiment
    s = an_experiment(7, 0, 2, RANKMETER_AB_CUPED="true", RANKMETER_AB_CUPED_BUCKETS="4096")
    pre, during, _ = events(3, 300, 300)
    feed(s.pipeline, s.bus, pre + during)
    covariates = s.pipeline.experiments.covariates
    means, pooled = covariates.means(s.pipeline.experiments.name)
    s.store.definitions[s.pipeline.experiments.name + MEANS] = _encoded(means + 1.0, pooled)
    assert _look_at_experiment(s.pipeline, s.store.unavailable)
    assert s.pipeline.unreadable.counts["experiment"] == 1
    assert np.array_equal(covariates.means(s.pipeline.experiments.name)[0], means + 1.0)
