"""Facts from what is on disk and on the node: model sizes and KV caches from config.json
fixtures (tests/fixtures/hf, written from the models' public architecture facts), GPUs from
the shipped table and from a stand-in nvidia-smi."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
from pathlib import Path

import pytest
from studykit import wait_until

from treetune.config import BASELINE
from treetune.errors import FieldError, TreetuneError
from treetune.facts import (
    auto_prior,
    detect_gpu,
    facts_from_config,
    find_config,
    gpu_facts,
    gpu_table,
    model_facts,
    query_gpus,
)
from treetune.facts.gpus import table_path
from treetune.facts.models import read_config
from treetune.perfmodel import check_memory, load_profile
from treetune.perfmodel.profile import SlidingWindow

HF = Path(__file__).parent / "fixtures" / "hf"


def fixture(name: str) -> str:
    return str(HF / name)


def within(value: float, expected: float, share: float) -> bool:
    return abs(value - expected) <= share * abs(expected)


# ---- the shipped profiles' models --------------------------------------------------------

# Active parameters count as model cards count them, embedding and head included (the
# Qwen3-30B-A3B card's 3.3B); Qwen3-Coder-Next's config gives 3.87B, where its "A3B" name
# rounds down.
SHIPPED = [  # profile, target fixture, draft fixture
    ("qwen3-8b-h100", "Qwen/Qwen3-8B", "thoughtworks/Qwen3-8B-Eagle3"),
    ("qwen3-30b-a3b-h100", "Qwen/Qwen3-30B-A3B-FP8", "sgl-project/qwen3-30B-A3B-eagle3"),
    ("qwen3-coder-next-h200", "Qwen/Qwen3-Coder-Next-FP8",
     "thoughtworks/Qwen3-Coder-Next-Eagle3"),
]


def auto_for(profile_name: str, target: str, draft: str):
    shipped = load_profile(profile_name)
    prior = auto_prior(model_facts(fixture(target)), model_facts(fixture(draft)),
                       gpu_facts(shipped.hardware.gpu), shipped.tp)
    return shipped, prior


@pytest.mark.parametrize(("profile_name", "target", "draft"), SHIPPED)
def test_the_auto_prior_counts_the_shipped_profiles_total_parameters_within_3_percent(
        profile_name, target, draft):
    shipped, prior = auto_for(profile_name, target, draft)
    assert within(prior.target.total_params_b, shipped.target.total_params_b, 0.03)


@pytest.mark.parametrize(("profile_name", "target", "draft"), SHIPPED)
def test_the_auto_prior_counts_the_shipped_profiles_active_parameters_within_3_percent(
        profile_name, target, draft):
    shipped, prior = auto_for(profile_name, target, draft)
    assert within(prior.target.active_params_b, shipped.target.active_params_b, 0.03)


@pytest.mark.parametrize(("profile_name", "target", "draft"), SHIPPED)
def test_the_auto_prior_counts_the_shipped_profiles_draft_parameters_within_3_percent(
        profile_name, target, draft):
    """The draft's weights are read at every draft step: a profile that counts them
    differently from the auto prior makes the search on a real GPU start from other costs
    than its own benchmark's (the 8B's said 350M, its config counts 399.5M)."""
    shipped, prior = auto_for(profile_name, target, draft)
    assert within(prior.draft.params_m, shipped.draft.params_m, 0.03)


@pytest.mark.parametrize(("profile_name", "target", "draft"), SHIPPED)
def test_the_auto_prior_counts_the_shipped_profiles_attention_within_3_percent(
        profile_name, target, draft):
    """What each data-parallel attention group holds a copy of: a shipped profile without
    it cannot price (or emulate) a server whose flags ask for groups."""
    shipped, prior = auto_for(profile_name, target, draft)
    assert shipped.target.attention_params_b > 0
    assert within(prior.target.attention_params_b, shipped.target.attention_params_b, 0.03)


@pytest.mark.parametrize(("profile_name", "target", "draft"), SHIPPED)
def test_the_auto_prior_matches_the_shipped_profiles_kv_bytes_per_token_within_3_percent(
        profile_name, target, draft):
    shipped, prior = auto_for(profile_name, target, draft)
    assert within(prior.target.kv_bytes_per_token, shipped.target.kv_bytes_per_token, 0.03)
    assert within(prior.draft.kv_bytes_per_token, shipped.draft.kv_bytes_per_token, 0.03)


@pytest.mark.parametrize(("profile_name", "target", "draft"), SHIPPED)
def test_the_auto_prior_matches_the_shipped_profiles_other_facts(profile_name, target, draft):
    shipped, prior = auto_for(profile_name, target, draft)
    assert prior.hardware == shipped.hardware  # the GPU table agrees with the hand-written
    t, s = prior.target, shipped.target
    assert (t.layers, t.hidden_size, t.weight_bytes, t.vocab_size, t.attention_layers) == (
        s.layers, s.hidden_size, s.weight_bytes, s.vocab_size, s.attention_layers)
    if s.moe is None:
        assert t.moe is None
    else:
        assert t.moe is not None
        assert (t.moe.experts, t.moe.experts_per_token, t.moe.layers, t.moe.shared_experts) \
            == (s.moe.experts, s.moe.experts_per_token, s.moe.layers, s.moe.shared_experts)
        assert within(t.moe.expert_params_m, s.moe.expert_params_m, 0.01)
    if s.state_bytes_per_request:
        assert within(t.state_bytes_per_request, s.state_bytes_per_request, 0.03)


# ---- architectures -----------------------------------------------------------------------

def test_a_dense_qwen3_counts_as_its_model_card_says():
    f = model_facts(fixture("Qwen/Qwen3-8B"))
    assert within(f.total_params / 1e9, 8.19, 0.005) and f.active_params == f.total_params
    assert (f.layers, f.attention_layers, f.linear_layers, f.moe) == (36, 36, 0, None)
    assert f.kv_bytes_per_token == 36 * 2 * 8 * 128 * 2
    assert (f.weight_bytes, f.quantization, f.dtype) == (2.0, "", "bfloat16")


def test_a_qwen3_moe_counts_all_experts_in_total_and_the_routed_eight_in_active():
    f = model_facts(fixture("Qwen/Qwen3-30B-A3B-FP8"))
    assert within(f.total_params / 1e9, 30.5, 0.01) and within(f.active_params / 1e9, 3.3,
                                                                0.02)
    assert f.moe is not None and (f.moe.experts, f.moe.experts_per_token, f.moe.layers) == (
        128, 8, 48)
    assert f.moe.expert_params == 3 * 2048 * 768
    assert (f.weight_bytes, f.quantization) == (1.0, "fp8")


def test_qwen3_next_holds_a_kv_cache_only_in_its_full_attention_layers():
    f = model_facts(fixture("Qwen/Qwen3-Coder-Next"))
    assert (f.layers, f.attention_layers, f.linear_layers) == (48, 12, 36)
    assert f.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2  # 2 KV heads of 256 dims, bf16
    # Gated DeltaNet keeps a fixed state per request: 32 heads x 128 x 128 in fp32, plus
    # the convolution's last 3 inputs of its 8192 channels.
    assert f.state_bytes_per_request == 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    assert f.moe is not None and (f.moe.experts, f.moe.experts_per_token,
                                  f.moe.shared_experts) == (512, 10, 1)
    assert within(f.total_params / 1e9, 80, 0.01)  # the card: 80B, 79B without embedding
    assert within((f.total_params - 2 * 151936 * 2048) / 1e9, 79, 0.01)


def test_layer_types_say_which_layers_are_linear_attention():
    data = read_config(HF / "Qwen/Qwen3-Coder-Next/config.json")
    del data["full_attention_interval"]
    data["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * 12
    f = facts_from_config(data, "listed", Path("listed.json"))
    assert (f.attention_layers, f.linear_layers) == (12, 36)


def test_a_glm4_moe_uses_gqa_and_keeps_its_first_layer_dense():
    f = model_facts(fixture("zai-org/GLM-4.5-Air"))
    assert not f.mla
    assert f.kv_bytes_per_token == 46 * 2 * 8 * 128 * 2
    assert f.moe is not None and (f.moe.layers, f.moe.shared_experts, f.moe.experts) == (
        45, 1, 128)
    assert within(f.total_params / 1e9, 106, 0.01)  # the card: 106B total
    assert within((f.active_params - 2 * 151552 * 4096) / 1e9, 12, 0.02)  # 12B, no embedding


def test_mla_caches_one_latent_vector_per_layer_not_k_and_v_per_head():
    f = model_facts(fixture("deepseek-ai/DeepSeek-V3"))
    assert f.mla and f.kv_bytes_per_token == 61 * (512 + 64) * 2
    assert within(f.total_params / 1e9, 671, 0.01) and within(f.active_params / 1e9, 37, 0.02)
    assert f.moe is not None and f.moe.layers == 58  # the first three layers are dense
    assert f.weight_bytes == 1.0


def test_deepseek_sparse_attention_caches_its_indexers_key_beside_the_latent():
    """DeepSeek-V3.2's indexer caches a 128-dim fp8 key and its 4-byte scale per token and
    layer, whatever the KV dtype (SGLang's DSA token pool); an fp8 latent under DSA is
    stored with its scales and a bf16 rotary part (656 bytes). Its weights: query heads
    from the query's low-rank state, one key, a LayerNorm and a weight per head."""
    v32, v3 = (model_facts(fixture(f"deepseek-ai/{n}")) for n in ("DeepSeek-V3.2",
                                                                   "DeepSeek-V3"))
    assert v32.kv_bytes_per_token == 61 * ((512 + 64) * 2 + 132)
    assert v32.mtp_kv_bytes_per_token == (512 + 64) * 2 + 132
    assert model_facts(fixture("deepseek-ai/DeepSeek-V3.2"), kv_cache_bytes=1.0
                       ).kv_bytes_per_token == 61 * (512 + 16 + 128 + 132)
    assert v3.kv_bytes_per_token == 61 * (512 + 64) * 2  # no indexer
    h = 7168
    indexer = 1536 * 64 * 128 + h * 128 + 2 * 128 + h * 64
    assert v32.total_params - v3.total_params == 61 * indexer
    assert v32.mtp_dense_params - v3.mtp_dense_params == indexer


def test_a_dsa_target_on_blackwell_takes_sglangs_fp8_kv_cache_unless_one_is_given():
    """SGLang's --kv-cache-dtype auto is fp8 for a DeepSeek Sparse Attention target on
    Blackwell (bf16 below it): counted at bf16 there, DeepSeek-V3.2's cache was 1.6x too
    large (a review's finding)."""
    from treetune.facts import build_prior

    model = fixture("deepseek-ai/DeepSeek-V3.2")

    def kv(gpu, kv_bytes=None):
        prior = build_prior(model, None, 8, gpu, kv_cache_bytes=kv_bytes, algorithm="NEXTN")
        return prior.target.kv_bytes_per_token
    assert kv("B200") == 61 * (512 + 16 + 128 + 132)
    assert kv("H200") == kv("B200", 2.0) == 61 * ((512 + 64) * 2 + 132)
    # A target without DSA keeps its dtype's cache on Blackwell.
    plain = build_prior(fixture("deepseek-ai/DeepSeek-V3"), None, 8, "B200", algorithm="NEXTN")
    assert plain.target.kv_bytes_per_token == 61 * (512 + 64) * 2


@pytest.mark.parametrize(("name", "total", "moe_layers"), [
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", 109, 48),
    ("meta-llama/Llama-4-Maverick-17B-128E-Instruct", 400, 24),
])
def test_llama4_counts_its_interleaved_moe_layers_and_its_shared_expert(name, total, moe_layers):
    """Every second Maverick layer is dense, with its own wider MLP, and each MoE layer
    runs one shared expert beside its one routed expert: counted as all MoE with no shared
    expert, Maverick came out at 778B total and 11B active. The cards count the vision
    tower too (about 1B), which decoding never runs."""
    f = model_facts(fixture(name))
    assert f.moe is not None and (f.moe.layers, f.moe.shared_experts) == (moe_layers, 1)
    assert within(f.total_params / 1e9, total, 0.02) and within(f.active_params / 1e9, 17, 0.02)
    assert f.kv_bytes_per_token == 48 * 2 * 8 * 128 * 2
    # The MoE layers' routers (5120 x experts, SGLang's ReplicatedLinear) are whole on
    # every GPU; the dense layers have none.
    experts = f.moe.experts
    assert f.replicated_params == moe_layers * 5120 * experts


def test_ernie_4_5_counts_its_experts_from_its_own_keys_and_its_mtp_layer_as_dense():
    """ERNIE-4.5 names its experts `moe_num_experts` / `moe_k` and its MoE layers by a start
    and an end index; unread, the 300B-A47B was counted as a dense model of 47B in all.
    Its MTP layer has a dense MLP of `intermediate_size` (SGLang's Ernie4DecoderLayer
    with is_mtp), so a NEXTN draft pass reads no routed expert."""
    f = model_facts(fixture("baidu/ERNIE-4.5-300B-A47B-PT"))
    assert f.moe is not None and (f.moe.experts, f.moe.experts_per_token, f.moe.layers,
                                  f.moe.shared_experts) == (64, 8, 51, 0)
    assert within(f.total_params / 1e9, 300, 0.01) and within(f.active_params / 1e9, 47, 0.01)
    assert f.kv_bytes_per_token == 54 * 2 * 8 * 128 * 2
    h = 8192
    attention = h * (64 * 128 + 2 * 8 * 128) + 64 * 128 * h + 2 * 128  # (q/k norms' noise)
    assert (f.mtp_layers, f.mtp_moe) == (1, False)
    assert f.mtp_dense_params == attention + 3 * h * 28672 + 2 * h * h + 5 * h
    # Whole on every GPU: the 51 MoE layers' routers (with their score-correction bias);
    # of the MTP layer, its fusing projection only (a dense MLP has no router).
    assert f.replicated_params == 51 * (h * 64 + 64)
    assert f.mtp_replicated_params == 2 * h * h
    method = auto_prior(f, None, gpu_facts("H200"), 8, algorithm="NEXTN").method("NEXTN")
    assert method.mtp is not None and not method.mtp.routed_experts
    # An MoE target's MTP layer elsewhere is an MoE layer of its shape.
    assert model_facts(fixture("deepseek-ai/DeepSeek-V3")).mtp_moe


def test_experts_under_a_key_the_counting_does_not_read_are_refused_not_counted_dense():
    data = {**read_config(HF / "Qwen/Qwen3-8B/config.json"), "ffn_num_experts": 16,
            "num_experts_per_tok": 2}
    with pytest.raises(TreetuneError, match=r"key 'ffn_num_experts': names 16 experts under a "
                       r"key treetune does not read, so it cannot count this MoE yet"):
        facts_from_config(data, "q", Path("q.json"))
    # A list of counts (ERNIE-4.5-VL's text and vision experts) is refused the same way.
    vl = {**data, "ffn_num_experts": [64, 64]}
    with pytest.raises(TreetuneError, match=r"key 'ffn_num_experts': names \[64, 64\] "):
        facts_from_config(vl, "q", Path("q.json"))
    # A count per token alone, a size, or one expert, is no MoE to refuse.
    dense = {**read_config(HF / "Qwen/Qwen3-8B/config.json"), "num_experts_per_tok": 8,
             "num_experts": 0, "shared_expert_intermediate_size": 5632,
             "moe_num_shared_experts": 1}
    assert facts_from_config(dense, "q", Path("q.json")).moe is None


def test_ernie_4_5_takes_transformers_defaults_for_the_keys_its_config_leaves_out():
    """SGLang loads an ERNIE-4.5 MoE config through transformers' Ernie4_5_MoeConfig: its
    MoE layers run from layer 1 to the last (an end index of -1) with 2 shared experts
    unless the config says otherwise. Another model's `moe_num_experts` (Step-3's) is not
    read as ERNIE's."""
    full = read_config(HF / "baidu/ERNIE-4.5-300B-A47B-PT/config.json")
    sparse = {k: v for k, v in full.items()
              if k not in ("moe_layer_start_index", "moe_num_shared_experts")}
    f = facts_from_config({**sparse, "moe_layer_end_index": -1}, "e", Path("e.json"))
    assert f.moe is not None and (f.moe.layers, f.moe.shared_experts) == (53, 2)
    step = {**read_config(HF / "Qwen/Qwen3-8B/config.json"), "moe_num_experts": 48,
            "moe_top_k": 3}
    with pytest.raises(TreetuneError, match="key 'moe_num_experts': names 48 experts"):
        facts_from_config(step, "s", Path("s.json"))


def test_an_eagle3_head_counts_its_layer_fc_and_draft_vocabulary_head_not_the_embedding():
    f = model_facts(fixture("thoughtworks/Qwen3-Coder-Next-Eagle3"))
    h = 2048
    attention = 2 * h * (32 * 128 + 2 * 4 * 128) + 32 * 128 * h  # fed [embedding, hidden]
    mlp, fc, head = 3 * h * 5120, 3 * h * h, h * 32000
    assert f.eagle3 and f.layers == 1 and f.vocab_size == 32000
    assert within(f.total_params, attention + mlp + fc + head, 0.001)
    assert f.kv_bytes_per_token == 2 * 4 * 128 * 2


def test_an_eagle3_head_s_further_layers_and_a_llama4_head_s_mlp_count_as_sglang_builds_them(
        tmp_path):
    """SGLang's LlamaForCausalLMEagle3 feeds only its first layer [embedding, hidden] (2 x
    h); further layers read the hidden state. A Llama 4 head (model_type llama4_text)
    takes the MLP width of Llama 4's dense layers, intermediate_size_mlp (the count took
    intermediate_size: 126M short for Maverick's head)."""
    config = json.loads((HF / "thoughtworks/Qwen3-Coder-Next-Eagle3/config.json").read_text())
    one = model_facts(fixture("thoughtworks/Qwen3-Coder-Next-Eagle3"))
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "config.json").write_text(json.dumps({**config,
                                                             "num_hidden_layers": 2}))
    h = 2048
    layer = h * (32 * 128 + 2 * 4 * 128) + 32 * 128 * h + 3 * h * 5120 + 2 * h  # 2 norms
    two = model_facts(str(tmp_path / "two"))
    assert two.total_params - one.total_params == layer + 2 * 128  # and its q/k norms
    assert two.kv_bytes_per_token == 2 * one.kv_bytes_per_token
    llama4 = {**config, "model_type": "llama4_text", "intermediate_size": 8192,
              "intermediate_size_mlp": 16384}
    (tmp_path / "llama4").mkdir()
    (tmp_path / "llama4" / "config.json").write_text(json.dumps(llama4))
    wide = model_facts(str(tmp_path / "llama4"))
    assert wide.total_params - one.total_params == 3 * h * (16384 - 5120)


def test_an_eagle3_head_holds_its_own_embedding_or_the_target_s_head_as_sglang_loads_it(
        tmp_path):
    """SGLang shares the target's embedding only with a head of the target's width
    (llama.py's set_embed returns early otherwise: Llama-3.3-70B's 6144-wide head keeps
    its own, 128256 x 6144), and a head naming no draft vocabulary reads the target's
    lm_head instead of holding one (gpt-oss-120b's); a tied head's lm_head is its
    embedding, the target's at the target's width. They read as before; they hold more,
    or less."""
    from treetune.config import TreeConfig

    config = json.loads((HF / "thoughtworks/Qwen3-8B-Eagle3/config.json").read_text())
    h, vocab = config["hidden_size"], config["vocab_size"]
    plain = model_facts(fixture("thoughtworks/Qwen3-8B-Eagle3"))
    assert plain.resident_params == plain.total_params
    draft_vocab = config["draft_vocab_size"]
    for name, change, held in (
            ("narrow", {"target_hidden_size": 2 * h}, +vocab * h),
            # gpt-oss-120b's head writes it as null
            ("borrowing", {"draft_vocab_size": None}, -vocab * h),
            ("tied", {"tie_word_embeddings": True}, -draft_vocab * h),
            ("tied-narrow", {"tie_word_embeddings": True, "target_hidden_size": 2 * h},
             vocab * h - draft_vocab * h)):
        data = {**config, **change}
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(data))
        f = model_facts(str(tmp_path / name))
        assert f.resident_params - f.total_params == held, name
        target = dict(json.loads((HF / "Qwen/Qwen3-8B/config.json").read_text()))
        target["hidden_size"] = f.target_hidden_size
        (tmp_path / f"{name}-target").mkdir()
        (tmp_path / f"{name}-target" / "config.json").write_text(json.dumps(target))
        prior = auto_prior(model_facts(str(tmp_path / f"{name}-target")), f,
                           gpu_facts("H100-SXM"), 1)
        assert prior.draft.resident_params_m * 1e6 == f.resident_params
        tree = TreeConfig(3, 1, 4)
        with_head, without = (check_memory(prior, c, 1).required_gb for c in (tree, BASELINE))
        counted = dataclasses.replace(prior, draft=dataclasses.replace(
            prior.draft, resident_params_m=0.0))
        before = check_memory(counted, tree, 1).required_gb
        assert (with_head - without) - (before - without) == pytest.approx(
            held * 2 / 1e9, abs=1e-6), name


def test_a_modelopt_export_that_quantized_nothing_is_its_dtype(tmp_path):
    """NVIDIA's Llama-4-Maverick EAGLE3 head ships an hf_quant_config.json with
    `quant_algo: null`: a ModelOpt export that quantized nothing. It was refused as an
    algorithm treetune does not know."""
    config = json.loads((HF / "thoughtworks/Qwen3-Coder-Next-Eagle3/config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None}}))
    f = model_facts(str(tmp_path))
    assert (f.weight_bytes, f.quantization) == (2.0, "")


def test_an_mtp_layer_is_counted_apart_as_what_a_nextn_draft_pass_reads():
    """DeepSeek-V3's MTP layer (its 62nd, an MoE layer): MLA attention, eh_proj fusing
    [embedding, hidden], router, shared expert and norms every pass reads; its 256 routed
    experts are the target's. With them, about the 14B the model card gives for the MTP
    module less the embedding and head it shares with the target (2 x 0.93B)."""
    f = model_facts(fixture("deepseek-ai/DeepSeek-V3"))
    h, heads = 7168, 128
    q = h * 1536 + 1536 + 1536 * heads * (128 + 64)
    kv = h * (512 + 64) + 512 + 512 * heads * (128 + 128)
    attention = q + kv + heads * 128 * h
    router, shared, eh_proj, norms = h * 256 + 256, 3 * h * 2048, 2 * h * h, 5 * h
    assert f.mtp_layers == 1
    assert f.mtp_dense_params == attention + router + shared + eh_proj + norms
    assert f.mtp_kv_bytes_per_token == (512 + 64) * 2  # one layer's latent
    with_experts = f.mtp_dense_params + 256 * f.moe.expert_params + 2 * 129280 * h
    assert within(with_experts / 1e9, 14, 0.05)
    # GLM-4.5-Air's: GQA attention (with its biases) and an MoE layer; a dense Qwen3 has none.
    glm = model_facts(fixture("zai-org/GLM-4.5-Air"))
    h = 4096
    attention = h * (96 * 128 + 2 * 8 * 128) + 96 * 128 * h + 96 * 128 + 2 * 8 * 128 + 2 * 128
    assert glm.mtp_layers == 1 and glm.mtp_kv_bytes_per_token == 2 * 8 * 128 * 2
    assert glm.mtp_dense_params == (attention + h * 128 + 3 * h * 1408 + 2 * h * h + 5 * h)
    dense = model_facts(fixture("Qwen/Qwen3-8B"))
    assert (dense.mtp_layers, dense.mtp_dense_params, dense.mtp_kv_bytes_per_token) == (0, 0, 0)
    # Qwen3-Next's config.json names none, but its checkpoints carry one, as SGLang takes it:
    # gated attention (16 heads of 256, 2 KV heads), a gated shared expert, the router.
    nxt = model_facts(fixture("Qwen/Qwen3-Coder-Next"))
    h = 2048
    attention = h * (2 * 16 * 256 + 2 * 2 * 256) + 16 * 256 * h + 2 * 256
    assert nxt.mtp_layers == 1 and nxt.mtp_kv_bytes_per_token == 2 * 2 * 256 * 2
    assert nxt.mtp_dense_params == (attention + h * 512 + 3 * h * 512 + h + 2 * h * h + 5 * h)


def test_qwen3_5_s_mtp_layer_matches_the_shipped_397b_profile_s_nextn_within_1_percent(
        tmp_path):
    """Qwen3.5 names its MTP layer in text_config (`mtp_num_hidden_layers`). Its config.json
    as published (hidden 4096, 60 layers, every 4th full attention with 2 KV heads of 256,
    512 experts of 1024, a shared expert of 1024), and the auto prior's NEXTN against the
    shipped profile's, written by hand from the same architecture (gated attention, the
    shared expert, router and eh_proj read per pass)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": {
            "model_type": "qwen3_5_moe_text", "hidden_size": 4096, "num_hidden_layers": 60,
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256,
            "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 1024,
            "shared_expert_intermediate_size": 1024, "full_attention_interval": 4,
            "linear_num_key_heads": 16, "linear_num_value_heads": 64,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "vocab_size": 248320, "mtp_num_hidden_layers": 1,
            "tie_word_embeddings": False, "dtype": "bfloat16"}}))
    shipped = load_profile("qwen3.5-397b-a17b-h200").method("NEXTN").mtp
    prior = auto_prior(model_facts(str(tmp_path)), None, gpu_facts("H200"), 8)
    counted = prior.method("NEXTN").mtp
    assert within(counted.dense_params_m, shipped.dense_params_m, 0.01), counted
    assert counted.kv_bytes_per_token == shipped.kv_bytes_per_token
    assert counted.routed_experts and shipped.routed_experts
    # What every GPU holds whole: the MTP layer's fc and router, the target's 60 routers;
    # and the 2 KV heads each GPU of 8 holds a copy of.
    assert within(counted.replicated_params_m, shipped.replicated_params_m, 0.01), counted
    target = load_profile("qwen3.5-397b-a17b-h200").target
    assert within(prior.target.replicated_params_b, target.replicated_params_b, 0.01)
    assert prior.target.kv_heads == target.kv_heads == 2


def prior_of(target: str, draft: str, gpu: str, tp: int):
    return auto_prior(model_facts(fixture(target)), model_facts(draft), gpu_facts(gpu), tp)


def eagle3_head(tmp_path: Path, hidden: int, intermediate: int) -> str:
    """An EAGLE3 head in SpecForge's shape for a target of this width."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden,
        "intermediate_size": intermediate, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "num_hidden_layers": 1, "vocab_size": 129280,
        "draft_vocab_size": 32000, "torch_dtype": "bfloat16"}))
    return str(tmp_path)


def test_an_mla_target_s_prior_keeps_its_whole_latent_cache_on_every_gpu(tmp_path):
    """SGLang holds MLA's latent, shared by every head, whole on each tensor-parallel GPU:
    a prior that split it over 8 GPUs said 64 requests of 32k tokens fit on 8 H200s, where
    each GPU needs the 147 GB the cache alone takes (a helper's audit)."""
    prior = prior_of("deepseek-ai/DeepSeek-V3", eagle3_head(tmp_path, 7168, 18432), "H200", 8)
    assert prior.target.mla is not None and prior.target.kv_share(8) == 1.0
    assert prior.target.kv_bytes_per_token == 61 * (512 + 64) * 2
    check = check_memory(prior, BASELINE, 64, tp=8, context_tokens=32768)
    assert not check.fits and check.required_gb > 140


def test_an_mla_target_s_mtp_layer_keeps_its_latent_whole_on_every_gpu_too():
    """NEXTN's layer of DeepSeek-V3 caches an MLA latent as the target's layers do, whole on
    each of the 8 GPUs: it was divided by 8 (a review's finding). 61 + 1 layers of 1152 B
    per token, for every slot of 32 requests."""
    from treetune.config import TreeConfig

    prior = auto_prior(model_facts(fixture("deepseek-ai/DeepSeek-V3")), None,
                       gpu_facts("H200"), 8)
    tree = TreeConfig(3, 1, 4)
    check = check_memory(prior, tree, 32, tp=8, method="NEXTN", context_tokens=32768)
    slots = 32768 + tree.kv_slots_per_round
    kv_gb = 32 * slots * (61 + 1) * (512 + 64) * 2 / 1e9
    assert f"KV {kv_gb:.1f} GB for 32 requests" in check.reason, check.reason
    # And a draft pass reads it whole on each GPU: 8 x 1152 B per token of context.
    from treetune.perfmodel import PerfModel

    cost = PerfModel(prior, 8, "NEXTN").cost
    read = cost.draft_pass(32, 32, 4096) - cost.draft_pass(32, 32, 2048)
    per_token = read * cost.bandwidth * prior.calibration.kv_bandwidth_eff / (32 * 2048)
    assert per_token == pytest.approx(8 * (512 + 64) * 2)


@pytest.mark.parametrize(("tp", "per_gpu"), [(1, 1.0), (2, 1 / 2), (4, 1 / 2), (8, 1 / 2)])
def test_kv_heads_fewer_than_the_gpus_are_copied_so_each_gpu_holds_half_the_cache(tp, per_gpu):
    """Qwen3-Coder-Next has 2 KV heads: on 4 or 8 GPUs SGLang copies each head to tp / 2
    of them (its pool's head count is max(1, heads / tp)), so each GPU holds and reads
    half the cache. The prior split it over tp: a quarter on 4 GPUs, an eighth on 8."""
    prior = prior_of("Qwen/Qwen3-Coder-Next", fixture("thoughtworks/Qwen3-Coder-Next-Eagle3"),
                     "H200", 4)
    assert (prior.target.kv_heads, prior.draft.kv_heads) == (2, 4)
    assert prior.target.kv_share(tp) == per_gpu
    requests, slots = 16, 65536
    check = check_memory(prior, BASELINE, requests, tp=tp, context_tokens=slots)
    state = requests * prior.target.state_bytes_per_request / tp
    kv_gb = (requests * slots * 24576 * per_gpu + state) / 1e9
    assert f"KV {kv_gb:.1f} GB for {requests} requests" in check.reason, check.reason
    # A decode step on each GPU reads its copy: tp x its share of the whole cache.
    from treetune.perfmodel import PerfModel

    cost = PerfModel(prior, tp).cost
    data = prior.datasets["mt-bench"]
    longer = dataclasses.replace(data, context_tokens=data.context_tokens + 1000)
    read = cost.target_pass(8, 1, longer) - cost.target_pass(8, 1, data)
    per_token = read * cost.bandwidth * prior.calibration.kv_bandwidth_eff / (8 * 1000)
    assert per_token == pytest.approx(tp * per_gpu * 24576)
    # The draft head's 4 heads are copied on 8 GPUs only.
    assert prior.method().kv_share(prior.target, 8) == 1 / 4
    assert prior.method().kv_share(prior.target, 4) == 1 / 4


def test_mla_s_down_projections_and_dsa_s_indexer_are_held_whole_on_every_gpu(tmp_path):
    """SGLang holds MLA's fused query and latent down-projection and DeepSeek Sparse
    Attention's indexer as ReplicatedLinear: whole on each of the 8 GPUs, and read whole
    by each of them every pass, as it holds the MoE layers' routers. The prior split them
    over the 8 (DeepSeek-V3.2: 1.88B parameters, 1.6 GB short on each GPU)."""
    from treetune.perfmodel import PerfModel

    head = eagle3_head(tmp_path, 7168, 18432)
    v3 = prior_of("deepseek-ai/DeepSeek-V3", head, "H200", 8).target
    routers = 58 * (7168 * 256 + 256)  # 58 MoE layers' gates and score-correction biases
    assert v3.replicated_params_b * 1e9 == 61 * 7168 * (1536 + 512 + 64) + routers
    v32 = prior_of("deepseek-ai/DeepSeek-V3.2", head, "H200", 8)
    indexer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    replicated = 61 * (7168 * (1536 + 512 + 64) + indexer) + routers
    assert v32.target.replicated_params_b * 1e9 == replicated
    # Of them, the indexer's weights_proj and the routers stay bf16 in the fp8 checkpoint.
    assert v32.target.replicated_unquantized_b * 1e9 == 61 * 7168 * 64 + routers
    copy = replicated + 61 * 7168 * 64 + routers  # bytes: fp8, and bf16 for those
    # Memory: the split share plus seven more copies.
    check = check_memory(v32, BASELINE, 1, tp=8)
    split = v32.target.weight_bytes_of(v32.target.total_params_b * 1e9) / 8
    assert f"weights {(split + 7 / 8 * copy) / 1e9:.1f} GB" in check.reason
    # A pass reads them whole on each GPU: 7 more copies' bytes at all GPUs' bandwidth.
    unsplit = dataclasses.replace(v32, target=dataclasses.replace(
        v32.target, replicated_params_b=0.0, replicated_unquantized_b=0.0))
    data = v32.datasets["mt-bench"]
    extra = PerfModel(v32, 8).cost.target_pass(1, 1, data) - PerfModel(
        unsplit, 8).cost.target_pass(1, 1, data)
    cost = PerfModel(v32, 8).cost
    assert extra == pytest.approx(7 * copy / (
        cost.bandwidth * v32.calibration.weight_bandwidth_eff))
    # And each GPU computes them for every token: a compute-bound pass of 64k tokens.
    tokens = 65536
    extra = PerfModel(v32, 8).cost.target_pass(1, tokens, data) - PerfModel(
        unsplit, 8).cost.target_pass(1, tokens, data)
    assert extra == pytest.approx(2 * 7 * replicated * tokens / (
        cost.flops_peak * v32.calibration.compute_eff))
    with pytest.raises(FieldError, match=r"must be in 0\.\.17\.9\d* \(the parameters every "
                       r"pass reads\), got 671"):
        dataclasses.replace(v32.target, replicated_params_b=v32.target.total_params_b)
    with pytest.raises(FieldError, match=r"must be >= 0, got -2"):
        dataclasses.replace(v32.target, kv_heads=-2)
    # Attention of other kinds splits by heads: nothing is replicated.
    assert prior_of("Qwen/Qwen3-8B", fixture("thoughtworks/Qwen3-8B-Eagle3"), "H100-SXM",
                    1).target.replicated_params_b == 0


def test_replicated_attention_a_checkpoint_keeps_unquantized_is_held_at_its_dtype(tmp_path):
    """A checkpoint that leaves attention out of its quantization (Kimi-K2-Thinking's int4
    experts beside bf16 attention) holds MLA's replicated down-projections in bf16 on
    every GPU: 2 bytes a parameter, not the experts' width (a helper's review: 0.45 GB
    counted for 1.62 GB on each of 8 GPUs)."""
    config = json.loads((Path(fixture("deepseek-ai/DeepSeek-V3")) / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"],
                                     "modules_to_not_convert": ["self_attn"]}
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "config.json").write_text(json.dumps(config))
    prior = auto_prior(model_facts(str(tmp_path / "kept")),
                       model_facts(eagle3_head(tmp_path, 7168, 18432)), gpu_facts("H200"), 8)
    t = prior.target
    replicated = 61 * 7168 * (1536 + 512 + 64) + 58 * (7168 * 256 + 256)  # and the routers
    assert t.replicated_unquantized_b == t.replicated_params_b == replicated / 1e9
    assert t.replicated_extra_bytes(8) == pytest.approx(7 * replicated * 2)
    with pytest.raises(FieldError, match=r"replicated_params_b, those among"):
        dataclasses.replace(t, replicated_unquantized_b=t.replicated_params_b * 2)


def test_an_mtp_layer_s_fusing_projection_down_projections_and_router_are_held_whole():
    """SGLang's DeepSeek NEXTN layer fuses embedding and hidden state with a plain
    nn.Linear (eh_proj, 2 x 7168 -> 7168, never quantized), holds its MLA down-projections
    as ReplicatedLinear (fp8 in this checkpoint) and its router as a plain bf16 parameter:
    all whole on each of 8 GPUs. The prior split them over the 8 at fp8: about 200 MB
    short on each GPU, read on every draft pass."""
    from treetune.config import TreeConfig
    from treetune.perfmodel import PerfModel

    prior = auto_prior(model_facts(fixture("deepseek-ai/DeepSeek-V3")), None,
                       gpu_facts("H200"), 8)
    mtp = prior.method("NEXTN").mtp
    bf16 = 2 * 7168 * 7168 + 7168 * 256 + 256  # eh_proj, the router and its bias
    fp8 = 7168 * (1536 + 512 + 64)
    assert mtp.replicated_params_m * 1e6 == bf16 + fp8
    assert mtp.replicated_unquantized_m * 1e6 == bf16 and not mtp.unquantized
    split = dataclasses.replace(prior, methods={"NEXTN": dataclasses.replace(
        prior.methods["NEXTN"], mtp=dataclasses.replace(
            mtp, replicated_params_m=0.0, replicated_unquantized_m=0.0))})
    # Each GPU holds all of them, at 2 and 1 bytes, where its split share was 1 byte / 8.
    whole = bf16 * (8 * 2 - 1) + fp8 * (8 - 1)  # beyond the split share, all GPUs
    tree = TreeConfig(3, 1, 4)
    held, short = (check_memory(p, tree, 1, tp=8, method="NEXTN").required_gb
                   for p in (prior, split))
    assert held - short == pytest.approx(whole / 8 / 1e9, abs=1e-6)
    # And reads them so on every pass,
    cost, was = PerfModel(prior, 8, "NEXTN").cost, PerfModel(split, 8, "NEXTN").cost
    extra = cost.draft_pass(1, 1, 1024) - was.draft_pass(1, 1, 1024)
    assert extra == pytest.approx(whole / (
        cost.bandwidth * prior.calibration.weight_bandwidth_eff))
    # and computes them for every token (a compute-bound pass of 64k tokens).
    tokens = 65536
    extra = cost.draft_pass(tokens, 1, 1024) - was.draft_pass(tokens, 1, 1024)
    assert extra == pytest.approx(2 * 7 * (bf16 + fp8) * tokens / (
        cost.flops_peak * prior.calibration.compute_eff))
    with pytest.raises(FieldError, match=r"must be in 0\.\.\d+.* \(of dense_params_m\)"):
        dataclasses.replace(mtp, replicated_params_m=mtp.dense_params_m + 1)
    with pytest.raises(FieldError, match=r"must be in 0\.\.\d+.* \(of replicated_params_m\)"):
        dataclasses.replace(mtp, replicated_unquantized_m=mtp.replicated_params_m + 1)


def test_a_modelopt_nvfp4_deepseek_s_mtp_layer_is_held_and_read_in_bf16():
    """SGLang builds a ModelOpt NVFP4 DeepSeek checkpoint's NextN layer without its
    quantization (deepseek_nextn.py: "Overriding ... quant config for modelopt_fp4"): the
    layer and its 256 experts are bf16, 23 GB over 8 GPUs, where the prior held them at
    0.5625 bytes (6.5 GB)."""
    from treetune.config import TreeConfig

    prior = auto_prior(model_facts(fixture("nvidia/DeepSeek-V3-0324-FP4")), None,
                       gpu_facts("B200"), 8)
    mtp = prior.method("NEXTN").mtp
    assert mtp.unquantized and prior.target.weight_bytes == 0.5625
    assert not auto_prior(model_facts(fixture("deepseek-ai/DeepSeek-V3")), None,
                          gpu_facts("H200"), 8).method("NEXTN").mtp.unquantized
    tree = TreeConfig(3, 1, 4)
    weights = [float(re.search(r"weights ([\d.]+) GB", check_memory(
        prior, config, 1, tp=8, method="NEXTN").reason).group(1)) for config in (tree, BASELINE)]
    layer = mtp.dense_params_m * 1e6 + 256 * 3 * 7168 * 2048  # its experts, all resident
    expected = (layer * 2 + mtp.replicated_params_m * 1e6 * 7 * 2) / 8 / 1e9
    assert weights[0] - weights[1] == pytest.approx(expected, abs=0.15)
    assert expected > 2.9


def test_an_eagle3_head_s_fc_runs_in_the_extend_pass_only_and_is_whole_on_every_gpu(tmp_path):
    """SGLang's EAGLE3 head projects the target's three hidden states with a plain Linear
    (`fc`, 3 x 7168 -> 7168 for a DeepSeek-V3 head: 154M of its parameters), whole on
    every GPU, and runs it only when fed those states: the draft extend over a round's
    accepted tokens (and the prefill), not the draft-decode passes, whose input is the
    head's own state. The prior read it on every pass, split over the GPUs."""
    from treetune.config import TreeConfig
    from treetune.perfmodel import PerfModel

    prior = prior_of("deepseek-ai/DeepSeek-V3", eagle3_head(tmp_path, 7168, 18432), "H200", 8)
    fc = 3 * 7168 * 7168
    assert prior.draft.fc_params_m * 1e6 == fc
    flat = dataclasses.replace(prior, draft=dataclasses.replace(prior.draft, fc_params_m=0.0))
    cost, was = PerfModel(prior, 8).cost, PerfModel(flat, 8).cost
    per_byte = cost.bandwidth * prior.calibration.weight_bandwidth_eff
    decode = cost.draft_pass(1, 1, 1024) - was.draft_pass(1, 1, 1024)
    extend = cost.draft_pass(4, 1, 1024, extend=True) - was.draft_pass(4, 1, 1024, extend=True)
    assert decode == pytest.approx(-fc * 2 / per_byte)  # not read at all
    assert extend == pytest.approx((8 - 1) * fc * 2 / per_byte)  # read whole on each GPU
    # A round: one extend and steps - 1 decode passes.
    tree, data = TreeConfig(3, 1, 4), prior.datasets["mt-bench"]
    more = (cost.spec_round(tree, 1, data).draft_s - was.spec_round(tree, 1, data).draft_s)
    assert more == pytest.approx(((8 - 1) - 2) * fc * 2 / per_byte)
    held, short = (check_memory(p, tree, 1, tp=8).required_gb for p in (prior, flat))
    assert held - short == pytest.approx(7 / 8 * fc * 2 / 1e9, abs=1e-6)
    # A prefill feeds the head the target's states too: its fc runs, whole on each GPU
    # (one request of one token: weight-bound).
    now, then = (PerfModel(p, 8).prefill_time(tree, 1, 1, "mt-bench") for p in (prior, flat))
    assert now - then == pytest.approx((8 - 1) * fc * 2 / per_byte)
    # Only a head has one: a standalone model reads all its parameters on every pass.
    with pytest.raises(FieldError, match=r"only a draft head \(EAGLE3\) has an fc"):
        dataclasses.replace(prior.method(), drafter="standalone")
    with pytest.raises(FieldError, match=r"must be in 0\.\.\d+.* \(of params_m\)"):
        dataclasses.replace(prior.draft, fc_params_m=prior.draft.params_m + 1)


def test_a_draft_and_an_mtp_layer_copy_their_kv_heads_too(tmp_path):
    """An EAGLE3 head's own 4 KV heads on 8 GPUs, and Qwen3-Coder-Next's MTP layer (the
    target's 2 heads) on 4: each GPU holds and reads a quarter, then a half, of their
    caches, as SGLang sizes each attention's pool by its own heads."""
    from treetune.config import TreeConfig
    from treetune.perfmodel import PerfModel

    prior = prior_of("Qwen/Qwen3-Coder-Next", fixture("thoughtworks/Qwen3-Coder-Next-Eagle3"),
                     "H200", 8)
    tree, requests, context = TreeConfig(3, 1, 4), 8, 32768
    for tp, method, per_gpu in ((8, "EAGLE3", 2048 / 4), (4, "NEXTN", 2048 / 2)):
        check = check_memory(prior, tree, requests, tp=tp, method=method,
                             context_tokens=context)
        slots = context + tree.kv_slots_per_round
        target = 24576 / 2  # the target's own 2 heads: half on each GPU
        state = prior.target.state_bytes_per_request / tp
        kv_gb = requests * (slots * (target + per_gpu) + state) / 1e9
        assert f"KV {kv_gb:.1f} GB for {requests} requests" in check.reason, (method,
                                                                             check.reason)
        cost = PerfModel(prior, tp, method).cost
        read = cost.draft_pass(8, 8, 4096) - cost.draft_pass(8, 8, 2048)
        per_token = read * cost.bandwidth * prior.calibration.kv_bandwidth_eff / (8 * 2048)
        assert per_token == pytest.approx(tp * per_gpu), method
    # An MLA draft (a standalone DeepSeek-V2-Lite) keeps its whole latent on every GPU.
    lite = {"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048,
            "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
            "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
            "v_head_dim": 128, "intermediate_size": 10944, "vocab_size": 102400,
            "torch_dtype": "bfloat16"}
    (tmp_path / "lite").mkdir()
    (tmp_path / "lite" / "config.json").write_text(json.dumps(lite))
    draft = model_facts(str(tmp_path / "lite"))
    standalone = auto_prior(model_facts(fixture("deepseek-ai/DeepSeek-V3")), draft,
                            gpu_facts("H200"), 8, algorithm="STANDALONE")
    method = standalone.method("STANDALONE")
    assert method.kv_share(standalone.target, 8) == 1.0
    # And so does an MLA EAGLE3 head (SGLang's Eagle3DeepseekV2ForCausalLM).
    head = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "hidden_size": 7168,
            "num_hidden_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
            "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 18432,
            "vocab_size": 129280, "draft_vocab_size": 32000, "torch_dtype": "bfloat16"}
    (tmp_path / "mla-head").mkdir()
    (tmp_path / "mla-head" / "config.json").write_text(json.dumps(head))
    facts = model_facts(str(tmp_path / "mla-head"))
    assert facts.eagle3 and facts.mla and facts.kv_bytes_per_token == (512 + 64) * 2
    prior = auto_prior(model_facts(fixture("deepseek-ai/DeepSeek-V3")), facts,
                       gpu_facts("H200"), 8)
    assert prior.method().kv_share(prior.target, 8) == 1.0


@pytest.mark.parametrize(("target", "window", "layers"), [
    ("openai/gpt-oss-120b", 128, 18),  # layer_types: every other layer slides
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", 8192, 36),  # chunked: 3 of every 4
])
def test_layers_sglang_pools_by_their_window_are_priced_at_the_window(tmp_path, target,
                                                                      window, layers):
    """SGLang's hybrid sliding-window pool keeps only the window of these layers' cache
    (configs/model_config.py: is_hybrid_swa_model, get_hybrid_layer_ids)."""
    hidden = model_facts(fixture(target)).hidden_size
    prior = prior_of(target, eagle3_head(tmp_path, hidden, 8192), "H100-SXM", 8)
    assert prior.target.sliding_window == SlidingWindow(window=window, layers=layers)
    full = dataclasses.replace(prior, target=dataclasses.replace(prior.target,
                                                                 sliding_window=None))
    assert (check_memory(prior, BASELINE, 64, tp=8, context_tokens=131072).required_gb
            < check_memory(full, BASELINE, 64, tp=8, context_tokens=131072).required_gb)


def test_gemma3_counts_with_the_defaults_its_config_leaves_out(tmp_path):
    """google/gemma-3-27b-it's config.json gives no vocab_size and no tie_word_embeddings:
    transformers takes 262208 and a tied head. Its window layers share SGLang's full-size
    pool (Gemma 3 is not one of its hybrid sliding-window models)."""
    f = model_facts(fixture("google/gemma-3-27b-it"))
    assert f.vocab_size == 262208 and within(f.total_params / 1e9, 27.0, 0.01)
    assert f.kv_bytes_per_token == 62 * 2 * 16 * 128 * 2 and f.window_layers == 0
    prior = prior_of("google/gemma-3-27b-it", eagle3_head(tmp_path, 5376, 21504), "H100-SXM", 2)
    assert prior.target.sliding_window is None


def test_a_modelopt_checkpoint_s_quantization_is_read_from_hf_quant_config_json():
    """NVIDIA's ModelOpt exports keep it beside config.json, where SGLang reads it."""
    f = model_facts(fixture("nvidia/DeepSeek-V3-0324-FP4"))
    assert (f.weight_bytes, f.quantization) == (4.5 / 8, "nvfp4 (modelopt)")


@pytest.mark.parametrize(("quant", "expected"), [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, 1.0),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int"}}}}, 0.5),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float"}}}}, 1.0),
    ({"quant_method": "awq", "bits": 4}, 0.5),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, 1.0),
    ({"quant_method": "mxfp4"}, 4.25 / 8),
    # A ModelOpt export that names its producer, not its method (Qwen3-32B-FP8-Static).
    ({"quant_algo": "FP8", "producer": {"name": "modelopt"}, "ignore": ["lm_head"]}, 1.0),
    ({"quant_algo": "FP8", "producer": {"name": "modelopt"}}, 1.0),
    # Group-wise int4: a 16-bit scale and a 4-bit zero per 128 weights; GPTQ's sym: none.
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
     0.5 + 20 / 1024),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}, 0.5 + 16 / 1024),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True}, 1 + 16 / 1024),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
        "symmetric": True}}}}, 0.5 + 16 / 1024),
])
def test_quantization_config_sets_the_bytes_per_weight(quant, expected):
    data = {**read_config(HF / "Qwen/Qwen3-8B/config.json"), "quantization_config": quant}
    assert facts_from_config(data, "q", Path("q.json")).weight_bytes == expected


def test_an_unknown_quantization_method_names_the_key_and_the_way_out():
    data = {**read_config(HF / "Qwen/Qwen3-8B/config.json"),
            "quantization_config": {"quant_method": "mystery"}}
    with pytest.raises(TreetuneError, match=r"q\.json: key 'quantization_config': "
                       r"quant_method 'mystery'.*--prior"):
        facts_from_config(data, "q", Path("q.json"))


def test_an_fp8_kv_cache_halves_the_kv_bytes():
    f = model_facts(fixture("Qwen/Qwen3-8B"), kv_cache_bytes=1.0)
    assert f.kv_bytes_per_token == 36 * 2 * 8 * 128


def test_a_missing_architecture_key_is_named():
    data = read_config(HF / "Qwen/Qwen3-8B/config.json")
    del data["num_hidden_layers"]
    with pytest.raises(TreetuneError, match=r"x\.json: key 'num_hidden_layers': missing"):
        facts_from_config(data, "x", Path("x.json"))


# ---- finding config.json -----------------------------------------------------------------

def cache_with(root: Path, repo: str, commit: str = "0123abcd") -> Path:
    """A Hugging Face hub cache holding `repo`'s fixture config, as huggingface_hub lays
    it out (snapshots/<commit>/, refs/main naming the commit)."""
    folder = root / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((HF / repo / "config.json").read_text())
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return snapshot / "config.json"


def test_a_local_directory_is_read_directly():
    assert find_config(fixture("Qwen/Qwen3-8B"), {}) == HF / "Qwen/Qwen3-8B/config.json"


def test_a_hub_name_is_found_in_hf_hub_cache(tmp_path):
    path = cache_with(tmp_path / "hub", "Qwen/Qwen3-8B")
    assert find_config("Qwen/Qwen3-8B", {"HF_HUB_CACHE": str(tmp_path / "hub")}) == path


def test_a_hub_name_is_found_under_hf_home_and_in_the_default_cache(tmp_path):
    under_home = cache_with(tmp_path / "hf" / "hub", "Qwen/Qwen3-8B")
    assert find_config("Qwen/Qwen3-8B", {"HF_HOME": str(tmp_path / "hf")}) == under_home
    default = cache_with(tmp_path / "home" / ".cache" / "huggingface" / "hub",
                         "zai-org/GLM-4.5-Air")
    assert find_config("zai-org/GLM-4.5-Air", {"HOME": str(tmp_path / "home")}) == default


def test_refs_main_picks_the_snapshot_among_several(tmp_path):
    cache_with(tmp_path, "Qwen/Qwen3-8B", "old")
    folder = tmp_path / "models--Qwen--Qwen3-8B"
    newer = folder / "snapshots" / "new"
    newer.mkdir()
    (newer / "config.json").write_text("{}")
    (folder / "refs" / "main").write_text("old")
    assert find_config("Qwen/Qwen3-8B", {"HF_HUB_CACHE": str(tmp_path)}).parent.name == "old"


def test_a_model_found_nowhere_names_where_it_looked_and_downloads_nothing(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path / "a"), "HF_HOME": str(tmp_path / "b"),
           "HOME": str(tmp_path / "c")}
    with pytest.raises(TreetuneError) as caught:
        find_config("Org/Missing-Model", env)
    message = str(caught.value)
    assert "\n" not in message and "no config.json for 'Org/Missing-Model'" in message
    assert str(tmp_path / "a" / "models--Org--Missing-Model" / "snapshots") in message
    assert not any(tmp_path.rglob("*"))  # nothing was created, let alone downloaded


def test_only_the_cache_huggingface_hub_reads_is_searched(tmp_path):
    # A copy under HF_HOME, while HF_HUB_CACHE points elsewhere, is not what the server
    # would load: huggingface_hub reads HF_HUB_CACHE alone then.
    cache_with(tmp_path / "hf" / "hub", "Qwen/Qwen3-8B")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf")}
    with pytest.raises(TreetuneError, match=re.escape(str(tmp_path / "hub"))):
        find_config("Qwen/Qwen3-8B", env)
    assert find_config("Qwen/Qwen3-8B", {"HF_HOME": str(tmp_path / "hf")}).is_file()


def test_a_local_directory_without_config_json_is_named(tmp_path):
    with pytest.raises(TreetuneError, match=re.escape(str(tmp_path / "config.json"))):
        find_config(str(tmp_path), {})


# ---- GPUs --------------------------------------------------------------------------------

REQUIRED_GPUS = ("A100-40GB-SXM", "A100-80GB-SXM", "H100-SXM", "H100-PCIe", "H100-NVL", "H200",
                 "B200", "B300", "GB200", "L40S", "MI300X", "MI325X", "MI355X")


def test_the_gpu_table_holds_every_required_gpu_with_every_fact():
    table = gpu_table()
    assert set(REQUIRED_GPUS) <= set(table)
    for gpu in table.values():
        assert gpu.memory_gb > 0 and gpu.bandwidth_tb_s > 0 and gpu.bf16_tflops > 0
        assert gpu.interconnect_gb_s > 0
        assert gpu.fp8_tflops is None or gpu.fp8_tflops == pytest.approx(
            2 * gpu.bf16_tflops, rel=0.02)  # FP8 tensor cores run at twice BF16
    assert table["A100-80GB-SXM"].fp8_tflops is None  # Ampere has no FP8 tensor cores


def test_every_gpu_entry_names_its_vendor_datasheet_in_a_comment():
    text = table_path().read_text()
    entries = re.split(r"\n(?=[A-Z][A-Za-z0-9-]+:\n)", text)[1:]
    assert len(entries) == len(gpu_table())
    for entry in entries:
        assert re.search(r"#.*datasheet", entry), entry.splitlines()[0]


def test_the_peak_follows_the_weights_precision():
    h100 = gpu_facts("H100-SXM")
    assert (h100.peak_tflops(1.0), h100.peak_tflops(2.0), h100.peak_tflops(0.5)) == (
        1979, 989, 989)
    assert gpu_facts("A100-80GB-SXM").peak_tflops(1.0) == 312


@pytest.mark.parametrize(("name", "key"), [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA H100 PCIe", "H100-PCIe"),
    ("NVIDIA H100 NVL", "H100-NVL"), ("NVIDIA H200", "H200"), ("NVIDIA B200", "B200"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB-SXM"), ("NVIDIA A100 80GB PCIe", "A100-80GB-PCIe"),
    ("NVIDIA L40S", "L40S"), ("AMD Instinct MI300X", "MI300X"), ("h200", "H200"),
    ("gb200", "GB200"), ("MI325X", "MI325X"), ("NVIDIA H20", "H20"), ("NVIDIA H800", "H800"),
    ("NVIDIA B300 SXM6 AC", "B300"), ("AMD Instinct MI355X", "MI355X"),
])
def test_gpu_names_as_nvidia_smi_and_users_write_them_map_to_the_table(name, key):
    assert gpu_facts(name).name == key


def test_an_unknown_gpu_names_the_override():
    with pytest.raises(TreetuneError, match=r"GPU 'NVIDIA RTX 9999' \(--gpu\) is not in "
                       r"treetune's GPU table: name a GPU it knows with --gpu NAME"):
        gpu_facts("NVIDIA RTX 9999")


@pytest.mark.parametrize("name", ["NVIDIA L40", "NVIDIA A10", "NVIDIA L4"])
def test_a_gpu_whose_name_begins_another_s_is_not_taken_for_it(name):
    # The L40 has about half the L40S's dense TFLOPs, the A10 and L4 are far slower than
    # the A100 and L40S their names begin: matched by whole words, never by letters (the
    # H20 and the H200 are both in the table, each its own).
    with pytest.raises(TreetuneError, match="is not in treetune's GPU table"):
        gpu_facts(name, "nvidia-smi on node-1")


def test_an_ambiguous_gpu_name_lists_the_candidates():
    with pytest.raises(TreetuneError, match=r"could be H100-SXM, H100-PCIe, H100-NVL.*--gpu"):
        gpu_facts("H100")


def stand_in_nvidia_smi(folder: Path, output: str, exit_code: int = 0,
                        program: str = "nvidia-smi") -> Path:
    """An `nvidia-smi` (or another `program`) on PATH that prints `output` and records its
    arguments in `args`."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / program
    script.write_text("#!/bin/sh\n"
                      f'echo "$@" > "{folder}/args"\n'
                      f"printf '%s' '{output}'\n"
                      f"exit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder


def test_the_gpu_is_read_from_nvidia_smi_on_path(tmp_path):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA H100 80GB HBM3, 81559 MiB\n"
                                  "NVIDIA H100 80GB HBM3, 81559 MiB\n")
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin"}
    seen = query_gpus(env)
    assert [(g.name, g.memory_mib) for g in seen] == [("NVIDIA H100 80GB HBM3", 81559)] * 2
    assert detect_gpu(env).name == "H100-SXM"
    args = (bin_dir / "args").read_text().split()
    assert args == ["--query-gpu=name,memory.total", "--format=csv,noheader"]


def test_nvidia_smi_is_asked_about_the_devices_the_worker_was_given(tmp_path):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA H200, 143771 MiB\n")
    env = {"PATH": str(bin_dir), "CUDA_VISIBLE_DEVICES": "2,3"}
    assert detect_gpu(env).name == "H200"
    assert (bin_dir / "args").read_text().split()[-1] == "--id=2,3"


def test_mig_instances_are_not_taken_for_whole_gpus(tmp_path):
    """nvidia-smi names the parent GPU: a 1g.10gb slice of an A100 would be priced with
    the whole A100's 80 GB and 2 TB/s (a helper's audit)."""
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA A100-SXM4-80GB, 81920 MiB\n")
    env = {"PATH": str(bin_dir), "CUDA_VISIBLE_DEVICES": "MIG-4f8c1d2e-0b6a-5f3e-9c7d-1a2b3c4d5e6f"}
    with pytest.raises(TreetuneError, match=r"are MIG instances \(MIG-4f8c.*--prior FILE"):
        detect_gpu(env)


def test_an_unknown_gpu_from_nvidia_smi_names_the_override(tmp_path):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA Future GPU, 1000 MiB\n")
    with pytest.raises(TreetuneError, match=r"GPU 'NVIDIA Future GPU' \(nvidia-smi on .*"
                       r"1000 MiB\).*--gpu NAME"):
        detect_gpu({"PATH": str(bin_dir)})


def test_without_any_gpu_tool_the_error_names_the_tools_and_the_override(tmp_path):
    with pytest.raises(TreetuneError, match=r"no GPU management tool \(nvidia-smi, amd-smi, "
                       r"rocm-smi\) was found on .*--gpu NAME"):
        query_gpus({"PATH": str(tmp_path)})


# rocm-smi --showproductname --showmeminfo vram --json on a 2-GPU MI300X node (ROCm 6.x,
# shortened); the field's case changed between releases ("Card series" / "Card Series").
ROCM_SMI_MI300X = json.dumps({
    "card0": {"Card Series": "AMD Instinct MI300X OAM", "Card Model": "0x74a1",
              "VRAM Total Memory (B)": "206141652992"},
    "card1": {"Card series": "AMD Instinct MI300X OAM", "Card model": "0x74a1",
              "VRAM Total Memory (B)": "206141652992"}})
# amd-smi static --asic --vram --json (ROCm 6.3+ wraps the list in gpu_data), one MI325X and
# one MI300X, as on a mixed test node.
AMD_SMI_MIXED = json.dumps({"gpu_data": [
    {"gpu": 0, "asic": {"market_name": "AMD Instinct MI325X", "device_id": "0x74a5"},
     "vram": {"type": "HBM3E", "size": {"value": 262128, "unit": "MB"}}},
    {"gpu": 1, "asic": {"market_name": "AMD Instinct MI300X", "device_id": "0x74a1"},
     "vram": {"type": "HBM3", "size": {"value": 196592, "unit": "MB"}}}]})


def test_on_an_amd_node_the_gpu_is_read_from_rocm_smi(tmp_path):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", ROCM_SMI_MI300X, program="rocm-smi")
    env = {"PATH": str(bin_dir)}
    seen = query_gpus(env)
    assert [(g.name, round(g.memory_mib or 0), g.tool) for g in seen] == [
        ("AMD Instinct MI300X OAM", 196592, "rocm-smi")] * 2
    assert detect_gpu(env).name == "MI300X"
    assert (bin_dir / "args").read_text().split() == [
        "--showproductname", "--showmeminfo", "vram", "--json"]


def test_amd_smi_comes_before_rocm_smi_and_keeps_the_devices_ray_gave_the_worker(tmp_path):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", AMD_SMI_MIXED, program="amd-smi")
    stand_in_nvidia_smi(tmp_path / "bin", "{}", program="rocm-smi")
    assert detect_gpu({"PATH": str(bin_dir), "HIP_VISIBLE_DEVICES": "1"}).name == "MI300X"
    assert detect_gpu({"PATH": str(bin_dir), "ROCR_VISIBLE_DEVICES": "0"}).name == "MI325X"
    assert (bin_dir / "args").read_text().split() == ["static", "--asic", "--vram", "--json"]
    with pytest.raises(TreetuneError, match=r"GPUs on .* differ \(AMD Instinct MI300X, AMD "
                       r"Instinct MI325X\).*--gpu NAME"):
        detect_gpu({"PATH": str(bin_dir)})


def test_an_amd_gpu_unknown_to_the_table_says_which_tool_named_it(tmp_path):
    output = json.dumps([{"gpu": 0, "asic": {"market_name": "AMD Instinct MI999X"},
                          "vram": {"vram_size_mb": 1000}}])  # the pre-6.3 list form
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", output, program="amd-smi")
    with pytest.raises(TreetuneError, match=r"GPU 'AMD Instinct MI999X' \(amd-smi on .*, "
                       r"1000 MiB\) is not in treetune's GPU table.*--gpu NAME"):
        detect_gpu({"PATH": str(bin_dir)})


@pytest.mark.parametrize("output", ["{}", "ERROR: GPU[0]: unable to read the device",
                                    json.dumps({"system": {"Driver version": "6.8.5"}})])
def test_a_rocm_smi_that_exits_0_without_a_gpu_lists_no_gpu(tmp_path, output):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", output, program="rocm-smi")
    with pytest.raises(TreetuneError, match=r"rocm-smi on .* lists no GPU \(.*\): name the "
                       r"GPU with --gpu NAME"):
        detect_gpu({"PATH": str(bin_dir)})
    with pytest.raises(TreetuneError, match=r"lists no GPU \((no GPU in its output|ERROR)"):
        detect_gpu({"PATH": str(bin_dir), "HIP_VISIBLE_DEVICES": "0"})  # not "among 0"


def test_visible_devices_that_name_no_listed_amd_gpu_are_a_clear_error(tmp_path):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", ROCM_SMI_MI300X, program="rocm-smi")
    with pytest.raises(TreetuneError, match=r"lists no GPU \(no GPU among 5\)"):
        detect_gpu({"PATH": str(bin_dir), "HIP_VISIBLE_DEVICES": "5"})


def test_nvidia_smi_is_asked_first_when_a_node_has_both_tools(tmp_path):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA H200, 143771 MiB\n")
    stand_in_nvidia_smi(tmp_path / "bin", ROCM_SMI_MI300X, program="rocm-smi")
    assert detect_gpu({"PATH": str(bin_dir)}).name == "H200"


def test_a_failing_nvidia_smi_says_what_it_said(tmp_path):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA-SMI has failed because it "
                                  "could not communicate with the NVIDIA driver.", 9)
    with pytest.raises(TreetuneError, match=r"lists no GPU \(exit code 9: NVIDIA-SMI has "
                       r"failed.*--gpu"):
        query_gpus({"PATH": str(bin_dir)})


@pytest.mark.parametrize(("output", "code", "said"), [
    # Each misread once (an audit): lines of no GPU taken for GPUs that "differ", a failing
    # exit hidden behind the one line it printed, bytes of no UTF-8 an internal error.
    ("!!!\nasdf qwerty\n", 0, "lists no GPU (asdf qwerty)"),
    ("NVIDIA H100 80GB HBM3, 81559 MiB\n", 3, "lists no GPU (exit code 3: NVIDIA H100"),
    ("\\377\\376 broken\n", 0, "lists no GPU (\ufffd\ufffd broken)"),
])
def test_what_nvidia_smi_prints_that_names_no_gpu_is_said_as_it_is(tmp_path, output, code,
                                                                   said):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "", code)
    script = bin_dir / "nvidia-smi"  # printf reads the octal escapes as bytes
    script.write_text(script.read_text().replace("printf '%s' ''", f"printf '{output}'"))
    with pytest.raises(TreetuneError) as info:
        query_gpus({"PATH": str(bin_dir)})
    assert said in str(info.value) and "--gpu" in str(info.value)


@pytest.mark.parametrize("memory", ["[N/A]", "[Not Supported]", "[Insufficient Permissions]"])
def test_a_gpu_line_among_chatter_is_read_and_a_bracketed_memory_is_no_number(tmp_path,
                                                                              memory):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "a warning, of a wrapper\n"
                                  f"NVIDIA GB10, {memory}\n")
    assert [(g.name, g.memory_mib) for g in query_gpus({"PATH": str(bin_dir)})] == [
        ("NVIDIA GB10", None)]


def test_an_nvidia_smi_that_hangs_is_ended_with_what_it_started(tmp_path, monkeypatch):
    from treetune.facts import gpus

    monkeypatch.setattr(gpus, "SMI_TIMEOUT_S", 1.0)
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "")
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {tmp_path}/child\nwait\n")
    with pytest.raises(TreetuneError, match="did not answer within 1 s"):
        query_gpus({"PATH": f"{bin_dir}:/usr/bin:/bin"})
    child = int((tmp_path / "child").read_text())
    assert wait_until(lambda: not Path(f"/proc/{child}").exists()
                      or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2], 10)


def test_different_gpus_on_one_worker_are_refused(tmp_path):
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA H100 80GB HBM3, 81559 MiB\n"
                                  "NVIDIA H200, 143771 MiB\n")
    with pytest.raises(TreetuneError, match=r"GPUs on .* differ .*--gpu NAME"):
        detect_gpu({"PATH": str(bin_dir)})


def test_a_config_of_a_shape_the_counting_does_not_know_is_a_one_line_error():
    data = read_config(HF / "Qwen/Qwen3-8B/config.json")
    del data["head_dim"]
    data["num_attention_heads"] = 0  # a ZeroDivisionError once
    with pytest.raises(TreetuneError, match=r"z\.json: key 'num_attention_heads': expected a "
                       "positive integer, got 0"):
        facts_from_config(data, "z", Path("z.json"))
    with pytest.raises(TreetuneError, match=r"z\.json: cannot count this model "
                       r"\(TypeError.*--prior"):
        facts_from_config({**QWEN3_8B, "architectures": 5}, "z", Path("z.json"))


@pytest.mark.parametrize(("key", "value", "said"), [
    # Each was an internal error or ran for minutes (an audit).
    ("num_key_value_heads", 0, "expected a positive integer, got 0"),
    ("num_hidden_layers", 0, "expected a positive integer, got 0"),
    ("num_hidden_layers", 10**9, "1000000000 is more than any model holds"),
    ("num_key_value_heads", 64, "64 KV heads do not divide the 32 attention heads"),
])
def test_a_config_count_no_model_has_is_refused_naming_its_key(key, value, said):
    with pytest.raises(TreetuneError) as info:
        facts_from_config({**QWEN3_8B, key: value}, "z", Path("z.json"))
    assert f"key '{key}': {said}" in str(info.value)


QWEN3_8B = read_config(HF / "Qwen/Qwen3-8B/config.json")


def unquantized(quant: dict) -> int:
    data = {**QWEN3_8B, "quantization_config": quant}
    return facts_from_config(data, "q", Path("q.json")).unquantized_params


def test_what_a_quantized_checkpoint_keeps_unquantized_is_counted_as_each_scheme_says():
    """Priced at the quantized width, an FP8 Qwen3-30B-A3B's bf16 head and routers were
    read 9% short per pass, gpt-oss's bf16 attention and head 43% short (a helper's audit
    of SGLang 0.5.23's quantization code)."""
    h, vocab, layers = 4096, 151936, 36
    head, norms = vocab * h, (2 * layers + 1) * h
    mlp = layers * 3 * h * 12288
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert unquantized({}) == 0
    assert unquantized(fp8) == head + norms  # SGLang quantizes the linear layers only
    one = unquantized({**fp8, "modules_to_not_convert": ["lm_head", "model.layers.0.self_attn"]})
    every = unquantized({**fp8, "ignored_layers": ["self_attn"]})
    attention = one - head - norms
    assert attention > 0 and every == head + norms + layers * attention
    assert unquantized({**fp8, "modules_to_not_convert": ["model.layers.0.mlp.gate"]}) \
        == head + norms  # a router, already kept: no MLP of a dense model
    ct = {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}}
    assert unquantized(ct) == head + norms
    assert unquantized({**ct, "ignore": ["lm_head", "re:.*mlp.down_proj"]}) == head + norms + mlp
    assert unquantized({**ct, "config_groups": {"g": {
        "targets": ["Linear", "lm_head"], "weights": {"num_bits": 8, "type": "float"}}}}) == norms
    modelopt = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    assert unquantized(modelopt) == norms  # ModelOpt quantizes the head unless excluded
    assert unquantized({**modelopt, "exclude_modules": ["lm_head", "model.layers.*.self_attn"]}
                       ) == every
    awq = {"quant_method": "awq", "bits": 4}
    assert unquantized(awq) == head + norms and unquantized({**awq, "lm_head": True}) == norms
    gptq = {"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*self_attn.*": {}}}
    assert unquantized(gptq) == every
    # A tied head reads the embedding whole, at its width (a review's finding).
    tied = facts_from_config({**QWEN3_8B, "tie_word_embeddings": True,
                              "quantization_config": fp8}, "q", Path("q.json"))
    assert tied.unquantized_params == head + norms
    # ModelOpt's nested form, as in a config.json (the sidecar's is flattened on reading).
    nested = {"quant_method": "modelopt", "quantization": {
        "quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}}
    assert unquantized(nested) == head + norms
    gpt_oss = model_facts(fixture("openai/gpt-oss-120b"))  # mxfp4: the experts only
    moe = gpt_oss.moe
    routed = moe.layers * moe.experts * moe.expert_params
    assert gpt_oss.unquantized_params == gpt_oss.total_params - routed - \
        gpt_oss.vocab_size * gpt_oss.hidden_size


def test_a_multimodal_llama4s_module_names_are_matched_with_their_prefix():
    """Llama 4 calls its MLPs feed_forward, under `language_model.` in the checkpoint."""
    data = read_config(HF / "meta-llama/Llama-4-Maverick-17B-128E-Instruct/config.json")

    def kept(*listed: str) -> int:
        quant = {"quant_method": "fp8", "modules_to_not_convert": ["lm_head", *listed]}
        return facts_from_config({**data, "quantization_config": quant}, "q",
                                 Path("q.json")).unquantized_params

    base = kept()
    attention = kept("language_model.model.layers.*.self_attn")
    dense = kept("re:.*feed_forward.down_proj")
    assert attention > base + 1e9 and dense > base + 1e9  # 48 layers; 24 dense MLPs
    assert kept("language_model.model.layers.0.self_attn") - base == (attention - base) / 48


def test_the_auto_prior_reads_and_holds_the_unquantized_parts_at_their_width():
    profile = prior_of(fixture("openai/gpt-oss-120b"), fixture("thoughtworks/Qwen3-8B-Eagle3"),
                       "H200", 1)
    t = profile.target
    assert t.unquantized_bytes == 2.0 and t.unquantized_params_b > 1.5
    bulk = t.always_read_params * t.weight_bytes
    assert t.weight_bytes_of(t.always_read_params) / bulk > 2.5  # mostly bf16 but experts
    from treetune.perfmodel.cost import CostModel

    bulk_only = dataclasses.replace(profile, target=dataclasses.replace(
        t, unquantized_params_b=0.0, replicated_unquantized_b=0.0,
        attention_unquantized_b=0.0))
    data = next(iter(profile.datasets.values()))
    step, priced_short = (CostModel(p).target_pass(1, 1, data) for p in (profile, bulk_only))
    extra = t.unquantized_params_b * 1e9 * (2 - t.weight_bytes) / (
        profile.hardware.bandwidth_tb_s * 1e12 * profile.calibration.weight_bandwidth_eff)
    assert step - priced_short == pytest.approx(extra, rel=0.01)  # weight-bound at batch 1
    held, short = (check_memory(p, BASELINE, 1).required_gb for p in (profile, bulk_only))
    assert held - short == pytest.approx(t.unquantized_params_b * (2 - t.weight_bytes), 0.01)
    with pytest.raises(FieldError, match=r"must be in 0\.\.2\.1\d* \(the parameters every pass"):
        dataclasses.replace(t, unquantized_params_b=t.total_params_b)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hybrid_override_pattern", "MEMEM*EMEMEM*", "Nemotron-H"),
    ("block_configs", [{"attention": {"no_op": True}}], "DeciLM, Nemotron-NAS"),
    ("hybrid_layer_pattern", [0, 1, 1], "MiMo-V2"),
    ("global_head_dim", 512, "Gemma 4"),
    ("zero_expert_num", 1, "LongCat-Flash"),
    ("attn_layer_period", 8, "Jamba"),
    ("attn_type_list", [0] * 7 + [1], "MiniMax-Text-01, MiniMax-M1"),
    ("altup_num_inputs", 4, "Gemma-3n"),
    ("ffn_config", {"moe_num_experts": 16, "moe_top_k": 4}, "DBRX"),
    ("use_mixed_mlp_moe", True, "Hunyuan"),
    ("use_cla", True, "Hunyuan's cross-layer attention"),
    ("mamba_d_ssm", 1024, "Falcon-H1, Bamba"),
])
def test_a_layout_the_counting_would_get_wrong_is_refused_not_miscounted(key, value, named):
    """A helper ran real configs through the counting: Nemotron-3-Nano came out at 102B for
    about 32B, Nemotron-Super-49B at 24B with 13x its KV cache, both without a word."""
    data = {**read_config(HF / "Qwen/Qwen3-8B/config.json"), key: value}
    with pytest.raises(TreetuneError, match=rf"key '{key}': its layers are .*\({named}\), "
                       r"which treetune cannot count yet: write the profile by hand"):
        facts_from_config(data, "q", Path("q.json"))


def test_a_minimax_config_whose_layers_are_all_softmax_attention_is_counted():
    data = {**read_config(HF / "Qwen/Qwen3-8B/config.json"), "attn_type_list": [1] * 36,
            "use_cla": False, "use_mixed_mlp_moe": False}
    assert facts_from_config(data, "q", Path("q.json")).attention_layers == 36


def test_a_cohere_config_without_tie_word_embeddings_ties_its_head_as_transformers_does():
    """transformers' CohereConfig and Cohere2Config tie the head by default: a config
    leaving the key out was counted with a head of its own (Command-A: +2.9%)."""
    data = {k: v for k, v in read_config(HF / "Qwen/Qwen3-8B/config.json").items()
            if k != "tie_word_embeddings"}
    untied = facts_from_config({**data, "tie_word_embeddings": False}, "c", Path("c.json"))
    for model_type in ("cohere", "cohere2"):
        tied = facts_from_config({**data, "model_type": model_type}, "c", Path("c.json"))
        assert untied.total_params - tied.total_params == data["vocab_size"] * 4096


def test_a_per_layer_moe_list_marks_the_moe_layers():
    data = read_config(HF / "Qwen/Qwen3-30B-A3B-FP8/config.json")
    layers = data["num_hidden_layers"]
    listed = facts_from_config({**data, "moe_layer_freq": [0] + [1] * (layers - 1)}, "q",
                               Path("q.json"))
    assert listed.moe is not None and listed.moe.layers == layers - 1


def test_qwen35_gated_attention_counts_its_gate_projection():
    """Qwen3.5 says attn_output_gate where Qwen3-Next's model_type said it: its gate (a
    query-sized projection) went uncounted, 3% of the 397B's active parameters."""
    data = read_config(HF / "Qwen/Qwen3-8B/config.json")
    plain = facts_from_config(data, "q", Path("q.json"))
    gated = facts_from_config({**data, "attn_output_gate": True}, "q", Path("q.json"))
    gate = data["num_attention_heads"] * data["head_dim"] * data["hidden_size"]
    assert gated.total_params - plain.total_params == data["num_hidden_layers"] * gate


def test_an_eagle3_head_of_another_vocabulary_than_the_target_gets_no_auto_prior(tmp_path):
    """SGLang serves the pair (the head takes the target's embedding), so the study is not
    refused; the auto prior is not built on a head trained for another tokenizer."""
    from treetune.facts import build_prior
    from treetune.facts.prior import pair_problem, vocabulary_problem

    head = model_facts(fixture("thoughtworks/Qwen3-8B-Eagle3"))
    target = read_config(HF / "Qwen/Qwen3-8B/config.json")
    same = facts_from_config(target, "t", Path("t.json"))
    assert vocabulary_problem("t", same, "d", head) == ""
    llama_config = tmp_path / "llama"
    llama_config.mkdir()
    (llama_config / "config.json").write_text(json.dumps({**target, "vocab_size": 128256}))
    llama = model_facts(str(llama_config))
    assert pair_problem("t", llama, "d", head) == ""  # SGLang would serve it
    assert vocabulary_problem("t", llama, "d", head) == (
        f"draft 'd' ({head.config_path}) is an EAGLE3 head for a target of vocabulary 151936, "
        "but 't' has vocabulary 128256: give the draft head trained for this target")
    with pytest.raises(TreetuneError, match="is an EAGLE3 head for a target of vocabulary"):
        build_prior(str(llama_config), fixture("thoughtworks/Qwen3-8B-Eagle3"), gpu="H100-SXM")
    # A head whose config gives only its draft vocabulary says nothing of the target's.
    bare = read_config(HF / "thoughtworks/Qwen3-8B-Eagle3/config.json")
    unsaid = facts_from_config({**bare, "vocab_size": bare["draft_vocab_size"]}, "d",
                               Path("d.json"))
    assert unsaid.target_vocab_size == 0 and vocabulary_problem("t", llama, "d", unsaid) == ""


def test_a_wrapped_language_model_keeps_the_outer_architecture_sglang_loads_by():
    """Kimi-K2.5's config names KimiK25ForConditionalGeneration outside and
    DeepseekV3ForCausalLM in its text_config; SGLang loads the outer (a helper's audit)."""
    inner = read_config(HF / "deepseek-ai/DeepSeek-V3/config.json")
    wrapped = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": inner}
    facts = facts_from_config(wrapped, "k", Path("k.json"))
    assert facts.architecture == "KimiK25ForConditionalGeneration"
    assert facts.total_params == facts_from_config(inner, "k", Path("k.json")).total_params


def test_a_modelopt_export_without_quant_method_quantizes_its_head_unless_it_says_not():
    """SGLang takes a config without quant_method for ModelOpt's, whose head is quantized
    unless excluded; the head was counted unquantized (a review's finding)."""
    data = read_config(HF / "Qwen/Qwen3-8B/config.json")
    named = {"quant_method": "modelopt", "quant_algo": "FP8"}
    for quant in (named, {"quant_algo": "FP8", "producer": {"name": "modelopt"}}):
        f = facts_from_config({**data, "quantization_config": quant}, "q", Path("q.json"))
        assert f.unquantized_params < 1e6, quant  # norms only
    kept = facts_from_config({**data, "quantization_config": {
        "quant_algo": "FP8", "producer": {"name": "modelopt"}, "ignore": ["lm_head"]}}, "q",
        Path("q.json"))
    assert kept.unquantized_params > data["vocab_size"] * data["hidden_size"]


def test_qwen35_attention_is_gated_when_its_config_does_not_say():
    data = read_config(HF / "Qwen/Qwen3-8B/config.json")
    said = facts_from_config({**data, "attn_output_gate": True}, "q", Path("q.json"))
    for model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        unsaid = facts_from_config({**data, "model_type": model_type}, "q", Path("q.json"))
        assert unsaid.total_params == said.total_params, model_type


def test_a_modelopt_mixed_precision_export_is_priced_by_its_experts_algorithm(tmp_path):
    """nvidia's MIXED_PRECISION exports (experts in NVFP4, attention in FP8) were refused:
    the auto prior went without them (a helper ran the real sidecar)."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "config.json").write_text((HF / "Qwen/Qwen3-30B-A3B-FP8/config.json").read_text()
                                        .replace('"quantization_config"', '"unused"'))
    layers = {f"model.layers.{i}.mlp.experts.{e}.{part}": {"quant_algo": "W4A16_NVFP4"}
              for i in range(2) for e in range(2) for part in ("gate_proj", "down_proj")}
    layers |= {f"model.layers.{i}.self_attn.q_proj": {"quant_algo": "FP8"} for i in range(9)}
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
        "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}))
    facts = model_facts(str(folder))
    assert facts.weight_bytes == (4 + 8 / 16) / 8
    assert facts.quantization == "nvfp4 (modelopt mixed precision, by its routed experts)"
    # One fused entry a layer for the routed experts, three FP8 ones for the shared
    # expert: the routed experts' algorithm still (a review's case).
    fused = {"model.layers.0.mlp.experts": {"quant_algo": "NVFP4"}} | {
        f"model.layers.0.mlp.shared_expert.{p}_proj": {"quant_algo": "FP8"}
        for p in ("gate", "up", "down")}
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
        "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": fused}}))
    assert model_facts(str(folder)).weight_bytes == (4 + 8 / 16) / 8


def test_an_fp8_checkpoint_with_nvfp4_experts_and_a_group_size_is_priced_by_its_experts():
    """SGLang 0.5.23's hybrid export: quant_method fp8, moe_quant_algo NVFP4, group_size
    16 came out at 1.125 bytes a weight (fp8 with a group scale); its experts are 0.5625."""
    data = {**read_config(HF / "Qwen/Qwen3-8B/config.json"), "quantization_config": {
        "quant_method": "fp8", "quant_algo": "MIXED_PRECISION", "moe_quant_algo": "NVFP4",
        "group_size": 16}}
    assert facts_from_config(data, "q", Path("q.json")).weight_bytes == (4 + 8 / 16) / 8
    plain = {**data, "quantization_config": {"quant_method": "fp8", "group_size": 128}}
    assert facts_from_config(plain, "q", Path("q.json")).weight_bytes == 1.0


def test_data_parallel_attention_copies_the_attention_and_reads_the_busiest_groups_cache():
    """SGLang's data-parallel attention in G groups (--enable-dp-attention --dp-size G):
    each group holds the attention (and linear attention) split over tp / G GPUs and runs
    it for its own requests; the MoE stays over tp. A pass reads G copies of the attention
    and waits for the group with the most requests, whose GPUs read their KV cache and
    recurrent state; the EAGLE3 head drafts within its group (draft_tp_context). Qwen3-Coder-
    Next over 4 GPUs in 4 groups (its cache split evenly in the shipped profile)."""
    from treetune.perfmodel.cost import CostModel
    from treetune.perfmodel.profile import with_attention_dp

    profile = load_profile("qwen3-coder-next-h200")
    t, c = profile.target, profile.calibration
    grouped = with_attention_dp(profile, 4)
    one, four = CostModel(profile), CostModel(grouped)
    data = profile.dataset("terminal-bench")
    bandwidth = 4 * profile.hardware.bandwidth_tb_s * 1e12
    copies_s = 3 * 1.541e9 * t.weight_bytes / (bandwidth * c.weight_bandwidth_eff)
    whole = t.kv_bytes(data.context_tokens) + 2 * t.state_bytes_per_request
    per_gpu_s = whole / (bandwidth / 4 * c.kv_bandwidth_eff)  # one request, one GPU

    def extra(batch):
        return four.target_pass(batch, 1, data) - one.target_pass(batch, 1, data)

    # Four groups of eight read what four GPUs read of 32 requests split evenly.
    assert extra(32) == pytest.approx(copies_s)
    # One request: one GPU reads its whole cache and state, where four read a quarter.
    assert extra(1) == pytest.approx(copies_s + 0.75 * per_gpu_s)
    # Five: the busiest group has two (the least loaded is given the next), not 5 / 4.
    assert extra(5) == pytest.approx(copies_s + (2 - 1.25) * per_gpu_s)
    # The head drafts the busiest group's requests on one GPU, no all-reduce.
    context = data.context_tokens
    assert four.draft_pass(5 * 3, 5, context, extend=True) == pytest.approx(
        CostModel(profile, 1).draft_pass(2 * 3, 2, context, extend=True))
    assert four.draft_pass(5, 5, context) > one.draft_pass(5, 5, context)
    with pytest.raises(TreetuneError, match=r"3 data-parallel attention groups "
                       r"\(server.attention_dp\) do not split tp 4 evenly"):
        CostModel(with_attention_dp(profile, 3))


def test_data_parallel_attention_keeps_one_mla_latent_per_request_not_one_per_gpu():
    """DeepSeek-V3's latent is whole on every GPU of a tensor-parallel server: with 8
    attention groups of one GPU each holds its own requests' only, so 512 requests of 4k
    tokens fit on 8 x H200 where they did not, and the pass reads an eighth of the cache
    it did; each GPU holds the whole attention (10.49B fp8 of it split over tp)."""
    from treetune.perfmodel.cost import CostModel
    from treetune.perfmodel.profile import with_attention_dp

    facts = model_facts(fixture("deepseek-ai/DeepSeek-V3"))
    split = 1536 + 1536 * 128 * 192 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    assert facts.attention_params == 61 * split and facts.attention_unquantized == 0
    prior = auto_prior(facts, None, gpu_facts("H200"), 8, attention_dp=8)
    assert prior.server.attention_dp == 8 and prior.target.attention_params_b == 61 * split / 1e9
    tp = with_attention_dp(prior, 1)
    assert not check_memory(tp, BASELINE, 512).fits and check_memory(prior, BASELINE, 512).fits
    held = check_memory(prior, BASELINE, 64).required_gb - check_memory(
        tp, BASELINE, 64).required_gb
    cache = 64 * tp.target.kv_bytes(tp.server.reserve_context_tokens) / 1e9
    copies = (61 * split + prior.target.lm_head_params) * 7 / 8 / 1e9  # and the embedding
    assert held == pytest.approx(copies - cache * 7 / 8)
    data = next(iter(prior.datasets.values()))
    grouped = dataclasses.replace(data, context_tokens=32768.0)
    assert CostModel(prior).target_pass(64, 1, grouped) < CostModel(tp).target_pass(
        64, 1, grouped)
    assert prior.target.attention_extra_bytes(8) == pytest.approx(7 * 61 * split)  # fp8


def test_attention_a_checkpoint_keeps_unquantized_is_copied_at_its_width(tmp_path):
    """Each attention group's copy of attention a checkpoint leaves out of its fp8 is bf16."""
    config = json.loads((Path(fixture("deepseek-ai/DeepSeek-V3")) / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"],
                                     "modules_to_not_convert": ["self_attn"]}
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "config.json").write_text(json.dumps(config))
    t = auto_prior(model_facts(str(tmp_path / "kept")), None, gpu_facts("H200"), 8).target
    assert t.attention_unquantized_b == t.attention_params_b > 10
    assert t.attention_extra_bytes(2) == pytest.approx(t.attention_params_b * 1e9 * 2)
    with pytest.raises(FieldError, match=r"attention_params_b, those among"):
        dataclasses.replace(t, attention_unquantized_b=t.attention_params_b * 2)


def test_data_parallel_attention_holds_each_groups_share_of_the_requests_and_a_head_whole():
    """Memory with 4 attention groups over Qwen3-Coder-Next's 4 GPUs, 6 requests (SGLang
    gives each group 6 // 4; treetune counts the busiest, 2): each GPU holds the whole
    attention and embedding, its 2 requests' whole KV cache and state, and the draft head
    whole with its KV for them."""
    from treetune.config import TreeConfig
    from treetune.perfmodel.profile import with_attention_dp

    profile = load_profile("qwen3-coder-next-h200")
    t, d, tree = profile.target, profile.draft, TreeConfig(3, 1, 4)
    one, four = (check_memory(p, tree, 6).required_gb
                 for p in (profile, with_attention_dp(profile, 4)))
    slots = profile.server.reserve_context_tokens + tree.kv_slots_per_round
    kv = t.kv_bytes(slots) + slots * d.kv_bytes_per_token + t.state_bytes_per_request
    extra = (3 / 4 * (t.attention_params_b * 1e9 + t.lm_head_params) * t.weight_bytes
             + 3 / 4 * d.params_m * 1e6 * d.weight_bytes
             + 2 * kv - 6 * kv / 4)
    assert four - one == pytest.approx(extra / 1e9)


def test_an_mtp_layer_s_attention_is_copied_to_each_group_and_reads_its_groups_cache():
    """SGLang builds DeepSeek's NextN layer as a target layer: with 8 attention groups of
    one GPU, each holds its attention whole (171.97M split over tp, fp8) and reads its own
    requests' latent only."""
    from treetune.config import TreeConfig
    from treetune.perfmodel.cost import CostModel
    from treetune.perfmodel.profile import with_attention_dp

    prior = auto_prior(model_facts(fixture("deepseek-ai/DeepSeek-V3")), None,
                       gpu_facts("H200"), 8)
    mtp = prior.method("NEXTN").mtp
    split = 1536 + 1536 * 128 * 192 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    assert mtp.attention_params_m * 1e6 == split
    grouped = with_attention_dp(prior, 8)
    c = prior.calibration
    bandwidth = 8 * prior.hardware.bandwidth_tb_s * 1e12
    copies_s = 7 * split / (bandwidth * c.weight_bandwidth_eff)
    context = 4096.0  # 8 requests: each GPU reads 1 latent of them, not all 8
    latent_s = (8 - 1) * context * mtp.kv_bytes_per_token / (bandwidth / 8 * c.kv_bandwidth_eff)
    tp, dp = (CostModel(p, method="NEXTN") for p in (prior, grouped))
    assert dp.draft_pass(8, 8, context) - tp.draft_pass(8, 8, context) == pytest.approx(
        copies_s - latent_s)
    tree, t = TreeConfig(2, 1, 3), prior.target
    held = (check_memory(grouped, tree, 8, method="NEXTN").required_gb
            - check_memory(prior, tree, 8, method="NEXTN").required_gb)
    slots = prior.server.reserve_context_tokens + tree.kv_slots_per_round
    latents = t.kv_bytes(slots) + slots * mtp.kv_bytes_per_token  # whole on every GPU
    copies = 7 / 8 * (t.attention_params_b * 1e9 + t.lm_head_params + split) * t.weight_bytes
    assert held == pytest.approx((copies - (8 - 1) * latents) / 1e9)
