"""Launch command lines: flag names per SGLang version, quoting."""

import itertools
import os
import shlex
import sys
from pathlib import Path

import pytest

from treetune.backends import LaunchSpec, shell_line
from treetune.backends.emulator import emulator_command
from treetune.backends.sglang import cuda_graph_flag, server_args, sglang_command
from treetune.config import BASELINE, TreeConfig
from treetune.errors import TreetuneError


def spec(**kw):
    base = dict(model_path="Qwen/Qwen3-Coder-Next", draft_model_path="org/draft", tp=4,
                max_running_requests=64, cuda_graph_max_bs=64, attention_backend="triton")
    return LaunchSpec(**{**base, **kw})


def test_sglang_0_5_23_uses_the_split_cuda_graph_flag():
    args = server_args(TreeConfig(3, 4, 8), spec(engine_version="0.5.23"))
    assert "--cuda-graph-max-bs-decode" in args
    assert "--cuda-graph-max-bs" not in args


@pytest.mark.parametrize("version", ["0.5.6", "0.4.9", "0.5.9", "0.5.10", "0.5.13"])
def test_releases_before_0_5_14_use_the_old_cuda_graph_flag(version):
    args = server_args(TreeConfig(3, 4, 8), spec(engine_version=version))
    assert args[args.index("--cuda-graph-max-bs") + 1] == "64"
    assert "--cuda-graph-max-bs-decode" not in args


def test_cuda_graph_flag_switches_at_0_5_14():
    """0.5.13's server_args.py knows only the old name (its parser refuses the new one);
    0.5.14 has the new one and the old as an alias; 0.5.22 has only the new."""
    assert cuda_graph_flag("0.5.14") == "--cuda-graph-max-bs-decode"
    assert cuda_graph_flag("0.5.23") == "--cuda-graph-max-bs-decode"
    assert cuda_graph_flag("0.5.13") == "--cuda-graph-max-bs"


def test_speculative_flags_come_as_a_complete_set():
    args = server_args(TreeConfig(3, 4, 8), spec())
    pairs = dict(itertools.pairwise(args))
    assert pairs["--speculative-algorithm"] == "EAGLE3"
    assert pairs["--speculative-draft-model-path"] == "org/draft"
    assert pairs["--speculative-num-steps"] == "3"
    assert pairs["--speculative-eagle-topk"] == "4"
    assert pairs["--speculative-num-draft-tokens"] == "8"
    assert pairs["--max-running-requests"] == "64"
    assert pairs["--attention-backend"] == "triton"


def test_baseline_has_no_speculative_flags():
    args = server_args(BASELINE, spec())
    assert not [a for a in args if a.startswith("--speculative")]


def test_servers_bind_loopback_by_default():
    args = server_args(BASELINE, LaunchSpec(model_path="m"))
    assert args[args.index("--host") + 1] == "127.0.0.1"


def test_eagle3_without_a_draft_is_refused():
    with pytest.raises(TreetuneError, match="draft model path"):
        server_args(TreeConfig(3, 4, 8), spec(draft_model_path=None))


def test_shell_line_quotes_paths_with_spaces_and_shell_characters():
    nasty = "/m/$(touch x); y"
    line = shell_line(sglang_command(TreeConfig(3, 4, 8), spec(model_path=nasty)))
    assert shlex.split(line)[shlex.split(line).index("--model-path") + 1] == nasty
    assert "'/m/$(touch x); y'" in line


def test_emulator_command_takes_the_same_server_flags():
    config = TreeConfig(5, 1, 6)
    real = sglang_command(config, spec())
    emulated = emulator_command(config, spec(), "qwen3-coder-next-h200")
    assert emulated[1:3] == ["-m", "treetune.emulator"]
    assert emulated[-len(real) + 3:] == real[3:]


@pytest.mark.parametrize(("flags", "named"), [
    ({"--ep-size": 8}, "--ep-size"), ({"--ep": "8"}, "--ep"),
    ({"--expert-parallel-size": [8]}, "--expert-parallel-size"),
    ({"--moe-a2a-backend": "deepep"}, "--moe-a2a-backend"),
    ({"--ep-size": 1, "--moe-a2a-backend": "none"}, None),
    # Data-parallel attention is priced (its groups reach the prior): not named.
    ({"--enable-dp-attention": None, "--dp-size": 8}, None),
    ({"--attn-dp-size": 2, "--ep-size": 8}, "--ep-size"),
])
def test_expert_parallel_servers_are_said_to_be_priced_as_tp(flags, named):
    from treetune.backends.sglang import tp_priced

    word = tp_priced(flags)
    if named is None:
        assert word == ""
    else:
        assert word.startswith(f"server_flags {named}: the performance model prices the "
                               "experts as tensor parallel"), word


def test_attention_groups_a_prior_cannot_copy_are_said_once_priced_without_the_copies():
    """A prior that does not say its attention weights (a profile written before they were
    a fact) prices a study's attention groups' KV but not their copies: said."""
    import dataclasses

    from treetune.backends.sglang import groups_unpriced
    from treetune.perfmodel import load_profile

    dp = {"--enable-dp-attention": None, "--dp-size": 4}
    coder = load_profile("qwen3-coder-next-h200")
    assert groups_unpriced(dp, coder) == "" and groups_unpriced({}, coder) == ""
    bare = coder.replace(target=dataclasses.replace(coder.target, attention_params_b=0.0))
    assert groups_unpriced({}, bare) == "" and groups_unpriced(dp, None) == ""
    assert groups_unpriced(dp, bare).startswith(
        "server_flags --enable-dp-attention: the prior 'qwen3-coder-next-h200' does not say "
        "its attention weights (target.attention_params_b), so the copy each data-parallel "
        "attention group holds is not priced"), groups_unpriced(dp, bare)


DEEPEP = {"--moe-a2a-backend": "deepep"}
CAP = "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"


@pytest.mark.parametrize(("flags", "env", "tp", "batch", "widest", "said"), [
    ({}, {}, 8, 256, {"EAGLE3": 8}, None),
    ({"--moe-a2a-backend": "none"}, {}, 8, 256, {"EAGLE3": 8}, None),
    # DeepEP with attention DP over all 8 GPUs: 32 requests a GPU, 8 tokens each.
    ({**DEEPEP, "--attn-dp-size": 8}, {}, 8, 256, {"EAGLE3": 8, "NGRAM": 4},
     "'--moe-a2a-backend' deepep: DeepEP's low-latency dispatch takes at most 128 tokens a GPU "
     "per pass (SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK, SGLang's default), and at "
     "batch 256 (32 requests per attention group of 1 GPU(s)) a verify pass of EAGLE3's "
     "8-token trees sends 256: SGLang would fail at start-up capturing that pass (without CUDA "
     "graphs, at the first batch that large). Give "
     "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK: 256 in the study's env; or trees of at "
     "most 4 draft tokens"),
    ({**DEEPEP, "--attn-dp-size": 8}, {CAP: "256"}, 8, 256, {"EAGLE3": 8}, None),
    ({**DEEPEP, "--attn-dp-size": 8, "--deepep-mode": "normal"}, {}, 8, 256, {"EAGLE3": 8},
     None),
    ({**DEEPEP, "--deepep-mode": ["low_latency"]}, {CAP: "64"}, 4, 64, {"EAGLE3": 8},
     "takes at most 64 tokens a GPU per pass (SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK, "
     "as the environment sets it), and at batch 64 (64 requests per attention group of 4 "
     "GPU(s)) a verify pass of EAGLE3's 8-token trees sends 128"),
    # SGLang pads the largest CUDA graph's requests to a multiple of the group's GPUs: 33
    # requests are captured as 36, 135 tokens a GPU (a review's case; 124 unpadded).
    ({**DEEPEP}, {}, 4, 33, {"EAGLE3": 15}, "at batch 33 (33 requests per attention group of "
     "4 GPU(s), captured as 36) a verify pass of EAGLE3's 15-token trees sends 135"),
    ({**DEEPEP}, {CAP: "2048"}, 4, 8, {"EAGLE3": 8}, "takes 1 to 1024 tokens per GPU"),
    ({**DEEPEP}, {CAP: "many"}, 4, 8, {"EAGLE3": 8}, "='many' is not a whole number"),
    # Past what the variable can reach, and no tree fits: only the batch or the mode.
    ({**DEEPEP, "--attn-dp-size": 8}, {}, 8, 1024, {"EAGLE3": 16},
     "sends 2048: SGLang would fail at start-up capturing that pass (without CUDA graphs, at "
     "the first batch that large). Give a smaller largest batch size, or --deepep-mode "
     "normal"),
])
def test_deepeps_dispatch_cap_is_checked_against_the_largest_verify_pass(
        flags, env, tp, batch, widest, said):
    """SGLang 0.5.23 captures the verify pass of its largest batch with DeepEP's
    low-latency dispatch, whose per-GPU token cap DeepEP asserts (a helper's trace):
    past it every launch fails at start-up, minutes into a GPU node's time."""
    from treetune.backends.sglang import deepep_problem

    problem = deepep_problem(flags, env, tp, batch, widest)
    if said is None:
        assert problem == ""
    else:
        assert said in problem, problem


def test_a_study_whose_trees_deepep_cannot_dispatch_is_refused_before_ray(tmp_path):
    from studykit import small_study

    from treetune.study.preflight import check_study
    from treetune.study.spec import load_study

    flags = {**DEEPEP, "--attn-dp-size": 4}
    spec = load_study(None, small_study(tmp_path, batch=[1, 32], server_flags=flags))
    # bench-speculative's widest trees verify 32 tokens a request.
    with pytest.raises(TreetuneError, match=r"^server_flags: '--moe-a2a-backend' deepep: .* at "
                       r"batch 32 \(8 requests per attention group of 1 GPU\(s\)\) a verify "
                       r"pass of EAGLE3's "
                       r"32-token trees sends 256: .* Give SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_"
                       r"PER_RANK: 256 in the study's env; or trees of at most 16 draft tokens"):
        check_study(spec)
    # The study's env raises the cap to its widest pass: refused no more.
    check_study(load_study(None, small_study(tmp_path, batch=[1, 32], server_flags=flags,
                                             env={CAP: "256"})))
    # This shell's value is not the study's: the exported scripts and other nodes' servers
    # would not get it (a helper's audit: the shell's passed, the scripts failed).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CAP, "512")
        with pytest.raises(TreetuneError, match=f"{CAP} is set in this shell, but the launch "
                           "scripts and the servers on other nodes get only the study's env"):
            check_study(spec)


def test_the_widest_pass_of_each_draft_method_counts_its_space_its_compared_trees_and_nextn_topk(
        tmp_path):
    from studykit import small_study

    from treetune.study.methods import method_spaces
    from treetune.study.preflight import widest_passes
    from treetune.study.spec import load_study

    space = tmp_path / "narrow.yaml"
    space.write_text("steps: [1, 2]\ntopk: [1]\ndraft_tokens: [2, 3]\n")
    spec = load_study(None, small_study(
        tmp_path, space=str(space), methods=["EAGLE3", "NEXTN"], datasets=["mt-bench"],
        compare=["2,1,3", "NEXTN:1,8,2"],
        backend={"kind": "emulator", "profile": "qwen3.5-397b-a17b-h200", "noise": False}))
    # EAGLE3's trees verify 3 tokens a request at most; NEXTN's MoE draft layer also sends
    # topk (8, of a compared tree) a request per draft pass.
    assert widest_passes(spec, method_spaces(spec)) == {"EAGLE3": 3, "NEXTN": 8}


@pytest.mark.parametrize(("dtype", "size"), [("fp8_e4m3", 1.0), ("mxfp8", 1 + 1 / 32),
                                             ("nvfp4", 0.5625), ("fp4_mx_block16", 0.5625),
                                             ("auto", None)])
def test_the_kv_cache_dtypes_of_sglang_0_5_23_are_priced_at_their_size(dtype, size):
    """0.5.23's mxfp8, nvfp4 and fp4_mx_block16 were priced at the model's dtype (2-4x
    the cache a step reads; a helper's audit)."""
    from treetune.backends.sglang import kv_cache_bytes

    assert kv_cache_bytes(LaunchSpec("m", extra_flags=(("--kv-cache-dtype", dtype),))) == size


@pytest.mark.parametrize(("flags", "version", "added"), [
    ({"--attn-dp-size": "4"}, "0.5.23", "total_requests"),
    ({"--enable-dp-attention": None, "--dp-size": "4"}, "0.5.14", "total_requests"),
    ({"--enable-dp-attention": None, "--dp-size": "4"}, "0.5.3", "shortest_queue"),
    ({"--attn-dp-size": "4", "--load-balance-method": "round_robin"}, "0.5.23", None),
    ({}, "0.5.23", None),
])
def test_attention_groups_get_the_least_loaded_groups_requests(flags, version, added):
    """SGLang dispatches to data-parallel attention groups round robin by default: a closed
    loop's next request went to the next group, not to the one a request just left, so
    the groups drifted apart and the batch never formed (a review's finding). Unless the
    study says otherwise, each request goes to the least loaded group."""
    extra = tuple((k, v) for k, v in flags.items())
    argv = server_args(BASELINE, LaunchSpec("m", tp=4, extra_flags=extra,
                                            engine_version=version))
    methods = [argv[i + 1] for i, a in enumerate(argv) if a == "--load-balance-method"]
    assert methods == ([added] if added else [flags["--load-balance-method"]] if
                       "--load-balance-method" in flags else [])


FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def facts_of(name):
    from treetune.facts import model_facts

    return model_facts(str(FIXTURES / name))


CHAINS = "search and compare chains only (topk 1: --space narrow)"


@pytest.mark.parametrize(("model", "flags", "backend", "gpu", "method", "said"), [
    # DeepSeek Sparse Attention: SGLang's dsa backend on 64-token pages, on any NVIDIA GPU.
    ("deepseek-ai/DeepSeek-V3.2", {}, None, "H200", "EAGLE3",
     "SGLang fails EAGLE3 trees that branch (topk > 1) as they start here: the dsa attention "
     "backend, which SGLang picks for DeepseekV32ForCausalLM with DeepSeek Sparse Attention "
     "(index_topk in its config.json), runs on pages of 64 tokens, where SGLang holds a "
     f"tree only with flashinfer, fa3, triton; {CHAINS}"),
    ("deepseek-ai/DeepSeek-V3.2", {}, None, None, "NEXTN", "the dsa attention backend"),
    ("deepseek-ai/DeepSeek-V3.2", {}, None, "MIG instances", "NEXTN", "the dsa attention"),
    ("deepseek-ai/DeepSeek-V3.2", {}, None, "MI300X", "EAGLE3", None),  # pages of 1 there
    # The same family without the indexer: MLA on Hopper serves trees; on Blackwell
    # SGLang picks trtllm_mla, on 64-token pages.
    ("deepseek-ai/DeepSeek-V3", {}, None, "H200", "NEXTN", None),
    ("deepseek-ai/DeepSeek-V3", {}, None, "B200", "NEXTN",
     "the trtllm_mla attention backend, which SGLang picks for DeepseekV3ForCausalLM on "
     "B200, runs on pages of 64 tokens, where SGLang holds a tree only with flashinfer, "
     f"fa3, triton; {CHAINS}, or give --attention-backend triton if the model runs on it"),
    ("deepseek-ai/DeepSeek-V3", {}, None, "DGX B200", "NEXTN", "trtllm_mla"),  # any spelling
    ("deepseek-ai/DeepSeek-V3", {}, "triton", "B200", "NEXTN", None),
    # gpt-oss on Blackwell: trtllm_mha, which drafts chains only; triton is the way out
    # (SGLang refuses gpt-oss on flashinfer, model_hook.py).
    ("openai/gpt-oss-120b", {}, None, "B200", "EAGLE3",
     "the trtllm_mha attention backend, which SGLang picks for GptOssForCausalLM on B200, "
     f"drafts chains only; {CHAINS}, or give --attention-backend triton if the model runs "
     "on it"),
    ("openai/gpt-oss-120b", {}, None, "H100-SXM", "EAGLE3", None),
    ("openai/gpt-oss-120b", {}, "triton", "B200", "EAGLE3", None),
    # Given backends and pages, whatever the model (none read).
    (None, {}, "trtllm_mha", None, "EAGLE3", "the trtllm_mha attention backend, as given, "
     "drafts chains only"),
    (None, {"--prefill-attention-backend": "trtllm_mha"}, "fa3", None, "EAGLE3",
     "the trtllm_mha attention backend, as given, drafts chains only"),
    (None, {"--decode-attention-backend": "flashmla"}, "fa3", None, "EAGLE3",
     "the flashmla attention backend, as given, runs on pages of 64 tokens"),
    (None, {"--page-size": 16}, "fa3", None, "EAGLE3", None),
    (None, {"--page": "16"}, "fa3", None, "NGRAM",  # SGLang's parser takes abbreviations
     "SGLang fails branching NGRAM servers (breadth > 1) as they start here: the fa3 "
     "attention backend, as given, runs on pages of 16 tokens, where SGLang holds a tree "
     "only with flashinfer; search breadth 1 (an NGRAM space of topk [1]), or leave "
     "--page-size out"),
    (None, {"--page-size": 16}, "flashinfer", None, "NGRAM", None),
    (None, {}, None, "B200", "EAGLE3", None),
    # FlashInfer's MLA kernels: a NEXTN draft fails, a head's trees lose their mask.
    ("deepseek-ai/DeepSeek-V3", {}, "flashinfer", None, "EAGLE3", "the flashinfer attention "
     "backend, as given, takes an MLA target's chains only: a NEXTN draft fails as it "
     "starts, and other drafts' trees are verified without their tree mask; "
     f"{CHAINS}, or give --attention-backend triton"),
    ("Qwen/Qwen3-8B", {}, "flashinfer", "B200", "EAGLE3", None),
    # ROCm: aiter, SGLang's choice for these targets, drafts chains only.
    ("Qwen/Qwen3-8B", {}, None, "MI300X", "EAGLE3", "the aiter attention backend, which "
     f"SGLang picks for Qwen3ForCausalLM on MI300X, drafts chains only; {CHAINS}, or give "
     "--attention-backend triton if the model runs on it"),
    ("Qwen/Qwen3-8B", {}, None, "mi300x", "EAGLE3", "the aiter attention backend"),
    ("openai/gpt-oss-120b", {}, None, "MI355X", "EAGLE3", "the aiter attention backend"),
    # MIG instances are NVIDIA's (not an MI-something): SGLang's CUDA default holds trees.
    ("Qwen/Qwen3-8B", {}, None, "MIG instances", "EAGLE3", None),
    # Hybrid models are left to their servers: what SGLang picks there is not traced.
    ("Qwen/Qwen3-Coder-Next", {}, None, "MI300X", "EAGLE3", None),
    ("Qwen/Qwen3-8B", {}, "triton", "MI300X", "EAGLE3", None),
    ("Qwen/Qwen3-8B", {}, None, "MI300X", "NGRAM", None),
    ("Qwen/Qwen3-8B", {}, None, "H100-SXM", "EAGLE3", None),
])
def test_trees_sglang_serves_only_as_chains_are_named_with_the_reason(
        model, flags, backend, gpu, method, said):
    """SGLang 0.5.23 refuses at start-up a tree (topk > 1) on pages of more than one token
    but with flashinfer, fa3 or triton, and any tree with trtllm_mha (a helper's trace of
    `_handle_eagle_family`, `_handle_ngram` and the model overrides): for DeepSeek-V3.2 or
    GLM-5 everywhere, and for gpt-oss, Llama 4 or DeepSeek-V3 on a B200 by default, every
    launch of the default space's trees would fail."""
    from treetune.backends.sglang import branching_problem

    problem = branching_problem(flags, backend, facts_of(model) if model else None, gpu,
                                method)
    if said is None:
        assert problem == ""
    else:
        assert said in problem, problem


def test_a_study_of_trees_sglang_would_refuse_is_refused_before_ray_and_chains_run(tmp_path):
    from studykit import small_study

    from treetune.study.preflight import check_study
    from treetune.study.spec import load_study

    model = str(FIXTURES / "deepseek-ai" / "DeepSeek-V3.2")
    with pytest.raises(TreetuneError, match=r"DeepSeek-V3\.2: SGLang fails EAGLE3 trees "
                       r"that branch \(topk > 1\) as they start here: the dsa attention"):
        check_study(load_study(None, small_study(tmp_path, model=model)))
    # A compared tree that branches is refused too, in a space of chains.
    with pytest.raises(TreetuneError, match="dsa attention backend"):
        check_study(load_study(None, small_study(tmp_path, model=model, space="narrow",
                                                 compare=["3,4,8"])))
    check_study(load_study(None, small_study(tmp_path, model=model, space="narrow",
                                             compare=["3,1,4"])))


def test_a_tree_sglang_resolved_otherwise_is_said_with_the_launch():
    """SGLang may serve another tree than the command asks (a model's override, multi-layer
    EAGLE): its /server_info tells, and the launch says so (a helper's audit: treetune
    kept the resolved values and never compared them)."""
    from treetune.backends.sglang import launch_warnings

    asked = [("--speculative-num-steps", "3"), ("--speculative-eagle-topk", "4"),
             ("--speculative-num-draft-tokens", "8"), ("--tp", "1")]
    info = {"speculative_num_steps": 3, "speculative_eagle_topk": 4,
            "speculative_num_draft_tokens": 8}
    assert launch_warnings(asked, info, "") == []
    assert launch_warnings(asked, {**info, "speculative_eagle_topk": 1,
                                   "speculative_num_draft_tokens": 4}, "") == [
        "SGLang serves --speculative-eagle-topk 1 (asked 4), --speculative-num-draft-tokens 4 "
        "(asked 8), by its /server_info: this launch measured that tree, not the one it was "
        "asked for"]
    # A baseline asks for no tree; an older SGLang may not report one.
    assert launch_warnings([("--tp", "1")], {"speculative_eagle_topk": None}, "") == []
    assert launch_warnings(asked, {}, "") == []


@pytest.mark.parametrize("flag", ["--speculative-use-rejection-sampling",
                                  "--speculative-use-block-verification"])
def test_rejection_sampling_takes_chains_only_and_eagles_drafts_only(flag):
    from treetune.backends.sglang import branching_problem, parallel_flag_problem

    target = facts_of("Qwen/Qwen3-8B")
    assert branching_problem({flag: None}, None, target, "H100-SXM", "NEXTN") == (
        f"SGLang fails NEXTN trees that branch (topk > 1) as they start with '{flag}': "
        f"rejection sampling verifies chains only; {CHAINS}, or leave it out")
    assert branching_problem({flag: None}, None, target, "H100-SXM", "NGRAM") == ""
    assert parallel_flag_problem({flag: None}, {"EAGLE3"}) == ""
    refused = parallel_flag_problem({flag: None}, {"EAGLE3", "STANDALONE", "NGRAM"})
    drafts = "NGRAM and STANDALONE" if "block" in flag else "STANDALONE"
    assert refused == (f"'{flag}': SGLang 0.5.23 takes it for EAGLE, EAGLE3 and NEXTN only, "
                       f"and fails {drafts} servers as they start; leave it out")


def test_a_local_gpu_node_s_own_gpu_decides_and_an_emulated_study_s_never_does(
        tmp_path, monkeypatch):
    """On a B200 node (a stand-in nvidia-smi), SGLang gives gpt-oss trtllm_mha, which
    drafts chains only: the local SGLang study of trees is refused before Ray. An emulated
    study on the same machine is not: its servers are the profile's, whatever GPU the
    machine has (a review's case)."""
    from studykit import small_study
    from test_facts import stand_in_nvidia_smi

    from treetune.study.preflight import check_study
    from treetune.study.spec import load_study

    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA B200, 183359 MiB\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    model = str(FIXTURES / "openai" / "gpt-oss-120b")
    emulated = load_study(None, small_study(tmp_path, model=model))
    check_study(emulated)
    real = load_study(None, small_study(tmp_path, model=model, backend={
        "kind": "sglang", "python": sys.executable}))
    with pytest.raises(TreetuneError, match=r"trtllm_mha attention backend, which SGLang "
                       r"picks for GptOssForCausalLM on B200, drafts chains only"):
        check_study(real)


@pytest.mark.parametrize(("batch", "flags", "tp", "cap"), [
    (1, {}, 8, 1), (3, {}, 8, 3),
    # Two GPUs per attention group: a cap of 1 leaves SGLang no batch size to capture.
    (1, {"--attn-dp-size": 4}, 8, 2), (8, {"--attn-dp-size": 4}, 8, 8),
    (1, {"--attn-dp-size": 8}, 8, 1),  # one GPU per group: any size
    (1, {"--moe-a2a-backend": "deepep"}, 8, 8), (1, {"--moe-a2a-backend": "deepep"}, 1, 1),
    (1, {"--enable-two-batch-overlap": None}, 1, 2),
    (1, {"--attn-dp-size": 4, "--enable-two-batch-overlap": None}, 8, 4),
    (16, {"--attn-dp-size": 2, "--enable-two-batch-overlap": None}, 8, 16)])
def test_the_cuda_graph_cap_leaves_sglang_a_batch_size_to_capture(batch, flags, tp, cap):
    """get_batch_sizes_to_capture keeps only multiples of the attention group's GPUs where
    tokens are gathered (twice that with two-batch overlap) and fails when none is left
    (a helper's audit: an exported batch-1 script with two GPUs per group)."""
    from treetune.backends.sglang import cuda_graphs_for

    assert cuda_graphs_for(batch, flags, tp) == cap


@pytest.mark.parametrize(("flags", "tp", "refused"), [
    ({"--ep-size": 4}, 4, None), ({"--ep-size": 2}, 4, None),
    ({"--ep-size": 8}, 4, "'--ep-size' 8: the expert-parallel ranks are a divisor of tp 4"),
    ({"--ep": 3}, 4, "'--ep' 3: the expert-parallel ranks are a divisor of tp 4"),
    ({"--moe-dense-tp-size": 1}, 4, None), ({"--moe-dense-tp-size": 4}, 4, None),
    ({"--moe-dense-tp-size": 2}, 4, "SGLang asserts the dense layers' tp is 1 or the "
     "server's, 4"),
    ({"--enable-two-batch-overlap": None}, 4, "'--enable-two-batch-overlap': SGLang runs "
     "two-batch overlap only with an all-to-all MoE backend"),
    ({"--enable-two-batch-overlap": None, "--moe-a2a-backend": "deepep"}, 4, None),
    ({"--enable-two-batch-overlap": None, "--attn-dp-size": 2}, 4, None)])
def test_expert_parallel_and_overlap_flags_sglang_fails_at_start_up_are_refused(
        flags, tp, refused):
    """SGLang divides tp by the expert-parallel size, asserts moe_dense_tp_size in (None,
    1, tp), and refuses two-batch overlap without an all-to-all backend or data-parallel
    attention (a helper's audit: each study loaded and every launch failed)."""
    from treetune.backends.sglang import parallel_flag_problem

    problem = parallel_flag_problem(flags, {"EAGLE3"}, tp)
    if refused is None:
        assert problem == ""
    else:
        assert refused in problem, problem


def test_dense_layers_on_one_gpu_gather_the_attention_as_data_parallel_attention_does():
    from treetune.backends.sglang import cuda_graphs_for

    assert cuda_graphs_for(1, {"--moe-dense-tp-size": "1"}, 2) == 2
    assert cuda_graphs_for(1, {"--moe-dense-tp-size": "2"}, 2) == 1
