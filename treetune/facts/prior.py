"""The auto prior: a profile built from what is on disk (the target's and the draft's
config.json) and on the node (its GPU), with every fitted value neutral. It is what the
model search starts from on real servers, and what `treetune prior` prints."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from treetune.datasets import builtin_names
from treetune.errors import TreetuneError
from treetune.facts.gpus import BLACKWELL_GPUS, GpuFacts, detect_gpu, gpu_facts
from treetune.facts.models import (
    DTYPE_BYTES,
    TP_SIZES,
    ModelFacts,
    facts_from_config,
    find_config,
    model_facts,
    read_config,
)
from treetune.perfmodel.prior import NEUTRAL_ACCEPTANCE, neutral_prior
from treetune.perfmodel.profile import (
    MLA,
    MTP,
    Calibration,
    Dataset,
    Draft,
    Hardware,
    Method,
    MoE,
    Profile,
    ServerDefaults,
    SlidingWindow,
    Target,
)

# SGLang's draft method of a target's own MTP layer (--speculative-algorithm NEXTN), and of
# a small model of its own (no hidden states of the target).
MTP_METHOD = "NEXTN"
STANDALONE = "STANDALONE"
# Bytes per KV element SGLang stores a DeepSeek Sparse Attention target's cache at on
# Blackwell when --kv-cache-dtype is auto (fp8_e4m3).
DSA_BLACKWELL_KV_BYTES = 1.0


def auto_prior(target: ModelFacts, draft: ModelFacts | None, gpu: GpuFacts, tp: int,
               datasets: Sequence[str] = (), name: str | None = None,
               algorithm: str = "EAGLE3", attention_dp: int = 1) -> Profile:
    """A profile of `target` + `draft` on `tp` x `gpu`: facts only, every free parameter
    (calibration, per-dataset acceptance and context) at the neutral value the search
    starts from. `datasets` default to the built-in prompt sets. `draft` is the profile's
    draft head, or with `algorithm` STANDALONE its STANDALONE method (priced alike: its
    own weights and KV cache). A target with MTP layers also gets the NEXTN method (its
    first MTP layer as the draft); without `draft`, that is the profile's only method.
    `attention_dp`: the servers' data-parallel attention groups."""
    moe = target.moe
    drafted = None if draft is None else Draft(
        name=draft.name, params_m=draft.total_params / 1e6,
        weight_bytes=draft.weight_bytes, kv_bytes_per_token=draft.kv_bytes_per_token,
        layers=draft.layers, kv_heads=1 if draft.mla else draft.kv_heads,
        fc_params_m=draft.fc_params / 1e6,
        resident_params_m=(0.0 if draft.resident_params in (0, draft.total_params)
                           else draft.resident_params / 1e6))
    standalone = algorithm == STANDALONE and drafted is not None
    methods = {STANDALONE: Method("standalone", {"neutral": NEUTRAL_ACCEPTANCE},
                                  draft=drafted)} if standalone else {}
    drafts = f"with {draft.name} " if draft is not None else "with its MTP layer (NEXTN) "
    sources = (f"{target.config_path} and {draft.config_path}" if draft is not None
               else target.config_path)
    profile = Profile(
        name=name or f"auto-{_slug(target.name)}-{gpu.name.lower()}",
        description=(
            f"Auto prior: {target.name} {drafts}on {tp} x {gpu.name}. Model facts "
            f"from {sources}; GPU facts from treetune's "
            "GPU table (treetune/facts/gpus.yaml). Every fitted value (calibration, "
            "per-dataset acceptance and context length) is neutral: the search learns them."),
        hardware=Hardware(gpu=gpu.name, gpus=tp, memory_gb=gpu.memory_gb,
                          bandwidth_tb_s=gpu.bandwidth_tb_s,
                          peak_tflops=gpu.peak_tflops(target.weight_bytes),
                          interconnect_gb_s=gpu.interconnect_gb_s),
        target=Target(
            name=target.name, total_params_b=target.total_params / 1e9,
            active_params_b=target.active_params / 1e9, layers=target.layers,
            hidden_size=target.hidden_size, kv_bytes_per_token=target.kv_bytes_per_token,
            weight_bytes=target.weight_bytes,
            unquantized_params_b=target.unquantized_params / 1e9,
            unquantized_bytes=DTYPE_BYTES[target.dtype],
            state_bytes_per_request=target.state_bytes_per_request,
            vocab_size=target.vocab_size, attention_layers=target.attention_layers,
            kv_heads=0 if target.mla else target.kv_heads,
            replicated_params_b=target.replicated_params / 1e9,
            replicated_unquantized_b=target.replicated_unquantized / 1e9,
            attention_params_b=target.attention_params / 1e9,
            attention_unquantized_b=target.attention_unquantized / 1e9,
            mla=_mla(target),
            sliding_window=(SlidingWindow(window=target.window, layers=target.window_layers)
                            if target.window_layers else None),
            moe=None if moe is None else MoE(
                experts=moe.experts, experts_per_token=moe.experts_per_token,
                expert_params_m=moe.expert_params / 1e6, layers=moe.layers,
                shared_experts=moe.shared_experts)),
        draft=None if standalone else drafted,
        # A placeholder: neutral_prior below gives every dataset its neutral shape.
        datasets={"neutral": Dataset(acceptance=NEUTRAL_ACCEPTANCE)},
        methods={**methods, **_mtp_method(target)},
        calibration=Calibration(),
        server=ServerDefaults(tp=tp, attention_dp=attention_dp),
    )
    return neutral_prior(profile, list(datasets) or builtin_names())


def _mtp_method(target: ModelFacts) -> dict[str, Method]:
    """NEXTN, when the target has an MTP layer: that layer drafts, scoring with the
    target's head (acceptance neutral, as neutral_prior sets it)."""
    if not target.mtp_layers:
        return {}
    mtp = MTP(dense_params_m=target.mtp_dense_params / 1e6,
              replicated_params_m=target.mtp_replicated_params / 1e6,
              replicated_unquantized_m=target.mtp_replicated_unquantized / 1e6,
              unquantized=target.mtp_unquantized,
              attention_params_m=target.mtp_attention_params / 1e6,
              kv_bytes_per_token=target.mtp_kv_bytes_per_token,
              routed_experts=target.mtp_moe)
    return {MTP_METHOD: Method("mtp", {"neutral": NEUTRAL_ACCEPTANCE}, mtp=mtp)}


def _mla(target: ModelFacts) -> MLA | None:
    """The target's latent cache, at the bytes per element its KV bytes were counted in."""
    if not target.kv_lora_rank:
        return None
    elements = target.attention_layers * (target.kv_lora_rank + target.rope_dim)
    return MLA(kv_lora_rank=target.kv_lora_rank, rope_dim=target.rope_dim,
               bytes_per_element=target.kv_bytes_per_token / elements)


def pair_problem(model: str, target: ModelFacts, draft: str, head: ModelFacts,
                 algorithm: str = "EAGLE3") -> str:
    """Why SGLang cannot serve `draft` as the draft of `model` by `algorithm` ("" when it
    can): a target that is itself an EAGLE3 head, an EAGLE3 head under a plain
    architecture, a plain model given as an EAGLE3 head, an EAGLE3 head drafted by EAGLE
    or given as a STANDALONE draft, a STANDALONE draft of another vocabulary size, or an
    EAGLE3 head trained for a target of another width (its first layer takes three of the
    target's hidden states)."""
    if target.eagle3:
        return (f"'{model}' ({target.config_path}) is an EAGLE3 draft head, not a target "
                "model: give it as the draft")
    if head.eagle3 and not head.eagle3_class:
        # SGLang 0.5.x picks the model class by the architecture's name and remaps only
        # MTP classes for drafts: such a head loads as a plain model and fails as the
        # draft worker sets up (its hot_token_id, its weights' names).
        return (f"draft '{draft}' ({head.config_path}) is an EAGLE3 head (its config names "
                f"draft_vocab_size) under the plain architecture {head.architecture}, which "
                "SGLang loads as a plain model, and then fails to start. Give a copy whose "
                "config.json names an EAGLE3 class (architectures: "
                "[\"LlamaForCausalLMEagle3\"], as the re-uploads SGLang's docs use, such as "
                "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B, do)")
    if algorithm == "EAGLE3" and not head.eagle3:
        # SGLang 0.5.23 loads the whole model as the draft, then fails in the draft
        # worker's set-up (no set_embed or hot_token_id on a plain model's class).
        return (f"draft '{draft}' ({head.config_path}) is a plain model ({head.architecture})"
                ", not an EAGLE3 draft head (an Eagle3 architecture such as "
                "LlamaForCausalLMEagle3, trained on the target's hidden states): SGLang "
                "loads both models and then fails to start. Give the target's EAGLE3 head, "
                "or draft with this model as STANDALONE (a study's algorithm: STANDALONE, "
                "--algorithm STANDALONE)")
    if algorithm == "EAGLE" and head.eagle3:
        # SGLang 0.5.23 starts, but only EAGLE3 has the target capture the three hidden
        # states the head's fc projection takes: the head then skips it, and drafts from
        # what it was never trained on (llama_eagle3.py), accepting little.
        return (f"draft '{draft}' ({head.config_path}) is an EAGLE3 draft head "
                f"({head.architecture}): drafted by EAGLE, the target does not hand it the "
                "three hidden states it was trained on, and SGLang runs it without the "
                "projection of them, so its acceptance is not the head's. Draft by EAGLE3 "
                "(a study's algorithm: EAGLE3, --algorithm EAGLE3)")
    if algorithm == STANDALONE and not head.eagle3 and head.vocab_size != target.vocab_size:
        # SGLang 0.5.23's STANDALONE worker compares the two vocabularies once both models
        # are loaded (standalone_worker_v2.py, _validate_vocab_compatibility).
        return (f"draft '{draft}' ({head.config_path}) has a vocabulary of {head.vocab_size} "
                f"tokens and '{model}' of {target.vocab_size}: SGLang's STANDALONE drafting "
                "needs the very same vocabulary, and fails to start once both models are "
                "loaded. Give a draft of the target's own tokenizer and vocabulary size")
    if algorithm == STANDALONE and head.eagle3:
        # SGLang 0.5.23 loads it as the draft model, gives it no hidden states of the
        # target, and fails in its forward while capturing CUDA graphs.
        instead = ("Draft with this head as EAGLE3, or give" if head.target_hidden_size
                   == target.hidden_size else "Give")
        return (f"draft '{draft}' ({head.config_path}) is an EAGLE3 draft head "
                f"({head.architecture}), not a standalone model: STANDALONE runs the draft "
                "alone, without the target's hidden states, embedding and token map that "
                f"the head needs, so SGLang loads both models and then fails to start. "
                f"{instead} STANDALONE a small plain model of the target's tokenizer as its "
                "draft")
    if head.eagle3 and head.target_hidden_size != target.hidden_size:
        return (f"draft '{draft}' ({head.config_path}) is an EAGLE3 head for a target of "
                f"hidden size {head.target_hidden_size}, but '{model}' has hidden size "
                f"{target.hidden_size}: give the draft head trained for this target")
    return ""


def mtp_problem(model: str, target: ModelFacts) -> str:
    """Why NEXTN cannot draft for `model` ("" when it can): it drafts with the target's own
    MTP layer, and SGLang fails to start a target whose config.json names none (no draft
    path to load, or a layer not in the checkpoint)."""
    if target.mtp_layers:
        return ""
    return (f"'{model}' ({target.config_path}) names no multi-token-prediction layer "
            "(num_nextn_predict_layers, mtp_num_hidden_layers), which NEXTN drafts with: "
            "give its draft model and another algorithm (EAGLE3)")


def vocabulary_problem(model: str, target: ModelFacts, draft: str, head: ModelFacts) -> str:
    """Why the auto prior will not take `draft` for `model` ("" when it will): an EAGLE3
    head that names a target vocabulary other than `model`'s was trained for another
    tokenizer, so its acceptance is not the one the prior assumes. SGLang serves the pair
    (the head takes the target's embedding), so the study runs, without the prior."""
    if head.eagle3 and head.target_vocab_size not in (0, target.vocab_size):
        return (f"draft '{draft}' ({head.config_path}) is an EAGLE3 head for a target of "
                f"vocabulary {head.target_vocab_size}, but '{model}' has vocabulary "
                f"{target.vocab_size}: give the draft head trained for this target")
    return ""


def build_prior(model: str, draft: str | None, tp: int = 1, gpu: str | None = None,
                env: Mapping[str, str] | None = None, kv_cache_bytes: float | None = None,
                datasets: Sequence[str] = (), name: str | None = None,
                algorithm: str = "EAGLE3", attention_dp: int = 1) -> Profile:
    """The auto prior of `model` + `draft` on `tp` GPUs: config.json files from local
    directories or the local Hugging Face cache, the GPU named by `gpu` or else the one the
    node's GPU tool (nvidia-smi, amd-smi, rocm-smi) shows this process; `algorithm`: the
    draft method `draft` runs by; `attention_dp`: the attention's data-parallel groups (its
    heads split over tp / that); NEXTN takes no draft (the target's MTP layer drafts).
    Raises TreetuneError saying what is missing."""
    path = find_config(model, env)
    config = read_config(path)  # once: a DSA target on Blackwell is counted again below
    target_facts = facts_from_config(config, model, path, kv_cache_bytes)
    draft_facts = None
    if algorithm == MTP_METHOD:
        if problem := mtp_problem(model, target_facts):
            raise TreetuneError(problem)
    elif draft is None:
        raise TreetuneError(f"the auto prior of {algorithm} needs its draft model's "
                            "config.json, and none is given (--draft)")
    else:
        draft_facts = model_facts(draft, env, kv_cache_bytes)
        if problem := (pair_problem(model, target_facts, draft, draft_facts, algorithm)
                       or vocabulary_problem(model, target_facts, draft, draft_facts)):
            raise TreetuneError(problem)
    if refusal := target_facts.tp_refusal(model, tp, attention_dp):
        raise TreetuneError(f"--tp {tp}: {refusal}")
    if draft_facts is not None and (problem := draft_facts.tp_problem(tp)):
        # The draft runs on the target's GPUs with the target's tp, its attention split
        # over all of them whatever the data-parallel attention (LlamaAttention's asserts).
        fits = [t for t in TP_SIZES if not draft_facts.tp_problem(t)
                and not target_facts.tp_problem(t)]
        raise TreetuneError(f"--tp {tp}: SGLang cannot split the draft '{draft}' over {tp} "
                            f"GPUs: {problem} ({draft_facts.config_path}); tp sizes that fit "
                            f"both models: {', '.join(map(str, fits)) or 'none up to 16'}")
    gpu_entry = gpu_facts(gpu, "--gpu") if gpu else detect_gpu(env)
    if kv_cache_bytes is None and target_facts.sparse_index and gpu_entry.name in BLACKWELL_GPUS:
        # --kv-cache-dtype auto: SGLang stores a DeepSeek Sparse Attention target's cache in
        # fp8 on Blackwell, bf16 below it (server_args' _set_default_nsa_kv_cache_dtype).
        target_facts = facts_from_config(config, model, path, DSA_BLACKWELL_KV_BYTES)
    try:
        return auto_prior(target_facts, draft_facts, gpu_entry, tp, datasets, name, algorithm,
                          attention_dp)
    except ValueError as exc:  # a count no profile can hold (FieldError among them)
        read = " and ".join(str(f.config_path) for f in (target_facts, draft_facts) if f)
        raise TreetuneError(f"the facts read from {read} make no profile ({exc}): check "
                            "those config.json files, or write the profile by hand and give "
                            "it with --prior") from None


def _slug(name: str) -> str:
    """A model's short name: its last path part ("Qwen/Qwen3-8B": qwen3-8b), its folder's
    when the path is the config.json itself."""
    parts = [p for p in name.split("/") if p]
    if len(parts) > 1 and parts[-1] == "config.json":
        parts.pop()
    return re.sub(r"[^a-z0-9.]+", "-", (parts or ["model"])[-1].lower()).strip("-") or "model"
