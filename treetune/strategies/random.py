"""Random: untried configs of the space uniformly at random (seeded)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treetune.config import TreeConfig
from treetune.results import LaunchResult
from treetune.strategies._base import Proposal, SearchContext, register
from treetune.strategies.tpe import random_untried


@register("random", "untried trees uniformly at random")
class RandomStrategy:
    def __init__(self, context: SearchContext) -> None:
        self.context = context
        self.rng = np.random.default_rng(context.seed)

    def propose(self) -> Proposal | None:
        return random_untried(self.context, self.rng)

    def observe(self, result: LaunchResult, baseline: LaunchResult) -> None:
        """Nothing to learn: every untried tree is as likely."""

    def estimates(self, configs: Sequence[TreeConfig]) -> None:
        return None
