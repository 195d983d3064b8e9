"""What to launch next, and what the launches so far say.

Shared by the runner (Ray workers in parallel, servers for real) and the search-efficiency
benchmark (launches evaluated in-process): the same queue, strategies, re-measurement of
borderline configs and merged evidence drive both.

Order of work: the baseline and compared configs first; then, before any new config, a
borderline config that could become a recommendation is re-measured (the baseline first
while it has fewer launches, since its noise shifts every speedup); then the strategy's
proposal.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.errors import TreetuneError
from treetune.perfmodel import Profile, load_profile
from treetune.results import LaunchResult, config_key
from treetune.space import SearchSpace
from treetune.study.evidence import Interval, intervals, launches_of, merge, merge_all
from treetune.study.propose import GridProposer, Proposal, RandomProposer, TPEProposer
from treetune.study.spec import StudySpec
from treetune.study.storage import StudyStore


@dataclass
class Task:
    config: ServerConfig
    proposal: Proposal | None = None
    remeasure: bool = False

    @property
    def key(self) -> str:
        return config_key(self.config)


def resolve_prior(spec: StudySpec) -> Profile | None:
    """The profile the model search starts from: the study's `search.prior` as written, or
    for the emulator its profile with every free parameter neutral (the profile itself is
    the truth being searched)."""
    from treetune.study.guided import neutral_prior

    if spec.search.prior:
        prior = load_profile(spec.search.prior)
        missing = [d for d in spec.dataset_names if d not in prior.datasets]
        if missing:
            neutral = neutral_prior(prior, missing)
            prior = prior.replace(datasets={**prior.datasets, **neutral.datasets})
        return prior
    if spec.backend.kind == "emulator" and spec.backend.profile:
        return neutral_prior(load_profile(spec.backend.profile), spec.dataset_names)
    return None


def strategy_of(spec: StudySpec) -> str:
    """The strategy a study runs: `auto` is the model search when a prior is known."""
    chosen = spec.search.strategy
    has_prior = bool(spec.search.prior) or spec.backend.kind == "emulator"
    if chosen == "auto":
        return "model" if has_prior else "tpe"
    if chosen == "model" and not has_prior:
        raise TreetuneError("strategy 'model' needs a prior profile with the hardware and "
                            "model facts: give --prior NAME_OR_FILE (see `treetune profiles`),"
                            " or choose --strategy tpe")
    return chosen


class Planner:
    def __init__(self, spec: StudySpec, store: StudyStore, space: SearchSpace,
                 launched: list[LaunchResult], tp: int | None = None) -> None:
        self.spec = spec
        self.store = store
        self.launched = list(launched)  # every finished launch, oldest first
        self.results: dict[str, LaunchResult] = merge_all(self.launched)
        self.in_flight: list[Task] = []
        self.queue: list[Task] = [Task(c) for c in (BASELINE, *spec.compare)
                                  if config_key(c) not in self.results]
        self.pending: list[tuple[LaunchResult, Proposal | None]] = []
        self.strategy = strategy_of(spec)
        self.proposer = self._proposer(space, tp)
        self.floor = 1.0 - spec.tolerance

    def _proposer(self, space: SearchSpace, tp: int | None) -> TPEProposer:
        args = (self.store, space, self.spec.seed, self.is_known)
        if self.strategy == "grid":
            return GridProposer(*args)
        if self.strategy == "random":
            return RandomProposer(*args)
        if self.strategy == "model":
            from treetune.study.guided import ModelProposer

            prior = resolve_prior(self.spec)
            assert prior is not None
            return ModelProposer(*args, prior=prior, evidence=self.evidence,
                                 tolerance=self.spec.tolerance, tp=tp)
        return TPEProposer(*args)

    # ---- state ------------------------------------------------------------------------
    @property
    def baseline(self) -> LaunchResult | None:
        result = self.results.get("baseline")
        return result if result and result.ok else None

    @property
    def launches(self) -> int:
        return len(self.launched)

    def evidence(self) -> tuple[list[LaunchResult], LaunchResult | None]:
        return list(self.results.values()), self.baseline

    def estimates(self) -> dict | None:
        """The model search's estimate of every measured tree (None for other strategies),
        for `recommend` to blend with the measurements."""
        from treetune.study.guided import ModelProposer, model_estimates

        if not isinstance(self.proposer, ModelProposer) or self.baseline is None:
            return None
        self.proposer.refresh()
        trees = [r.config for r in self.results.values()
                 if r.ok and isinstance(r.config, TreeConfig)]
        return model_estimates(self.proposer.fit, trees, np.random.default_rng(self.spec.seed))

    def is_known(self, key: str) -> bool:
        return key in self.results or any(t.key == key for t in (*self.in_flight, *self.queue))

    def intervals(self, result: LaunchResult, batch: int, names: list[str] | None = None
                  ) -> dict[str, Interval]:
        assert self.baseline is not None
        return intervals(result, self.baseline, batch, names or self.spec.dataset_names,
                         self.spec.search.launch_cv)

    # ---- what next --------------------------------------------------------------------
    def next(self) -> Task | None:
        """The next launch, or None until a running launch finishes (or for good)."""
        if self.queue:
            task = self.queue.pop(0)
        elif self.baseline is None:
            return None  # speedups need the baseline before anything can be judged
        else:
            task = self._remeasure()
            if task is None:
                proposal = self.proposer.next()
                if proposal is None:
                    return None
                task = Task(proposal.config, proposal)
        self.in_flight.append(task)
        return task

    def _remeasure(self) -> Task | None:
        """A borderline config that would become a recommendation if it were surely
        feasible: re-launched (the baseline first while it has fewer launches)."""
        busy = {t.key for t in self.in_flight}
        limit = self.spec.search.max_launches_per_config
        if limit <= 1:
            return None
        names = self.spec.dataset_names  # the mixed workload's recommendation
        candidates: list[tuple[float, str, int]] = []  # (gain over the best, key, batch)
        for batch in self.spec.batch:
            scored = []
            for key, result in self.results.items():
                if result.ok and isinstance(result.config, TreeConfig):
                    ivs = self.intervals(result, batch, names)
                    scored.append((statistics.fmean(i.mean for i in ivs.values()), key, ivs))
            best = max((m for m, _, ivs in scored
                        if all(i.low >= self.floor for i in ivs.values())), default=1.0)
            for mean, key, ivs in scored:
                borderline = (all(i.mean >= self.floor for i in ivs.values())
                              and any(i.low < self.floor for i in ivs.values()))
                if (borderline and mean > best and key not in busy
                        and launches_of(self.results[key]) < limit):
                    candidates.append((mean - best, key, batch))
        if not candidates:
            return None
        model = self.estimates() or {}  # only now: it costs a model evaluation

        def expected_regression(key: str, batch: int) -> bool:
            config = self.results[key].config
            return any((config, batch, d) in model
                       and math.exp(model[config, batch, d][0]) < self.floor for d in names)

        # The model, from every launch so far, may expect a regression: not worth a launch.
        viable = [c for c in candidates if not expected_regression(c[1], c[2])]
        pick = max(viable, key=lambda c: c[0])[1] if viable else None
        if pick is None:
            return None
        assert self.baseline is not None
        base_launches = launches_of(self.baseline)
        if (base_launches < limit and base_launches <= launches_of(self.results[pick])
                and "baseline" not in busy):
            pick = "baseline"
        return Task(self.results[pick].config, remeasure=True)

    # ---- what happened ----------------------------------------------------------------
    def finish(self, task: Task, result: LaunchResult) -> LaunchResult:
        """Record a finished launch; returns the config's merged result."""
        self.in_flight.remove(task)
        self.launched.append(result)
        merged = merge(r for r in self.launched if config_key(r.config) == task.key)
        self.results[task.key] = merged
        if isinstance(task.config, TreeConfig) and not task.remeasure:
            self.pending.append((merged, task.proposal))
        if self.baseline is not None:
            for told, proposal in self.pending:
                self.proposer.observe(proposal.trials if proposal else [], told, self.baseline)
            self.pending.clear()
        return merged

    def requeue(self, task: Task) -> None:
        """A launch whose worker died: done again first, with the same proposal."""
        self.in_flight.remove(task)
        self.queue.insert(0, task)

    def unfinished_proposals(self) -> list[Proposal]:
        return [t.proposal for t in (*self.in_flight, *self.queue) if t.proposal]

