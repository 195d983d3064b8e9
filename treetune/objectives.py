"""What a study optimizes: one number per measured cell, and which way is better.

`throughput` (output tokens/s) is the default and what closed-loop cells were always judged
by. The latency objectives are a percentile of a cell's per-request times (lower is
better), `goodput` is requests/s completed within the study's SLO (higher is better). A
tree's *speedup* on a cell is always "how many times better than no speculation":
tree / baseline for throughput and goodput, baseline / tree for a latency, so that 1.0 is
the no-regression floor whatever the objective (a tree may not make p99 TPOT worse).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from treetune.results import CellResult, LaunchResult


class Objective(StrEnum):
    THROUGHPUT = "throughput"
    TPOT_P50 = "tpot_p50"
    TPOT_P99 = "tpot_p99"
    TTFT_P99 = "ttft_p99"
    GOODPUT = "goodput"

    @property
    def higher_is_better(self) -> bool:
        return self in (Objective.THROUGHPUT, Objective.GOODPUT)

    @property
    def is_latency(self) -> bool:
        return not self.higher_is_better

    @property
    def judges_rate_cells(self) -> bool:
        """Whether open-loop cells count: at a given request rate a server that keeps up
        delivers that rate whatever its tree, so throughput there says nothing about the
        tree; latencies and goodput do."""
        return self is not Objective.THROUGHPUT

    @property
    def label(self) -> str:
        """As tables and headers write it: 'p99 TPOT', 'throughput'."""
        return _LABELS[self]

    def describe(self) -> str:
        """One line: what a speedup means under this objective."""
        if self is Objective.THROUGHPUT:
            return "throughput (speedup = tree's output tokens/s / no speculation's)"
        if self is Objective.GOODPUT:
            return ("goodput (speedup = tree's requests/s within the SLO / no "
                    "speculation's)")
        return (f"{self.label} (lower is better; speedup = no speculation's {self.label} / "
                "tree's)")

    def value_of(self, cell: CellResult) -> float | None:
        """The cell's measured value in the objective's unit (ms for latencies); None when
        the cell cannot tell (no request completed, no SLO for goodput). A latency
        percentile over an open-loop cell where more requests than the percentile leaves
        out never finished is infinite: the unfinished ones took longer than any measured."""
        if self is Objective.THROUGHPUT:
            return cell.output_tok_s
        if self is Objective.GOODPUT:
            if cell.goodput is None:
                return None
            # Half a request per window when none met the SLO: ratios stay finite, and
            # a server meeting it once beats one never meeting it, by little. An open-loop
            # cell's window is its schedule's (its requests over its rate), alike for
            # every server; its measured window ends with its last request.
            sent = cell.requests + cell.unfinished
            window = sent / cell.rate if cell.rate and sent else cell.duration_s
            return max(cell.goodput, 0.5 / window if window > 0 else 0.0)
        metric, quantile = _LATENCY[self]
        latency = getattr(cell, metric)
        sent = cell.requests + cell.unfinished
        if sent and cell.unfinished / sent > 1 - quantile:
            return math.inf
        if latency is None:
            return None
        return getattr(latency, f"p{round(quantile * 100)}") * 1e3

    def ratio(self, value: float | None, baseline: float | None) -> float:
        """The speedup of `value` over the baseline's (0: unknown or infinitely worse)."""
        if value is None or baseline is None or value <= 0 or baseline <= 0:
            return 0.0
        if math.isinf(value):
            return 0.0
        return value / baseline if self.higher_is_better else baseline / value

    def speedup(self, cell: CellResult, baseline: CellResult) -> float:
        """A cell's speedup over the baseline's cell. Where no speculation cannot keep up
        at a rate (more of its requests unfinished than the percentile leaves out), its
        latency is unbounded, and a tree's against it says only "better" (inf) or,
        saturated too, nothing (inf / inf): both are compared as a saturated server is
        judged, by what it completes, its output tokens/s (a tree that keeps up delivers
        the rate; no speculation its capacity)."""
        base = self.value_of(baseline)
        if base is not None and math.isinf(base):
            return Objective.THROUGHPUT.ratio(cell.output_tok_s, baseline.output_tok_s)
        return self.ratio(self.value_of(cell), base)


_LABELS = {Objective.THROUGHPUT: "throughput", Objective.TPOT_P50: "p50 TPOT",
           Objective.TPOT_P99: "p99 TPOT", Objective.TTFT_P99: "p99 TTFT",
           Objective.GOODPUT: "goodput"}
_LATENCY = {Objective.TPOT_P50: ("tpot", 0.50), Objective.TPOT_P99: ("tpot", 0.99),
            Objective.TTFT_P99: ("ttft", 0.99)}
OBJECTIVES = tuple(o.value for o in Objective)


@dataclass(frozen=True)
class Criterion:
    """What a verdict judges: the objective, and the open-loop cells it covers. Rate
    cells are served by the server sized for the study's largest batch size (its
    `--max-running-requests`), so they join that batch size's verdict, each a cell of its
    own ('humaneval at 4 req/s'); objectives that cannot judge them (throughput) leave
    them out."""

    objective: Objective = Objective.THROUGHPUT
    rates: tuple[float, ...] = ()
    max_batch: int = 0

    def rates_at(self, batch: int) -> tuple[float, ...]:
        """The rate cells judged with batch size `batch`."""
        if batch != self.max_batch or not self.objective.judges_rate_cells:
            return ()
        return tuple(sorted(self.rates))

    def cells(self, datasets: list[str], batch: int) -> list[CellKey]:
        """The cells a verdict at `batch` judges: every dataset's closed-loop cell, then
        the rate cells."""
        return ([CellKey(d, batch) for d in datasets]
                + [CellKey(d, batch, r) for r in self.rates_at(batch) for d in datasets])


THROUGHPUT = Criterion()


@dataclass(frozen=True)
class CellKey:
    """A judged cell: a dataset at a batch size (closed loop) or at a rate (open loop)."""

    dataset: str
    batch: int
    rate: float | None = None

    @property
    def name(self) -> str:
        """The key a verdict's intervals use: the dataset for a closed-loop cell (as
        always), 'humaneval at 4 req/s' for a rate cell."""
        return self.dataset if self.rate is None else rate_cell_name(self.dataset, self.rate)

    def cell(self, result: LaunchResult) -> CellResult | None:
        if self.rate is None:
            return result.cell(self.dataset, self.batch)
        return result.rate_cell(self.dataset, self.rate)


def rate_cell_name(dataset: str, rate: float) -> str:
    return f"{dataset} at {rate:g} req/s"


__all__ = ["OBJECTIVES", "THROUGHPUT", "CellKey", "Criterion", "Objective", "rate_cell_name"]
