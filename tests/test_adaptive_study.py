"""SGLang's adaptive steps as a study candidate: the config kind and its storage key, its
JSON and launch flags as SGLang 0.5.23 takes them, and a launch worker running it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from studykit import server_processes, small_study, wait_until
from synthetic import BASE, DATASETS, launch

from treetune.backends import LaunchSpec
from treetune.backends import sglang_adaptive as sglang_adaptive
from treetune.backends.sglang import sglang_command
from treetune.config import AdaptiveConfig, AdaptiveSlot, chain
from treetune.emulator.args import build_parser, parse
from treetune.errors import InvalidTreeError, TreetuneError
from treetune.results import config_from_key, config_key
from treetune.study.evidence import StudyNoise
from treetune.study.schedule import slot_keys, tune

SGLANG_MODULE = Path(__file__).resolve().parents[1] / "treetune" / "backends" / "sglang.py"
TUNED = AdaptiveConfig((AdaptiveSlot(1, (1, 2)), AdaptiveSlot(6, (2,)),
                        AdaptiveSlot(16, (0, 1), down_hysteresis=-0.25)))


# ---- the config kind ---------------------------------------------------------------------

@pytest.mark.parametrize("config", [AdaptiveConfig.sglang_default(), TUNED])
def test_an_adaptive_config_round_trips_through_its_storage_key(config):
    key = config_key(config)
    assert key.startswith("adaptive:") and config_from_key(key) == config
    assert config_key(config_from_key(key)) == key


def test_the_keys_and_labels_are_readable():
    assert config_key(AdaptiveConfig.sglang_default()) == (
        "adaptive:1=1.3.5.7,down=-0.25|8=0.1.3|32=0.1|64=0")
    assert config_key(TUNED) == "adaptive:1=1.2|6=2|16=0.1,down=-0.25"
    assert str(AdaptiveConfig.sglang_default()) == "adaptive (SGLang default)"
    assert TUNED.label() == "adaptive 1:{1,2} 6:{2} 16:{0,1}"


@pytest.mark.parametrize("config", [AdaptiveConfig.sglang_default(), TUNED])
def test_its_json_passes_sglangs_validation_and_loads_back_the_same(config, tmp_path):
    data = config.to_json()
    slots = sglang_adaptive.validate(data)
    assert [str(k) for k in slots] == list(data) and all(k.isdigit() for k in data)
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(data))
    assert AdaptiveConfig.from_json(sglang_adaptive.load(path)) == config


def test_sglangs_default_config_is_its_default_json_with_every_setting_explicit():
    assert AdaptiveConfig.from_json(sglang_adaptive.DEFAULT_CONFIG).is_sglang_default
    steps = {k: v["candidate_steps"] for k, v in
             AdaptiveConfig.sglang_default().to_json().items()}
    assert steps == {k: v["candidate_steps"] for k, v in
                     sglang_adaptive.DEFAULT_CONFIG.items()}
    assert AdaptiveConfig.sglang_default().initial_steps == 3  # SGLang's middle candidate


@pytest.mark.parametrize(("slots", "problem"), [
    ((), "at least one"),
    ((AdaptiveSlot(1, (0,)),), "never drafts"),
    ((AdaptiveSlot(8, (1,)), AdaptiveSlot(1, (2,))), "increasing order"),
])
def test_configs_sglang_could_not_serve_as_intended_are_refused(slots, problem):
    with pytest.raises(InvalidTreeError, match=problem):
        AdaptiveConfig(slots)


@pytest.mark.parametrize(("batch", "steps"), [(0, (1,)), (1, ()), (1, (3, 1)), (1, (-1, 1))])
def test_slots_hold_a_sorted_non_empty_list_of_non_negative_steps(batch, steps):
    with pytest.raises(InvalidTreeError):
        AdaptiveSlot(batch, steps)


# ---- its launch flags --------------------------------------------------------------------

def launch_spec(path: str | None) -> LaunchSpec:
    return LaunchSpec("org/target", "org/draft", adaptive_config_path=path, port=31234)


@pytest.mark.parametrize("config", [AdaptiveConfig.sglang_default(), TUNED])
def test_the_launch_command_parses_with_sglangs_flags_as_an_adaptive_server(config, tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(config.to_json()))
    argv = sglang_command(config, launch_spec(str(path)))
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    # The emulator's parser mirrors SGLang 0.5.23's flags and its adaptive checks.
    settings = parse(["--profile", "qwen3-coder-next-h200", *argv[3:]])
    assert settings.adaptive is not None and settings.adaptive_fallback is None
    assert settings.adaptive.config_path == str(path)
    assert settings.adaptive.steps == config.initial_steps
    ns, unknown = build_parser().parse_known_args([*argv[3:], "--profile", "x"])
    assert unknown == []
    assert (ns.speculative_eagle_topk, ns.speculative_num_draft_tokens) == (
        1, config.initial_steps + 1)
    assert ns.speculative_num_steps in config.candidate_steps
    facts = SGLANG_MODULE.read_text()
    for flag in (a for a in argv[3:] if a.startswith("--speculative")):
        assert f'"{flag}"' in facts, flag  # every flag is one of the SGLang backend's facts


def test_an_adaptive_launch_without_its_config_file_is_refused():
    with pytest.raises(TreetuneError, match="JSON config file"):
        sglang_command(TUNED, launch_spec(None))


# ---- a launch worker ---------------------------------------------------------------------

def test_a_launch_worker_writes_the_json_next_to_the_log_and_its_server_runs_adaptive(
        tmp_path):
    from treetune.results import LaunchResult
    from treetune.study.spec import load_study
    from treetune.study.worker import LaunchWorker

    spec = load_study(None, small_study(tmp_path, batch=[1], datasets=["humaneval"],
                                        compare=[]))
    result = LaunchResult.from_dict(LaunchWorker(spec, 0).run(config_key(TUNED), []))
    assert result.ok, result.reason
    assert result.config == TUNED and result.warnings == []
    assert result.server_info["speculative_adaptive"] is True
    written = list((spec.output_dir / "logs").glob("*.adaptive.json"))
    assert [p.name for p in written] == ["adaptive_1_1.2_6_2_16_0.1-down_-0.25.adaptive.json"]
    assert AdaptiveConfig.from_json(json.loads(written[0].read_text())) == TUNED
    assert wait_until(lambda: not server_processes(str(tmp_path)), 5)


# ---- tuning from measured chains ---------------------------------------------------------

def chains(per_steps: dict[int, dict[int, tuple[float, float]]]) -> list:
    """Measured chains: {steps: {batch: (sharegpt tok/s, humaneval tok/s)}} over
    synthetic.BASE (100 tok/s per dataset at batch 1, 1000 at batch 32)."""
    return [launch(chain(s), {b: dict(zip(DATASETS, tput, strict=True))
                              for b, tput in rows.items()})
            for s, rows in per_steps.items()]


def tuned(results, estimates=None, launch_cv=0.01):
    return tune([1, 32], DATASETS, 0.0, results, BASE, StudyNoise(launch_cv), estimates)


# Batch 1: chain 2 is best; chain 1 within the noise of it (1.31 vs 1.325); chain 3 too,
# but longer; chain 5 well below. Batch 32: every chain regresses humaneval.
MEASURED = {1: {1: (129, 133), 32: (1100, 990)}, 2: {1: (130, 135), 32: (1150, 980)},
            3: {1: (128, 132), 32: (1200, 950)}, 5: {1: (110, 112), 32: (1100, 800)}}


def test_a_slot_holds_the_best_chain_and_the_shorter_ones_within_its_noise():
    tuning = tuned(chains(MEASURED))
    one, _ = tuning.slots
    assert (one.batch, one.key, one.best, one.steps) == (1, 1, 2, (1, 2))
    assert 3 not in one.steps, "a longer chain would let the controller climb past the best"
    assert one.estimated == () and not tuning.estimated


def test_a_batch_size_where_no_chain_is_surely_feasible_gets_no_drafting():
    _, many = tuned(chains(MEASURED)).slots
    assert (many.batch, many.key, many.best, many.steps) == (32, 6, 0, (0,))
    config = tuned(chains(MEASURED)).config
    assert config is not None and config.to_json()["6"]["candidate_steps"] == [0]
    assert config_key(config) == "adaptive:1=1.2|6=0"


def test_without_noise_only_the_best_chain_is_a_candidate():
    one, _ = tuned(chains(MEASURED), launch_cv=0.0).slots
    assert one.steps == (2,)


def test_nothing_to_draft_anywhere_derives_no_config():
    regressing = {s: {1: (95, 99), 32: (1000, 900)} for s in (1, 2)}
    tuning = tuned(chains(regressing))
    assert [slot.steps for slot in tuning.slots] == [(0,), (0,)] and tuning.config is None


def test_an_unmeasured_chain_enters_from_the_models_estimates_flagged_as_such():
    import math

    measured = {s: rows for s, rows in MEASURED.items() if s != 2}
    estimates = {(chain(2), b, d): (math.log(speedup), 0.01 ** 2)
                 for b, speedup in ((1, 1.33), (32, 0.9)) for d in DATASETS}
    tuning = tuned(chains(measured), estimates)
    one, many = tuning.slots
    assert (one.best, one.steps, one.estimated) == (2, (1, 2), (2,))
    assert tuning.estimated and "2 from model estimates" in tuning.describe()
    assert many.steps == (0,), "the model's estimate of a regression keeps it out"
    without = tuned(chains(measured))
    assert without.slots[0].steps == (1,), "no model: only measured chains"


def test_slots_are_keyed_halfway_between_the_study_batch_sizes():
    assert slot_keys([32, 1]) == [1, 6]
    assert slot_keys([1, 8, 32]) == [1, 3, 16]
