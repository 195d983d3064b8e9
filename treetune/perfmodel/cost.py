"""Step-time cost model: roofline plus fixed costs, per forward pass.

A forward over n tokens from b requests costs
    fixed + max(bytes / bandwidth, flops / peak) + tensor-parallel all-reduces + n * per-token
where bytes are the weights touched (for MoE, the distinct experts n tokens route to)
plus the KV cache and recurrent state of the b requests.

What a draft pass reads depends on the draft method: a draft head or a standalone model
reads its own weights; the target's MTP layer reads that layer (for an MoE layer, the
experts its tokens route to) plus the target's full-vocabulary lm_head; n-gram lookup runs
no forward at all, only a CPU trie match per request and round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from treetune.config import TreeConfig
from treetune.perfmodel.profile import MTP, Dataset, Draft, Method, Profile

ACTIVATION_BYTES = 2  # bf16 activations on the all-reduce wire


@dataclass(frozen=True)
class RoundTime:
    """Seconds spent in one speculative round (or one plain decode step)."""

    draft_s: float
    verify_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return self.draft_s + self.verify_s + self.overhead_s


def distinct_experts(independent_tokens: float, experts: int, per_token: int) -> float:
    """Expected distinct experts touched by n independently, uniformly routed tokens."""
    if independent_tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - per_token / experts) ** independent_tokens)


def independent_tokens(
    requests: float, tokens_per_request: float, diversity: float, tree_diversity: float
) -> float:
    """How many uniformly routed tokens a pass is worth for expert coverage.

    Real routing is correlated: the requests of one workload pick overlapping experts
    (`diversity` < 1), and a draft tree's extra candidates, mostly low-rank guesses, route
    with their own diversity (`tree_diversity`).
    """
    extra = requests * (tokens_per_request - 1.0)
    return 1.0 + (requests - 1.0) * diversity + extra * tree_diversity


def busiest_group(requests: float, groups: int) -> float:
    """The requests of the busiest of `groups` data-parallel attention groups, each new
    request given to the least loaded (all of them with one group)."""
    return requests if groups == 1 else math.ceil(requests / groups - 1e-9)


class CostModel:
    """Forward-pass and round times for one profile, draft method and tensor-parallel size.

    With data-parallel attention in G groups (`server.attention_dp`, or `attention_dp`
    here), each group runs the attention of its own requests on tp / G GPUs: a target pass
    reads G copies of the attention weights and waits for the group with the most
    requests, whose GPUs read their KV cache (at a share of tp / G GPUs) and recurrent
    state; the MoE, the lm_head and the all-reduces stay as over tp. A draft head drafts
    within its group (SGLang's draft_tp_context): a server of tp / G GPUs drafting the
    busiest group's requests (an EAGLE head, which SGLang builds over all tp, is priced
    alike). An MTP layer's attention is a target layer's: a copy a group, its KV read by
    group. Requests go to the least loaded group, as treetune launches such servers."""

    def __init__(self, profile: Profile, tp: int | None = None,
                 method: Method | str | None = None, attention_dp: int | None = None) -> None:
        self.profile = profile
        self.method = method if isinstance(method, Method) else profile.method(method)
        self.tp = tp or profile.tp
        self.groups = attention_dp or profile.attention_groups(self.tp)
        hw = profile.hardware
        self.bandwidth = hw.bandwidth_tb_s * 1e12 * self.tp
        self.flops_peak = hw.peak_tflops * 1e12 * self.tp
        self.link = hw.interconnect_gb_s * 1e9
        # One attention group's GPUs, and the server a draft head drafts as in one.
        self.group_gpus = self.tp // self.groups
        self._group = None if self.groups == 1 else CostModel(
            profile, self.group_gpus, self.method, attention_dp=1)

    def busiest(self, requests: float) -> float:
        """The requests of the busiest attention group (all of them without groups)."""
        return busiest_group(requests, self.groups)

    @property
    def _pass_overhead_s(self) -> float:
        """Fixed cost of one draft pass of this method."""
        own = self.method.pass_overhead_ms
        return (self.profile.calibration.draft_overhead_ms if own is None else own) * 1e-3

    def _comm(self, tokens: float, layers: int) -> float:
        if self.tp <= 1:
            return 0.0
        hw = self.profile.hardware
        message = tokens * self.profile.target.hidden_size * ACTIVATION_BYTES
        ring = 2.0 * (self.tp - 1) / self.tp * message / self.link
        return 2 * layers * (hw.allreduce_latency_us * 1e-6 + ring)  # attention + MLP

    def target_pass(self, requests: float, tokens_per_request: float, data: Dataset,
                    *, prefill: bool = False) -> float:
        """One target forward over `tokens_per_request` tokens from each of `requests`.

        A prefill keeps only each request's final recurrent state; decode and verify keep
        one per token so that rejected drafts can be rolled back.
        """
        t, c = self.profile.target, self.profile.calibration
        tokens = requests * tokens_per_request
        context = data.context_tokens
        params = t.always_read_params
        if t.moe is not None:
            routed = independent_tokens(
                requests, tokens_per_request, data.routing_diversity, c.tree_routing_diversity
            )
            params += distinct_experts(routed, t.moe.experts, t.moe.experts_per_token) * (
                t.expert_params
            )
        # The bandwidth is all GPUs': a replicated parameter is read by each of them, an
        # attention group's copy by each of its GPUs.
        weight_s = (t.weight_bytes_of(params) + t.replicated_extra_bytes(self.tp)
                    + t.attention_extra_bytes(self.groups)) / (
            self.bandwidth * c.weight_bandwidth_eff)
        # Linear-attention layers read each request's recurrent state once and, to roll back
        # rejected drafts, write one state per processed token (a tree node forks the state).
        state = t.state_bytes_per_request * (2 if prefill else 1 + tokens_per_request)
        # Each rank reads its share of its attention group's KV cache: all of an MLA
        # latent, a copied head's whole (fewer KV heads than the group's GPUs);
        # sliding-window layers read no more than their window. The pass waits for the
        # busiest group.
        kv = t.kv_bytes(context) * t.kv_share(self.group_gpus) * self.group_gpus
        kv_bytes = self.busiest(requests) * (kv + state)
        kv_s = kv_bytes / (self.bandwidth / self.groups * c.kv_bandwidth_eff)
        replicated = (self.tp - 1) * t.replicated_params_b * 1e9
        flops = 2.0 * (t.active_params_b * 1e9 + replicated) * tokens
        compute_s = flops / (self.flops_peak * c.compute_eff)
        return (
            c.step_overhead_ms * 1e-3
            + max(weight_s + kv_s, compute_s)
            + self._comm(tokens, t.layers)
            + c.token_overhead_us * 1e-6 * tokens
        )

    def draft_pass(self, tokens: float, requests: float, context: float,
                   routing_diversity: float = 1.0, *, extend: bool = False) -> float:
        """One forward of the method's draft over `tokens` tokens from `requests` requests
        (0 for n-gram lookup, which has none). `routing_diversity`: the workload's, for an
        MoE MTP layer; `extend`: a pass fed the target's hidden states (a round's draft
        extend, a prefill), the only ones an EAGLE3 head's fc runs in."""
        m = self.method
        if m.draft is not None and self._group is not None:
            busiest = self.busiest(requests)
            return self._group.draft_pass(tokens * busiest / max(requests, 1e-9), busiest,
                                          context, routing_diversity, extend=extend)
        if m.draft is not None:
            return self._model_pass(m.draft, tokens, requests, context, extend)
        if m.mtp is not None:
            return self._mtp_pass(m.mtp, tokens, requests, context, routing_diversity)
        return 0.0

    def _model_pass(self, d: Draft, tokens: float, requests: float, context: float,
                    extend: bool) -> float:
        """A draft with weights of its own (EAGLE3: one layer plus its LM head, and its fc
        whole on every GPU in an extend; a standalone model: all its layers)."""
        c = self.profile.calibration
        params = d.params_m - d.fc_params_m + (self.tp * d.fc_params_m if extend else 0.0)
        weight_s = params * 1e6 * d.weight_bytes / (self.bandwidth * c.weight_bandwidth_eff)
        kv = d.kv_bytes_per_token * self.method.kv_share(self.profile.target, self.tp) * self.tp
        kv_s = requests * context * kv / (self.bandwidth * c.kv_bandwidth_eff)
        compute_s = 2.0 * params * 1e6 * tokens / (self.flops_peak * c.compute_eff)
        return (
            self._pass_overhead_s
            + max(weight_s + kv_s, compute_s)
            + self._comm(tokens, d.layers)
            + c.token_overhead_us * 1e-6 * tokens
        )

    def _mtp_pass(self, mtp: MTP, tokens: float, requests: float, context: float,
                  routing_diversity: float) -> float:
        """The target's MTP layer: its dense part, the experts its tokens route to (an MoE
        layer of the target's shape, sharded like the target's) and the target's
        full-vocabulary lm_head, at the target's weight width (the head at the unquantized
        width, as far as the checkpoint keeps that many parameters unquantized: quantized
        checkpoints keep their head first); one layer's all-reduces.
        The lm_head is read whole every pass but scores only each request's last token
        (the draft's next guess), so its FLOPs follow the requests, not the tokens."""
        t, c = self.profile.target, self.profile.calibration
        layer = mtp.dense_params_m * 1e6
        read = layer + t.lm_head_params
        if mtp.routed_experts and t.moe is not None:
            expert = t.moe.expert_params_m * 1e6
            routed = independent_tokens(requests, tokens / max(requests, 1e-9),
                                        routing_diversity, c.tree_routing_diversity)
            read += distinct_experts(routed, t.moe.experts, t.moe.experts_per_token) * expert
            layer += t.moe.experts_per_token * expert
        wide = min(t.lm_head_params, t.unquantized_params_b * 1e9)
        head_bytes = (t.lm_head_params - wide) * t.weight_bytes + wide * t.unquantized_bytes
        read_bytes = ((read - t.lm_head_params) * mtp.width(t) + head_bytes
                      + mtp.whole_extra_bytes(t, self.tp)
                      + mtp.attention_extra_bytes(t, self.groups))
        weight_s = read_bytes / (self.bandwidth * c.weight_bandwidth_eff)
        # Its attention is the target's kind, split as the target's (by attention group).
        kv = mtp.kv_bytes_per_token * t.kv_share(self.group_gpus) * self.group_gpus
        kv_s = self.busiest(requests) * context * kv / (
            self.bandwidth / self.groups * c.kv_bandwidth_eff)
        layer += (self.tp - 1) * mtp.replicated_params_m * 1e6  # each GPU computes it whole
        flops = 2.0 * (layer * tokens + t.lm_head_params * requests)
        compute_s = flops / (self.flops_peak * c.compute_eff)
        return (
            self._pass_overhead_s
            + max(weight_s + kv_s, compute_s)
            + self._comm(tokens, 1)
            + c.token_overhead_us * 1e-6 * tokens
        )

    def baseline_step(self, batch: float, data: Dataset) -> RoundTime:
        return RoundTime(0.0, self.target_pass(batch, 1, data), 0.0)

    def spec_round(self, config: TreeConfig, batch: float, data: Dataset) -> RoundTime:
        """One draft-extend pass over B*(S+1) tokens, S-1 draft-decode passes over B*K
        tokens, one verify over B*N tokens (tree attention reads each request's KV once).

        The draft extend re-reads only the accepted path, at most S+1 tokens a request:
        SGLang's EAGLE worker sizes it (and its CUDA graphs) as `speculative_num_steps + 1`
        tokens per request whatever N is, so a wide tree's N does not enter it.

        N-gram lookup has no draft pass: its tree comes from a CPU trie match per request,
        counted with the round's overhead.
        """
        ctx, overhead = data.context_tokens, self.profile.calibration.round_overhead_ms * 1e-3
        verify = self.target_pass(batch, config.draft_tokens, data)
        if not self.method.has_draft_forward:
            return RoundTime(0.0, verify, overhead + batch * self.method.lookup_us * 1e-6)
        diversity = data.routing_diversity
        draft = self.draft_pass(batch * (config.steps + 1), batch, ctx, diversity,
                                extend=True) + (
            config.steps - 1
        ) * self.draft_pass(batch * config.topk, batch, ctx, diversity)
        return RoundTime(draft, verify, overhead)
