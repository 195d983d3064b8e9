"""Grid: every config of the space in its order (steps, then topk, then draft tokens), as a
hand-run grid would go."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from treetune.config import TreeConfig
from treetune.results import LaunchResult, config_key
from treetune.strategies._base import Proposal, SearchContext, register


@register("grid", "every tree of the space in order, as a hand-run grid")
class GridStrategy:
    def __init__(self, context: SearchContext) -> None:
        self.context = context

    def order(self) -> Iterable[TreeConfig]:
        """The trees in the order they are launched."""
        return self.context.space.configs()

    def propose(self) -> Proposal | None:
        for config in self.order():
            if not self.context.is_known(config_key(config)):
                return Proposal(config)
        return None

    def observe(self, result: LaunchResult, baseline: LaunchResult) -> None:
        """Nothing to learn: the order is fixed."""

    def estimates(self, configs: Sequence[TreeConfig]) -> None:
        return None
