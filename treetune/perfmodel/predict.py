"""Noise-free predictions: throughput, speedup and accept length per (config, dataset, batch)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.perfmodel.acceptance import (
    Acceptance,
    DraftTree,
    build_tree,
    expected_accept_length,
    sample_accepted,
)
from treetune.perfmodel.cost import CostModel, RoundTime
from treetune.perfmodel.memory import check_memory
from treetune.perfmodel.profile import DEFAULT_METHOD, Profile


@dataclass(frozen=True)
class Prediction:
    config: ServerConfig
    dataset: str
    batch: int
    baseline_tok_s: float
    spec_tok_s: float
    speedup: float
    accept_length: float
    step_time_s: float  # one round of this config (one decode step for the baseline)
    oom: bool

    def record(self) -> dict[str, object]:
        """The stable JSON record of `treetune predict --json`."""
        tree = self.config if isinstance(self.config, TreeConfig) else None
        return {
            "steps": tree.steps if tree else None,
            "topk": tree.topk if tree else None,
            "draft_tokens": tree.draft_tokens if tree else None,
            "batch": self.batch,
            "dataset": self.dataset,
            "baseline_tok_s": round(self.baseline_tok_s, 3),
            "spec_tok_s": round(self.spec_tok_s, 3),
            "speedup": round(self.speedup, 4),
            "accept_length": round(self.accept_length, 4),
            "oom": self.oom,
        }


class PerfModel:
    """Everything the profile predicts for one draft method (default: the profile's own
    draft head) at one tensor-parallel size. A profile without an entry for `method`
    refuses with a TreetuneError naming the methods it has."""

    def __init__(self, profile: Profile, tp: int | None = None,
                 method: str | None = None) -> None:
        self.profile = profile
        self.method_name = method or DEFAULT_METHOD
        self.method = profile.method(method)
        self.cost = CostModel(profile, tp, self.method)
        self._trees: dict[tuple[TreeConfig, str], DraftTree] = {}

    def acceptance(self, dataset: str) -> Acceptance:
        """This method's acceptance on `dataset` (the profile must know the dataset)."""
        self.profile.dataset(dataset)
        return self.method.acceptance[dataset]

    def accept_length(self, config: ServerConfig, dataset: str) -> float:
        if config is BASELINE:
            return 1.0
        assert isinstance(config, TreeConfig)
        return expected_accept_length(config, self.acceptance(dataset))

    def round_time(self, config: ServerConfig, batch: float, dataset: str) -> RoundTime:
        data = self.profile.dataset(dataset)
        if config is BASELINE:
            return self.cost.baseline_step(batch, data)
        assert isinstance(config, TreeConfig)
        return self.cost.spec_round(config, batch, data)

    def sample_accepted(self, config: ServerConfig, dataset: str, rng: np.random.Generator,
                        count: int) -> np.ndarray:
        """Accepted drafts (bonus excluded) of `count` requests in one verify round."""
        if not isinstance(config, TreeConfig):
            return np.zeros(count, dtype=np.int64)
        acceptance = self.acceptance(dataset)
        tree = self._trees.get((config, dataset))
        if tree is None:
            tree = self._trees[config, dataset] = build_tree(config, acceptance)
        return sample_accepted(tree, acceptance, rng, count)

    def throughput(self, config: ServerConfig, batch: float, dataset: str) -> float:
        """Output tokens/s over the whole batch, decoding in steady state."""
        round_s = self.round_time(config, batch, dataset).total_s
        return batch * self.accept_length(config, dataset) / round_s

    def prefill_time(self, config: ServerConfig, requests: float, prompt_tokens: float,
                     dataset: str) -> float:
        """One extend pass over `requests` new prompts of `prompt_tokens` tokens: the
        target's, then (speculating) the draft's over the same tokens (none for n-gram)."""
        data = self.profile.dataset(dataset)
        seconds = self.cost.target_pass(requests, prompt_tokens, data, prefill=True)
        if isinstance(config, TreeConfig):
            seconds += self.cost.draft_pass(requests * prompt_tokens, requests, prompt_tokens,
                                            data.routing_diversity)
        return seconds

    def request_throughput(self, config: ServerConfig, dataset: str) -> float:
        """Output tokens/s of one request of the dataset's mean shape served alone: its
        prefill (which yields the first token), then (output - 1) / accept length rounds.
        What a batch-1 benchmark that times whole requests reports; far below `throughput`
        when answers are a few tokens long and the prefill dominates."""
        data = self.profile.dataset(dataset)
        prefill = self.prefill_time(config, 1, data.prompt_tokens, dataset)
        rounds = max(data.output_tokens - 1, 0) / self.accept_length(config, dataset)
        return data.output_tokens / (prefill + rounds * self.round_time(config, 1, dataset).total_s)

    def predict(
        self,
        config: ServerConfig,
        dataset: str,
        batch: int,
        max_running_requests: int | None = None,
    ) -> Prediction:
        baseline = self.throughput(BASELINE, batch, dataset)
        spec = self.throughput(config, batch, dataset)
        memory = check_memory(self.profile, config, max_running_requests or batch,
                              tp=self.cost.tp, method=self.method)
        return Prediction(
            config=config,
            dataset=dataset,
            batch=batch,
            baseline_tok_s=baseline,
            spec_tok_s=spec,
            speedup=spec / baseline,
            accept_length=self.accept_length(config, dataset),
            step_time_s=self.round_time(config, batch, dataset).total_s,
            oom=not memory.fits,
        )
