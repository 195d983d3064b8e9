"""What the measurements of a config say, with their uncertainty.

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

from treetune.results import CellResult, LaunchResult, config_key

Z_LOWER = 2.0  # one-sided: the true speedup is below `low` about 2% of the time


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
