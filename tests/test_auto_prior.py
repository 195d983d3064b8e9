"""The auto prior in use: `treetune prior` prints a profile the rest of treetune loads, and
a study on the SGLang backend builds the same prior by itself, so `auto` runs the model
search; when it cannot, auto falls back to TPE and says why in one line."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from studykit import fake_sglang, run_cli, small_study
from test_facts import HF, ROCM_SMI_MI300X, cache_with, fixture, stand_in_nvidia_smi

from treetune.config import BASELINE, TreeConfig
from treetune.errors import TreetuneError
from treetune.facts import auto_prior, gpu_facts, model_facts
from treetune.perfmodel import load_profile
from treetune.perfmodel.profile import Profile, with_attention_dp
from treetune.space import load_space
from treetune.study.planner import Planner
from treetune.study.spec import load_study
from treetune.study.storage import StudyStore
from treetune.yamlio import build

TARGET, DRAFT = fixture("Qwen/Qwen3-Coder-Next-FP8"), fixture(
    "thoughtworks/Qwen3-Coder-Next-Eagle3")


# ---- treetune prior ----------------------------------------------------------------------

def test_treetune_prior_writes_a_profile_that_loads_and_predicts(capsys, tmp_path):
    out = tmp_path / "prior.yaml"
    code, _, err = run_cli(capsys, "prior", "--model", TARGET, "--draft", DRAFT, "--tp", "4",
                           "--gpu", "H200", "-o", str(out))
    assert code == 0, err
    profile = load_profile(out)
    assert profile.tp == 4 and profile.hardware.gpu == "H200"
    # FP8 weights, but its head, norms and routers in bf16: said beside the counts, with
    # the routers every GPU holds whole and the KV each GPU holds of its 2 heads (half).
    assert ("3.87B active, 0.36B of them at 2 bytes (left unquantized) and the rest at 1, "
            "0.05B held whole on every GPU), 24576 KV bytes per token (12288 on each GPU)"
            ) in " ".join(err.split()), err
    assert profile.target.attention_layers == 12 and profile.target.weight_bytes == 1.0
    assert set(profile.datasets) >= {"mt-bench", "humaneval", "swebench-verified"}
    assert "wrote" in err
    code, stdout, err = run_cli(capsys, "predict", "--profile", str(out), "--tree", "3,4,8",
                                "--batch", "1", "--json")
    assert code == 0, err
    assert all(row["speedup"] > 0 for row in yaml.safe_load(stdout))


def test_treetune_prior_of_nextn_drafts_with_the_targets_mtp_layer(capsys, tmp_path):
    """SGLang's NEXTN drafts with the target's own MTP layer, as DeepSeek, GLM-4 and Qwen3.5
    are mostly served: no draft model to give, and the prior says what that layer costs."""
    deepseek, out = fixture("deepseek-ai/DeepSeek-V3"), tmp_path / "prior.yaml"
    code, _, err = run_cli(capsys, "prior", "--model", deepseek, "--algorithm", "nextn",
                           "--tp", "8", "--gpu", "H200", "-o", str(out))
    assert code == 0, err
    assert "NEXTN: its MTP layer, 336M read on every pass, plus its routed experts" in err
    profile = load_profile(out)
    assert profile.draft is None and profile.method_names == ["NEXTN"]
    mtp = profile.method("NEXTN").mtp
    assert mtp.routed_experts and mtp.kv_bytes_per_token == (512 + 64) * 2
    code, stdout, err = run_cli(capsys, "predict", "--profile", str(out), "--tree", "3,1,4",
                                "--batch", "1", "--json")
    assert code == 0, err
    assert [row["method"] for row in yaml.safe_load(stdout)] == ["NEXTN"] * len(
        profile.datasets)
    # calibrate takes the points as NEXTN's (the profile has no draft head) and writes the
    # fitted acceptance back as NEXTN's: the file predicts what the fit did.
    points = tmp_path / "points.csv"
    points.write_text("steps,topk,draft_tokens,batch,dataset,speedup,accept_length\n"
                      "3,1,4,1,mt-bench,1.5,3.1\n1,1,2,1,mt-bench,1.3,1.8\n")
    fitted = tmp_path / "fitted.yaml"
    code, _, err = run_cli(capsys, "calibrate", "--profile", str(out), "--measurements",
                           str(points), "-o", str(fitted))
    assert code == 0 and "the points are taken as its NEXTN method's" in err, err
    again = load_profile(fitted)
    assert again.draft is None and again.method_names == ["NEXTN"]
    assert again.method("NEXTN").acceptance["mt-bench"] != profile.method(
        "NEXTN").acceptance["mt-bench"]
    from treetune.config import TreeConfig
    from treetune.perfmodel import PerfModel

    assert abs(PerfModel(again).accept_length(TreeConfig(3, 1, 4), "mt-bench") - 3.1) < 0.1
    # A draft given to NEXTN, none to EAGLE3, and a target without an MTP layer: refused.
    code, _, err = run_cli(capsys, "prior", "--model", deepseek, "--algorithm", "NEXTN",
                           "--draft", DRAFT, "--gpu", "H200")
    assert code == 2 and "NEXTN drafts with the target's own MTP layer: drop --draft" in err
    code, _, err = run_cli(capsys, "prior", "--model", deepseek, "--gpu", "H200")
    assert code == 2 and "--algorithm EAGLE3 drafts with --draft: give it" in err
    code, _, err = run_cli(capsys, "prior", "--model", fixture("Qwen/Qwen3-8B"),
                           "--algorithm", "NEXTN", "--gpu", "H200")
    assert code == 2 and "names no multi-token-prediction layer (num_nextn_predict_layers" \
        in err, err
    # With a draft head, a target with an MTP layer describes NEXTN beside it.
    both = auto_prior(model_facts(fixture("zai-org/GLM-4.5-Air")), model_facts(DRAFT),
                      gpu_facts("H200"), 4)
    assert both.method_names == ["EAGLE3", "NEXTN"]


def test_treetune_prior_prints_the_shipped_profiles_schema_with_neutral_free_values(capsys):
    code, stdout, err = run_cli(capsys, "prior", "--model", fixture("Qwen/Qwen3-8B"),
                                "--draft", fixture("thoughtworks/Qwen3-8B-Eagle3"),
                                "--gpu", "NVIDIA H100 80GB HBM3", "--datasets", "mt-bench",
                                "sharegpt")
    assert code == 0, err
    data = yaml.safe_load(stdout)
    shipped = load_profile("qwen3-8b-h100").to_dict()
    assert set(data) == set(shipped)
    # The shipped profiles were calibrated with the head's fc read on every draft pass;
    # the prior says which of its parameters the fc is (read in the extend pass only), and
    # the attention a data-parallel attention group holds a copy of.
    for section in ("hardware", "target", "draft", "calibration", "noise"):
        extra = {"attention_layers"} | ({"fc_params_m"} if section == "draft" else set()) | (
            {"attention_params_b"} if section == "target" else set())
        assert set(data[section]) <= set(shipped[section]) | extra, section
    assert data["draft"]["fc_params_m"] == pytest.approx(3 * 4096 * 4096 / 1e6, rel=1e-4)
    profile = build(Profile, data, "stdout")
    assert list(profile.datasets) == ["mt-bench", "sharegpt"]
    acceptance = {d.acceptance for d in profile.datasets.values()}
    assert len(acceptance) == 1  # every dataset the same neutral guess
    assert profile.calibration == type(profile.calibration)()


def test_treetune_prior_reads_the_gpu_from_nvidia_smi(capsys, tmp_path, monkeypatch):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA H100 80GB HBM3, 81559 MiB\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    code, stdout, err = run_cli(capsys, "prior", "--model", fixture("Qwen/Qwen3-8B"),
                                "--draft", fixture("thoughtworks/Qwen3-8B-Eagle3"))
    assert code == 0, err
    assert yaml.safe_load(stdout)["hardware"]["gpu"] == "H100-SXM"


def test_treetune_prior_reads_an_amd_gpu_from_rocm_smi(capsys, tmp_path, monkeypatch):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", ROCM_SMI_MI300X, program="rocm-smi")
    monkeypatch.setenv("PATH", str(bin_dir))  # only the stand-in: no real nvidia-smi first
    code, stdout, err = run_cli(capsys, "prior", "--model", fixture("Qwen/Qwen3-8B"),
                                "--draft", fixture("thoughtworks/Qwen3-8B-Eagle3"))
    assert code == 0, err
    hardware = yaml.safe_load(stdout)["hardware"]
    assert hardware["gpu"] == "MI300X" and hardware["bandwidth_tb_s"] == 5.3


def test_treetune_prior_on_an_unknown_gpu_is_one_line_naming_the_gpu_option(capsys):
    code, stdout, err = run_cli(capsys, "prior", "--model", TARGET, "--draft", DRAFT,
                                "--gpu", "RTX 9999")
    assert code == 2 and stdout == ""
    assert err.count("\n") == 1 and "--gpu NAME" in err and "'RTX 9999'" in err


def test_treetune_prior_refuses_an_eagle3_head_given_as_the_target(capsys):
    # The same check as the search's own prior: models swapped by mistake would give a
    # 0.4B "target" drafted by an 8B model, a prior of nothing real.
    code, stdout, err = run_cli(capsys, "prior", "--model", DRAFT, "--draft", TARGET,
                                "--gpu", "H200")
    assert code == 2 and stdout == ""
    assert "is an EAGLE3 draft head, not a target model: give it as the draft" in err


@pytest.mark.parametrize("tp", ["3", "64"])
def test_treetune_prior_refuses_a_tp_the_attention_heads_do_not_split_over(capsys, tp):
    """Qwen3-8B: 32 query heads, 8 KV heads. SGLang's attention layers assert a whole share
    of each per GPU; a prior for 64 x H100 was printed, exit 0 (a helper's audit)."""
    code, stdout, err = run_cli(capsys, "prior", "--model", fixture("Qwen/Qwen3-8B"),
                                "--draft", fixture("thoughtworks/Qwen3-8B-Eagle3"),
                                "--gpu", "H100-SXM", "--tp", tp)
    message = " ".join(err.split())
    assert code == 2 and stdout == "", err
    assert f"--tp {tp}: SGLang cannot serve" in message
    assert f"its 32 attention heads do not split evenly over {tp} GPUs" in message
    assert "tp sizes that fit: 1, 2, 4, 8, 16" in message


@pytest.mark.parametrize(("model", "tp", "problem"), [
    ("Qwen/Qwen3-8B", 16, ""),  # 8 KV heads, each copied to two GPUs
    ("Qwen/Qwen3-Coder-Next-FP8", 4, ""),  # 16 heads; 2 KV heads, each on two GPUs
    ("zai-org/GLM-4.5-Air", 3, "its 8 KV heads neither split evenly over 3 GPUs"),
    ("zai-org/GLM-4.5-Air", 16, ""),
    ("deepseek-ai/DeepSeek-V3", 8, ""),  # MLA: one latent, no KV heads to split
    ("deepseek-ai/DeepSeek-V3", 6, "its 128 attention heads do not split evenly"),
])
def test_a_tp_size_is_checked_against_the_query_and_kv_heads(model, tp, problem):
    found = model_facts(fixture(model)).tp_problem(tp)
    assert (found.startswith(problem) and found) if problem else found == ""


def test_treetune_prior_refuses_a_draft_head_trained_for_another_target_width(capsys):
    # Its first layer reads three 2048-wide hidden states; Qwen3-8B's are 4096 wide.
    code, stdout, err = run_cli(capsys, "prior", "--model", fixture("Qwen/Qwen3-8B"),
                                "--draft", DRAFT, "--gpu", "H200")
    assert code == 2 and stdout == ""
    assert "is an EAGLE3 head for a target of hidden size 2048" in " ".join(err.split())


def test_a_prior_from_a_config_json_path_is_named_after_its_folder_with_exact_counts(capsys):
    code, stdout, err = run_cli(capsys, "prior", "--model",
                                f"{fixture('Qwen/Qwen3-8B')}/config.json",
                                "--draft", fixture("thoughtworks/Qwen3-8B-Eagle3"),
                                "--gpu", "H100-SXM")
    assert code == 0, err
    data = yaml.safe_load(stdout)
    assert data["name"] == "auto-qwen3-8b-h100-sxm"
    # 36 layers x 8 KV heads x 128 x (K and V) x 2 bytes, not rounded to 147460.
    assert data["target"]["kv_bytes_per_token"] == 147456


def test_treetune_prior_prices_a_plain_draft_as_standalone_and_refuses_it_as_eagle3(capsys):
    args = ("prior", "--model", fixture("Qwen/Qwen3-30B-A3B-FP8"), "--draft",
            fixture("Qwen/Qwen3-8B"), "--gpu", "H200")
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and "is a plain model (Qwen3ForCausalLM)" in err, err
    code, stdout, err = run_cli(capsys, *args, "--algorithm", "standalone")
    assert code == 0, err
    # Its STANDALONE method, not a draft head: a study of STANDALONE searches with it.
    data = yaml.safe_load(stdout)
    assert "draft" not in data and data["methods"]["STANDALONE"]["drafter"] == "standalone"
    assert data["methods"]["STANDALONE"]["draft"]["layers"] == 36
    assert build(Profile, data, "prior.yaml").method_names == ["STANDALONE"]
    code, _, err = run_cli(capsys, *args, "--algorithm", "NGRAM")
    assert code == 2 and "--algorithm 'NGRAM' is not one the auto prior describes (EAGLE3, " \
        "EAGLE, NEXTN, STANDALONE)" in err, err


def test_treetune_prior_without_a_config_names_where_it_looked(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli(capsys, "prior", "--model", "Org/Not-Here", "--draft", DRAFT,
                           "--gpu", "H200")
    assert code == 2
    assert "no config.json for 'Org/Not-Here'" in err
    assert str(tmp_path / "cache" / "models--Org--Not-Here" / "snapshots") in err


def test_treetune_prior_finds_hub_names_in_the_local_cache(capsys, tmp_path, monkeypatch):
    cache_with(tmp_path, "Qwen/Qwen3-8B")
    cache_with(tmp_path, "thoughtworks/Qwen3-8B-Eagle3")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    code, stdout, err = run_cli(capsys, "prior", "--model", "Qwen/Qwen3-8B", "--draft",
                                "thoughtworks/Qwen3-8B-Eagle3", "--gpu", "H100-SXM")
    assert code == 0, err
    data = yaml.safe_load(stdout)
    assert data["target"]["name"] == "Qwen/Qwen3-8B" and data["name"] == "auto-qwen3-8b-h100-sxm"


# ---- the study's prior on the SGLang backend ----------------------------------------------

def sglang_study(tmp_path, **over):
    fields = {"model": TARGET, "draft": DRAFT, "tp": 4, "batch": [1, 32],
              "datasets": ["mt-bench", "terminal-bench"], "space": "default", **over,
              "backend": {"kind": "sglang", "python": sys.executable,
                          **over.get("backend", {})}}
    return load_study(None, small_study(tmp_path, **fields))


def planner_for(spec):
    store = StudyStore(spec, storage=optuna.storages.InMemoryStorage())
    return Planner(spec, store, load_space(spec.space), [], tp=spec.tp)


def test_the_sglang_backend_builds_the_auto_prior_and_auto_picks_the_model_search(tmp_path):
    spec = sglang_study(tmp_path, backend={"gpu": "H200"})
    planner = planner_for(spec)
    assert planner.strategy_name == "model" and planner.note == ""
    prior = planner.strategy.context.prior
    expected = auto_prior(model_facts(TARGET), model_facts(DRAFT), gpu_facts("H200"), 4)
    assert prior.target == expected.target and prior.hardware == expected.hardware
    assert list(prior.datasets) == ["mt-bench", "terminal-bench"]


def test_a_nextn_study_on_sglang_searches_with_its_mtp_layers_prior(tmp_path):
    """A study of NEXTN alone, on the SGLang backend, had no auto prior (no draft model to
    read) and ran TPE. Now its model search starts from the MTP layer's prior, seen as
    NEXTN (a profile's draft head would price another draft); in a study of NEXTN and
    NGRAM, NEXTN's search takes it too."""
    from treetune.perfmodel import PerfModel

    deepseek = fixture("deepseek-ai/DeepSeek-V3")
    spec = sglang_study(tmp_path, model=deepseek, draft=None, algorithm="NEXTN", tp=8,
                        backend={"gpu": "H200"})
    planner = planner_for(spec)
    assert planner.strategy_name == "model" and planner.note == ""
    assert PerfModel(planner.strategy.context.prior).method.mtp is not None
    spec = sglang_study(tmp_path, model=deepseek, draft=None, algorithm="NEXTN", tp=8,
                        backend={"gpu": "H200"}, methods=["NEXTN", "NGRAM"])
    parts = planner_for(spec).strategy.parts.values()
    assert [(p.name, p.strategy_name) for p in parts] == [("NEXTN", "model"), ("NGRAM", "tpe")]
    # NEXTN first, an EAGLE3 head beside it: the prior is built from the head, and
    # describes both (it was built from NEXTN's missing draft: EAGLE3 ran TPE).
    from test_facts import eagle3_head

    (tmp_path / "head").mkdir()
    head = eagle3_head(tmp_path / "head", 7168, 18432)
    spec = sglang_study(tmp_path, model=deepseek, draft=None, algorithm="NEXTN", tp=8,
                        backend={"gpu": "H200"},
                        methods=["NEXTN", {"name": "EAGLE3", "draft": head}])
    parts = planner_for(spec).strategy.parts.values()
    assert [(p.name, p.strategy_name) for p in parts] == [("NEXTN", "model"),
                                                          ("EAGLE3", "model")]
    # A target without an MTP layer: TPE, and the reason in one line.
    spec = sglang_study(tmp_path, model=fixture("Qwen/Qwen3-8B"), draft=None,
                        algorithm="NEXTN", backend={"gpu": "H200"})
    planner = planner_for(spec)
    assert planner.strategy_name == "tpe"
    assert "names no multi-token-prediction layer" in planner.note


@pytest.mark.parametrize("of_methods", [False, True])
def test_a_nextn_study_of_a_target_without_an_mtp_layer_is_refused_before_ray(
        tmp_path, of_methods):
    """NEXTN drafts with the target's own MTP layer. A study of NEXTN on a target whose
    config.json names none searched by TPE (no prior) and every launch then failed in
    SGLang after Ray started: refused here now, as `treetune prior` refuses it; a target
    with an MTP layer passes."""
    from treetune.backends.sglang import check_models
    from treetune.study.preflight import check_study

    plain, deepseek = fixture("Qwen/Qwen3-8B"), fixture("deepseek-ai/DeepSeek-V3")
    if of_methods:
        over = {"draft": fixture("thoughtworks/Qwen3-8B-Eagle3"),
                "methods": ["EAGLE3", "NEXTN"]}
        prefix = "NEXTN: "
    else:
        over, prefix = {"draft": None, "algorithm": "NEXTN"}, ""
    spec = sglang_study(tmp_path, model=plain, tp=1, backend={"gpu": "H100-SXM"}, **over)
    refused = (rf"^{prefix}'.*Qwen3-8B' \(.*config\.json\) names no multi-token-prediction "
               r"layer \(num_nextn_predict_layers, mtp_num_hidden_layers\), which NEXTN "
               r"drafts with: give its draft model and another algorithm \(EAGLE3\)$")
    with pytest.raises(TreetuneError, match=refused):
        check_models(spec.launch_spec(), {})
    with pytest.raises(TreetuneError, match=refused):
        check_study(spec)
    check_models(sglang_study(tmp_path, model=deepseek, draft=None, algorithm="NEXTN", tp=8,
                              backend={"gpu": "H200"}).launch_spec(), {})


def test_an_emulated_study_of_one_draft_method_is_searched_with_that_methods_prior(tmp_path):
    """The 397B profile describes its EAGLE3 head and its MTP layer (NEXTN): a study of
    NEXTN alone fitted and proposed with the head's draft costs."""
    from treetune.perfmodel import PerfModel
    from treetune.study.planner import study_prior

    spec = load_study(None, small_study(
        tmp_path, model="Qwen/Qwen3.5-397B-A17B", draft=None, algorithm="NEXTN", tp=8,
        datasets=["mt-bench", "humaneval"], compare=[],
        backend={"kind": "emulator", "profile": "qwen3.5-397b-a17b-h200"}))
    prior, why_not = study_prior(spec)
    assert why_not == "" and PerfModel(prior).method.mtp is not None
    assert planner_for(spec).strategy_name == "model"


def test_the_sglang_backend_asks_nvidia_smi_with_the_studys_environment(tmp_path):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA H200, 143771 MiB\n")
    spec = sglang_study(tmp_path, env={"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin"})
    planner = planner_for(spec)
    assert planner.strategy_name == "model"
    assert planner.strategy.context.prior.hardware.gpu == "H200"


def test_a_server_flag_for_an_fp8_kv_cache_reaches_the_prior(tmp_path):
    spec = sglang_study(tmp_path, backend={"gpu": "H200"},
                        server_flags={"--kv-cache-dtype": "fp8_e4m3"})
    prior = planner_for(spec).strategy.context.prior
    assert prior.target.kv_bytes_per_token == 12 * 2 * 2 * 256
    assert prior.draft.kv_bytes_per_token == 2 * 4 * 128



@pytest.mark.parametrize(("batch", "fraction", "fit"), [
    (256, None, 43), (256, "0.95", 41), (256, "0.383", 0)])
def test_the_studys_static_memory_fraction_decides_the_trees_the_search_proposes(
        tmp_path, batch, fraction, fit):
    """The model search proposes only trees that can start. It judged them at the prior's
    share of GPU memory (0.85), whatever the study's --mem-fraction-static: at 0.95 and
    batch 256 the 30B-A3B on an H100 starts 41 of 43 trees (the widest have too little
    left for their workspace), and the search could propose any; at 0.383 its weights with
    a draft head leave no KV pool, and it proposed trees all the same."""
    from treetune.perfmodel import check_memory

    flags = {"--mem-fraction-static": fraction} if fraction else {}
    spec = load_study(None, small_study(
        tmp_path, model="Qwen/Qwen3-30B-A3B", draft="Tengyunw/qwen3_30b_moe_eagle3", tp=1,
        batch=[1, batch], server_flags=flags,
        backend={"kind": "emulator", "profile": "qwen3-30b-a3b-h100"}))
    strategy = planner_for(spec).strategy
    assert strategy.context.prior.server.mem_fraction_static == float(fraction or 0.85)
    assert len(strategy.candidates) == fit
    # The trees the emulator starts with the study's flags (its truth: the same profile).
    truth = load_profile("qwen3-30b-a3b-h100")
    launch = spec.launch_spec()
    starts = [c for c in load_space(spec.space).configs()
              if check_memory(truth, c, launch.max_running_requests, tp=1,
                              mem_fraction_static=launch.mem_fraction_static).starts]
    assert strategy.candidates == starts



def test_a_baseline_whose_weights_the_gpus_cannot_hold_is_said_before_its_launch(tmp_path):
    """`treetune search` of a large model without --tp: SGLang loads the weights (minutes)
    before it finds no room for a KV cache. The prior knows the weights and the GPU, so
    the study says so before the baseline's launch and names a TP that would hold them;
    said again if the launch fails as said. Nothing at a TP that holds them."""
    for tp, said in ((1, "--tp 2 would leave room"), (2, "")):
        planner = planner_for(sglang_study(tmp_path, tp=tp, backend={"gpu": "L40S"}))
        if said:
            assert planner.baseline_memory().startswith(
                f"the prior says the baseline's server cannot start at --tp {tp} on L40S "
                "(out of memory: baseline needs ")
            assert planner.baseline_memory().endswith(f"no room for a KV cache); {said}")
        else:
            assert planner.baseline_memory() == ""


@pytest.mark.parametrize("flags", [{}, {"--mem-fraction-static": "0.85"}])
def test_the_share_of_memory_sglang_chose_for_a_tree_decides_the_trees_proposed(
        tmp_path, flags):
    """Left to choose, SGLang sizes its share of GPU memory by itself (by the GPU's
    memory, the chunked prefill, the CUDA-graph cap and the parallel size, differently
    from release to release), not as the prior's 0.85.
    Once a tree's server says what it took, the model search judges which trees can start
    at that share, and a word says so; a resumed study starts there. A share the study
    gives stands."""
    from treetune.results import CellResult, LaunchResult

    spec = load_study(None, small_study(
        tmp_path, model="Qwen/Qwen3-30B-A3B", draft="Tengyunw/qwen3_30b_moe_eagle3", tp=1,
        batch=[1, 256], server_flags=flags,
        backend={"kind": "emulator", "profile": "qwen3-30b-a3b-h100"}))
    planner = planner_for(spec)
    assert len(planner.strategy.candidates) == 43

    def absorb(config, index: int = 0, share: float = 0.95) -> None:
        cell = CellResult("humaneval", 256, 1000.0, None, 100, 10_000, 6.0, None, None,
                          repeats=(1000.0, 1000.0))
        planner.absorb(LaunchResult(config, ok=True, cells=[cell],
                                    server_info={"mem_fraction_static": share}), index)

    absorb(BASELINE)  # no speculation: SGLang reserves otherwise, and no tree was judged
    assert planner.memory_notes() == []
    absorb(TreeConfig(3, 1, 4))
    strategy = planner.strategy
    notes = planner.memory_notes()
    if flags:
        assert notes == [] and len(planner.strategy.candidates) == 43
        return
    assert len(notes) == 1 and notes[0].startswith(
        "SGLang took 0.95 of each GPU's memory for weights and KV cache (its own choice, the "
        "study's server_flags leave it; the prior assumed 0.85): from launch 3 on, the model "
        "search proposes the trees that can start at that share"), notes
    assert planner.strategy_name == "model" and len(planner.strategy.candidates) == 41
    # The same search, what it learnt kept (a review found it made anew, its fit cold).
    assert planner.strategy is strategy and strategy.fit.prior is planner.context.prior
    assert strategy.fit.caps(BASELINE) > strategy.fit.caps(TreeConfig(3, 1, 4)) > 1
    assert planner.memory_notes() == []  # said once
    # On a node of other GPUs SGLang took another share: one for the study, the least,
    # not a new search at every launch.
    absorb(TreeConfig(2, 1, 3), share=0.97)
    assert planner.memory_notes() == [] and len(planner.strategy.candidates) == 41
    again = Planner(spec, planner.store, load_space(spec.space), planner.launched, tp=1)
    assert len(again.strategy.candidates) == 41 and again.memory_notes() == []


def test_without_a_config_auto_falls_back_to_tpe_and_says_why_in_one_line(tmp_path):
    spec = sglang_study(tmp_path, model=str(tmp_path / "no-such-model"),
                        backend={"gpu": "H200"})
    planner = planner_for(spec)
    assert planner.strategy_name == "tpe"
    assert planner.note.startswith("strategy tpe: no performance-model prior (no config.json")
    assert str(tmp_path / "no-such-model" / "config.json") in planner.note
    assert "\n" not in planner.note


HUB_TARGET, HUB_DRAFT = "Qwen/Qwen3-Coder-Next-FP8", "thoughtworks/Qwen3-Coder-Next-Eagle3"


def test_models_not_yet_downloaded_leave_tpe_until_sglang_has_fetched_them(tmp_path):
    """On a fresh node the models are not in the Hugging Face cache until SGLang's first
    start downloads them: `auto` ran TPE for the whole study. It now asks again after
    each launch, and the model search takes over once both config.json are there."""
    from treetune.study.planner import local_facts

    cache = tmp_path / "hub"
    spec = sglang_study(tmp_path, model=HUB_TARGET, draft=HUB_DRAFT, backend={"gpu": "H200"},
                        env={"HF_HUB_CACHE": str(cache)})
    planner = planner_for(spec)
    assert planner.strategy_name == "tpe" and planner.awaiting_facts
    assert "the model search takes over once they are here" in planner.note
    cache_with(cache, HUB_TARGET)  # the baseline's server fetched the target
    assert planner.adopt_facts(local_facts(spec), tree_launched=False) == ""
    assert planner.strategy_name == "tpe" and planner.awaiting_facts
    cache_with(cache, HUB_DRAFT)  # a tree's server fetched the draft head
    note = planner.adopt_facts(local_facts(spec), tree_launched=True)
    assert note.startswith("strategy model from launch 1 on (was tpe): the models' "
                           "config.json are on the node now"), note
    assert planner.strategy_name == "model" and not planner.awaiting_facts
    local = planner_for(sglang_study(tmp_path, backend={"gpu": "H200"}))  # the same files
    fetched, read = planner.strategy.context.prior.target, local.strategy.context.prior.target
    assert fetched.name == HUB_TARGET and fetched == dataclasses.replace(read, name=HUB_TARGET)


def test_a_study_of_several_methods_takes_the_model_search_once_the_models_are_fetched(
        tmp_path):
    """As a study of one method: each method's search `auto` now resolves otherwise
    changes, with its trees' measurements so far; NGRAM, which the auto prior does not
    describe, stays with TPE. Another method's launch fetches nothing of `draft`."""
    from treetune.study.planner import local_facts

    cache = tmp_path / "hub"
    spec = sglang_study(tmp_path, model=HUB_TARGET, draft=HUB_DRAFT, backend={"gpu": "H200"},
                        env={"HF_HUB_CACHE": str(cache)}, methods=["EAGLE3", "NGRAM"])
    planner = planner_for(spec)
    assert planner.strategy_name == "tpe" and planner.awaiting_facts
    assert planner.note.startswith("draft methods EAGLE3 (tpe), NGRAM (tpe): one search each")
    assert "the model search takes over once they are here" in planner.note
    cache_with(cache, HUB_TARGET)  # the baseline's server, and an NGRAM tree's
    assert planner.adopt_facts(local_facts(spec), tree_launched=False) == ""
    assert planner.awaiting_facts
    cache_with(cache, HUB_DRAFT)
    note = planner.adopt_facts(local_facts(spec), tree_launched=True)
    assert note.startswith("draft methods EAGLE3 (tpe -> model) from launch 1 on: the "
                           "models' config.json are on the node now"), note
    assert planner.strategy_name == "model" and not planner.awaiting_facts
    parts = planner.strategy.parts
    assert [(p.name, p.strategy_name) for p in parts.values()] == [
        ("EAGLE3", "model"), ("NGRAM", "tpe")]
    assert parts[""].strategy.context.prior.target.name == HUB_TARGET
    assert planner.strategy.propose() is not None  # the turns go on over both


def test_facts_missing_for_another_reason_or_after_a_tree_are_not_asked_again(tmp_path):
    """An unknown GPU is not fetched by a launch: nothing to ask again. A config still
    missing after a tree's launch (its server loaded the draft) will not come either."""
    from treetune.study.planner import local_facts

    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA Z900, 1000 MiB\n")
    unknown_gpu = sglang_study(tmp_path, env={"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin"})
    planner = planner_for(unknown_gpu)
    assert planner.strategy_name == "tpe" and not planner.awaiting_facts
    assert "asked again" not in planner.note
    cache = tmp_path / "hub"
    spec = sglang_study(tmp_path, model=HUB_TARGET, draft=HUB_DRAFT, backend={"gpu": "H200"},
                        env={"HF_HUB_CACHE": str(cache)})
    planner = planner_for(spec)
    note = planner.adopt_facts(local_facts(spec), tree_launched=True)
    assert note.startswith("strategy tpe stays: the models' config.json are not on the node "
                           f"even after a tree's launch (no config.json for '{HUB_TARGET}'")
    assert planner.strategy_name == "tpe" and not planner.awaiting_facts
    # Both fetched, but the pair cannot make a prior (a head for another target).
    planner = planner_for(sglang_study(tmp_path, model=HUB_TARGET, draft="thoughtworks/"
                                       "Qwen3-8B-Eagle3", backend={"gpu": "H200"},
                                       env={"HF_HUB_CACHE": str(cache)}))
    cache_with(cache, HUB_TARGET)
    cache_with(cache, "thoughtworks/Qwen3-8B-Eagle3")
    note = planner.adopt_facts(local_facts(planner.spec), tree_launched=True)
    assert note.startswith("strategy tpe stays: the models are on the node now, but the prior "
                           "cannot be built (draft 'thoughtworks/Qwen3-8B-Eagle3'"), note
    assert not planner.awaiting_facts
    # A local folder without config.json: nothing a server downloads.
    folder = tmp_path / "a-local-model"
    folder.mkdir()
    planner = planner_for(sglang_study(tmp_path, model=str(folder), backend={"gpu": "H200"}))
    assert planner.strategy_name == "tpe" and not planner.awaiting_facts
    assert "asked again" not in planner.note and "hf download" not in planner.note


def test_an_unknown_gpu_override_is_refused_when_the_study_is_read(tmp_path):
    # A misspelt --gpu is the user's to fix before anything starts; only a GPU the worker
    # sees and the table lacks makes `auto` go without a model (below).
    with pytest.raises(TreetuneError, match=r"--gpu \(backend.gpu\): GPU 'RTX 9999' \(--gpu\) "
                       r"is not in treetune's GPU table"):
        sglang_study(tmp_path, backend={"gpu": "RTX 9999"})


def test_on_an_unknown_gpu_auto_falls_back_to_tpe_naming_the_override(tmp_path):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA Future GPU, 1000 MiB\n")
    spec = sglang_study(tmp_path, env={"PATH": str(bin_dir)})
    planner = planner_for(spec)
    assert planner.strategy_name == "tpe"
    assert "'NVIDIA Future GPU'" in planner.note and "--gpu NAME (backend.gpu" in planner.note


def test_a_study_of_several_draft_methods_still_says_why_auto_went_without_a_model(
        tmp_path):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA Future GPU, 1000 MiB\n")
    spec = sglang_study(tmp_path, env={"PATH": str(bin_dir)}, methods=["EAGLE3", "NGRAM"])
    planner = planner_for(spec)
    assert planner.strategy_name == "tpe"
    assert planner.note.startswith("draft methods EAGLE3 (tpe), NGRAM (tpe): one search "
                                   "each, taking turns; no performance-model prior (GPU "
                                   "'NVIDIA Future GPU' (nvidia-smi")
    assert "\n" not in planner.note


@pytest.mark.parametrize("tp", [3, 6])
def test_a_search_on_a_tp_the_target_does_not_split_over_is_refused_before_ray(tmp_path, tp):
    """Coder-Next: 16 query heads, 2 KV heads. SGLang's assert would fail the baseline's
    launch after Ray started, and `auto` had already gone to TPE for want of a prior."""
    from treetune.study.preflight import check_study

    with pytest.raises(TreetuneError) as refused:
        check_study(sglang_study(tmp_path, tp=tp, backend={"gpu": "H200"}))
    message = str(refused.value)
    assert message.startswith(f"tp {tp} (--tp): SGLang cannot serve '{TARGET}' on {tp} GPUs")
    assert f"its 16 attention heads do not split evenly over {tp} GPUs" in message
    assert message.endswith("tp sizes that fit: 1, 2, 4, 8, 16")


def stand_in_sglang(tmp_path, version: str | None) -> dict[str, str]:
    """A study environment whose interpreter imports a stand-in sglang of `version`."""
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"__version__ = {version!r}\n" if version else "")
    return {"PYTHONPATH": str(fake.parent)}


@pytest.mark.parametrize(("installed", "targeted", "refused"), [
    ("0.5.13", "0.5.23", True), ("0.5.23", "0.5.10", True), ("0.5.14rc0", "0.5.23", False),
    ("0.5.9", "0.5.12", False), (None, "0.5.23", False)])
def test_an_installed_sglang_that_takes_other_flags_than_the_study_targets_is_refused(
        tmp_path, installed, targeted, refused):
    """0.5.13's parser refuses --cuda-graph-max-bs-decode, 0.5.23's --cuda-graph-max-bs:
    every launch would fail after Ray started (a helper's audit)."""
    from treetune.study.preflight import check_study

    spec = sglang_study(tmp_path, backend={"gpu": "H200"}, sglang_version=targeted,
                        env=stand_in_sglang(tmp_path, installed))
    if not refused:
        check_study(spec)
        return
    with pytest.raises(TreetuneError) as caught:
        check_study(spec)
    message = str(caught.value)
    assert message.startswith(f"SGLang {installed} is installed for {sys.executable} "
                              f"(backend.python), and the study's commands are written for "
                              f"SGLang {targeted} (sglang_version)")
    assert message.endswith(f"give --sglang-version {installed}")


def test_a_server_flag_the_installed_sglang_names_otherwise_is_refused(tmp_path):
    """A study written for 0.5.14 with its --mamba-scheduler-strategy, on a node whose
    SGLang is 0.5.20: that parser knows only --mamba-radix-cache-strategy, and every
    launch would fail after Ray started."""
    from treetune.study.preflight import check_study

    spec = sglang_study(tmp_path, backend={"gpu": "H200"}, sglang_version="0.5.14",
                        server_flags={"--mamba-scheduler-strategy": "extra_buffer"},
                        env=stand_in_sglang(tmp_path, "0.5.20"))
    with pytest.raises(TreetuneError) as caught:
        check_study(spec)
    message = str(caught.value)
    assert message.startswith(f"SGLang 0.5.20 is installed for {sys.executable}")
    assert "server_flags: SGLang 0.5.20 has no '--mamba-scheduler-strategy': 0.5.14 " \
        "renamed it '--mamba-radix-cache-strategy'" in message
    assert message.endswith("give --sglang-version 0.5.20")


@pytest.mark.parametrize("architecture", ["MiMoV2FlashForCausalLM", "Step3p5ForCausalLM"])
def test_adaptive_steps_on_a_target_sglang_runs_as_multi_layer_eagle_are_refused(
        tmp_path, architecture):
    """SGLang 0.5.23 turns multi-layer EAGLE on by itself for these targets' EAGLE, and
    then serves static trees though adaptive steps are asked for: every adaptive launch
    would measure a chain, labeled adaptive (a helper's audit)."""
    from treetune.study.preflight import check_adaptive_target, check_study

    target = tmp_path / "target"
    target.mkdir()
    config = json.loads((Path(fixture("Qwen/Qwen3-8B")) / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config,
                                                    "architectures": [architecture]}))
    head = fixture("thoughtworks/Qwen3-8B-Eagle3")
    with pytest.raises(TreetuneError, match=f"adaptive: SGLang runs EAGLE on {architecture} "
                                            "as multi-layer EAGLE"):
        check_study(sglang_study(tmp_path, model=str(target), draft=str(head),
                                 algorithm="EAGLE", adaptive=True, tp=1,
                                 backend={"gpu": "H200"}))
    for over in ({"algorithm": "EAGLE", "adaptive": False}, {"algorithm": "EAGLE3",
                                                              "adaptive": True}):
        check_adaptive_target(sglang_study(tmp_path, model=str(target), draft=str(head),
                                           tp=1, backend={"gpu": "H200"}, **over), {})


@pytest.mark.parametrize(("model", "draft", "refused"), [
    (TARGET, fixture("thoughtworks/Qwen3-8B-Eagle3"), "is an EAGLE3 head for a target of "
     "hidden size 4096, but"),
    (DRAFT, TARGET, "is an EAGLE3 draft head, not a target model: give it as the draft"),
    (fixture("Qwen/Qwen3-30B-A3B-FP8"), fixture("Qwen/Qwen3-8B"), r"draft '.*Qwen3-8B' \(.*"
     r"config.json\) is a plain model \(Qwen3ForCausalLM\), not an EAGLE3 draft head .*"
     r"or draft with this model as STANDALONE \(a study's algorithm: STANDALONE, "
     r"--algorithm STANDALONE\)"),
])
def test_a_draft_sglang_cannot_serve_with_the_target_is_refused_before_ray(
        tmp_path, model, draft, refused):
    """A head trained for another target: the search ran TPE (no prior) and launched trees
    that SGLang cannot load (a helper's audit); `treetune prior` refused the pair."""
    from treetune.study.preflight import check_study

    with pytest.raises(TreetuneError, match=refused):
        check_study(sglang_study(tmp_path, model=model, draft=draft, backend={"gpu": "H200"}))


def test_a_plain_model_is_a_draft_for_standalone_and_each_methods_draft_is_checked(tmp_path):
    """SGLang 0.5.23 loads a plain model given as an EAGLE3 head, then fails to start
    (its class has no set_embed or hot_token_id): refused before Ray. STANDALONE drafts
    with a plain model of the target's tokenizer, as it should; in a study of several
    methods, each method's draft is checked for its method."""
    from treetune.backends.sglang import check_models

    target, plain = fixture("Qwen/Qwen3-30B-A3B-FP8"), fixture("Qwen/Qwen3-8B")
    standalone = sglang_study(tmp_path, model=target, draft=plain, algorithm="STANDALONE",
                              backend={"gpu": "H200"})
    check_models(standalone.launch_spec(), {})
    planner = planner_for(standalone)  # the auto prior is built, the plain draft priced
    assert planner.strategy_name == "model", planner.note
    priced = planner.strategy.context.prior.method()  # its STANDALONE method
    assert priced.drafter == "standalone" and priced.draft.layers == 36
    with pytest.raises(TreetuneError, match=r"^EAGLE3: draft '.*Qwen3-Coder-Next' .* is a "
                       "plain "):
        check_models(sglang_study(
            tmp_path, model=target, draft=plain, backend={"gpu": "H200"},
            methods=["STANDALONE", {"name": "EAGLE3", "draft": fixture("Qwen/Qwen3-Coder-Next")}],
            algorithm="STANDALONE").launch_spec(), {})


@pytest.mark.parametrize("of_methods", [False, True])
def test_an_eagle3_head_as_a_standalone_draft_is_refused_before_ray(tmp_path, of_methods):
    """SGLang 0.5.23 loads an EAGLE3 head as a STANDALONE draft, gives it no hidden states
    of the target and fails while capturing CUDA graphs, after loading both models (a
    helper's trace): the study's own method, or one of its methods, refused here; and
    `treetune prior --algorithm STANDALONE` refuses the pair."""
    from treetune.backends.sglang import check_models
    from treetune.facts import build_prior

    target, head = fixture("Qwen/Qwen3-30B-A3B-FP8"), fixture("sgl-project/qwen3-30B-A3B-eagle3")
    other = fixture("thoughtworks/Qwen3-8B-Eagle3")  # a head, for a target of another width
    if of_methods:
        spec = sglang_study(tmp_path, model=target, draft=head, backend={"gpu": "H200"},
                            methods=["EAGLE3", {"name": "STANDALONE", "draft": other}])
        # A head for another target: EAGLE3 could not draft with it either.
        prefix, shown, advice = "STANDALONE: ", "Qwen3-8B-Eagle3", "Give"
    else:
        spec = sglang_study(tmp_path, model=target, draft=head, algorithm="STANDALONE",
                            backend={"gpu": "H200"})
        prefix, shown = "", "qwen3-30B-A3B-eagle3"
        advice = "Draft with this head as EAGLE3, or give"
    with pytest.raises(TreetuneError, match=rf"^{prefix}draft '.*{shown}' \(.*config\.json\) "
                       r"is an EAGLE3 draft head \(LlamaForCausalLMEagle3\), not a standalone "
                       rf"model: .* fails to start\. {advice} STANDALONE a small plain model of "
                       r"the target's tokenizer as its draft$"):
        check_models(spec.launch_spec(), {})
    with pytest.raises(TreetuneError, match="is an EAGLE3 draft head"):
        build_prior(target, head, tp=1, gpu="H200", algorithm="STANDALONE")


def test_an_eagle3_head_drafted_by_eagle_or_a_standalone_draft_of_another_vocabulary_is_refused(
        tmp_path):
    """Two pairs SGLang 0.5.23 cannot serve as asked (a helper's trace): an EAGLE3 head
    drafted by EAGLE starts, but the target hands it no aux hidden states and the head
    skips its first layer (acceptance not the head's); a STANDALONE draft whose vocabulary
    size is not the target's fails once both models are loaded. A plain draft of the
    target's vocabulary still drafts STANDALONE."""
    from treetune.backends.sglang import check_models

    target, head = fixture("Qwen/Qwen3-8B"), fixture("thoughtworks/Qwen3-8B-Eagle3")
    spec = sglang_study(tmp_path, model=target, draft=head, algorithm="EAGLE",
                        backend={"gpu": "H100-SXM"})
    with pytest.raises(TreetuneError, match=r"^draft '.*Qwen3-8B-Eagle3' \(.*config\.json\) is "
                       r"an EAGLE3 draft head \(LlamaForCausalLMEagle3\): drafted by EAGLE, .* "
                       r"Draft by EAGLE3 \(a study's algorithm: EAGLE3, --algorithm EAGLE3\)$"):
        check_models(spec.launch_spec(), {})
    deepseek = fixture("deepseek-ai/DeepSeek-V3")
    spec = sglang_study(tmp_path, model=deepseek, draft=target, algorithm="STANDALONE",
                        backend={"gpu": "H200"}, tp=8)
    with pytest.raises(TreetuneError, match=r"^draft '.*Qwen3-8B' \(.*config\.json\) has a "
                       r"vocabulary of 151936 tokens and '.*DeepSeek-V3' of 129280: SGLang's "
                       r"STANDALONE drafting needs the very same vocabulary"):
        check_models(spec.launch_spec(), {})
    check_models(sglang_study(tmp_path, model=fixture("Qwen/Qwen3-Coder-Next"), draft=target,
                              algorithm="STANDALONE", backend={"gpu": "H200"}, tp=4
                              ).launch_spec(), {})


@pytest.mark.parametrize(("tp", "flags", "refused"), [
    (8, {}, r"^tp 8 \(--tp\): SGLang cannot serve '.*' on 8 GPUs: its 28 attention heads do "
     r"not split evenly over 8 GPUs .* tp sizes that fit: 1, 2, 4$"),
    (8, {"--attn-dp-size": 2}, None),
    (8, {"--attn-dp-size": ["8"]}, None),  # a launch spec's one-value tuple is its value
    (8, {"--enable-dp-attention": None, "--dp-size": 2}, None),
    (8, {"--enable-dp-attention": None}, r"on 8 GPUs: its 28"),  # alone: one group in 0.5.23
    (16, {"--attn-dp-size": 2}, r"^tp 16 \(--tp\): SGLang cannot serve '.*' on 16 GPUs in 2 "
     r"data-parallel attention groups of 8: its 28 attention heads do not split evenly over "
     r"8 GPUs .* attention group sizes \(tp / attention dp\) that fit: 1, 2, 4$"),
    # Llama's attention asserts its heads against the whole tp, attention groups or not.
    (8, {"--attn-dp-size": 2, "llama": True}, r"on 8 GPUs: its 28 attention heads"),
])
def test_attention_heads_split_over_the_attention_groups_with_data_parallel_attention(
        tmp_path, tp, flags, refused):
    """SGLang 0.5.23 splits a Qwen3 MoE's attention over tp / the attention's data-parallel
    groups (`attn_tp_size`): 28 heads and 4 KV heads at tp 8 in 2 groups of 4 serve (a
    helper's trace; Qwen2-57B-A14B's counts), and were refused as if split over all 8."""
    from treetune.backends.sglang import check_models

    config = json.loads((HF / "Qwen/Qwen3-30B-A3B-FP8/config.json").read_text())
    config.update(num_attention_heads=28, num_key_value_heads=4)
    if flags.pop("llama", False):
        config.update(architectures=["LlamaForCausalLM"])
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    spec = sglang_study(tmp_path, model=str(model), draft=fixture(
        "sgl-project/qwen3-30B-A3B-eagle3"), tp=tp, server_flags=flags, backend={"gpu": "H200"})
    if refused is None:
        check_models(spec.launch_spec(), {})
        assert planner_for(spec).strategy_name == "model"  # the auto prior is built
        return
    with pytest.raises(TreetuneError, match=refused):
        check_models(spec.launch_spec(), {})


def test_a_standalone_prior_file_with_its_draft_at_the_top_level_still_searches(tmp_path):
    """`treetune prior --algorithm STANDALONE` wrote the draft at the top level before it
    became the profile's STANDALONE method: a study of STANDALONE given such a file keeps
    the model search (a review's finding), the draft priced as a STANDALONE draft is."""
    target, plain = fixture("Qwen/Qwen3-30B-A3B-FP8"), fixture("Qwen/Qwen3-8B")
    written = auto_prior(model_facts(target), model_facts(plain), gpu_facts("H200"), 4)
    assert written.draft is not None and "STANDALONE" not in written.methods
    path = tmp_path / "written.yaml"
    written.save(path)
    planner = planner_for(sglang_study(tmp_path, model=target, draft=plain,
                                       algorithm="STANDALONE", backend={"gpu": "H200"},
                                       search={"prior": str(path)}))
    assert planner.strategy_name == "model", planner.note
    assert planner.strategy.context.prior.method().draft.layers == 36


def test_a_method_with_another_draft_than_the_auto_priors_is_not_priced_with_it(tmp_path):
    """The auto prior is built from the study's own draft: a STANDALONE study's plain
    8B priced the EAGLE3 method's trees as if the 8B drafted them (a review's finding).
    Now it describes the 8B as its STANDALONE method only, which the model search takes."""
    target, plain = fixture("Qwen/Qwen3-30B-A3B-FP8"), fixture("Qwen/Qwen3-8B")
    head = fixture("sgl-project/qwen3-30B-A3B-eagle3")
    planner = planner_for(sglang_study(
        tmp_path, model=target, draft=plain, algorithm="STANDALONE", backend={"gpu": "H200"},
        methods=["STANDALONE", {"name": "EAGLE3", "draft": head}]))
    parts = {p.name: p.strategy_name for p in planner.strategy.parts.values()}
    assert parts == {"STANDALONE": "model", "EAGLE3": "tpe"}, planner.note
    assert ("EAGLE3 without a model: the prior describes no EAGLE3 draft method (its "
            "methods: STANDALONE)") in planner.note
    # The head as the study's own draft: EAGLE3 gets the model search.
    planner = planner_for(sglang_study(
        tmp_path, model=target, draft=head, backend={"gpu": "H200"},
        methods=["EAGLE3", {"name": "STANDALONE", "draft": plain}]))
    assert {p.name: p.strategy_name for p in planner.strategy.parts.values()} == {
        "EAGLE3": "model", "STANDALONE": "tpe"}


def test_a_search_whose_target_is_only_on_the_nodes_leaves_its_tp_to_them(tmp_path):
    from treetune.backends.sglang import check_models

    spec = sglang_study(tmp_path, model=str(tmp_path / "on-the-nodes"), tp=3,
                        backend={"gpu": "H200"})
    check_models(spec.launch_spec(), {})  # nothing here to say it does not fit


def test_the_model_strategy_asked_for_without_facts_says_why(tmp_path):
    spec = sglang_study(tmp_path, model=str(tmp_path / "nothing"), backend={"gpu": "H200"},
                        search={"strategy": "model"})
    with pytest.raises(TreetuneError, match=r"strategy 'model' needs a prior profile .*\(no "
                       r"config\.json for .*\): give --prior"):
        planner_for(spec)


def test_a_search_prior_file_still_wins_over_the_auto_prior(tmp_path):
    spec = sglang_study(tmp_path, backend={"gpu": "H200"},
                        search={"prior": "qwen3-coder-next-h200"})
    prior = planner_for(spec).strategy.context.prior
    assert prior.target.active_params_b == load_profile("qwen3-coder-next-h200").target.\
        active_params_b


def test_search_takes_the_gpu_on_the_command_line(tmp_path):
    # As `treetune search --gpu B200` passes it: unset options are None.
    spec = load_study(None, {**small_study(tmp_path, model=TARGET, draft=DRAFT),
                             "backend": {"kind": "sglang", "profile": None, "time_scale": None,
                                         "gpu": "B200"}})
    assert spec.backend.gpu == "B200"


@pytest.mark.slow
@pytest.mark.usefixtures("ray_tmpdir")
def test_a_study_on_sglang_gathers_its_prior_on_a_worker_and_runs_the_model_search(
        tmp_path, ray_cluster):
    """SGLang's command resolves to a stand-in package that execs the emulator; the worker
    finds the fixtures' config.json and a stand-in nvidia-smi, as a GPU node would (the
    cluster's 4 GPUs are logical: Ray hands them out as on a GPU node)."""
    from treetune.study.runner import run_study

    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA H200, 143771 MiB\n" * 4)
    spec = sglang_study(
        tmp_path, name="autoprior", budget={"launches": 2}, workers=1, compare=[],
        batch=[1], datasets=["humaneval"], server_flags={"--ep-size": 4},
        env={**fake_sglang(tmp_path / "fake"),
             "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, ray_address=ray_cluster)
    notes: list[str] = []
    outcome = run_study(spec, lambda p: notes.extend(n for n in p.notes if n not in notes))
    # Nothing but the word on the attention backend this study leaves to SGLang, and that
    # the auto prior prices its expert parallelism as tensor parallelism.
    assert outcome.strategy == "model" and [n for n in notes if "no attention backend pinned"
                                            not in n] == [
        "server_flags --ep-size: the performance model prices the experts as tensor "
        "parallel (a share of every expert on each GPU, all-reduces), not as expert "
        "parallel; the search corrects it from the launches, but its first proposals may be "
        "off (at small batches most: the busiest expert rank sets the pace)"], notes
    assert len(outcome.results) == 2 and all(r.ok for r in outcome.results), [
        (r.reason, r.log_tail) for r in outcome.results]
    # Ray gave the worker 4 GPUs: nvidia-smi was asked about those, not the whole node.
    assert (bin_dir / "args").read_text().split()[-1].startswith("--id=")


@pytest.mark.parametrize("methods", [None, ["EAGLE3", "NGRAM"]], ids=["one", "methods"])
def test_a_study_whose_models_sglang_downloads_switches_to_the_model_search(tmp_path,
                                                                           ray_cluster,
                                                                           methods):
    """A fresh GPU node: the models are hub names not yet in its cache. The stand-in SGLang
    "downloads" each model it is started with into the cache (as SGLang's first start
    does), and the study goes from TPE to the model search once both are there. With
    several methods, the EAGLE3 tree's launch fetches the draft and NGRAM's turn comes
    after (two launches: the emulated profile describes no NGRAM)."""
    from treetune.study.runner import run_study

    cache = tmp_path / "hub"
    download = (  # each model the server is started with, into the cache
        "import os, pathlib, shutil\n"
        f"hf = pathlib.Path({str(HF)!r})\n"
        "for flag in ('--model-path', '--speculative-draft-model-path'):\n"
        "    if flag in sys.argv:\n"
        "        repo = sys.argv[sys.argv.index(flag) + 1]\n"
        "        folder = pathlib.Path(os.environ['HF_HUB_CACHE']) / ('models--' + "
        "repo.replace('/', '--'))\n"
        "        (folder / 'snapshots' / 'c0ffee').mkdir(parents=True, exist_ok=True)\n"
        "        shutil.copy(hf / repo / 'config.json', folder / 'snapshots' / 'c0ffee')\n"
        "        (folder / 'refs').mkdir(exist_ok=True)\n"
        "        (folder / 'refs' / 'main').write_text('c0ffee')\n")
    spec = sglang_study(
        tmp_path, name="fetched", model=HUB_TARGET, draft=HUB_DRAFT,
        budget={"launches": 2 if methods else 3},
        workers=1, compare=[], batch=[1], datasets=["humaneval"], backend={"gpu": "H200"},
        env={**fake_sglang(tmp_path / "fake", download), "HF_HUB_CACHE": str(cache)},
        ray_address=ray_cluster, server_flags={"--ep-size": 4},
        **({"methods": methods} if methods else {}))
    notes: list[str] = []
    outcome = run_study(spec, lambda p: notes.extend(n for n in p.notes if n not in notes))
    assert len(outcome.results) == spec.budget.launches and all(
        r.ok for r in outcome.results), [(r.reason, r.log_tail) for r in outcome.results]
    assert any("no performance-model prior (no config.json" in n for n in notes), notes
    switched = ("draft methods EAGLE3 (tpe -> model) from launch 3 on" if methods else
                "strategy model from launch 3 on (was tpe)")
    switch = (f"{switched}: the models' config.json are on the node now (SGLang "
              "downloaded them), so the performance-model prior could be built")
    assert switch in notes, notes
    # Said once the model search runs: at the switch, not at the start under TPE.
    priced = [i for i, n in enumerate(notes) if n.startswith("server_flags --ep-size: the "
                                                             "performance model prices")]
    assert priced == [notes.index(switch) + 1], notes
    assert outcome.strategy == "model"


def test_facts_that_fail_unexpectedly_leave_the_study_to_tpe_with_the_cause():
    from treetune.backends import LaunchSpec, gather_facts

    class Broken:
        kind = "broken"

        def facts(self, launch, env):
            raise RuntimeError("driver exploded")

    facts = gather_facts(Broken(), LaunchSpec("m"), {})  # type: ignore[arg-type]
    assert facts.profile is None
    assert facts.why_not == "building them failed: RuntimeError: driver exploded"


def test_a_note_from_the_search_is_printed_once_above_the_progress_line(tmp_path, capsys):
    from treetune.cli import _run_with_progress
    from treetune.study.runner import Progress

    def fake_run(spec, show):
        progress = Progress(budget=2)
        progress.notes.append("strategy tpe: no performance-model prior (a reason)")
        show(progress)
        show(progress)
        return "done"

    assert _run_with_progress(sglang_study(tmp_path), fake_run) == "done"
    err = capsys.readouterr().err
    assert err.count("note: strategy tpe: no performance-model prior (a reason)") == 1


def test_an_eagle3_head_under_a_plain_architecture_is_refused_with_the_way_out(tmp_path,
                                                                               capsys):
    """EAGLE3 heads as first published (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) name
    draft_vocab_size under `architectures: ["LlamaForCausalLM"]`: SGLang picks the class by
    that name, loads a plain Llama and fails as the draft worker sets up. It was taken
    for an EAGLE3 head and priced; its fixed copies name LlamaForCausalLMEagle3."""
    config = json.loads((HF / "thoughtworks/Qwen3-8B-Eagle3/config.json").read_text())
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps(
        {**config, "architectures": ["LlamaForCausalLM"]}))
    code, _, err = run_cli(capsys, "prior", "--model", fixture("Qwen/Qwen3-8B"), "--draft",
                           str(tmp_path / "plain"), "--gpu", "H100-SXM")
    text = " ".join(err.split())
    assert code == 2 and "is an EAGLE3 head (its config names draft_vocab_size) under the " \
        "plain architecture LlamaForCausalLM" in text and "LlamaForCausalLMEagle3" in text, err
    code, _, err = run_cli(capsys, "prior", "--model", fixture("Qwen/Qwen3-8B"), "--draft",
                           fixture("thoughtworks/Qwen3-8B-Eagle3"), "--gpu", "H100-SXM")
    assert code == 0, err


def test_a_draft_whose_heads_do_not_split_over_tp_is_refused_with_the_sizes_that_fit(
        tmp_path, capsys):
    """The draft runs on the target's GPUs, its attention split as the target's: a head of
    20 attention heads cannot be split over 8 GPUs, and SGLang fails as it builds it."""
    config = json.loads((HF / "thoughtworks/Qwen3-8B-Eagle3/config.json").read_text())
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps(
        {**config, "num_attention_heads": 20, "num_key_value_heads": 4, "head_dim": 128}))
    code, _, err = run_cli(capsys, "prior", "--model", fixture("Qwen/Qwen3-8B"), "--draft",
                           str(tmp_path / "odd"), "--gpu", "H100-SXM", "--tp", "8")
    text = " ".join(err.split())
    assert code == 2 and "--tp 8: SGLang cannot split the draft" in text \
        and "its 20 attention heads do not split evenly over 8 GPUs" in text \
        and "tp sizes that fit both models: 1, 2, 4" in text, err



@pytest.mark.parametrize(("flags", "groups"), [
    ({}, 1), ({"--attn-dp-size": 2}, 2), ({"--enable-dp-attention": None, "--dp-size": 4}, 4),
    ({"--enable-dp-attention": None}, 1),  # alone, 0.5.23 runs one group
])
def test_a_study_s_data_parallel_attention_groups_reach_its_prior(tmp_path, flags, groups):
    """The study's server flags say how its servers run their attention: the model search
    prices that many groups, whatever prior it starts from (the auto prior; a profile
    written for other servers)."""
    spec = sglang_study(tmp_path, server_flags=flags, backend={"gpu": "H200"})
    prior = planner_for(spec).strategy.context.prior
    assert prior.server.attention_dp == groups
    assert prior.target.attention_params_b == pytest.approx(1.541, abs=1e-3)
    written = tmp_path / "written.yaml"
    with_attention_dp(load_profile("qwen3-coder-next-h200"), 2).save(written)
    spec = sglang_study(tmp_path, server_flags=flags, backend={"gpu": "H200"},
                        search={"prior": str(written)})
    assert planner_for(spec).strategy.context.prior.server.attention_dp == groups


def test_treetune_prior_prices_data_parallel_attention_groups(capsys):
    code, stdout, err = run_cli(capsys, "prior", "--model", TARGET, "--draft", DRAFT,
                                "--tp", "4", "--attn-dp-size", "4", "--gpu", "H200")
    assert code == 0, err
    data = yaml.safe_load(stdout)
    assert data["server"]["attention_dp"] == 4
    assert data["target"]["attention_params_b"] == pytest.approx(1.541, abs=1e-3)
    assert "its 1.54B of attention copied to each of its 4 data-parallel attention " \
        "groups" in err, err
    code, stdout, _ = run_cli(capsys, "prior", "--model", TARGET, "--draft", DRAFT, "--tp",
                              "4", "--gpu", "H200")
    assert code == 0 and "attention_dp" not in yaml.safe_load(stdout)["server"]
    code, _, err = run_cli(capsys, "prior", "--model", TARGET, "--draft", DRAFT, "--tp", "4",
                           "--attn-dp-size", "3", "--gpu", "H200")
    assert code == 2 and "--attn-dp-size must divide --tp (4), got 3" in err, err


def test_the_tp_hint_skips_sizes_the_studys_attention_groups_do_not_divide(tmp_path):
    """The hint tried TP 2, 4 and 8 with the study's attention groups: 6 groups divide
    none, and the check's refusal ended the study before its first launch (a review)."""
    spec = load_study(None, small_study(
        tmp_path, model=fixture("deepseek-ai/DeepSeek-V3"), draft=None, algorithm="NEXTN",
        tp=6, batch=[1, 32], datasets=["mt-bench"], space="default",
        server_flags={"--enable-dp-attention": None, "--dp-size": 6},
        backend={"kind": "sglang", "python": sys.executable, "gpu": "L40S"}))
    said = planner_for(spec).baseline_memory()
    assert said.startswith("the prior says the baseline's server cannot start at --tp 6 "
                           "on L40S") and said.endswith("no TP within one node of 8 GPUs would")
