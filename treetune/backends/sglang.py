"""SGLang: every fact treetune relies on about it, and the backend that launches it.

Flag names follow the SGLang version a command targets: 0.5.14 split
`--cuda-graph-max-bs` into `--cuda-graph-max-bs-decode` / `--cuda-graph-max-bs-prefill`
(keeping the old name as a deprecated alias until 0.5.22 dropped it).
The emulator speaks the same flags and HTTP API, so it reads them from here too.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from treetune.backends._base import (
    AdaptiveState,
    Deployment,
    Flags,
    LaunchContext,
    LaunchSpec,
    ServerApi,
    parse_version,
    register,
)
from treetune.backends.sglang_adaptive import (
    DP_ATTENTION_REASON,
    GRAPH_FLAGS_ABSENT_IN,
    PHASE_GRAPH_SINCE,
    STATIC_WITH,
    fallback_reason,
    graph_flag_named,
)
from treetune.config import BASELINE, AdaptiveConfig, ServerConfig, TreeConfig
from treetune.errors import FieldError, InvalidTreeError, TreetuneError
from treetune.facts.gpus import BLACKWELL_GPUS
from treetune.perfmodel.profile import DEFAULT_METHOD

if TYPE_CHECKING:
    from treetune.facts.models import ModelFacts
    from treetune.perfmodel import Profile

DEFAULT_SGLANG_VERSION = "0.5.23"
# The algorithms whose draft is SGLang's EAGLE tree, shaped by --speculative-num-steps,
# --speculative-eagle-topk and --speculative-num-draft-tokens (what a study tunes). NEXTN is
# the target's own MTP layer: SGLang resolves it to EAGLE at start-up ("NEXTN shares the
# same implementation of EAGLE") and reports EAGLE in /server_info. STANDALONE runs a
# separate small model through the same worker.
ALGORITHMS = ("EAGLE3", "EAGLE", "NEXTN", "STANDALONE")
# NGRAM has no draft model: it matches the recent tokens in a suffix trie of earlier text
# and verifies the continuations found there. Its knobs are its own (see NGRAM_FLAGS).
NGRAM = "NGRAM"
# NGRAM came in 0.5.3 (PR #11010 renamed the lookahead drafter; 0.5.2's parser refuses it).
NGRAM_SINCE = (0, 5, 3)
KNOWN_ALGORITHMS = (*ALGORITHMS, NGRAM)  # every --speculative-algorithm treetune can serve
ALGORITHM_ALIASES = {"NEXTN": "EAGLE"}  # what SGLang resolves an algorithm to
# The algorithms with no --speculative-draft-model-path: the target's MTP layer, the trie.
DRAFTLESS_ALGORITHMS = ("NEXTN", NGRAM)
TREE_KNOBS = ("--speculative-num-steps", "--speculative-eagle-topk",
              "--speculative-num-draft-tokens")
# NGRAM's flags in SGLang 0.5.23 (server_args.py), with their defaults. _handle_ngram sets
# speculative_eagle_topk to --speculative-ngram-max-bfs-breadth unconditionally (a given
# --speculative-eagle-topk is overwritten), takes --speculative-num-draft-tokens (12 when
# unset) as the verify size, and defaults --speculative-num-steps, which it does not draft
# with, to draft_tokens // breadth. Releases before the adaptive controller named these
# differently (--speculative-ngram-branch-length, --speculative-ngram-{min,max}-match-
# window-size, no --speculative-ngram-max-trie-depth).
NGRAM_BREADTH_FLAG = "--speculative-ngram-max-bfs-breadth"
NGRAM_FLAGS: dict[str, tuple[type, object]] = {
    "--speculative-ngram-min-bfs-breadth": (int, 1),
    NGRAM_BREADTH_FLAG: (int, 10),
    "--speculative-ngram-match-type": (str, "BFS"),
    "--speculative-ngram-max-trie-depth": (int, 18),
    "--speculative-ngram-capacity": (int, 10_000_000),
}
NGRAM_MATCH_TYPES = ("BFS", "PROB")
NGRAM_DEFAULT_DRAFT_TOKENS = 12
# The wheels' srt/server_args.py: 0.5.13's knows only "--cuda-graph-max-bs"; 0.5.14's has
# cuda_graph_max_bs_decode and keeps the old flag as a DeprecatedAliasStoreAction of it.
CUDA_GRAPH_FLAG_SPLIT = PHASE_GRAPH_SINCE  # (0, 5, 14), with every per-phase flag
# `python -m sglang.launch_server --config FILE.yaml` first shipped in SGLang 0.5.3: the 0.5.2
# wheel's srt/server_args.py has no --config, 0.5.3's has it and
# srt/server_args_config_parser.py (sgl-project/sglang PR #10534, "Initial support for input
# config files", Sept 2025). From 0.5.3 to 0.5.23 each key becomes `--{key}` verbatim, so keys
# are the long flag names with dashes; `true` on a store-true flag becomes the bare flag;
# other values are passed as str(value); the file must end in .yaml or .yml; the file's
# arguments go before the command line's, so flags on the command line win.
CONFIG_FILE_SINCE = (0, 5, 3)
# With speculation on and --max-running-requests unset, SGLang caps running requests here.
SPEC_DEFAULT_MAX_RUNNING = 48
NO_PREFIX_CACHE = "--disable-radix-cache"
SGLANG_IMPORT_TIMEOUT_S = 60.0  # importing sglang pulls in torch: seconds, not minutes
EMULATOR_HINT = "or run on the emulator: --profile NAME (see `treetune profiles`)"

# Adaptive steps (domain.md section 7): a store-true flag and a JSON config path.
ADAPTIVE_FLAG = "--speculative-adaptive"
ADAPTIVE_CONFIG_FLAG = "--speculative-adaptive-config"
# /server_info returns the resolved server args: when adaptive mode cannot run, SGLang logs
# a warning and sets speculative_adaptive back to false before it serves static trees.
ADAPTIVE_INFO_KEY = "speculative_adaptive"
INTERNAL_STATES_KEY = "internal_states"
# The current steps per batch-size slot, {"1": 5, "8": 3}, in internal_states[0]. SGLang
# 0.5.23 reports no controller state (its observability PR #23942 closed unmerged): this
# name is the emulator's, and a real server without it reads as steps unknown.
ADAPTIVE_STEPS_KEY = "adaptive_steps_per_slot"


def adaptive_state(info: Mapping[str, Any]) -> AdaptiveState:
    """Whether the server runs adaptive steps, and each slot's current steps (empty when
    the server does not report them)."""
    if info.get(ADAPTIVE_INFO_KEY) is not True:
        return AdaptiveState(False, {})
    state = (info.get(INTERNAL_STATES_KEY) or [{}])[0]
    steps = (state.get(ADAPTIVE_STEPS_KEY) if isinstance(state, Mapping) else None) or {}
    return AdaptiveState(True, {int(k): int(v) for k, v in steps.items()})


# The tree flags of a command and the /server_info keys SGLang reports them resolved by.
RESOLVED_TREE = (("--speculative-num-steps", "speculative_num_steps"),
                 ("--speculative-eagle-topk", "speculative_eagle_topk"),
                 ("--speculative-num-draft-tokens", "speculative_num_draft_tokens"))


def launch_warnings(flags: Flags, info: Mapping[str, Any], log: str) -> list[str]:
    """What the server serves otherwise than its command asked: a tree knob SGLang
    resolved to another value (its /server_info; e.g. a multi-layer EAGLE or a model's own
    override), whose measurements are then of another tree; or adaptive steps asked for
    and static trees served (SGLang only logs why)."""
    names = [name for name, _ in flags]
    if ADAPTIVE_FLAG not in names:
        asked = dict(flags)
        changed = [f"{flag} {info[key]} (asked {asked[flag]})" for flag, key in RESOLVED_TREE
                   if asked.get(flag) is not None and info.get(key) is not None
                   and str(info[key]) != asked[flag]]
        return [f"SGLang serves {', '.join(changed)}, by its /server_info: this launch "
                "measured that tree, not the one it was asked for"] if changed else []
    if adaptive_state(info).active:
        return []
    reason = fallback_reason(log)
    why = (f"SGLang logged: {reason}" if reason else
           f"its /server_info says {ADAPTIVE_INFO_KEY}={info.get(ADAPTIVE_INFO_KEY)!r}")
    return [f"{ADAPTIVE_FLAG} was asked for but the server serves static trees ({why})"]


SGLANG_API = ServerApi(
    health="/health_generate",  # runs a real generation: 200 only once the server can generate
    server_info=("/server_info", "/get_server_info"),  # the second before SGLang 0.5
    flush_cache="/flush_cache",
    metrics="/metrics",  # with --enable-metrics
    completions={"chat": "/v1/chat/completions", "completion": "/v1/completions"},
    generated_tokens="sglang:generation_tokens_total",
    verify_calls="sglang:spec_verify_calls_total",
    running="sglang:num_running_reqs",
    queued="sglang:num_queue_reqs",
    prompt_tokens="sglang:prompt_tokens_total",
    # The wheels' metrics_collector.py: first in 0.5.13.
    verify_calls_hint="SGLang counts them from 0.5.13 on",
    prefix_cache=True,
    # http_server.py (0.5.23) logs this for each /health_generate that times out.
    health_log=("Health check failed",),
    # scheduler.py logs it at each retraction (with the counts after it).
    pool_full_log="KV cache pool is full. Retract requests.",
    info_keys=("version", "attention_backend", "max_running_requests", "speculative_algorithm",
               "speculative_num_steps", "speculative_eagle_topk",
               "speculative_num_draft_tokens", "tp_size", "mem_fraction_static",
               ADAPTIVE_INFO_KEY),
    adaptive_state=adaptive_state,
    launch_warnings=launch_warnings,
)


# Launch flags treetune sets itself, each with where to say what it should be. Given again
# in server_flags (a production command pasted whole), SGLang's parser would keep the later
# value: every "tree" the same server, a port no one polls, GPUs Ray never reserved.
_KNOBS = "the trees of the search space: they are what the study searches"
MANAGED_FLAGS = {
    "--model-path": "the study's model", "--model": "the study's model",
    "--speculative-draft-model-path": "the study's draft",
    "--speculative-draft-model": "the study's draft",
    "--speculative-algorithm": "the study's algorithm or methods",
    "--speculative-num-steps": _KNOBS, "--speculative-eagle-topk": _KNOBS,
    "--speculative-num-draft-tokens": _KNOBS, "--speculative-ngram-max-bfs-breadth": _KNOBS,
    "--tp-size": "the study's tp", "--tp": "the study's tp",
    "--tensor-parallel-size": "the study's tp",
    "--host": "the study's host", "--port": "a free port per server",
    "--max-running-requests": "the largest batch size (a multiple of the data-parallel "
                              "attention groups), so every batch can form",
    "--cuda-graph-max-bs": "the largest batch size (or the least SGLang can capture), under "
                           "the flag the SGLang version knows",
    "--cuda-graph-max-bs-decode": "the largest batch size (or the least SGLang can capture), "
                                  "under the flag the SGLang version knows",
    "--api-key": "from the environment variable named by api_key_env: a secret does "
                 "not belong in a study file",
}
# Flags whose one value a study reads (a list there is refused).
ONE_VALUE_FLAGS = ("--attention-backend", "--mem-fraction-static", "--kv-cache-dtype")


def abbreviates(flag: str, name: str) -> bool:
    """Whether SGLang's parser reads `flag` as its flag `name`: the name itself, or a
    prefix of it (argparse takes an unambiguous abbreviation)."""
    return flag == name or (len(flag) >= 4 and name.startswith(flag))


def managed_flag(flag: str) -> tuple[str, str] | None:
    """The flag treetune sets itself that `flag` would set too (the flag, or one it
    abbreviates), with where a study says its value; None for a flag of the user's own."""
    if flag in MANAGED_FLAGS:
        return flag, MANAGED_FLAGS[flag]
    for name, where in MANAGED_FLAGS.items():
        if abbreviates(flag, name):
            return name, where
    return None


# SGLang's own names for one parallelism flag (its aliases; `abbreviates` takes prefixes).
_PARALLEL_NAMES = {
    "--nnodes": ("--nnodes",), "--node-rank": ("--node-rank",),
    "--dist-init-addr": ("--dist-init-addr", "--nccl-init-addr"),
    "--pp-size": ("--pp-size", "--pipeline-parallel-size"),
    "--dp-size": ("--dp-size", "--data-parallel-size"),
    "--enable-dp-attention": ("--enable-dp-attention",),
    "--attn-dp-size": ("--attn-dp-size", "--attention-data-parallel-size"),
    "--ep-size": ("--ep-size", "--expert-parallel-size", "--ep"),
    "--moe-a2a-backend": ("--moe-a2a-backend",),
    "--deepep-mode": ("--deepep-mode",),
    "--load-balance-method": ("--load-balance-method",),
}
# Flags SGLang dropped (0.5.3 refused them, 0.5.9 has none), with what replaced them.
DROPPED_FLAGS = {
    "--enable-ep-moe": "--ep-size N (the tp size, for every expert on its own GPU group)",
    "--enable-deepep-moe": "--moe-a2a-backend deepep",
}
_ONE_NODE = ("treetune runs each server on the tp GPUs Ray gives its worker, on one node, "
             "several servers at a time")


class ServerFlags:
    """Server flags as SGLang's parser reads them: by their names, their aliases (of the
    parallelism flags), or a prefix of one (it takes unambiguous abbreviations)."""

    def __init__(self, flags: Mapping[str, Any]) -> None:
        self.flags = flags

    def given(self, name: str) -> str | None:
        """The flag that is SGLang's `name`."""
        return next((flag for flag in self.flags for n in _PARALLEL_NAMES.get(name, (name,))
                     if abbreviates(flag, n)), None)

    def value(self, name: str) -> str | None:
        """The one value of the flag that is `name`, as text (None: not given, or bare)."""
        flag = self.given(name)
        if flag is None or self.flags[flag] is None:
            return None
        value = self.flags[flag]
        # One value, as the command has it: a study's list, or a launch spec's tuple.
        if isinstance(value, list | tuple) and len(value) == 1:
            value = value[0]
        return str(value)

    def number(self, name: str) -> int | None:
        """The whole-number value of the flag that is `name` (None: not given, or not a
        number, which SGLang's parser will say)."""
        try:
            return int(self.value(name) or "")
        except ValueError:
            return None

    def first_given(self, names: Iterable[str]) -> str | None:
        """The first of `names` given, as the flags write it."""
        return next(filter(None, map(self.given, names)), None)

    def attention_backends(self, main: str | None) -> list[str]:
        """The attention backends named: the decode one, `main` (--attention-backend, as
        resolved), then the prefill one."""
        return [b for b in (self.value("--decode-attention-backend"), main,
                            self.value("--prefill-attention-backend")) if b]

    def page_size(self, backend: str) -> int:
        """The KV cache's page size with `backend`: 64 for the backends that take large
        pages only (PAGED_BACKENDS), else --page-size (1 when not given)."""
        return 64 if backend in PAGED_BACKENDS else self.number("--page-size") or 1

    def above(self, name: str, limit: int) -> str | None:
        """The flag that is `name`, when its value is a number above `limit`."""
        value = self.number(name)
        return self.given(name) if value is not None and value > limit else None

    @property
    def attention_dp(self) -> str | None:
        """The flag that turns data-parallel attention on: --attn-dp-size above 1, or
        --enable-dp-attention with --dp-size above 1 (0.5.23 turns that dp size into the
        attention's; alone, it does nothing)."""
        if flag := self.above("--attn-dp-size", 1):
            return flag
        enabled = self.given("--enable-dp-attention")
        return enabled if enabled and self.above("--dp-size", 1) else None

    @property
    def attention_dp_size(self) -> int:
        """How many data-parallel groups the attention runs in (1: none): --attn-dp-size,
        or --dp-size given with --enable-dp-attention."""
        if (size := self.number("--attn-dp-size") or 1) > 1:
            return size
        return (self.number("--dp-size") or 1) if self.attention_dp else 1

    @property
    def all_to_all(self) -> str | None:
        """The flag that sets an all-to-all MoE backend (--moe-a2a-backend other than
        none)."""
        flag = self.given("--moe-a2a-backend")
        return flag if self.value("--moe-a2a-backend") not in (None, "none") else None

    @property
    def replicas(self) -> str | None:
        """--dp-size above 1 that starts replicas of tp GPUs each: without
        --enable-dp-attention, or beside an --attn-dp-size above 1 (then both count)."""
        flag = self.above("--dp-size", 1)
        converted = self.given("--enable-dp-attention") and not self.above("--attn-dp-size", 1)
        return flag if flag and not converted else None


def adaptive_blocker(flags: Mapping[str, Any]) -> tuple[str, str] | None:
    """The server flag with which SGLang serves static trees though adaptive steps were
    asked for (it only logs why), and its reason; None when there is none."""
    parallel = ServerFlags(flags)
    if flag := parallel.attention_dp:
        return flag, DP_ATTENTION_REASON
    return next(((flag, reason) for name, reason in STATIC_WITH.items()
                 if (flag := parallel.given(name))), None)


def attention_dp_size(flags: Mapping[str, Any]) -> int:
    """The attention's data-parallel size the server flags ask for (1: none). SGLang
    0.5.23 splits attention heads over tp / this (`attn_tp_size`), not over tp."""
    return ServerFlags(flags).attention_dp_size


def capture_multiple(flags: Mapping[str, Any], tp: int) -> int:
    """What every batch size SGLang captures in a CUDA graph is a multiple of: 2 with
    two-batch overlap, times an attention group's GPUs where the attention's tokens are
    gathered (data-parallel attention, an all-to-all MoE backend or dense layers on one
    GPU, over tp > 1; `get_batch_sizes_to_capture`). It fails at start-up when no size up
    to its cap is one."""
    parallel = ServerFlags(flags)
    groups = parallel.attention_dp_size
    if tp % groups:
        return 1
    gathered = (groups > 1 or parallel.all_to_all is not None
                or parallel.number("--moe-dense-tp-size") == 1)
    multiple = tp // groups if gathered else 1
    return multiple * (2 if parallel.given("--enable-two-batch-overlap") else 1)


def cuda_graphs_for(batch: int, flags: Mapping[str, Any], tp: int) -> int:
    """The --cuda-graph-max-bs(-decode) for servers of `batch` requests: `batch`, or a
    group's share of it rounded up to the `capture_multiple` (a cap of 1 with two GPUs per
    attention group captured nothing)."""
    multiple = capture_multiple(flags, tp)
    share = -(-batch // ServerFlags(flags).attention_dp_size)
    return max(batch, -(-share // multiple) * multiple)


def running_requests_for(batch: int, flags: Mapping[str, Any]) -> int:
    """The --max-running-requests that lets `batch` requests run at once: with D
    data-parallel attention groups each takes max_running_requests // D, so a multiple of
    D (the batch itself without them)."""
    groups = attention_dp_size(flags)
    return -(-batch // groups) * groups


# Trees (topk > 1) on a paged KV cache (pages of more than one token): SGLang 0.5.23 serves
# them only with these attention backends (`_handle_eagle_family` in
# srt/arg_groups/speculative_hook.py); an NGRAM server's branches only with flashinfer
# (`_handle_ngram`). The others cannot give each branch its own tail of a page.
PAGED_TREE_BACKENDS = ("flashinfer", "fa3", "triton")
PAGED_NGRAM_BACKENDS = ("flashinfer",)
# Backends that take pages of 16-128 tokens only: SGLang raises a page of 1 to 64 for them
# (`_mla_backend_page_constraints` in srt/arg_groups/overrides.py); DSA's own backend runs on
# 64-token pages (srt/arg_groups/model_overrides/deepseek_v2.py).
PAGED_BACKENDS = ("flashmla", "trtllm_mla", "cutedsl_mla", "trtllm_mha", "hpc_ops", "dsa")
# Backends that draft chains only, whatever the page: trtllm_mha ("only supports topk = 1
# for speculative decoding", at start-up), and ROCm's aiter ("SPEC_V2 path currently
# supports topk <= 1 only", once the weights are loaded). FlashInfer's MLA kernels too
# ("Currently Flashinfer MLA only supports topk=1", flashinfer_mla_backend.py).
CHAIN_BACKENDS = ("trtllm_mha", "aiter")
# The targets SGLang gives DSA's backend when they have DeepSeek Sparse Attention's indexer
# (`index_topk`) and no backend is given (deepseek_v2.py's overrides, on CUDA; on ROCm
# without aiter's paged kernel it falls back to pages of 1).
DSA_ARCHITECTURES = frozenset({
    "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "MistralLarge3ForCausalLM",
    "PixtralForConditionalGeneration", "GlmMoeDsaForCausalLM",
    "Glm5NextForConditionalGeneration", "HYV4ForCausalLM", "LongcatFlashForCausalLM",
    "Dots3NoteForCausalLM",
})
# MLA targets SGLang gives FlashInfer's MLA kernels on Blackwell when no backend is given
# (model_override_base.py's default for MLA; no model override of theirs picks another).
BLACKWELL_MLA_FLASHINFER = frozenset({"DeepseekV2ForCausalLM", "Glm4MoeLiteForCausalLM"})
# Targets SGLang gives aiter on ROCm when no backend is given: the default for a target
# without MLA, or their own override's (gpt-oss, Llama 4). Others with overrides of their
# own (OLMo 2/3, EXAONE 4 with sliding windows, MiniMax-M3: triton) are left out.
ROCM_AITER = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM", "GptOssForCausalLM",
    "Llama4ForCausalLM", "Llama4ForConditionalGeneration",
})
# Flags that verify by rejection sampling (block verification turns it on), which SGLang
# 0.5.23 implements for chains only ("requires --speculative-eagle-topk=1").
REJECTION_SAMPLING_FLAGS = ("--speculative-use-rejection-sampling",
                            "--speculative-use-block-verification")
# The backend SGLang gives these targets on Blackwell GPUs when none is given
# (srt/arg_groups/model_overrides/: gpt_oss.py, llama4.py, and deepseek_v2.py for the
# DeepSeek family without DSA).
BLACKWELL_BACKENDS = {
    "GptOssForCausalLM": "trtllm_mha", "Llama4ForCausalLM": "trtllm_mha",
    "Llama4ForConditionalGeneration": "trtllm_mha",
    **{architecture: "trtllm_mla" for architecture in DSA_ARCHITECTURES
       | {"KimiK25ForConditionalGeneration"}},
}


def branching_problem(flags: Mapping[str, Any], attention_backend: str | None,
                      target: ModelFacts | None, gpu: str | None, method: str) -> str:
    """Why SGLang (0.5.23) would fail every server of draft `method` whose tree branches
    (topk > 1; an NGRAM server's breadth) ("" when it would not): rejection sampling, or
    an attention backend (`attention_backend` or one in `flags`; else the one SGLang picks
    for the `target` on `gpu`, when they are known) that drafts chains only or runs on
    pages of many tokens, where only a few backends can hold a tree."""
    parallel = ServerFlags(flags)
    if method in ("EAGLE", "EAGLE3", "NEXTN") and (
            sampled := parallel.first_given(REJECTION_SAMPLING_FLAGS)):
        return (f"SGLang fails {method} trees that branch (topk > 1) as they start with "
                f"'{sampled}': rejection sampling verifies chains only; {_CHAINS}, or leave "
                "it out")
    given = parallel.attention_backends(attention_backend)
    backend, chosen = (given[0], "as given") if given else _default_backend(target, gpu)
    if backend is None:
        return ""
    if method != "NGRAM" and "trtllm_mha" in given:  # any of those named (decode, main, prefill)
        backend = "trtllm_mha"
    page = parallel.page_size(backend)
    allowed = PAGED_NGRAM_BACKENDS if method == "NGRAM" else PAGED_TREE_BACKENDS
    mla = target is not None and target.mla
    if method != "NGRAM" and backend == "flashinfer" and mla:
        why = (f"the flashinfer attention backend, {chosen}, takes an MLA target's chains "
               "only: a NEXTN draft fails as it starts, and other drafts' trees are verified "
               "without their tree mask")
    elif method != "NGRAM" and backend in CHAIN_BACKENDS:
        why = f"the {backend} attention backend, {chosen}, drafts chains only"
    elif page > 1 and backend not in allowed:
        why = (f"the {backend} attention backend, {chosen}, runs on pages of {page} "
               f"tokens, where SGLang holds a tree only with {', '.join(allowed)}")
    else:
        return ""
    if method == "NGRAM":
        shape = "branching NGRAM servers (breadth > 1)"
        fix = "search breadth 1 (an NGRAM space of topk [1])"
        if backend not in PAGED_BACKENDS:
            fix += ", or leave --page-size out"
    else:
        shape, fix = f"{method} trees that branch (topk > 1)", _CHAINS
        if backend != "dsa":  # DSA's indexer runs on its own backend only
            # triton holds trees on every GPU, for MLA targets too, and gpt-oss and Llama 4
            # take it (they refuse flashinfer: model_hook.py).
            fix += ", or give --attention-backend triton if the model runs on it"
    return f"SGLang fails {shape} as they start here: {why}; {fix}"


_CHAINS = "search and compare chains only (topk 1: --space narrow)"
AMD_GPUS = ("MI300X", "MI325X", "MI355X")


def _default_backend(target: ModelFacts | None, gpu: str | None
                     ) -> tuple[str | None, str]:
    """The attention backend SGLang 0.5.23 picks for `target` on `gpu` (any name the GPU
    table knows) when none is given, where it drafts chains only or pages the cache (None
    where it is one that holds trees, or unknown), and how it was chosen."""
    from treetune.facts import gpu_facts

    if target is None:
        return None, ""
    try:
        name = gpu_facts(gpu).name if gpu else None
    except TreetuneError:
        name = None  # not a GPU of the table (MIG instances, say): its default is unknown
    # On ROCm SGLang falls back to pages of 1 where aiter's paged kernel is missing.
    if target.sparse_index and target.architecture in DSA_ARCHITECTURES and \
            name not in AMD_GPUS:
        return "dsa", (f"which SGLang picks for {target.architecture} with DeepSeek Sparse "
                       "Attention (index_topk in its config.json)")
    if name in BLACKWELL_GPUS and target.architecture in BLACKWELL_BACKENDS:
        backend = BLACKWELL_BACKENDS[target.architecture]
    elif name in BLACKWELL_GPUS and target.architecture in BLACKWELL_MLA_FLASHINFER:
        backend = "flashinfer"
    elif name in AMD_GPUS and target.architecture in ROCM_AITER:
        backend = "aiter"
    else:
        return None, ""
    return backend, f"which SGLang picks for {target.architecture} on {name}"


DEEPEP_CAP_VARIABLE = "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"
DEEPEP_DEFAULT_CAP = 128  # SGLang 0.5.23's default for it (srt/environ.py)
DEEPEP_MAX_CAP = 1024  # what its DeepEP dispatcher asserts the variable stays within


def deepep_problem(flags: Mapping[str, Any], env: Mapping[str, str], tp: int,
                   max_batch: int, widest: Mapping[str, int]) -> str:
    """Why DeepEP's low-latency dispatch would fail a study's launches ("" when it would
    not): with --moe-a2a-backend deepep (its mode auto or low_latency: decode and verify
    passes dispatch low-latency), a GPU takes at most DEEPEP_CAP_VARIABLE tokens a pass, and
    SGLang 0.5.23 captures the verify pass of its largest batch at start-up, where DeepEP's
    own assertion fails past the cap. A GPU's tokens: its attention group's share of the
    largest batch, times the tokens each request verifies, over the group's GPUs.
    `widest`: per draft method, the most tokens a request sends in one pass (draft tokens;
    a NEXTN draft's MoE layer also sends topk)."""
    parallel = ServerFlags(flags)
    if parallel.value("--moe-a2a-backend") != "deepep":
        return ""
    if parallel.value("--deepep-mode") == "normal":
        return ""  # no cap (and no CUDA graphs)
    text = env.get(DEEPEP_CAP_VARIABLE)
    where = "as the environment sets it" if text else "SGLang's default"
    try:
        cap = int(text) if text else DEEPEP_DEFAULT_CAP
    except ValueError:
        return f"{DEEPEP_CAP_VARIABLE}={text!r} is not a whole number of tokens"
    if not 1 <= cap <= DEEPEP_MAX_CAP:
        return (f"{DEEPEP_CAP_VARIABLE}={cap}: SGLang's DeepEP dispatcher takes 1 to "
                f"{DEEPEP_MAX_CAP} tokens per GPU")
    groups = parallel.attention_dp_size
    group_gpus = tp // groups if tp % groups == 0 else tp
    # An attention group's share of the largest batch, as SGLang sizes its request pool
    # (max_running_requests // groups, treetune launching running_requests_for), padded
    # to a multiple of the group's GPUs as it sizes its largest CUDA graph (with an
    # all-to-all backend, the group's tokens are spread evenly over its GPUs).
    requests = running_requests_for(max_batch, flags) // groups
    padded = -(-requests // group_gpus) * group_gpus

    def per_gpu(tokens: int) -> int:
        return padded * tokens // group_gpus

    over = {name: n for name, n in widest.items() if per_gpu(n) > cap}
    if not over:
        return ""
    name, tokens = max(over.items(), key=lambda item: item[1])
    fits = cap * group_gpus // padded
    need = per_gpu(max(widest.values()))
    split = f"{requests} requests per attention group of {group_gpus} GPU(s)"
    if padded != requests:
        split += f", captured as {padded}"
    fixes = [f"{DEEPEP_CAP_VARIABLE}: {need} in the study's env"] if need <= DEEPEP_MAX_CAP else []
    if fits >= 2:
        fixes.append(f"trees of at most {fits} draft tokens (the space's draft_tokens; and "
                     "topk, for NEXTN)")
    fixes.append("a smaller largest batch size, or --deepep-mode normal (no cap, no CUDA "
                 "graphs)")
    flag = parallel.given("--moe-a2a-backend")
    return (f"'{flag}' deepep: DeepEP's low-latency dispatch takes at most {cap} tokens a "
            f"GPU per pass ({DEEPEP_CAP_VARIABLE}, {where}), and at batch {max_batch} "
            f"({split}) a verify pass of {name}'s {tokens}-token trees sends "
            f"{per_gpu(tokens)}: SGLang would fail at start-up capturing that pass (without "
            "CUDA graphs, at the first batch that large). Give " + "; or ".join(fixes))


def parallel_flag_problem(flags: Mapping[str, Any], algorithms: Collection[str],
                          tp: int = 1) -> str:
    """Why a study's server flags would make SGLang (0.5.23) fail every launch, or use
    GPUs its worker was not given ("" when none): a flag SGLang dropped; a server spanning
    nodes; pipeline parallelism (tp x pp GPUs, and no EAGLE3 or STANDALONE draft with it);
    data-parallel replicas (tp x dp GPUs); STANDALONE or NGRAM with attention data
    parallelism; an attention data-parallel size or an expert-parallel size that does not
    divide `tp`; dense layers' tp neither 1 nor `tp`; two-batch overlap with neither an
    all-to-all MoE backend nor data-parallel attention. Expert parallelism and attention
    data parallelism live within the tp GPUs: allowed (each attention group takes
    max_running_requests // its count: treetune launches a multiple of it,
    `running_requests_for`)."""
    parallel = ServerFlags(flags)
    for dropped, instead in DROPPED_FLAGS.items():
        if dropped in flags:  # by its whole name: a prefix may be another flag's now
            return (f"'{dropped}' is no flag of SGLang since 0.5.9 (0.5.3 refused it): "
                    f"write {instead}")
    if flag := (parallel.above("--nnodes", 1) or parallel.above("--node-rank", 0)
                or parallel.given("--dist-init-addr")):
        return (f"'{flag}' makes a server that spans nodes, or gives every server of the "
                f"study one rendezvous address: {_ONE_NODE}; tune on one node (tp up to its "
                "GPUs)")
    if flag := parallel.above("--pp-size", 1):
        return (f"'{flag}': pipeline parallelism needs tp x pp GPUs per server, where "
                f"{_ONE_NODE}; and SGLang 0.5.23 drafts with it only by EAGLE or NEXTN "
                "(SGLANG_ENABLE_PP_SPEC=1), never EAGLE3 or STANDALONE. Leave it out")
    if flag := parallel.replicas:
        return (f"'{flag}' starts that many replicas of tp GPUs each, where {_ONE_NODE}: a "
                "study measures one replica (leave it out; `workers` runs servers side by "
                "side), or for data-parallel attention within tp add "
                "--enable-dp-attention (SGLang 0.5.23: write --attn-dp-size N instead)")
    for name in REJECTION_SAMPLING_FLAGS:
        flag = parallel.given(name)
        # Block verification takes EAGLE, EAGLE3 and NEXTN only, and so does rejection
        # sampling of the methods treetune runs (speculative_hook.py; NGRAM has no verify
        # by rejection sampling to refuse it).
        drafts = {"STANDALONE", "NGRAM"} if "block" in name else {"STANDALONE"}
        if flag and (refused := sorted(drafts & set(algorithms))):
            return (f"'{flag}': SGLang 0.5.23 takes it for EAGLE, EAGLE3 and NEXTN only, "
                    f"and fails {' and '.join(refused)} servers as they start; leave it out")
    flag = parallel.attention_dp
    for refused in ("STANDALONE", "NGRAM"):  # speculative_hook.py's two refusals
        if flag and refused in algorithms:
            return (f"'{flag}': SGLang 0.5.23 refuses {refused} drafting with data-parallel "
                    "attention; leave it out, or draft by EAGLE3")
    groups = parallel.attention_dp_size
    if flag and tp % groups:
        return (f"'{flag}': {groups} data-parallel attention groups do not divide tp {tp} "
                "(SGLang 0.5.23 asserts tp is a multiple of them): give a divisor of tp")
    ep = parallel.number("--ep-size")
    if ep is not None and (ep < 1 or ep > tp or tp % ep):
        return (f"'{parallel.given('--ep-size')}' {ep}: the expert-parallel ranks are a "
                f"divisor of tp {tp} (SGLang splits each server's tp GPUs among them, and "
                "fails at start-up otherwise): give one, or leave it out")
    dense = parallel.number("--moe-dense-tp-size")
    if dense is not None and dense not in (1, tp):
        return (f"'{parallel.given('--moe-dense-tp-size')}' {dense}: SGLang asserts the "
                f"dense layers' tp is 1 or the server's, {tp}")
    overlap = parallel.given("--enable-two-batch-overlap")
    if overlap and not flag and parallel.all_to_all is None:
        return (f"'{overlap}': SGLang runs two-batch overlap only with an all-to-all MoE "
                "backend (--moe-a2a-backend) or data-parallel attention, and fails at "
                "start-up without: add one, or leave it out")
    return ""


def tp_priced(flags: Mapping[str, Any]) -> str:
    """The word for a model search when the study's server flags ask for expert
    parallelism ("" when they do not): its performance model prices the experts as tensor
    parallel, where a step is as slow as its busiest expert rank and experts move by
    all-to-all; the search's learned correction has to make up for it. (Data-parallel
    attention it prices: CostModel.)"""
    parallel = ServerFlags(flags)
    used = [f for f in (parallel.above("--ep-size", 1), parallel.all_to_all) if f]
    if not used:
        return ""
    return (f"server_flags {', '.join(used)}: the performance model prices the experts as "
            "tensor parallel (a share of every expert on each GPU, all-reduces), not as "
            "expert parallel; the search corrects it from the launches, but its first "
            "proposals may be off (at small batches most: the busiest expert rank sets the "
            "pace)")


def groups_unpriced(flags: Mapping[str, Any], prior: Profile | None) -> str:
    """The word for a model search whose servers run data-parallel attention while its
    prior does not say the attention's weights, which each group holds a copy of ("" when
    they do not, or it does)."""
    parallel = ServerFlags(flags)
    if prior is None or parallel.attention_dp is None or prior.target.attention_params_b:
        return ""
    return (f"server_flags {parallel.attention_dp}: the prior '{prior.name}' does not say its "
            "attention weights (target.attention_params_b), so the copy each data-parallel "
            "attention group holds is not priced (its KV cache by group is); the search "
            "corrects it from the launches")


def version_of(launch: LaunchSpec) -> str:
    return launch.engine_version or DEFAULT_SGLANG_VERSION


def supports_config_file(sglang_version: str) -> bool:
    """Whether `launch_server --config FILE` exists in this SGLang version."""
    return parse_version(sglang_version) >= CONFIG_FILE_SINCE


def cuda_graph_flag(sglang_version: str) -> str:
    if parse_version(sglang_version) >= CUDA_GRAPH_FLAG_SPLIT:
        return "--cuda-graph-max-bs-decode"
    return "--cuda-graph-max-bs"


# Flags SGLang renamed, as the wheels' parsers show: old name -> (new name, the first
# release with the new name, a release without the old one). 0.5.9's server_args.py knows
# only --mamba-scheduler-strategy; 0.5.14's has --mamba-radix-cache-strategy and keeps the
# old name as an alias; 0.5.20's and 0.5.23's arg_groups know only the new one. (The
# published Qwen3.5-397B EAGLE3-vs-MTP run passed the old name.)
RENAMED_FLAGS: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]] = {
    "--mamba-scheduler-strategy": ("--mamba-radix-cache-strategy", (0, 5, 14), (0, 5, 20)),
    # 0.5.9 has only --cuda-graph-bs; 0.5.14 keeps it as a deprecated alias of the decode
    # phase's; 0.5.20 has none (argparse then takes it for an ambiguous abbreviation).
    "--cuda-graph-bs": ("--cuda-graph-bs-decode", (0, 5, 14), (0, 5, 20)),
}


def flag_not_in_release(flag: str, sglang_version: str) -> str:
    """Why `flag` is not a flag of that SGLang release ("" when treetune knows no reason):
    a name it renamed, before or after the rename, or a CUDA-graph flag per phase before
    it had them. SGLang refuses an unknown flag, so every launch of the study would fail."""
    version = parse_version(sglang_version)
    for old, (new, since, gone) in RENAMED_FLAGS.items():
        if flag == old and version >= gone:
            return (f"SGLang {sglang_version} has no '{old}': {_release(since)} renamed it "
                    f"'{new}', and {_release(gone)} has only the new name; write '{new}'")
        if flag == new and version < since:
            return (f"SGLang {sglang_version} has no '{new}': it came in {_release(since)}, "
                    f"and earlier releases call it '{old}'; write '{old}', or give a newer "
                    "sglang_version")
    if version <= GRAPH_FLAGS_ABSENT_IN.get(flag, ()):
        return (f"SGLang {sglang_version} has no '{flag}' (the "
                f"{_release(GRAPH_FLAGS_ABSENT_IN[flag])} wheel's parser has none, 0.5.23's "
                "has it); give a newer sglang_version")
    return ""


def abbreviated_graph_flag(flag: str) -> str:
    """Why a study may not give `flag` ("" when it may): an abbreviation of a CUDA-graph
    flag. SGLang reads it on the command line (or refuses it, when it abbreviates
    several), but a deployment's config file holds each flag under the name written, and
    SGLang's reader takes a bare flag's `true` as the flag only under its whole name. The
    slot keys of an adaptive study follow those flags (`graph_sizes_for`)."""
    names = graph_flag_named(flag)
    if len(names) > 1:
        return (f"'{flag}' abbreviates several CUDA-graph flags ({', '.join(names)}), which "
                "SGLang refuses as ambiguous: write the whole name of the one meant")
    if names and names[0] != flag:
        return (f"'{flag}' is short for '{names[0]}': write the whole name (a deployment's "
                "config file takes whole names only)")
    return ""


def _release(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


# ---- draft methods: which algorithm needs what, and which knobs shape its draft ---------

def needs_draft_model(algorithm: str) -> bool:
    """Whether SGLang needs --speculative-draft-model-path for this algorithm (NEXTN uses
    the target's own MTP layer, NGRAM a suffix trie)."""
    return algorithm not in DRAFTLESS_ALGORITHMS


def resolved_algorithm(algorithm: str) -> str:
    """The algorithm SGLang runs and reports in /server_info (NEXTN becomes EAGLE)."""
    return ALGORITHM_ALIASES.get(algorithm, algorithm)


def profile_method(algorithm: str) -> str:
    """The performance-profile method that times this algorithm: EAGLE and EAGLE3 run the
    draft head at --speculative-draft-model-path, the profile's own draft; the others are
    entries of the profile's `methods` under the algorithm's name."""
    return DEFAULT_METHOD if algorithm in ("EAGLE", "EAGLE3") else algorithm


def method_knobs(algorithm: str) -> tuple[str, ...]:
    """The launch flags that shape this algorithm's draft tree: the EAGLE tree's three for
    EAGLE, EAGLE3, NEXTN and STANDALONE; NGRAM has no steps/topk tree, only its verify size
    and the trie match's breadth."""
    if algorithm == NGRAM:
        return ("--speculative-num-draft-tokens", NGRAM_BREADTH_FLAG)
    return TREE_KNOBS


def ngram_tree(draft_tokens: int, breadth: int) -> TreeConfig:
    """An NGRAM server as a TreeConfig: `draft_tokens` verified tokens (root included), at
    most `breadth` continuations per trie node. A match may run as deep as its tokens
    allow, so the tree's depth bound (steps) is draft_tokens - 1; breadth 1 is a chain."""
    return TreeConfig.of(draft_tokens - 1, breadth, draft_tokens)


def method_tree_problem(algorithm: str, config: TreeConfig) -> str | None:
    """Why `config` is not a server of this algorithm, or None. The EAGLE-tree algorithms
    share TreeConfig's own rules; an NGRAM server has no steps knob, so only its
    canonical form ngram_tree(N, K) = (N-1, K, N) names one."""
    if algorithm not in KNOWN_ALGORITHMS:
        return (f"speculative algorithm '{algorithm}' is not one of "
                f"{', '.join(KNOWN_ALGORITHMS)}")
    if algorithm == NGRAM and config.steps != config.draft_tokens - 1:
        return _not_ngram(config.steps, config.topk, config.draft_tokens)
    return None


def _not_ngram(steps: int, topk: int, draft_tokens: int) -> str:
    return (f"({steps},{topk},{draft_tokens}) is not an NGRAM server: NGRAM has no steps "
            f"knob, only --speculative-num-draft-tokens N and {NGRAM_BREADTH_FLAG} K; write "
            f"it as (N-1, K, N), here {ngram_tree(draft_tokens, topk).label()}")


def parse_method_tree(text: str, algorithm: str) -> TreeConfig:
    """A tree typed 'S,K,N' (a server of `algorithm`) or 'METHOD:S,K,N', refused unless it
    names a server of its method. An NGRAM server is judged as typed: SGLang's chain
    rule would make '1,1,8' the chain (1,1,2), which is NGRAM's N=2, not the N=8 asked."""
    method, steps, topk, draft_tokens = TreeConfig.typed(text)
    own = method or algorithm
    if own == NGRAM and steps != draft_tokens - 1 and draft_tokens >= 2:
        raise InvalidTreeError(_not_ngram(steps, topk, draft_tokens))
    config = TreeConfig.of(steps, topk, draft_tokens, method)
    problem = method_tree_problem(own, config)
    if problem is not None:
        raise InvalidTreeError(problem)
    return config


def check_algorithm(algorithm: str, draft: str | None) -> None:
    if algorithm not in KNOWN_ALGORITHMS:
        raise TreetuneError(
            f"speculative algorithm '{algorithm}' is not one of {', '.join(KNOWN_ALGORITHMS)}")
    if draft is None and needs_draft_model(algorithm):
        raise TreetuneError(f"{algorithm} needs a draft model path (--draft)")


def speculative_args(config: ServerConfig, spec: LaunchSpec) -> list[str]:
    """The speculative flags: all three knobs together (NGRAM: its verify size and
    breadth), or none for the baseline; the config's own draft method and its draft. An
    adaptive server starts from its middle candidate chain (SGLang's own default, and it
    must be a candidate) and reads its slots from the JSON file `spec` names."""
    if config is BASELINE:
        return []
    adaptive: list[str] = []
    if isinstance(config, AdaptiveConfig):
        if spec.adaptive_config_path is None:
            raise TreetuneError(f"{config} needs its JSON config file: no "
                                "adaptive_config_path was given for the launch")
        steps = config.initial_steps
        adaptive = [ADAPTIVE_FLAG, ADAPTIVE_CONFIG_FLAG, spec.adaptive_config_path]
        config = TreeConfig.of(steps, 1, steps + 1)
    assert isinstance(config, TreeConfig)
    spec = spec.for_method(config.method)  # a tree of another draft method of the study
    check_algorithm(spec.algorithm, spec.draft_model_path)
    problem = method_tree_problem(spec.algorithm, config)
    if problem is not None:
        raise TreetuneError(problem)
    args = ["--speculative-algorithm", spec.algorithm]
    if spec.algorithm == NGRAM:  # no draft model; SGLang sets its topk from the breadth
        return [*args, "--speculative-num-draft-tokens", str(config.draft_tokens),
                NGRAM_BREADTH_FLAG, str(config.topk)]
    if spec.draft_model_path is not None:
        args += ["--speculative-draft-model-path", spec.draft_model_path]
    return [
        *args,
        "--speculative-num-steps", str(config.steps),
        "--speculative-eagle-topk", str(config.topk),
        "--speculative-num-draft-tokens", str(config.draft_tokens),
        *adaptive,
    ]


def server_args(
    config: ServerConfig, spec: LaunchSpec, flags: Sequence[tuple[str, str | None]] = ()
) -> list[str]:
    """SGLang `launch_server` arguments for one server (without the program)."""
    version = version_of(spec)
    args = ["--model-path", spec.model_path, *speculative_args(config, spec)]
    args += ["--tp-size", str(spec.tp), "--host", spec.host, "--port", str(spec.port)]
    if spec.max_running_requests is not None:
        # With speculation on and this unset, SGLang caps running requests at 48.
        args += ["--max-running-requests", str(spec.max_running_requests)]
    if spec.cuda_graph_max_bs is not None:
        args += [cuda_graph_flag(version), str(spec.cuda_graph_max_bs)]
    if spec.attention_backend is not None:
        args += ["--attention-backend", spec.attention_backend]
    if spec.mem_fraction_static is not None:
        args += ["--mem-fraction-static", f"{spec.mem_fraction_static:g}"]
    if spec.enable_metrics:
        args.append("--enable-metrics")
    if not spec.prefix_cache and NO_PREFIX_CACHE not in (name for name, _ in spec.extra_flags):
        args.append(NO_PREFIX_CACHE)  # SGLang's radix cache is on by default
    parallel = ServerFlags(dict(spec.extra_flags))
    if parallel.attention_dp_size > 1 and parallel.given("--load-balance-method") is None:
        # Round robin (the default) hands a closed loop's next request to the next group,
        # not to the one a request just left: groups drift apart, some queue while others
        # idle, and the batch a cell asks for never forms. The least loaded group instead.
        args += ["--load-balance-method",
                 "total_requests" if parse_version(version) >= (0, 5, 9) else "shortest_queue"]
    for name, value in (*spec.extra_flags, *flags):
        args += ([name] if value is None else [name, *value] if isinstance(value, tuple)
                 else [name, value])
    return args


def sglang_command(
    config: ServerConfig,
    spec: LaunchSpec,
    flags: Sequence[tuple[str, str | None]] = (),
    python: str = "python",
) -> list[str]:
    return [python, "-m", "sglang.launch_server", *server_args(config, spec, flags)]


def config_mapping(server_args: Sequence[str]) -> dict[str, Any]:
    """launch_server arguments as a --config mapping: long names without the leading dashes,
    bare flags as true, numbers typed (a later repeat of a flag wins, as on the command line)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(server_args):
        flag = server_args[i]
        if not flag.startswith("--"):
            raise TreetuneError(f"cannot write '{flag}' to an SGLang config file: expected a "
                                "--flag")
        values = []
        i += 1
        while i < len(server_args) and not server_args[i].startswith("--"):
            values.append(_typed(server_args[i]))
            i += 1
        # A flag of several values is a list in the file (SGLang spreads it back).
        out[flag[2:]] = True if not values else values[0] if len(values) == 1 else values
    return out


def _typed(value: str) -> int | float | str:
    """A number when it prints back exactly as given, so SGLang's str(value) restores it."""
    for kind in (int, float):
        try:
            number = kind(value)
        except ValueError:
            continue
        if str(number) == value:
            return number
    return value


# Bare flags SGLang 0.5.23's --config reader refuses, kept on the command line: its
# deprecated switches, and the --X / --no-X pairs (only plain store_true flags go in the
# file; srt/utils/server_args_config_parser.py).
COMMAND_LINE_ONLY_FLAGS = frozenset({
    "--enable-dp-attention", "--disable-cuda-graph", "--mm-enable-dp-encoder",
    "--speculative-enable-w4a4-mxfp4-megamoe", "--enable-tf32-matmul",
    "--enable-decoder-swa-bounded-replay", "--enable-fused-qk-norm-rope",
    "--enable-dsa-fused-indexer", "--ple-offload-embedding", "--dllm-fdfo",
    "--experts-shared-outer-loras", "--lora-strict-loading", "--dcp-replicate-q-proj",
    "--enable-tp-lm-head-all-to-all",
    "--lora-paths"})  # nargs="*" with an action of its own


def command_line_only(flag: str) -> bool:
    """Whether SGLang's --config reader refuses `flag` (it stays on the command line)."""
    return flag in COMMAND_LINE_ONLY_FLAGS or flag.startswith("--no-")


def sglang_deployment(launch: LaunchSpec, config: ServerConfig,
                      python: str = "python") -> Deployment:
    """What production runs: `python -m sglang.launch_server ...`, and the same flags as a
    config file where the SGLang version reads one (those it cannot hold after it, on the
    command line). `python`: the interpreter that has SGLang (a study's backend.python:
    the one it ran its servers with)."""
    argv = sglang_command(config, launch, python=python)
    if not supports_config_file(version_of(launch)):
        return Deployment(argv)
    in_file: list[str] = []
    tail: list[str] = []
    for word in argv[3:]:  # each flag with the values after it
        if word.startswith("--"):
            target = tail if command_line_only(word) else in_file
        target.append(word)
    return Deployment(argv, config_mapping(in_file),
                      [python, "-m", "sglang.launch_server", "--config"],
                      "SGLang >= 0.5.3", tail)


# --kv-cache-dtype values and the bytes each stores per element ("auto": the model's dtype).
# 0.5.23 takes auto, fp8_e5m2, fp8_e4m3, mxfp8, bf16, bfloat16, nvfp4, fp4_mx_block16
# (srt/arg_groups/fields/model.py); earlier releases fp4_e2m1, float16, half too. The
# block formats with their scales: a byte per 32 (mxfp8), per 16 (nvfp4, fp4_mx_block16).
KV_CACHE_BYTES = {"fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "mxfp8": 1 + 1 / 32, "fp4_e2m1": 0.5,
                  "nvfp4": 0.5 + 1 / 16, "fp4_mx_block16": 0.5 + 1 / 16, "bf16": 2.0,
                  "bfloat16": 2.0, "float16": 2.0, "half": 2.0}


def kv_cache_bytes(launch: LaunchSpec) -> float | None:
    """Bytes per KV-cache element the launch's flags ask for; None: the model's dtype."""
    value = dict(launch.extra_flags).get("--kv-cache-dtype")
    return KV_CACHE_BYTES.get(value or "auto")


# Prints the installed release ("" when the package does not say: a stand-in, a source tree).
_IMPORT_AND_VERSION = (
    "import sglang\n"
    "version = getattr(sglang, '__version__', '')\n"
    "if not version:\n"
    "    from importlib import metadata\n"
    "    try:\n"
    "        version = metadata.version('sglang')\n"
    "    except metadata.PackageNotFoundError:\n"
    "        pass\n"
    "print(version)\n")


def check_sglang(python: str, env: Mapping[str, str] | None = None) -> str:
    """`python` (backend.python) can import sglang; no shell involved. Returns the
    installed release, "" when the package does not say."""
    shown = python if shutil.which(python) in (None, python) else (
        f"{python} ({shutil.which(python)})")
    try:
        done = subprocess.run([python, "-c", _IMPORT_AND_VERSION], stdin=subprocess.DEVNULL,
                              env=dict(env) if env is not None else None,
                              capture_output=True, text=True, timeout=SGLANG_IMPORT_TIMEOUT_S)
    except FileNotFoundError:
        raise TreetuneError(
            f"the SGLang interpreter '{python}' (backend.python) was not found: set "
            f"backend.python to the Python that has SGLang installed, {EMULATOR_HINT}"
        ) from None
    except OSError as exc:
        raise TreetuneError(
            f"cannot run the SGLang interpreter '{python}' (backend.python): {exc.strerror}; "
            f"set backend.python to the Python that has SGLang installed, {EMULATOR_HINT}"
        ) from None
    except subprocess.TimeoutExpired:
        raise TreetuneError(
            f"'import sglang' with {shown} (backend.python) took more than "
            f"{SGLANG_IMPORT_TIMEOUT_S:.0f} s; check that installation, {EMULATOR_HINT}"
        ) from None
    if done.returncode == 0:
        lines = done.stdout.strip().splitlines()
        return lines[-1].strip() if lines else ""
    if "No module named 'sglang'" in done.stderr:
        raise TreetuneError(
            f"SGLang is not installed for {shown} (backend.python): install it on the GPU "
            f"machine with pip install 'treetune[sglang]' (or set backend.python to the "
            f"Python that has it), {EMULATOR_HINT}")
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    cause = lines[-1] if lines else f"exit code {done.returncode}"
    raise TreetuneError(
        f"SGLang cannot be imported by {shown} (backend.python): {cause}; fix that "
        f"installation (pip install 'treetune[sglang]'), {EMULATOR_HINT}")


def check_models(launch: LaunchSpec, env: Mapping[str, str]) -> None:
    """The target's attention splits over `launch.tp` GPUs, the draft is one SGLang can
    serve with it, and a target drafted by NEXTN has an MTP layer, when their config.json
    are here to say (a local folder or this machine's
    Hugging Face cache): else every launch (the baseline's, or every tree's) would fail in
    SGLang after Ray started. Models found only on the nodes are left to them."""
    from treetune.facts import model_facts
    from treetune.facts.prior import MTP_METHOD, mtp_problem, pair_problem

    try:
        facts = model_facts(launch.model_path, env)
    except TreetuneError:
        return
    groups = attention_dp_size(dict(launch.extra_flags))
    if refusal := facts.tp_refusal(launch.model_path, launch.tp, groups):
        raise TreetuneError(f"tp {launch.tp} (--tp): {refusal}")
    for algorithm, draft in ((launch.algorithm, launch.draft_model_path), *launch.methods):
        if algorithm == MTP_METHOD and (problem := mtp_problem(launch.model_path, facts)):
            raise TreetuneError(f"{algorithm}: {problem}" if launch.methods else problem)
        if draft is None or not needs_draft_model(algorithm):
            continue
        try:
            head = model_facts(draft, env)
        except TreetuneError:
            continue
        if problem := pair_problem(launch.model_path, facts, draft, head, algorithm):
            raise TreetuneError(f"{algorithm}: {problem}" if launch.methods else problem)


def check_installed_version(installed: str, targeted: str, python: str,
                            server_flags: Iterable[str] = ()) -> None:
    """The installed SGLang takes the flags the study's commands are written for: a study
    targeting 0.5.23 (the default) on 0.5.13 would pass --cuda-graph-max-bs-decode, which
    that release's parser refuses, and fail every launch; so would a server flag the
    installed release names otherwise."""
    try:
        parse_version(installed)
    except TreetuneError:
        return  # no release to compare (a stand-in, a source tree): the launch will tell
    where = (f"SGLang {installed} is installed for {python} (backend.python), and the "
             f"study's commands are written for SGLang {targeted} (sglang_version)")
    if cuda_graph_flag(installed) != cuda_graph_flag(targeted):
        raise TreetuneError(
            f"{where}: that release takes {cuda_graph_flag(installed)} where these pass "
            f"{cuda_graph_flag(targeted)}; give --sglang-version {installed}")
    for flag in server_flags:
        if missing := flag_not_in_release(flag, installed):
            raise TreetuneError(f"{where}: server_flags: {missing}, and give "
                                f"--sglang-version {installed}")


@register
@dataclass(frozen=True)
class SGLangBackend:
    """Real SGLang servers on real GPUs (`pip install 'treetune[sglang]'`)."""

    kind: ClassVar[str] = "sglang"
    gpu_resource: ClassVar[str] = "GPU"
    gpu_label: ClassVar[str] = "GPUs"
    api: ClassVar[ServerApi] = SGLANG_API

    python: str = "python"  # the interpreter that has sglang installed
    # The GPU the model search assumes, by its name in treetune's GPU table (`treetune
    # prior --help`); None: the one nvidia-smi (amd-smi, rocm-smi) shows a launch worker.
    gpu: str | None = None

    def __post_init__(self) -> None:
        if self.gpu is not None:
            # A misspelt override is refused here, not found on a worker after Ray starts
            # (where `auto` would quietly run TPE).
            from treetune.facts import gpu_facts

            try:
                gpu_facts(self.gpu)
            except TreetuneError as exc:
                raise FieldError("gpu", str(exc)) from None

    def command(self, launch: LaunchSpec, config: ServerConfig,
                context: LaunchContext) -> list[str]:
        return sglang_command(config, launch, python=self.python)

    def deployment(self, launch: LaunchSpec, config: ServerConfig) -> Deployment:
        return sglang_deployment(launch, config, self.python)

    def reads_config_file(self, launch: LaunchSpec) -> bool:
        return supports_config_file(version_of(launch))

    def check(self, launch: LaunchSpec, datasets: list[str], env: Mapping[str, str],
              local: bool) -> None:
        check_models(launch, env)
        if local:  # on a cluster, the nodes' interpreters are theirs
            check_installed_version(check_sglang(self.python, env), version_of(launch),
                                    self.python, (flag for flag, _ in launch.extra_flags))

    def facts(self, launch: LaunchSpec, env: Mapping[str, str]) -> Profile:
        """The auto prior: the target's and draft's config.json (local paths or the local
        Hugging Face cache) on this worker's GPU (or `gpu`), with the KV-cache dtype the
        server flags ask for."""
        from treetune.facts import build_prior

        # A study whose own method drafts without a model (NEXTN) beside one that drafts
        # with one: the prior is built from that draft, and describes NEXTN too.
        algorithm, draft = launch.algorithm, launch.draft_model_path
        if draft is None:
            algorithm, draft = next(((name, path) for name, path in launch.methods
                                     if path is not None), (algorithm, draft))
        return build_prior(launch.model_path, draft, tp=launch.tp,
                           gpu=self.gpu, env=env, kv_cache_bytes=kv_cache_bytes(launch),
                           algorithm=algorithm,
                           attention_dp=attention_dp_size(dict(launch.extra_flags)))

    def describe(self) -> str:
        return self.kind
