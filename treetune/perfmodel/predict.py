"""Noise-free predictions: throughput, speedup and accept length per (config, dataset, batch):
in the steady state of decoding (`predict`), or for whole requests of a shape under a
closed or open loop, as a benchmark measures them (`predict_serving`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treetune.config import BASELINE, ServerConfig, TreeConfig, tree_fields
from treetune.perfmodel.acceptance import (
    Acceptance,
    DraftTree,
    accepted_distribution,
    build_tree,
    expected_accept_length,
    sample_accepted,
)
from treetune.perfmodel.cost import CostModel, RoundTime
from treetune.perfmodel.memory import RunningCaps, check_memory
from treetune.perfmodel.profile import Profile
from treetune.perfmodel.serving import Serving, Shape, closed_loop, open_loop


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
        """The stable JSON record of `treetune predict --json`. A server that would not
        start (`oom`) delivers nothing: its throughput and speedup are null, so that no
        consumer ranks it by what it would do if it started."""
        return {
            **tree_fields(self.config),
            "batch": self.batch,
            "dataset": self.dataset,
            "baseline_tok_s": round(self.baseline_tok_s, 3),
            "spec_tok_s": None if self.oom else round(self.spec_tok_s, 3),
            "speedup": None if self.oom else round(self.speedup, 4),
            "accept_length": round(self.accept_length, 4),
            "oom": self.oom,
        }


@dataclass(frozen=True)
class ServingPrediction:
    """A config against the baseline on one cell (a closed loop at `batch` clients, or an
    open loop at `rate` requests/s with `batch` 0) of whole requests of one shape.

    speedup: closed loop, the output throughputs' ratio (what a study measures); open loop,
    the ratio of the baseline's TPOT to the config's: below saturation both deliver what
    arrives, and speculation shows as faster requests.
    """

    config: ServerConfig
    dataset: str
    shape: Shape
    batch: int
    rate: float | None
    max_running: int
    baseline: Serving
    spec: Serving
    accept_length: float
    oom: bool

    @property
    def speedup(self) -> float:
        if self.rate is None:
            return self.spec.output_tok_s / self.baseline.output_tok_s
        return self.baseline.tpot_s / self.spec.tpot_s

    def record(self) -> dict[str, object]:
        """The stable JSON record of `treetune predict --prompt-tokens/--output-tokens/--rate
        --json`: the steady-state record's keys, and the shape's and latencies' (the
        config's own throughput, speedup, latencies and saturation null when `oom`)."""

        def ms(seconds: float) -> float | None:
            return round(seconds * 1e3, 4) if seconds != float("inf") else None

        return {
            **tree_fields(self.config),
            "batch": self.batch,
            "rate": self.rate,
            "dataset": self.dataset,
            "prompt_tokens": self.shape.prompt_tokens,
            "output_tokens": self.shape.output_tokens,
            "max_running_requests": self.max_running,
            "baseline_tok_s": round(self.baseline.output_tok_s, 3),
            "spec_tok_s": None if self.oom else round(self.spec.output_tok_s, 3),
            "speedup": None if self.oom else round(self.speedup, 4),
            "accept_length": round(self.accept_length, 4),
            "baseline_tpot_ms": ms(self.baseline.tpot_s),
            "tpot_ms": None if self.oom else ms(self.spec.tpot_s),
            "baseline_ttft_ms": ms(self.baseline.ttft_s),
            "ttft_ms": None if self.oom else ms(self.spec.ttft_s),
            "baseline_saturated": self.baseline.saturated,
            "saturated": None if self.oom else self.spec.saturated,
            "oom": self.oom,
        }


class PerfModel:
    """Everything the profile predicts for one draft method (default: the profile's own
    draft head) at one tensor-parallel size. A profile without an entry for `method`
    refuses with a TreetuneError naming the methods it has."""

    def __init__(self, profile: Profile, tp: int | None = None,
                 method: str | None = None) -> None:
        self.profile = profile
        self.method_name = method or profile.method_names[0]
        self.method = profile.method(method)
        self.cost = CostModel(profile, tp, self.method)
        self._trees: dict[tuple[TreeConfig, str], DraftTree] = {}

    def for_method(self, method: str) -> PerfModel:
        """The same truth for another draft method of the profile (a world keeps its
        effects)."""
        return PerfModel(self.profile, self.cost.tp, method)

    def launch_speed(self, rng: np.random.Generator) -> float:
        """A launch's own speed factor beyond the launch noise (a world's slow launches):
        1 here, drawing nothing."""
        return 1.0

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

    def _tree(self, config: TreeConfig, dataset: str) -> DraftTree:
        tree = self._trees.get((config, dataset))
        if tree is None:
            tree = self._trees[config, dataset] = build_tree(config, self.acceptance(dataset))
        return tree

    def sample_accepted(self, config: ServerConfig, dataset: str, rng: np.random.Generator,
                        count: int) -> np.ndarray:
        """Accepted drafts (bonus excluded) of `count` requests in one verify round."""
        if not isinstance(config, TreeConfig):
            return np.zeros(count, dtype=np.int64)
        return sample_accepted(self._tree(config, dataset), self.acceptance(dataset), rng,
                               count)

    def gains_distribution(self, config: ServerConfig, dataset: str) -> np.ndarray:
        """P(a request gains k tokens in one round) for k = 0..steps+1: its accepted
        drafts plus the bonus token (one token a step without speculation)."""
        if not isinstance(config, TreeConfig):
            return np.array([0.0, 1.0])
        return np.concatenate([[0.0], accepted_distribution(self._tree(config, dataset))])

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
                                            data.routing_diversity, extend=True)
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

    def shape(self, dataset: str) -> Shape:
        """The dataset's mean request shape, as the profile gives it."""
        data = self.profile.dataset(dataset)
        return Shape(data.prompt_tokens, data.output_tokens)

    def closed_loop(self, config: ServerConfig, dataset: str, shape: Shape, concurrency: int,
                    max_running: int | None = None) -> Serving:
        """Whole requests of `shape` from `concurrency` clients, each sending its next
        request when its last one ends (`treetune.perfmodel.serving`)."""
        return closed_loop(self, config, dataset, shape, concurrency, max_running)

    def open_loop(self, config: ServerConfig, dataset: str, shape: Shape, rate: float,
                  max_running: int) -> Serving:
        """Whole requests of `shape` arriving at `rate` per second (Poisson)."""
        return open_loop(self, config, dataset, shape, rate, max_running)

    def predict_serving(self, config: ServerConfig, dataset: str, shape: Shape, *,
                        batch: int | None = None, rate: float | None = None,
                        max_running_requests: int | None = None) -> ServingPrediction:
        """`config` and the baseline serving whole requests of `shape`: closed loop at
        `batch` clients, or open loop at `rate` (give one). The server runs at most
        `max_running_requests` at once (default: the batch; required for a rate)."""
        if (batch is None) == (rate is None):
            raise ValueError("give a batch (closed loop) or a rate (open loop), not both")
        if batch is not None and batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if batch is None and max_running_requests is None:
            raise ValueError("an open loop needs max_running_requests")
        cap = max_running_requests or batch
        assert cap is not None

        def served(of: ServerConfig) -> tuple[Serving, bool]:
            # Every running request holds its whole prompt and output in the KV pool: as
            # many run at once as it holds.
            memory = check_memory(self.profile, of, cap, tp=self.cost.tp, method=self.method,
                                  context_tokens=shape.prompt_tokens + shape.output_tokens)
            running = memory.running(cap)
            if batch is not None:
                return self.closed_loop(of, dataset, shape, batch, running), memory.starts
            assert rate is not None
            return self.open_loop(of, dataset, shape, rate, running), memory.starts

        (base, _), (spec, starts) = served(BASELINE), served(config)
        return ServingPrediction(config, dataset, shape, batch or 0, rate, cap, base, spec,
                                 self.accept_length(config, dataset), not starts)

    def predict(
        self,
        config: ServerConfig,
        dataset: str,
        batch: int,
        max_running_requests: int | None = None,
    ) -> Prediction:
        # As many of the batch run at once as each server's KV pool holds.
        caps = RunningCaps(self.profile, max_running_requests or batch, self.cost.tp,
                           self.method)
        baseline = self.throughput(BASELINE, caps.batch(BASELINE, batch), dataset)
        size = caps.batch(config, batch)
        spec = self.throughput(config, size, dataset)
        return Prediction(
            config=config,
            dataset=dataset,
            batch=batch,
            baseline_tok_s=baseline,
            spec_tok_s=spec,
            speedup=spec / baseline,
            accept_length=self.accept_length(config, dataset),
            step_time_s=self.round_time(config, size, dataset).total_s,
            oom=not caps.starts(config),
        )
