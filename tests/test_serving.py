"""Whole requests under load (`treetune.perfmodel.serving`): what a benchmark of the
emulator measures, beyond the steady state of decoding. Pure model checks; the emulator's
agreement with them is `test_predict_agreement.py` (and, with numbers,
`benchmarks/predict_agreement.py`)."""

from __future__ import annotations

import numpy as np
import pytest

from treetune.config import BASELINE, TreeConfig
from treetune.perfmodel import PerfModel, Shape, load_profile
from treetune.perfmodel.serving import rounds_needed

PROFILE = "qwen3-8b-h100"
DATASET = "sharegpt"
TREE = TreeConfig(3, 4, 8)
SHORT = Shape(12, 256)
LONG = Shape(512, 1024)


@pytest.fixture(scope="module")
def model() -> PerfModel:
    return PerfModel(load_profile(PROFILE))


@pytest.mark.parametrize("config", [BASELINE, TREE, TreeConfig(5, 1, 6)])
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_whole_requests_reduce_to_the_steady_state_when_outputs_are_long_and_prompts_short(
        model, config, batch):
    served = model.closed_loop(config, DATASET, Shape(1, 200_000), batch)
    assert served.output_tok_s == pytest.approx(model.throughput(config, batch, DATASET),
                                                rel=2e-3)
    assert served.running == pytest.approx(batch, rel=1e-3)


def test_at_batch_one_a_closed_loop_serves_one_request_after_another(model):
    gains = model.gains_distribution(TREE, DATASET)
    rounds = rounds_needed(gains, SHORT.output_tokens - 1)
    request_s = (model.prefill_time(TREE, 1, SHORT.prompt_tokens, DATASET)
                 + rounds * model.round_time(TREE, 1, DATASET).total_s)
    served = model.closed_loop(TREE, DATASET, SHORT, 1)
    assert served.output_tok_s == pytest.approx(SHORT.output_tokens / request_s)
    assert served.tpot_s == pytest.approx(
        rounds * model.round_time(TREE, 1, DATASET).total_s / (SHORT.output_tokens - 1))


def test_short_outputs_pay_prefill_and_turnover_that_speculation_does_not_speed_up(model):
    for batch in (8, 32):
        steady = model.predict(TREE, DATASET, batch).speedup
        short = model.predict_serving(TREE, DATASET, SHORT, batch=batch).speedup
        long = model.predict_serving(TREE, DATASET, LONG, batch=batch).speedup
        assert short < long < steady
        assert short < 0.97 * steady  # the measured gap: 6% at batch 8, 9% at 32


def test_a_baseline_started_together_stays_one_cohort_that_leaves_and_returns_together(model):
    served = model.closed_loop(BASELINE, DATASET, SHORT, 8)
    cycle = (model.prefill_time(BASELINE, 1, 12, DATASET)
             + model.prefill_time(BASELINE, 7, 12, DATASET)
             + (SHORT.output_tokens - 1) * model.round_time(BASELINE, 8, DATASET).total_s)
    assert served.output_tok_s == pytest.approx(8 * SHORT.output_tokens / cycle)


def test_more_clients_than_slots_queue_and_their_first_token_waits(model):
    capped = model.closed_loop(TREE, DATASET, SHORT, 48, max_running=32)
    free = model.closed_loop(TREE, DATASET, SHORT, 32)
    assert capped.running == 32
    assert capped.output_tok_s > free.output_tok_s  # a queued successor leaves no slot empty
    assert capped.ttft_s > free.ttft_s + 16 / capped.request_rate * 0.9


def test_rounds_needed_cuts_the_last_round_at_what_the_request_needs():
    assert rounds_needed(np.array([0.0, 1.0]), 255) == 255
    assert rounds_needed(np.array([0.0, 0.0, 0.0, 1.0]), 10) == 4  # 3 + 3 + 3 + 1
    gains = np.array([0.0, 0.5, 0.5])
    assert rounds_needed(gains, 2) == pytest.approx(1.5)
    assert rounds_needed(gains, 10_000) == pytest.approx(10_000 / 1.5, rel=1e-3)


def test_the_gains_are_the_distribution_the_emulator_draws_from(model):
    gains = model.gains_distribution(TREE, DATASET)
    assert gains.sum() == pytest.approx(1.0)
    assert np.dot(np.arange(len(gains)), gains) == pytest.approx(
        model.accept_length(TREE, DATASET))
    drawn = model.sample_accepted(TREE, DATASET, np.random.default_rng(0), 200_000) + 1
    assert np.bincount(drawn, minlength=len(gains)) / drawn.size == pytest.approx(
        gains, abs=5e-3)
    assert list(model.gains_distribution(BASELINE, DATASET)) == [0.0, 1.0]


def test_an_open_loop_below_saturation_delivers_what_arrives(model):
    for config in (BASELINE, TREE):
        served = model.open_loop(config, DATASET, SHORT, 4.0, max_running=32)
        assert not served.saturated
        assert served.output_tok_s == pytest.approx(4.0 * SHORT.output_tokens)
        assert served.request_rate == 4.0


def test_an_open_loop_slows_its_requests_as_the_rate_rises(model):
    tpots = [model.open_loop(TREE, DATASET, SHORT, r, 32).tpot_s for r in (1, 4, 8, 16)]
    assert tpots == sorted(tpots)
    assert tpots[0] > model.round_time(TREE, 1, DATASET).total_s / model.accept_length(
        TREE, DATASET)


def test_an_open_loop_beyond_capacity_is_saturated_and_delivers_a_full_server(model):
    served = model.open_loop(BASELINE, DATASET, SHORT, 16.0, max_running=32)
    assert served.saturated and served.ttft_s == float("inf")
    assert served.request_rate < 16.0
    assert served.running == 32


def test_open_loop_speedup_is_the_baseline_tpot_over_the_configs(model):
    cell = model.predict_serving(TREE, DATASET, SHORT, rate=4.0, max_running_requests=32)
    assert cell.speedup == pytest.approx(cell.baseline.tpot_s / cell.spec.tpot_s)
    assert cell.record()["rate"] == 4.0 and cell.record()["batch"] == 0


def test_a_serving_prediction_needs_exactly_one_of_batch_and_rate(model):
    with pytest.raises(ValueError, match="not both"):
        model.predict_serving(TREE, DATASET, SHORT, batch=8, rate=2.0)
    with pytest.raises(ValueError, match="max_running_requests"):
        model.predict_serving(TREE, DATASET, SHORT, rate=2.0)


@pytest.mark.parametrize("field", ["prompt_tokens", "output_tokens"])
def test_a_shape_needs_positive_whole_token_counts(field):
    values = {"prompt_tokens": 12, "output_tokens": 256, field: 0}
    with pytest.raises(ValueError, match=field):
        Shape(**values)


@pytest.mark.parametrize("mean", [0.3, 4.0, 60.0, 900.0])
def test_a_poisson_over_thousands_of_slots_keeps_only_the_counts_that_weigh(mean):
    """`--max-running-requests 4096` made every open-loop state a sum over 4096 counts
    (minutes per config): the counts kept are those with any weight, the same numbers."""
    from scipy import stats

    from treetune.perfmodel.serving import _poisson

    counts, weights = _poisson(mean, 4095)
    assert len(counts) < 4096 and weights.sum() == pytest.approx(1.0, abs=1e-12)
    exact = stats.poisson.pmf(counts, mean)
    assert np.allclose(weights[:-1], exact[:-1], rtol=0, atol=1e-300)
    assert stats.poisson.sf(counts[-1], mean) < 1e-25  # what was left out
    small, _ = _poisson(mean, 8)  # a cap below the reach still folds the tail into it
    assert list(small) == list(range(9))
