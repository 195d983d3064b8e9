"""What a search strategy is to the planner: a small protocol and a registry of names.

A strategy proposes the next tree to launch and may estimate speedups; the planner hands it
a `SearchContext` when the study starts and never asks which class it holds (as Optuna's
study takes any sampler). Every launch is recorded in the per-batch Optuna studies by the
planner's `BatchStudies`, whatever proposed it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import optuna

from treetune.config import TreeConfig
from treetune.errors import TreetuneError
from treetune.results import LaunchResult
from treetune.space import SearchSpace

if TYPE_CHECKING:
    from treetune.perfmodel import Profile
    from treetune.perfmodel.serving import Shape
    from treetune.strategies._trials import BatchStudies

AUTO = "auto"


class Estimate(NamedTuple):
    """A model's estimate of one config's log-speedup in one cell."""

    log_mean: float
    variance: float  # how far the truth may lie from `log_mean`
    # The part of `variance` that is this config's own, not shared by every config it was
    # estimated with: an error of the model's level (every speedup a little high, say)
    # moves all their estimates alike and leaves their order alone, so a ranking among
    # them weighs the estimate by this. At most `variance`.
    rank_variance: float


# A model's estimates, per (config, batch, dataset).
Estimates = Mapping[tuple[TreeConfig, int, str], Estimate]


@dataclass
class Proposal:
    config: TreeConfig
    # Trials (per batch size) waiting for this config's measurement.
    trials: list[tuple[int, optuna.trial.Trial, dict[str, int]]] = field(default_factory=list)
    # The strategy's forecast of the proposal's mean speedup over the best measured tree at
    # the batch size where it gains most (None: no forecast). A large one may go before a
    # re-measurement of the best measured tree.
    gain: float | None = None


@dataclass(frozen=True)
class SearchContext:
    """What a strategy may know of the study it searches."""

    space: SearchSpace
    studies: BatchStudies  # the per-batch Optuna studies (TPE asks them; all record there)
    batches: list[int]  # sorted
    datasets: list[str]
    tolerance: float
    seed: int
    is_known: Callable[[str], bool]  # a config key launched, failed, running or queued
    # Every config's merged result so far, and the baseline's (None before it is measured).
    evidence: Callable[[], tuple[list[LaunchResult], LaunchResult | None]]
    prior: Profile | None = None  # hardware and model facts, when known
    # Variance of a measured log speedup (result, baseline, batch, dataset), from the
    # study's learned noise: how far a model may be off before it is misfit.
    measurement_variance: Callable[[LaunchResult, LaunchResult, int, str], float] = (
        lambda result, baseline, batch, dataset: 0.03 ** 2 * 2)
    # How far (log) below a tree's measured speedup at a batch size the feasibility bound
    # reaches once the tree and the baseline have the per-config limit of launches each, at
    # the study's learned noise: a tree predicted clear of the floor by this much can be
    # proven in the launches a config may have (0: no proof is in view).
    proof_reach: Callable[[int], float] = lambda batch: 0.0
    max_batch: int = 1
    tp: int | None = None
    prior_why_not: str = ""  # why there is no prior, in one line, when there is none
    # Trees launched (here or by another search of the study) or queued whose first
    # result is not in yet: with several workers, a proposal is made while these run, and
    # must be worth launching beside them, not a copy of what they will tell.
    pending: Callable[[], list[TreeConfig]] = lambda: []
    # Datasets of fixed-length requests (prompt and output tokens): their cells measure
    # whole requests, prefill and turnover included (`strategies/_whole.py`).
    shapes: Mapping[str, Shape] = field(default_factory=dict)


class Strategy(Protocol):
    """Proposes what to launch next."""

    name: ClassVar[str]

    def propose(self) -> Proposal | None:
        """A config not yet launched, or None when the space is exhausted."""
        ...

    def observe(self, result: LaunchResult, baseline: LaunchResult) -> None:
        """A config's (merged) result is in: measured, re-measured or failed."""
        ...

    def estimates(self, configs: Sequence[TreeConfig]) -> Estimates | None:
        """A model's log-speedup estimates for `configs`, or None (no model)."""
        ...


@dataclass(frozen=True)
class StrategyInfo:
    name: str
    make: Callable[[SearchContext], Strategy]
    # Why the strategy cannot run this study (None: it can); `auto` takes the first that can.
    unavailable: Callable[[SearchContext], str | None]
    help: str
    forecasts: bool = False  # its proposals carry a forecast gain (Proposal.gain)
    # What it needs installed, checked before a study starts (None: nothing missing).
    requires: Callable[[], str | None] = lambda: None


STRATEGIES: dict[str, StrategyInfo] = {}
AUTO_ORDER: list[str] = []  # what `auto` tries, in order
_auto_rank: dict[str, int] = {}


def register(name: str, help: str, *, auto: int | None = None,
             unavailable: Callable[[SearchContext], str | None] = lambda context: None,
             forecasts: bool = False, requires: Callable[[], str | None] = lambda: None
             ) -> Callable[[Any], Any]:
    """Class decorator: the strategy is available by `name`; with `auto`, `auto` tries it
    (lower first); `forecasts`: its proposals carry a forecast gain; `requires`: what
    it needs installed, said before a study starts."""

    def add(cls: Any) -> Any:
        cls.name = name
        STRATEGIES[name] = StrategyInfo(name, cls, unavailable, help, forecasts, requires)
        if auto is not None:
            _auto_rank[name] = auto
            AUTO_ORDER[:] = sorted(_auto_rank, key=_auto_rank.__getitem__)
        return cls

    return add


def names() -> list[str]:
    return [AUTO, *STRATEGIES]


def resolve(name: str, context: SearchContext) -> str:
    """The strategy a study runs: `auto` is the first strategy of AUTO_ORDER that can run;
    a named strategy that cannot run is refused, saying why."""
    if name == AUTO:
        return next(n for n in AUTO_ORDER if STRATEGIES[n].requires() is None
                    and STRATEGIES[n].unavailable(context) is None)
    why = missing_requirement(name) or STRATEGIES[name].unavailable(context)
    if why is not None:
        raise TreetuneError(why)
    return name


def missing_requirement(name: str) -> str | None:
    """Why strategy `name` cannot run on this install (a package missing), or None; `auto`
    always can. An unknown name is refused, naming the strategies there are."""
    if name == AUTO:
        return None
    if name not in STRATEGIES:
        raise TreetuneError(f"unknown strategy '{name}': choose one of {', '.join(names())}")
    return STRATEGIES[name].requires()


def make(name: str, context: SearchContext) -> Strategy:
    return STRATEGIES[resolve(name, context)].make(context)
