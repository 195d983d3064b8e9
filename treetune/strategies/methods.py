"""Several draft methods in one search: one strategy per method, each over its method's
space with its method's evidence and prior, taking turns.

A method's trees are another search than the next method's (NEXTN's (3,1,4) is not
EAGLE3's), so no strategy learns across them; the baseline and the verdicts are shared.
A forecast gain is relative to the trees of the proposing method only, which says
nothing about the study's best tree: the proposals carry none (the planner then never
puts a re-measurement off for them).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from treetune.config import TreeConfig
from treetune.results import LaunchResult
from treetune.strategies._base import Estimate, Estimates, Proposal, Strategy


@dataclass(frozen=True)
class MethodPart:
    """One draft method's search: its name (for messages), the strategy's name, and the
    strategy."""

    name: str
    strategy_name: str
    strategy: Strategy


class MethodsStrategy:
    """Takes turns over the methods' strategies (a method whose strategy has nothing left
    is skipped); results and estimates go to the strategy of the config's method."""

    name: ClassVar[str] = "methods"

    def __init__(self, parts: Mapping[str, MethodPart]) -> None:
        self.parts = dict(parts)  # by TreeConfig.method ("": the study's own)
        self.turns = itertools.cycle(list(self.parts))
        self.exhausted: set[str] = set()

    def propose(self) -> Proposal | None:
        for _ in range(len(self.parts)):
            method = next(self.turns)
            if method in self.exhausted:
                continue
            proposal = self.parts[method].strategy.propose()
            if proposal is None:
                self.exhausted.add(method)
                continue
            proposal.gain = None  # relative to this method's trees only (see above)
            return proposal
        return None

    def observe(self, result: LaunchResult, baseline: LaunchResult) -> None:
        if isinstance(result.config, TreeConfig) and result.config.method in self.parts:
            self.parts[result.config.method].strategy.observe(result, baseline)

    def estimates(self, configs: Sequence[TreeConfig]) -> Estimates | None:
        """Each method's model's estimates of its own configs. Where two models speak,
        their levels are not shared, so a rank weighs each estimate by its whole
        variance."""
        out: dict[tuple[TreeConfig, int, str], Estimate] = {}
        speaking = 0
        for method, part in self.parts.items():
            own = [c for c in configs if c.method == method]
            if own and (theirs := part.strategy.estimates(own)):
                out.update(theirs)
                speaking += 1
        if speaking > 1:
            out = {k: e._replace(rank_variance=e.variance) for k, e in out.items()}
        return out or None
