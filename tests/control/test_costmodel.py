"""The online cost model: converges, follows drift, keeps to its seed on little data (no engine)."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.planner.costmodel import CostModel, Profile

TRUE = Profile(prefill_base_s=0.02, prefill_per_token_s=2e-4, step_base_s=0.006,
               step_per_running_s=0.0008, step_per_kkv_s=0.0005)


def feed(model: CostModel, truth: Profile, n: int, rng: np.random.Generator,
         noise: float = 0.05, scale: float = 1.0) -> None:
    for _ in range(n):
        tokens = int(rng.integers(50, 2000))
        model.observe(tokens, scale * truth.prefill_seconds(tokens)
                      * (1 + noise * rng.standard_normal()))
        running = int(rng.integers(1, 40))
        kv = running * int(rng.integers(100, 2000))
        model.observe_step(running, kv, scale * truth.step_seconds(running, kv)
                           * (1 + noise * rng.standard_normal()))


def test_converges_on_synthetic_data_from_a_wrong_seed():
    model = CostModel(Profile())  # the default seed is off by 2-3x on every coefficient
    feed(model, TRUE, 300, np.random.default_rng(0))
    for n in (16, 100, 1000, 2000):
        assert model.prefill_seconds(n) == pytest.approx(TRUE.prefill_seconds(n), rel=0.03)
    for running, kv in ((1, 100), (10, 10_000), (40, 60_000)):
        assert model.step_seconds(running, kv) == pytest.approx(
            TRUE.step_seconds(running, kv), rel=0.03)
    fitted = model.profile()
    assert fitted.prefill_per_token_s == pytest.approx(TRUE.prefill_per_token_s, rel=0.05)
    assert fitted.step_per_running_s == pytest.approx(TRUE.step_per_running_s, rel=0.1)


def test_follows_a_drift_to_a_slower_worker():
    rng = np.random.default_rng(1)
    model = CostModel(TRUE)
    feed(model, TRUE, 100, rng)
    feed(model, TRUE, 250, rng, scale=1.5)  # a neighbour took half the core
    for n in (100, 1000, 2000):
        assert model.prefill_seconds(n) == pytest.approx(1.5 * TRUE.prefill_seconds(n), rel=0.05)
    assert model.step_seconds(10, 10_000) == pytest.approx(
        1.5 * TRUE.step_seconds(10, 10_000), rel=0.05)


def test_with_no_samples_it_predicts_its_seed():
    model = CostModel(TRUE)
    for n in (1, 100, 2000):
        assert model.prefill_seconds(n) == pytest.approx(TRUE.prefill_seconds(n))
    assert model.step_seconds(7, 5000) == pytest.approx(TRUE.step_seconds(7, 5000))
    assert model.snapshot()["prefill"]["samples"] == 0


def test_one_sample_moves_the_seed_only_part_way():
    model = CostModel(TRUE)
    model.observe(1000, 4 * TRUE.prefill_seconds(1000))  # one very slow batch
    for n in (16, 100, 1000, 2000):
        ratio = model.prefill_seconds(n) / TRUE.prefill_seconds(n)
        assert 1.0 < ratio < 1.6


def test_one_outlier_does_not_move_a_converged_model():
    rng = np.random.default_rng(2)
    model = CostModel(Profile())
    feed(model, TRUE, 200, rng)
    before = model.prefill_seconds(100), model.step_seconds(5, 5000)
    model.observe(100, 1.0)  # a GC pause: 25x the truth
    model.observe_step(5, 5000, 0.5)
    assert model.prefill_seconds(100) == pytest.approx(before[0], rel=0.05)
    assert model.step_seconds(5, 5000) == pytest.approx(before[1], rel=0.05)


def test_never_predicts_negative_time():
    # Data whose best line has a negative intercept: short prefills would come out negative.
    model = CostModel(Profile(prefill_base_s=0.0, prefill_per_token_s=1e-4))
    for n in range(200, 2001, 50):
        model.observe(n, max(1e-4, -0.05 + 1e-4 * n))
    assert model.profile().prefill_base_s < 0  # the fit went negative...
    assert model.prefill_seconds(1) >= 0.0  # ...the prediction does not
    assert model.prefill_seconds(0) >= 0.0
    assert model.step_seconds(0, 0) >= 0.0


def test_ignores_impossible_samples():
    model = CostModel(TRUE)
    model.observe(0, 0.1)
    model.observe(100, -1.0)
    model.observe(100, float("nan"))
    model.observe_step(0, 0, 0.01)
    model.observe_step(3, 100, float("inf"))
    snap = model.snapshot()
    assert snap["prefill"]["samples"] == 0 and snap["decode"]["samples"] == 0


def test_handoff_mean_follows_observations():
    model = CostModel(Profile(handoff_s=0.05))
    for _ in range(200):
        model.observe_handoff(0.02)
    assert model.handoff_s == pytest.approx(0.02, rel=0.01)
    assert model.snapshot()["handoff_samples"] == 200


def test_snapshot_shows_coefficients_in_ms_and_counts():
    model = CostModel(TRUE)
    feed(model, TRUE, 10, np.random.default_rng(3), noise=0.0)
    snap = model.snapshot()
    assert snap["prefill"]["samples"] == 10 and snap["decode"]["samples"] == 10
    assert snap["prefill"]["base_ms"] == pytest.approx(20.0, rel=0.05)
    assert snap["prefill"]["per_1k_tokens_ms"] == pytest.approx(200.0, rel=0.05)
    assert snap["decode"]["step_base_ms"] == pytest.approx(6.0, rel=0.05)
    assert snap["seed"] == TRUE.source


def test_context_term_is_fit_when_seeded_with_one():
    truth = Profile(prefill_base_s=0.01, prefill_per_token_s=1e-4, prefill_per_token_ctx_s=5e-5)
    model = CostModel(Profile(prefill_per_token_ctx_s=1e-5))
    rng = np.random.default_rng(4)
    for _ in range(300):
        new, cached = int(rng.integers(50, 1000)), int(rng.integers(0, 4000))
        model.observe(new, truth.prefill_seconds(new, new + cached), context=new + cached)
    assert model.prefill_seconds(500, 4500) == pytest.approx(
        truth.prefill_seconds(500, 4500), rel=0.03)
    assert model.profile().prefill_per_token_ctx_s == pytest.approx(5e-5, rel=0.1)


def test_profile_json_round_trip_and_tolerates_unknown_keys():
    p = Profile(prefill_base_s=0.1, step_per_kkv_s=0.002, chunk_tokens=512, source="bench x")
    assert Profile.from_json(p.to_json()) == p
    text = p.to_json().replace('"source"', '"from_the_future": 1, "source"')
    assert Profile.from_json(text) == p
    assert Profile.from_json({"handoff_s": 0.02}) == Profile(handoff_s=0.02)
