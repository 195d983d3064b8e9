"""Model-guided search: fit the performance model to what has been measured, predict every
untried config at every cell, and launch the one the model expects to be best.

After each measured launch the free parameters of a prior profile (its hardware and model
facts stay) are refitted with `treetune calibrate`'s fitting code: per-dataset acceptance
from the measured accept lengths, step-time costs from the measured throughputs. The fit's
Jacobian gives a Gaussian posterior over the parameters; each proposal draws one parameter
set from it (Thompson sampling), so configs the data cannot yet tell apart all get their
chance, and a share of proposals is drawn at random from the space so that a model that is
wrong cannot trap the search.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np

from treetune.config import BASELINE, TreeConfig
from treetune.perfmodel import PerfModel, Profile, check_memory
from treetune.perfmodel.acceptance import Acceptance
from treetune.perfmodel.calibrate import (
    CALIBRATION_BOUNDS,
    CalibrationResult,
    Measurement,
    Parameter,
    calibrate,
    free_parameters,
    set_values,
    values_of,
)
from treetune.perfmodel.profile import Calibration, Dataset
from treetune.results import LaunchResult, config_key
from treetune.space import SearchSpace
from treetune.study.propose import Proposal, TPEProposer, nearest_config
from treetune.study.spec import StudySpec
from treetune.study.storage import StudyStore

EXPLORE = 0.1  # share of proposals drawn at random from the untried configs
NOVELTY = 0.005  # a proposal must be predicted this different (log) from measured trees
MARGIN = 0.02  # a config must be predicted this far above the floor on every dataset
ONLINE_DATASET_FIT = ("acceptance.top1", "acceptance.top1_decay", "acceptance.rank_mass",
                      "context_tokens")
NEUTRAL_ACCEPTANCE = Acceptance(top1=0.6, top1_decay=0.05, rank_mass=0.5, rank_ratio=0.5)
NEUTRAL_CONTEXT = 2048.0
# First launches after the baseline, before the model has anything to go on: a deep chain
# (acceptance along depth: top-1 and its decay) and a wide tree (the lower ranks' share),
# which also span draft and verify costs. Mapped to the nearest configs of the space.
INITIAL_DESIGN = (TreeConfig(5, 1, 6), TreeConfig(3, 8, 24))


def neutral_prior(profile: Profile, datasets: list[str]) -> Profile:
    """The profile's hardware and model facts with every free parameter at a neutral
    value: what the search may assume before it has measured anything."""
    shapes = {}
    for name in datasets:
        known = profile.datasets.get(name)
        shapes[name] = Dataset(
            acceptance=NEUTRAL_ACCEPTANCE, context_tokens=NEUTRAL_CONTEXT,
            prompt_tokens=known.prompt_tokens if known else 512,
            output_tokens=known.output_tokens if known else 512)
    return profile.replace(calibration=Calibration(), datasets=shapes)


def measurements(results: list[LaunchResult], baseline: LaunchResult, batches: list[int],
                 datasets: list[str]) -> list[Measurement]:
    """Every measured (tree, batch, dataset) cell with its baseline, as calibrate takes."""
    points = []
    for result in results:
        if not result.ok or not isinstance(result.config, TreeConfig):
            continue
        for batch in batches:
            for dataset in datasets:
                cell, base = result.cell(dataset, batch), baseline.cell(dataset, batch)
                if cell and base and cell.output_tok_s > 0 and base.output_tok_s > 0:
                    points.append(Measurement(result.config, batch, dataset, base.output_tok_s,
                                              cell.output_tok_s, cell.accept_length,
                                              launch=config_key(result.config)))
    return points


class ModelFit:
    """The current fit and its posterior: refitted from the prior on every new result,
    warm-started from the previous fit."""

    def __init__(self, prior: Profile, batches: list[int], datasets: list[str],
                 tp: int | None = None) -> None:
        self.prior = prior
        self.batches, self.datasets, self.tp = batches, datasets, tp
        self.result: CalibrationResult | None = None
        self.params: list[Parameter] = []

    @property
    def profile(self) -> Profile:
        return self.result.profile if self.result else self.prior

    def update(self, results: list[LaunchResult], baseline: LaunchResult) -> None:
        points = measurements(results, baseline, self.batches, self.datasets)
        if not points:
            return
        self.params = free_parameters(self.prior, points, _calibration_fit(self.prior),
                                      _dataset_fit(self.prior))
        start = self.result.profile if self.result else None
        # Warm-started refits move little once many trees are measured: fewer steps.
        steps = 400 if start is None else 100 if len(points) < 80 else 40
        self.result = calibrate(self.prior, points, self.params, starts=1, start=start,
                                max_nfev=steps, tolerance=1e-4)

    def sample(self, rng: np.random.Generator, inflate: float = 1.0) -> Profile:
        """One parameter set drawn from the fit's posterior (the fit itself before any)."""
        result = self.result
        if result is None or result.covariance is None:
            return self.profile
        x = rng.multivariate_normal(result.x, inflate * result.covariance,
                                    check_valid="ignore", method="eigh")
        low = np.array([p.low_x for p in self.params])
        high = np.array([p.high_x for p in self.params])
        return set_values(self.prior, values_of(self.params, np.clip(x, low, high)))


def _calibration_fit(profile: Profile) -> tuple[str, ...]:
    """The cost parameters measurements can tell apart: KV bandwidth efficiency only ever
    appears divided into a dataset's context length (which is fitted), and a dense target
    has no routing to diversify."""
    skip = {"kv_bandwidth_eff"} | (set() if profile.target.moe else {"tree_routing_diversity"})
    return tuple(name for name in CALIBRATION_BOUNDS if name not in skip)


def _dataset_fit(profile: Profile) -> tuple[str, ...]:
    return (*ONLINE_DATASET_FIT, "routing_diversity") if profile.target.moe else ONLINE_DATASET_FIT


def predicted_speedups(profile: Profile, configs: list[TreeConfig], batches: list[int],
                       datasets: list[str], tp: int | None = None
                       ) -> dict[TreeConfig, dict[int, list[float]]]:
    """Noise-free speedup of every config, per batch size, per dataset (in order)."""
    model = PerfModel(profile, tp)
    base = {(b, d): model.throughput(BASELINE, b, d) for b in batches for d in datasets}
    return {c: {b: [model.throughput(c, b, d) / base[b, d] for d in datasets] for b in batches}
            for c in configs}


class ModelProposer(TPEProposer):
    """Proposes the config a posterior draw of the fitted model predicts to improve most on
    the measured trees, at whichever batch size gains most; every launch is still told to
    the per-batch Optuna studies."""

    def __init__(self, store: StudyStore, space: SearchSpace, seed: int,
                 is_known: Callable[[str], bool], prior: Profile,
                 evidence: Callable[[], tuple[list[LaunchResult], LaunchResult | None]],
                 tolerance: float = 0.0, tp: int | None = None) -> None:
        super().__init__(store, space, seed, is_known)
        spec = store.spec
        self.floor = 1.0 - tolerance
        self.evidence = evidence
        self.fit = ModelFit(prior, sorted(spec.batch), spec.dataset_names, tp)
        self.fitted_on: tuple[int, int] = (-1, -1)
        # Configs the memory model says cannot start are never proposed (facts, not fits).
        self.candidates = [c for c in space.configs() if isinstance(c, TreeConfig)
                           and check_memory(prior, c, max(spec.batch), tp=tp).fits]

    def refresh(self) -> list[TreeConfig]:
        """Refit when there is news (a new measured tree, or a re-measurement); returns
        the measured trees."""
        results, baseline = self.evidence()
        measured = [r for r in results if r.ok and isinstance(r.config, TreeConfig)]
        news = (len(measured), sum(len(c.launch_tok_s) for r in measured for c in r.cells[:1]))
        if baseline is not None and measured and news != self.fitted_on:
            self.fit.update(results, baseline)
            self.fitted_on = news
        return [r.config for r in measured if isinstance(r.config, TreeConfig)]

    def next(self) -> Proposal | None:
        untried = [c for c in self.candidates if not self.is_known(config_key(c))]
        if not untried:
            return super().next()  # TPE's own fallback: nothing left but OOM configs
        trees = self.refresh()
        measured = len(trees)
        for design in INITIAL_DESIGN[measured:]:
            config = nearest_config(self.space, design.steps, design.topk, design.draft_tokens)
            if config in untried:
                return Proposal(config)
        if self.rng.random() < EXPLORE and measured >= 2:
            return Proposal(untried[int(self.rng.integers(len(untried)))])
        # Thompson sampling: one draw of the model, and the untried tree that draw says
        # improves most on the measured trees, at whichever batch size gains most.
        profile = self.fit.sample(self.rng)
        batches = self.fit.batches
        table = predicted_speedups(profile, untried + trees, batches, self.fit.datasets,
                                   self.fit.tp)
        known = {b: np.log([table[c][b] for c in trees]) for b in batches} if trees else None
        best_pick: tuple[float, TreeConfig] | None = None
        for batch in batches:
            incumbent = max((statistics.fmean(table[c][batch]) for c in trees
                             if min(table[c][batch]) >= self.floor), default=1.0)
            for config in untried:
                per = table[config][batch]
                if min(per) < self.floor + MARGIN:
                    continue
                if known is not None and np.abs(known[batch] - np.log(per)).max(
                        axis=1).min() < NOVELTY:
                    continue  # a near twin of a measured tree: launching it teaches nothing
                gain = statistics.fmean(per) / incumbent
                if best_pick is None or gain > best_pick[0]:
                    best_pick = (gain, config)
        if best_pick is None:
            return Proposal(untried[int(self.rng.integers(len(untried)))])
        return Proposal(best_pick[1])


Estimates = dict[tuple[TreeConfig, int, str], tuple[float, float]]


def model_estimates(fit: ModelFit, configs: list[TreeConfig], rng: np.random.Generator,
                    samples: int = 12) -> Estimates:
    """The fitted model's log-speedup per (config, batch, dataset), with its variance over
    parameter sets drawn from the fit's posterior: how much the model knows, pooled from
    every launch so far."""
    if fit.result is None or not configs:
        return {}
    draws = [predicted_speedups(fit.sample(rng, inflate=1.0), configs, fit.batches,
                                fit.datasets, fit.tp) for _ in range(samples)]
    out: Estimates = {}
    for config in configs:
        for batch in fit.batches:
            for i, dataset in enumerate(fit.datasets):
                logs = np.log([d[config][batch][i] for d in draws])
                out[config, batch, dataset] = (float(logs.mean()),
                                               max(float(logs.var()), 1e-6))
    return out


def study_estimates(spec: StudySpec, results: list[LaunchResult], baseline: LaunchResult,
                    seed: int = 0) -> Estimates:
    """Model estimates for every measured tree of a finished or running study, from a fit
    made here (the report, the notebooks)."""
    from treetune.study.planner import resolve_prior

    prior = resolve_prior(spec)
    if prior is None:
        return {}
    fit = ModelFit(prior, sorted(spec.batch), spec.dataset_names, spec.tp)
    fit.update(results, baseline)
    configs = [r.config for r in results if r.ok and isinstance(r.config, TreeConfig)]
    return model_estimates(fit, configs, np.random.default_rng(seed))
