"""Search spaces: shipped files, enumeration, and errors naming the file and key."""

import itertools

import pytest

from treetune.config import BASELINE, TreeConfig
from treetune.errors import ConfigFileError
from treetune.space import load_space


def test_default_space_is_larger_than_sglangs_grid():
    default = load_space("default").configs()
    grid = load_space("bench-speculative").configs()
    assert set(grid) <= set(default)
    assert len(default) > 10 * len(grid)
    assert {c.steps for c in default} == set(range(1, 9))
    assert {c.topk for c in default} == {1, 2, 3, 4, 6, 8}
    assert max(c.draft_tokens for c in default) == 64


def test_narrow_space_holds_only_chains():
    configs = load_space("narrow").configs()
    assert configs and all(c.topk == 1 and c.draft_tokens == c.steps + 1 for c in configs)


def test_bench_speculative_space_is_exactly_sglangs_grid():
    # bench_speculative.py: steps x topk x draft tokens, skip steps*topk+1 < N, plus the
    # all-zero baseline: 48 launches, of which 4 chains duplicate another chain.
    raw = [(s, k, n) for s, k, n in itertools.product((1, 3, 5, 7), (1, 2, 4, 8),
                                                      (2, 4, 8, 16, 32)) if s * k + 1 >= n]
    assert len(raw) + 1 == 48
    space = load_space("bench-speculative")
    assert set(space.configs()) == {TreeConfig.of(*t) for t in raw}
    assert len(space.configs()) == 43
    assert BASELINE not in space.configs()  # the study measures it, whatever the space


def test_enumeration_yields_each_canonical_config_once():
    configs = load_space("default").configs()
    assert len(configs) == len(set(configs))
    assert configs == sorted(configs)


def test_flags_in_a_space_are_refused_on_their_line_pointing_to_server_flags(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("steps: [3]\ntopk: [1, 4]\ndraft_tokens: [8]\n"
                    "flags:\n  --attention-backend: [triton, flashinfer]\n")
    with pytest.raises(ConfigFileError) as info:
        load_space(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 4: key 'flags': SGLang flags are not searched")
    assert "server_flags" in message and "\n" not in message


def test_a_space_cannot_leave_out_the_baseline(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("steps: [3]\ntopk: [1]\ninclude_baseline: false\ndraft_tokens: [4]\n")
    with pytest.raises(ConfigFileError) as info:
        load_space(path)
    assert str(info.value) == (f"{path}, line 3: key 'include_baseline': the baseline is "
                               "always measured: remove include_baseline")


def test_include_baseline_true_is_accepted_since_it_is_what_happens(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("steps: [3]\ntopk: [1]\ndraft_tokens: [4]\ninclude_baseline: true\n")
    assert load_space(path).configs() == [TreeConfig.of(3, 1, 4)]


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("steps: [1]\ntopk: [2]\ndraft_tokens: [3]\ntopkk: [1]\n", "topkk", "unknown key"),
        ("steps: [1]\ntopk: [0, 2]\ndraft_tokens: [3]\n", "topk", ">= 1"),
        ("steps: [1]\ntopk: [2]\ndraft_tokens: [30, 40]\n", "draft_tokens", "empty"),
        ("steps: {min: 1}\ntopk: [2]\ndraft_tokens: [3]\n", "steps", "min and max"),
        ("steps: [1]\ntopk: [two]\ndraft_tokens: [3]\n", "topk", "integers"),
        ("steps: [1]\ntopk: [2]\n", "draft_tokens", "missing"),
    ],
)
def test_bad_space_files_name_the_file_and_key(tmp_path, text, key, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigFileError) as info:
        load_space(path)
    message = str(info.value)
    assert str(path) in message and f"'{key}'" in message and fragment in message


def test_misspelt_key_gets_a_suggestion(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("steps: [1]\ntopk: [2]\ndraft_token: [3]\n")
    with pytest.raises(ConfigFileError, match="did you mean 'draft_tokens'"):
        load_space(path)


def test_unknown_space_name_lists_the_shipped_ones():
    with pytest.raises(Exception, match="default"):
        load_space("defualt")
