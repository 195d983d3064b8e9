"""What the measurements of a config say, with their uncertainty: the one place that
computes speedups, their intervals, the floor, feasibility and the ranking. The search's
constraints, its progress line, the recommendations, the report and the notebooks all ask
here, so they cannot disagree.

A config may be launched more than once (a borderline config is re-measured): its launches
are merged into one `LaunchResult` whose cells keep each launch's throughput. A cell's
relative variance has two parts: the spread of its sub-windows within a launch, and the
launch-to-launch spread (clock boost, placement), which sub-windows cannot see. The latter
comes from repeated launches when there are any, and from a prior (`launch_cv`) otherwise.

A speedup's interval combines the config's cell and the baseline's cell (the baseline's own
launch noise shifts every speedup alike, which is why it is re-measured too).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from treetune.config import ServerConfig
from treetune.results import CellResult, LaunchResult, config_key
from treetune.strategies import Estimates

Z_LOWER = 2.0  # one-sided: the true speedup is below `low` about 2% of the time
# A single launch is trusted on its own only when even twice the interval's reach keeps it
# clear of the floor: one launch can be lucky (a fast allocator draw, a warm clock).
Z_SURE = 2 * Z_LOWER


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float

    def straddles(self, floor: float) -> bool:
        return self.low < floor <= self.high

    def label(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def launches_of(result: LaunchResult) -> int:
    """How many successful launches a (merged) result holds."""
    cell = result.cells[0] if result.cells else None
    return max(1, len(cell.launch_tok_s)) if cell else 1


def merge(results: Iterable[LaunchResult]) -> LaunchResult:
    """One result per config: the successful launches merged, cell by cell (the mean of
    per-launch throughputs); a failed launch only when none succeeded."""
    results = list(results)
    ok = [r for r in results if r.ok]
    if not ok:
        return results[-1]
    if len(ok) == 1:
        return ok[0]
    first = ok[0]
    cells = []
    for cell in first.cells:
        same = [c for r in ok if (c := r.cell(cell.dataset, cell.batch)) is not None]
        per_launch = tuple(v for c in same for v in (c.launch_tok_s or (c.output_tok_s,)))
        accepts = [c.accept_length for c in same if c.accept_length is not None]
        cells.append(dataclasses.replace(
            cell,
            output_tok_s=statistics.fmean(per_launch),
            accept_length=statistics.fmean(accepts) if accepts else None,
            requests=sum(c.requests for c in same),
            output_tokens=sum(c.output_tokens for c in same),
            duration_s=sum(c.duration_s for c in same),
            errors=sum(c.errors for c in same),
            repeats=tuple(v for c in same for v in c.repeats),
            launch_tok_s=per_launch,
        ))
    return dataclasses.replace(first, cells=cells, attempts=sum(r.attempts for r in ok))


def merge_all(results: Iterable[LaunchResult]) -> dict[str, LaunchResult]:
    """Every config's merged result, keyed by config key, in first-launch order."""
    grouped: dict[str, list[LaunchResult]] = {}
    for result in results:
        grouped.setdefault(config_key(result.config), []).append(result)
    return {key: merge(group) for key, group in grouped.items()}


def relative_variance(cell: CellResult, launch_cv: float) -> float:
    """Variance of log(measured / true throughput) of a cell's (merged) measurement."""
    launches = cell.launch_tok_s or (cell.output_tok_s,)
    count = len(launches)
    within = 0.0
    per_launch_repeats = len(cell.repeats) // count if cell.repeats else 0
    if per_launch_repeats > 1 and cell.output_tok_s > 0:
        spread = statistics.pvariance(cell.repeats) / cell.output_tok_s ** 2
        within = spread / per_launch_repeats  # one launch's mean of its sub-windows
    prior = (launch_cv ** 2 + within) / count
    if count >= 2:
        mean = statistics.fmean(launches)
        sample = statistics.variance(launches) / mean ** 2 / count
        # Pooled with the prior as if it were worth 3 launches: 2 launches alone can agree
        # by luck.
        return ((count - 1) * sample + 3 * prior) / (count + 2)
    return prior


def speedup_interval(result: LaunchResult, baseline: LaunchResult, dataset: str, batch: int,
                     launch_cv: float, z: float = Z_LOWER) -> Interval:
    cell, base = result.cell(dataset, batch), baseline.cell(dataset, batch)
    if cell is None or base is None or base.output_tok_s <= 0 or cell.output_tok_s <= 0:
        return Interval(0.0, 0.0, 0.0)
    mean = cell.output_tok_s / base.output_tok_s
    sd = math.sqrt(relative_variance(cell, launch_cv) + relative_variance(base, launch_cv))
    return Interval(mean, mean * math.exp(-z * sd), mean * math.exp(z * sd))


def intervals(result: LaunchResult, baseline: LaunchResult, batch: int, datasets: list[str],
              launch_cv: float, z: float = Z_LOWER) -> dict[str, Interval]:
    return {d: speedup_interval(result, baseline, d, batch, launch_cv, z) for d in datasets}


def speedups(result: LaunchResult, baseline: LaunchResult, batch: int,
             datasets: Iterable[str]) -> dict[str, float]:
    """Measured speedup per dataset at one batch size (0 where a cell is missing)."""
    return {d: speedup_interval(result, baseline, d, batch, 0.0).mean for d in datasets}


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
    launches: int = 1  # successful launches merged into the measurement
    sure: bool = False  # feasible by a wide margin (Z_SURE), even on one launch
    needs_launches: int = 1  # launches a feasible tree needs unless it is sure

    @property
    def mean(self) -> float:
        """Mean measured speedup over the datasets."""
        return statistics.fmean(i.mean for i in self.intervals.values())

    @property
    def feasible(self) -> bool:
        """Surely no regression: every dataset's lower bound clears the floor."""
        return all(i.low >= self.floor for i in self.intervals.values())

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
          tolerance: float, launch_cv: float, estimates: Estimates | None = None,
          needs_launches: int = 1) -> Verdict:
    """The verdict on one (merged) result at one batch size; `needs_launches`: how many
    launches a feasible tree needs before it may be recommended, unless it is sure."""
    ivs = intervals(result, baseline, batch, datasets, launch_cv)
    rank = statistics.fmean(_blend(ivs[d], estimates, result.config, batch, d)
                            for d in datasets)
    floor = floor_of(tolerance)
    sure = all(i.low >= floor
               for i in intervals(result, baseline, batch, datasets, launch_cv, Z_SURE).values())
    return Verdict(result.config, batch, ivs, floor, rank, launches_of(result), sure,
                   needs_launches)


def best(verdicts: Iterable[Verdict]) -> Verdict | None:
    """The confirmed verdict with the highest rank, or None."""
    return max((v for v in verdicts if v.confirmed), key=lambda v: v.rank, default=None)


def _blend(measured: Interval, estimates: Estimates | None, config: ServerConfig,
           batch: int, dataset: str) -> float:
    """The measured speedup, or its inverse-variance blend with the model's estimate (the
    model pools every launch, so it ranks near-equal trees better than one launch can);
    feasibility never rests on it."""
    model = estimates.get((config, batch, dataset)) if estimates else None
    if model is None or measured.mean <= 0 or measured.high <= measured.low:
        return measured.mean
    sd = (math.log(measured.high) - math.log(measured.low)) / (2 * Z_LOWER)
    weight_m, weight_p = 1 / sd ** 2, 1 / model[1]
    return math.exp((weight_m * math.log(measured.mean) + weight_p * model[0])
                    / (weight_m + weight_p))
