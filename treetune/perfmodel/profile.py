"""Profiles: the hardware, target model, draft head and workloads a prediction is for.

Physical facts (bandwidth, FLOPs, parameter counts, experts, memory) are written by hand;
`Calibration` and the per-dataset acceptance and workload shape are fitted by
`treetune calibrate`.

The top-level `draft` and each dataset's `acceptance` describe the profile's own draft head
(method `EAGLE3`). Other draft methods (the target's own MTP layer, a standalone small
model, n-gram lookup) are optional entries under `methods`, each with its draft cost and its
acceptance per dataset; a profile without them describes its draft head only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from treetune.errors import ConfigFileError, FieldError, TreetuneError
from treetune.perfmodel.acceptance import Acceptance
from treetune.yamlio import build, closest, dump_yaml, load_yaml


@dataclass(frozen=True)
class Hardware:
    """One GPU group serving one model replica (TP across `gpus`)."""

    gpu: str
    gpus: int
    memory_gb: float  # per GPU
    bandwidth_tb_s: float  # HBM, per GPU
    peak_tflops: float  # dense, at the weight dtype, per GPU
    interconnect_gb_s: float = 450.0  # per GPU and direction (NVLink)
    allreduce_latency_us: float = 8.0

    def __post_init__(self) -> None:
        _positive(self, "gpus", "memory_gb", "bandwidth_tb_s", "peak_tflops", "interconnect_gb_s")


@dataclass(frozen=True)
class MoE:
    experts: int
    experts_per_token: int
    expert_params_m: float  # one expert in one layer
    layers: int  # MoE layers
    shared_experts: int = 0

    def __post_init__(self) -> None:
        _positive(self, "experts", "experts_per_token", "expert_params_m", "layers")
        if self.experts_per_token > self.experts:
            raise ValueError("experts_per_token cannot exceed experts")


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the KV cache holds one
    compressed latent per token and layer, shared by every head, instead of K and V per
    KV head."""

    kv_lora_rank: int  # width of the latent (512 on DeepSeek-V3)
    rope_dim: int = 64  # the decoupled RoPE key stored beside it (qk_rope_head_dim)
    bytes_per_element: float = 2.0  # bf16 cache; 1 for an fp8 KV cache

    def __post_init__(self) -> None:
        _positive(self, "kv_lora_rank", "bytes_per_element")
        if self.rope_dim < 0:
            raise ValueError(f"rope_dim must be >= 0, got {self.rope_dim}")

    @property
    def bytes_per_token_and_layer(self) -> float:
        return (self.kv_lora_rank + self.rope_dim) * self.bytes_per_element


@dataclass(frozen=True)
class SlidingWindow:
    """Attention layers that only see the last `window` tokens (gpt-oss, Gemma 2/3,
    Mistral): their KV reads, and what SGLang's hybrid SWA pool keeps of them, stop
    growing with context at the window."""

    window: int  # tokens a windowed layer attends to
    layers: int  # attention layers with the window; the other attention layers see it all

    def __post_init__(self) -> None:
        _positive(self, "window", "layers")


@dataclass(frozen=True)
class Target:
    name: str
    total_params_b: float
    active_params_b: float
    layers: int
    hidden_size: int
    # KV cache of one token, all attention layers, whole model (K and V, or the MLA
    # latent). May be left out when `mla` says it: it is then derived from the latent.
    kv_bytes_per_token: float = 0.0
    weight_bytes: float = 2.0  # per parameter: 2 for bf16, 1 for fp8
    state_bytes_per_request: float = 0.0  # recurrent (linear-attention) state
    vocab_size: int = 151936
    attention_layers: int | None = None  # layers with a KV cache (default: all)
    moe: MoE | None = None
    mla: MLA | None = None
    sliding_window: SlidingWindow | None = None
    # Of a quantized checkpoint, the parameters it keeps at `unquantized_bytes` (the head,
    # norms and routers, layers its quantization_config leaves out; mxfp4: all but the
    # routed experts), all among those every pass reads. The auto prior leaves the
    # embedding out: a pass gathers a few of its rows (priced as the quantized bulk).
    unquantized_params_b: float = 0.0
    unquantized_bytes: float = 2.0
    # Key/value heads of a full-attention layer (0: not given, the cache taken as split
    # evenly). SGLang gives each tensor-parallel GPU a whole share of them, and with fewer
    # heads than GPUs copies each head to tp / kv_heads GPUs: each GPU then holds and reads
    # 1 / kv_heads of the KV cache, not 1 / tp (Qwen3-Next's 2 heads on 4 GPUs: twice).
    kv_heads: int = 0
    # Of the parameters every pass reads, those every tensor-parallel GPU holds and reads
    # whole (SGLang's ReplicatedLinear: MLA's fused query and latent down-projection,
    # DeepSeek Sparse Attention's indexer, MoE routers), and of them those at
    # `unquantized_bytes` (among unquantized_params_b; the rest at `weight_bytes`).
    replicated_params_b: float = 0.0
    replicated_unquantized_b: float = 0.0
    # Of the parameters every pass reads, the attention's (and linear attention's) that
    # tensor parallelism splits over tp, all layers, and of them those at
    # `unquantized_bytes`: with data-parallel attention (`server.attention_dp`) each group
    # holds and reads a copy of its own (0: not given, no copy priced).
    attention_params_b: float = 0.0
    attention_unquantized_b: float = 0.0

    def __post_init__(self) -> None:
        _positive(self, "total_params_b", "active_params_b", "layers", "hidden_size",
                  "weight_bytes", "unquantized_bytes")
        if self.active_params_b > self.total_params_b:
            raise ValueError("active_params_b cannot exceed total_params_b")
        if self.kv_heads < 0:
            raise FieldError("kv_heads", f"must be >= 0, got {self.kv_heads}")
        read, slack = self.always_read_params, 1.000001  # counts rounded in a file
        _in_share(self, "replicated_params_b", read, "the parameters every pass reads",
                  scale=1e9, slack=slack)
        _in_share(self, "replicated_unquantized_b",
                  min(self.replicated_params_b, self.unquantized_params_b),
                  "of replicated_params_b, those among unquantized_params_b", slack=slack)
        _in_share(self, "unquantized_params_b", read, "the parameters every pass reads",
                  scale=1e9, slack=slack)
        _in_share(self, "attention_params_b", read / 1e9 - self.replicated_params_b,
                  "the parameters every pass reads, less replicated_params_b", slack=slack)
        _in_share(self, "attention_unquantized_b",
                  min(self.attention_params_b, self.unquantized_params_b),
                  "of attention_params_b, those among unquantized_params_b", slack=slack)
        if self.attention_layers is not None and not 0 < self.attention_layers <= self.layers:
            raise FieldError("attention_layers", f"must be in 1..layers ({self.layers}), "
                             f"got {self.attention_layers}")
        if self.mla is not None:
            latent = self.kv_layers * self.mla.bytes_per_token_and_layer
            if self.kv_bytes_per_token == 0:
                object.__setattr__(self, "kv_bytes_per_token", latent)  # frozen: derive once
            elif abs(self.kv_bytes_per_token / latent - 1) > 0.01:
                raise FieldError("kv_bytes_per_token", (
                    f"{self.kv_bytes_per_token:g} disagrees with the MLA latent: "
                    f"{self.kv_layers} layers x ({self.mla.kv_lora_rank} + "
                    f"{self.mla.rope_dim}) x {self.mla.bytes_per_element:g} bytes = "
                    f"{latent:g}; leave kv_bytes_per_token out or fix one of them"))
        if self.kv_bytes_per_token <= 0:
            raise FieldError("kv_bytes_per_token",
                             f"must be > 0, got {self.kv_bytes_per_token:g} (or give mla)")
        if self.sliding_window is not None and self.sliding_window.layers > self.kv_layers:
            raise FieldError("sliding_window.layers", (
                f"{self.sliding_window.layers} windowed layers but only {self.kv_layers} "
                "attention layers"))

    @property
    def kv_layers(self) -> int:
        """Layers that hold a KV cache (hybrid models' linear-attention layers hold none)."""
        return self.attention_layers or self.layers

    def kv_share(self, tp: int) -> float:
        """The share of the whole KV cache each of `tp` GPUs holds and reads: all of an MLA
        latent (one "head" shared by all heads, which TP cannot split), 1 / kv_heads when
        there are fewer KV heads than GPUs, else 1 / tp."""
        return 1.0 if self.mla is not None else _kv_share(self.kv_heads, tp)

    def replicated_extra_bytes(self, tp: int) -> float:
        """What `tp` GPUs hold (and a pass reads) beyond the weights split over them: the
        replicated parameters' tp - 1 further copies."""
        return self._copies(tp - 1, self.replicated_params_b, self.replicated_unquantized_b)

    def attention_extra_bytes(self, groups: int) -> float:
        """What `groups` data-parallel attention groups hold (and a pass reads) beyond one
        split of the attention: its groups - 1 further copies."""
        return self._copies(groups - 1, self.attention_params_b, self.attention_unquantized_b)

    def _copies(self, copies: int, params_b: float, unquantized_b: float) -> float:
        """Bytes of `copies` copies of `params_b` billion parameters, `unquantized_b` of
        them at the unquantized width."""
        return copies * 1e9 * ((params_b - unquantized_b) * self.weight_bytes
                               + unquantized_b * self.unquantized_bytes)

    def kv_bytes(self, context: float) -> float:
        """Bytes of one request's KV cache at `context` tokens, whole model: what a decode
        step reads, and what the cache holds. Windowed layers stop at their window."""
        if self.sliding_window is None:
            return context * self.kv_bytes_per_token
        per_layer = self.kv_bytes_per_token / self.kv_layers
        windowed = self.sliding_window.layers
        return per_layer * ((self.kv_layers - windowed) * context
                            + windowed * min(context, self.sliding_window.window))

    @property
    def expert_params(self) -> float:
        """Routed-expert parameters read per distinct expert (all MoE layers)."""
        return 0.0 if self.moe is None else self.moe.expert_params_m * 1e6 * self.moe.layers

    @property
    def lm_head_params(self) -> float:
        """The output head: vocabulary x hidden size (what an MTP draft pass scores with)."""
        return float(self.vocab_size * self.hidden_size)

    def weight_bytes_of(self, params: float) -> float:
        """Bytes of `params` weights (the whole model's, or what a pass reads): the
        unquantized ones, always among them, at their own width."""
        unquantized = self.unquantized_params_b * 1e9
        return (params - unquantized) * self.weight_bytes + unquantized * self.unquantized_bytes

    @property
    def always_read_params(self) -> float:
        """Parameters every forward pass reads whatever the routing (attention, shared)."""
        routed = 0.0 if self.moe is None else self.moe.experts_per_token * self.expert_params
        return self.active_params_b * 1e9 - routed


@dataclass(frozen=True)
class Draft:
    name: str
    params_m: float
    weight_bytes: float = 2.0
    kv_bytes_per_token: float = 0.0
    layers: int = 1
    kv_heads: int = 0  # its attention's key/value heads (0: not given; see Target.kv_heads)
    # Of params_m, an EAGLE3 head's projection of the target's three hidden states (`fc`):
    # a plain Linear in SGLang, whole on every GPU, which only a pass fed the target's
    # states runs (the draft extend over a round's accepted tokens, and the prefill), not
    # the draft-decode passes that follow.
    fc_params_m: float = 0.0
    # What it holds in GPU memory when not params_m (0: params_m): an EAGLE3 head of
    # another width than the target's keeps an embedding of its own (SGLang shares the
    # target's only with a head of its width), one that names no draft vocabulary reads
    # the target's lm_head instead of holding one.
    resident_params_m: float = 0.0

    def __post_init__(self) -> None:
        _positive(self, "params_m", "weight_bytes", "layers")
        if self.resident_params_m < 0:
            raise FieldError("resident_params_m",
                             f"must be >= 0, got {self.resident_params_m:g}")
        if self.kv_heads < 0:
            raise FieldError("kv_heads", f"must be >= 0, got {self.kv_heads}")
        _in_share(self, "fc_params_m", self.params_m, "of params_m")


# The method the top-level `draft` and the datasets' `acceptance` describe.
DEFAULT_METHOD = "EAGLE3"
# Who drafts, which decides how a draft pass costs (see `Method`).
DRAFTERS = ("head", "mtp", "standalone", "ngram")


@dataclass(frozen=True)
class MTP:
    """The target's own multi-token-prediction layer used as the draft (DeepSeek-V3,
    Qwen3-Next, Qwen3.5; SGLang's NEXTN): one decoder layer of the target's width, fed with
    the last token's embedding and hidden state. It has no weights beyond that layer: it
    embeds with the target's embedding (a row read) and scores with the target's
    full-vocabulary lm_head, which every draft pass reads."""

    # Read on every pass: attention, the projection fusing embedding and hidden state,
    # norms, router and shared expert(s).
    dense_params_m: float
    kv_bytes_per_token: float  # its attention layer's KV cache
    # Its MLP is one MoE layer of the target's shape (target.moe): a pass reads the experts
    # its tokens route to, and all of them stay resident. False: a dense MLP, in dense_params_m.
    routed_experts: bool = True
    # Of dense_params_m, those every tensor-parallel GPU holds and reads whole: the
    # projection fusing embedding and hidden state (a plain Linear in SGLang's MTP layers,
    # never quantized), an MLA layer's down-projections and the router; and of them, those
    # at the target's unquantized width (the fusing projection and the router).
    replicated_params_m: float = 0.0
    replicated_unquantized_m: float = 0.0
    # The whole layer (dense part and experts) at the target's unquantized width: SGLang
    # builds a ModelOpt NVFP4 DeepSeek checkpoint's NextN layer unquantized (bf16).
    unquantized: bool = False
    # Of dense_params_m, its attention's that tensor parallelism splits: what each
    # data-parallel attention group holds a copy of (0: not given, no copy priced).
    attention_params_m: float = 0.0

    def __post_init__(self) -> None:
        _positive(self, "dense_params_m", "kv_bytes_per_token")
        _in_share(self, "replicated_params_m", self.dense_params_m, "of dense_params_m")
        _in_share(self, "replicated_unquantized_m", self.replicated_params_m,
                  "of replicated_params_m")
        _in_share(self, "attention_params_m", self.dense_params_m - self.replicated_params_m,
                  "of dense_params_m, less replicated_params_m", slack=1.000001)

    def width(self, target: Target) -> float:
        """Bytes per parameter of the layer's own weights (the head is the target's)."""
        return target.unquantized_bytes if self.unquantized else target.weight_bytes

    def whole_extra_bytes(self, target: Target, tp: int) -> float:
        """What `tp` GPUs hold (and a pass reads) of the replicated part beyond its split
        share at the layer's width: every GPU's whole copy, its unquantized part at the
        target's unquantized width."""
        width, kept = self.width(target), self.replicated_unquantized_m * 1e6
        rest = self.replicated_params_m * 1e6 - kept
        return rest * (tp - 1) * width + kept * (tp * target.unquantized_bytes - width)

    def attention_extra_bytes(self, target: Target, groups: int) -> float:
        """What `groups` data-parallel attention groups hold (and a pass reads) of its
        attention beyond one split: groups - 1 further copies, at the layer's width."""
        return (groups - 1) * self.attention_params_m * 1e6 * self.width(target)


@dataclass(frozen=True)
class Method:
    """A draft method: what its draft pass costs and, per dataset, how often its guesses
    are right. A profile's `methods` hold those besides its own draft head, which
    `Profile.method()` presents as one too (a head with the top-level draft).

    drafter says who drafts, and so how a draft pass costs:
      head        a draft head fed with the target's hidden states (EAGLE, EAGLE3): its own
                  weights (`draft`), read on every draft pass;
      mtp         the target's own MTP layer (`mtp`): a slice of the target, no separate
                  weights; it reads the target's lm_head on every pass;
      standalone  a separate small model (`draft`: all its layers, its own embedding, head
                  and KV cache) run on every draft pass;
      ngram       no draft forward at all: a CPU suffix-trie match per request and round
                  (`lookup_us`); it only guesses text seen before, so its acceptance is low
                  on novel text.
    """

    drafter: str
    acceptance: dict[str, Acceptance]  # per dataset of the profile
    draft: Draft | None = None  # head, standalone
    mtp: MTP | None = None  # mtp
    lookup_us: float = 0.0  # ngram: trie match and tree build, per request and round
    # Fixed cost of one draft pass (kernel launches, sampling over its vocabulary); None:
    # calibration.draft_overhead_ms, the draft head's. A whole MoE decoder layer scored
    # over the full vocabulary launches more kernels than a one-layer head.
    pass_overhead_ms: float | None = None

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise FieldError("drafter", f"must be one of {', '.join(DRAFTERS)}, got "
                             f"'{self.drafter}'")
        needs = {"head": "draft", "standalone": "draft", "mtp": "mtp"}.get(self.drafter)
        for part in ("draft", "mtp"):
            given = getattr(self, part) is not None
            if part == needs and not given:
                raise FieldError(part, f"a {self.drafter} method needs its {part} facts")
            if part != needs and given:
                raise FieldError(part, f"a {self.drafter} method has no {part} section")
        if self.drafter != "head" and self.draft is not None and self.draft.fc_params_m:
            raise FieldError("draft.fc_params_m", "only a draft head (EAGLE3) has an fc over "
                             "the target's hidden states; a standalone model reads all its "
                             "parameters on every pass")
        if self.lookup_us < 0:
            raise FieldError("lookup_us", f"must be >= 0, got {self.lookup_us}")
        if self.lookup_us and self.drafter != "ngram":
            raise FieldError("lookup_us", "only an ngram method has a trie lookup")
        if self.pass_overhead_ms is not None and (
                self.pass_overhead_ms < 0 or self.drafter == "ngram"):
            raise FieldError("pass_overhead_ms", "must be >= 0, for a method with a draft "
                             "forward (ngram has none)")

    @property
    def has_draft_forward(self) -> bool:
        return self.drafter != "ngram"

    def resident_params(self, target: Target) -> float:
        """Parameters the draft adds to GPU memory (an MTP layer shares the target's
        embedding and lm_head; n-gram lookup has none)."""
        if self.draft is not None:
            return self.draft.params_m * 1e6
        if self.mtp is not None:
            experts = 0.0
            if self.mtp.routed_experts and target.moe is not None:
                experts = target.moe.experts * target.moe.expert_params_m * 1e6
            return self.mtp.dense_params_m * 1e6 + experts
        return 0.0

    def resident_bytes(self, target: Target, tp: int = 1) -> float:
        """Bytes the draft adds to the `tp` GPUs together (an MTP layer's replicated part
        and an EAGLE3 head's fc whole on each)."""
        if self.draft is not None:
            d = self.draft
            held = d.resident_params_m or d.params_m
            return (held + (tp - 1) * d.fc_params_m) * 1e6 * d.weight_bytes
        if self.mtp is None:
            return self.resident_params(target) * target.weight_bytes
        return (self.resident_params(target) * self.mtp.width(target)
                + self.mtp.whole_extra_bytes(target, tp))

    @property
    def kv_bytes_per_token(self) -> float:
        if self.draft is not None:
            return self.draft.kv_bytes_per_token
        return self.mtp.kv_bytes_per_token if self.mtp is not None else 0.0

    def kv_share(self, target: Target, tp: int) -> float:
        """The share of the draft's KV cache each of `tp` GPUs holds: its own heads' for a
        draft model, the target's for an MTP layer (an attention layer of the target's)."""
        if self.draft is not None:
            return _kv_share(self.draft.kv_heads, tp)
        return target.kv_share(tp)


@dataclass(frozen=True)
class Calibration:
    """Free parameters of the cost model, fitted to measurements."""

    step_overhead_ms: float = 5.0  # fixed cost of a target forward (launches, scheduler)
    draft_overhead_ms: float = 0.5  # fixed cost of a draft forward
    round_overhead_ms: float = 0.3  # per speculative round: tree build, verify bookkeeping
    token_overhead_us: float = 2.0  # per token in a forward (sampling, copies, norms)
    weight_bandwidth_eff: float = 0.7  # achieved share of HBM bandwidth for weight reads
    kv_bandwidth_eff: float = 0.5  # achieved share for KV-cache and state reads
    compute_eff: float = 0.5  # achieved share of peak FLOPs
    tree_routing_diversity: float = 1.0  # MoE routing spread of a tree's extra candidates

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith(("_eff", "_diversity")) and not 0 < value <= 1:
                raise ValueError(f"{f.name} must be in (0, 1], got {value}")
            if value < 0:
                raise ValueError(f"{f.name} must be >= 0, got {value}")


@dataclass(frozen=True)
class Dataset:
    """A workload: how predictable its text is and what shape its requests have."""

    acceptance: Acceptance
    context_tokens: float = 1024.0  # mean KV length a decode step reads per request
    prompt_tokens: int = 256
    output_tokens: int = 256
    routing_diversity: float = 1.0  # 1 = uniform MoE routing; lower = more concentrated

    def __post_init__(self) -> None:
        _positive(self, "context_tokens", "prompt_tokens", "output_tokens", "routing_diversity")


@dataclass(frozen=True)
class Noise:
    """Measurement noise: a per-launch speed factor and per-measurement drift."""

    launch_cv: float = 0.02
    measurement_cv: float = 0.02

    def __post_init__(self) -> None:
        for name in ("launch_cv", "measurement_cv"):
            if not 0 <= getattr(self, name) < 1:  # a spread of 100% is no measurement
                raise FieldError(name, f"must be in [0, 1), got {getattr(self, name):g}")


@dataclass(frozen=True)
class ServerDefaults:
    tp: int | None = None  # defaults to hardware.gpus
    # Data-parallel attention groups (SGLang's --attn-dp-size, or --dp-size with
    # --enable-dp-attention; 1: none): each group runs the attention of its own requests
    # on tp / attention_dp GPUs, the MoE and the lm_head still over all tp.
    attention_dp: int = 1
    mem_fraction_static: float = 0.85
    reserve_context_tokens: int = 4096  # KV each running request must be able to hold
    activation_bytes_per_token: float = 0.0  # workspace per token in flight (0: derived)

    def __post_init__(self) -> None:
        if self.tp is not None and self.tp < 1:
            raise FieldError("tp", f"must be >= 1, got {self.tp}")
        if self.attention_dp < 1:
            raise FieldError("attention_dp", f"must be >= 1, got {self.attention_dp}")
        if not 0 < self.mem_fraction_static <= 1:  # SGLang's share of each GPU's memory
            raise FieldError("mem_fraction_static",
                             f"must be in (0, 1], got {self.mem_fraction_static:g}")
        for name in ("reserve_context_tokens", "activation_bytes_per_token"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"must be >= 0, got {getattr(self, name):g}")


@dataclass(frozen=True)
class Profile:
    name: str
    hardware: Hardware
    target: Target
    # Its own draft head (DEFAULT_METHOD). None: a profile of other methods only (an auto
    # prior of a target's MTP layer, NEXTN, which has no draft model).
    draft: Draft | None = None
    datasets: dict[str, Dataset] = field(default_factory=dict)
    calibration: Calibration = field(default_factory=Calibration)
    noise: Noise = field(default_factory=Noise)
    server: ServerDefaults = field(default_factory=ServerDefaults)
    description: str = ""
    methods: dict[str, Method] = field(default_factory=dict)  # draft methods besides `draft`

    def __post_init__(self) -> None:
        if not self.datasets:
            raise ValueError("a profile needs at least one dataset under 'datasets'")
        if self.draft is None and not self.methods:
            raise FieldError("draft", "a profile needs its draft head's facts, or another "
                             "draft method under 'methods'")
        for name, method in self.methods.items():
            if name == DEFAULT_METHOD:
                raise FieldError(f"methods.{name}", (
                    f"{DEFAULT_METHOD} is the profile's own draft head: describe it with the "
                    "top-level draft and each dataset's acceptance"))
            missing = [d for d in self.datasets if d not in method.acceptance]
            unknown = [d for d in method.acceptance if d not in self.datasets]
            if missing:
                raise FieldError(f"methods.{name}.acceptance", (
                    f"{name} gives no acceptance for dataset(s) {', '.join(missing)}: a "
                    "method's acceptance must cover every dataset of the profile"))
            if unknown:
                raise FieldError(f"methods.{name}.acceptance.{unknown[0]}", (
                    f"no such dataset{closest(unknown[0], self.datasets)}; the profile's "
                    f"datasets: {', '.join(self.datasets)}"))
            if method.drafter == "mtp" and method.mtp is not None and (
                    method.mtp.routed_experts and self.target.moe is None):
                raise FieldError(f"methods.{name}.mtp.routed_experts", (
                    "the target has no moe section for an MoE MTP layer to route to; set "
                    "routed_experts: false and count its MLP in dense_params_m"))

    @property
    def tp(self) -> int:
        return self.server.tp or self.hardware.gpus

    def attention_groups(self, tp: int) -> int:
        """The data-parallel attention groups of a server of `tp` GPUs (1: none)."""
        groups = self.server.attention_dp
        if tp % groups:
            raise TreetuneError(f"{groups} data-parallel attention groups "
                                f"(server.attention_dp) do not split tp {tp} evenly")
        return groups

    def dataset(self, name: str) -> Dataset:
        try:
            return self.datasets[name]
        except KeyError:
            raise TreetuneError(
                f"profile '{self.name}' has no dataset '{name}'{closest(name, self.datasets)}; "
                f"it knows: {', '.join(self.datasets)}"
            ) from None

    @property
    def method_names(self) -> list[str]:
        """The draft methods this profile can predict: its own draft head first."""
        return [DEFAULT_METHOD, *self.methods] if self.draft is not None else [*self.methods]

    def method(self, name: str | None = None) -> Method:
        """A draft method by name; None: the profile's first (its own draft head, when it
        has one); DEFAULT_METHOD: its own draft head."""
        if name is None:
            name = self.method_names[0]
        if name == DEFAULT_METHOD and self.draft is not None:
            return Method("head", {d: data.acceptance for d, data in self.datasets.items()},
                          draft=self.draft)
        if name == DEFAULT_METHOD:  # and no draft head
            raise TreetuneError(
                f"profile '{self.name}' has no draft head ({DEFAULT_METHOD}): it describes "
                f"{', '.join(self.method_names)}; add a top-level draft section (the head's "
                "facts) to serve or predict it")
        try:
            return self.methods[name]
        except KeyError:
            raise TreetuneError(
                f"profile '{self.name}' has no draft method '{name}'"
                f"{closest(name, self.method_names)}: it describes "
                f"{', '.join(self.method_names)}; add a methods.{name} section (its draft cost "
                "and its acceptance per dataset) to serve or predict it") from None

    def replace(self, **changes: Any) -> Profile:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        data = _plain(dataclasses.asdict(self))
        if not data.get("methods"):
            data.pop("methods", None)  # profiles of one draft head stay as they were
        if not self.target.unquantized_params_b:  # nor do those of one weight width
            data["target"].pop("unquantized_params_b")
            data["target"].pop("unquantized_bytes")
        for sections in (data, *data.get("methods", {}).values()):
            _drop_unset(sections)  # nor do those that leave the per-GPU facts out
        if self.server.attention_dp == 1:
            data["server"].pop("attention_dp")  # nor those without attention groups
        return {"name": data.pop("name"), "description": data.pop("description"), **data}

    def save(self, path: str | Path) -> None:
        dump_yaml(self.to_dict(), path)


def with_attention_dp(profile: Profile, groups: int) -> Profile:
    """`profile` served with its attention in `groups` data-parallel groups."""
    return profile.replace(server=dataclasses.replace(profile.server, attention_dp=groups))


def with_memory_share(profile: Profile, share: float) -> Profile:
    """`profile` served with `share` of each GPU's memory for weights and KV cache
    (SGLang's --mem-fraction-static)."""
    return profile.replace(server=dataclasses.replace(profile.server,
                                                      mem_fraction_static=share))


# Per-GPU facts a profile leaves out while they hold their default (0, false), by section.
UNSET_DROPPED = {"target": ("kv_heads", "replicated_params_b", "replicated_unquantized_b",
                            "attention_params_b", "attention_unquantized_b"),
                 "draft": ("kv_heads", "fc_params_m", "resident_params_m"),
                 "mtp": ("replicated_params_m", "replicated_unquantized_m", "unquantized",
                         "attention_params_m")}


def _drop_unset(sections: dict[str, Any]) -> None:
    """Drop UNSET_DROPPED's keys at their defaults from a profile's (or a method's)
    sections, in place."""
    for part, keys in UNSET_DROPPED.items():
        for key in keys:
            if part in sections and not sections[part].get(key):
                sections[part].pop(key, None)


def _kv_share(kv_heads: int, tp: int) -> float:
    """Each of `tp` GPUs' share of a cache of `kv_heads` heads (0: split evenly): SGLang
    copies a head to several GPUs when there are fewer heads than GPUs."""
    return 1.0 / min(tp, kv_heads) if kv_heads else 1.0 / tp


def _plain(value: Any) -> Any:
    """asdict output without tuples or None-valued optional keys, for tidy YAML."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not value.is_integer():
        return float(f"{value:.5g}")  # fitted values: no false precision in the YAML
    # Whole numbers are counted facts (147456 KV bytes per token), kept exact.
    return value


def _in_share(obj: object, name: str, limit: float, what: str, *, scale: float = 1.0,
              slack: float = 1.0) -> None:
    """Refuse field `name` of `obj` outside 0..`limit` (`what` the limit is; `scale`: the
    field's units in the limit's, `slack`: a margin for counts rounded in a file)."""
    value = getattr(obj, name)
    if not 0 <= value * scale <= limit * slack:
        raise FieldError(name, f"must be in 0..{limit / scale:g} ({what}), got {value:g}")


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def shipped_profiles() -> list[str]:
    folder = resources.files("treetune") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def resolve_profile_path(name_or_path: str | Path) -> Path:
    """A shipped profile's name, or the path of a profile file."""
    text = str(name_or_path)
    candidate = Path(text)
    if candidate.suffix in (".yaml", ".yml") or candidate.exists() or "/" in text:
        return candidate
    shipped = resources.files("treetune") / "profiles" / f"{text}.yaml"
    if shipped.is_file():
        return Path(str(shipped))
    names = shipped_profiles()
    raise TreetuneError(
        f"unknown profile '{text}'{closest(text, names)}: give a profile file path or one of "
        f"the shipped profiles: {', '.join(names)}"
    )


def load_profile(name_or_path: str | Path) -> Profile:
    path = resolve_profile_path(name_or_path)
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigFileError(path, "a profile must be a mapping with hardware, target, ...")
    return build(Profile, data, path)
