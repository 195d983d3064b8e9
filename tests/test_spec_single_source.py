"""StudySpec is the one source of the study file's keys and of `treetune search`'s options:
both follow its fields, so adding a field cannot leave one of them behind."""

import dataclasses
import re
import typing
from types import SimpleNamespace

import typer
from studykit import run_cli

import treetune.cli
from treetune.backends import BACKENDS
from treetune.config import TreeConfig
from treetune.study.spec import (
    BACKEND_OPTIONS,
    StudySpec,
    file_schema,
    option_overrides,
    search_options,
)


def spec_fields(cls=StudySpec, prefix=""):
    """Every field of the spec and of its sections, by dotted key."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from spec_fields(hints[f.name], f"{prefix}{f.name}.")
        yield f"{prefix}{f.name}", f


def search_params():
    return {opt: param for param in typer.main.get_command(treetune.cli.app)
            .commands["search"].params for opt in param.opts}


def test_every_key_of_the_study_file_is_a_spec_field_and_every_field_a_key():
    keys = {f.name for f in dataclasses.fields(file_schema())}
    fields = {f.name for f in dataclasses.fields(StudySpec)}
    assert keys == (fields - {"base_dir"}) | {"description"}


def test_every_field_with_an_option_is_an_option_of_search_with_its_help():
    params = search_params()
    with_option = [f for _, f in spec_fields() if "option" in f.metadata]
    assert len(with_option) >= 20
    for f in with_option:
        # The field's help, and its default where the field has a plain one (an option
        # left out is None, so that a study file's value stands).
        assert params[f.metadata["option"]].help.startswith(f.metadata["help"].rstrip("."))
    assert params["--tp"].help.endswith("(GPUs per server) (default 1).")
    assert params["--budget-launches"].help.endswith("at least 2 (default 30).")
    assert params["--space"].help.endswith("(default 'default').")
    # default None: no "(default None)" added to the field's own words
    assert params["--workers"].help == ("GPU groups to use in parallel (default: all the "
                                        "cluster has; on a cluster, more wait for nodes that "
                                        "join).")


def test_search_help_lists_every_option_with_its_help(capsys):
    code, out, _ = run_cli(capsys, "search", "--help")
    text = re.sub(r"[\s│]+", " ", out)  # help wraps inside the box
    assert code == 0
    for option in search_options():
        assert option.flag in text and option.help in text, option.flag
    assert "--study" in text


def test_search_takes_exactly_the_derived_options():
    flags = {o.flag for o in search_options()} | {o.short for o in search_options() if o.short}
    assert "-o" in flags  # short forms come from the metadata too
    assert set(search_params()) == flags | {"--study"}


def test_backend_options_name_a_field_of_a_registered_backend():
    fields = {f.name for cls in BACKENDS.values() for f in dataclasses.fields(cls)}
    for option in BACKEND_OPTIONS:
        section, _, name = option.key.partition(".")
        assert section == "backend" and (name == "kind" or name in fields), option.key


def test_list_fields_take_several_values_after_one_flag():
    multiple = {o.flag for o in search_options() if o.multiple}
    assert multiple == {"--datasets", "--batch", "--rates", "--compare", "--methods"}
    assert multiple <= treetune.cli.multi_value_options()


def test_profile_implies_the_emulator_unless_a_backend_is_given():
    assert option_overrides({"backend.profile": "p", "budget.launches": 4, "tp": None}) == {
        "backend": {"profile": "p", "kind": "emulator"}, "budget": {"launches": 4}}
    assert option_overrides({"backend.profile": "p", "backend.kind": "sglang"}) == {
        "backend": {"profile": "p", "kind": "sglang"}}


# One value per option, as a user types it; the test below fails when an option is added
# without one here, so every option is shown to reach its field.
SAMPLES = {
    "--name": ("cli-study",), "--model": ("org/model",), "--datasets": ("humaneval", "mt-bench"),
    "--batch": ("1", "16"), "--rates": ("2", "8.5"), "--slo-ttft-ms": ("2000",),
    "--slo-tpot-ms": ("40",), "--objective": ("goodput",), "--draft": ("org/draft",),
    "--algorithm": ("EAGLE",), "--methods": ("EAGLE", "NEXTN"),
    "--sglang-version": ("0.5.13",), "--tp": ("2",), "--space": ("narrow",),
    "--budget-launches": ("7",), "--budget-time": ("600",), "--tolerance": ("0.05",),
    "--backend": ("emulator",), "--profile": ("qwen3-coder-next-h200",),
    "--time-scale": ("4",), "--ray-address": ("127.0.0.1:6379",), "--workers": ("3",),
    "--gpu-type": ("H100",),
    "--storage": ("sqlite:///elsewhere.db",), "--seed": ("9",), "--compare": ("3,4,8", "5,1,6"),
    "--output": ("OUT",), "--host": ("127.0.0.2",), "--api-key-env": ("MY_KEY",),
    "--strategy": ("grid",), "--prior": ("qwen3-8b-h100",), "--adaptive": (),
}


def test_every_option_sets_its_field(capsys, monkeypatch, tmp_path):
    # --world and --profile are two ways to name what the emulator serves, and --gpu belongs
    # to the SGLang backend: each has its own test below.
    assert set(SAMPLES) | {"--world", "--gpu"} == {o.flag for o in search_options()}
    seen = []

    def capture(spec, run_study):
        seen.append(spec)
        return SimpleNamespace(baseline=None, interrupted=False, ended="")

    monkeypatch.setattr(treetune.cli, "_run_with_progress", capture)
    argv = [a for flag, values in SAMPLES.items() for a in (flag, *values)]
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    code, _, err = run_cli(capsys, "search", *argv)
    assert code == 2 and "no baseline was measured" in err  # stopped after the spec was built
    spec = seen[0]
    assert (spec.name, spec.model, spec.draft, spec.algorithm) == (
        "cli-study", "org/model", "org/draft", "EAGLE")
    assert spec.method_names == ("EAGLE", "NEXTN")
    assert spec.dataset_names == ["humaneval", "mt-bench"] and spec.batch == (1, 16)
    assert spec.rates == (2.0, 8.5)
    assert (spec.slo.ttft_ms, spec.slo.tpot_ms, spec.objective) == (2000.0, 40.0, "goodput")
    assert (spec.sglang_version, spec.tp, spec.space) == ("0.5.13", 2, "narrow")
    assert (spec.budget.launches, spec.budget.wall_time_s, spec.tolerance) == (7, 600.0, 0.05)
    assert spec.backend.kind == "emulator" and spec.backend.profile == "qwen3-coder-next-h200"
    assert spec.backend.time_scale == 4.0
    assert (spec.ray_address, spec.workers, spec.storage, spec.seed) == (
        "127.0.0.1:6379", 3, "sqlite:///elsewhere.db", 9)
    assert spec.gpu_type == "H100"
    assert spec.compare == (TreeConfig(3, 4, 8), TreeConfig(5, 1, 6))
    assert spec.output == str(tmp_path / "out")
    assert (spec.host, spec.api_key_env) == ("127.0.0.2", "MY_KEY")
    assert (spec.search.strategy, spec.search.prior) == ("grid", "qwen3-8b-h100")
    assert spec.adaptive is True



def spec_from_command_line(capsys, monkeypatch, *options: str):
    """The spec `treetune search` builds from these options (it stops before any launch)."""
    seen = []

    def capture(spec, run_study):
        seen.append(spec)
        return SimpleNamespace(baseline=None, interrupted=False, ended="")

    monkeypatch.setattr(treetune.cli, "_run_with_progress", capture)
    code, _, err = run_cli(capsys, "search", "--model", "m", "--draft", "d", "--datasets",
                           "humaneval", "--batch", "1", *options)
    assert code == 2 and "no baseline was measured" in err
    return seen[0]


def test_the_world_option_names_the_emulated_world_and_implies_the_emulator(capsys,
                                                                             monkeypatch):
    spec = spec_from_command_line(capsys, monkeypatch, "--world", "cliffs")
    assert spec.backend.kind == "emulator" and spec.backend.world == "cliffs"
    assert spec.backend.profile is None


def test_the_gpu_option_sets_the_sglang_backends_gpu(capsys, monkeypatch):
    spec = spec_from_command_line(capsys, monkeypatch, "--backend", "sglang", "--gpu",
                                  "H100 SXM")
    assert spec.backend.kind == "sglang" and spec.backend.gpu == "H100 SXM"


def test_a_switch_is_unset_unless_given_so_the_study_files_value_stands(capsys, monkeypatch,
                                                                        tmp_path):
    assert spec_from_command_line(capsys, monkeypatch).adaptive is False
    study = tmp_path / "s.yaml"
    study.write_text("adaptive: true\n")
    assert spec_from_command_line(capsys, monkeypatch, "--study", str(study)).adaptive is True
    assert spec_from_command_line(capsys, monkeypatch, "--study", str(study),
                                  "--no-adaptive").adaptive is False
