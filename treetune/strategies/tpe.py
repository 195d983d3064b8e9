"""TPE: Optuna's sampler asks the per-batch studies in turn; every proposal is mapped to the
nearest valid canonical config of the space, and a config already launched (or under way) is
answered from its measurement instead of being launched again."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from treetune.config import TreeConfig
from treetune.results import LaunchResult, config_key
from treetune.strategies._base import Proposal, SearchContext, register
from treetune.strategies._trials import nearest_config

MAX_ASKS = 64  # proposals per slot before falling back to an untried config at random


def random_untried(context: SearchContext, rng: np.random.Generator) -> Proposal | None:
    """An untried config of the space, uniformly at random (None when none is left)."""
    untried = [c for c in context.space.configs() if not context.is_known(config_key(c))]
    if not untried:
        return None
    return Proposal(untried[int(rng.integers(len(untried)))])


def ask_untried(context: SearchContext, batches: Iterator[int],
                rng: np.random.Generator) -> Proposal | None:
    """Ask the batch studies' sampler in turn (one batch size per ask) for a config not yet
    launched; a proposal already known is answered from its measurement (parked)."""
    for _ in range(MAX_ASKS):
        batch = next(batches)
        trial, raw = context.studies.ask(batch)
        config = nearest_config(context.space, **raw)
        key = config_key(config)
        if not context.is_known(key):
            return Proposal(config, [(batch, trial, raw)])
        context.studies.park(key, (batch, trial, raw))
    return random_untried(context, rng)


@register("tpe", "Optuna's TPE sampler over the three knobs, per batch size", auto=1)
class TPEStrategy:
    def __init__(self, context: SearchContext) -> None:
        self.context = context
        self.batches = itertools.cycle(context.batches)
        self.rng = np.random.default_rng(context.seed)

    def propose(self) -> Proposal | None:
        return ask_untried(self.context, self.batches, self.rng)

    def observe(self, result: LaunchResult, baseline: LaunchResult) -> None:
        """Nothing to do: TPE learns through the batch studies, which record every launch."""

    def estimates(self, configs: Sequence[TreeConfig]) -> None:
        return None
