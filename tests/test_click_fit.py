"""The click models beside pbm and the fit test that withdraws the debiased series (issue
22): ubm's examination recovered from cascade clicks, the held-out calibration that fails
pbm on cascade users and passes it on position-based ones, the reaction probe, the
thresholds' hysteresis, and a stored look read back whatever it holds."""

from __future__ import annotations

import numpy as np
import pytest

from rankmeter.debias.clickmodels import FitLayout, ReactionProbe, placements, slot, slots
from rankmeter.debias.fit import (CALIBRATION, CALIBRATION_Z, DEPENDENT_CLICKS, MIN_EXPECTED, Look, below_clicks,
                                  from_fields, initial, judge, miscalibrated, to_fields)
from rankmeter.debias.propensity import Propensities
from rankmeter.debias.tables import ModelTables, decide, split, upgrade, vector_size
from rankmeter.simulator.clicks import cascade, dcm, pbm

K = 10


def traffic(click_model, queries: int, seed: int = 1, react: float = 0.0):
    """Lists of 10 out of 15 documents per text (a noisy ranking by attractiveness, so the
    same document is shown at several ranks), clicks by `click_model`. `react`: a clicked
    document is moved up that many ranks in its text's next list (a ranker reacting)."""
    rng = np.random.default_rng(seed)
    texts = 40
    attract = rng.uniform(0.02, 0.8, (texts, 15))
    boost: dict[tuple[int, int], float] = {}
    for q in range(queries):
        t = int(rng.integers(texts))
        scores = attract[t] + rng.normal(0, 0.3, 15)
        for d in range(15):
            scores[d] += react * boost.pop((t, d), 0.0)
        order = list(np.argsort(-scores)[:K])
        clicks = click_model([attract[t][d] for d in order], rng)
        shown = [f"d{d}" for d in order]
        clicked = {shown[r] for r in clicks}
        for r in clicks:
            boost[(t, order[r])] = 1.0
        yield f"q{seed}-{q}", f"t{t}", shown, clicked


def fed(click_model, queries: int = 6000, looks: int = 6, **kw) -> ModelTables:
    tables = ModelTables(K, 50_000)
    look = None
    for i, (qid, text, shown, clicked) in enumerate(traffic(click_model, queries, **kw)):
        tables.observe(qid, text, shown, clicked, {d: 1.0 for d in clicked})
        if i % (queries // looks) == queries // looks - 1:
            look = decide(tables.vector(), K, 100, look)
            tables.looked(look)
    return tables


def test_slots_place_each_rank_by_the_distance_to_the_last_click_above():
    assert slots(10) == 27 and slot(0, 0) == 0 and slot(1, 1) == 2 and slot(9, 5) == 26
    placed = placements(["a", "b", "c", "d", "e"], {"b", "c"})
    assert placed == [(slot(0, 0), "a"), (slot(1, 0), "b"), (slot(2, 1), "c"), (slot(3, 1), "d"), (slot(4, 2), "e")]


def test_ubm_recovers_cascade_examination_and_the_fit_test_fails_pbm_there():
    tables = fed(cascade)
    look = tables.look
    ranks = range(K)
    # Cascade users: every rank with no click above is examined (γ = 1), none below a click.
    no_click = [look.ubm.relative[slot(r, 0)] for r in ranks]
    below = [look.ubm.relative[slot(r, d)] for r in range(1, K) for d in (1, 2) if d <= r]
    assert all(g is not None for g in no_click) and 0.85 < np.mean(no_click) < 1.2, no_click
    assert all(0.8 < g < 1.35 for g in no_click[:5]), no_click  # the ranks with 1,000s of pairs
    assert all(g is None or g < 0.02 for g in below), below
    # ubm fits them, and says clicks see nothing below a click: no weighting recovers the gap.
    assert look.model == "ubm" and look.reason == "unexamined_below_clicks", look
    fit = split(tables.vector(), K)[2]
    layout = FitLayout(K)
    assert layout.perplexity(fit, 1) < layout.perplexity(fit, 0)
    # pbm expects clicks below a click that cascade users never make.
    assert layout.observed_over_expected(fit, 0, 1, 30) < 0.2
    # So a look that keeps pbm (ubm not estimated) withdraws the series as a poor fit.
    pbm_only = decide(tables.vector(), K, 100, None)._replace(ubm=initial(K, slots(K)).ubm)
    again = judge(pbm_only.pbm, pbm_only.ubm, fit, layout, None)
    assert again.model == "pbm" and again.reason == "poor_fit", again.checks


def test_dependent_click_users_withdraw_the_series_and_position_based_ones_do_not():
    """Dependent-click users: ubm fits them better, but one value per slot below a click
    misweighs the lists (bench: worse than raw clicks): withdrawn, `dependent_clicks`."""
    tables = fed(dcm)
    look = tables.look
    assert look.model == "ubm" and look.reason == "dependent_clicks", (look.reason, look.checks)
    below, pairs = below_clicks(look.ubm, K)
    assert below + 2 / np.sqrt(pairs) < DEPENDENT_CLICKS[0] and below > 0.15
    # Position-based users examine below a click as at the same rank with none above.
    base = fed(lambda a, rng: pbm(a, rng)).look
    assert below_clicks(base.ubm, K)[0] > DEPENDENT_CLICKS[1] + 0.1 and base.valid, base.checks


def test_position_based_users_pass_the_fit_test_with_either_model():
    tables = fed(lambda a, rng: pbm(a, rng))
    look = tables.look
    assert look.valid, (look.reason, look.checks)
    fit = split(tables.vector(), K)[2]
    for m in (0, 1):
        for cls in (0, 1):
            assert 0.85 < FitLayout(K).observed_over_expected(fit, m, cls, 30) < 1.15
    true = 1.0 / np.arange(1, K + 1) ** 0.9
    assert np.abs(np.array(look.pbm.relative) - true).max() < 0.08


def test_a_ranker_reacting_to_clicks_is_found_and_withdraws_the_series():
    layout = FitLayout(K)
    still = split(fed(lambda a, rng: pbm(a, rng), queries=3000).vector(), K)[2]
    assert abs(layout.reaction_contrast(still, 300)) < 0.25
    tables = fed(lambda a, rng: pbm(a, rng), queries=3000, react=1.0)
    fit = split(tables.vector(), K)[2]
    assert layout.reaction_contrast(fit, 300) > 1.0
    assert tables.look.reason == "click_reactive_ranker"


def test_the_probe_compares_the_same_document_at_the_same_earlier_rank():
    probe = ReactionProbe(100)
    # "b" at rank 2: clicked, then at rank 1 next time; not clicked, then at rank 3.
    for clicked, later in (({"b"}, ["b", "a", "c"]), (set(), ["a", "c", "b"])) * 3:
        probe.observe("t", ["a", "b", "c"], clicked)
        probe.observe("t", later, set())
    assert probe.h > 0 and probe.hd / probe.h == pytest.approx(2.0)  # rank 1 vs rank 3


def fit_with_calibration(ratio: float, expected: float = 100.0) -> np.ndarray:
    layout = FitLayout(K)
    fit = np.zeros(layout.size)
    for cls in (0, 1):
        i = layout.calibration(0, cls)
        fit[i], fit[i + 1] = expected * (ratio if cls else 1.0), expected
    return fit


def test_withdraw_and_restore_on_separate_thresholds():
    p = Propensities([1.0, 0.5, 0.3] + [0.2] * 7, [1000.0] * K, 1)
    ubm = initial(K, slots(K)).ubm
    layout = FitLayout(K)
    look: Look | None = None
    seen = []
    (withdraw_low, _), (restore_low, _) = CALIBRATION
    noise = CALIBRATION_Z / np.sqrt(100.0)  # the margin at fit_with_calibration's 100 expected clicks
    for ratio in (1.0, withdraw_low - noise + 0.02, withdraw_low - noise - 0.02, restore_low - noise - 0.02,
                  restore_low - noise + 0.02):
        look = judge(p, ubm, fit_with_calibration(ratio), layout, look)
        seen.append(look.reason)
    assert seen == ["ok", "ok", "poor_fit", "poor_fit", "ok"]


def test_the_calibration_is_judged_on_its_noise():
    """The bounds widen by CALIBRATION_Z SDs of the ratio's noise (1/√expected): at 30
    expected clicks 0.6 − 3·0.18 = 0.05, at 10,000 0.57; restoring keeps its stricter bound."""
    margin = CALIBRATION_Z / np.sqrt(MIN_EXPECTED)
    assert CALIBRATION_Z == 3.0 and margin == pytest.approx(0.548, abs=0.001)
    for t, (low, high) in enumerate(CALIBRATION):
        assert not miscalibrated(low - margin + 0.01, MIN_EXPECTED, t)
        assert miscalibrated(low - margin - 0.01, MIN_EXPECTED, t)
        assert not miscalibrated(high + margin - 0.01, MIN_EXPECTED, t)
        assert miscalibrated(high + margin + 0.01, MIN_EXPECTED, t)
        assert miscalibrated(low - 0.04, 10_000.0, t) and not miscalibrated(low - 0.02, 10_000.0, t)
    assert not miscalibrated(None, 0.0, 0)
    # Hysteresis: between the withdraw and the restore bound, a valid series stays, a
    # withdrawn one stays withdrawn.
    between = CALIBRATION[1][0] - margin - 0.05
    assert not miscalibrated(between, MIN_EXPECTED, 0) and miscalibrated(between, MIN_EXPECTED, 1)


def test_implausible_propensities_withdraw():
    layout = FitLayout(K)
    ubm = initial(K, slots(K)).ubm
    fit = fit_with_calibration(1.0)
    rising = Propensities([1.0, 0.5, 0.4, 0.3, 0.3, 0.3, 0.4, 0.6, 1.2, 2.57], [1000.0] * K, 1)
    assert judge(rising, ubm, fit, layout, None).reason == "implausible_propensities"
    noisy = Propensities([1.0, 0.5, 0.45, 0.47, 0.3, 0.31, 0.2, 0.22, 0.15, 0.16], [1000.0] * K, 1)
    assert judge(noisy, ubm, fit, layout, None).reason == "ok"
    thin = Propensities([None] * K, [10.0] * K, 0)
    assert judge(thin, ubm, fit, layout, None).reason == "insufficient_support"


def test_a_stored_look_reads_back_and_garbage_reads_as_none():
    p = Propensities([1.0, 0.5] + [None] * 8, [500.0] * K, 3)
    look = initial(K, slots(K))._replace(pbm=p, model="pbm", reason="poor_fit", perplexity={"pbm": 1.3, "ubm": 1.2},
                                          at=1_800_000_000.25)
    back = from_fields(to_fields(look), K, slots(K))
    assert back is not None and back.pbm.relative == p.relative and back.reason == "poor_fit"
    assert back.perplexity == {"pbm": 1.3, "ubm": 1.2} and back.at == 1_800_000_000.25
    # An older version's record (pbm only): what it exported, pbm and ok, no time.
    old = from_fields({"relative": to_fields(look)["relative"], "support": to_fields(look)["support"]}, K, slots(K))
    assert old is not None and old.model == "pbm" and old.reason == "ok" and old.at == 0.0
    for at in ("nan", "inf", "-5", "1e400", "x", "1" * 40):  # a time that is not one: none
        assert from_fields({**to_fields(look), "at": at}, K, slots(K)).at == 0.0
    for bad in ({"relative": "[1.0"}, {"relative": '"x"', "support": "[]"}, {"relative": "[NaN]" * 1},
                {**to_fields(look), "reason": "lies"}, {**to_fields(look), "perplexity": "[1]"}, {}):
        out = from_fields(bad, K, slots(K))
        assert out is None or out.reason in ("ok", "insufficient_support", "poor_fit")


def test_an_older_pbm_only_vector_is_padded():
    old = np.arange(2 * K * K, dtype=float)
    new = upgrade(old, K)
    assert len(new) == vector_size(K) and (new[:len(old)] == old).all() and not new[len(old):].any()
    assert not upgrade(np.ones(7), K).any()


def test_a_ranker_demoting_clicked_results_withdraws_the_series_too():
    # ("already seen" rotation: the probe's contrast is negative; the rank depends on clicks)
    tables = fed(lambda a, rng: pbm(a, rng), queries=4000, react=-1.0)
    assert FitLayout(K).reaction_contrast(split(tables.vector(), K)[2], 300) < -1.0
    assert tables.look.reason == "click_reactive_ranker"


def test_bots_clicking_every_result_show_in_the_logged_checks():
    # Not a reason to withdraw (yet): a bound on below_clicks would also withdraw valid
    # traffic mixing shallow and deep examination (1.7-4.3 computed, review of issue 22);
    # the value is in the look's checks, logged.
    def with_bots(attract, rng):  # 5% of the queries: every result clicked
        return list(range(len(attract))) if rng.random() < 0.05 else pbm(attract, rng)
    bots, clean = fed(with_bots).look, fed(lambda a, rng: pbm(a, rng)).look
    assert bots.checks["below_clicks"] > 2.0 and clean.checks["below_clicks"] < 1.2, (bots.checks, clean.checks)


def test_each_check_withdraws_on_its_own():
    layout = FitLayout(K)
    ubm = initial(K, slots(K)).ubm
    ok = Propensities([1.0, 0.5, 0.3] + [0.2] * 7, [1000.0] * K, 1)
    assert judge(ok, ubm, fit_with_calibration(1.0), layout, None).reason == "ok"
    # A rise alone (every rank below 1.2 of rank 1): MAX_RISE's.
    rises = Propensities([1.0, 0.5, 0.85, 0.4, 0.3, 0.3, 0.25, 0.2, 0.2, 0.2], [1000.0] * K, 1)
    assert judge(rises, ubm, fit_with_calibration(1.0), layout, None).reason == "implausible_propensities"
    # Too many clicks below a click for the model: the calibration's upper bound.
    assert judge(ok, ubm, fit_with_calibration(2.0, 1000.0), layout, None).reason == "poor_fit"
    # A stored sum that is not a number.
    nan = Propensities([1.0, float("nan")] + [0.2] * 8, [1000.0] * K, 1)
    assert judge(nan, ubm, fit_with_calibration(1.0), layout, None).reason == "implausible_propensities"
    # Before any look: nothing estimated, and so said.
    assert initial(K, slots(K)).reason == "insufficient_support"


@pytest.mark.parametrize("bad", ["[" + str(10 ** 400) + "]", "[" * 200_000])
def test_a_hostile_stored_look_is_unreadable_not_a_crash(bad):
    """Review s10 M3: a 400-digit number (OverflowError), a deep nesting (RecursionError):
    no look, never an exception."""
    look = to_fields(initial(K, slots(K)))
    assert from_fields({**look, "relative": bad}, K, slots(K)) is None
    assert from_fields({**look, "support": bad}, K, slots(K)) is None


@pytest.mark.parametrize("bad", ['{"pbm": ' + "9" * 400 + "}", "[" * 100_000, '{"pbm": NaN, "ubm": true}', "[1.5]",
                                 '{"pbm": 1.5' + " " * 200_000 + "}"])
def test_a_hostile_stored_perplexity_is_none_not_a_crash_of_the_look_or_the_scrape(bad):
    """Review s11 M2: the same look's perplexity field was read unguarded: a deep nesting raised
    out of every replica's look, a 400-digit integer out of every scrape (math.isfinite)."""
    from rankmeter.exporter import click_fit_metrics
    stored = {**to_fields(fed(lambda a, rng: pbm(a, rng), queries=1200, looks=2).look), "perplexity": bad}
    look = from_fields(stored, K, slots(K))
    assert look is not None and look.perplexity == {"pbm": None, "ubm": None}
    assert [m.name for m in click_fit_metrics(look)][:2] == ["rankmeter_debias_valid", "rankmeter_click_model_perplexity"]
    good = from_fields({**stored, "perplexity": '{"pbm": 1.25, "ubm": 1.5}'}, K, slots(K))
    assert good is not None and good.perplexity == {"pbm": 1.25, "ubm": 1.5}


def test_a_hostile_stored_look_is_logged_once_however_often_it_is_read(caplog, monkeypatch):
    from rankmeter import logs
    monkeypatch.setattr(logs, "_said", set())
    look = {**to_fields(initial(K, slots(K))), "relative": "[" * 200_000}
    with caplog.at_level("ERROR"):
        for _ in range(3):
            assert from_fields(look, K, slots(K)) is None
    said = [r for r in caplog.records if r.getMessage() == "skipping an unreadable stored look"]
    assert len(said) == 1 and "200000 characters" in said[0].why
