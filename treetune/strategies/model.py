"""Model-guided search: fit the performance model to what has been measured, predict every
untried config at every cell, and launch the one the model expects to be best.

After each measured launch the free parameters of a prior profile (its hardware and model
facts stay) are refitted with `treetune calibrate`'s fitting code: per-dataset acceptance
from the measured accept lengths, step-time costs from the measured throughputs. The fit's
Jacobian gives a Gaussian posterior over the parameters; each proposal draws one parameter
set from it, tempered to half its spread (Thompson sampling), so configs the data cannot yet
tell apart all get their chance, and a share of proposals draws from a posterior made
wider, so that a model that is too sure of itself cannot trap the search. Cells of
fixed-length requests are fitted and predicted as the whole requests they measure
(`_whole.py`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.perfmodel import PerfModel, Profile, RunningCaps
from treetune.perfmodel.calibrate import (
    CALIBRATION_BOUNDS,
    DATASET_BOUNDS,
    CalibrationResult,
    Measurement,
    Parameter,
    calibrate,
    free_parameters,
    get_value,
    set_values,
    values_of,
)
from treetune.perfmodel.serving import Shape
from treetune.results import LaunchResult, config_key, launches_of
from treetune.strategies._base import Estimate, Estimates, Proposal, SearchContext, register
from treetune.strategies._misfit import Correction, Residual
from treetune.strategies._trials import nearest_config
from treetune.strategies._whole import WholeRequests
from treetune.strategies.tpe import TPEStrategy

EXPLORE = 0.1  # share of proposals drawn from a wider posterior (EXPLORE_INFLATE)
EXPLORE_MISFIT = 0.25  # the same while the model does not fit the measurements
# An exploring proposal draws the parameters with this many times the posterior's variance.
# Not uniformly from the space: most of a space is trees no plausible model favours (deep,
# wide trees at large batch), and a launch spent there teaches the search little
# (benchmarks/RESULTS.md, stop 18).
EXPLORE_INFLATE = 4.0
# Any other proposal draws them with this share of the posterior's variance (a tempered
# Thompson draw: half its spread). Of the 1,648 trees of the default space, the 1-23
# within 1% of the best at a batch size are near twins the posterior cannot yet tell
# apart, and a whole draw's best tree wanders over a wider ring of them; a tempered draw
# proposes nearer what the fit expects best, yet still varies between proposals. Against
# whole draws, seeds 0-11 of twelve worlds: 1474 -> 1333 launches to the target (the 30B
# 111 -> 91, cliffs 130 -> 96, everything 134 -> 116), the 8B's p90 15 -> 17 where its fit
# ranks the best batch-1 tree low (benchmarks/RESULTS.md, stop 47).
DRAW_INFLATE = 0.25
REDRAWS = 3  # posterior draws a proposal tries before the fit itself
# Once a study has run this many launches (the baseline's counted), a draw also asks
# which untried tree gains most over the measured trees that the feasibility proof could
# reach: those it predicts clear of the floor by the bound's reach at the per-config limit
# of launches (`SearchContext.proof_reach`). When that gain is the larger, that tree is
# proposed. Where the fastest trees clear the floor by a few percent on one dataset, their
# proofs take more launches than a study has, and it ran without speculation there for
# want of a tree it could prove: dense-band, 12 seeds, 5 -> 7 studies reached, regret at
# the budget 19.2% -> 7.2% (`benchmarks/RESULTS.md`, stop 90). Asked from the first
# proposal it cost other worlds launches (dense-band 5 -> 2 reached, a cliffs study 10 ->
# 31): early, the fastest trees are not yet measured, and launches went to trees 2-4%
# slower. From launch 12 it moved the launches to the target in 4 of the 18 shipped
# worlds (13 the same in every field) and in two of the 144 held-out studies (one each way).
PROVABLE_AFTER = 12
# Once the posterior predictive check has found the model misfit, the fit counts a
# speedup's misfit beyond this (log) as soft-L1 rather than squared: a verify cliff or a
# dispatch cost the model cannot express moves some trees' speedups 4-14%, and squared,
# those cells drag the fitted costs until the trees the effect spares are mispredicted
# too (a held-out cliff world's traced fit put its best trees 5% below their truth, three
# fitted values at their bounds); the correction then learns what the fit leaves. About
# the standard error of one launch's speedup at 3% launch and measurement noise (0.049):
# cells the model explains within their noise count about as before. Held out, seeds 0-1
# of the three sets: 2626 -> 2551 launches to the target, 87 -> 89 of 144 studies reached
# (regret at the budget 2.25% -> 2.30%); the 18 shipped worlds, where the check seldom
# fires, every study at the same launch (benchmarks/RESULTS.md, stop 91).
ROBUST_SCALE = 0.05
# The model's rank of two trees is never taken as surer than this (a log speedup's
# standard deviation, added to the rank variance its posterior draws give): the draws
# move only what its form lets move, and near twins move together, so it claimed their
# order to 0.1-0.5% where its form was off between them by 1-2%. Read against each
# world's truth (measured trees at launches 10 and 20, seeds 0-3): where the claimed rank
# standard deviation was under 0.5%, the errors were 6-12 times it in cliffs and 4-10 in
# moe-dispatch, where the misfit check had not fired, 2-3 in near-floor and Coder-Next's
# own profile, and about it in the 8B's and the 30B's own. The ranks of measured trees
# blend the estimate with the measurements by their variances (`evidence.judge`), and a
# twin the fit put 0.1% ahead outranked one measured 4.5% faster on as many launches: a
# traced cliffs study (seed 1) held its batch-1 target from launch 11, then from launch 23
# recommended (2,2,6), 1.6% below the best, to the end. At 0.5%, 12 seeds of cliffs,
# near-floor, replay-cliff-grid, the 8B and the 30B: launches to a stable target 916 ->
# 804 summed, to the target 527 -> 532 (benchmarks/RESULTS.md, stop 92). All 18 shipped
# worlds: to a stable target 3,712 -> 3,545, to the target 2,701 -> 2,704, 178 -> 179
# studies reached, the same median in 17 (everything 6.5 -> 7), the regret at the budget
# lower in 9 and higher in 2 (everything 1.24% -> 1.38%, the 30B's 0.29% -> 0.33%); the
# held-out sets 2026, 2027 and 2028: to the target 884 -> 869, 750 -> 749 and 917 -> 917,
# reached 29 -> 31, 33 and 27 of 48 (benchmarks/RESULTS.md, stop 93). At 1%, the 18
# shipped worlds took 2,729 launches to the target (attention-dp 112 -> 132) and the three
# held-out sets 2,529 against 2,535 (benchmarks/RESULTS.md, stop 94).
RANK_SD_FLOOR = 0.005
NOVELTY = 0.005  # a proposal must be predicted this different (log) from measured trees
MARGIN = 0.02  # a config must be predicted this far above the floor on every dataset
# A Thompson draw of the misfit correction is joint over the configs whose upper bound
# (Z_UPPER standard deviations of the correction) ranks among this many per batch size.
JOINT_CANDIDATES = 128
Z_UPPER = 2.0
# With cells of whole requests, a draw's proposal is among the trees its steady state ranks
# highest, this many per batch size, served whole (`_whole.py`).
SERVED = 12
# A cell's accept-length noise (coefficient of variation) where no tree was measured at two
# batch sizes to show it.
ACCEPT_CV = 0.01
# How far a cell's speedup strays from a right fit, launch by launch (about each launch's
# own level, which the fit profiles out): 2-3% at the benchmark's 3% noise (2.0% at the
# truth's own parameters in a 30B study: benchmarks/RESULTS.md, stop 34).
SPEEDUP_CV = 0.03
# The fit weighs a speedup's log error this many times an accept length's relative error
# (calibrate's default: 3): as their noise stands, so both are in units of ACCEPT_CV, and
# calibrate's pull toward the prior is then a Gaussian prior half as wide as each
# parameter's bounds. At 3 (27 times what the noise warrants, in squares) a 30B study
# fitted its speedups' noise with the acceptance: three trees measured, a top-1 decay of
# 1.0 on one dataset against a truth of 0.08, its accept lengths 5% off (5 times their
# noise), and launches 6-14 spent on depth-2 trees where the best are depth 3. Over 6
# seeds of 10 worlds, 460 launches to the target at 3, 407 at a third; at 1, more than at
# a third in the 30B and acceptance-shape (47 and 44 against 40 and 35). Weighed as their
# noise with the pull kept against calibrate's weights (a prior 4.5 times the bounds wide),
# more in 5 of 7 worlds (everything 65 against 41) (benchmarks/RESULTS.md, stop 55).
SPEEDUP_WEIGHT = ACCEPT_CV / SPEEDUP_CV
# A fit whose accept lengths or speedups sit further from the measured ones than these
# many times their noise (mean squared, in ACCEPT_CV and SPEEDUP_CV units) may be stuck on
# the flat side of the roofline: it is refitted once from across it (`_across_roofline`)
# and the other fit is kept if its cost is at most ACROSS_KEEP times the first's.
ACCEPT_MISFIT = 4.0
SPEEDUP_MISFIT = 1.0
ACROSS_KEEP = 0.5
ONLINE_DATASET_FIT = ("acceptance.top1", "acceptance.top1_decay", "acceptance.rank_mass",
                      "context_tokens")
# Fitted once for every dataset, once the measurements show the prior's value does not
# serve (`ModelFit`): how fast the lower ranks' shares fall (each rank holds rank_ratio of
# the one above). It is the draft head's, not the text's: how much of the miss the lower
# ranks catch varies by dataset (rank_mass), how it spreads over them hardly does.
# Held at the prior's 0.5, a draft whose rank 2 catches nearly all of it
# (rank shares 0.45 and 0.03) was fitted with the other acceptance parameters bent to
# make up: a noise-free fit to six trees put a two-branch tree's accept lengths 3% low
# and a deep wide tree's 2-3% high (all within 1% with it fitted), and the search took
# 137 launches over 12 seeds of the acceptance-shape world to its target
# (benchmarks/RESULTS.md, stop 32).
ONLINE_SHARED_FIT = ("acceptance.rank_ratio",)
# Until then every fit is tried with them freed too, and they are freed for good when that
# cuts the fit's cost by a quarter and moves one of them SHARED_DEPARTURE posterior
# standard deviations or more from the prior's value (a Wald test, the deviations scaled
# by the fit's own residuals). In 8 of the 144 benchmark studies, in worlds whose ratio
# is the prior's 0.5, the cut passed a quarter by chance with one to three trees measured
# (two: 42 data rows for 28 parameters; the fit without it had converged), the ratio
# within 2.7 deviations of 0.5, and wrong-prior's seed 4 took 15 launches to its target,
# not 6. In the acceptance-shape world's, every cut past a quarter had moved it 6-12
# deviations (benchmarks/RESULTS.md, stop 33).
SHARED_KEEP = 0.75
SHARED_DEPARTURE = 4.0
# First launches after the baseline, before the model has anything to go on: a chain
# (acceptance along depth: top-1 and its decay) and a branching tree of the same depth (the
# lower ranks' share), which also span draft and verify costs. Both are trees of the size
# that wins on most servers, so the first to be confirmed is often good enough: against a
# deep chain and a wide tree, (5,1,6) and (3,8,24), 366 launches to the target instead of
# 435 over 6 seeds of 7 worlds; none at all, the first proposal from the prior, 423 against
# 313 over 5 (benchmarks/RESULTS.md, stop 24). Mapped to the nearest configs of the space.
INITIAL_DESIGN = (TreeConfig(3, 1, 4), TreeConfig(3, 4, 12))


def measurements(results: list[LaunchResult], baseline: LaunchResult, batches: list[int],
                 datasets: list[str], whole: WholeRequests | None = None,
                 caps: RunningCaps | None = None) -> list[Measurement]:
    """Every measured (tree, batch, dataset) cell with its baseline, as calibrate takes
    (which fits the steady state: a cell of whole requests is read as the steady-state
    throughputs it implies, by `whole`'s shifts). Each server of a cell ran as many of
    its batch at once as its KV pool holds (`caps`): the cell is fitted at those."""
    points = []
    for result in results:
        if not result.ok or not isinstance(result.config, TreeConfig):
            continue
        for batch in batches:
            size, base_size = (caps.batch(result.config, batch), caps.batch(BASELINE, batch)
                               ) if caps is not None else (batch, batch)
            for dataset in datasets:
                cell, base = result.cell(dataset, batch), baseline.cell(dataset, batch)
                if cell and base and cell.output_tok_s > 0 and base.output_tok_s > 0:
                    base_tok_s, cell_tok_s = base.output_tok_s, cell.output_tok_s
                    if whole:
                        base_tok_s /= np.exp(whole.server_shift(BASELINE, batch, dataset))
                        cell_tok_s /= np.exp(whole.server_shift(result.config, batch, dataset))
                    points.append(Measurement(result.config, size, dataset, float(base_tok_s),
                                              float(cell_tok_s), cell.accept_length,
                                              launch=config_key(result.config),
                                              base_batch=base_size))
    return points


class ModelFit:
    """The current fit and its posterior: refitted from the prior on every new result,
    warm-started from the previous fit, and once more from across the roofline when its
    accept lengths misfit (`_across_roofline`). Then once more with ONLINE_SHARED_FIT
    freed too, kept (and from then on always fitted) if that cuts the fit's cost by a
    quarter (SHARED_KEEP) and moves it well away from the prior's value
    (SHARED_DEPARTURE): a parameter whose prior value serves in most worlds costs the
    search launches there when fitted from the start (the 30B's 12 seeds took 164 launches
    to the target instead of 111: its draws spread every wide tree's prediction)."""

    def __init__(self, prior: Profile, batches: list[int], datasets: list[str],
                 tp: int | None = None, shapes: Mapping[str, Shape] | None = None,
                 max_batch: int | None = None) -> None:
        self.prior = prior
        self.batches, self.datasets, self.tp = batches, datasets, tp
        self.result: CalibrationResult | None = None
        self.params: list[Parameter] = []
        self.shared_fit = False  # ONLINE_SHARED_FIT freed (for good) once it fitted better
        self.max_batch = max_batch or max(batches)
        # How many of a batch each server runs at once (its KV pool's hold).
        self.caps = RunningCaps(prior, self.max_batch, tp)
        # The shift to whole requests on datasets of fixed-length requests, at the fit.
        self.whole = WholeRequests(shapes or {}, self.max_batch, tp, self.caps)
        self.whole.at(prior)

    def reshare(self, prior: Profile) -> None:
        """The servers take another share of GPU memory (`prior`'s): what each runs at
        once is judged anew; the fit stands (no fitted parameter is a memory fact)."""
        self.prior = prior
        self.caps = RunningCaps(prior, self.max_batch, self.tp)
        self.whole.caps = self.caps
        self.whole.at(self.profile, again=True)

    @property
    def profile(self) -> Profile:
        return self.result.profile if self.result else self.prior

    def update(self, results: list[LaunchResult], baseline: LaunchResult,
               robust: float | None = None) -> None:
        points = measurements(results, baseline, self.batches, self.datasets, self.whole,
                              self.caps)
        if not points:
            return
        per_dataset = free_parameters(self.prior, points, _calibration_fit(self.prior),
                                      _dataset_fit(self.prior))
        shared = [Parameter(f"datasets.*.{name}", *DATASET_BOUNDS[name])
                  for name in ONLINE_SHARED_FIT]
        freed = per_dataset + shared
        params = freed if self.shared_fit else per_dataset
        start = self.result.profile if self.result else None
        # Warm-started refits move little once many trees are measured: fewer steps.
        steps = 400 if start is None else 100 if len(points) < 80 else 40
        def fit_from(start: Profile | None, params: list[Parameter],
                     steps: int = steps) -> CalibrationResult:
            return calibrate(self.prior, points, params, starts=1, start=start,
                             max_nfev=steps, tolerance=1e-4, speedup_weight=SPEEDUP_WEIGHT,
                             robust=robust)

        result = fit_from(start, params)
        if accept_misfit(result) > ACCEPT_MISFIT or speedup_misfit(result) > SPEEDUP_MISFIT:
            other = fit_from(_across_roofline(result.profile), params)
            if other.cost < ACROSS_KEEP * result.cost:
                result = other
        if shared and not self.shared_fit:
            other = fit_from(result.profile, freed, 400)
            if (other.cost < SHARED_KEEP * result.cost
                    and departure(other, self.prior, shared) >= SHARED_DEPARTURE):
                result, params, self.shared_fit = other, freed, True
        self.result, self.params = result, params
        self.whole.at(self.result.profile)

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


def departure(result: CalibrationResult, prior: Profile, last: Sequence[Parameter]) -> float:
    """How far a fit moved the `last` of its parameters from the prior's values: the
    largest distance, in the fit's posterior standard deviations (0 without a posterior)."""
    if result.x is None or result.covariance is None:
        return 0.0
    k = len(last)
    sd = np.sqrt(np.maximum(np.diag(result.covariance)[-k:], 1e-300))
    start = np.array([p.x_of(get_value(prior, p.name)) for p in last])
    return float(np.max(np.abs(result.x[-k:] - start) / sd))


def accept_misfit(result: CalibrationResult) -> float:
    """The mean squared log error of a fit's accept lengths, in units of their noise
    (ACCEPT_CV squared): about 1 when the fit explains them."""
    errors = [np.log(p.predicted_accept / p.measurement.accept_length) for p in result.points
              if p.measurement.accept_length]
    return float(np.mean(np.square(errors))) / ACCEPT_CV ** 2 if errors else 0.0


def speedup_misfit(result: CalibrationResult) -> float:
    """The mean squared log error of a fit's speedups about each launch's mean error (the
    launch's level, which the fit profiles out), in units of SPEEDUP_CV squared."""
    by_launch: dict[str | None, list[float]] = {}
    for p in result.points:
        by_launch.setdefault(p.measurement.launch, []).append(
            float(np.log(p.predicted_speedup / p.measurement.speedup)))
    errors = [e - statistics.fmean(group) for group in by_launch.values() for e in group]
    return float(np.mean(np.square(errors))) / SPEEDUP_CV ** 2 if errors else 0.0


def _across_roofline(fitted: Profile) -> Profile:
    """The fit with its compute efficiency on the other side of the roofline. Where no
    measured forward is compute-bound, the fit's cost does not depend on the compute
    efficiency (its gradient is zero), so a warm-started fit keeps it where it started,
    and the step-time errors that follow push the acceptance off instead (a 30B study:
    kept at the prior's 0.5 against a truth of 0.12, accept lengths 2.8% off against
    1% of noise; benchmarks/RESULTS.md, stop 29)."""
    calibration = fitted.calibration
    other = 0.1 if calibration.compute_eff > 0.2 else 0.5
    return fitted.replace(calibration=dataclasses.replace(calibration, compute_eff=other))


def acceptance_shifts(fit: ModelFit, measured: Sequence[LaunchResult]
                      ) -> dict[tuple[TreeConfig, str], float]:
    """Per measured (tree, dataset): how much to move the fit's log speedup, at every batch
    size, toward the tree's measured acceptance.

    A launch's speed factor moves its throughputs but not its accept lengths, which a cell
    measures to about 1%: where the model's acceptance form does not fit (a plateau, then
    a drop, puts the fit 2% off on both sides of the drop, enough to rank a depth-4 tree
    above the better depth-5 one), a measured tree's acceptance is known better than the
    fit gives it; a round's time does not depend on acceptance, so its speedup moves with
    it. Where the form fits, the measured accept lengths only differ from the fit by their
    noise, and the fit, which pools every tree, is the better estimate. So each (tree,
    dataset)'s log(measured / fitted accept length) is shrunk by the share of its spread
    that is misfit (empirical Bayes): the noise from the spread of one tree's accept
    length between batch sizes (acceptance does not depend on the batch), the misfit from
    how far the trees' mean residuals spread beyond that noise."""
    model = PerfModel(fit.profile, fit.tp)
    residuals: dict[tuple[TreeConfig, str], list[float]] = {}
    for result in measured:
        assert isinstance(result.config, TreeConfig)
        for dataset in fit.datasets:
            cells = [c for b in fit.batches if (c := result.cell(dataset, b)) and c.accept_length]
            if cells:
                fitted = model.accept_length(result.config, dataset)
                residuals.setdefault((result.config, dataset), []).extend(
                    float(np.log(c.accept_length / fitted)) for c in cells)
    repeated = [r for r in residuals.values() if len(r) >= 2]
    dof = sum(len(r) - 1 for r in repeated)
    noise = (sum(float(np.var(r)) * len(r) for r in repeated) / dof if dof
             else ACCEPT_CV ** 2)
    misfit = max(statistics.fmean(statistics.fmean(r) ** 2 - noise / len(r)
                                  for r in residuals.values()), 0.0) if residuals else 0.0
    if misfit == 0.0:
        return {}
    return {key: misfit / (misfit + noise / len(r)) * statistics.fmean(r)
            for key, r in residuals.items()}


def _calibration_fit(profile: Profile) -> tuple[str, ...]:
    """The cost parameters measurements can tell apart: KV bandwidth efficiency only ever
    appears divided into a dataset's context length (which is fitted), and a dense target
    has no routing to diversify."""
    skip = {"kv_bandwidth_eff"} | (set() if profile.target.moe else {"tree_routing_diversity"})
    return tuple(name for name in CALIBRATION_BOUNDS if name not in skip)


def _dataset_fit(profile: Profile) -> tuple[str, ...]:
    return (*ONLINE_DATASET_FIT, "routing_diversity") if profile.target.moe else ONLINE_DATASET_FIT


def predicted_speedups(profile: Profile, configs: list[TreeConfig], batches: list[int],
                       datasets: list[str], tp: int | None = None,
                       caps: RunningCaps | None = None
                       ) -> dict[TreeConfig, dict[int, list[float]]]:
    """Noise-free speedup of every config, per batch size, per dataset (in order); with
    `caps`, each server runs as many of a batch at once as its KV pool holds."""
    model = PerfModel(profile, tp)

    def size(config: ServerConfig, batch: int) -> int:
        return caps.batch(config, batch) if caps is not None else batch

    base = {(b, d): model.throughput(BASELINE, size(BASELINE, b), d)
            for b in batches for d in datasets}
    return {c: {b: [model.throughput(c, size(c, b), d) / base[b, d] for d in datasets]
                for b in batches} for c in configs}


def _no_prior(context: SearchContext) -> str | None:
    if context.prior is None:
        why = f" ({context.prior_why_not})" if context.prior_why_not else ""
        return ("strategy 'model' needs a prior profile with the hardware and model facts"
                f"{why}: give --prior NAME_OR_FILE (see `treetune profiles` and `treetune "
                "prior`), or choose --strategy tpe")
    return None


@register("model", "fit the performance model to what was measured and launch the tree a "
          "posterior draw predicts best", auto=0, unavailable=_no_prior,
          forecasts=True)
class ModelStrategy:
    """Proposes the config a posterior draw of the fitted model predicts to improve most on
    the measured trees, at whichever batch size gains most."""

    def __init__(self, context: SearchContext) -> None:
        assert context.prior is not None  # see _no_prior
        self.context = context
        self.space = context.space
        self.floor = 1.0 - context.tolerance
        self.rng = np.random.default_rng(context.seed)
        self.fit = ModelFit(context.prior, context.batches, context.datasets, context.tp,
                            context.shapes, context.max_batch)
        self.correction = Correction(context.datasets)
        self.fitted_on: tuple[int, int] = (-1, -1)
        self.fitted_configs: set[object] = set()
        # Per measured (tree, dataset): the log-speedup shift toward its measured
        # acceptance (`acceptance_shifts`).
        self.accepted: dict[tuple[TreeConfig, str], float] = {}
        # Nothing left but configs the memory model says cannot start: TPE's own fallback.
        self.fallback = TPEStrategy(context)
        self.candidates = self._startable()

    def _startable(self) -> list[TreeConfig]:
        """Configs the memory model says cannot start are never proposed (facts, not
        fits); one whose KV pool holds fewer requests than the largest batch starts, runs
        fewer at once and is priced so (`ModelFit.caps`): it may be the best at a smaller
        batch."""
        return [c for c in self.space.configs() if self.fit.caps.starts(c)]

    def reshare(self, context: SearchContext) -> None:
        """The servers took another share of GPU memory than the prior's (`context`'s
        prior has it, `Planner.memory_notes`): the trees that can start, and how many of
        a batch each runs at once, are judged anew; the fit and what it learnt stand."""
        assert context.prior is not None
        self.context = context
        self.fallback.context = context
        self.fit.reshare(context.prior)
        self.candidates = self._startable()
        self.fitted_on = (-1, -1)  # refitted at the new caps, warm-started from the fit

    def refresh(self) -> list[TreeConfig]:
        """Refit when there is news (a new measured tree, or a re-measurement); returns
        the measured trees."""
        results, baseline = self.context.evidence()
        measured = [r for r in results if r.ok and isinstance(r.config, TreeConfig)]
        news = (len(measured), sum(len(c.launch_tok_s) for r in measured for c in r.cells[:1]))
        if baseline is not None and measured and news != self.fitted_on:
            self._judge_predictions(measured, baseline)
            self.fit.update(results, baseline,
                            ROBUST_SCALE if self.correction.misfit else None)
            self.accepted = acceptance_shifts(self.fit, measured)
            self.correction.update(self._residuals(measured, baseline))
            self.fitted_on = news
            self.fitted_configs = {r.config for r in measured}
        return [r.config for r in measured if isinstance(r.config, TreeConfig)]

    def _judge_predictions(self, measured: list[LaunchResult], baseline: LaunchResult) -> None:
        """The posterior predictive check: trees measured since the last fit, against what
        that fit predicted for them."""
        new = [r for r in measured if r.config not in self.fitted_configs]
        if self.fit.result is None or not new:
            return
        configs = [r.config for r in new if isinstance(r.config, TreeConfig)]
        predicted = model_estimates(self.fit, configs, np.random.default_rng(self.context.seed))
        z2 = []
        for result in new:
            for batch in self.fit.batches:
                for dataset in self.fit.datasets:
                    cell, base = result.cell(dataset, batch), baseline.cell(dataset, batch)
                    guess = predicted.get((result.config, batch, dataset))
                    if not cell or not base or guess is None or cell.output_tok_s <= 0:
                        continue
                    variance = guess.variance + self.context.measurement_variance(
                        result, baseline, batch, dataset)
                    shift = np.log(cell.output_tok_s / base.output_tok_s) - guess.log_mean
                    z2.append(float(shift ** 2 / variance))
        self.correction.surprise(z2)

    def _residuals(self, measured: list[LaunchResult], baseline: LaunchResult) -> list[Residual]:
        """Every measured cell against the fitted model, with its measurement variance."""
        trees = [r.config for r in measured if isinstance(r.config, TreeConfig)]
        table = predicted_speedups(self.fit.profile, trees, self.fit.batches,
                                   self.fit.datasets, self.fit.tp, self.fit.caps)
        for batch in self.fit.batches:
            self.fit.whole.serve(table, trees, batch, self.fit.datasets)
        out = []
        for result in measured:
            assert isinstance(result.config, TreeConfig)
            for batch in self.fit.batches:
                for i, dataset in enumerate(self.fit.datasets):
                    cell, base = result.cell(dataset, batch), baseline.cell(dataset, batch)
                    if not cell or not base or cell.output_tok_s <= 0 or base.output_tok_s <= 0:
                        continue
                    measured_log = np.log(cell.output_tok_s / base.output_tok_s)
                    out.append(Residual(
                        result.config, batch, dataset,
                        float(measured_log - np.log(table[result.config][batch][i])),
                        self.context.measurement_variance(result, baseline, batch, dataset)))
        return out

    def corrected(self, table: dict[TreeConfig, dict[int, list[float]]],
                  draw: np.random.Generator | None = None,
                  measured: Sequence[TreeConfig] = ()) -> None:
        """Apply the learned correction to a table of predicted speedups, in place: its
        mean, or with `draw` one joint sample of it (Thompson sampling) over the configs
        that could win under it (JOINT_CANDIDATES per batch size, by their upper bound)
        and the `measured` ones they are judged against; the others take its mean."""
        if not self.correction.misfit:
            return
        configs = list(table)
        judged_against = set(measured)
        for batch in self.fit.batches:
            shifts = np.zeros((len(configs), len(self.fit.datasets)))
            spreads = np.zeros_like(shifts)
            for i, dataset in enumerate(self.fit.datasets):
                shifts[:, i], spreads[:, i] = self.correction.predict(configs, batch, dataset)
            if draw is not None:
                upper = np.log([table[c][batch] for c in configs]) + shifts \
                    + Z_UPPER * np.sqrt(spreads)
                chosen = set(np.argsort(-upper.mean(axis=1))[:JOINT_CANDIDATES].tolist())
                chosen |= {i for i, c in enumerate(configs) if c in judged_against}
                rows = sorted(chosen)
                shifts[rows] = self.correction.sample([configs[i] for i in rows], batch, draw)
            for config, delta in zip(configs, shifts, strict=True):
                table[config][batch] = [v * float(np.exp(d))
                                        for v, d in zip(table[config][batch], delta,
                                                        strict=True)]

    def observe(self, result: LaunchResult, baseline: LaunchResult) -> None:
        """Nothing to do now: the next proposal refits from every result (see refresh)."""

    def estimates(self, configs: Sequence[TreeConfig]) -> Estimates | None:
        """The fitted model's estimates for `configs`, from every launch so far."""
        _, baseline = self.context.evidence()
        if baseline is None:
            return None
        self.refresh()
        out = model_estimates(self.fit, list(configs), np.random.default_rng(self.context.seed))
        # Measured trees at their measured acceptance (`acceptance_shifts`).
        for (config, batch, dataset), estimate in out.items():
            out[config, batch, dataset] = estimate._replace(
                log_mean=estimate.log_mean + self.accepted.get((config, dataset), 0.0))
        if not self.correction.misfit or not out:
            return _doubted(out)
        # A model that does not fit: corrected, and trusted less against the measurements
        # (the correction's variance counted whole in the ranks too: it is learned per tree).
        # A measured tree takes the correction learned without its own cells: the ranks
        # weigh this estimate against the tree's measurement as separate evidence, and a
        # correction learned from that measurement would echo it.
        ratio = self.correction.ratio
        for batch in self.fit.batches:
            for dataset in self.fit.datasets:
                mean, var = self.correction.predict(list(configs), batch, dataset)
                for config, m, v in zip(configs, mean, var, strict=True):
                    held = self.correction.held_out(config, batch, dataset)
                    shift, spread = held if held is not None else (float(m), float(v))
                    e = out[config, batch, dataset]
                    out[config, batch, dataset] = Estimate(
                        e.log_mean + shift, e.variance * ratio + spread,
                        e.rank_variance * ratio + spread)
        return _doubted(out)

    def propose(self) -> Proposal | None:
        is_known = self.context.is_known
        untried = [c for c in self.candidates if not is_known(config_key(c))]
        if not untried:
            return self.fallback.propose()
        trees = self.refresh()
        measured = len(trees)
        for design in INITIAL_DESIGN[measured:]:
            config = nearest_config(self.space, design.steps, design.topk, design.draft_tokens)
            if config in untried:
                return Proposal(config)
        if self.context.evidence()[1] is None:
            # Asked before the baseline's result only while it runs (the planner's rule):
            # past the start-up design, wait and propose from what it will show.
            return None
        explore = EXPLORE_MISFIT if self.correction.misfit else EXPLORE
        exploring = self.rng.random() < explore and measured >= 2
        # Launches under way (other workers') are believed at what this proposal's draw
        # predicts for them: a tree must improve on them too, and their near twins are
        # skipped, so N free workers get N different trees, each worth it beside the
        # others (batch Thompson sampling: each proposal has its own draw).
        seen = trees + [c for c in self.context.pending() if c not in trees]
        # Thompson sampling: one draw of the model (tempered, DRAW_INFLATE), and the
        # untried tree that draw says improves most on the measured trees, at whichever
        # batch size gains most. A draw in which no untried tree clears the floor has
        # nothing to launch (its best move is no speculation): drawn again, and at last
        # the fit itself.
        inflate = EXPLORE_INFLATE if exploring else DRAW_INFLATE
        for draw in range(REDRAWS + 1):
            profile = (self.fit.sample(self.rng, inflate=inflate) if draw < REDRAWS
                       else self.fit.profile)
            pick = self._best_under(profile, untried, seen, self.rng if draw < REDRAWS
                                    else None)
            if pick is not None:
                # An exploring draw's gain is no forecast: it must not hold back a
                # confirmation.
                return Proposal(pick[1], gain=None if exploring else pick[0])
        return Proposal(untried[int(self.rng.integers(len(untried)))])

    def _served(self, table: dict[TreeConfig, dict[int, list[float]]],
                untried: list[TreeConfig], trees: list[TreeConfig], batch: int,
                workload: tuple[int, ...], done: set[tuple[TreeConfig, int]], clear: float
                ) -> list[TreeConfig]:
        """The untried trees a proposal for `workload` (dataset indices) at `batch`
        chooses from: all of them; with cells of whole requests, the SERVED ones this
        draw's steady state ranks highest there among those `clear` of it on every dataset,
        served whole in `table` (and the measured `trees` with them), at the fit's shifts;
        `done`: the cells served already."""
        if not self.fit.whole:
            return untried
        top = _top(table, untried, batch, workload, clear, SERVED)
        fresh = [c for c in top + trees if (c, batch) not in done]
        self.fit.whole.serve(table, fresh, batch, self.fit.datasets)
        done.update((c, batch) for c in fresh)
        return top

    def _best_under(self, profile: Profile, untried: list[TreeConfig], trees: list[TreeConfig],
                    draw: np.random.Generator | None) -> tuple[float, TreeConfig] | None:
        """The untried tree that `profile` (with the correction, drawn with `draw`) says
        gains most over `trees` (the measured ones, and those under way) at some batch
        size, with that gain; None when no untried tree is predicted clear of the floor,
        other than near twins.

        Where no tree is predicted clear of the floor on every dataset at any batch size,
        the study recommends each dataset its own tree (what a server dedicated to that
        workload runs): the gain is then over each dataset's best."""
        table = predicted_speedups(profile, untried + trees, self.fit.batches,
                                   self.fit.datasets, self.fit.tp, self.fit.caps)
        self.corrected(table, draw=draw, measured=trees)
        done: set[tuple[TreeConfig, int]] = set()
        every = tuple(range(len(self.fit.datasets)))
        pick = self._gain_over(table, untried, trees, [every], done)
        if pick is None and len(every) > 1:
            pick = self._gain_over(table, untried, trees, [(i,) for i in every], done)
        return pick

    def _gain_over(self, table: dict[TreeConfig, dict[int, list[float]]],
                   untried: list[TreeConfig], trees: list[TreeConfig],
                   workloads: list[tuple[int, ...]], done: set[tuple[TreeConfig, int]]
                   ) -> tuple[float, TreeConfig] | None:
        """The untried tree of most gain over `trees` for some workload (dataset indices)
        at some batch size, clear of the floor on the workload's datasets and no near twin
        of a measured tree; None if there is none. From PROVABLE_AFTER launches on, the tree
        of most gain among those the proof could reach, over the measured trees it could
        reach, when that gain is the larger."""
        pick = self._most_gain(table, untried, trees, workloads, done, lambda batch: 0.0)
        if pick is None or self._launched() < PROVABLE_AFTER:
            return pick
        provable = self._most_gain(table, untried, trees, workloads, done,
                                   self.context.proof_reach)
        return provable if provable is not None and provable[0] > pick[0] else pick

    def _most_gain(self, table: dict[TreeConfig, dict[int, list[float]]],
                   untried: list[TreeConfig], trees: list[TreeConfig],
                   workloads: list[tuple[int, ...]], done: set[tuple[TreeConfig, int]],
                   reach: Callable[[int], float]) -> tuple[float, TreeConfig] | None:
        """`_gain_over`'s search, counting at each batch size only trees predicted clear
        of the floor by `reach` (log) there: the candidates (by MARGIN at least) and the
        measured trees their gain is over."""
        best_pick: tuple[float, TreeConfig] | None = None
        for batch in self.fit.batches:
            line = self.floor * math.exp(reach(batch))
            clear = max(self.floor + MARGIN, line)
            for workload in workloads:
                among = self._served(table, untried, trees, batch, workload, done, clear)
                known = np.log([table[c][batch] for c in trees]) if trees else None
                incumbent = max((statistics.fmean(cells) for c in trees
                                 if min(cells := _on(table, c, batch, workload)) >= line),
                                default=1.0)
                for config in among:
                    per = _on(table, config, batch, workload)
                    if min(per) < clear:
                        continue
                    if known is not None and np.abs(known - np.log(table[config][batch])).max(
                            axis=1).min() < NOVELTY:
                        continue  # a near twin of a measured tree: launching it teaches nothing
                    gain = statistics.fmean(per) / incumbent
                    if best_pick is None or gain > best_pick[0]:
                        best_pick = (gain, config)
        return best_pick

    def _launched(self) -> int:
        """The study's successful launches so far, the baseline's counted."""
        results, _ = self.context.evidence()
        return sum(launches_of(r) for r in results if r.ok and r.cells)


def _on(table: dict[TreeConfig, dict[int, list[float]]], config: TreeConfig, batch: int,
        workload: tuple[int, ...]) -> list[float]:
    """A config's speedups at `batch` on the workload's datasets (indices)."""
    return [table[config][batch][i] for i in workload]


def _top(table: dict[TreeConfig, dict[int, list[float]]], configs: list[TreeConfig],
         batch: int, workload: tuple[int, ...], floor: float, count: int
         ) -> list[TreeConfig]:
    """The `count` configs of the highest mean speedup at `batch` over the workload's
    datasets (indices) among those clear of `floor` on each of them."""
    clear = [c for c in configs if min(_on(table, c, batch, workload)) >= floor]
    return sorted(clear, key=lambda c: -statistics.fmean(_on(table, c, batch, workload))
                  )[:count]


def _doubted(estimates: Estimates) -> Estimates:
    """`estimates` with RANK_SD_FLOOR's variance added to each: what the model's form may
    be off between two trees, which no posterior draw of its parameters shows."""
    floor = RANK_SD_FLOOR ** 2
    return {key: Estimate(e.log_mean, e.variance + floor, e.rank_variance + floor)
            for key, e in estimates.items()}


def model_estimates(fit: ModelFit, configs: list[TreeConfig], rng: np.random.Generator,
                    samples: int = 12) -> dict[tuple[TreeConfig, int, str], Estimate]:
    """The fitted model's log-speedup per (config, batch, dataset), with its variance over
    parameter sets drawn from the fit's posterior: how much the model knows, pooled from
    every launch so far. Its rank variance is the variance of the config's draws about
    each draw's mean over `configs`: what the draws move alike (the model's level) orders
    no two of them. In the 30B's own profile, three seeds at 8 and 14 launches, the rank
    variance was 7-56% of the variance (mean over the measured trees at batch 1 or 32).

    The estimate is the fit's own prediction, not the mean of the draws: a parameter the
    data hardly determine is drawn across its bounds and clipped there, and the speedups
    are far from linear in it, so the draws' mean can sit well off the fit (12% below both
    the fit and the measurements of every tree, in an 8B study of five trees)."""
    if fit.result is None or not configs:
        return {}
    fitted = predicted_speedups(fit.profile, configs, fit.batches, fit.datasets, fit.tp,
                                fit.caps)
    draws = [predicted_speedups(fit.sample(rng, inflate=1.0), configs, fit.batches,
                                fit.datasets, fit.tp, fit.caps) for _ in range(samples)]
    out: dict[tuple[TreeConfig, int, str], Estimate] = {}
    for batch in fit.batches:
        for i, dataset in enumerate(fit.datasets):
            logs = np.log([[d[c][batch][i] for c in configs] for d in draws])  # draw x config
            own = logs - logs.mean(axis=1, keepdims=True)
            for j, config in enumerate(configs):
                variance = max(float(logs[:, j].var()), 1e-6)
                out[config, batch, dataset] = Estimate(
                    float(np.log(fitted[config][batch][i]))
                    + fit.whole.shift(config, batch, dataset), variance,
                    min(max(float(own[:, j].var()), 1e-6), variance) if len(configs) > 1
                    else variance)
    return out
