"""Proposers: which config to launch next. The runner only calls `next()` and `observe()`.

`TPEProposer` asks the per-batch Optuna studies in turn; every proposal is mapped to the
nearest valid canonical config of the space, and a config that was already launched (or is
running) is answered from its measurement instead of being launched again.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    IntDistribution,
)

from treetune.config import TreeConfig, candidate_pool_size
from treetune.results import LaunchResult, config_key
from treetune.space import SearchSpace
from treetune.study.storage import StudyStore

MAX_ASKS = 64  # proposals per slot before falling back to an untried config at random


@dataclass
class Proposal:
    config: TreeConfig
    # Trials (per batch size) waiting for this config's measurement.
    trials: list[tuple[int, optuna.trial.Trial, dict[str, int]]] = field(default_factory=list)


def knob_distributions(space: SearchSpace) -> dict[str, BaseDistribution]:
    def dist(values: tuple[int, ...]) -> BaseDistribution:
        contiguous = values == tuple(range(values[0], values[-1] + 1))
        return IntDistribution(values[0], values[-1]) if contiguous else \
            CategoricalDistribution(values)
    return {"steps": dist(space.steps), "topk": dist(space.topk),
            "draft_tokens": dist(space.draft_tokens)}


def nearest_config(space: SearchSpace, steps: int, topk: int, draft_tokens: int) -> TreeConfig:
    """The space's canonical config closest to a raw triple (SGLang would refuse or
    rewrite an out-of-range draft_tokens; the search never launches such a server)."""
    if space.allows(steps, topk, draft_tokens):
        return TreeConfig.of(steps, topk, draft_tokens)
    capped = min(draft_tokens, candidate_pool_size(steps, topk) + 1)
    if space.allows(steps, topk, capped):
        return TreeConfig.of(steps, topk, capped)
    return min(space.configs(), key=lambda c: (abs(c.steps - steps) + abs(c.topk - topk)
                                               + abs(c.draft_tokens - draft_tokens) / 8))


def _holds(distribution: BaseDistribution, value: int) -> bool:
    if isinstance(distribution, CategoricalDistribution):
        return value in distribution.choices
    assert isinstance(distribution, IntDistribution)
    return distribution.low <= value <= distribution.high


def params_of(config: TreeConfig) -> dict[str, int]:
    return {"steps": config.steps, "topk": config.topk, "draft_tokens": config.draft_tokens}


class TPEProposer:
    def __init__(self, store: StudyStore, space: SearchSpace, seed: int,
                 is_known: Callable[[str], bool]) -> None:
        self.store = store
        self.space = space
        self.distributions = knob_distributions(space)
        self.batches = itertools.cycle(sorted(store.batch_studies))
        self.rng = np.random.default_rng(seed)
        self.is_known = is_known  # launched, failed or running
        self.parked: dict[str, list[tuple[int, optuna.trial.Trial, dict[str, int]]]] = {}
        self.answers: dict[str, LaunchResult] = {}

    def next(self) -> Proposal | None:
        """A config not yet launched, or None when the space is exhausted."""
        for _ in range(MAX_ASKS):
            batch = next(self.batches)
            trial = self.store.batch_studies[batch].ask(self.distributions)
            raw = {k: int(trial.params[k]) for k in ("steps", "topk", "draft_tokens")}
            config = nearest_config(self.space, **raw)
            key = config_key(config)
            if not self.is_known(key):
                return Proposal(config, [(batch, trial, raw)])
            # Already measured or under way: answer this trial when its result is known.
            self.parked.setdefault(key, []).append((batch, trial, raw))
            if key in self.answers:
                self.flush(key)
        untried = [c for c in self.space.configs() if not self.is_known(config_key(c))]
        if not untried:
            return None
        return Proposal(untried[int(self.rng.integers(len(untried)))])

    def observe(self, proposal_trials: list[tuple[int, optuna.trial.Trial, dict[str, int]]],
                result: LaunchResult, baseline: LaunchResult) -> None:
        """Tell every batch study what a launch measured."""
        key = config_key(result.config)
        self.answers[key] = result
        self.parked.setdefault(key, []).extend(proposal_trials)
        told = {batch for batch, _, _ in self.parked[key]}
        assert isinstance(result.config, TreeConfig)
        params = params_of(result.config)
        # A compared tree may lie outside the space's ranges: it is measured and can be
        # recommended, but the samplers' distributions cannot hold it.
        representable = all(_holds(self.distributions[k], v) for k, v in params.items())
        for batch in self.store.batch_studies:
            if batch not in told and representable:
                self.store.record(batch, None, params, self.distributions, result, baseline)
        self.baseline = baseline
        self.flush(key)

    def flush(self, key: str) -> None:
        result = self.answers[key]
        for batch, trial, raw in self.parked.pop(key, []):
            self.store.record(batch, trial, raw, self.distributions, result, self.baseline)

    def abandon_all(self, reason: str) -> None:
        for waiting in self.parked.values():
            for batch, trial, _ in waiting:
                self.store.abandon(trial, self.store.batch_studies[batch], reason)
        self.parked.clear()


class GridProposer(TPEProposer):
    """Every config of the space in its order (steps, then topk, then draft tokens), as a
    hand-run grid would go; launches are still told to the per-batch studies."""

    def next(self) -> Proposal | None:
        for config in self.space.configs():
            if isinstance(config, TreeConfig) and not self.is_known(config_key(config)):
                return Proposal(config)
        return None


class RandomProposer(TPEProposer):
    """Untried configs uniformly at random (seeded)."""

    def next(self) -> Proposal | None:
        untried = [c for c in self.space.configs()
                   if isinstance(c, TreeConfig) and not self.is_known(config_key(c))]
        if not untried:
            return None
        return Proposal(untried[int(self.rng.integers(len(untried)))])
