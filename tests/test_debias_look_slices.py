"""The propensities' estimate in slices (serve: a few ms after each batch instead of ~0.1 s
at once on the consuming thread): the same look, to the bit, as the estimate at once; a
look begun while one is under way only advances it; a result whose claim on partition 0
has moved on is neither stored nor applied."""

from __future__ import annotations

import pytest

from rankmeter.debias import fit
from rankmeter.debias.clickmodels import slots
from rankmeter.debias.propensity import estimate, estimating
from rankmeter.debias.tables import decide, split
from rankmeter.pipeline import Pipeline
from rankmeter.pipeline.position_bias import global_sums
from rankmeter.store import MemoryStore
from rankmeter.unreadable import Unreadable

from test_debias_pipeline import SETTINGS, START_MS, Clock, simulate

NAME = f"propensity|ranks={SETTINGS.debias.ranks}|min_pairs={SETTINGS.debias.min_pairs}"


@pytest.fixture(scope="module")
def harvested() -> MemoryStore:
    _, _, store = simulate(seed=4, queries=6_000)
    return store


def holder(store: MemoryStore) -> Pipeline:
    pipeline = Pipeline(SETTINGS, store, lambda r, why: None, Clock(START_MS + 6_000 * 500))
    pipeline.assign(store.partitions())
    return pipeline


def slices(pipeline: Pipeline) -> int:
    """Looks with no time at all (one EM iteration a call) until the look is applied."""
    pipeline.look_at_position_bias(estimate_here=True, now=12.0, budget_s=0.0)
    calls = 1
    while pipeline.position_bias._pending is not None:
        pipeline.advance_position_bias(0.0)
        calls += 1
    return calls


def test_estimating_in_steps_gives_the_estimate_at_once_to_the_bit(harvested):
    _, ubm, _ = split(sum(global_sums(harvested, SETTINGS.debias.ranks, Unreadable())), SETTINGS.debias.ranks)
    steps = estimating(ubm)
    count = 0
    try:
        while True:
            next(steps)
            count += 1
    except StopIteration as done:
        stepped = done.value
    assert stepped == estimate(ubm) and stepped.iterations > 10
    assert count in (stepped.iterations - 1, stepped.iterations)  # (the last converges or is the limit)
    assert stepped.relative[1] is not None


def test_a_look_in_slices_is_the_look_at_once(harvested):
    original = harvested.load_running(NAME)  # the previous decision both start from
    at_once = holder(harvested)
    at_once.look_at_position_bias(estimate_here=True, now=12.0)
    stored_at_once = harvested.load_running(NAME)
    assert stored_at_once != original
    assert harvested.save_running(NAME, original)
    sliced = holder(harvested)
    calls = slices(sliced)
    assert calls > 50  # spread over many calls: pbm's iterations and ubm's
    assert sliced.position_bias.look_result == at_once.position_bias.look_result
    assert harvested.load_running(NAME) == stored_at_once
    vector = sum(global_sums(harvested, SETTINGS.debias.ranks, Unreadable()))
    previous = fit.from_fields(original, SETTINGS.debias.ranks, slots(SETTINGS.debias.ranks))
    assert sliced.position_bias.look_result == decide(vector, SETTINGS.debias.ranks, SETTINGS.debias.min_pairs,
                                                      previous)._replace(at=12.0)


def test_a_look_begun_meanwhile_advances_the_one_under_way(harvested, monkeypatch):
    pipeline = holder(harvested)
    began = []
    import rankmeter.pipeline.position_bias as position_bias
    deciding = position_bias.deciding
    monkeypatch.setattr(position_bias, "deciding", lambda *a: began.append(1) or deciding(*a))
    pipeline.look_at_position_bias(estimate_here=True, budget_s=0.0)
    pending = pipeline.position_bias._pending
    for _ in range(5):
        pipeline.look_at_position_bias(estimate_here=True, budget_s=0.0)
    assert pipeline.position_bias._pending is pending and began == [1]


def test_a_result_under_a_claim_that_moved_on_is_neither_stored_nor_applied(harvested):
    pipeline = holder(harvested)
    before = harvested.load_running(NAME)
    pipeline.look_at_position_bias(estimate_here=True, now=99.0, budget_s=0.0)
    assert pipeline.position_bias._pending is not None
    pipeline.revoke([0])  # partition 0 elsewhere now
    pipeline.advance_position_bias(float("inf"))
    assert pipeline.position_bias._pending is None
    assert harvested.load_running(NAME) == before
    assert pipeline.position_bias.look_result.at != 99.0


def test_a_result_under_an_earlier_claim_of_partition_0_is_dropped(harvested):
    pipeline = holder(harvested)
    before = harvested.load_running(NAME)
    pipeline.look_at_position_bias(estimate_here=True, now=77.0, budget_s=0.0)
    begun_under = pipeline.partitions[0].epoch
    pipeline.revoke([0])
    pipeline.assign([0])  # claimed again: a new epoch
    assert pipeline.partitions[0].epoch != begun_under
    pipeline.advance_position_bias(float("inf"))
    assert pipeline.position_bias._pending is None
    assert harvested.load_running(NAME) == before and pipeline.position_bias.look_result.at != 77.0


def test_an_estimate_that_fails_is_not_left_under_way(harvested, monkeypatch):
    import rankmeter.pipeline.position_bias as position_bias

    def failing(*a):
        yield
        raise FloatingPointError("the sums were not finite")

    monkeypatch.setattr(position_bias, "deciding", failing)
    pipeline = holder(harvested)
    pipeline.look_at_position_bias(estimate_here=True, budget_s=0.0)
    with pytest.raises(FloatingPointError):
        pipeline.advance_position_bias(0.0)
    assert pipeline.position_bias._pending is None
    monkeypatch.undo()
    pipeline.look_at_position_bias(estimate_here=True, now=5.0)  # the next look begins afresh
    assert pipeline.position_bias.look_result.at == 5.0
