"""Memory model: does a server start, and how many running requests does its KV pool hold?

SGLang takes `mem_fraction_static` of each GPU for weights plus the KV pool: the pool is
whatever the static share leaves after the weights (the draft's included), and the server
refuses to start only when that is nothing ("Not enough memory"). Speculation adds the
draft's weights and KV, and reserves max(S*K, N) extra slots per running request. What the
static share leaves out (1 - mem_fraction_static) holds the workspace, logits and
activations for batch * N tokens in flight, which CUDA-graph capture allocates at start:
a server whose workspace outgrows it is taken not to start either. A pool too small for
the running requests' reserve does not stop a server: SGLang admits requests while the pool
has room and retracts them when it runs short, so the server runs as many as the pool
holds (`MemoryCheck.holds`). The draft's weights depend on the method: a draft head's or
standalone model's own; an MTP layer's (all its experts resident; embedding and lm_head
shared with the target); none for n-gram lookup, which reserves only its N verify slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.perfmodel.cost import busiest_group
from treetune.perfmodel.profile import Method, Profile

GB = 1e9
LOGIT_BYTES = 4  # fp32 logits for sampling and verification


@dataclass(frozen=True)
class MemoryCheck:
    fits: bool  # it starts, and its pool holds every running request asked for
    required_gb: float  # per GPU: weights and the KV reserve of the requests asked for
    available_gb: float  # per GPU, after mem_fraction_static
    reason: str
    starts: bool = True  # SGLang starts it (a KV pool left, the workspace in the rest)
    holds: int = 0  # running requests whose KV reserve the pool holds at once
    # Why it cannot start: "weights" (they leave no KV pool) or "workspace" (it outgrows
    # what the static share leaves); "" when it starts.
    cause: str = ""
    brief: str = ""  # the reason without its breakdown in parentheses

    def running(self, asked: int) -> int:
        """How many of `asked` running requests the server runs at once: what its pool
        holds, at least one (a short request still runs in a small pool)."""
        return max(1, min(asked, self.holds))


def check_memory(
    profile: Profile,
    config: ServerConfig,
    max_running_requests: int,
    *,
    tp: int | None = None,
    mem_fraction_static: float | None = None,
    method: Method | str | None = None,
    context_tokens: int | None = None,
) -> MemoryCheck:
    """`context_tokens`: what each running request holds at most (prompt and output), when
    longer than the profile's reserve (`server.reserve_context_tokens`)."""
    tp = tp or profile.tp
    fraction = mem_fraction_static or profile.server.mem_fraction_static
    t, server = profile.target, profile.server
    draft = method if isinstance(method, Method) else profile.method(method)
    available = profile.hardware.memory_gb * GB * fraction
    # With data-parallel attention, each of its groups holds a copy of the attention on its
    # tp / groups GPUs, and the KV cache of its own share of the requests (SGLang gives
    # each max_running_requests // groups; counted here for the busiest, rounded up).
    groups = profile.attention_groups(tp)
    gpus = tp // groups
    weights = (t.weight_bytes_of(t.total_params_b * 1e9) + t.replicated_extra_bytes(tp)
               + t.attention_extra_bytes(groups)) / tp
    if groups > 1:  # and SGLang holds the embedding whole on every GPU (at the bulk's width)
        weights += (tp - 1) / tp * t.lm_head_params * t.weight_bytes
    slots = max(server.reserve_context_tokens, context_tokens or 0)
    in_flight = max_running_requests
    draft_kv_per_token = 0.0
    if config is not BASELINE:
        assert isinstance(config, TreeConfig)
        if draft.draft is not None:  # a draft head: held whole within each attention group
            weights += draft.resident_bytes(t, gpus) / gpus
        else:  # an MTP layer: as the target's layers, its attention copied to each group
            weights += draft.resident_bytes(t, tp) / tp
            if draft.mtp is not None:
                weights += draft.mtp.attention_extra_bytes(t, groups) / tp
        # An MTP layer caches as the target's attention (an MLA latent whole on every rank).
        draft_kv_per_token = draft.kv_bytes_per_token * draft.kv_share(t, gpus)
        slots += config.kv_slots_per_round if draft.has_draft_forward else config.draft_tokens
        in_flight *= config.draft_tokens
    # An MLA latent is not split by tensor parallelism (every rank holds all of it), nor
    # is a KV head copied to several ranks.
    target_kv = t.kv_bytes(slots) * t.kv_share(gpus)
    per_request = target_kv + slots * draft_kv_per_token + t.state_bytes_per_request / gpus
    kv = busiest_group(max_running_requests, groups) * per_request
    pool = available - weights
    holds = int(pool // per_request) * groups if pool > 0 and per_request > 0 else 0
    per_token = server.activation_bytes_per_token or (
        t.vocab_size * LOGIT_BYTES + 16 * t.hidden_size * 2
    )
    workspace = in_flight * per_token / tp
    rest = profile.hardware.memory_gb * GB - available
    required = weights + kv
    parts = (
        f"weights {weights / GB:.1f} GB + KV {kv / GB:.1f} GB for {max_running_requests} "
        f"requests; workspace {workspace / GB:.1f} GB for {in_flight} tokens in flight"
    )
    leaves = (f"{fraction:g} x {profile.hardware.memory_gb:g} GB leaves "
              f"{available / GB:.1f} GB")
    if pool <= 0:
        brief = (f"out of memory: {config} needs {weights / GB:.1f} GB per GPU of weights "
                 f"but {leaves}: no room for a KV cache")
        return MemoryCheck(False, required / GB, available / GB, f"{brief} ({parts})",
                           starts=False, cause="weights", brief=brief)
    if workspace > rest:
        reason = (f"out of memory: {config} at --max-running-requests {max_running_requests} "
                  f"needs a workspace of {workspace / GB:.1f} GB per GPU for {in_flight} "
                  f"tokens in flight (logits and activations, captured in CUDA graphs) but "
                  f"{leaves} and {rest / GB:.1f} GB to the rest")
        return MemoryCheck(False, required / GB, available / GB, reason, starts=False,
                           cause="workspace")
    if required > available:
        reason = (f"its KV pool holds {holds} of {max_running_requests} running requests: "
                  f"{config} needs {required / GB:.1f} GB per GPU ({parts}) but {leaves}")
        return MemoryCheck(False, required / GB, available / GB, reason, holds=holds)
    return MemoryCheck(True, required / GB, available / GB, f"fits: {parts}", holds=holds)


class RunningCaps:
    """Each server asked to hold `asked` running requests, per config, judged once
    (`check_memory`; a fit moves no memory fact): whether it starts, and how many requests
    it runs at once (its KV pool's hold). A cell at a larger batch is served at that many,
    the others waiting."""

    def __init__(self, profile: Profile, asked: int, tp: int | None = None,
                 method: Method | str | None = None) -> None:
        self.profile, self.asked, self.tp, self.method = profile, asked, tp, method
        self._checks: dict[ServerConfig, MemoryCheck] = {}

    def check(self, config: ServerConfig) -> MemoryCheck:
        if config not in self._checks:
            self._checks[config] = check_memory(self.profile, config, self.asked, tp=self.tp,
                                                method=self.method)
        return self._checks[config]

    def starts(self, config: ServerConfig) -> bool:
        return self.check(config).starts

    def __call__(self, config: ServerConfig) -> int:
        """The requests it runs at once."""
        return self.check(config).running(self.asked)

    def batch(self, config: ServerConfig, batch: int) -> int:
        """The requests of a `batch`-client cell that run at once."""
        return min(batch, self(config))
