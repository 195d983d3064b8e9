"""Measurement noise: per-launch factors and drift have the configured spread."""

import numpy as np
import pytest

from treetune.perfmodel import Drift, NoiseModel, lognormal_factor


def test_lognormal_factors_have_mean_one_and_the_configured_cv():
    rng = np.random.default_rng(1)
    draws = np.array([lognormal_factor(0.03, rng) for _ in range(40_000)])
    assert draws.mean() == pytest.approx(1.0, abs=0.001)
    assert draws.std() == pytest.approx(0.03, rel=0.05)


def test_zero_noise_means_exactly_one():
    model = NoiseModel(0.0, 0.0)
    rng = np.random.default_rng(0)
    assert model.launch_factor(rng) == 1.0
    assert model.drift(rng).advance(1.0) == 1.0


def test_drift_is_correlated_over_short_times_and_spreads_over_long_ones():
    rng = np.random.default_rng(2)
    drift = Drift(0.05, correlation_s=5.0, rng=rng)
    short = [drift.advance(0.01) for _ in range(200)]
    assert np.std(short) < 0.01  # two seconds of 10 ms rounds barely move
    long = [drift.advance(20.0) for _ in range(5000)]
    assert np.std(long) == pytest.approx(0.05, rel=0.1)
