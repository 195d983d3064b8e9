"""Replay worlds: a table of measured cells is the truth, so anyone with a measured grid
can replay it against the search.

The table is CSV (a header row) or YAML (a list of mappings) with the columns
`steps, topk, draft_tokens, batch, dataset, throughput, accept_length`; a baseline row
leaves `steps, topk, draft_tokens` empty (CSV) or null (YAML) and `accept_length` may be
empty. Throughput is output tokens/s over the whole batch. Every (batch, dataset) that has
tree rows needs a baseline row and the converse, every dataset of the profile some rows,
and each cell one row: a table that breaks these is refused as it loads, naming the row.

Cells that were not measured are filled by one rule, documented here and in the README:
- a measured tree without an accept length takes the profile's model estimate for it;
- a tree that was not measured takes the speedup and accept length of the nearest measured
  tree at the same batch size and dataset (distance |d steps| + |d log2 topk| +
  |d log2 draft_tokens|, first in table order on ties), its accept length capped at
  steps + 1;
- a batch size between two measured ones interpolates linearly in log(batch): per-request
  baseline throughput in log space, speedups linearly; outside the measured range the
  nearest batch size's values are used.
"""

from __future__ import annotations

import bisect
import csv
import dataclasses
import io
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.errors import ConfigFileError, TreetuneError
from treetune.perfmodel import DEFAULT_METHOD, PerfModel, Profile
from treetune.perfmodel.cost import RoundTime
from treetune.yamlio import load_yaml, read_text

COLUMNS = ("steps", "topk", "draft_tokens", "batch", "dataset", "throughput", "accept_length")


@dataclass(frozen=True)
class Cell:
    config: ServerConfig
    batch: int
    dataset: str
    throughput: float
    accept_length: float | None
    where: str = field(default="", compare=False)  # its row, for errors


def load_cells(path: Path) -> list[Cell]:
    """The measured cells of a replay file; errors name the row."""
    if path.suffix.lower() == ".csv":
        rows = list(csv.DictReader(io.StringIO(read_text(path), newline="")))
        where = [f"row {i + 2}" for i in range(len(rows))]
    else:
        loaded = load_yaml(path)
        if not isinstance(loaded, list):
            raise ConfigFileError(path, "a replay table must be a list of cells")
        rows = loaded
        where = [f"cells[{i}]" for i in range(len(rows))]
    cells = []
    seen: dict[tuple[ServerConfig, int, str], str] = {}
    for row, at in zip(rows, where, strict=True):
        try:
            cell = dataclasses.replace(_cell(row), where=at)
        except (KeyError, TypeError, ValueError) as exc:
            what = f"no {exc} column" if isinstance(exc, KeyError) else str(exc)
            raise ConfigFileError(path, f"{at}: {what} (columns: {', '.join(COLUMNS)})") \
                from None
        if (first := seen.setdefault((cell.config, cell.batch, cell.dataset), at)) != at:
            # Which one holds would be an accident of the table's order.
            raise ConfigFileError(path, f"{at}: {cell.config} at batch {cell.batch} on "
                                  f"'{cell.dataset}' is measured in {first} too: keep one "
                                  "(a mean of repeats, say)")
        cells.append(cell)
    if not cells:
        raise ConfigFileError(path, "a replay table needs at least one cell")
    return cells


def _number(value: object, name: str, whole: bool = False) -> float | None:
    """A finite number (None when empty); `whole`: an integer. Refused, not rounded or
    read as 1: a table's number that is not one is a mistake in it."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if whole and number != int(number):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return number


def _cell(row: object) -> Cell:
    if not isinstance(row, dict):
        raise ValueError(f"a cell must be a mapping of its columns, got {row!r}")
    if None in row:  # csv's key for the fields beyond the header's
        raise ValueError(f"{len(row) - 1 + len(row[None])} fields, and the header names "
                         f"{len(row) - 1}")
    if unknown := sorted(str(k) for k in row if k not in COLUMNS):
        # A misspelt column is dropped otherwise, and the model's estimate stands in.
        raise ValueError(f"unknown column {unknown[0]!r}")
    knobs = [_number(row.get(k), k, whole=True) for k in ("steps", "topk", "draft_tokens")]
    if all(k is None for k in knobs):
        config: ServerConfig = BASELINE
    elif any(k is None for k in knobs):
        raise ValueError("give steps, topk and draft_tokens together, or none (baseline)")
    else:
        config = TreeConfig.of(*(int(k) for k in knobs))  # type: ignore[arg-type]
    throughput = _number(row["throughput"], "throughput")
    if throughput is None or throughput <= 0:
        raise ValueError("throughput must be a positive number")
    batch = _number(row["batch"], "batch", whole=True)
    if batch is None or batch < 1:
        raise ValueError("batch must be a whole number of at least 1")
    dataset = row["dataset"]
    if not isinstance(dataset, str) or not dataset.strip():
        raise ValueError(f"dataset must be a name, got {dataset!r}")
    accept = _number(row.get("accept_length"), "accept_length")
    if accept is not None and config is not BASELINE and not (
            1.0 <= accept <= config.steps + 1):  # type: ignore[union-attr]
        raise ValueError(f"accept_length {accept:g} of {config} must lie within 1 and steps "
                         "+ 1 (the tokens one round can emit)")
    return Cell(config, int(batch), dataset, throughput, accept)


class ReplayModel(PerfModel):
    """Measured cells as the truth; the profile supplies only what the table cannot
    (prefill costs, memory, the datasets' request shapes)."""

    def __init__(self, profile: Profile, path: Path, tp: int | None = None,
                 method: str | None = None) -> None:
        super().__init__(profile, tp, method)
        if self.method_name != DEFAULT_METHOD:
            # The table holds one server's cells; nothing says which draft it ran but the
            # profile's own.
            raise TreetuneError(f"replayed measurements ({path.name}) are of the profile's "
                                f"own draft head ({DEFAULT_METHOD}), not {self.method_name}")
        self.path = path
        cells = load_cells(path)
        self.baseline: dict[tuple[int, str], float] = {}
        self.trees: dict[tuple[int, str], list[Cell]] = {}
        for cell in cells:
            if cell.dataset not in profile.datasets:
                raise ConfigFileError(path, f"{cell.where}: dataset '{cell.dataset}' is not in "
                                      f"profile '{profile.name}' (it has "
                                      f"{', '.join(profile.datasets)})")
            if cell.config is BASELINE:
                self.baseline[cell.batch, cell.dataset] = cell.throughput
            else:
                self.trees.setdefault((cell.batch, cell.dataset), []).append(cell)
        missing = sorted(set(self.trees) - set(self.baseline))
        if missing:
            raise ConfigFileError(path, f"no baseline row for batch {missing[0][0]}, dataset "
                                  f"'{missing[0][1]}'")
        # Said here, not when a search first reads the cell, minutes into a study.
        if bare := sorted(set(self.baseline) - set(self.trees)):
            raise ConfigFileError(path, f"batch {bare[0][0]}, dataset '{bare[0][1]}' has a "
                                  "baseline row but no tree measured: speedups are read "
                                  "against the baseline of the same batch size, so add its "
                                  "trees or remove that row")
        measured = {d for _, d in self.baseline}
        if unmeasured := [d for d in profile.datasets if d not in measured]:
            raise ConfigFileError(path, f"dataset '{unmeasured[0]}' of profile "
                                  f"'{profile.name}' has no row: measure it, or name a "
                                  "profile of exactly the grid's datasets")
        self.batches = {d: sorted(b for b, dd in self.baseline if dd == d)
                        for d in profile.datasets}

    def for_method(self, method: str) -> ReplayModel:
        """Refused for any other method than the table's, as the emulator refuses it."""
        return ReplayModel(self.profile, self.path, self.cost.tp, method)

    def datasets(self) -> list[str]:
        return sorted({d for _, d in self.baseline})

    @lru_cache(maxsize=65536)  # noqa: B019 - one model per world, alive as long as its cache
    def _at(self, config: ServerConfig, batch: int, dataset: str) -> tuple[float, float]:
        """(speedup, accept length) at a measured batch size, filled by the nearest tree."""
        if config is BASELINE:
            return 1.0, 1.0
        assert isinstance(config, TreeConfig)
        cells = self.trees[batch, dataset]  # every batch size with a baseline has trees
        base = self.baseline[batch, dataset]

        def distance(cell: Cell) -> float:
            other = cell.config
            assert isinstance(other, TreeConfig)
            return (abs(other.steps - config.steps) + abs(math.log2(other.topk / config.topk))
                    + abs(math.log2(other.draft_tokens / config.draft_tokens)))

        nearest = min(cells, key=distance)
        accept = (nearest.accept_length if nearest.accept_length is not None
                  else super().accept_length(nearest.config, dataset))
        return nearest.throughput / base, min(accept, config.steps + 1.0)

    def _interpolated(self, config: ServerConfig, batch: float,
                      dataset: str) -> tuple[float, float, float]:
        """(baseline throughput, speedup, accept length) at any batch size."""
        measured = self.batches.get(dataset) or []
        if not measured:
            raise ConfigFileError(self.path, f"no baseline measured on '{dataset}'")
        i = bisect.bisect_left(measured, batch)
        if (i < len(measured) and measured[i] == batch) or len(measured) == 1:
            b = measured[min(i, len(measured) - 1)]
            speedup, accept = self._at(config, b, dataset)
            per_request = self.baseline[b, dataset] / b
            return per_request * batch, speedup, accept
        lo, hi = measured[max(i - 1, 0)], measured[min(i, len(measured) - 1)]
        if i == 0 or i == len(measured):  # outside: the nearest measured batch size
            b = lo if i == len(measured) else hi
            speedup, accept = self._at(config, b, dataset)
            return self.baseline[b, dataset] / b * batch, speedup, accept
        w = (math.log(batch) - math.log(lo)) / (math.log(hi) - math.log(lo))
        s_lo, a_lo = self._at(config, lo, dataset)
        s_hi, a_hi = self._at(config, hi, dataset)
        r_lo, r_hi = self.baseline[lo, dataset] / lo, self.baseline[hi, dataset] / hi
        per_request = math.exp((1 - w) * math.log(r_lo) + w * math.log(r_hi))
        return per_request * batch, (1 - w) * s_lo + w * s_hi, (1 - w) * a_lo + w * a_hi

    def accept_length(self, config: ServerConfig, dataset: str) -> float:
        if config is BASELINE:
            return 1.0
        return float(np.mean([self._at(config, b, dataset)[1]
                              for b in self.batches.get(dataset) or []]))

    def throughput(self, config: ServerConfig, batch: float, dataset: str) -> float:
        base, speedup, _ = self._interpolated(config, batch, dataset)
        return base * speedup

    def round_time(self, config: ServerConfig, batch: float, dataset: str) -> RoundTime:
        """A round lasts as long as the table's throughput says for its tokens."""
        tokens = batch * self.accept_length(config, dataset)
        return RoundTime(0.0, tokens / self.throughput(config, batch, dataset), 0.0)

    def sample_accepted(self, config: ServerConfig, dataset: str, rng: np.random.Generator,
                        count: int) -> np.ndarray:
        """Accepted drafts per request with the table's mean (a binomial over the depth)."""
        if not isinstance(config, TreeConfig):
            return np.zeros(count, dtype=np.int64)
        mean = self.accept_length(config, dataset) - 1.0
        return rng.binomial(config.steps, min(max(mean / config.steps, 0.0), 1.0), count)
