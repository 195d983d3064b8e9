"""The per-batch Optuna studies as strategies see them: the knobs as distributions, raw
proposals mapped into the space, and every launch told to every batch size's study (so
optuna-dashboard shows the whole search, and TPE learns from launches it did not propose).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    IntDistribution,
)
from optuna.exceptions import UpdateFinishedTrialError

from treetune.config import TreeConfig, candidate_pool_size
from treetune.results import LaunchResult, config_key
from treetune.space import SearchSpace

Waiting = tuple[int, optuna.trial.Trial, dict[str, int]]  # (batch, trial, raw params)


class TrialStore(Protocol):
    """What of the study storage the batch studies need (`study.storage.StudyStore`)."""

    batch_studies: dict[int, optuna.Study]

    def record(self, batch: int, trial: optuna.trial.Trial | None, params: dict[str, int],
               distributions: dict[str, BaseDistribution], result: LaunchResult,
               baseline: LaunchResult) -> None: ...

    def abandon(self, trial: optuna.trial.Trial, study: optuna.Study, reason: str) -> None: ...

    def tag(self, trial: optuna.trial.Trial) -> None: ...

    def told(self) -> dict[int, set[str]]: ...


def knob_distributions(space: SearchSpace) -> dict[str, BaseDistribution]:
    def dist(values: tuple[int, ...]) -> BaseDistribution:
        contiguous = values == tuple(range(values[0], values[-1] + 1))
        return IntDistribution(values[0], values[-1]) if contiguous else \
            CategoricalDistribution(values)
    if space.is_ngram:  # no steps knob: topk is the breadth, steps follows draft_tokens
        return {"topk": dist(space.topk), "draft_tokens": dist(space.draft_tokens)}
    return {"steps": dist(space.steps), "topk": dist(space.topk),
            "draft_tokens": dist(space.draft_tokens)}


def nearest_config(space: SearchSpace, steps: int, topk: int, draft_tokens: int) -> TreeConfig:
    """The space's canonical config closest to a raw triple (SGLang would refuse or
    rewrite an out-of-range draft_tokens; the search never launches such a server)."""
    if space.allows(steps, topk, draft_tokens):
        return TreeConfig.of(steps, topk, draft_tokens, space.method)
    capped = min(draft_tokens, candidate_pool_size(steps, topk) + 1)
    if space.allows(steps, topk, capped):
        return TreeConfig.of(steps, topk, capped, space.method)
    return min(space.configs(), key=lambda c: (abs(c.steps - steps) + abs(c.topk - topk)
                                               + abs(c.draft_tokens - draft_tokens) / 8))


def holds(distribution: BaseDistribution, value: int) -> bool:
    if isinstance(distribution, CategoricalDistribution):
        return value in distribution.choices
    assert isinstance(distribution, IntDistribution)
    return distribution.low <= value <= distribution.high


def params_of(config: TreeConfig) -> dict[str, int]:
    return {"steps": config.steps, "topk": config.topk, "draft_tokens": config.draft_tokens}


class BatchStudies:
    """Tells each batch size's Optuna study what every launch measured, through the
    trials that asked for it (answered once the config's result is known) or new ones."""

    def __init__(self, store: TrialStore, space: SearchSpace) -> None:
        self.store = store
        self.distributions = knob_distributions(space)
        self.batches = sorted(store.batch_studies)
        self.parked: dict[str, list[Waiting]] = {}
        self.answers: dict[str, LaunchResult] = {}
        self.baseline: LaunchResult | None = None

    def use_sampler(self, sampler: Callable[[int], optuna.samplers.BaseSampler]) -> None:
        """Ask with `sampler(batch)` from now on (the stored studies start with TPE)."""
        for batch, study in self.store.batch_studies.items():
            study.sampler = sampler(batch)

    def ask(self, batch: int) -> tuple[optuna.trial.Trial, dict[str, int]]:
        while True:
            trial = self.store.batch_studies[batch].ask(self.distributions)
            try:
                self.store.tag(trial)  # whose proposal, when searches share the study
                break
            except UpdateFinishedTrialError:  # failed as an orphan before its tag: again
                continue
        raw = {k: int(v) for k, v in trial.params.items()}
        raw.setdefault("steps", raw["draft_tokens"] - 1)  # an NGRAM space's trees
        return trial, {k: raw[k] for k in ("steps", "topk", "draft_tokens")}

    def park(self, key: str, waiting: Waiting) -> None:
        """A trial that asked for a config already launched or under way: answered from
        that config's result."""
        self.parked.setdefault(key, []).append(waiting)
        if key in self.answers:
            self._flush(key)

    def record(self, trials: list[Waiting], result: LaunchResult,
               baseline: LaunchResult) -> None:
        """Tell every batch study what a launch of a tree measured."""
        key = config_key(result.config)
        self.answers[key] = result
        self.baseline = baseline
        self.parked.setdefault(key, []).extend(trials)
        told = {batch for batch, _, _ in self.parked[key]}
        self.tell(result, baseline, [b for b in self.store.batch_studies if b not in told])
        self._flush(key)

    def tell(self, result: LaunchResult, baseline: LaunchResult, batches: list[int]) -> None:
        """A launch of a tree told to the studies of `batches` by new trials (no trial of
        theirs asked for it)."""
        assert isinstance(result.config, TreeConfig)
        params = {k: v for k, v in params_of(result.config).items() if k in self.distributions}
        # A compared tree may lie outside the space's ranges: it is measured and can be
        # recommended, but the samplers' distributions cannot hold it.
        if not all(holds(self.distributions[k], v) for k, v in params.items()):
            return
        for batch in batches:
            self.store.record(batch, None, params, self.distributions, result, baseline)

    def _flush(self, key: str) -> None:
        result = self.answers[key]
        assert self.baseline is not None
        for batch, trial, raw in self.parked.pop(key, []):
            self.store.record(batch, trial, raw, self.distributions, result, self.baseline)

    def abandon(self, trials: list[Waiting], reason: str) -> None:
        for batch, trial, _ in trials:
            self.store.abandon(trial, self.store.batch_studies[batch], reason)

    def told(self) -> dict[int, set[str]]:
        """The configs (keys) each batch study holds a measurement of, by batch size."""
        return self.store.told()

    def abandon_all(self, reason: str) -> None:
        for waiting in self.parked.values():
            self.abandon(waiting, reason)
        self.parked.clear()
