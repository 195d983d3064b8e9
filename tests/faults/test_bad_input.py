"""Bad input is refused before Ray or any server starts, in one paragraph that says what is
wrong, where (file, key and line when it comes from a file) and what to do; exit code 2,
and a traceback only with --debug.

Most cases run `treetune search` in-process with `ray.init` replaced by a function that
fails the test, so a bad input that reaches Ray cannot pass unnoticed."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import pytest
from studykit import run_cli, small_study

from treetune.backends.sglang import check_sglang
from treetune.datasets import DatasetSpec, load_datasets
from treetune.errors import ConfigFileError, TreetuneError
from treetune.space import load_space
from treetune.study.preflight import check_ray_address
from treetune.study.spec import load_study
from treetune.study.storage import StudyStore
from treetune.yamlio import load_yaml

FAST_S = 5.0  # a refusal takes well under this; Ray alone takes longer to start
without_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is not None,
                                    reason="SGLang is installed here")

GOOD = {
    "model": "org/model",
    "draft": "org/draft",
    "datasets": "[mt-bench]",
    "batch": "[1]",
    "budget": "{launches: 3}",
    "backend": "{kind: emulator, profile: qwen3-coder-next-h200}",
}


def write_study(tmp_path: Path, **fields: str | None) -> Path:
    """A study file: GOOD's fields as YAML lines, changed, added or (None) removed."""
    lines = {**GOOD, "output": str(tmp_path / "out"), **fields}
    path = tmp_path / "study.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in lines.items() if v is not None))
    return path


def line_of(path: Path, fragment: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if fragment in line)


def run(capsys, *args):
    return run_cli(capsys, *args)


def refused(capsys, *args: str) -> str:
    """Run the command, check it was refused in one line, fast; return the message."""
    started = time.monotonic()
    code, _, err = run(capsys, *args)
    took = time.monotonic() - started
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert took < FAST_S, f"took {took:.1f} s"
    return lines[0].removeprefix("error: ")


def search(capsys, path: Path, *options: str) -> str:
    return refused(capsys, "search", "--study", str(path), *options)


@pytest.fixture(autouse=True)
def no_ray(request, monkeypatch):
    """ray.init fails the test, unless it is marked slow (those start Ray for real)."""
    if request.node.get_closest_marker("slow"):
        return
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init was called: the bad input reached Ray")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- the harness itself -----------------------------------------------------------------
def test_a_good_study_does_reach_ray_so_the_refusals_below_mean_something(capsys, tmp_path):
    code, _, err = run(capsys, "search", "--study", str(write_study(tmp_path)))
    assert code == 1 and "ray.init was called" in err


# ---- 1. YAML that does not parse ----------------------------------------------------------
@pytest.mark.parametrize(("text", "line"), [
    ("model: [org/model\ndraft: d\n", 2),  # unclosed bracket: noticed on the next line
    ("model: m\ndraft: 'd\nbatch: [1]\n", 4),  # unclosed quote: runs to the end
    ("model: m\n\tdraft: d\n", 2),  # a tab
])
def test_malformed_yaml_names_the_file_and_the_line(capsys, tmp_path, text, line):
    path = tmp_path / "study.yaml"
    path.write_text(text)
    message = search(capsys, path)
    assert message.startswith(f"{path}: not valid YAML (line {line}, column ")


NOT_UTF8 = b"model: org/model\ndraft: \xff\xfe org/draft\n"  # Latin-1 bytes, say


def write_latin1(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(NOT_UTF8)
    return path


@pytest.mark.parametrize("kind", ["study", "space", "prior", "world", "measurements",
                                  "config.json"])
def test_a_file_that_is_not_utf8_is_named_not_shown_as_an_internal_error(
        capsys, tmp_path, kind):
    bad = write_latin1(tmp_path / {"study": "study.yaml", "space": "space.yaml",
                                   "prior": "prior.yaml", "world": "world.yaml",
                                   "measurements": "points.csv",
                                   "config.json": "target/config.json"}[kind])
    (tmp_path / "good").mkdir()
    good_study = str(write_study(tmp_path / "good"))
    args = {
        "study": ("search", "--study", str(bad)),
        "space": ("search", "--study", good_study, "--space", str(bad)),
        "prior": ("search", "--study", good_study, "--strategy", "model", "--prior", str(bad)),
        "world": ("grid", "--world", str(bad), "-o", str(tmp_path / "grid.csv")),
        "measurements": ("calibrate", "--profile", "qwen3-8b-h100", "--measurements",
                         str(bad), "-o", str(tmp_path / "fitted.yaml")),
        "config.json": ("prior", "--model", str(bad.parent), "--draft", str(bad.parent),
                        "--gpu", "H100-SXM"),
    }[kind]
    message = refused(capsys, *args)
    assert message.startswith(f"{bad}: not UTF-8 text (byte 24)"), message


def test_a_number_in_exponent_notation_yaml_reads_as_text_says_how_to_write_it(capsys,
                                                                            tmp_path):
    """PyYAML follows YAML 1.1, which reads 1e3 as text: `duration_s: 1e3` was refused as
    "expected a number, got str" without saying why (a helper's audit). Not read as a
    number: treetune's own files and users' env values (a revision 1234e56) stay text."""
    path = write_study(tmp_path, measurement="{duration_s: 1e3}")
    message = search(capsys, path)
    assert message.endswith("key 'measurement.duration_s': expected a number, got str "
                            "'1e3' (YAML reads 1e3 as text: write 1.0e+3, or the number in "
                            "full)"), message
    path = write_study(tmp_path, measurement="{duration_s: 1.0e+3}",
                       env="{HF_REVISION: 1234e56}")
    spec = load_study(path)
    assert spec.measurement.duration_s == 1000.0 and spec.env["HF_REVISION"] == "1234e56"


def test_a_key_given_twice_is_refused_at_its_second_line(capsys, tmp_path):
    """PyYAML keeps the last of two equal keys silently: the first tolerance was lost."""
    path = write_study(tmp_path, tolerance="0.01")
    path.write_text(path.read_text() + "tolerance: 0.02\n")
    message = search(capsys, path)
    line = len(path.read_text().splitlines())
    assert message == (f"{path}: not valid YAML (line {line}, column 1): key 'tolerance' is "
                       "given twice in one mapping")


# ---- 2. unknown and misspelt keys ---------------------------------------------------------
@pytest.mark.parametrize(("fields", "key", "suggestion"), [
    ({"budgett": "{launches: 3}"}, "budgett", "budget"),
    ({"backend": "{kind: emulator, profle: qwen3-coder-next-h200}"}, "backend.profle",
     "profile"),
    ({"measurement": "{duraton_s: 5}"}, "measurement.duraton_s", "duration_s"),
    ({"datasets": "[mt-bench, {name: mine, pth: mine.jsonl}]"}, "datasets[1].pth", "path"),
    ({"backend": "\n  kind: emulator\n  profile: qwen3-coder-next-h200\n  time_scael: 2"},
     "backend.time_scael", "time_scale"),
    ({"budget": "\n  launches: 3\n  wall_time: 60"}, "budget.wall_time", "wall_time_s"),
])
def test_an_unknown_key_is_named_with_its_file_line_and_closest_valid_key(
        capsys, tmp_path, fields, key, suggestion):
    path = write_study(tmp_path, **fields)
    message = search(capsys, path)
    line = line_of(path, key.rsplit(".", 1)[-1].split("[")[0] + ":")
    assert message.startswith(f"{path}, line {line}: key '{key}': unknown key")
    assert f"(did you mean '{suggestion}'?)" in message


def test_an_unknown_key_in_a_search_space_file_gets_its_line_too(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("steps: [1, 2]\ntopk: [1, 2]\ndraft_tokens: [2, 3]\ninclude_basline: true\n")
    with pytest.raises(ConfigFileError) as info:
        load_space(path)
    assert str(info.value).startswith(f"{path}, line 4: key 'include_basline': unknown key")
    assert "did you mean 'include_baseline'" in str(info.value) and info.value.line == 4


# ---- 3. values of the wrong type -----------------------------------------------------------
@pytest.mark.parametrize(("fields", "key", "expected"), [
    ({"batch": '"many"'}, "batch", "expected a list, got str 'many'"),
    ({"batch": "[1, lots]"}, "batch[1]", "expected an integer, got str 'lots'"),
    ({"tp": "two"}, "tp", "expected an integer, got str 'two'"),
    ({"budget": "{launches: ten}"}, "budget.launches", "expected an integer, got str 'ten'"),
    ({"tolerance": "[1]"}, "tolerance", "expected a number, got a list"),
    ({"backend": "\n  kind: emulator\n  profile: qwen3-coder-next-h200\n  noise: maybe"},
     "backend.noise", "expected true or false, got str 'maybe'"),
    # YAML's .nan and .inf are numbers to it, none to a duration, rate or limit.
    ({"rates": "[.nan]"}, "rates[0]", "expected a finite number, got nan"),
    ({"measurement": "{duration_s: .inf}"}, "measurement.duration_s",
     "expected a finite number, got inf"),
    ({"budget": "{launches: 3, wall_time_s: .nan}"}, "budget.wall_time_s",
     "expected a finite number, got nan"),
    ({"slo": "{tpot_ms: .nan}"}, "slo.tpot_ms", "expected a finite number, got nan"),
    ({"sglang_version": "banana"}, "sglang_version",
     "SGLang version 'banana' is not of the form MAJOR.MINOR[.PATCH]"),
    # A number where text goes loses how it was written: SGLang 0.10 is not 0.1.
    ({"sglang_version": "0.10"}, "sglang_version",
     'expected a string, got the number 0.1: quote it as written ("0.10", not 0.10)'),
])
def test_a_value_of_the_wrong_type_names_key_file_line_and_expected_type(
        capsys, tmp_path, fields, key, expected):
    path = write_study(tmp_path, **fields)
    message = search(capsys, path)
    line = line_of(path, key.rsplit(".", 1)[-1].split("[")[0] + ":")
    assert message == f"{path}, line {line}: key '{key}': {expected}"


# Depends on the CLI showing Typer's own usage errors (Typer >= 0.20 ships its own click)
# as one line, see the report.
@pytest.mark.parametrize(("options", "fragment"), [
    (("--tp", "two"), "Invalid value for '--tp'"),
    (("--budget-launches", "ten"), "Invalid value for '--budget-launches'"),
    (("--tolerance", "lots"), "Invalid value for '--tolerance'"),
    (("--budgett", "3"), "No such option: --budgett"),
])
def test_an_option_of_the_wrong_type_is_a_one_line_usage_error(capsys, tmp_path, options,
                                                                fragment):
    message = search(capsys, write_study(tmp_path), *options)
    assert fragment in message and "treetune search --help" in message


@pytest.mark.parametrize(("options", "key", "got"), [
    (("--budget-time", "inf"), "budget.wall_time_s", "inf"),
    (("--rates", "nan"), "rates[0]", "nan"),
    (("--tolerance", "nan"), "tolerance", "nan"),
])
def test_an_option_of_nan_or_inf_is_refused_as_the_file_s_are(capsys, tmp_path, options,
                                                              key, got):
    """Typer parses "nan" and "inf" as floats before any field sees them. Named by the
    option typed, then the file's key (a helper's audit: the key alone)."""
    message = search(capsys, write_study(tmp_path), *options)
    assert message == (f"command line: {options[0]} ({key}): expected a finite number, "
                       f"got {got}")


def test_a_report_of_a_folder_that_does_not_exist_says_so(capsys, tmp_path):
    message = refused(capsys, "report", str(tmp_path / "gone"))
    assert message == (f"{tmp_path / 'gone'} does not exist: give the folder "
                       "`treetune search` wrote (its --output, runs/<name> by default)")


def test_predict_refuses_a_rate_of_nan_or_inf(capsys):
    for rate in ("nan", "inf"):
        message = refused(capsys, "predict", "-p", "qwen3-8b-h100", "--tree", "3,4,8",
                          "--rate", rate)
        assert "--rate must be a finite number > 0 requests/s" in message, message


@pytest.mark.parametrize(("row", "expected"), [
    ("3,4,8,1,sharegpt,nan", "line 2: column 'speedup': 'nan' is not a finite number"),
    ("3,4,8,1,sharegpt,1.5,7,8", "line 2: 2 more cells than the header's columns: '7', '8'"),
    ("3.5,4,8,1,sharegpt,1.5", "line 2: column 'steps': '3.5' is not an integer"),
])
def test_a_measurements_row_that_cannot_be_a_point_is_named(capsys, tmp_path, row, expected):
    """Before, nan fitted a profile whose error was nan (exit 0), and extra cells were
    dropped without a word."""
    points = tmp_path / "points.csv"
    points.write_text(f"steps,topk,draft_tokens,batch,dataset,speedup\n{row}\n")
    message = refused(capsys, "calibrate", "--profile", "qwen3-8b-h100", "--measurements",
                      str(points), "-o", str(tmp_path / "fitted.yaml"))
    assert message == f"{points}: {expected}", message
    assert not (tmp_path / "fitted.yaml").exists()


# Depends on the CLI printing messages as text, not Rich markup, see the report.
@pytest.mark.parametrize("value", ["[/red]", "[bold]x[/bold] [abc]"])
def test_brackets_in_the_user_s_text_are_shown_as_written(capsys, tmp_path, value):
    path = write_study(tmp_path, tp=f'"{value}"')
    message = search(capsys, path)
    assert message.endswith(f"key 'tp': expected an integer, got str '{value}'")


# ---- 4. empty and impossible search spaces -------------------------------------------------
EMPTY_SPACES = {
    "no steps": ("steps: []\ntopk: [1, 2]\ndraft_tokens: [2, 4]\n", "steps", 1,
                 "no values given, so the space is empty"),
    # A space's flags are not searched, so none of their values is checked: the key is refused.
    "no flag values": ("steps: [2]\ntopk: [2]\ndraft_tokens: [4]\n"
                       "flags:\n  --attention-backend: []\n", "flags", 4,
                       "SGLang flags are not searched: pin them in the study's server_flags"),
    "reversed range": ("steps: {min: 5, max: 2}\ntopk: [2]\ndraft_tokens: [4]\n", "steps", 1,
                       "empty range min 5 max 2 step 1, so the space is empty"),
    # topk 2 proposes 2 candidates per step: one step verifies at most 3 tokens.
    "no valid tree": ("steps: [1]\ntopk: [2]\ndraft_tokens: [10, 20]\n", "draft_tokens", 3,
                      "the space is empty: none of its 2 (steps, topk, draft_tokens) "
                      "combinations is a valid tree, not even (1, 2, 10): draft_tokens 10 is "
                      "too large for steps 1, topk 2"),
    "no tree under the rule": ("steps: [2]\ntopk: [2]\ndraft_tokens: [6, 7]\n"
                               "draft_tokens_rule: steps_times_topk_plus_one\n",
                               "draft_tokens", 3, "above steps*topk+1 = 5"),
}


@pytest.mark.parametrize("case", EMPTY_SPACES)
def test_an_empty_or_impossible_space_file_says_so_and_why(tmp_path, case):
    text, key, line, fragment = EMPTY_SPACES[case]
    path = tmp_path / "space.yaml"
    path.write_text(text)
    with pytest.raises(ConfigFileError) as info:
        load_space(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line {line}: key '{key}': ") and fragment in message
    assert "\n" not in message


@pytest.mark.parametrize("case", ["no steps", "no valid tree"])
def test_a_study_with_an_empty_space_is_refused_before_ray(capsys, tmp_path, case):
    text, key, line, fragment = EMPTY_SPACES[case]
    space = tmp_path / "space.yaml"
    space.write_text(text)
    message = search(capsys, write_study(tmp_path, space=str(space)))
    assert message.startswith(f"{space}, line {line}: key '{key}': ") and fragment in message


def test_an_ngram_space_for_a_study_of_one_tree_method_is_refused_before_ray(capsys,
                                                                           tmp_path):
    """Its (draft_tokens, breadth) servers were read as EAGLE3 trees (a helper's audit:
    the server ran num_steps 1, topk 1, draft_tokens 2); `predict` and `methods:` refuse
    the pairing, and now a study of one method does too."""
    message = search(capsys, write_study(tmp_path, space="ngram"))
    assert "space 'ngram' holds NGRAM servers (draft_tokens and breadth), but the study " \
        "drafts by EAGLE3: give a tree space" in message, message
    assert not (tmp_path / "out").exists()


def test_a_space_too_wide_to_enumerate_is_refused_at_its_widest_knob(capsys, tmp_path):
    """steps up to 100000 made `predict --space` run for minutes without a word (a
    helper's audit): 50 million combinations, each checked, every tree predicted."""
    space = tmp_path / "huge.yaml"
    space.write_text("steps: {min: 1, max: 100000}\ntopk: {min: 1, max: 8}\n"
                     "draft_tokens: {min: 2, max: 64}\n")
    message = refused(capsys, "predict", "-p", "qwen3-8b-h100", "--space", str(space))
    assert message == (f"{space}, line 1: key 'steps': 100000 steps x 8 topk x 63 "
                       "draft_tokens are 50,400,000 combinations, more than treetune "
                       "enumerates (100,000): narrow the ranges")


def test_a_file_where_a_folder_goes_is_said_to_be_a_file(capsys, tmp_path):
    """The search said the output folder was "not writable (File exists)" and to fix its
    permissions; `report` that a file held no study.yaml (a helper's audit)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    message = search(capsys, write_study(tmp_path, output=str(afile)))
    assert message == f"the output folder {afile} is a file, not a folder: choose " \
        "another with --output"
    message = refused(capsys, "report", str(afile))
    assert message.startswith(f"{afile} is a file, not a study folder")


def test_an_unknown_space_name_suggests_the_closest_shipped_one(capsys, tmp_path):
    message = search(capsys, write_study(tmp_path, space="defualt"))
    assert "unknown search space 'defualt' (did you mean 'default'?)" in message
    assert not (tmp_path / "out").exists()  # refused before the storage was made


def test_an_unknown_prior_or_a_strategy_not_installed_is_refused_before_anything_starts(
        capsys, tmp_path, monkeypatch):
    from treetune.strategies import gp

    message = search(capsys, write_study(tmp_path), "--prior", "qwen3-8b-h10")
    assert "qwen3-8b-h10" in message and "did you mean 'qwen3-8b-h100'" in message
    monkeypatch.setattr(gp, "torch_installed", lambda: False)
    message = search(capsys, write_study(tmp_path), "--strategy", "gp")
    assert message.startswith("strategy 'gp' needs PyTorch") and "treetune[gp]" in message
    assert not (tmp_path / "out").exists()


# ---- 5. batch sizes ------------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "options", "got"), [
    ({}, ("--batch", "0"), "[0]"),
    ({}, ("--batch", "8", "-1"), "[8, -1]"),
    ({"batch": "[-1]"}, (), "[-1]"),
    ({"batch": "[4, 0]"}, (), "[4, 0]"),
])
def test_batch_sizes_below_one_are_refused(capsys, tmp_path, fields, options, got):
    message = search(capsys, write_study(tmp_path, **fields), *options)
    assert f"batch sizes must be >= 1, got {got}" in message


@pytest.mark.parametrize(("fields", "options"), [({"batch": "[32, 32]"}, ()),
                                                ({}, ("--batch", "8", "8"))])
def test_a_batch_size_listed_twice_is_refused(capsys, tmp_path, fields, options):
    """As a dataset listed twice is: each cell would be measured twice a launch."""
    message = search(capsys, write_study(tmp_path, **fields), *options)
    assert "batch sizes are listed twice: [" in message, message


def test_grid_writes_a_batch_size_given_twice_once(capsys, tmp_path):
    out = tmp_path / "grid.csv"
    code, _, err = run(capsys, "grid", "--world", "cliffs", "--space", "narrow",
                       "--batch", "4", "4", "-o", str(out))
    assert code == 0, err
    rows = out.read_text().splitlines()[1:]
    assert rows and len(rows) == len(set(rows))


def test_a_bad_batch_size_given_on_the_command_line_is_not_blamed_on_a_file_line(
        capsys, tmp_path):
    message = search(capsys, write_study(tmp_path), "--batch", "0")
    assert not re.search(r", line \d+", message)


# ---- 6. datasets ---------------------------------------------------------------------------
@pytest.mark.parametrize(("entry", "key", "fragment"), [
    ("mtbench", "datasets[0]", "unknown built-in dataset 'mtbench' (did you mean 'mt-bench'?)"),
    ("{name: humaneva}", "datasets[0]",
     "unknown built-in dataset 'humaneva' (did you mean 'humaneval'?)"),
    ("{name: mine, path: mine.jsonl, format: jsonlines}", "datasets[0]",
     "unknown format 'jsonlines' (did you mean 'jsonl'?)"),
    ("{name: mine, format: sharegpt}", "datasets[0]", "format 'sharegpt' reads a file; give a "
     "path"),
])
def test_an_unknown_dataset_or_format_is_named_with_a_suggestion(
        capsys, tmp_path, entry, key, fragment):
    path = write_study(tmp_path, datasets=f"[{entry}]")
    message = search(capsys, path)
    assert message.startswith(f"{path}, line {line_of(path, 'datasets:')}: key '{key}': ")
    assert fragment in message


@pytest.mark.parametrize(("name", "fragment"), [
    ('"../../evil\\necho INJECTED #"', "may only hold letters, digits"),
    ("'my chats'", "may only hold letters, digits"),
    (".hidden", "may only hold letters, digits"),
    ("mixed", "'mixed' is the workload of every dataset at once"),
])
def test_a_dataset_name_that_would_leave_the_launch_folder_or_break_a_script_is_refused(
        capsys, tmp_path, name, fragment):
    """A dataset's name names its workload's launch files and stands in their comments: a
    '/' would write them elsewhere and a newline would run its text as a command."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    path = write_study(tmp_path, datasets=f"[mt-bench, {{name: {name}, path: p.jsonl}}]")
    message = search(capsys, path)
    assert message.startswith(f"{path}, line {line_of(path, 'datasets:')}: key "
                              "'datasets[1].name': "), message
    assert fragment in message
    assert not (tmp_path / "out").exists()


def test_a_dataset_file_named_on_the_command_line_is_named_safely(tmp_path):
    """`--datasets "my chats.jsonl"`: the dataset is "my-chats", as a study file's name is
    made a study's."""
    (tmp_path / "my chats.jsonl").write_text('{"prompt": "hi"}\n')
    spec = load_study(None, {"model": "org/model", "draft": "org/draft", "batch": [1],
                             "datasets": [str(tmp_path / "my chats.jsonl")]})
    assert [d.name for d in spec.datasets] == ["my-chats"]
    assert spec.datasets[0].path == str(tmp_path / "my chats.jsonl")


BAD_FILES = {
    "missing": (None, "dataset file not found"),
    "empty": ("", "file is empty"),
    "bad JSON line": ('{"prompt": "one"}\n{"prompt": "two"\n', "line 2 is not valid JSON"),
    "no prompt field": ('{"prompt": "one"}\n{"promt": "two"}\n',
                        "line 2: no 'prompt' field (did you mean 'promt'?)"),
    "not an object": ('{"prompt": "one"}\n["two"]\n', "line 2: expected a JSON object"),
    "bad JSON array": ('[{"prompt": "one"}, ]', "not valid JSON at line 1"),
}


def bad_dataset(tmp_path: Path, case: str) -> Path:
    text, _ = BAD_FILES[case]
    path = tmp_path / ("mine.json" if "array" in case else "mine.jsonl")
    if text is not None:
        path.write_text(text)
    return path


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_dataset_file_is_named_with_the_record_at_fault(tmp_path, case):
    path = bad_dataset(tmp_path, case)
    with pytest.raises(TreetuneError) as info:
        load_datasets([DatasetSpec("mt-bench"), DatasetSpec("mine", path=path.name)], tmp_path)
    message = str(info.value)
    assert message.startswith(f"dataset 'mine': {path}: ") and BAD_FILES[case][1] in message
    assert "\n" not in message


def test_a_missing_dataset_path_says_where_relative_paths_are_taken_from(
        capsys, tmp_path, monkeypatch):
    (tmp_path / "studies").mkdir()
    study = write_study(tmp_path / "studies", datasets="[nothere/x.jsonl]")
    monkeypatch.chdir(tmp_path)
    # In the file: from the file's folder; on the command line: from the current folder.
    for options, folder in [((), tmp_path / "studies"),
                            (("--datasets", "nothere/x.jsonl"), tmp_path)]:
        message = search(capsys, study, *options)
        assert f"{folder / 'nothere' / 'x.jsonl'}: dataset file not found" in message
        assert ("relative path is taken from the study file's folder, or on the command "
                "line from the current folder") in message


# Depends on the runner calling treetune.study.preflight.check_study(spec) before Ray.
@pytest.mark.parametrize("case", BAD_FILES)
def test_a_study_with_a_bad_dataset_file_is_refused_before_ray(capsys, tmp_path, case):
    path = bad_dataset(tmp_path, case)
    study = write_study(tmp_path, datasets=f"[mt-bench, {{name: mine, path: {path.name}}}]")
    message = search(capsys, study)
    assert message.startswith(f"dataset 'mine': {path}: ") and BAD_FILES[case][1] in message


# Depends on the runner calling treetune.study.preflight.check_study(spec) before Ray.
def test_a_dataset_the_emulator_profile_does_not_know_is_refused_before_ray(
        capsys, tmp_path):
    (tmp_path / "mine.jsonl").write_text('{"prompt": "one"}\n')
    study = write_study(tmp_path, datasets="[mt-bench, {name: mine, path: mine.jsonl}]")
    message = search(capsys, study)
    assert "profile 'qwen3-coder-next-h200' has no dataset 'mine'" in message
    assert "the emulator serves only its profile's datasets" in message
    # A built-in set the profile was not calibrated on is said so, not taken for a
    # misspelling (terminal-bench got "did you mean 'mt-bench'?": a helper's audit).
    message = search(capsys, write_study(tmp_path, datasets="[terminal-bench]"),
                     "--profile", "qwen3-8b-h100")
    assert message.startswith("profile 'qwen3-8b-h100' was not calibrated on the built-in "
                              "dataset 'terminal-bench'; it knows: "), message
    assert "did you mean" not in message


# ---- 7. SGLang not installed -----------------------------------------------------------------
def fake_sglang(tmp_path: Path, body: str = "") -> Path:
    """A folder to put on PYTHONPATH holding a stand-in `sglang` package."""
    folder = tmp_path / "site"
    (folder / "sglang").mkdir(parents=True)
    (folder / "sglang" / "__init__.py").write_text(body)
    return folder


@without_sglang
def test_check_sglang_says_how_to_install_it_or_use_the_emulator(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # no sglang there
    with pytest.raises(TreetuneError) as info:
        check_sglang(sys.executable)
    message = str(info.value)
    assert message.startswith(f"SGLang is not installed for {sys.executable} (backend.python)")
    assert "pip install 'treetune[sglang]'" in message and "--profile NAME" in message


def test_check_sglang_passes_when_the_interpreter_imports_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", str(fake_sglang(tmp_path)))
    check_sglang(sys.executable)


def test_check_sglang_names_a_missing_interpreter(tmp_path):
    missing = str(tmp_path / "bin" / "python")
    with pytest.raises(TreetuneError, match=r"interpreter '.*/bin/python' \(backend.python\) "
                       r"was not found: set backend.python"):
        check_sglang(missing)


def test_check_sglang_gives_the_cause_when_sglang_is_broken(monkeypatch, tmp_path):
    broken = fake_sglang(tmp_path, "raise ImportError('libcuda.so.1: cannot open shared "
                         "object file')\n")
    monkeypatch.setenv("PYTHONPATH", str(broken))
    with pytest.raises(TreetuneError) as info:
        check_sglang(sys.executable)
    assert "SGLang cannot be imported by" in str(info.value)
    assert "ImportError: libcuda.so.1: cannot open shared object file" in str(info.value)


# Depends on the runner calling treetune.study.preflight.check_study(spec) before Ray.
@without_sglang
@pytest.mark.parametrize("python", ["sys.executable", "missing"])
def test_a_sglang_study_without_sglang_is_refused_before_ray(
        capsys, monkeypatch, tmp_path, python):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # no sglang there
    interpreter = sys.executable if python == "sys.executable" else str(tmp_path / "python")
    study = write_study(tmp_path, backend=f"{{kind: sglang, python: {interpreter}}}")
    message = search(capsys, study)
    assert ("SGLang is not installed" in message if python == "sys.executable"
            else "was not found" in message)
    assert "--profile NAME" in message


# ---- 8. no GPUs ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.ray_no_server  # refused once Ray is up, before any worker: beside the heavy tests
@pytest.mark.timeout(120)
def test_a_sglang_study_on_a_machine_without_gpus_points_to_the_emulator(tmp_path):
    # The GPU count is Ray's to find out, so this one starts Ray (in its short temp dir).
    study = write_study(tmp_path, backend=f"{{kind: sglang, python: {sys.executable}}}")
    env = {**os.environ, "PYTHONPATH": str(fake_sglang(tmp_path)), "CUDA_VISIBLE_DEVICES": ""}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "treetune", "search", "--study", str(study)],
                          capture_output=True, text=True, env=env, timeout=100)
    # The study had started (Ray was up), so its progress line may come first.
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert all(line.startswith("launches") for line in lines[:-1]), done.stderr
    assert lines[-1].startswith("error: the Ray cluster offers 0 GPUs"), done.stderr
    assert "--backend emulator --profile NAME" in lines[-1]
    assert time.monotonic() - started < 60


# ---- 9. an unreachable Ray cluster -------------------------------------------------------------
def test_a_closed_port_is_refused_at_once():
    port = closed_port()
    started = time.monotonic()
    with pytest.raises(TreetuneError) as info:
        check_ray_address(f"127.0.0.1:{port}")
    assert time.monotonic() - started < 1
    assert str(info.value) == (
        f"cannot reach the Ray cluster at 127.0.0.1:{port}: connection refused; check the "
        "address (ray status on the head node) or leave ray_address unset to run locally")


@pytest.mark.parametrize("address", ["10.255.255.1:6379", "ray://10.255.255.1:10001"])
def test_a_non_routable_address_is_refused_within_the_timeout(address):
    started = time.monotonic()
    with pytest.raises(TreetuneError, match=f"cannot reach the Ray cluster at {address}: "):
        check_ray_address(address, timeout_s=1)
    assert time.monotonic() - started < 2.5


def test_a_live_grpc_server_passes_and_auto_and_local_are_left_to_ray():
    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        check_ray_address(f"127.0.0.1:{port}")
        check_ray_address(f"ray://127.0.0.1:{port}")
    finally:
        server.stop(None)
    check_ray_address("auto")
    check_ray_address("local")


def test_something_else_listening_on_the_port_is_not_taken_for_ray():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with pytest.raises(TreetuneError, match="cannot reach the Ray cluster"):
            check_ray_address(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=1)


@pytest.mark.parametrize("address", ["nonsense", "head-node", "host:port", "10.0.0.1:99999"])
def test_a_ray_address_that_is_not_an_address_says_what_to_give(address):
    with pytest.raises(TreetuneError, match=f"ray_address '{address}' is not an address: give "
                       "host:port"):
        check_ray_address(address)


# Depends on the runner calling treetune.study.preflight.check_study(spec) before Ray.
@pytest.mark.parametrize("address", ["closed", "10.255.255.1:6379"])
def test_a_study_on_an_unreachable_cluster_is_refused_before_ray(
        capsys, monkeypatch, tmp_path, address):
    import treetune.study.preflight as preflight

    monkeypatch.setattr(preflight, "RAY_CONNECT_TIMEOUT_S", 1.0)
    address = f"127.0.0.1:{closed_port()}" if address == "closed" else address
    message = search(capsys, write_study(tmp_path), "--ray-address", address)
    assert message.startswith(f"cannot reach the Ray cluster at {address}: ")


# ---- 10. a storage made by another spec --------------------------------------------------------
def test_a_storage_made_by_a_different_spec_is_refused_with_how_to_start_anew(
        capsys, tmp_path):
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    StudyStore(load_study(write_study(tmp_path, storage=storage)))
    message = search(capsys, write_study(tmp_path, storage=storage, batch="[1, 8]"))
    assert "was created with a different spec" in message and storage in message
    assert "Start a new study with another --name or --output" in message


def test_a_storage_that_does_not_load_leaves_no_run_folder_of_its_making(capsys, tmp_path):
    """Refused before anything is written: the folder the search made for its lock goes
    with it (it held only `.treetune.lock`; a helper's audit); one that was there stays."""
    message = search(capsys, write_study(tmp_path), "--storage", "foo://bar")
    assert "cannot open study storage foo://bar" in message
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()
    search(capsys, write_study(tmp_path), "--storage", "foo://bar")
    assert (tmp_path / "out").is_dir()


# ---- 11. budget, tolerance, workers, backend, profile ------------------------------------------
@pytest.mark.parametrize(("fields", "options", "fragment"), [
    ({"budget": "{launches: 1}"}, (), "budget.launches must be >= 2 (the baseline plus one tree)"),
    ({}, ("--budget-launches", "1"), "budget.launches must be >= 2"),
    ({"tolerance": "1.5"}, (), "tolerance must be in [0, 1), got 1.5"),
    ({}, ("--tolerance", "-0.1"), "tolerance must be in [0, 1), got -0.1"),
    ({"workers": "0"}, (), "workers must be >= 1"),
    ({"backend": "{kind: vllm}"}, (), "backend.kind must be one of sglang, emulator, got 'vllm'"),
    ({}, ("--backend", "vllm"), "backend.kind must be one of sglang, emulator, got 'vllm'"),
    ({"backend": "{kind: emulator}"}, (), "the emulator backend needs backend.profile"),
    ({"backend": None}, ("--backend", "emulator"), "the emulator backend needs backend.profile"),
    ({"measurement": "{warmup_s: -3}"}, (), "measurement.warmup_s must be >= 0"),
    ({"backend": "{kind: emulator, profile: qwen3-8b-h100, load_time_s: -1}"}, (),
     "backend.load_time_s must be >= 0, got -1"),
    ({"env": "{A: [1, 2]}"}, (), "key 'env.A': an environment variable's value is text or a "
     "number, got a list: quote it"),
    ({"env": "{A: }"}, (), "got nothing: quote it"),
    ({"env": "{A: yes}"}, (), "got true/false: quote it"),
])
def test_out_of_range_settings_are_refused_in_one_line(capsys, tmp_path, fields, options,
                                                        fragment):
    path = write_study(tmp_path, **fields)
    message = search(capsys, path, *options)
    assert fragment in message
    if not options:
        assert message.startswith(str(path))


# Needs spec.py to name the key of a StudySpec check (see the report): then the line follows.
@pytest.mark.parametrize(("fields", "key"), [
    ({"budget": "{launches: 1}"}, "budget"),
    ({"tolerance": "1.5"}, "tolerance"),
    ({"workers": "0"}, "workers"),
    ({"batch": "[-1]"}, "batch"),
    ({"backend": "{kind: vllm}"}, "backend"),
    ({"measurement": "{warmup_s: -3}"}, "measurement"),
])
def test_an_out_of_range_setting_in_a_file_is_given_its_line(capsys, tmp_path, fields, key):
    path = write_study(tmp_path, **fields)
    message = search(capsys, path)
    assert message.startswith(f"{path}, line {line_of(path, key + ':')}: key '{key}")


def test_an_environment_value_that_is_not_text_is_given_its_own_line(capsys, tmp_path):
    path = write_study(tmp_path, env="\n  B: '1'\n  A: [1, 2]")
    message = search(capsys, path)
    assert message.startswith(f"{path}, line {line_of(path, 'A: [1, 2]')}: key 'env.A': ")


# Depends on the runner calling treetune.study.preflight.check_study(spec) before Ray.
@pytest.mark.parametrize("options", [
    ("--profile", "qwen3-coder-next-h20"),
    ("--backend", "emulator", "--profile", "qwen3-coder-next-h20"),
])
def test_an_unknown_profile_is_refused_before_ray_with_a_suggestion(capsys, tmp_path, options):
    message = search(capsys, write_study(tmp_path, backend=None), *options)
    assert "qwen3-coder-next-h20" in message
    assert "did you mean 'qwen3-coder-next-h200'" in message


@pytest.mark.parametrize(("backend", "tp", "gpus"), [
    ("{kind: emulator, profile: qwen3-8b-h100}", 2, 1),
    ("{kind: emulator, world: cliffs}", 8, 4),
])
def test_more_tensor_parallel_gpus_than_the_emulated_node_has_is_refused_before_ray(
        capsys, tmp_path, backend, tp, gpus):
    path = write_study(tmp_path, tp=str(tp), backend=backend)
    message = search(capsys, path)
    assert f"tp {tp} needs {tp} GPUs per server" in message
    assert f"set tp to at most {gpus}" in message
    # Nothing was created, so the same folder takes the corrected study.
    assert not (tmp_path / "out").exists()


def test_a_draft_method_the_emulated_profile_lacks_is_refused_before_ray(capsys, tmp_path):
    # Every NGRAM launch would fail on qwen3-8b-h100, spending the budget on nothing.
    path = write_study(tmp_path, methods="[EAGLE3, NGRAM]",
                       backend="{kind: emulator, profile: qwen3-8b-h100}")
    message = search(capsys, path)
    assert "describes the draft methods EAGLE3, not NGRAM: drop NGRAM" in message


@pytest.mark.parametrize(("fields", "options"), [
    ({"backend": "{kind: sglang, gpu: H999}"}, ()),
    ({"backend": None}, ("--backend", "sglang", "--gpu", "H999")),
])
def test_a_gpu_override_not_in_the_gpu_table_is_refused_before_ray(capsys, tmp_path, fields,
                                                                   options):
    path = write_study(tmp_path, **fields)
    message = search(capsys, path, *options)
    assert "GPU 'H999' (--gpu) is not in treetune's GPU table" in message
    assert "H100-SXM" in message  # the names it knows
    if not options:
        assert message.startswith(f"{path}, line {line_of(path, 'backend:')}: key 'backend.gpu'")


def test_an_output_folder_holding_another_study_is_refused_naming_both(capsys, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "study.yaml").write_text("name: A\nmodel: m\n")
    message = search(capsys, write_study(tmp_path, name="B"))
    assert message.startswith(f"the output folder {tmp_path / 'out'} holds study 'A'")
    assert "give it another --output, or --name A to resume that study" in message


def test_an_output_folder_stored_in_another_database_is_refused_naming_both(capsys, tmp_path,
                                                                           monkeypatch):
    """A rerun with another --storage (or none, for a study stored in a database server)
    started the study over in that database, overwriting the folder's scripts and
    recommendations with those of its first launches (an audit)."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "study.db").write_bytes(b"")  # the folder's own storage
    (tmp_path / "out" / "study.yaml").write_text("name: study\nstorage: null\n")
    other = f"sqlite:///{tmp_path / 'other.db'}"
    message = search(capsys, write_study(tmp_path), "--storage", other)
    assert message.startswith(f"the output folder {tmp_path / 'out'} holds a study stored in "
                              f"the folder's own study.db ({tmp_path / 'out' / 'study.yaml'})")
    assert f"would store it in {other}, starting it over: give no --storage" in message
    (tmp_path / "out" / "study.yaml").write_text(
        "name: study\nstorage: postgresql://tt@db.example/studies\n")
    message = search(capsys, write_study(tmp_path))
    assert "give --storage postgresql://tt@db.example/studies to resume it" in message
    # The same database spelled otherwise (the folder's own file by its URL) resumes.
    (tmp_path / "out" / "study.yaml").write_text("name: study\nstorage: null\n")
    from treetune.study.preflight import check_output_folder

    check_output_folder(load_study(write_study(tmp_path), {
        "storage": f"sqlite:///{tmp_path / 'x' / '..' / 'out' / 'study.db'}"}))
    # A database server's URL without its password (which study.yaml never holds), its
    # options in another order, its default port spelled out: the same database.
    (tmp_path / "out" / "study.yaml").write_text(
        "name: study\nstorage: postgresql://tt@db.example/studies?application_name=a&"
        "sslmode=require\n")
    check_output_folder(load_study(write_study(tmp_path), {
        "storage": "postgresql://tt:secret@DB.example:5432/studies?sslmode=require&"
                   "application_name=a"}))
    # A relative SQLite path is kept absolute in the copy: a rerun from another folder,
    # which would open another file, is refused.
    monkeypatch.chdir(tmp_path)
    spec = load_study(write_study(tmp_path), {"storage": "sqlite:///rel.db"})
    spec.save(tmp_path / "out" / "study.yaml")
    assert load_yaml(tmp_path / "out" / "study.yaml")["storage"] == \
        f"sqlite:///{tmp_path / 'rel.db'}"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(TreetuneError) as info:
        check_output_folder(spec)
    assert f"would store it in sqlite:///{tmp_path / 'elsewhere' / 'rel.db'}, starting it " \
        f"over: give --storage sqlite:///{tmp_path / 'rel.db'} to resume" in str(info.value)


# ---- a traceback only with --debug --------------------------------------------------------------
def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "treetune", *args], capture_output=True,
                          text=True, timeout=60)


def test_the_command_prints_one_line_and_no_traceback(tmp_path):
    study = write_study(tmp_path, budgett="{launches: 3}")
    done = cli("search", "--study", str(study))
    assert done.returncode == 2
    assert done.stderr.strip() == (f"error: {study}, line {line_of(study, 'budgett')}: key "
                                   "'budgett': unknown key (did you mean 'budget'?)")
    assert "Traceback" not in done.stderr


def test_debug_shows_the_traceback(tmp_path):
    study = write_study(tmp_path, budgett="{launches: 3}")
    done = cli("search", "--study", str(study), "--debug")
    assert done.returncode != 0
    assert "Traceback (most recent call last)" in done.stderr
    assert "ConfigFileError" in done.stderr and "did you mean 'budget'" in done.stderr


def test_a_rerun_of_a_study_whose_failed_baselines_spent_its_budget_says_so_at_once(tmp_path):
    """Each failed launch of the baseline counts in the launch budget: once they had spent
    it, a rerun said "launching it again", launched nothing and ended on "no baseline was
    measured" (a helper's audit). It now says at once, before Ray starts, that the budget
    is spent and how to go on."""
    from treetune.config import BASELINE
    from treetune.results import LaunchResult
    from treetune.study.runner import run_study

    spec = load_study(None, small_study(tmp_path, budget={"launches": 2}))
    store = StudyStore(spec)
    for _ in range(2):
        store.finish_launch(store.begin_launch(BASELINE, ()), LaunchResult(
            BASELINE, reason="No module named sglang.launch_server", exit_code=1))
    with pytest.raises(TreetuneError) as refused:
        run_study(spec)
    assert str(refused.value) == (
        "the baseline's launch failed in an earlier run (No module named "
        "sglang.launch_server), and the study's launch budget is spent (2 of 2 launches): "
        "once the server setup is fixed, rerun with a larger --budget-launches to launch it "
        "again")


def test_a_storage_given_as_a_path_is_asked_for_as_a_url(capsys, tmp_path):
    """`--storage study.db` met SQLAlchemy's "Could not parse SQLAlchemy URL" (a helper's
    audit): the URL the user meant is named."""
    code, _, err = run_cli(capsys, "search", "--model", "m", "--draft", "d", "--batch", "1",
                           "--profile", "qwen3-8b-h100", "--storage", str(tmp_path / "x.db"),
                           "-o", str(tmp_path / "out"))
    assert code == 2 and f"give sqlite:///{tmp_path / 'x.db'}" in err, err
    assert "SQLAlchemy" not in err and not (tmp_path / "out").exists()



@pytest.mark.parametrize("key", ["world", "profile"])
def test_a_backend_file_not_found_is_said_with_its_study_key(capsys, tmp_path, key):
    """"sub/nope.yaml: file not found" named no key of the study (an audit)."""
    message = search(capsys, write_study(tmp_path, backend=f"{{kind: emulator, {key}: "
                                                           "sub/nope.yaml}"))
    assert message.startswith(f"backend.{key}: ") and "nope.yaml: file not found" in message


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:",
                                 "sqlite:///file::memory:?uri=true"])
def test_an_in_memory_storage_is_refused_since_it_keeps_nothing(capsys, tmp_path, url):
    """An in-memory SQLite storage was taken: a rerun measured every launch again, and the
    report found nothing (an audit)."""
    code, _, err = run_cli(capsys, "search", "--model", "m", "--draft", "d", "--batch", "1",
                           "--profile", "qwen3-8b-h100", "--storage", url,
                           "-o", str(tmp_path / "out"))
    assert code == 2 and "is an in-memory SQLite database" in err, err
    assert "--storage" in err and not (tmp_path / "out").exists()
