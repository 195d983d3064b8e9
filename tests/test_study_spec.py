"""Study specs: YAML plus command-line overrides, validated once."""

import re
from pathlib import Path

import pytest

from treetune.config import TreeConfig
from treetune.errors import ConfigFileError, TreetuneError
from treetune.study.spec import load_study

STUDIES = Path(__file__).resolve().parents[1] / "studies"


def test_shipped_demo_study_is_the_published_setup_on_the_emulator():
    spec = load_study(STUDIES / "demo.yaml")
    assert spec.backend.kind == "emulator" and spec.backend.profile == "qwen3-coder-next-h200"
    assert spec.dataset_names == ["mt-bench", "humaneval", "swebench-verified", "terminal-bench"]
    assert spec.batch == (1, 32) and spec.tp == 4
    assert set(spec.compare) == {TreeConfig(3, 4, 8), TreeConfig(5, 1, 6)}
    real = load_study(STUDIES / "qwen3-coder-next.yaml")
    assert real.backend.kind == "sglang"
    assert real.fingerprint() != spec.fingerprint()


def test_command_line_values_win_over_the_file():
    spec = load_study(STUDIES / "demo.yaml", {
        "batch": [1, 8, 64], "budget": {"launches": 5}, "backend": {"time_scale": 50.0},
        "tolerance": 0.02, "compare": ["2,2,4"]})
    assert spec.batch == (1, 8, 64)
    assert spec.budget.launches == 5
    assert spec.backend.time_scale == 50 and spec.backend.profile == "qwen3-coder-next-h200"
    assert spec.tolerance == 0.02 and spec.compare == (TreeConfig(2, 2, 4),)


def test_a_study_can_come_from_the_command_line_alone():
    spec = load_study(None, {"model": "org/Model-7B", "draft": "org/draft", "batch": [1],
                             "datasets": ["humaneval"]})
    assert spec.name == "Model-7B"
    assert str(spec.output_dir) == "runs/Model-7B"
    assert spec.storage_url.startswith("sqlite:///") and spec.storage_url.endswith("study.db")


def test_a_study_naming_no_datasets_takes_the_four_published_ones_or_its_emulators(tmp_path):
    """`treetune search --model M --draft D --batch 1 32` is a whole study: on SGLang with
    the four sets the published EAGLE3 grids measure; on the emulator with those of its
    profile's datasets that treetune ships (it serves no other). Named, they are the
    study's; an empty list is refused, as is a profile none of whose sets are built in."""
    line = {"model": "org/Model-7B", "draft": "org/draft", "batch": [1, 32]}
    assert load_study(None, line).dataset_names == [
        "mt-bench", "humaneval", "swebench-verified", "terminal-bench"]
    emulated = {**line, "backend": {"kind": "emulator", "profile": "qwen3-8b-h100"}}
    assert load_study(None, emulated).dataset_names == [
        "sharegpt", "mt-bench", "humaneval", "swebench-verified"]
    assert load_study(None, {**emulated, "datasets": ["humaneval"]}).dataset_names == [
        "humaneval"]
    other = {**emulated, "backend": {"kind": "emulator",
                                     "profile": "qwen3.5-397b-a17b-h200"}}
    assert load_study(None, other).dataset_names == ["mt-bench", "humaneval"]
    path = tmp_path / "s.yaml"
    path.write_text("model: m\ndraft: d\nbatch: [1]\n")
    assert load_study(path).dataset_names == load_study(None, line).dataset_names
    with pytest.raises(TreetuneError, match="at least one dataset"):
        load_study(None, {**line, "datasets": []})
    import yaml

    from treetune.perfmodel import resolve_profile_path
    data = yaml.safe_load(resolve_profile_path("qwen3-8b-h100").read_text())
    data["datasets"] = {f"our-{name}": value for name, value in data["datasets"].items()}
    (tmp_path / "ours.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(TreetuneError) as refused:
        load_study(None, {**line, "backend": {"kind": "emulator",
                                              "profile": str(tmp_path / "ours.yaml")}})
    assert str(refused.value).startswith(
        "command line: no datasets named, and the emulator's profile serves none of the "
        "built-in ones (it knows: our-"), str(refused.value)
    # A value no option gave is named by its key, not by an option never typed (a review).
    with pytest.raises(TreetuneError, match=r"^command line: key 'batch': "):
        load_study(None, {"model": "m", "draft": "d"})


def test_every_launch_forms_the_largest_batch():
    spec = load_study(STUDIES / "demo.yaml", {"batch": [1, 64]})
    launch = spec.launch_spec(port=1234)
    assert launch.max_running_requests == 64 and launch.cuda_graph_max_bs == 64
    assert launch.attention_backend == "triton" and launch.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [0]\n", "batch sizes must be >= 1"),
        ("model: m\ndraft: d\ndatasets: []\nbatch: [1]\n", "at least one dataset"),
        ("model: m\ndatasets: [humaneval]\nbatch: [1]\n", "needs a draft model"),
        ("model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\nbackend: {kind: emulator}\n",
         "needs backend.profile"),
        ("model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\nbackend: {kind: vllm}\n",
         "sglang, emulator"),
        ("model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\ntolerance: 1.5\n", "tolerance"),
        ("draft: d\ndatasets: [humaneval]\nbatch: [1]\n", "no model"),
        ("model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\nbudget: {launches: 1}\n",
         "launches must be >= 2"),
    ],
)
def test_bad_specs_are_refused_naming_the_file(tmp_path, text, fragment):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(TreetuneError) as info:
        load_study(path)
    assert fragment in str(info.value) and str(path) in str(info.value)


def test_misspelt_keys_are_named_with_a_suggestion(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: m\ndraft: d\ndatasets: [humaneval]\nbatches: [1]\n")
    with pytest.raises(ConfigFileError, match="did you mean 'batch'"):
        load_study(path)


def test_an_unknown_dataset_name_is_named_with_a_suggestion(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: m\ndraft: d\ndatasets: [humaneval, mtbench]\nbatch: [1]\n")
    with pytest.raises(ConfigFileError, match=r"datasets\[1\].*'mtbench'.*mt-bench"):
        load_study(path)


def test_compare_entries_must_be_valid_trees(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\n"
                    "compare: [[2, 2, 30]]\n")
    with pytest.raises(ConfigFileError, match=r"compare\[0\].*too large"):
        load_study(path)


def test_a_saved_spec_loads_back_as_the_same_study(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "p.jsonl").write_text('{"prompt": "hello"}\n')
    study = tmp_path / "s.yaml"
    study.write_text("model: m\ndraft: d\nbatch: [1, 8]\ncompare: [[3, 4, 8]]\n"
                     "server_flags: {--trust-remote-code: null}\n"
                     "datasets: [humaneval, {name: mine, path: data/p.jsonl}]\n")
    spec = load_study(study)
    copy = tmp_path / "elsewhere" / "study.yaml"
    spec.save(copy)
    again = load_study(copy)
    assert again.fingerprint() == spec.fingerprint() and again.compare == spec.compare
    assert again.datasets[1].path == str((data / "p.jsonl").resolve())
    assert again.server_flags == {"--trust-remote-code": None}
    assert again.batch == spec.batch and again.model == spec.model


def test_a_mapping_in_server_flags_goes_to_the_server_as_json(tmp_path):
    """SGLang reads --cuda-graph-config as JSON; a mapping written in the study file went to
    the command line in Python's spelling ({'decode': ...}), which it refuses."""
    import json

    from treetune.study.schedule import slot_keys

    study = tmp_path / "s.yaml"
    study.write_text("model: m\ndraft: d\nbatch: [1, 36, 40]\ndatasets: [humaneval]\n"
                     "server_flags: {--cuda-graph-config: {decode: {max_bs: 36}}}\n")
    spec = load_study(study)
    value = spec.server_flags["--cuda-graph-config"]
    assert json.loads(value) == {"decode": {"max_bs": 36}}
    assert ("--cuda-graph-config", value) in spec.launch_spec().extra_flags
    # Read as SGLang reads it: captured up to 36, so batch 40 is not padded into 36's slot.
    assert slot_keys(spec.batch, spec.server_flags) == [1, 6, 38]
    # A value YAML reads as a date goes as its text, not as a traceback.
    study.write_text("model: m\ndraft: d\nbatch: [1]\ndatasets: [humaneval]\n"
                     "server_flags: {--x: {since: 2026-12-06}, --y: [{a: 1}]}\n")
    flags = load_study(study).server_flags
    assert json.loads(flags["--x"]) == {"since": "2026-12-06"}
    assert [json.loads(v) for v in flags["--y"]] == [{"a": 1}]


@pytest.mark.parametrize(("file", "name"), [
    ("my study.yaml", "my-study"), (".hidden.yaml", "hidden"), ("_x (2).yaml", "x-2"),
    ("étude.yaml", "etude"), ("✓.yaml", "study"),
])
def test_the_default_name_from_a_file_name_is_made_a_valid_study_name(tmp_path, file, name):
    path = tmp_path / file
    path.write_text("model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\n")
    spec = load_study(path)
    assert spec.name == name and str(spec.output_dir) == f"runs/{name}"


def test_api_key_env_must_be_a_variable_name(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\n"
                    "api_key_env: 'KEY); rm -rf ~ #'\n")
    with pytest.raises(TreetuneError, match="not an environment variable name"):
        load_study(path)


@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"])
def test_env_cannot_give_every_server_the_same_gpus(tmp_path, name):
    """Ray sets the devices per worker; one value in env: for every server overrode it,
    and two servers on one node shared GPUs (a helper's audit of the cluster path)."""
    path = tmp_path / "s.yaml"
    path.write_text(f"model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\n"
                    f"env: {{{name}: '0,1'}}\n")
    with pytest.raises(TreetuneError, match=f"env.{name}.*set per worker.*leave it out"):
        load_study(path)


@pytest.mark.parametrize(("flag", "field"), [
    ("--speculative-num-steps", "search space"), ("--port", "free port"), ("--tp", "tp"),
    ("--max-running-requests", "largest batch"), ("--cuda-graph-max-bs", "largest batch"),
    ("--api-key", "api_key_env"), ("--model-path", "model"),
    ("--speculative-num-step", "short for '--speculative-num-steps'"),
])
def test_a_flag_treetune_sets_itself_is_refused_in_server_flags(tmp_path, flag, field):
    """A production command pasted into server_flags would override the tree (every
    launch the same server), the port (a server no one polls) or the GPUs Ray reserved:
    SGLang's parser keeps the last value."""
    path = tmp_path / "s.yaml"
    path.write_text("model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1, 32]\n"
                    f"server_flags: {{{flag}: '8'}}\n")
    with pytest.raises(TreetuneError) as info:
        load_study(path)
    message = str(info.value)
    assert f"server_flags: '{flag}'" in message and "is set by treetune" in message
    assert field in message
    assert str(path) in message and "server_flags" in message


@pytest.mark.parametrize(("flag", "version", "refused"), [
    ("--mamba-scheduler-strategy", "0.5.23", "0.5.14 renamed it '--mamba-radix-cache-strategy'"),
    ("--mamba-scheduler-strategy", "0.5.20", "0.5.14 renamed it"),
    ("--mamba-scheduler-strategy", "0.5.14", None), ("--mamba-scheduler-strategy", "0.5.9", None),
    ("--mamba-radix-cache-strategy", "0.5.9", "earlier releases call it "
                                              "'--mamba-scheduler-strategy'"),
    ("--mamba-radix-cache-strategy", "0.5.23", None),
    ("--cuda-graph-bs", "0.5.23", "0.5.14 renamed it '--cuda-graph-bs-decode'"),
    ("--cuda-graph-bs", "0.5.14", None), ("--cuda-graph-bs-decode", "0.5.23", None),
    ("--cuda-graph-bs-decode", "0.5.9", "earlier releases call it '--cuda-graph-bs'"),
    ("--cuda-graph-config", "0.5.9", "(the 0.5.13 wheel's parser has none, 0.5.23's has it)"),
    ("--disable-decode-cuda-graph", "0.5.13", "the 0.5.13 wheel's parser has none"),
    ("--cuda-graph-prefill-max-context", "0.5.20", "the 0.5.20 wheel's parser has none"),
    ("--cuda-graph-prefill-max-context", "0.5.23", None),
    ("--cuda-graph-config", "0.5.14", None),
])
def test_a_flag_the_targeted_sglang_renamed_is_refused_with_its_name_there(
        tmp_path, flag, version, refused):
    """studies/methods.yaml passed the published run's --mamba-scheduler-strategy to SGLang
    0.5.23, whose parser refuses it: every launch of the study would fail (a helper's
    audit of the emitted commands against the 0.5.23 wheel)."""
    path = tmp_path / "s.yaml"
    path.write_text(f"model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\n"
                    f"sglang_version: '{version}'\nserver_flags:\n  {flag}: extra_buffer\n")
    if refused is None:
        assert load_study(path).server_flags == {flag: "extra_buffer"}
        return
    with pytest.raises(TreetuneError) as info:
        load_study(path)
    message = str(info.value)
    assert refused in message and f"SGLang {version} has no '{flag}'" in message
    assert message.startswith(f"{path}, line 6: key 'server_flags'"), message


@pytest.mark.parametrize(("flag", "refused"), [
    ("--disable-decode-cuda", "'--disable-decode-cuda' is short for "
     "'--disable-decode-cuda-graph': write the whole name (a deployment's config file takes "
     "whole names only)"),
    ("--cuda-graph-bs-d", "is short for '--cuda-graph-bs-decode'"),
    ("--disable-cuda", "'--disable-cuda' abbreviates several CUDA-graph flags "
     "(--disable-cuda-graph, --disable-cuda-graph-padding), which SGLang refuses as "
     "ambiguous: write the whole name of the one meant"),
    ("--disable-cuda-graph", None), ("--disable-cuda-graph-padding", None),
    ("--disable-radix", None),  # no CUDA-graph flag: the user's own, as given
])
def test_an_abbreviated_cuda_graph_flag_is_refused_with_its_whole_name(tmp_path, flag,
                                                                       refused):
    """SGLang's parser takes `--disable-decode-cuda` for `--disable-decode-cuda-graph`, but
    a deployment's config file holds it as written (`disable-decode-cuda: true`), which
    SGLang's config reader does not take for the bare flag; and the slot keys of an
    adaptive study follow these flags. So a study names them whole (a review)."""
    path = tmp_path / "s.yaml"
    path.write_text(f"model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\n"
                    f"server_flags:\n  {flag}: null\n")
    if refused is None:
        assert load_study(path).server_flags == {flag: None}
        return
    with pytest.raises(TreetuneError) as info:
        load_study(path)
    assert refused in str(info.value) and "line 5: key 'server_flags'" in str(info.value)


@pytest.mark.parametrize(("flags", "extra", "refused"), [
    ({"--enable-ep-moe": None}, "", "'--enable-ep-moe' is no flag of SGLang since 0.5.9 "
     "(0.5.3 refused it): write --ep-size N"),
    ({"--enable-deepep-moe": None}, "", "write --moe-a2a-backend deepep"),
    ({"--nnodes": 2}, "", "'--nnodes' makes a server that spans nodes"),
    ({"--node-rank": 1}, "", "'--node-rank' makes a server that spans nodes"),
    ({"--nccl-init-addr": "10.0.0.1:5000"}, "", "one rendezvous address"),
    ({"--pp-size": 2}, "", "pipeline parallelism needs tp x pp GPUs per server"),
    ({"--pipeline-parallel-size": 2}, "", "never EAGLE3 or STANDALONE"),
    ({"--dp-size": 2}, "", "'--dp-size' starts that many replicas of tp GPUs each"),
    ({"--dp": 2}, "", "'--dp' starts that many replicas"),  # SGLang takes the prefix
    ({"--enable-dp-attention": None, "--dp-size": 2}, "algorithm: STANDALONE\n",
     "SGLang 0.5.23 refuses STANDALONE drafting with data-parallel attention"),
    ({"--enable-dp-attention": None, "--dp-size": 2, "--ep-size": 4}, "tp: 4\n", None),
    # SGLang asserts tp is a multiple of the attention's data-parallel groups.
    ({"--attn-dp-size": 3}, "tp: 4\n", "'--attn-dp-size': 3 data-parallel attention groups "
     "do not divide tp 4"),
    ({"--enable-dp-attention": None, "--dp-size": 2}, "", "2 data-parallel attention "
     "groups do not divide tp 1"),
    ({"--attn-dp-size": ["2"]}, "tp: 2\nbatch: [1, 8]\n", None),
    # Each attention group takes max_running_requests // groups: launched with a multiple
    # of them (test_launch.py), batch 3 or 6 over 4 groups forms.
    ({"--attn-dp-size": 4}, "tp: 4\nbatch: [1, 3]\n", None),
    ({"--attn-dp-size": 4}, "tp: 4\nbatch: [1, 6]\n", None),
    ({"--nnodes": 1, "--node-rank": 0, "--pp-size": 1, "--dp-size": 1}, "", None),
    # A review's cases: a one-value list is the value; --dp-size beside --attn-dp-size
    # above 1 still counts replicas; --enable-dp-attention alone does nothing in 0.5.23;
    # a dropped flag is named only by its whole name (--enable-ep is --enable-eplb's prefix).
    ({"--dp-size": [2]}, "", "'--dp-size' starts that many replicas"),
    ({"--enable-dp-attention": None, "--dp-size": 2, "--attn-dp-size": 2}, "",
     "'--dp-size' starts that many replicas"),
    ({"--enable-dp-attention": None}, "algorithm: STANDALONE\n", None),
    ({"--attn-dp-size": 2}, "algorithm: STANDALONE\n", "'--attn-dp-size': SGLang 0.5.23 "
     "refuses STANDALONE"),
    # speculative_hook.py's _handle_ngram: no NGRAM drafting with data-parallel attention.
    ({"--attn-dp-size": 2}, "tp: 2\nmethods: [EAGLE3, NGRAM]\n", "'--attn-dp-size': "
     "SGLang 0.5.23 refuses NGRAM drafting with data-parallel attention"),
    ({"--enable-ep": None}, "", None),
])
def test_parallelism_flags_that_would_fail_every_launch_are_refused_before_ray(
        tmp_path, flags, extra, refused):
    """Each server gets the tp GPUs Ray gave its worker, on one node: with these SGLang
    wanted more GPUs than it could see, waited for nodes no one started, or refused the
    draft, and every launch failed after Ray started (a helper's audit of 0.5.23)."""
    path = tmp_path / "s.yaml"
    lines = "".join(f"  {flag}: {'null' if value is None else repr(value)}\n"
                    for flag, value in flags.items())
    batch = "" if "batch:" in extra else "batch: [1]\n"
    path.write_text(f"model: m\ndraft: d\ndatasets: [humaneval]\n{batch}{extra}"
                    f"server_flags:\n{lines}")
    if refused is None:
        assert set(load_study(path).server_flags) == set(flags)
        return
    with pytest.raises(TreetuneError) as info:
        load_study(path)
    message = str(info.value)
    assert refused in message and "key 'server_flags'" in message, message


@pytest.mark.parametrize(("flags", "batch", "running"), [
    ("{--attn-dp-size: 4}", "[1, 3]", 4), ("{--attn-dp-size: 4}", "[1, 6]", 8),
    ("{--attn-dp-size: 4}", "[1, 8]", 8),
    ("{--enable-dp-attention: null, --dp-size: 2}", "[1, 3]", 4), ("{}", "[1, 6]", 6)])
def test_each_attention_group_is_launched_with_at_least_its_share_of_the_largest_batch(
        tmp_path, flags, batch, running):
    """SGLang gives each of D attention groups max_running_requests // D requests and
    asserts that is one or more: launched with the largest batch, 3 over 4 groups failed
    every launch at start-up, and 6 was refused (a helper's audit). A multiple of D."""
    path = tmp_path / "s.yaml"
    path.write_text(f"model: m\ndraft: d\ndatasets: [humaneval]\ntp: 4\nbatch: {batch}\n"
                    f"server_flags: {flags}\n")
    launch = load_study(path).launch_spec()
    assert launch.max_running_requests == running
    # One GPU per group at tp 4 and 4 groups: SGLang captures any batch size.
    assert launch.cuda_graph_max_bs == int(batch.strip("[]").split(", ")[-1])
    from treetune.emulator.args import LaunchError, parse

    args = [a for pair in launch.extra_flags for a in (pair[0], *([] if pair[1] is None else
                                                                 [str(pair[1])]))]
    settings = parse(["--profile", "qwen3-coder-next-h200", "--model-path", "m",
                      "--tp-size", "4", "--max-running-requests", str(running), *args])
    assert settings.max_running_requests == running
    if "dp" in flags:  # as SGLang 0.5.23's tp_worker.py asserts
        with pytest.raises(LaunchError, match="AssertionError: max_running_request is zero"):
            parse(["--profile", "qwen3-coder-next-h200", "--model-path", "m", "--tp-size",
                   "4", "--max-running-requests", "1", *args])


def test_a_study_s_servers_get_a_cuda_graph_cap_sglang_can_capture_under(tmp_path):
    """tp 8 in 4 attention groups: SGLang captures only even batch sizes, so a cap of 1
    (the largest batch) left it nothing to capture, and every launch failed."""
    path = tmp_path / "s.yaml"
    path.write_text("model: m\ndraft: d\ndatasets: [humaneval]\ntp: 8\nbatch: [1]\n"
                    "server_flags: {--attn-dp-size: 4}\n")
    launch = load_study(path).launch_spec()
    assert (launch.max_running_requests, launch.cuda_graph_max_bs) == (4, 2)


@pytest.mark.parametrize(("extra", "refused"), [
    (["--cuda-graph-max-bs-decode", "1"], True), (["--cuda-graph-max-bs-decode", "2"], False),
    (["--cuda-graph-max-bs-decode", "1", "--disable-cuda-graph"], False), ([], False)])
def test_the_emulator_fails_as_sglang_does_with_no_batch_size_to_capture(extra, refused):
    from treetune.emulator.args import LaunchError, parse

    args = ["--profile", "qwen3-coder-next-h200", "--model-path", "m", "--tp-size", "4",
            "--attn-dp-size", "2", *extra]
    if refused:
        with pytest.raises(LaunchError, match=r"AssertionError: capture_bs=\[\]"):
            parse(args)
    else:
        assert parse(args).attention_dp == 2


def test_a_server_flag_written_with_its_value_in_the_key_is_refused(tmp_path):
    """`--tp-size=4` as a key would slip past every check of the flag's name."""
    path = tmp_path / "s.yaml"
    path.write_text("model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\n"
                    "server_flags: {--attention-backend=fa3: null}\n")
    with pytest.raises(TreetuneError, match=r"give the value as the flag's, "
                       r"\{--attention-backend: fa3\}"):
        load_study(path)


def test_a_space_file_named_in_a_study_file_is_found_next_to_it(tmp_path, monkeypatch):
    folder = tmp_path / "studies"
    folder.mkdir()
    (folder / "mine.yaml").write_text("steps: [1, 2]\ntopk: [1]\ndraft_tokens: [2, 3]\n")
    (folder / "s.yaml").write_text("model: m\ndraft: d\ndatasets: [mt-bench]\nbatch: [1]\n"
                                   "space: mine.yaml\n")
    monkeypatch.chdir(tmp_path)  # not the study file's folder
    spec = load_study(folder / "s.yaml")
    assert spec.space == str((folder / "mine.yaml").resolve())


def test_a_profile_or_prior_file_named_in_a_study_file_is_found_next_to_it(tmp_path,
                                                                         monkeypatch):
    """As its space and dataset files are: a search started from another folder read them
    from that folder ("myprof.yaml: file not found", a helper's audit)."""
    folder = tmp_path / "studies"
    folder.mkdir()
    profile = STUDIES.parent / "treetune" / "profiles" / "qwen3-8b-h100.yaml"
    (folder / "mine.yaml").write_text(profile.read_text())
    (folder / "s.yaml").write_text("model: m\ndraft: d\ndatasets: [mt-bench]\nbatch: [1]\n"
                                   "backend: {kind: emulator, profile: mine.yaml}\n"
                                   "search: {prior: mine.yaml}\n")
    monkeypatch.chdir(tmp_path)  # not the study file's folder
    spec = load_study(folder / "s.yaml")
    mine = str((folder / "mine.yaml").resolve())
    assert spec.backend.profile == mine and spec.search.prior == mine
    # A study stored by an older treetune, which kept the names as written (and found the
    # files from the study file's folder), still resumes; another file does not.
    import dataclasses

    from treetune.study.storage import StudyStore

    written = dataclasses.replace(
        spec, backend=dataclasses.replace(spec.backend, profile="mine.yaml"),
        search=dataclasses.replace(spec.search, prior="mine.yaml"))
    StudyStore(written)  # SQLite under tmp_path/runs/s: its attributes read back as JSON
    StudyStore(spec)  # resumes
    (folder / "other.yaml").write_text(profile.read_text())
    other = load_study(folder / "s.yaml", {"backend": {"profile": str(folder / "other.yaml")}})
    with pytest.raises(TreetuneError, match="created with a different spec"):
        StudyStore(other)


@pytest.mark.parametrize(("line", "message"), [
    ("seed: -3", "key 'seed': seed must be in 0..4294967294 (each batch size's search is "
     "seeded with seed + its batch size), got -3"),
    ("seed: 4294967295", "key 'seed': seed must be in 0..4294967294 (each batch size's "
     "search is seeded with seed + its batch size), got 4294967295"),
    ("measurement: {repeats: 0}", "key 'measurement.repeats': measurement.repeats must be "
     ">= 1, got 0"),
    ("measurement: {duration_s: 0}", "key 'measurement.duration_s': measurement.duration_s "
     "must be > 0, got 0"),
])
def test_a_seed_optuna_cannot_take_or_a_bad_measurement_value_is_named_when_read(
        tmp_path, line, message):
    """A negative seed was an internal error once the study's storage was made; a bad
    measurement value was blamed on the whole section (a helper's audit)."""
    study = tmp_path / "s.yaml"
    study.write_text(f"model: m\ndraft: d\ndatasets: [mt-bench]\nbatch: [1]\n{line}\n")
    with pytest.raises(ConfigFileError) as caught:
        load_study(study)
    assert str(caught.value) == f"{study}, line 5: {message}"


def test_a_world_on_the_command_line_replaces_the_study_file_s_profile():
    from treetune.study.spec import option_overrides

    spec = load_study(STUDIES / "demo.yaml", option_overrides({"backend.world": "cliffs"}))
    assert spec.backend.world == "cliffs" and spec.backend.profile is None
    assert spec.backend.time_scale == load_study(STUDIES / "demo.yaml").backend.time_scale
    with pytest.raises(ConfigFileError, match=r"^command line: --world \(backend.world\): give "
                       r"backend.profile or backend.world, not both"):
        load_study(STUDIES / "demo.yaml", option_overrides({
            "backend.world": "cliffs", "backend.profile": "qwen3-8b-h100"}))


@pytest.mark.parametrize(("key", "value", "blamed"), [
    ("datasets", ["foo"], "--datasets (datasets[0]): unknown built-in dataset 'foo'"),
    ("compare", ["3,4"], "--compare (compare[0]): tree '3,4' must be three integers"),
    ("methods", ["EAGLE3", "FOO"], "--methods (methods[1]): draft method 'FOO' is not one of"),
    ("search.strategy", "tpee", "--strategy (search.strategy): search.strategy must be one"),
    ("search.launch_cv", 1.5, "key 'search.launch_cv': search.launch_cv must be in [0, 1)"),
])
def test_a_bad_command_line_value_is_blamed_on_the_command_line_not_the_file(key, value,
                                                                             blamed):
    from treetune.study.spec import option_overrides

    with pytest.raises(ConfigFileError) as caught:
        load_study(STUDIES / "demo.yaml", option_overrides({key: value}))
    assert str(caught.value).startswith(f"command line: {blamed}"), str(caught.value)


@pytest.mark.parametrize(("key", "line", "value", "message"), [
    ("space", "space: defualt", "defualt", "unknown search space 'defualt' (did you mean "
     "'default'?)"),
    ("search.prior", "search: {prior: qwen3-8b}", "qwen3-8b", "unknown profile 'qwen3-8b'"),
    ("backend.profile", "backend: {kind: emulator, profile: qwen3-8b}", "qwen3-8b",
     "unknown profile 'qwen3-8b'"),
    ("backend.world", "backend: {kind: emulator, world: clifs}", "clifs",
     "unknown world 'clifs' (did you mean 'cliffs'?)"),
    ("methods[1].space", "methods: [EAGLE3, {name: NGRAM, space: ngarm}]", "ngarm",
     "unknown search space 'ngarm' (did you mean 'ngram'?)"),
])
def test_an_unknown_shipped_name_is_refused_at_its_line_when_the_study_is_read(
        tmp_path, key, line, value, message):
    """It was refused only after the study's banner, by the check that loads it, without
    the file or key it was written at (a helper's audit)."""
    study = tmp_path / "s.yaml"
    study.write_text(f"model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\n{line}\n")
    with pytest.raises(ConfigFileError) as caught:
        load_study(study)
    assert str(caught.value).startswith(f"{study}, line 5: key '{key}': {message}"), str(
        caught.value)


def test_a_space_or_profile_given_as_a_file_is_left_to_its_loader(tmp_path):
    study = tmp_path / "s.yaml"
    study.write_text("model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\n"
                     "space: mine.yaml\nsearch: {prior: ./profiles/p.yaml}\n")
    spec = load_study(study)  # a missing file is the loader's to name, with its path
    assert spec.space == "mine.yaml" and spec.search.prior == "./profiles/p.yaml"


@pytest.mark.parametrize("host", ["", " ", "127.0.0.1 "])
def test_an_empty_or_spaced_host_is_refused(host):
    from treetune.study.spec import option_overrides

    with pytest.raises(ConfigFileError, match=r"^command line: --host \(host\): host .* is not an "
                       r"address to listen on"):
        load_study(STUDIES / "demo.yaml", option_overrides({"host": host}))


@pytest.mark.parametrize(("study", "key", "value", "message"), [
    ("qwen3-coder-next.yaml", "backend.time_scale", 5.0,
     "'time_scale' is a setting of the emulator backend, and this study's backend is sglang"),
    ("demo.yaml", "backend.gpu", "H200",
     "'gpu' is a setting of the sglang backend, and this study's backend is emulator"),
])
def test_another_backend_s_option_names_the_backend_it_belongs_to(study, key, value, message):
    from treetune.study.spec import option_overrides

    with pytest.raises(ConfigFileError) as caught:
        load_study(STUDIES / study, option_overrides({key: value}))
    flag = {"backend.time_scale": "--time-scale", "backend.gpu": "--gpu"}[key]
    assert str(caught.value) == f"command line: {flag} ({key}): {message}"


def test_a_server_flag_of_several_values_is_given_as_separate_words(tmp_path):
    """SGLang's list flags (`--cuda-graph-bs-decode 1 2 4 8`) take one word per value: a YAML
    list is spread on the command line and kept a list in the config file; a study saved
    and loaded again is the same study."""
    from treetune.backends.sglang import sglang_deployment

    path = tmp_path / "s.yaml"
    path.write_text("model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1, 8]\n"
                    "server_flags: {--cuda-graph-bs-decode: [1, 2, 4, 8], "
                    "--trust-remote-code: null}\n")
    spec = load_study(path)
    launch = spec.launch_spec(port=1234)
    command = spec.backend.command(launch, TreeConfig(3, 4, 8), None)
    at = command.index("--cuda-graph-bs-decode")
    assert command[at:at + 6] == ["--cuda-graph-bs-decode", "1", "2", "4", "8",
                                  "--trust-remote-code"]
    config = sglang_deployment(launch, TreeConfig(3, 4, 8)).config_file
    assert config["cuda-graph-bs-decode"] == [1, 2, 4, 8] and config["trust-remote-code"] is True
    spec.save(tmp_path / "copy" / "study.yaml")
    again = load_study(tmp_path / "copy" / "study.yaml")
    assert again.server_flags == spec.server_flags and again.fingerprint() == spec.fingerprint()
    path.write_text("model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\n"
                    "server_flags: {--cuda-graph-bs-decode: []}\n")
    with pytest.raises(TreetuneError, match="takes at least one value"):
        load_study(path)


def test_a_changed_study_is_refused_naming_what_changed(tmp_path):
    """Resuming a study under another spec names each field that differs, with both values,
    so the user sees which option moved (the stored study.yaml is the other side)."""
    from treetune.study.storage import StudyStore

    base = {"name": "s", "model": "m", "draft": "d", "datasets": ["humaneval"],
            "batch": [1, 4], "output": str(tmp_path / "out"),
            "server_flags": {"--attention-backend": "fa3"}}
    StudyStore(load_study(None, base))
    changed = load_study(None, {**base, "batch": [1, 8],
                                "server_flags": {"--attention-backend": "triton"}})
    with pytest.raises(TreetuneError) as info:
        StudyStore(changed)
    message = str(info.value)
    assert "batch: stored [1, 4], now [1, 8]" in message
    assert ("server_flags.--attention-backend: stored 'fa3', now 'triton'" in message), message
    StudyStore(load_study(None, base))  # the same spec resumes
    # A field its fingerprint leaves out at the default is named with that default, not
    # as "stored None" (a helper's audit).
    with pytest.raises(TreetuneError) as info:
        StudyStore(load_study(None, {**base, "objective": "ttft_p99", "rates": [2.0],
                                     "measurement": {"max_clock_lag_s": 0.2}}))
    message = str(info.value)
    assert "objective: stored 'throughput', now 'ttft_p99'" in message, message
    assert "rates: stored [], now [2.0]" in message, message
    assert "measurement.max_clock_lag_s: stored 0.05, now 0.2" in message, message


def test_a_dataset_file_named_where_a_name_goes_is_read_as_that_file(tmp_path):
    """`--datasets data/chat.jsonl` (or `datasets: [chat.jsonl]`): the file, named after
    it, its format read from its records; a name that is neither a built-in nor a file's
    path is refused saying how to give a file."""
    from treetune.datasets import load_datasets

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.jsonl").write_text(
        '{"prompt": "hello there"}\n{"prompt": "write a poem"}\n')
    path = tmp_path / "s.yaml"
    path.write_text("model: m\ndraft: d\ndatasets: [data/chat.jsonl, mt-bench]\nbatch: [1]\n")
    spec = load_study(path)
    assert spec.dataset_names == ["chat", "mt-bench"]
    loaded = load_datasets(spec.datasets, Path(spec.base_dir))
    assert len(loaded["chat"].prompts) == 2
    with pytest.raises(TreetuneError, match=r"give a file's path \(ending .json or .jsonl"):
        load_study(None, {"model": "m", "draft": "d", "datasets": ["chat"], "batch": [1]})


def test_a_dataset_file_given_on_the_command_line_is_the_working_directory_s(
        tmp_path, monkeypatch):
    """With a study file elsewhere, `--datasets data/chat.jsonl` names the file where the
    user stands, not beside the study file; a file that would take a built-in's name is
    refused, naming the way to give it its own."""
    from treetune.study.spec import option_overrides

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.JSONL").write_text('{"prompt": "hello there"}\n')
    monkeypatch.chdir(tmp_path)
    spec = load_study(STUDIES / "demo.yaml", option_overrides({"datasets": ["data/chat.JSONL"]}))
    assert spec.datasets[0].path == str(tmp_path / "data" / "chat.JSONL")
    with pytest.raises(TreetuneError, match=r"a built-in dataset's name: give it its own, "
                       r"\{name: my-mt-bench, path: mt-bench.jsonl\}"):
        load_study(STUDIES / "demo.yaml", option_overrides({"datasets": ["mt-bench.jsonl"]}))


def test_an_adaptive_study_refuses_the_adaptive_flags_in_server_flags(tmp_path):
    """With `adaptive: true` the study sets --speculative-adaptive and its config on its
    adaptive launches, each with the config it measures: the same flags for every server
    would make every launch adaptive with one config. Without it, they are the user's."""
    base = {"model": "m", "draft": "d", "datasets": ["humaneval"], "batch": [1, 8]}
    for flag, value in (("--speculative-adaptive-config", "mine.json"),
                        ("--speculative-adaptive", None)):
        with pytest.raises(TreetuneError, match=f"'{flag}' is set by treetune on this "
                           "study's adaptive launches"):
            load_study(None, {**base, "adaptive": True, "server_flags": {flag: value}})
        assert load_study(None, {**base, "server_flags": {flag: value}}).server_flags


@pytest.mark.parametrize("version", ["0.5.10", "0.5.12"])
def test_an_adaptive_study_needs_an_sglang_that_reads_per_batch_size_slots(version):
    """0.5.11-0.5.12 read the config flat: the tuned slots would be ignored and the
    launches, labeled tuned, would serve candidate steps [1, 3, 7] (a helper's audit)."""
    base = {"model": "m", "draft": "d", "datasets": ["humaneval"], "batch": [1, 8],
            "adaptive": True}
    with pytest.raises(ConfigFileError, match=r"\(adaptive\): adaptive: SGLang reads a "
                       rf"per-batch-size adaptive config from 0\.5\.13 on .* sglang_version "
                       rf"{version}: give adaptive: false"):
        load_study(None, {**base, "sglang_version": version})
    assert load_study(None, {**base, "sglang_version": "0.5.13"}).adaptive


@pytest.mark.parametrize(("env", "message"), [
    ('{"X;touch /tmp/pwn;Y": "1"}', "env: 'X;touch /tmp/pwn;Y' is not an environment "
     "variable name"),
    ('{"A B": "1"}', "env: 'A B' is not an environment variable name"),
    ('{"SGLANG_X": "1\\ntrust-remote-code: true\\n#"}', "env: SGLANG_X's value holds a "
     "control character"),
])
def test_an_env_name_or_value_that_would_break_out_of_a_launch_script_is_refused(
        tmp_path, env, message):
    """Names went unquoted into `export NAME=VALUE` (the first ran its command when the
    script ran), a newline in a value ended the config file's comment and wrote a live key
    (a helper's audit)."""
    study = tmp_path / "s.yaml"
    study.write_text(f"model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\nenv: {env}\n")
    with pytest.raises(ConfigFileError, match=rf"^{re.escape(str(study))}, line 5: "):
        load_study(study)
    with pytest.raises(ConfigFileError, match=re.escape(message)):
        load_study(study)


@pytest.mark.parametrize("value", ['["1", "--host", "0.0.0.0"]', '"--host"'])
def test_a_server_flags_value_that_is_a_flag_is_refused(tmp_path, value):
    """`{--cuda-graph-bs: ["1", "--host", "0.0.0.0"]}` rebound every server to every
    interface past the check of the flags treetune sets, and without its warning."""
    study = tmp_path / "s.yaml"
    study.write_text("model: m\ndraft: d\ndatasets: [humaneval]\nbatch: [1]\n"
                     f"server_flags: {{--cuda-graph-bs: {value}}}\n")
    with pytest.raises(ConfigFileError, match=r"server_flags: '--cuda-graph-bs': its value "
                       r"'--host' starts with '--': give each flag as a key of its own"):
        load_study(study)
