"""Physical sanity of the performance model, over whole search spaces."""

import itertools
import statistics

import pytest

from treetune.config import BASELINE, TreeConfig
from treetune.perfmodel import (
    PerfModel,
    build_tree,
    check_memory,
    distinct_experts,
    load_profile,
    shipped_profiles,
)
from treetune.space import load_space

PROFILES = shipped_profiles()
DEFAULT = load_space("default").configs()


def test_three_profiles_ship_including_the_published_study():
    assert {"qwen3-coder-next-h200", "qwen3-8b-h100", "qwen3-30b-a3b-h100"} <= set(PROFILES)
    assert set(load_profile("qwen3-coder-next-h200").datasets) == {
        "mt-bench", "humaneval", "swebench-verified", "terminal-bench"}


@pytest.mark.parametrize("name", PROFILES)
def test_accept_length_never_exceeds_steps_plus_one(name):
    model = PerfModel(load_profile(name))
    for dataset in model.profile.datasets:
        for config in DEFAULT:
            accept = model.accept_length(config, dataset)
            assert 1.0 <= accept <= config.steps + 1 + 1e-12


@pytest.mark.parametrize("name", PROFILES)
def test_accept_length_never_decreases_as_draft_tokens_grow(name):
    model = PerfModel(load_profile(name))
    by_shape: dict[tuple[int, int], list[TreeConfig]] = {}
    for config in DEFAULT:
        by_shape.setdefault((config.steps, config.topk), []).append(config)
    for dataset in model.profile.datasets:
        for configs in by_shape.values():
            lengths = [model.accept_length(c, dataset) for c in sorted(configs)]
            assert all(b >= a - 1e-12 for a, b in itertools.pairwise(lengths))


@pytest.mark.parametrize("name", PROFILES)
def test_baseline_throughput_grows_with_batch_size_sublinearly(name):
    model = PerfModel(load_profile(name))
    batches = [1, 2, 4, 8, 16, 32, 64, 128]
    for dataset in model.profile.datasets:
        tput = [model.throughput(BASELINE, b, dataset) for b in batches]
        assert all(b > a for a, b in itertools.pairwise(tput))
        per_request = [t / b for t, b in zip(tput, batches, strict=True)]
        assert all(b < a for a, b in itertools.pairwise(per_request))


def best_config(model: PerfModel, batch: int):
    datasets = list(model.profile.datasets)

    def mean_speedup(config):
        return statistics.fmean(model.predict(config, d, batch).speedup for d in datasets)

    scored = [(mean_speedup(c), c) for c in DEFAULT]
    score, config = max(scored, key=lambda sc: (sc[0], -sc[1].topk))
    return (BASELINE, 1.0) if score < 1.0 else (config, score)


@pytest.mark.parametrize("name", ["qwen3-8b-h100", "qwen3-coder-next-h200"])
def test_best_config_at_batch_one_is_a_branching_tree(name):
    profile = load_profile(name)
    config, score = best_config(PerfModel(profile), 1)
    assert config is not BASELINE and config.topk > 1 and score > 1.2
    for data in profile.datasets.values():
        tree = build_tree(config, data.acceptance)
        widths = [int((tree.depth == d).sum()) for d in range(1, config.steps + 1)]
        assert max(widths) > 1, "the verify set must branch, not just carry topk > 1"


def test_best_config_for_the_moe_target_at_batch_64_is_a_chain_or_no_speculation():
    config, _ = best_config(PerfModel(load_profile("qwen3-coder-next-h200")), 64)
    assert config is BASELINE or config.topk == 1


def test_moe_experts_touched_grow_with_tokens_and_saturate():
    counts = [distinct_experts(n, 512, 10) for n in (1, 8, 32, 256, 4096)]
    assert counts[0] == pytest.approx(10)
    assert all(b > a for a, b in itertools.pairwise(counts))
    assert counts[-1] == pytest.approx(512, rel=1e-3)


def test_wide_trees_cost_more_to_verify_at_large_batch_on_moe():
    model = PerfModel(load_profile("qwen3-coder-next-h200"))
    wide, narrow = TreeConfig.of(3, 4, 8), TreeConfig.of(5, 1, 6)
    for dataset in model.profile.datasets:
        assert model.round_time(wide, 32, dataset).verify_s > \
            model.round_time(narrow, 32, dataset).verify_s


def test_the_draft_extend_reads_the_accepted_path_whatever_the_tree_size():
    # SGLang sizes the draft-extend pass at steps + 1 tokens a request: draft time depends
    # on steps and topk, never on draft_tokens.
    model = PerfModel(load_profile("qwen3-30b-a3b-h100"))
    narrow, wide = TreeConfig.of(3, 4, 6), TreeConfig.of(3, 4, 20)
    for batch in (1, 64):
        assert model.round_time(narrow, batch, "mt-bench").draft_s == pytest.approx(
            model.round_time(wide, batch, "mt-bench").draft_s)
        assert model.round_time(narrow, batch, "mt-bench").verify_s < \
            model.round_time(wide, batch, "mt-bench").verify_s


def test_memory_model_marks_large_trees_out_of_memory_at_high_concurrency():
    profile = load_profile("qwen3-30b-a3b-h100")
    big, small = TreeConfig.of(2, 8, 44), TreeConfig.of(3, 1, 4)
    assert not check_memory(profile, big, 128).fits
    assert check_memory(profile, small, 128).fits
    assert check_memory(profile, BASELINE, 128).fits
    assert check_memory(profile, big, 16).fits
    assert "out of memory" in check_memory(profile, big, 128).reason
    model = PerfModel(profile)
    assert model.predict(big, "mt-bench", 128).oom
    assert not model.predict(big, "mt-bench", 8).oom
