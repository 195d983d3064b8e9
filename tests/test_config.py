"""SGLang's tree-config rules: validity, canonical form, KV slots."""

import pytest

from treetune.config import BASELINE, TreeConfig, candidate_pool_size, is_valid, tree_problem
from treetune.errors import InvalidTreeError


@pytest.mark.parametrize(
    ("steps", "topk", "draft_tokens"),
    [(3, 4, 8), (5, 1, 6), (1, 8, 9), (2, 2, 7), (8, 8, 64), (3, 1, 4)],
)
def test_valid_trees_are_accepted(steps, topk, draft_tokens):
    assert is_valid(steps, topk, draft_tokens)
    config = TreeConfig.of(steps, topk, draft_tokens)
    assert (config.steps, config.topk) == (steps, topk)


@pytest.mark.parametrize(
    ("steps", "topk", "draft_tokens", "fragment"),
    [
        (0, 4, 8, "steps must be >= 1"),
        (3, 0, 8, "topk must be >= 1"),
        (3, 4, 1, "draft_tokens must be >= 2"),
        (1, 4, 6, "too large"),  # pool 4 -> at most 5 tokens
        (2, 2, 8, "too large"),  # pool 2 + 4 = 6 -> at most 7
    ],
)
def test_invalid_trees_are_refused_with_the_reason(steps, topk, draft_tokens, fragment):
    assert fragment in tree_problem(steps, topk, draft_tokens)
    with pytest.raises(InvalidTreeError, match=fragment):
        TreeConfig.of(steps, topk, draft_tokens)


def test_validity_bound_is_the_candidate_pool_plus_root():
    for steps in range(1, 6):
        for topk in range(2, 6):
            pool = topk + (steps - 1) * topk**2
            assert candidate_pool_size(steps, topk) == pool
            assert is_valid(steps, topk, pool + 1)
            assert not is_valid(steps, topk, pool + 2)


def test_chains_are_canonicalized_to_steps_plus_one():
    assert TreeConfig.of(5, 1, 2) == TreeConfig.of(5, 1, 6) == TreeConfig.of(5, 1, 40)
    assert TreeConfig.of(5, 1, 2).draft_tokens == 6
    assert len({TreeConfig.of(3, 1, n) for n in range(2, 20)}) == 1


def test_constructor_refuses_non_canonical_chains():
    with pytest.raises(InvalidTreeError, match="not canonical"):
        TreeConfig(3, 1, 8)


def test_kv_slots_per_round_is_max_of_steps_times_topk_and_draft_tokens():
    assert TreeConfig.of(3, 4, 8).kv_slots_per_round == 12
    assert TreeConfig.of(2, 4, 16).kv_slots_per_round == 16
    assert TreeConfig.of(5, 1, 6).kv_slots_per_round == 6


def test_parse_reads_a_command_line_triple():
    assert TreeConfig.parse("3,4,8") == TreeConfig(3, 4, 8)
    assert TreeConfig.parse(" 5, 1, 9 ") == TreeConfig(5, 1, 6)
    with pytest.raises(InvalidTreeError, match="three integers"):
        TreeConfig.parse("3,4")


def test_baseline_is_not_a_tree():
    assert TreeConfig(3, 4, 8) != BASELINE
    assert str(BASELINE) == "baseline"
