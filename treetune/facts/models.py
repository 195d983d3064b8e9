"""Model facts from a Hugging Face `config.json`: parameter counts, weight bytes, KV bytes
per token, layer kinds, experts. Read from a local directory or from the local Hugging Face
cache; nothing is ever downloaded.

Counting conventions, chosen to match how model cards count (Qwen3-30B-A3B: 30.5B total,
3.3B activated): total and active parameters include the input embedding and the output
head; multi-token-prediction layers (`num_nextn_predict_layers`) are left out, since a
server only runs them for NEXTN speculation (they are counted apart, `mtp_*`); a vision
tower (`text_config` models) is left out, since decoding never runs it. An EAGLE3 draft
head is counted as SGLang loads it: its one decoder layer (attention fed with 2 x hidden),
the fc layer fusing three target hidden states, and its head over the draft vocabulary;
its input embedding is the target's, shared, so it is not counted.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treetune.errors import ConfigFileError, ConfigNotFoundError
from treetune.yamlio import read_text

DTYPE_BYTES = {"float32": 4.0, "float": 4.0, "float16": 2.0, "half": 2.0, "bfloat16": 2.0,
               "float8_e4m3fn": 1.0, "float8_e5m2": 1.0}
# SGLang keeps the recurrent state of linear-attention (Gated DeltaNet) layers in fp32 by
# default (server arg mamba_ssm_dtype), whatever the weights' dtype.
RECURRENT_STATE_BYTES = 4.0
# Keys that configs of these model types may leave out, at the value transformers then
# takes (its Gemma3TextConfig: vocab_size 262208, tie_word_embeddings True; Gemma2 and
# Gemma 256000; the google/gemma-3-27b-it config.json gives neither).
MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    # Cohere's (Command-R, Command-A, Aya): transformers' configs tie the head by default.
    "cohere": {"tie_word_embeddings": True},
    "cohere2": {"tie_word_embeddings": True},
    "gemma3_text": {"vocab_size": 262208, "tie_word_embeddings": True},
    "gemma3": {"vocab_size": 262208, "tie_word_embeddings": True},
    "gemma2": {"vocab_size": 256000, "tie_word_embeddings": True},
    "gemma": {"vocab_size": 256000, "tie_word_embeddings": True},
}
# Architectures whose `sliding_attention` layers (layer_types) SGLang 0.5.23 caches in its
# hybrid sliding-window pool (configs/model_config.py: SWA_SINK_ARCHS, Gemma 4).
HYBRID_SWA_BY_LAYER_TYPES = frozenset({
    "GptOssForCausalLM", "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM",
    "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"})
# Architectures whose config.json names no MTP layer though their checkpoints carry one,
# which SGLang's NEXTN (and vLLM) then takes as one layer (Qwen3-Next: its weights under
# `mtp.`, no config key).
MTP_LAYERS_UNNAMED = {"Qwen3NextForCausalLM": 1}
# MoE architectures whose MTP layer has a dense MLP of the target's `intermediate_size`, not
# an MoE one (SGLang's Ernie4DecoderLayer with is_mtp).
DENSE_MTP_ARCHITECTURES = frozenset({"Ernie4_5_MoeForCausalLM"})
# SGLang's DeepSeek NextN layer drops a ModelOpt NVFP4 checkpoint's quantization
# (deepseek_nextn.py: "Overriding ... quant config for modelopt_fp4"): the checkpoint keeps
# that layer in bf16, experts included.
BF16_MTP_UNDER_MODELOPT_NVFP4 = frozenset({"DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"})
MODELOPT_NVFP4 = "nvfp4 (modelopt)"
ATTENTION_KINDS = ("full_attention", "attention", "sliding_attention", "chunked_attention")
# The tensor-parallel sizes a refusal offers in its stead.
TP_SIZES = (1, 2, 4, 8, 16)
LINEAR_KINDS = ("linear_attention", "mamba", "mamba2", "recurrent", "conv")


@dataclass(frozen=True)
class MoEFacts:
    experts: int  # routed experts per MoE layer
    experts_per_token: int
    expert_params: int  # one routed expert of one layer
    layers: int  # layers whose MLP is a mixture of experts
    shared_experts: int = 0


# The targets whose attention layers SGLang 0.5.23 splits over the attention's tensor-
# parallel group under data-parallel attention (their heads asserted against attn_tp_size,
# tp / the attention's data-parallel size: srt/models/qwen3.py, qwen3_moe.py, qwen3_next.py,
# qwen3_5.py, qwen2_moe.py, deepseek_v2.py, glm4_moe.py, gpt_oss.py, llama4.py,
# minimax_m2.py); the others' assert their heads against the whole tp.
ATTENTION_GROUP_ARCHITECTURES = frozenset({
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    "Qwen2MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM", "Glm4MoeForCausalLM", "GptOssForCausalLM", "Llama4ForCausalLM",
    "Llama4ForConditionalGeneration", "MiniMaxM2ForCausalLM",
})


@dataclass(frozen=True)
class ModelFacts:
    """What a model's config.json says about its size and its KV cache."""

    name: str
    config_path: str
    architecture: str
    total_params: int
    active_params: int  # read (and multiplied) for one token
    layers: int
    attention_layers: int  # layers that hold a KV cache
    linear_layers: int  # linear-attention / recurrent layers: a fixed-size state instead
    hidden_size: int
    vocab_size: int  # of the output head (the draft vocabulary for an EAGLE3 head)
    dtype: str
    weight_bytes: float  # per parameter of the bulk of the weights (the quantized layers)
    quantization: str  # "" when the checkpoint is not quantized
    kv_bytes_per_token: float  # K and V (or MLA's latent) of every attention layer
    state_bytes_per_request: float  # recurrent state of the linear-attention layers
    mla: bool
    moe: MoEFacts | None
    eagle3: bool
    target_hidden_size: int = 0  # an EAGLE3 head's: the width of the states it reads
    # An EAGLE3 head's: the vocabulary of the target it was trained on, when its config
    # names one apart from its own draft vocabulary (0: it does not).
    target_vocab_size: int = 0
    # An EAGLE3 head's: its fc over the target's three hidden states (3 x target x hidden).
    fc_params: int = 0
    # An EAGLE3 head's: whether its architecture names an EAGLE3 class SGLang loads it as
    # (an EAGLE3 head's config under a plain architecture, as first published: no).
    eagle3_class: bool = True
    # An EAGLE3 head's: what it holds in GPU memory, when not its parameters (0: they are).
    resident_params: int = 0
    attention_heads: int = 0  # query heads of a full-attention layer (0: not read)
    kv_heads: int = 0  # its key/value heads (MLA: its heads, sharing one latent)
    # MLA's latent and its rotary key, per token and layer (0 without MLA): SGLang keeps the
    # whole latent cache on every tensor-parallel GPU.
    kv_lora_rank: int = 0
    rope_dim: int = 0
    # Attention layers SGLang caches only the last `window` tokens of (its hybrid
    # sliding-window pool: gpt-oss's sliding layers, Llama 4's chunked ones); 0: none.
    window: int = 0
    window_layers: int = 0
    # Of a quantized checkpoint, the parameters left at the config's dtype (`_Unquantized`)
    # but the embedding: each pass reads them all. The embedding (kept too) is priced as
    # the quantized bulk, as a pass reads only a few of its rows, not all of it.
    unquantized_params: int = 0
    # DeepSeek Sparse Attention's indexer (DeepSeek-V3.2, GLM-5: `index_topk` in the
    # config): each query attends to the `index_topk` tokens its indexer picks. SGLang
    # 0.5.23 serves it on its own attention backend, on 64-token pages.
    sparse_index: bool = False
    # Of the parameters every pass reads, those SGLang holds whole on every tensor-parallel
    # GPU (`_replicated_params`), and of them those a quantized checkpoint keeps at its
    # dtype (among `unquantized_params`).
    replicated_params: int = 0
    replicated_unquantized: int = 0
    # Of the parameters every pass reads, the attention's and linear attention's that
    # tensor parallelism splits over the GPUs (all layers; the replicated part aside), and
    # of them those a quantized checkpoint keeps at its dtype: what each data-parallel
    # attention group holds a copy of.
    attention_params: int = 0
    attention_unquantized: int = 0
    # Its multi-token-prediction layers (`num_nextn_predict_layers`, Qwen3.5's
    # `mtp_num_hidden_layers`; 0: none named), which SGLang's NEXTN drafts with, and one
    # such layer's parameters every draft pass reads (attention, the projection fusing the
    # embedding and the hidden state, norms, router and shared experts, or a dense MLP; its
    # routed experts are the target's shape, in `moe`) and its KV bytes per token.
    # mtp_moe: its MLP is an MoE layer of the target's shape (False: a dense one).
    mtp_layers: int = 0
    mtp_dense_params: int = 0
    mtp_replicated_params: int = 0  # of them, those SGLang holds whole on every GPU
    mtp_kv_bytes_per_token: float = 0.0
    mtp_moe: bool = False
    # Of mtp_replicated_params, the ones a quantized checkpoint keeps at its dtype (the
    # fusing projection, the router, and its down-projections where its attention is kept;
    # DSA's weights_proj always); and whether SGLang keeps the whole layer so (a ModelOpt
    # NVFP4 DeepSeek's NextN layer).
    mtp_replicated_unquantized: int = 0
    mtp_unquantized: bool = False
    mtp_attention_params: int = 0  # of mtp_dense_params, the attention tp splits

    def tp_problem(self, tp: int) -> str:
        """Why SGLang cannot split this model's attention over `tp` GPUs ("" when it can):
        each GPU takes a whole share of the query heads, and of the KV heads unless there
        are fewer of them than GPUs, when each is copied to a whole number of GPUs (the
        asserts of SGLang's attention layers, e.g. `Qwen3Attention`)."""
        heads, kv = self.attention_heads, self.kv_heads
        if heads and heads % tp:
            return f"its {heads} attention heads do not split evenly over {tp} GPUs"
        if kv and not self.mla and (kv % tp if kv >= tp else tp % kv):
            return (f"its {kv} KV heads neither split evenly over {tp} GPUs nor copy evenly "
                    "to them")
        return ""

    def tp_refusal(self, model: str, tp: int, attention_dp: int = 1) -> str:
        """Why `model` (these facts') cannot be served on `tp` GPUs, with the sizes that fit;
        "" when it can. With `attention_dp` data-parallel attention groups, the attention of
        the architectures in ATTENTION_GROUP_ARCHITECTURES splits over tp / attention_dp
        GPUs (SGLang's attn_tp_size); every other's (Llama's, Qwen2's, Mixtral's) still
        over tp."""
        grouped = (attention_dp > 1 and tp % attention_dp == 0
                   and self.architecture in ATTENTION_GROUP_ARCHITECTURES)
        problem = self.tp_problem(tp // attention_dp if grouped else tp)
        if not problem:
            return ""
        fits = [t for t in TP_SIZES if not self.tp_problem(t)]
        if grouped:
            fits = [t for t in fits if t <= tp]
            return (f"SGLang cannot serve '{model}' on {tp} GPUs in {attention_dp} "
                    f"data-parallel attention groups of {tp // attention_dp}: {problem} "
                    f"({self.config_path}); attention group sizes (tp / attention dp) that "
                    f"fit: {', '.join(map(str, fits)) or 'none'}")
        return (f"SGLang cannot serve '{model}' on {tp} GPUs: {problem} ({self.config_path});"
                f" tp sizes that fit: {', '.join(map(str, fits)) or 'none up to 16'}")


# ---- where config.json is ---------------------------------------------------------------

def hub_cache(env: Mapping[str, str] | None = None) -> Path:
    """The local Hugging Face hub cache, as huggingface_hub itself (and so the server)
    resolves it: HF_HUB_CACHE (or the older HUGGINGFACE_HUB_CACHE), else HF_HOME/hub,
    else $XDG_CACHE_HOME/huggingface/hub or ~/.cache/huggingface/hub. One: a copy in a
    cache the server does not read is not the model it loads."""
    env = os.environ if env is None else env
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else (
        Path(env.get("HOME") or Path.home()).expanduser() / ".cache")
    return xdg / "huggingface" / "hub"


def find_config(model: str, env: Mapping[str, str] | None = None) -> Path:
    """The config.json of `model`: a directory holding one, a config.json path, or a hub
    name ("org/name") already in the local Hugging Face cache. Never downloads; when nothing
    is found the error says where it looked."""
    looked: list[str] = []
    path = Path(model).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path / "config.json"
        looked.append(str(path / "config.json"))
    parts = model.strip("/").split("/")
    # A hub name: a server started with it downloads the model (a folder here is no name).
    hub = (len(parts) == 2 and not path.is_absolute() and not model.startswith(".")
           and not path.is_dir())
    if hub:
        folder = hub_cache(env) / ("models--" + "--".join(parts))
        found = _cached_config(folder)
        if found is not None:
            return found
        looked.append(str(folder / "snapshots" / "*" / "config.json"))
    elif not looked:
        looked.append(str(path / "config.json"))
    hint = (f"; put it in a local cache first (e.g. `hf download {model} config.json`) or "
            "pass the model's local directory" if hub else "")
    raise ConfigNotFoundError(f"no config.json for '{model}': looked in {', '.join(looked)}"
                              f"{hint}", fetchable=hub)


def _cached_config(repo: Path) -> Path | None:
    """The snapshot `refs/main` points to, else the newest snapshot holding a config.json
    (a cache filled by revision has no refs/main)."""
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip() / "config.json"
        if candidate.is_file():
            return candidate
    configs = [p / "config.json" for p in snapshots.iterdir() if (p / "config.json").is_file()]
    return max(configs, key=lambda p: p.stat().st_mtime) if configs else None


def read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise ConfigFileError(path, f"not valid JSON (line {exc.lineno}): {exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(path, "a model config must be a JSON object")
    return data


def model_facts(model: str, env: Mapping[str, str] | None = None,
                kv_cache_bytes: float | None = None) -> ModelFacts:
    """The facts of `model` (see find_config for where it is looked up). `kv_cache_bytes`:
    bytes per KV element when the server stores the cache in another dtype than the
    model's (SGLang's --kv-cache-dtype)."""
    path = find_config(model, env)
    return facts_from_config(read_config(path), model, path, kv_cache_bytes)


# ---- counting ---------------------------------------------------------------------------

# Keys no model holds 0 of (a profile of them divides by them), and keys whose size is
# walked one by one (a typo of 1e9 layers ran for minutes).
_POSITIVE = frozenset({"hidden_size", "d_model", "num_hidden_layers", "n_layer", "num_layers",
                       "num_attention_heads", "num_key_value_heads", "vocab_size",
                       "draft_vocab_size", "head_dim"})
_MOST = {"num_hidden_layers": 4096, "n_layer": 4096, "num_layers": 4096}


class _Config:
    """A config.json with typed access; a missing or wrong key is an error naming it."""

    def __init__(self, data: Mapping[str, Any], path: Path) -> None:
        self.data, self.path = data, path

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def int(self, *keys: str, default: int | None = None) -> int:
        for key in keys:
            value = self.data.get(key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ConfigFileError(self.path, f"expected a non-negative integer, got "
                                          f"{value!r}", key)
                if value == 0 and key in _POSITIVE:
                    raise ConfigFileError(self.path, "expected a positive integer, got 0", key)
                if value > _MOST.get(key, value):
                    raise ConfigFileError(self.path, f"{value} is more than any model holds "
                                          f"(at most {_MOST[key]} here)", key)
                return value
        if default is None:
            raise ConfigFileError(self.path, "missing: treetune needs it to count the model",
                                  keys[0])
        return default


def facts_from_config(data: Mapping[str, Any], name: str, path: Path,
                      kv_cache_bytes: float | None = None) -> ModelFacts:
    """Count a model from its parsed config.json (`path` names it in errors)."""
    try:
        return _count(data, name, path, kv_cache_bytes)
    except (TypeError, ValueError, ZeroDivisionError, AttributeError, KeyError) as exc:
        # A config of a shape the counting does not know (nulls, strings for numbers).
        raise ConfigFileError(path, f"cannot count this model ({type(exc).__name__}: {exc}); "
                              "write the profile by hand and give it with --prior") from None


def _count(data: Mapping[str, Any], name: str, path: Path,
           kv_cache_bytes: float | None) -> ModelFacts:
    merged = dict(data)
    # Multimodal configs nest the language model; EAGLE3 heads in the `speculators` format
    # nest their decoder layer. The nested keys win (the decoder's sizes), but for the
    # architecture: SGLang picks the model class by the outer one.
    for nested in ("text_config", "transformer_layer_config"):
        if isinstance(data.get(nested), dict):
            merged = {**merged, **data[nested]}
    c = _Config(merged, path)
    architectures = data.get("architectures") or c.get("architectures", []) or []
    architecture = str(architectures[0]) if architectures else str(c.get("model_type", "?"))
    eagle3 = (any("eagle3" in str(a).lower() for a in architectures)
              or "draft_vocab_size" in merged or c.get("speculators_model_type") == "eagle3")
    dtype = str(c.get("torch_dtype", c.get("dtype", "bfloat16"))).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ConfigFileError(path, f"unknown dtype '{dtype}'", "torch_dtype")
    dtype_bytes = DTYPE_BYTES[dtype]
    quant = c.get("quantization_config") or _modelopt_sidecar(path)
    weight_bytes, quantization = _weight_bytes(quant, dtype_bytes, path)
    kv_bytes = kv_cache_bytes or dtype_bytes
    if eagle3:
        return _eagle3(c, name, path, architecture, dtype, weight_bytes, quantization, kv_bytes)
    kept = _Unquantized.of(quant if weight_bytes < dtype_bytes else None)
    return _decoder(c, name, path, architecture, dtype, weight_bytes, quantization, kv_bytes,
                    kept)


# Config keys of layouts the counting below would get wrong without a word: each refused,
# so that the search goes without a prior (or with a hand-written one) instead.
UNCOUNTED_LAYOUTS = {
    "hybrid_override_pattern": "Mamba2, MoE and attention layers set by a pattern "
                               "(Nemotron-H)",
    "block_configs": "a block of its own per layer, some without attention (DeciLM, "
                     "Nemotron-NAS)",
    "hybrid_layer_pattern": "sliding and full attention layers with their own KV heads "
                            "(MiMo-V2)",
    "global_head_dim": "full-attention layers with another head size and KV heads than "
                       "its sliding ones (Gemma 4)",
    "zero_expert_num": "two attention blocks and two dense MLPs around one MoE with "
                       "zero-computation experts (LongCat-Flash)",
    "attn_layer_period": "Mamba layers with attention every attn_layer_period-th and "
                         "experts every expert_layer_period-th (Jamba)",
    "altup_num_inputs": "per-layer embeddings, AltUp and KV caches shared across layers "
                        "(Gemma-3n)",
    "ffn_config": "experts nested in ffn_config and attention in attn_config (DBRX)",
}
# Keys that show such a layout when set to something true.
UNCOUNTED_WHEN_SET = {
    "use_mixed_mlp_moe": "MoE layers with a shared MLP of num_shared_expert (Hunyuan)",
    "use_cla": "attention layers sharing one KV cache across cla_share_factor layers "
               "(Hunyuan's cross-layer attention)",
}
# MiniMax's `attn_type_list` with a 0 in it (a list of 1s alone is plain attention).
LIGHTNING_LAYOUT = ("lightning (linear) attention layers among softmax ones (MiniMax-Text-01, "
                    "MiniMax-M1)")
# `mamba_*` keys without a `layer_types` naming Mamba layers.
MAMBA_LAYOUT = ("Mamba mixers beside or between attention layers that layer_types does not "
                "name (Falcon-H1, Bamba)")


def _uncounted_layout(c: _Config) -> tuple[str, str] | None:
    """The key and the layout of a config the counting would get wrong, or None."""
    for key, layout in UNCOUNTED_LAYOUTS.items():
        if c.get(key) is not None:
            return key, layout
    for key, layout in UNCOUNTED_WHEN_SET.items():
        if c.get(key):
            return key, layout
    if 0 in (c.get("attn_type_list") or []):  # MiniMax's: 0 lightning, 1 softmax attention
        return "attn_type_list", LIGHTNING_LAYOUT
    mamba = sorted(key for key in c.data if key.startswith("mamba_"))
    if mamba and not set(c.get("layer_types") or []) & set(LINEAR_KINDS):
        return mamba[0], MAMBA_LAYOUT
    return None


def _decoder(c: _Config, name: str, path: Path, architecture: str, dtype: str,
             weight_bytes: float, quantization: str, kv_bytes: float,
             kept: _Unquantized | None = None) -> ModelFacts:
    if uncounted := _uncounted_layout(c):
        key, layout = uncounted
        raise ConfigFileError(path, f"its layers are {layout}, which treetune cannot count "
                              "yet: write the profile by hand and give it with --prior", key)
    h = c.int("hidden_size", "d_model")
    layers = c.int("num_hidden_layers", "n_layer", "num_layers")
    defaults = MODEL_TYPE_DEFAULTS.get(str(c.get("model_type")), {})
    vocab = c.int("vocab_size", default=defaults.get("vocab_size"))
    kinds = _layer_kinds(c, layers)
    moe = _moe(c, h, layers)
    attention = _attention_params(c, h, h)
    replicated_layer = _replicated_params(c, h)
    linear = _linear_attention_params(c, h) if "linear" in kinds else 0
    # Gated (SwiGLU) MLPs; Llama 4's dense layers have their own, wider size.
    dense_mlp = 3 * h * c.int("intermediate_size_mlp", "intermediate_size", default=0)
    total = active = unquantized = replicated = replicated_kept = 0
    split = split_kept = 0  # the attention tensor parallelism splits, and of it kept
    for i, mixer_type in enumerate(kinds):
        mixer = attention if mixer_type == "attention" else linear
        norms = 2 * h
        own = mixer - (replicated_layer if mixer_type == "attention" else 0)
        split += own
        if mixer_type == "attention":
            replicated += replicated_layer
        if kept is not None:
            whole = kept.layer(i, mixer_type)
            split_kept += own * whole
            unquantized += norms + mixer * whole
            if mixer_type == "attention":
                kept_part = _replicated_kept(c, h, whole)
                replicated_kept += kept_part
                unquantized += 0 if whole else kept_part
        if moe is not None and i in moe.layers:
            total += mixer + norms + moe.router + moe.shared + moe.spec.experts * moe.expert
            active += mixer + norms + moe.router + moe.shared + (
                moe.spec.experts_per_token * moe.expert)
            replicated += moe.router  # a router is whole on every GPU, never quantized
            if kept is not None:
                unquantized += moe.router + moe.shared * kept.layer(i, "shared")
                replicated_kept += moe.router
        else:
            total += mixer + norms + dense_mlp
            active += mixer + norms + dense_mlp
            if kept is not None:
                unquantized += dense_mlp * kept.layer(i, "mlp")
    embed = vocab * h
    tied = c.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))
    head = 0 if tied else vocab * h
    total += embed + head + h
    active += embed + head + h
    if kept is not None:  # the embedding aside (a pass gathers a few of its rows), but
        # for a tied head: the head reads it whole, at the embedding's width
        unquantized += h + (head or embed) * kept.head
    attention_layers = kinds.count("attention")
    mtp_layers = c.int("num_nextn_predict_layers", "mtp_num_hidden_layers",
                       default=MTP_LAYERS_UNNAMED.get(architecture, 0))
    # One MTP layer: a full-attention decoder layer of the target's shape (an MoE layer
    # where the target has experts, but for DENSE_MTP_ARCHITECTURES), fed by eh_proj
    # ([embedding, hidden] -> hidden) after two norms, with a final norm (DeepSeek-V3's,
    # GLM-4's, Qwen3.5's; ERNIE-4.5's has none, h parameters of a billion).
    mtp_moe = bool(mtp_layers) and moe is not None and (
        architecture not in DENSE_MTP_ARCHITECTURES)
    mlp = moe.router + moe.shared if moe is not None and mtp_moe else dense_mlp
    mtp_dense = attention + 2 * h + mlp + 2 * h * h + 3 * h if mtp_layers else 0
    # Of it, held whole on every GPU: eh_proj (a plain Linear), MLA's down-projections and
    # the router.
    router = moe.router if moe is not None and mtp_moe else 0
    mtp_replicated = 2 * h * h + replicated_layer + router if mtp_layers else 0
    mtp_replicated_kept = 0
    if mtp_layers and kept is not None:  # the MTP layer is numbered after the last layer
        mtp_replicated_kept = 2 * h * h + router + _replicated_kept(
            c, h, kept.layer(layers, "attention"))
    return ModelFacts(
        name=name, config_path=str(path), architecture=architecture, total_params=total,
        active_params=active, layers=layers, attention_layers=attention_layers,
        linear_layers=kinds.count("linear"), hidden_size=h, vocab_size=vocab, dtype=dtype,
        weight_bytes=weight_bytes, quantization=quantization,
        kv_bytes_per_token=attention_layers * _layer_kv_bytes(c, h, kv_bytes),
        state_bytes_per_request=(kinds.count("linear") * _recurrent_state_bytes(
            c, DTYPE_BYTES[dtype]) if "linear" in kinds else 0.0),
        mla=_is_mla(c), moe=None if moe is None else moe.spec, eagle3=False,
        attention_heads=c.int("num_attention_heads", default=0),
        kv_heads=c.int("num_key_value_heads", "num_attention_heads", default=0),
        kv_lora_rank=c.int("kv_lora_rank") if _is_mla(c) else 0,
        rope_dim=c.int("qk_rope_head_dim") if _is_mla(c) else 0,
        unquantized_params=unquantized, sparse_index=c.get("index_topk") is not None,
        replicated_params=replicated, replicated_unquantized=replicated_kept,
        attention_params=split, attention_unquantized=split_kept,
        mtp_layers=mtp_layers, mtp_dense_params=mtp_dense,
        mtp_replicated_params=mtp_replicated, mtp_replicated_unquantized=mtp_replicated_kept,
        mtp_unquantized=bool(mtp_layers) and quantization == MODELOPT_NVFP4 and (
            architecture in BF16_MTP_UNDER_MODELOPT_NVFP4),
        mtp_kv_bytes_per_token=_layer_kv_bytes(c, h, kv_bytes) if mtp_layers else 0.0,
        mtp_moe=mtp_moe,
        mtp_attention_params=attention - replicated_layer if mtp_layers else 0,
        **_windowed(c, architecture, layers))


def _eagle3(c: _Config, name: str, path: Path, architecture: str, dtype: str,
            weight_bytes: float, quantization: str, kv_bytes: float) -> ModelFacts:
    h = c.int("hidden_size")
    layers = c.int("num_hidden_layers", default=1)
    draft_vocab = c.int("draft_vocab_size", "vocab_size")
    target_hidden = c.int("target_hidden_size", default=h)
    full_vocab = c.int("vocab_size", default=0)
    # SGLang's LlamaForCausalLMEagle3: its first layer's attention reads [embedding, fused
    # hidden] (2 x h), any further layer's the hidden state alone; Llama 4's heads take
    # the MLP width of its dense layers.
    mlp = 3 * h * c.int("intermediate_size_mlp" if c.get("model_type") == "llama4_text"
                        else "intermediate_size")
    per_layer = _attention_params(c, h, h) + mlp + 2 * h  # two norms: no input norm
    first = _attention_params(c, h, 2 * h) + mlp + 3 * h
    total = first + (layers - 1) * per_layer + 3 * target_hidden * h + draft_vocab * h + h
    # What it holds: SGLang lends an untied head naming no draft vocabulary the target's
    # embedding and lm_head (load_lm_head_from_target, set_embed_and_head); any other head
    # the target's embedding only at the target's width (llama.py's set_embed), which is
    # also a tied head's lm_head. Its own head is in `total`; its embedding is not.
    head_params = draft_vocab * h
    embedding = c.int("vocab_size", default=draft_vocab) * h if target_hidden != h else 0
    if c.get("tie_word_embeddings", False):
        held = total - head_params + embedding
    elif c.get("draft_vocab_size") is None:
        held = total - head_params
    else:
        held = total + embedding
    return ModelFacts(
        name=name, config_path=str(path), architecture=architecture, total_params=total,
        active_params=total, layers=layers, attention_layers=layers, linear_layers=0,
        hidden_size=h, vocab_size=draft_vocab, dtype=dtype, weight_bytes=weight_bytes,
        quantization=quantization, kv_bytes_per_token=layers * _kv_elements(c, h) * kv_bytes,
        state_bytes_per_request=0.0, mla=_is_mla(c), moe=None, eagle3=True,
        attention_heads=c.int("num_attention_heads", default=0),
        kv_heads=c.int("num_key_value_heads", "num_attention_heads", default=0),
        target_hidden_size=target_hidden, fc_params=3 * target_hidden * h,
        target_vocab_size=full_vocab if full_vocab != draft_vocab else 0,
        eagle3_class=_names_eagle3(architecture, c),
        resident_params=held)


def _names_eagle3(architecture: str, c: _Config) -> bool:
    """Whether SGLang loads this config as an EAGLE3 head: it picks the model class by the
    architecture's name alone (an `...Eagle3...` class), or converts a `speculators` one."""
    return "eagle3" in architecture.lower() or c.get("speculators_model_type") == "eagle3"


def _layer_kinds(c: _Config, layers: int) -> list[str]:
    """'attention' or 'linear' per layer. Sliding-window layers count as attention: they
    hold a KV cache too, bounded by the window where SGLang pools them apart (`_windowed`)."""
    types = c.get("layer_types")
    if isinstance(types, list) and types:
        kinds = []
        for i, kind in enumerate(types[:layers]):
            if kind in ATTENTION_KINDS:
                kinds.append("attention")
            elif kind in LINEAR_KINDS:
                kinds.append("linear")
            else:
                raise ConfigFileError(c.path, f"layer kind '{kind}' is not one treetune "
                                      "can count", f"layer_types[{i}]")
        return kinds + ["attention"] * (layers - len(kinds))
    interval = c.int("full_attention_interval", default=0)
    if interval:  # Qwen3-Next: every interval-th layer is full attention, the rest GDN
        return ["attention" if (i + 1) % interval == 0 else "linear" for i in range(layers)]
    return ["attention"] * layers


def _windowed(c: _Config, architecture: str, layers: int) -> dict[str, int]:
    """The window and the layers SGLang keeps only that much KV cache for: the models its
    hybrid sliding-window pool serves (`is_hybrid_swa_model` and `get_hybrid_layer_ids`
    in SGLang 0.5.23's configs/model_config.py). Other models with a window (Gemma 2/3,
    Mistral) get the full-size pool, so their cache counts in full, as it does here."""
    if architecture in HYBRID_SWA_BY_LAYER_TYPES:
        types = c.get("layer_types") or []
        window = c.int("sliding_window", default=0)
        count = sum(layer == "sliding_attention" for layer in types[:layers])
    elif architecture == "Llama4ForConditionalGeneration":  # chunked: 3 of every 4 layers
        window = c.int("attention_chunk_size", default=0)
        count = sum((i + 1) % 4 != 0 for i in range(layers))
    else:
        return {}
    return {"window": window, "window_layers": count} if window and count else {}


def _is_mla(c: _Config) -> bool:
    return c.get("kv_lora_rank") is not None


def _head_dim(c: _Config, h: int) -> int:
    return c.int("head_dim", default=h // c.int("num_attention_heads"))


def _attention_params(c: _Config, h: int, in_dim: int) -> int:
    heads = c.int("num_attention_heads")
    if _is_mla(c):  # DeepSeek-V2/V3 multi-head latent attention
        nope, rope = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim")
        v_dim, kv_rank = c.int("v_head_dim"), c.int("kv_lora_rank")
        q_rank = c.int("q_lora_rank", default=0)
        q = (h * q_rank + q_rank + q_rank * heads * (nope + rope)) if q_rank else (
            h * heads * (nope + rope))
        kv = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
        return q + kv + heads * v_dim * h + _indexer_params(c, h, q_rank or h)
    kv_heads = c.int("num_key_value_heads", default=heads)
    if heads % kv_heads:  # each KV head serves a whole group of query heads
        raise ConfigFileError(c.path, f"{kv_heads} KV heads do not divide the "
                              f"{heads} attention heads (num_attention_heads) into groups",
                              "num_key_value_heads")
    hd = _head_dim(c, h)
    # Qwen3-Next's and Qwen3.5's gated attention projects a sigmoid gate alongside the
    # query (Qwen3.5 says so as attn_output_gate).
    gated = c.get("attn_output_gate", str(c.get("model_type")).startswith(("qwen3_next",
                                                                             "qwen3_5")))
    q_out = heads * hd * (2 if gated else 1)
    params = in_dim * (q_out + 2 * kv_heads * hd) + heads * hd * h
    if c.get("attention_bias", False):
        params += q_out + 2 * kv_heads * hd
    return params + 2 * hd  # q/k norms where present: noise, kept for Qwen3's sake


def _replicated_params(c: _Config, h: int) -> int:
    """Parameters of one attention layer that SGLang holds whole on every tensor-parallel
    GPU (ReplicatedLinear in its deepseek_v2.py): MLA's down-projections of the query (when
    it has a low rank) and of the latent with its rotary key, and DeepSeek Sparse
    Attention's indexer. Other attention splits by heads. (An MoE layer's router is whole
    on every GPU too: counted with the layer.)"""
    if not _is_mla(c):
        return 0
    q_rank = c.int("q_lora_rank", default=0)
    latent = h * (q_rank + c.int("kv_lora_rank") + c.int("qk_rope_head_dim"))
    return latent + _indexer_params(c, h, q_rank or h)


def _replicated_kept(c: _Config, h: int, whole: int) -> int:
    """Of one attention layer's replicated part, what a quantized checkpoint keeps at its
    dtype: all of it where it keeps the layer's attention (`whole`), else DSA's
    weights_proj, which SGLang never quantizes."""
    return _replicated_params(c, h) if whole else _indexer_weights_proj(c, h)


def _indexer_params(c: _Config, h: int, q_in: int) -> int:
    """DeepSeek Sparse Attention's indexer (`index_topk`; 0 without one): its query heads
    from the query's low-rank state, one shared key with a LayerNorm, and a weight per
    head from the hidden state (DeepSeek-V3.2: about 14M a layer)."""
    if c.get("index_topk") is None:
        return 0
    heads, dim = c.int("index_n_heads"), c.int("index_head_dim")
    return q_in * heads * dim + h * dim + 2 * dim + _indexer_weights_proj(c, h)


def _indexer_weights_proj(c: _Config, h: int) -> int:
    """The DSA indexer's per-head weights from the hidden state (0 without an indexer):
    SGLang loads it unquantized whatever the checkpoint's quantization."""
    return h * c.int("index_n_heads") if c.get("index_topk") is not None else 0


def _layer_kv_bytes(c: _Config, h: int, kv_bytes: float) -> float:
    """What one attention layer caches per token: its KV elements at `kv_bytes` each, and
    for DeepSeek Sparse Attention (`index_topk`) its indexer's key, which SGLang caches
    beside the latent whatever the KV dtype (its DSA token pool): `index_head_dim` fp8
    bytes and a 4-byte scale per 128 of them (132 bytes for DeepSeek-V3.2's 128)."""
    if c.get("index_topk") is None:
        return _kv_elements(c, h) * kv_bytes
    dim = c.int("index_head_dim")
    indexer = dim + -(-dim // 128) * 4
    if kv_bytes == 1 and _is_mla(c):
        # An fp8 latent under DSA (SGLang's NSA store on CUDA): the latent in fp8 with a
        # 4-byte scale per 128 of it, its rotary part left at 2 bytes (656 bytes for
        # DeepSeek-V3.2; ROCm stores the plain 576).
        rank = c.int("kv_lora_rank")
        return rank + -(-rank // 128) * 4 + 2 * c.int("qk_rope_head_dim") + indexer
    return _kv_elements(c, h) * kv_bytes + indexer


def _kv_elements(c: _Config, h: int) -> int:
    """KV-cache elements per token of one attention layer: K and V of every KV head, or
    MLA's latent vector and its rotary part (stored once, shared by all heads)."""
    if _is_mla(c):
        return c.int("kv_lora_rank") + c.int("qk_rope_head_dim")
    heads = c.int("num_attention_heads")
    return 2 * c.int("num_key_value_heads", default=heads) * _head_dim(c, h)


def _linear_attention_params(c: _Config, h: int) -> int:
    """A Gated DeltaNet layer (Qwen3-Next): fused q/k/v/z and beta/alpha projections, a
    short causal convolution, per-head decay parameters, a gated norm and the output."""
    key_dim, value_dim, v_heads = _gdn_dims(c)
    conv_dim = 2 * key_dim + value_dim
    return (h * (2 * key_dim + 2 * value_dim) + h * 2 * v_heads
            + conv_dim * c.int("linear_conv_kernel_dim") + 2 * v_heads
            + c.int("linear_value_head_dim") + value_dim * h)


def _gdn_dims(c: _Config) -> tuple[int, int, int]:
    if c.get("linear_num_value_heads") is None:
        raise ConfigFileError(c.path, f"linear-attention layers of model_type "
                              f"'{c.get('model_type')}' are not ones treetune can count "
                              "(it knows Qwen3-Next's Gated DeltaNet)", "layer_types")
    v_heads = c.int("linear_num_value_heads")
    key_dim = c.int("linear_num_key_heads") * c.int("linear_key_head_dim")
    return key_dim, v_heads * c.int("linear_value_head_dim"), v_heads


def _recurrent_state_bytes(c: _Config, dtype_bytes: float) -> float:
    """One request's state in one GDN layer: the per-head k x v state matrix (fp32 in
    SGLang) plus the convolution's last kernel-1 inputs (model dtype)."""
    key_dim, value_dim, v_heads = _gdn_dims(c)
    temporal = v_heads * c.int("linear_key_head_dim") * c.int("linear_value_head_dim")
    conv = (2 * key_dim + value_dim) * (c.int("linear_conv_kernel_dim") - 1)
    return temporal * RECURRENT_STATE_BYTES + conv * dtype_bytes


@dataclass(frozen=True)
class _MoE:
    spec: MoEFacts
    layers: frozenset[int]
    expert: int  # parameters of one routed expert
    router: int
    shared: int  # parameters of all shared experts of one layer (and their gate)


# ERNIE-4.5's MoE (model_type ernie4_5_moe) names its experts by keys of its own, read for
# it alone (Step-3 names `moe_num_experts` too, in another layout); what its config leaves
# out is transformers' Ernie4_5_MoeConfig default, as SGLang loads it (an end index of -1:
# the last layer).
ERNIE_MOE = "ernie4_5_moe"
ERNIE_MOE_DEFAULTS = {"moe_num_experts": 64, "moe_k": 6, "moe_intermediate_size": 1536,
                      "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
                      "moe_layer_end_index": -1, "moe_layer_interval": 1}


def _moe(c: _Config, h: int, layers: int) -> _MoE | None:
    ernie = c.get("model_type") == ERNIE_MOE
    if ernie:
        given = {key: value for key, value in c.data.items() if value is not None}
        c = _Config({**ERNIE_MOE_DEFAULTS, **given}, c.path)
    experts = c.int("num_experts", "n_routed_experts", "num_local_experts",
                    *(["moe_num_experts"] if ernie else []), default=0)
    if not experts:
        _no_unread_experts(c)
        return None
    per_token = c.int("num_experts_per_tok", "num_experts_per_token", "experts_per_token",
                      "moe_topk", *(["moe_k"] if ernie else []))
    expert_dim = c.int("moe_intermediate_size", "intermediate_size")
    expert = 3 * h * expert_dim
    if isinstance(c.get("moe_layer_freq"), list):  # one entry a layer: 1 for MoE
        moe_layers = {i for i, sparse in enumerate(c.get("moe_layer_freq")[:layers]) if sparse}
    elif c.get("first_k_dense_replace") is not None or c.get("moe_layer_freq") is not None:
        # DeepSeek and GLM-4 MoE: the first k layers are dense, then every freq-th is MoE.
        first, freq = c.int("first_k_dense_replace", default=0), c.int("moe_layer_freq",
                                                                         default=1)
        moe_layers = {i for i in range(layers) if i >= first and i % max(freq, 1) == 0}
    elif isinstance(c.get("moe_layers"), list):  # Llama 4: the MoE layers listed
        moe_layers = {int(i) for i in c.get("moe_layers") if 0 <= int(i) < layers}
    elif c.get("interleave_moe_layer_step") is not None:  # Llama 4, without the list
        step = c.int("interleave_moe_layer_step")
        moe_layers = set(range(step - 1, layers, step)) if step > 0 else set()
    elif ernie:  # every interval-th layer from the start index to the end one (inclusive)
        first, step = c.int("moe_layer_start_index"), max(c.int("moe_layer_interval"), 1)
        end = c.get("moe_layer_end_index")
        last = layers - 1 if isinstance(end, int) and end < 0 else min(
            c.int("moe_layer_end_index"), layers - 1)
        moe_layers = {i for i in range(first, last + 1) if (i - first) % step == 0}
    else:  # Qwen MoE: decoder_sparse_step, minus mlp_only_layers
        step = c.int("decoder_sparse_step", default=1)
        dense = set(c.get("mlp_only_layers", []) or [])
        moe_layers = {i for i in range(layers)
                      if i not in dense and step > 0 and (i + 1) % step == 0}
    # Llama 4's MoE layers each run one shared expert of the routed experts' size, which
    # its config does not count.
    llama4 = c.get("model_type") == "llama4_text"
    shared_count = c.int("n_shared_experts", "num_shared_experts",
                         *(["moe_num_shared_experts"] if ernie else []),
                         default=1 if llama4 else 0)
    shared_dim = c.int("shared_expert_intermediate_size", default=0)
    if shared_dim:  # Qwen2-MoE / Qwen3-Next: one shared expert of its own size, gated
        shared_count = shared_count or 1
        shared = shared_count * 3 * h * shared_dim + h
    else:
        shared = shared_count * expert
    # DeepSeek-V3-style routers carry a per-expert score-correction bias as well (ERNIE-4.5's
    # with `moe_use_aux_free`).
    bias = c.get("topk_method") == "noaux_tc" or bool(c.get("moe_use_aux_free"))
    router = h * experts + (experts if bias else 0)
    spec = MoEFacts(experts=experts, experts_per_token=per_token, expert_params=expert,
                    layers=len(moe_layers), shared_experts=shared_count)
    return _MoE(spec, frozenset(moe_layers), expert, router, shared)


def _no_unread_experts(c: _Config) -> None:
    """A config that counts its experts under a key the counting above does not read would
    be counted as a dense model of its dense MLP's width, without a word (ERNIE-4.5-300B-A47B
    came out at 47B in all before its keys were read): refused instead."""
    for key, value in c.data.items():
        counts = value if isinstance(value, list) else [value]
        if key.endswith(("experts", "expert_num")) and any(
                isinstance(n, int) and not isinstance(n, bool) and n > 1 for n in counts):
            raise ConfigFileError(c.path, f"names {value} experts under a key treetune does "
                                  "not read, so it cannot count this MoE yet: write the "
                                  "profile by hand and give it with --prior", key)


# ---- weight bytes -----------------------------------------------------------------------

# The int formats with a scale (and maybe a zero) per group of weights.
GROUPED_INT_METHODS = ("awq", "gptq", "awq_marlin", "gptq_marlin", "auto-round", "autoround")
QUANT_BITS = {"awq": 4, "gptq": 4, "awq_marlin": 4, "gptq_marlin": 4, "auto-round": 4,
              "autoround": 4, "w8a8_int8": 8, "w8a8_fp8": 8, "fbgemm_fp8": 8, "fp8": 8}
# 4-bit formats with a scale per block: MXFP4 (an e8m0 scale per 32 weights), NVFP4 (an
# fp8 scale per 16).
MXFP4_BYTES = (4 + 8 / 32) / 8
NVFP4_BYTES = (4 + 8 / 16) / 8


# A layer's parts, by a module name SGLang gives one of them (of layer {i}): what a
# quantization_config's list of modules left out is matched against.
# Llama 4 names its MLPs `feed_forward`; multimodal checkpoints prefix `language_model.`.
MODULE_NAMES = {
    "attention": ("model.layers.{i}.self_attn.o_proj",),
    "linear": ("model.layers.{i}.linear_attn.out_proj",),
    "mlp": ("model.layers.{i}.mlp.down_proj", "model.layers.{i}.feed_forward.down_proj"),
    "shared": ("model.layers.{i}.mlp.shared_expert.down_proj",
               "model.layers.{i}.mlp.shared_experts.down_proj",
               "model.layers.{i}.feed_forward.shared_expert.down_proj"),
}


@dataclass(frozen=True)
class _Unquantized:
    """What a quantized checkpoint keeps at its config's dtype, as SGLang 0.5.23 loads it:
    the norms and routers always; the head unless the scheme quantizes it (ModelOpt and
    compressed-tensors when they name it, AWQ and GPTQ with `lm_head: true`); mxfp4 every
    layer but the routed experts; and each layer part whose module name the config's list
    of modules left out matches (fp8's `modules_to_not_convert` or `ignored_layers`,
    compressed-tensors' and ModelOpt's `ignore`, ModelOpt's `exclude_modules`, AWQ's
    `modules_to_not_convert`, GPTQ's `dynamic` entries starting '-:')."""

    patterns: tuple[str, ...] = ()
    head: bool = True
    all_but_experts: bool = False

    @classmethod
    def of(cls, quant: Any) -> _Unquantized | None:
        if not isinstance(quant, dict):
            return None
        quant = _flat(quant)
        method = _quant_method(quant)
        listed: list[str] = []
        for key in ("modules_to_not_convert", "ignored_layers", "ignore", "exclude_modules"):
            if isinstance(quant.get(key), list):
                listed += [str(m) for m in quant[key]]
        dynamic = quant.get("dynamic")
        if isinstance(dynamic, dict):
            listed += ["re:" + str(k)[2:] for k in dynamic if str(k).startswith("-:")]
        named_head = any(_matches(m, "lm_head") for m in listed)
        if method == "modelopt":
            head = named_head
        elif method == "compressed-tensors":
            targets = [str(t) for g in (quant.get("config_groups") or {}).values()
                       if isinstance(g, dict) for t in g.get("targets") or ()]
            head = named_head or not any(_matches(t, "lm_head") for t in targets)
        elif method in ("awq", "awq_marlin", "gptq", "gptq_marlin"):
            head = named_head or not quant.get("lm_head", False)
        else:
            head = True
        return cls(tuple(listed), head, all_but_experts=method == "mxfp4")

    def layer(self, i: int, part: str) -> int:
        """1 when part `part` of layer `i` is kept unquantized, else 0."""
        names = [prefix + n.format(i=i) for n in MODULE_NAMES[part]
                 for prefix in ("", "language_model.")]
        return int(self.all_but_experts or any(_matches(p, n) for p in self.patterns
                                               for n in names))


def _matches(pattern: str, name: str) -> bool:
    """Whether a module list's entry names module `name`: 're:' a regular expression (as
    compressed-tensors and GPTQ write them), a glob with '*' (ModelOpt), else a dotted
    part of the name (fp8, AWQ: 'lm_head', 'self_attn', 'model.layers.0.mlp')."""
    if pattern.startswith("re:"):
        try:
            return re.match(pattern[3:], name) is not None
        except re.error:
            return False
    if "*" in pattern or "?" in pattern:  # a module, or any module within it
        return (fnmatch.fnmatchcase(name, pattern)
                or fnmatch.fnmatchcase(name, pattern.rstrip(".") + ".*"))
    return f".{pattern.strip('.')}." in f".{name}."


def _modelopt_sidecar(path: Path) -> dict[str, Any] | None:
    """The quantization of a NVIDIA ModelOpt checkpoint that keeps it beside config.json,
    in hf_quant_config.json (`{"quantization": {"quant_algo": "NVFP4", ...}}`), as SGLang
    reads it; None when there is none."""
    sidecar = path.with_name("hf_quant_config.json")
    if not sidecar.is_file():
        return None
    data = read_config(sidecar)
    section = data.get("quantization", data)
    if not isinstance(section, dict):
        raise ConfigFileError(sidecar, "expected a mapping", "quantization")
    return {**section, "quant_method": "modelopt"}


def _flat(quant: Mapping[str, Any]) -> dict[str, Any]:
    """A quantization_config with ModelOpt's nested form (`quantization: {...}`) lifted to
    its top level."""
    nested = quant.get("quantization")
    return {**quant, **nested} if isinstance(nested, dict) else dict(quant)


def _quant_method(quant: Mapping[str, Any]) -> str:
    """A quantization_config's method, lower-case: a ModelOpt export may name its producer
    or algorithm only (SGLang 0.5.23 takes a config without quant_method for ModelOpt's)."""
    method = str(quant.get("quant_method", "")).lower()
    producer = quant.get("producer")
    nested = quant.get("quantization")
    if not method and (quant.get("quant_algo") or isinstance(nested, dict)
                       or (isinstance(producer, dict) and producer.get("name") == "modelopt")):
        return "modelopt"
    return method


def _grouped(bits: float, group: Any, zero: bool) -> float:
    """Bytes per weight of a group-wise int format (AWQ, GPTQ, compressed-tensors'
    `group` strategy): `bits`, plus a 16-bit scale and, with a zero point, a `bits`-bit
    zero per group of weights (no group: the bits alone)."""
    if isinstance(group, int) and group > 0:
        return bits / 8 + (16 + bits * zero) / (8 * group)
    return bits / 8


def _weight_bytes(quant: Any, dtype_bytes: float, path: Path) -> tuple[float, str]:
    """Bytes per weight of the quantized layers, and the scheme's name. Layers a scheme
    leaves in 16 bits (embeddings, head, routers) are a small share and not told apart."""
    if not quant:
        return dtype_bytes, ""
    if not isinstance(quant, dict):
        raise ConfigFileError(path, "expected a mapping", "quantization_config")
    quant = _flat(quant)
    method = _quant_method(quant)
    if method == "compressed-tensors":
        for group in (quant.get("config_groups") or {}).values():
            weights = (group.get("weights") or {}) if isinstance(group, dict) else {}
            bits = weights.get("num_bits")
            if isinstance(bits, int) and bits > 0:
                number = "fp" if weights.get("type") == "float" else "int"
                nvfp4 = bits == 4 and number == "fp"
                size = NVFP4_BYTES if nvfp4 else _grouped(
                    bits, weights.get("group_size") if weights.get("strategy") == "group"
                    else None, weights.get("symmetric") is False)
                return size, f"{number}{bits} (compressed-tensors)"
        raise ConfigFileError(path, "no config_groups.*.weights.num_bits to read the weight "
                              "size from", "quantization_config")
    if method == "mxfp4":
        return MXFP4_BYTES, "mxfp4"
    if method == "modelopt":
        algo = str(quant.get("quant_algo", "")).upper()
        if algo in ("", "NONE") and not quant.get("quantized_layers"):
            # A ModelOpt export that quantized nothing (NVIDIA's Llama-4-Maverick EAGLE3
            # head: `quant_algo: null`): its weights are the config's dtype.
            return dtype_bytes, ""
        scheme = "modelopt"
        if algo == "MIXED_PRECISION":
            # Per-layer algorithms: the routed experts' (most of an MoE's bytes), else the
            # most layers'. Every quantized layer is priced at that one algorithm.
            layers = quant.get("quantized_layers") or {}
            algos = {str(k): str(v.get("quant_algo", "")).upper() for k, v in layers.items()
                     if isinstance(v, dict)}
            routed = [a for k, a in algos.items() if ".experts" in k]  # not shared_experts
            named = routed or list(algos.values())
            algo = max(named, key=named.count, default=algo)
            scheme = ("modelopt mixed precision, by its routed experts" if routed
                      else "modelopt mixed precision" if named else scheme)
        if "NVFP4" in algo:
            return NVFP4_BYTES, f"nvfp4 ({scheme})"
        if "FP8" in algo:
            return 1.0, f"fp8 ({scheme})"
        raise ConfigFileError(path, f"modelopt quant_algo '{algo}' is not one treetune knows",
                              "quantization_config")
    if method == "bitsandbytes":
        return (0.5, "bnb 4-bit") if quant.get("load_in_4bit") else (1.0, "bnb 8-bit")
    if method in QUANT_BITS:
        if "NVFP4" in str(quant.get("moe_quant_algo", "")).upper():
            # An fp8 checkpoint whose routed experts are NVFP4 (SGLang 0.5.23's hybrid
            # export): most of an MoE's bytes at the experts' width.
            return NVFP4_BYTES, f"nvfp4 experts ({method} mixed precision)"
        bits = float(quant.get("bits") or quant.get("w_bit") or QUANT_BITS[method])
        if method not in GROUPED_INT_METHODS:
            return bits / 8, method
        zero = quant.get("zero_point", quant.get("sym") is False)
        return _grouped(bits, quant.get("group_size") or quant.get("q_group_size"),
                        bool(zero)), method
    raise ConfigFileError(
        path, f"quant_method '{method}' is not one treetune knows ({', '.join(sorted(QUANT_BITS))}"
        ", compressed-tensors, mxfp4, modelopt, bitsandbytes): write the profile by hand and "
        "give it with --prior", "quantization_config")
