"""What the measurements of a config say, with their uncertainty: the one place that
computes speedups, their intervals, the floor, feasibility and the ranking. The search's
constraints, its progress line, the recommendations, the report and the notebooks all ask
here, so they cannot disagree.

A config may be launched more than once (a borderline config is re-measured): its launches
are merged into one `LaunchResult` whose cells keep each launch's throughput. A cell's
relative variance has two parts: the spread of its sub-windows within a launch, and the
launch-to-launch spread (clock boost, placement), which sub-windows cannot see. Both are
learned from the whole study (`study_noise`): the launch spread from every config launched
more than once, shrunk toward a prior (`search.launch_cv`) while there are few.

A speedup's interval combines the config's cell and the baseline's cell (the baseline's own
launch noise shifts every speedup alike, which is why it is re-measured too). A spread learned
from few launches is itself uncertain: the interval's reach is a Student-t quantile for the
degrees of freedom behind it (Welch-Satterthwaite over the launch and sub-window parts), so
the intervals hold what they claim early in a study too, and narrow as the noise is learned.

On several nodes, every node runs the baseline and each tree is compared with the baseline
of its own node (`level_nodes`): a node slow for every launch it runs biases no speedup.
A machine whose speed clearly moves with time, as the baseline's launches at several times
show it, has the trend leveled out (`level_trend`): a tree launched late is compared with
the baseline at the baseline's time.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

from scipy import stats

from treetune.config import BASELINE, ServerConfig
from treetune.objectives import THROUGHPUT, CellKey, Criterion, Objective
from treetune.results import CellResult, Latency, LaunchResult, config_key, launches_of
from treetune.strategies import Estimate, Estimates

if TYPE_CHECKING:
    from treetune.study.spec import StudySpec

Z_INTERVAL = 1.96  # the intervals shown and judged for coverage: two-sided 95%
# Feasibility rests on a one-sided 99% lower bound: a tree truly just below the floor passes
# about 1% of the time, the false-feasible limit the search is held to (issue 11); a 95%
# bound would let such a tree through 2.5% of the time on each dataset.
Z_LOWER = 2.326
# A single launch is trusted on its own only when even twice the interval's reach keeps it
# clear of the floor: one launch can be lucky (a fast allocator draw, a warm clock).
Z_SURE = 2 * Z_INTERVAL


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float

    def straddles(self, floor: float) -> bool:
        return self.low < floor <= self.high

    def label(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"

    @property
    def log_sd(self) -> float:
        """The standard error of log(speedup) that this interval spans (Z_INTERVAL each
        way)."""
        return (math.log(self.high) - math.log(self.low)) / (2 * Z_INTERVAL)


def merge(results: Iterable[LaunchResult]) -> LaunchResult:
    """One result per config: the successful launches merged, cell by cell (the mean of
    per-launch throughputs, latency percentiles and goodputs; `launch_metrics` keeps each
    launch's objectives); a failed launch only when none succeeded."""
    results = list(results)
    ok = [r for r in results if r.ok]
    if not ok:
        return results[-1]
    if len(ok) == 1:
        return ok[0]
    first = ok[0]
    cells = [_merge_cell(cell, [c for r in ok if (c := r.cell(cell.dataset, cell.batch))])
             for cell in first.cells]
    rate_cells = [_merge_cell(cell, [c for r in ok
                                     if (c := r.rate_cell(cell.dataset, cell.rate or 0.0))])
                  for cell in first.rate_cells]
    return dataclasses.replace(first, cells=cells, rate_cells=rate_cells,
                               attempts=sum(r.attempts for r in ok),
                               leveled=_merge_leveled(ok),
                               trend=statistics.fmean(r.trend for r in ok))


def _merge_leveled(ok: list[LaunchResult]) -> tuple[tuple[str, float, float], ...]:
    """The node leveling of merged launches: per node, the share of them leveled there
    (and the baseline's launches there)."""
    base: dict[str, float] = {}
    share: dict[str, float] = {}
    for result in ok:
        for node, part, launches in result.leveled:
            share[node] = share.get(node, 0.0) + part / len(ok)
            base[node] = launches
    return tuple((node, share[node], base[node]) for node in sorted(share))


def _merge_cell(cell: CellResult, same: list[CellResult]) -> CellResult:
    per_launch = tuple(v for c in same for v in (c.launch_tok_s or (c.output_tok_s,)))
    accepts = [c.accept_length for c in same if c.accept_length is not None]
    metrics = tuple(m for c in same for m in (c.launch_metrics or (_metrics(c),)))
    goodputs = [c.goodput for c in same if c.goodput is not None]
    return dataclasses.replace(
        cell,
        output_tok_s=statistics.fmean(per_launch),
        accept_length=statistics.fmean(accepts) if accepts else None,
        requests=sum(c.requests for c in same),
        output_tokens=sum(c.output_tokens for c in same),
        duration_s=sum(c.duration_s for c in same),
        errors=sum(c.errors for c in same),
        error=next((c.error for c in reversed(same) if c.error), ""),
        unfinished=sum(c.unfinished for c in same),
        repeats=tuple(v for c in same for v in c.repeats),
        launch_tok_s=per_launch,
        ttft=_mean_latency([c.ttft for c in same]),
        tpot=_mean_latency([c.tpot for c in same]),
        itl=_mean_latency([c.itl for c in same]),
        e2e=_mean_latency([c.e2e for c in same]),
        goodput=statistics.fmean(goodputs) if goodputs else None,
        launch_metrics=metrics,
    )


def _metrics(cell: CellResult) -> dict[str, float | None]:
    return {o.value: o.value_of(cell) for o in Objective if o is not Objective.THROUGHPUT}


def _mean_latency(latencies: list[Latency | None]) -> Latency | None:
    known = [x for x in latencies if x is not None]
    if not known:
        return None
    return Latency(*(statistics.fmean(getattr(x, p) for x in known)
                     for p in ("p50", "p90", "p99")))


def merge_all(results: Iterable[LaunchResult]) -> dict[str, LaunchResult]:
    """Every config's merged result, keyed by config key, in first-launch order."""
    grouped: dict[str, list[LaunchResult]] = {}
    for result in results:
        grouped.setdefault(config_key(result.config), []).append(result)
    return {key: merge(group) for key, group in grouped.items()}


def merge_leveled(launched: list[LaunchResult], prior_launch_cv: float,
                  learned: bool = True) -> dict[str, LaunchResult]:
    """`merge_all` of the launches as `level_nodes` and then `level_trend` level them:
    what the study judges. `prior_launch_cv`, `learned`: the study's launch noise prior
    (see `study_noise`), which the trend's error is judged by."""
    return merge_all(leveled_launches(launched, prior_launch_cv, learned)[0])


def leveled_launches(launched: list[LaunchResult], prior_launch_cv: float,
                     learned: bool = True) -> tuple[list[LaunchResult], Trend | None]:
    """The launches as `level_nodes` and then `level_trend` level them, and the trend
    leveled (None: none)."""
    # The trend first, from the launches as measured (its fit is about each node's own
    # mean): a node's baseline run at another mean time than the others' holds part of
    # the trend in its gap, which leveling the nodes first would take out twice.
    # Its slope is the noise's own; the noise learned without it is learned only for a
    # trend large enough to level (this runs after every launch).
    fitted = launch_trend(launched, StudyNoise.prior(prior_launch_cv))
    if fitted is None or not fitted.large:
        return level_nodes(launched)[0], None
    # The trend is judged by the launch noise learned with it taken out: a trend widens
    # the baseline's spread, which would hide it (the baseline's slope fitted costs its
    # spread one degree of freedom).
    detrended = level_nodes(_detrended(launched, fitted))[0]
    noise = study_noise(merge_all(detrended).values(), prior_launch_cv, learned=learned)
    noise = dataclasses.replace(noise, launch_dof=max(noise.launch_dof - 1, 0))
    leveled, trend = level_trend(launched, noise)
    return level_nodes(leveled)[0], trend


PRIOR_LAUNCHES = 2  # the prior launch spread counts as this many degrees of freedom
# The prior launch spread: the stated one with this weight, else this share of it
# (`learned_cv`).
QUIET_MIX = (0.95, 1 / 3)
# A launch this many expected deviations from its config's other launches, and at least
# this far in speed, is called odd (a slow GPU, a busy node: `odd_launch`). Under the
# log-normal launch noise the study assumes, 4 deviations happen once in about 16,000.
ODD_SIGMAS = 4.0
ODD_SHIFT = 0.05
# A node is called slow (or fast) at NODE_SIGMAS standard errors and this far in speed: a
# few percent on every launch biases every speedup it measures (`node_shifts`). Few configs
# run on two nodes in a study: in a two-node probe the model search's studies named a node
# 8% slow in 17 of 24 (at launch 11-29), and a node in none of 24 with the nodes alike
# (benchmarks/RESULTS.md, stop 42).
NODE_SIGMAS = 3.0
NODE_SHIFT = 0.03
NODE_CONFIGS = 3  # configs launched on the node and elsewhere: one slow launch is no node
# A time trend in the launches' speed is leveled only when it is clear (`Trend.clear`):
# this many standard errors of its slope (two-sided, about 1%), a move of at least this
# over the launches so far, from at least this many baseline launches.
TREND_SIGMAS = 2.576
TREND_SHIFT = 0.03
TREND_BASELINES = 3


@dataclass(frozen=True)
class StudyNoise:
    """How much a measurement moves, learned from the study itself: the launch-to-launch
    spread (clock boost, placement: common to every cell of a launch) and the spread of a
    cell's sub-windows, as coefficients of variation. A fixed prior would either block
    trees that are truly faster (SGLang's own spread is well under the 3% default) or, on
    a noisier engine, ship regressions."""

    launch_cv: float
    window_cv: float | None = None  # None: each cell's own sub-window spread
    launch_dof: int = 0  # degrees of freedom behind launch_cv (0: the prior alone)
    window_dof: int = 0
    # The objective this noise is of: another than throughput has no sub-windows, and
    # its launch spread is per cell (`_objective_noise`).
    objective: Objective = Objective.THROUGHPUT
    # Whether launch_cv may be learned: a study that never re-launches takes its prior as
    # stated, with no Student-t widening (nothing it measures could revise the prior).
    learned: bool = True

    @classmethod
    def prior(cls, launch_cv: float, learned: bool = True) -> StudyNoise:
        return cls(launch_cv, learned=learned)

    def dof_of(self, launch_var: float, window_var: float) -> float:
        """Degrees of freedom of a variance made of a launch part and a sub-window part
        (Welch-Satterthwaite): the launch spread counts its repeated launches plus the
        prior's PRIOR_LAUNCHES; the exact (zero) noise counts as known."""
        if launch_var + window_var <= 0 or not self.learned:
            return math.inf
        launch_dof = self.launch_dof + PRIOR_LAUNCHES
        terms = launch_var ** 2 / launch_dof
        if window_var > 0:
            terms += window_var ** 2 / max(self.window_dof, 1)
        return (launch_var + window_var) ** 2 / terms


def noise_of(spec: StudySpec, results: Iterable[LaunchResult]) -> StudyNoise:
    """The noise of `spec`'s objective learned from its (merged) results, from the prior
    its search states (see `study_noise`)."""
    return study_noise(results, spec.search.launch_cv, spec.objective,
                       spec.search.learns_noise)


def study_noise(results: Iterable[LaunchResult], prior_launch_cv: float,
                objective: Objective = Objective.THROUGHPUT, learned: bool = True,
                windows: tuple[float, int] | None = None) -> StudyNoise:
    """The study's noise from its (merged) results: sub-window spread pooled over every
    launch and cell; launch spread pooled over every config launched more than once (the
    baseline first of all), less what the sub-windows explain, shrunk toward the prior of
    PRIOR_LAUNCHES degrees of freedom (`learned_cv`). For another objective than
    throughput, see `_objective_noise`. `learned`: whether the study re-launches at all (see
    StudyNoise.learned). `windows`: the sub-window spread to use (`window_spread` of other
    launches than `results`; default: `results`'s)."""
    results = list(results)
    if objective is not Objective.THROUGHPUT:
        return dataclasses.replace(_objective_noise(results, prior_launch_cv, objective),
                                   learned=learned)
    window_ss, window_dof = window_spread(results) if windows is None else windows
    repeated = [r for r in results
                if r.ok and r.cells and len(r.cells[0].launch_tok_s) >= 2]
    window_var = window_ss / window_dof if window_dof else None
    launch_ss = 0.0
    launch_dof = 0
    for result in repeated:
        cells = [c for c in result.cells if len(c.launch_tok_s) >= 2
                 and all(v > 0 for v in c.launch_tok_s)]
        if not cells:
            continue
        k = min(len(c.launch_tok_s) for c in cells)
        # The launch factor is common to the cells of a launch: average it over them.
        logs = [[math.log(v) for v in c.launch_tok_s[:k]] for c in cells]
        means = [statistics.fmean(row) for row in logs]
        deviations = [statistics.fmean(row[i] - mean for row, mean in zip(logs, means, strict=True))
                      for i in range(k)]
        ss = sum(d * d for d in deviations)
        # The baseline leveled on N nodes was fitted its N node means (`level_nodes`).
        fitted = len(result.leveled) if result.config == BASELINE and result.leveled else 1
        if k <= fitted:
            continue
        if window_var is not None:
            # The sub-windows' share of the deviations: as many of their variances as the
            # deviations have degrees of freedom.
            per_launch = max(len(cells[0].repeats) // len(cells[0].launch_tok_s), 1)
            ss -= (k - fitted) * window_var / (per_launch * len(cells))
        launch_ss += max(ss, 0.0)
        launch_dof += k - fitted
    return StudyNoise(learned_cv(launch_ss, launch_dof, prior_launch_cv),
                      math.sqrt(window_var) if window_var is not None else None,
                      launch_dof, window_dof, learned=learned)


def learned_cv(ss: float, dof: int, prior_cv: float) -> float:
    """The launch spread learned from `dof` degrees of freedom of squared log deviations
    `ss`, from a prior that is a mix of scales: the stated `prior_cv` (weight
    QUIET_MIX[0]) and QUIET_MIX[1] times it (a quiet engine: SGLang's own spread is well
    under the 3% default). Each scale is the conjugate prior of PRIOR_LAUNCHES degrees of
    freedom; the learned variance is the posterior mean over both, each weighed by how
    well it explains the repeats (the F(dof, PRIOR_LAUNCHES) density of ss / dof over its
    variance). With nothing learned it is the stated spread: a study that never repeats a
    launch assumes what it was told.

    The quiet scale's weight is small because a few repeats cannot tell the two engines
    apart: with more weight it narrowed a 3% engine's early bounds, where the search makes
    its first recommendations (benchmarks/RESULTS.md, stop 57: weight 0.2 cost 7% more
    launches to a stable pick at 3%). And the spread is never learned below the quiet
    scale: repeats that agree more than that are more likely luck than an engine that
    quiet (without the floor a 1% engine learned 0.59% from 9 degrees of freedom and
    shipped a tree 0.6% slower than no speculation)."""
    if prior_cv <= 0:  # a prior of no noise: the repeats alone, shrunk as a prior's would
        return math.sqrt(ss / (dof + PRIOR_LAUNCHES))
    if dof <= 0:
        return prior_cv
    stated_weight, quiet = QUIET_MIX
    observed = max(ss / dof, 1e-12 * prior_cv ** 2)
    logs, means = [], []
    for weight, scale in ((stated_weight, prior_cv), (1.0 - stated_weight, quiet * prior_cv)):
        var = scale ** 2
        logs.append(math.log(weight) + stats.f.logpdf(observed / var, dof, PRIOR_LAUNCHES)
                    - math.log(var))
        means.append((ss + PRIOR_LAUNCHES * var) / (dof + PRIOR_LAUNCHES))
    top = max(logs)
    weights = [math.exp(v - top) for v in logs]
    mixed = math.sqrt(sum(w * m for w, m in zip(weights, means, strict=True)) / sum(weights))
    return max(mixed, quiet * prior_cv)


def window_spread(results: Iterable[LaunchResult]) -> tuple[float, int]:
    """The sum of squared log deviations of every launch's sub-windows from their launch's
    mean, over every cell of `results`, and its degrees of freedom."""
    ss, dof = 0.0, 0
    for result in results:
        if not result.ok:
            continue
        for cell in result.cells:
            launches = len(cell.launch_tok_s) or 1
            per = len(cell.repeats) // launches
            for i in range(launches if per >= 2 else 0):
                logs = [math.log(v) for v in cell.repeats[i * per:(i + 1) * per] if v > 0]
                if len(logs) >= 2:
                    mean = statistics.fmean(logs)
                    ss += sum((v - mean) ** 2 for v in logs)
                    dof += len(logs) - 1
    return ss, dof


def _objective_noise(results: Iterable[LaunchResult], prior_cv: float,
                     objective: Objective) -> StudyNoise:
    """The launch-to-launch spread of a latency or goodput, per cell (closed and open
    loop), pooled over every config launched more than once and shrunk toward the prior
    as throughput's is. A percentile has no sub-windows to split: each launch's value is
    one draw of the whole measurement (its sampling error of a few hundred requests and
    the launch's speed alike), so this spread is all of a measurement's noise; and it is
    each cell's own (a p99 wanders per cell, not with a launch-wide factor)."""
    ss = 0.0
    dof = 0
    for result in results:
        if not result.ok:
            continue
        for cell in (*result.cells, *result.rate_cells):
            logs = [math.log(v) for v in launch_values(cell, objective)
                    if v is not None and 0 < v < math.inf]
            if len(logs) >= 2:
                mean = statistics.fmean(logs)
                ss += sum((v - mean) ** 2 for v in logs)
                dof += len(logs) - 1
    return StudyNoise(learned_cv(ss, dof, prior_cv), None, dof, 0, objective)


def common_cells(launches: list[LaunchResult]) -> list[list[CellResult]]:
    """Per cell that every one of `launches` (of one config) measured with a throughput:
    each launch's cell, in the launches' order."""
    rows = []
    for cell in launches[0].cells if launches else []:
        same = [r.cell(cell.dataset, cell.batch) for r in launches]
        if all(c is not None and c.output_tok_s > 0 for c in same):
            rows.append([c for c in same if c is not None])
    return rows


def launch_levels(rows: list[list[CellResult]]) -> list[float]:
    """Each launch's mean log throughput over the `common_cells` rows: its speed, as the
    launch factor common to its cells moves it."""
    return [statistics.fmean(math.log(row[i].output_tok_s) for row in rows)
            for i in range(len(rows[0]))]


@dataclass(frozen=True)
class OddLaunch:
    """One launch of a config that ran unlike the config's other launches."""

    index: int  # which of the config's launches, oldest first (0: its first; failed ones count)
    shift: float  # its speed against the mean of the others', minus 1 (below 0: slower)
    sigmas: float  # how many of the study's expected deviations that is
    worker: str  # where it ran (worker@host)


def odd_launch(launches: list[LaunchResult], noise: StudyNoise,
               skip: Iterable[int] = ()) -> OddLaunch | None:
    """The launch of one config (`launches`: each of its launches, oldest first) whose
    throughput, averaged over its cells, sits farthest from the mean of the config's other
    launches, when that is at least ODD_SIGMAS of the deviation `noise` explains and
    ODD_SHIFT in speed; None otherwise. A slow GPU, a busy node or a degraded link slows
    every cell of a launch alike, which the study's log-normal launch noise does not
    expect; `noise` should be learned without this config's own launches, which the odd one
    would inflate. With two launches either may be the odd one: the slower is named.
    `skip`: launches (indices) already named, left out of the comparison."""
    skipped = set(skip)
    measured = [(i, r) for i, r in enumerate(launches)
                if r.ok and r.cells and i not in skipped]
    done = [r for _, r in measured]
    if len(done) < 2 or noise.objective is not Objective.THROUGHPUT:
        return None
    rows = common_cells(done)
    if not rows:
        return None
    levels = launch_levels(rows)
    window_var = sum(statistics.fmean(relative_variance(c, noise) - noise.launch_cv ** 2
                                      for c in row) for row in rows)
    k = len(done)
    deviations = [levels[i] - (sum(levels) - levels[i]) / (k - 1) for i in range(k)]
    # A launch factor is common to its cells; sub-window noise averages over them.
    sd = math.sqrt((noise.launch_cv ** 2 + window_var / len(rows) ** 2) * k / (k - 1))
    index = min(range(k), key=lambda i: (-abs(deviations[i]) if k > 2 else deviations[i]))
    shift = math.exp(deviations[index]) - 1
    if sd <= 0 or abs(deviations[index]) < ODD_SIGMAS * sd or abs(shift) < ODD_SHIFT:
        return None
    return OddLaunch(measured[index][0], shift, abs(deviations[index]) / sd,
                     done[index].worker)


@dataclass(frozen=True)
class NodeShift:
    """How a node's launches ran against other nodes' launches of the same configs."""

    node: str
    shift: float  # its speed against the others', minus 1 (below 0: slower)
    sigmas: float  # how many standard errors (of the launch noise given) that is
    launches: int  # its launches compared
    configs: int  # configs launched both there and elsewhere


def worker_host(worker: str) -> str:
    """The host part of a worker's name (worker-N@host); '' if unnamed."""
    return worker.partition("@")[2]


def node_of(result: LaunchResult) -> str:
    """The host a launch ran on, from its worker's name; '' if unnamed."""
    return worker_host(result.worker)


def node_shifts(launched: Iterable[LaunchResult], noise: StudyNoise) -> list[NodeShift]:
    """Every node whose launches ran, config for config, at least NODE_SIGMAS standard
    errors and NODE_SHIFT in speed from the other nodes' launches of the same configs. A
    power-capped or hot node is slow for every launch it runs: the study compares its
    trees with its own baseline (`level_nodes`) and names it. Per config the gap is the mean
    `launch_levels` of its launches on the node less that of its launches elsewhere, its
    variance from `noise`'s launch spread; configs combine by inverse variance; a node
    needs NODE_CONFIGS configs launched there and elsewhere (one odd launch is
    `odd_launch`'s). Of two nodes only the slower is returned (the gap is one)."""
    if noise.objective is not Objective.THROUGHPUT:
        return []
    by_config: dict[str, list[LaunchResult]] = {}
    for result in launched:
        if result.ok and result.cells and node_of(result):
            by_config.setdefault(config_key(result.config), []).append(result)
    per_config: dict[str, list[tuple[str, float]]] = {}
    for key, results in by_config.items():
        if rows := common_cells(results):
            per_config[key] = list(zip(map(node_of, results), launch_levels(rows),
                                       strict=True))
    variance = noise.launch_cv ** 2
    if variance <= 0:
        return []
    nodes = sorted({node for values in per_config.values() for node, _ in values})
    out = []
    for node in nodes if len(nodes) > 1 else []:
        weight = total = 0.0
        launches = configs = 0
        for values in per_config.values():
            here = [v for n, v in values if n == node]
            there = [v for n, v in values if n != node]
            if here and there:
                w = 1 / (variance * (1 / len(here) + 1 / len(there)))
                weight += w
                total += w * (statistics.fmean(here) - statistics.fmean(there))
                launches += len(here)
                configs += 1
        if configs < NODE_CONFIGS:
            continue
        gap, error = total / weight, math.sqrt(1 / weight)
        shift = math.exp(gap) - 1
        if abs(gap) >= NODE_SIGMAS * error and abs(shift) >= NODE_SHIFT:
            out.append(NodeShift(node, shift, abs(gap) / error, launches, configs))
    # Two nodes are one gap seen from both sides: the slower names it.
    return [s for s in out if s.shift < 0] if len(nodes) == 2 else out


def node_yardstick(launched: Iterable[LaunchResult], prior_launch_cv: float,
                   learned: bool = True) -> StudyNoise:
    """The launch noise to judge nodes by: learned from configs launched more than once
    on one node (the study's own noise holds the gap between nodes), the prior's where
    there are none."""
    same_node: dict[tuple[str, str], list[LaunchResult]] = {}
    for result in launched:
        same_node.setdefault((config_key(result.config), node_of(result)), []).append(result)
    return study_noise([merge(rs) for rs in same_node.values()], prior_launch_cv,
                       learned=learned)


def level_nodes(launched: list[LaunchResult]) -> tuple[list[LaunchResult], dict[str, float]]:
    """Every launch (oldest first), each node's measured at one speed, and each node's gap
    (log). Every node a study uses runs the baseline (`Planner.next`), which is launched
    whatever it measures: a node's gap is its baseline launches' mean level (mean log
    throughput over their common cells) less the mean of the nodes' means, and every
    launch there is divided by it. A tree is so compared with the baseline measured on its
    own node, which a power-capped or hot node (slow for every launch it runs) cannot
    bias; with one node, or the baseline on one node so far, the launches as they are.
    A leveled launch notes its node and the baseline's launches there
    (`LaunchResult.leveled`): its speedup's interval carries that baseline's error
    (`node_variance`). Latencies and goodput are left as measured."""
    base = [r for r in launched if r.ok and r.cells and r.config == BASELINE and node_of(r)]
    nodes = sorted({node_of(r) for r in base})
    if len(nodes) < 2 or not (rows := common_cells(base)):
        return launched, {}
    levels: dict[str, list[float]] = {}
    for result, level in zip(base, launch_levels(rows), strict=True):
        levels.setdefault(node_of(result), []).append(level)
    means = {node: statistics.fmean(v) for node, v in levels.items()}
    center = statistics.fmean(means.values())
    gaps = {node: mean - center for node, mean in means.items()}
    counts = {node: float(len(v)) for node, v in levels.items()}
    return [_leveled(r, gaps[node], counts[node])
            if r.ok and (node := node_of(r)) in gaps else r for r in launched], gaps


def _leveled(result: LaunchResult, gap: float, base_launches: float) -> LaunchResult:
    return dataclasses.replace(_scaled(result, math.exp(-gap)),
                               leveled=((node_of(result), 1.0, base_launches),))


def _scaled(result: LaunchResult, factor: float) -> LaunchResult:
    """`result` with every throughput it measured times `factor`."""
    def cell(c: CellResult) -> CellResult:
        return dataclasses.replace(
            c, output_tok_s=c.output_tok_s * factor,
            repeats=tuple(v * factor for v in c.repeats),
            launch_tok_s=tuple(v * factor for v in c.launch_tok_s))

    return dataclasses.replace(result, cells=[cell(c) for c in result.cells],
                               rate_cells=[cell(c) for c in result.rate_cells])


@dataclass(frozen=True)
class Trend:
    """How the machine's speed moved with time over a study's launches, as the baseline's
    launches show it (`launch_trend`)."""

    slope: float  # log speed per launch (0.003: 0.3% faster with each launch)
    se: float  # the slope's standard error
    dof: float  # degrees of freedom of the launch noise it is judged by
    baselines: int  # the baseline's launches it was fitted from
    launches: int  # the study's launches so far

    @property
    def sigmas(self) -> float:
        return abs(self.slope) / self.se if self.se > 0 else 0.0

    @property
    def large(self) -> bool:
        """Whether the trend is large enough to level, whatever its error: a move of
        TREND_SHIFT or more over the study's launches so far, from TREND_BASELINES
        baseline launches or more."""
        return (self.baselines >= TREND_BASELINES
                and abs(self.slope) * max(self.launches - 1, 1) >= TREND_SHIFT)

    @property
    def clear(self) -> bool:
        """Whether the trend is both large (`large`) and sure (TREND_SIGMAS standard
        errors, as far as a Student-t of its degrees of freedom reaches)."""
        return self.large and self.se > 0 and \
            self.sigmas >= TREND_SIGMAS * widening(self.dof, TREND_SIGMAS)


def launch_trend(launched: list[LaunchResult], noise: StudyNoise) -> Trend | None:
    """The time trend of the machine's speed over `launched` (a launch's time is its place
    among them, `places`): the baseline's launches' `launch_levels`, each about its node's
    mean, against their places, one least-squares slope; its error from the study's noise
    (`noise`: a launch's level moves by its launch_cv and its cells' mean sub-window
    noise). None with fewer than two baseline launches on a node.

    Only the baseline's launches: it is launched on a schedule, whatever it measures, where
    a tree is launched again because its first launch looked good (a confirmation, a
    race), so its next launch tends lower (regression to the mean) and trees' repeats read
    as a falling trend: in a traced study at +1% per launch they fitted +0.02% to +0.23%,
    at about 0.3% standard error (benchmarks/RESULTS.md, stop 68)."""
    by_node: dict[str, list[tuple[int, LaunchResult]]] = {}
    for place, result in zip(places(launched), launched, strict=True):
        if result.ok and result.cells and result.config == BASELINE:
            by_node.setdefault(node_of(result), []).append((place, result))
    groups = []
    variance = 0.0  # a level's: the launch factor's and its cells' mean sub-window noise
    for items in by_node.values():
        if len(items) >= 2 and (rows := common_cells([r for _, r in items])):
            groups.append(([float(place) for place, _ in items], launch_levels(rows)))
            window = statistics.fmean(variance_parts(c, noise)[1] for row in rows for c in row)
            variance = max(variance, noise.launch_cv ** 2 + window / len(rows))
    centered = [(t - statistics.fmean(ts), y - statistics.fmean(ys))
                for ts, ys in groups for t, y in zip(ts, ys, strict=True)]
    sxx = sum(t * t for t, _ in centered)
    if sxx <= 0:
        return None
    slope = sum(t * y for t, y in centered) / sxx
    dof = noise.launch_dof + PRIOR_LAUNCHES if noise.learned else math.inf
    return Trend(slope, math.sqrt(variance / sxx), dof, len(centered), len(launched))


def places(launched: list[LaunchResult]) -> list[int]:
    """Each launch's place in time among `launched`: by when it started, where that is
    known (the runner stamps it), else by its place in the list. The planner keeps
    launches in the order they finish and the stored study in the order they were begun;
    with several workers these differ, and a trend judged by either would differ too."""
    order = sorted(range(len(launched)), key=lambda i: (launched[i].started_at or 0.0, i))
    place = [0] * len(launched)
    for rank, i in enumerate(order):
        place[i] = rank
    return place


def level_trend(launched: list[LaunchResult], noise: StudyNoise
                ) -> tuple[list[LaunchResult], Trend | None]:
    """Every launch (oldest first) at the speed of the baseline's launches' mean time, when
    the machine's speed clearly moved with time (`launch_trend`, `Trend.clear`), and the
    trend leveled (None: the launches as they are). A machine that warms up or a
    neighbour that leaves makes the trees launched late look faster than the baseline
    launched early, by more than the launch noise, taken as independent, allows: a tree
    truly below the floor was recommended (benchmarks/RESULTS.md, stop 66). A leveled
    launch notes the slope's error times its distance in launches from the baseline's
    mean time (`LaunchResult.trend`): its speedup's interval carries that error
    (`leveling_variance`). Latencies and goodput are left as measured."""
    trend = launch_trend(launched, noise)
    if trend is None or not trend.clear:
        return launched, None
    return _detrended(launched, trend), trend


def _detrended(launched: list[LaunchResult], trend: Trend) -> list[LaunchResult]:
    """Every launch (oldest first) at the speed of the baseline's launches' mean time, by
    `trend`'s slope; each noting the slope's error times its distance from that time."""
    timed = list(zip(places(launched), launched, strict=True))
    center = statistics.fmean(place for place, r in timed
                              if r.ok and r.cells and r.config == BASELINE)
    return [dataclasses.replace(_scaled(r, math.exp(-trend.slope * (place - center))),
                                trend=(place - center) * trend.se)
            if r.ok else r for place, r in timed]


def node_variance(result: LaunchResult, baseline: LaunchResult, launch_cv: float) -> float:
    """The launch variance a node leveling adds to the log speedup of `result` against
    the (leveled) `baseline`, beyond the baseline's own launch noise counted as one pooled
    mean: a tree leveled on node n is compared with the baseline launched there, so its
    speedup carries that node's baseline mean's error (launch_cv^2 / its launches), the
    shares of its launches weighing the nodes (a share on a node without the baseline
    weighs every node alike, through the mean of their means)."""
    if result.config == BASELINE or not baseline.leveled:
        return 0.0
    counts = {node: k for node, _, k in baseline.leveled}
    shares = {node: share for node, share, _ in result.leveled if node in counts}
    rest = (1.0 - sum(shares.values())) / len(counts)
    pooled = sum(launches for launches in counts.values())
    matched = sum((shares.get(node, 0.0) + rest) ** 2 / k for node, k in counts.items())
    return launch_cv ** 2 * max(matched - 1 / pooled, 0.0)


def leveling_variance(result: LaunchResult, baseline: LaunchResult, launch_cv: float
                      ) -> float:
    """The variance the study's leveling adds to the log speedup of `result` against
    `baseline`: the node leveling's (`node_variance`) and the time trend's (its slope's
    error over the time between their launches, `level_trend`)."""
    if result.config == BASELINE:
        return 0.0
    return node_variance(result, baseline, launch_cv) + (result.trend - baseline.trend) ** 2


def launch_values(cell: CellResult, objective: Objective) -> list[float | None]:
    """The objective's value on each launch merged into `cell`."""
    if objective is Objective.THROUGHPUT:
        return list(cell.launch_tok_s or (cell.output_tok_s,))
    if cell.launch_metrics:
        return [m.get(objective.value) for m in cell.launch_metrics]
    return [objective.value_of(cell)]


def relative_variance(cell: CellResult, noise: StudyNoise) -> float:
    """Variance of log(measured / true value) of a cell's (merged) measurement: each
    launch's factor plus the mean of its sub-windows, averaged over the launches (for
    another objective than throughput, its per-launch spread over the launches)."""
    return sum(variance_parts(cell, noise))


def variance_parts(cell: CellResult, noise: StudyNoise) -> tuple[float, float]:
    """`relative_variance` in its two parts: the launch factor's, and the sub-windows'
    (0 where the spread is the cell's own or the objective has none)."""
    if noise.objective is not Objective.THROUGHPUT:
        return noise.launch_cv ** 2 / len(launch_values(cell, noise.objective)), 0.0
    count = len(cell.launch_tok_s) or 1
    per_launch_repeats = len(cell.repeats) // count if cell.repeats else 0
    within = 0.0
    if noise.window_cv is not None and per_launch_repeats >= 1:
        within = noise.window_cv ** 2 / per_launch_repeats
    elif per_launch_repeats > 1 and cell.output_tok_s > 0:
        # The cell's own spread: its few windows are no better known than the launch's.
        spread = statistics.variance(cell.repeats) / cell.output_tok_s ** 2
        return (noise.launch_cv ** 2 + spread / per_launch_repeats) / count, 0.0
    return noise.launch_cv ** 2 / count, within / count


def speedup_interval(result: LaunchResult, baseline: LaunchResult, dataset: str, batch: int,
                     noise: StudyNoise, z: float = Z_INTERVAL, rate: float | None = None
                     ) -> Interval:
    """The speedup of one cell under the noise's objective (how many times better than no
    speculation: a latency's ratio is the baseline's over the tree's), with its interval;
    `rate`: the open-loop cell at that rate instead of the closed loop at `batch`."""
    return _spread(result, baseline, CellKey(dataset, batch, rate), noise).interval(z)


@dataclass(frozen=True)
class _Spread:
    """A cell's speedup with the standard error of its log and the degrees of freedom
    behind that error: every bound of the cell, at any level, follows from it."""

    mean: float
    sd: float = 0.0
    dof: float = math.inf
    # The part of `sd` that is the config's own measurement's, without the baseline's:
    # the baseline's error moves every tree's speedup in the cell alike, so it leaves
    # their order (the ranking) as it is.
    own_sd: float = 0.0

    def interval(self, z: float) -> Interval:
        if self.mean <= 0 or math.isinf(self.mean):
            return Interval(self.mean, self.mean, self.mean)
        reach = z * widening(self.dof, min(z, Z_LOWER)) * self.sd
        return Interval(self.mean, self.mean * math.exp(-reach), self.mean * math.exp(reach))


def _spread(result: LaunchResult, baseline: LaunchResult, key: CellKey,
            noise: StudyNoise) -> _Spread:
    cell, base = key.cell(result), key.cell(baseline)
    if cell is None or base is None:
        return _Spread(0.0)
    objective = noise.objective
    mean = objective.speedup(cell, base)
    parts = [variance_parts(cell, noise), variance_parts(base, noise)]
    launch, window = sum(p[0] for p in parts), sum(p[1] for p in parts)
    # A tree compared with its own node's baseline carries that baseline's error, and a
    # tree leveled for a time trend the trend's.
    nodes = (leveling_variance(result, baseline, noise.launch_cv)
             if objective is Objective.THROUGHPUT else 0.0)
    launch += nodes
    return _Spread(mean, math.sqrt(launch + window), noise.dof_of(launch, window),
                   math.sqrt(sum(parts[0]) + nodes))


@lru_cache(maxsize=1024)
def _widening(dof: float, z: float) -> float:
    return float(stats.t.ppf(stats.norm.cdf(z), dof)) / z


def widening(dof: float, z: float) -> float:
    """How much farther than the normal quantile `z` the Student-t quantile of the same
    level reaches with `dof` degrees of freedom (1 with the noise known exactly). A bound
    beyond the feasibility bound's level (Z_SURE's margin) takes that level's widening."""
    if math.isinf(dof) or dof > 1000 or z <= 0:
        return 1.0
    return _widening(round(max(dof, 1.0), 1), round(z, 3))


def intervals(result: LaunchResult, baseline: LaunchResult, batch: int, datasets: list[str],
              noise: StudyNoise, z: float = Z_INTERVAL, criterion: Criterion = THROUGHPUT
              ) -> dict[str, Interval]:
    """Per judged cell (`Criterion.cells`: each dataset, then rate cells at the largest
    batch size for objectives that judge them), its speedup interval."""
    return {k.name: speedup_interval(result, baseline, k.dataset, batch, noise, z, k.rate)
            for k in criterion.cells(datasets, batch)}


def speedups(result: LaunchResult, baseline: LaunchResult, cells: Iterable[CellKey],
             objective: Objective = Objective.THROUGHPUT) -> dict[CellKey, float]:
    """Measured speedup per cell, closed-loop or at a rate (0 where a cell is missing)."""
    exact = StudyNoise(0.0, objective=objective)
    return {c: _spread(result, baseline, c, exact).mean for c in cells}


def floor_of(tolerance: float) -> float:
    """The speedup no dataset may fall below: 1 - tolerance."""
    return 1.0 - tolerance


@dataclass(frozen=True)
class Verdict:
    """What the measurements say of one config at one batch size over a workload's
    datasets: per-dataset intervals, whether it is surely feasible, and its rank."""

    config: ServerConfig
    batch: int
    intervals: dict[str, Interval]
    floor: float
    rank: float  # mean speedup, blended with the model's estimate where there is one
    # Per dataset, the lower bound feasibility rests on: the one-sided 99% bound (Z_LOWER)
    # of a measurement; the interval's own lower end for a model estimate (`estimated_verdict`).
    lower: dict[str, float]
    launches: int = 1  # successful launches merged into the measurement
    sure: bool = False  # feasible by a wide margin (Z_SURE), even on one launch
    needs_launches: int = 1  # launches a feasible tree needs unless it is sure
    # The standard error of log(rank) from the tree's own measurement and the model's
    # estimate (the baseline's error moves every rank alike): how surely it orders trees.
    rank_sd: float = 0.0

    @property
    def mean(self) -> float:
        """Mean measured speedup over the datasets."""
        return statistics.fmean(i.mean for i in self.intervals.values())

    @property
    def overall(self) -> Interval:
        """The mean speedup over the datasets with the mean of their bounds: as wide as
        the datasets' intervals (their errors share the launch's and the baseline's)."""
        ivs = self.intervals.values()
        return Interval(self.mean, statistics.fmean(i.low for i in ivs),
                        statistics.fmean(i.high for i in ivs))

    @property
    def estimated(self) -> bool:
        """Resting on the model's estimates, with no measurement behind it."""
        return self.launches == 0

    @property
    def feasible(self) -> bool:
        """Surely no regression: every dataset's lower bound clears the floor."""
        return all(low >= self.floor for low in self.lower.values())

    @property
    def plausible(self) -> bool:
        """Not slower on average on any dataset (its interval may still reach below)."""
        return all(i.mean >= self.floor for i in self.intervals.values())

    @property
    def confirmed(self) -> bool:
        """Feasible, and resting on enough launches (or on a margin no launch noise
        explains away): what a recommendation needs."""
        return self.feasible and (self.sure or self.launches >= self.needs_launches)

    @property
    def possible(self) -> bool:
        """Not surely slower on any dataset: every interval reaches the floor."""
        return all(i.high >= self.floor for i in self.intervals.values())

    @property
    def borderline(self) -> bool:
        """Plausible but not surely feasible: another launch could settle it."""
        return self.plausible and not self.feasible

    @property
    def unsettled(self) -> bool:
        """Plausible but not confirmed: another launch could make it a recommendation."""
        return self.plausible and not self.confirmed

    def shortfalls(self) -> dict[str, float]:
        """Per dataset, how far the measured speedup falls short of the floor (<= 0: not
        slower): the constraint the per-batch Optuna studies learn from."""
        return {d: self.floor - i.mean for d, i in self.intervals.items()}


def judge(result: LaunchResult, baseline: LaunchResult, batch: int, datasets: list[str],
          tolerance: float, noise: StudyNoise, estimates: Estimates | None = None,
          needs_launches: int = 1, criterion: Criterion = THROUGHPUT) -> Verdict:
    """The verdict on one (merged) result at one batch size over the cells `criterion`
    judges there (the noise must be of its objective); `needs_launches`: how many
    launches a feasible tree needs before it may be recommended, unless it is sure. The
    model's estimates are of throughput: they join the ranking only under that
    objective."""
    assert noise.objective is criterion.objective, "noise of another objective"
    spreads = {k.name: _spread(result, baseline, k, noise)
               for k in criterion.cells(datasets, batch)}
    ivs = {name: s.interval(Z_INTERVAL) for name, s in spreads.items()}
    if criterion.objective is not Objective.THROUGHPUT:
        estimates = None
    blends = [_blend(s, estimates, result.config, batch, key) for key, s in spreads.items()]
    rank = statistics.fmean(value for value, _ in blends)
    floor = floor_of(tolerance)
    sure = all(s.interval(Z_SURE).low >= floor for s in spreads.values())
    lower = {name: s.interval(Z_LOWER).low for name, s in spreads.items()}
    return Verdict(result.config, batch, ivs, floor, rank, lower, launches_of(result), sure,
                   needs_launches, statistics.fmean(sd for _, sd in blends))


class ProofOutlook(NamedTuple):
    """What proving a measured tree feasible looks like from its measurements so far
    (`proof_outlook`)."""

    chance: float  # that its launches, up to their caps, can prove it
    launches: int  # more launches (the tree's and the baseline's) the proof needs


def proof_outlook(result: LaunchResult, baseline: LaunchResult, batch: int,
                  datasets: list[str], tolerance: float, noise: StudyNoise,
                  tree_cap: int, base_cap: int, criterion: Criterion = THROUGHPUT
                  ) -> ProofOutlook:
    """The chance that a measured tree is feasible by a margin its launches can prove: on
    every dataset, that its true speedup clears the floor by the 99% bound's reach once
    the tree has `tree_cap` launches and the baseline `base_cap` (the tree's own error and
    the baseline's shrink with their launches), as the measurements so far say. And how
    many more launches until that reach fits within every dataset's measured margin over
    the floor, the baseline launched first while it has fewer (`Planner._baseline_due`);
    all that the caps allow when none fits; at least one, a launch of its own or the
    baseline's."""
    floor = math.log(floor_of(tolerance))
    n_tree, n_base = launches_of(result), launches_of(baseline)
    spreads = [_spread(result, baseline, key, noise) for key in criterion.cells(datasets, batch)]
    if any(s.mean <= 0 for s in spreads):
        return ProofOutlook(0.0, max(tree_cap - n_tree, 0) + max(base_cap - n_base, 0) or 1)
    chance = 1.0
    for s in spreads:
        reach = _reach(s, n_tree, max(tree_cap, n_tree), n_base, max(base_cap, n_base))
        margin = math.log(s.mean) - floor - reach
        chance *= (float(stats.norm.cdf(margin / s.sd)) if s.sd > 0 else float(margin >= 0))
    tree, base, extra = n_tree, n_base, 0
    while extra == 0 or any(math.log(s.mean) - floor < _reach(s, n_tree, tree, n_base, base)
                            for s in spreads):
        if base < min(tree, base_cap):
            base += 1
        elif tree < tree_cap:
            tree += 1
        elif base < base_cap:
            base += 1
        else:
            break
        extra += 1
    return ProofOutlook(chance, max(extra, 1))


def proof_reach(baseline: LaunchResult, batch: int, datasets: list[str], noise: StudyNoise,
                launches: int) -> float:
    """How far (log) the feasibility bound (Z_LOWER) reaches below a speedup at `batch`
    measured on `launches` launches of a tree and as many of the baseline, each launch as
    noisy as the baseline's own (its launch factor and sub-windows at `noise`): the widest
    over the datasets."""
    n = launches_of(baseline)
    per_launch = max((relative_variance(cell, noise) * n for d in datasets
                      if (cell := baseline.cell(d, batch)) is not None), default=0.0)
    return Z_LOWER * math.sqrt(2 * per_launch / launches)


def _reach(spread: _Spread, n_tree: int, tree: int, n_base: int, base: int) -> float:
    """The 99% bound's reach below a speedup's log measured on `n_tree` launches of the
    tree and `n_base` of the baseline, once they have `tree` and `base`: each one's error
    shrinks with its own launches."""
    own, other = spread.own_sd ** 2, max(spread.sd ** 2 - spread.own_sd ** 2, 0.0)
    return Z_LOWER * math.sqrt(own * n_tree / tree + other * n_base / base)


def estimated_verdict(config: ServerConfig, batch: int, datasets: list[str], tolerance: float,
                      estimates: Estimates | None) -> Verdict | None:
    """What the model says of a config nobody measured, as a verdict (no launches, so never
    confirmed); None when the model has no estimate for some dataset."""
    if not estimates or any((config, batch, d) not in estimates for d in datasets):
        return None
    ivs = {}
    for d in datasets:
        log_mean, variance, _ = estimates[config, batch, d]  # type: ignore[index]
        sd = math.sqrt(max(variance, 0.0))
        ivs[d] = Interval(math.exp(log_mean), math.exp(log_mean - Z_INTERVAL * sd),
                          math.exp(log_mean + Z_INTERVAL * sd))
    rank = statistics.fmean(i.mean for i in ivs.values())
    return Verdict(config, batch, ivs, floor_of(tolerance), rank,
                   {d: i.low for d, i in ivs.items()}, launches=0)


def doubted(estimates: Estimates, results: Iterable[LaunchResult], baseline: LaunchResult,
            noise: StudyNoise) -> dict[tuple[ServerConfig, int, str], Estimate]:
    """`estimates` of the measured `results` with each batch size's rank variance raised
    by the model's misfit there: the spread of the measured trees' residuals (measured
    log speedup less the estimate, about each dataset's mean residual, which the
    baseline's error and the model's level share) beyond what their own measurement
    errors and the rank variances explain (a method-of-moments, empirical-Bayes
    estimate; 0 where the model ranks as well as it claims). A model that orders trees
    only as well as its posterior says is trusted for it; one whose trees sit off it by
    more is not, and the measurements take the ranks back (a traced study of the
    `everything` world, its model 1% apart over trees truly 13% apart, recommended a
    tree 9% below the best so). Estimates of trees not in `results` are left alone."""
    measured = {r.config: r for r in results if r.ok}
    rows: dict[tuple[int, str], list[tuple[float, float]]] = {}  # (residual, its variance)
    for (config, batch, dataset), e in estimates.items():
        if config in measured:
            spread = _spread(measured[config], baseline, CellKey(dataset, batch), noise)
            if spread.mean > 0:
                rows.setdefault((batch, dataset), []).append(
                    (math.log(spread.mean) - e.log_mean, spread.own_sd ** 2 + e.rank_variance))
    excess: dict[int, tuple[float, int]] = {}  # per batch size: summed excess, and over how many
    for (batch, _), pairs in sorted(rows.items()):  # one sum order
        if len(pairs) < 2:
            continue
        center, n = statistics.fmean(r for r, _ in pairs), len(pairs)
        total, terms = excess.get(batch, (0.0, 0))
        excess[batch] = (total + sum((r - center) ** 2 * n / (n - 1) - expected
                                     for r, expected in pairs), terms + n)
    misfit = {batch: max(total / terms, 0.0) for batch, (total, terms) in excess.items()}
    return {key: e._replace(rank_variance=e.rank_variance + misfit[key[1]])
            if key[0] in measured and misfit.get(key[1], 0.0) > 0 else e
            for key, e in estimates.items()}


def best(verdicts: Iterable[Verdict]) -> Verdict | None:
    """The confirmed verdict with the highest rank, or None."""
    return max((v for v in verdicts if v.confirmed), key=lambda v: v.rank, default=None)


def _blend(measured: _Spread, estimates: Estimates | None, config: ServerConfig,
           batch: int, dataset: str) -> tuple[float, float]:
    """The measured speedup, or its inverse-variance blend with the model's estimate (the
    model pools every launch, so it ranks near-equal trees better than one launch can),
    with the standard error of its log; feasibility never rests on it. Each weighs by
    its error in the order of trees, not in their level: the measurement by its own
    error, without the baseline's, which moves every tree alike (and the model's fit with
    them), as the shown interval widens it (Student-t); the model by its rank variance,
    without what its posterior moves every tree by alike."""
    model = estimates.get((config, batch, dataset)) if estimates else None
    own_sd = measured.own_sd * widening(measured.dof, Z_INTERVAL)
    if model is None or measured.mean <= 0 or measured.own_sd <= 0:
        return measured.mean, own_sd
    weight_m, weight_p = 1 / own_sd ** 2, 1 / model.rank_variance
    return (math.exp((weight_m * math.log(measured.mean) + weight_p * model.log_mean)
                     / (weight_m + weight_p)), math.sqrt(1 / (weight_m + weight_p)))
