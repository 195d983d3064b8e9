"""The positional acceptance model and SGLang's dynamic tree, checked against brute force."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treetune.config import TreeConfig
from treetune.perfmodel import Acceptance, build_tree, expected_accept_length, sample_accepted


def brute_force_accept_length(config: TreeConfig, acceptance: Acceptance) -> float:
    """Build SGLang's verify set from rank paths, then enumerate every target outcome."""
    s, k, n = config.steps, config.topk, config.draft_tokens
    p = acceptance.matrix(s, k)

    def score(path):
        return math.prod(p[d][r - 1] for d, r in enumerate(path))

    pool, kept = [], [()]
    for _ in range(s):
        layer = [(*parent, r) for parent in kept for r in range(1, k + 1)]
        pool += layer
        kept = sorted(layer, key=lambda path: -score(path))[:k]
    verify = set(sorted(pool, key=lambda path: (-score(path), len(path)))[: n - 1])

    expected = 0.0
    outcomes = [*range(1, k + 1), None]  # the target's token: rank r, or not drafted
    for ranks in itertools.product(outcomes, repeat=s):
        prob = math.prod(
            p[d][r - 1] if r is not None else 1.0 - p[d].sum() for d, r in enumerate(ranks)
        )
        accepted = 0
        while accepted < s and ranks[accepted] is not None and \
                tuple(ranks[: accepted + 1]) in verify:
            accepted += 1
        expected += prob * accepted
    return 1.0 + expected


SMALL = Acceptance(top1=0.62, top1_decay=0.15, rank_mass=0.7, rank_ratio=0.45)


@pytest.mark.parametrize(
    ("steps", "topk", "draft_tokens"),
    [(1, 3, 4), (2, 2, 5), (3, 2, 6), (3, 3, 10), (2, 3, 12), (4, 2, 9), (3, 1, 4)],
)
def test_expected_accept_length_equals_brute_force_enumeration(steps, topk, draft_tokens):
    config = TreeConfig.of(steps, topk, draft_tokens)
    assert expected_accept_length(config, SMALL) == pytest.approx(
        brute_force_accept_length(config, SMALL), abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    top1=st.floats(0.05, 0.95), decay=st.floats(0, 0.5), mass=st.floats(0, 1),
    ratio=st.floats(0.05, 0.95), steps=st.integers(1, 3), topk=st.integers(1, 3),
    data=st.data(),
)
def test_brute_force_agrees_for_random_profiles(top1, decay, mass, ratio, steps, topk, data):
    acceptance = Acceptance(top1=top1, top1_decay=decay, rank_mass=mass, rank_ratio=ratio)
    pool = topk + (steps - 1) * topk * topk
    n = data.draw(st.integers(2, pool + 1))
    config = TreeConfig.of(steps, topk, n)
    assert expected_accept_length(config, acceptance) == pytest.approx(
        brute_force_accept_length(config, acceptance), abs=1e-9)


def test_chain_accept_length_is_the_sum_of_prefix_products():
    acc = Acceptance(top1=0.6, top1_by_position=(0.600, 0.567, 0.550, 0.538, 0.526))
    expected = 1 + sum(math.prod((0.600, 0.567, 0.550, 0.538, 0.526)[:i]) for i in range(1, 6))
    assert expected_accept_length(TreeConfig.of(5, 1, 6), acc) == pytest.approx(expected)


def test_rank_probabilities_never_exceed_one_per_depth():
    for acc in (SMALL, Acceptance(top1=0.98, rank_mass=1.0, rank_ratio=0.95)):
        assert (acc.matrix(8, 8).sum(axis=1) <= 1 + 1e-12).all()


def test_verify_set_is_closed_under_parents():
    tree = build_tree(TreeConfig.of(4, 4, 20), SMALL)
    for parent, depth in zip(tree.parent, tree.depth, strict=True):
        assert (parent == -1 and depth == 1) or tree.depth[parent] == depth - 1


def test_wider_trees_help_only_when_lower_ranks_carry_mass():
    chain_like = Acceptance(top1=0.6, rank_mass=0.0)
    branching = Acceptance(top1=0.6, rank_mass=0.8)
    chain, tree = TreeConfig.of(3, 1, 4), TreeConfig.of(3, 4, 8)
    assert expected_accept_length(tree, chain_like) == pytest.approx(
        expected_accept_length(chain, chain_like))
    assert expected_accept_length(tree, branching) > expected_accept_length(chain, branching)


def test_sampled_accept_lengths_average_to_the_expectation():
    config = TreeConfig.of(3, 4, 8)
    tree = build_tree(config, SMALL)
    draws = sample_accepted(tree, SMALL, np.random.default_rng(7), 200_000)
    assert draws.max() <= config.steps and draws.min() >= 0
    stderr = draws.std() / math.sqrt(len(draws))
    assert abs(1 + draws.mean() - tree.expected_accept_length) < 4 * stderr
