"""SGLang's per-method rules, kept in its backend module: which algorithm needs a draft
model, which knobs shape its draft, what it resolves to, and which profile method times it."""

import itertools

import pytest

from treetune.backends import LaunchSpec
from treetune.backends.sglang import (
    ALGORITHMS,
    KNOWN_ALGORITHMS,
    NGRAM,
    NGRAM_BREADTH_FLAG,
    check_algorithm,
    method_knobs,
    method_tree_problem,
    needs_draft_model,
    ngram_tree,
    profile_method,
    resolved_algorithm,
    server_args,
)
from treetune.config import TreeConfig
from treetune.errors import TreetuneError
from treetune.perfmodel import DEFAULT_METHOD, load_profile


def spec(algorithm: str, draft: str | None = "org/draft") -> LaunchSpec:
    return LaunchSpec(model_path="Qwen/Qwen3.5-397B-A17B", draft_model_path=draft,
                      algorithm=algorithm, tp=8)


def test_every_known_algorithm_is_an_eagle_tree_algorithm_or_ngram():
    assert set(KNOWN_ALGORITHMS) == {"EAGLE3", "EAGLE", "NEXTN", "STANDALONE", NGRAM}
    assert NGRAM not in ALGORITHMS  # a study tunes EAGLE trees; NGRAM is not one


@pytest.mark.parametrize(("algorithm", "needs"), [
    ("EAGLE3", True), ("EAGLE", True), ("STANDALONE", True), ("NEXTN", False), (NGRAM, False)])
def test_only_draft_heads_and_standalone_models_need_a_draft_model_path(algorithm, needs):
    assert needs_draft_model(algorithm) is needs
    if needs:
        with pytest.raises(TreetuneError, match=f"{algorithm} needs a draft model path"):
            check_algorithm(algorithm, None)
    else:
        check_algorithm(algorithm, None)


def test_sglang_runs_nextn_as_eagle_and_everything_else_as_itself():
    assert resolved_algorithm("NEXTN") == "EAGLE"
    assert [resolved_algorithm(a) for a in ("EAGLE3", "EAGLE", "STANDALONE", NGRAM)] == [
        "EAGLE3", "EAGLE", "STANDALONE", NGRAM]


def test_eagle_and_eagle3_are_timed_by_the_profiles_draft_head_the_others_by_their_entry():
    assert profile_method("EAGLE3") == profile_method("EAGLE") == DEFAULT_METHOD
    assert [profile_method(a) for a in ("NEXTN", "STANDALONE", NGRAM)] == [
        "NEXTN", "STANDALONE", NGRAM]
    # The shipped Qwen3.5 profile knows the methods its published comparison used.
    profile = load_profile("qwen3.5-397b-a17b-h200")
    for algorithm in ("EAGLE3", "EAGLE", "NEXTN", NGRAM):
        profile.method(profile_method(algorithm))


def test_nextn_shares_the_eagle_tree_knobs_and_ngram_has_no_steps_or_topk_tree():
    tree = ("--speculative-num-steps", "--speculative-eagle-topk",
            "--speculative-num-draft-tokens")
    for algorithm in ALGORITHMS:
        assert method_knobs(algorithm) == tree
    assert method_knobs(NGRAM) == ("--speculative-num-draft-tokens", NGRAM_BREADTH_FLAG)


def test_an_ngram_server_is_its_draft_tokens_and_breadth_in_canonical_form():
    assert ngram_tree(12, 10) == TreeConfig(11, 10, 12)  # SGLang's defaults
    assert ngram_tree(5, 1) == TreeConfig(4, 1, 5)  # breadth 1: a chain
    assert method_tree_problem(NGRAM, ngram_tree(8, 3)) is None
    problem = method_tree_problem(NGRAM, TreeConfig(3, 4, 8))
    assert problem is not None and "no steps knob" in problem and "(7,4,8)" in problem


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_eagle_tree_algorithms_take_every_valid_tree(algorithm):
    for config in (TreeConfig(3, 1, 4), TreeConfig(3, 4, 8), TreeConfig(5, 8, 32)):
        assert method_tree_problem(algorithm, config) is None
    assert "not one of" in method_tree_problem("MEDUSA", TreeConfig(3, 1, 4))


def test_nextn_launches_with_the_tree_knobs_and_no_draft_model_path():
    pairs = dict(itertools.pairwise(server_args(TreeConfig(3, 1, 4), spec("NEXTN", None))))
    assert pairs["--speculative-algorithm"] == "NEXTN"
    assert "--speculative-draft-model-path" not in pairs
    assert (pairs["--speculative-num-steps"], pairs["--speculative-eagle-topk"],
            pairs["--speculative-num-draft-tokens"]) == ("3", "1", "4")


def test_ngram_launches_with_its_draft_tokens_and_breadth_only():
    args = server_args(ngram_tree(8, 4), spec(NGRAM, None))
    pairs = dict(itertools.pairwise(args))
    assert pairs["--speculative-algorithm"] == NGRAM
    assert pairs["--speculative-num-draft-tokens"] == "8"
    assert pairs[NGRAM_BREADTH_FLAG] == "4"
    for absent in ("--speculative-num-steps", "--speculative-eagle-topk",
                   "--speculative-draft-model-path"):
        assert absent not in args


def test_a_non_canonical_ngram_tree_is_refused_before_launch():
    with pytest.raises(TreetuneError, match="no steps knob"):
        server_args(TreeConfig(3, 4, 8), spec(NGRAM, None))
