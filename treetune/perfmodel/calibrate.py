"""Fit a profile's free parameters to measured throughputs, speedups and accept lengths.

Only the calibration block and the per-dataset acceptance and workload shape are free;
hardware and model facts stay as written. Residuals are log-ratios of predicted to
measured speedup and baseline throughput and relative accept-length errors, with a weak
pull towards the starting profile so that parameters the data cannot see stay put.

What people publish is often a few speedups without absolute throughputs: such points
fit ratios only (the baseline's speed is unknown), and a handful of points cannot
determine twenty parameters. `identify` finds which parameters the points do determine,
from the fit's Jacobian; `calibrate(..., keep_unidentified=True)` fits only those and
keeps the rest at the profile's values instead of letting them wander to whatever
unphysical value happens to fit (a 0.012 ms draft step).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from treetune.config import BASELINE, TreeConfig
from treetune.errors import ConfigFileError, InvalidTreeError, TreetuneError
from treetune.perfmodel.predict import PerfModel
from treetune.perfmodel.profile import Profile
from treetune.yamlio import build, closest, load_yaml, read_text


@dataclass(frozen=True)
class Measurement:
    """One measured cell: a config on a dataset at a batch size, against its baseline.

    Throughputs may be unknown when only the speedup was published: the baseline's speed
    is then unknown and the point constrains ratios only."""

    config: TreeConfig
    batch: int
    dataset: str
    baseline_tok_s: float | None
    spec_tok_s: float | None
    accept_length: float | None = None
    launch: str | None = None  # points of one launch share its speed factor (see calibrate)
    reported_speedup: float | None = None  # as published, for points without throughputs
    # The requests its baseline ran at once, when not `batch` (a KV pool that holds fewer:
    # each server of a cell runs as many as its own pool holds).
    base_batch: int | None = None

    def __post_init__(self) -> None:
        if self.reported_speedup is None and (self.baseline_tok_s is None
                                              or self.spec_tok_s is None):
            raise ValueError("a measurement needs both throughputs or a speedup")

    @property
    def baseline_batch(self) -> int:
        return self.base_batch or self.batch

    @property
    def speedup(self) -> float:
        if self.baseline_tok_s is not None and self.spec_tok_s is not None:
            return self.spec_tok_s / self.baseline_tok_s
        assert self.reported_speedup is not None  # __post_init__
        return self.reported_speedup


@dataclass(frozen=True)
class _Row:
    """A point as a measurement file writes it: throughputs, or a speedup, or both."""

    steps: int
    topk: int
    draft_tokens: int
    batch: int
    dataset: str
    baseline_tok_s: float | None = None
    spec_tok_s: float | None = None
    speedup: float | None = None
    accept_length: float | None = None


SPEEDUP_AGREEMENT = 0.02  # a published speedup rounded to 2 decimals is within this of spec/base


@dataclass(frozen=True)
class Parameter:
    """A free parameter: where it lives in the profile, its bounds, and its scale."""

    name: str  # "calibration.step_overhead_ms" or "datasets.<name>.acceptance.top1"
    low: float
    high: float
    log: bool  # fit in log space (positive quantities spanning orders of magnitude)

    @property
    def low_x(self) -> float:
        return _to_x(self, self.low)

    @property
    def high_x(self) -> float:
        return _to_x(self, self.high)

    def x_of(self, value: float) -> float:
        """`value` in fitting space."""
        return _to_x(self, value)


CALIBRATION_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "step_overhead_ms": (0.05, 50.0, True),
    "draft_overhead_ms": (0.01, 20.0, True),
    "round_overhead_ms": (0.001, 20.0, True),
    # Per token of a forward, outside the roofline (sampling, copies, norms): the shipped
    # profiles put it at 0.003-15 us (Coder-Next's, fitted to published data, 0.003; the
    # 397B's 15), and the bound is twice the largest. Free up to 500 us, a fit explained
    # the verify cliffs of small trees by it (190 us; drawn-2028-04's steps of 5.9% from
    # 12 tokens) and put the best batch-32 tree, 1152 tokens a verify, at 1.01x against
    # 1.52x in truth: a cost that grows without end where the cliffs stop
    # (benchmarks/RESULTS.md, stop 86).
    "token_overhead_us": (0.001, 30.0, True),
    "weight_bandwidth_eff": (0.05, 1.0, False),
    "kv_bandwidth_eff": (0.01, 1.0, False),
    "compute_eff": (0.05, 1.0, False),
    "tree_routing_diversity": (0.01, 1.0, True),
}
DATASET_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "acceptance.top1": (0.05, 0.98, False),
    "acceptance.top1_decay": (0.0, 1.0, False),
    "acceptance.rank_mass": (0.0, 1.0, False),
    "acceptance.rank_ratio": (0.05, 0.95, False),
    "context_tokens": (16.0, 65536.0, True),
    "routing_diversity": (0.01, 1.0, True),
}
DEFAULT_DATASET_FIT = ("acceptance.top1", "acceptance.rank_mass", "context_tokens")
MOE_DATASET_FIT = (*DEFAULT_DATASET_FIT, "routing_diversity")
LAUNCH_SHRINK = 1.0  # (cell noise / launch noise)^2: how far launch effects are shrunk
PRIOR_WEIGHT = 0.02  # pull per parameter (in scaled units) towards the starting profile


@dataclass(frozen=True)
class PointError:
    measurement: Measurement
    predicted_baseline: float
    predicted_spec: float
    predicted_accept: float

    @property
    def predicted_speedup(self) -> float:
        return self.predicted_spec / self.predicted_baseline

    @property
    def speedup_error(self) -> float:
        return self.predicted_speedup - self.measurement.speedup

    @property
    def baseline_rel_error(self) -> float | None:
        """None for a point whose baseline throughput was not measured (speedup only)."""
        measured = self.measurement.baseline_tok_s
        return None if measured is None else self.predicted_baseline / measured - 1.0


@dataclass(frozen=True)
class CalibrationResult:
    profile: Profile
    parameters: dict[str, float]
    points: list[PointError]
    cost: float
    x: np.ndarray | None = None  # the fitted parameters in fitting space (log where log)
    covariance: np.ndarray | None = None  # of x: Gauss-Newton, residual variance scaled
    kept: tuple[str, ...] = ()  # left at the profile's values: the data cannot determine them

    @property
    def max_speedup_error(self) -> float:
        return max(abs(p.speedup_error) for p in self.points)

    @property
    def max_baseline_error(self) -> float | None:
        """None when no point has a measured baseline throughput."""
        errors = [abs(e) for p in self.points if (e := p.baseline_rel_error) is not None]
        return max(errors) if errors else None


def load_measurements(path: str | Path, entry: str | None = None,
                      datasets: Sequence[str] | None = None) -> list[Measurement]:
    """Measured points from CSV, a YAML list of records, a `points:` list, or the
    published-results layout (`runs: [{batch, tree: [S,K,N], results: {dataset: [baseline,
    spec, speedup]}}]`). A point gives both throughputs, or a speedup (null or absent
    throughputs), or all three; `datasets`: the names a point's dataset must be one of (a
    profile's). Errors name the entry as the file writes it, with its line.
    """
    path = Path(path)
    if path.suffix.lower() == ".csv":
        if entry is not None:
            raise ConfigFileError(path, f"--entry {entry}: a CSV file holds one set of points, "
                                  "not entries")
        return _measurements(path, _csv_rows(path), datasets)
    data = load_yaml(path)
    prefix = ""
    if entry is not None and not isinstance(data, dict):
        raise ConfigFileError(path, f"--entry {entry}: this file is one list of points, not "
                              "entries")
    if isinstance(data, dict) and entry is not None:
        if entry not in data:
            raise ConfigFileError(path, f"no entry '{entry}'{closest(entry, map(str, data))}; "
                                  f"entries: {', '.join(map(str, data))}")
        data, prefix = data[entry], f"{entry}."
    elif (only := only_entry(data)) is not None:  # one entry: no --entry to ask for
        entry, data, prefix = only, data[only], f"{only}."
    if isinstance(data, dict) and "runs" in data:
        rows = _published_rows(data["runs"], path, f"{prefix}runs")
    elif isinstance(data, dict) and "points" in data:
        points = data["points"]
        if not isinstance(points, list):
            raise ConfigFileError(path, "expected a list of points", f"{prefix}points")
        rows = [(_Where(path, f"{prefix}points[{i}]"), raw) for i, raw in enumerate(points)]
    elif isinstance(data, list):
        # A bare list's points have no key of their own: call them points[i] and find
        # their lines at [i].
        rows = [(_Where(path, f"{prefix}points[{i}]", line_of=f"{prefix}[{i}]"), raw)
                for i, raw in enumerate(data)]
    else:
        raise ConfigFileError(
            path,
            "expected a list of points (steps, topk, draft_tokens, batch, dataset, "
            "baseline_tok_s, spec_tok_s, speedup, accept_length), a 'points' list, or 'runs'"
            + ("; this file has several entries: pick one with --entry" if entry is None
               and isinstance(data, dict) and any(_is_entry(v) for v in data.values())
               else "")
            + ("; it was read as YAML, as its name does not end in .csv: name a CSV file "
               "*.csv" if isinstance(data, str) and "," in data else ""),
        )
    return _measurements(path, rows, datasets)


def only_entry(data: Any) -> str | None:
    """The name of the one entry a file of entries holds (None: it holds none, or
    several, or is itself one set of points)."""
    if isinstance(data, dict) and len(data) == 1 and "runs" not in data \
            and "points" not in data and _is_entry(next(iter(data.values()))):
        return str(next(iter(data)))
    return None


def _is_entry(value: Any) -> bool:
    """Whether a value of a file's top-level mapping is an entry of points."""
    return isinstance(value, list) or (
        isinstance(value, dict) and ("runs" in value or "points" in value))


def declared_target(path: str | Path, entry: str | None = None) -> str | None:
    """The target model a measurements file says its points are of (the published layout's
    `target.name`), or None where it says none."""
    if Path(path).suffix.lower() == ".csv":
        return None
    data = load_yaml(Path(path))
    entry = entry if entry is not None else only_entry(data)
    if isinstance(data, dict) and entry is not None:
        data = data.get(entry)
    target = data.get("target") if isinstance(data, dict) else None
    name = target.get("name") if isinstance(target, dict) else None
    return str(name) if name else None


def same_model(one: str, other: str) -> bool:
    """Two names of one model: a hub name or its last part (`Qwen/Qwen3-8B`, `Qwen3-8B`),
    case aside, one perhaps a variant of the other (`Qwen3-30B-A3B-FP8`)."""
    def short(name: str) -> str:
        return name.rstrip("/").rsplit("/", 1)[-1].lower()
    a, b = sorted((short(one), short(other)), key=len)
    return b.startswith(a)


@dataclass(frozen=True)
class _Where:
    """Where a point sits in its file: a YAML key (whose line errors give) or a CSV line."""

    path: Path
    key: str | None = None
    csv_line: int | None = None
    line_of: str | None = None

    def error(self, message: str, field: str | None = None) -> ConfigFileError:
        if self.csv_line is not None:
            column = f"column '{field}': " if field else ""
            return ConfigFileError(self.path, f"line {self.csv_line}: {column}{message}")
        key = f"{self.key}.{field}" if field and self.key else self.key
        return ConfigFileError(self.path, message, key, line_of=self.line_of)

    def build(self, raw: Any) -> _Row:
        try:
            return build(_Row, raw, self.path, self.key or "")
        except ConfigFileError as exc:
            if self.csv_line is not None:  # the key is a column: name the line instead
                raise self.error(exc.message, exc.key) from None
            if self.line_of is None or self.key is None:
                raise
            key = exc.key or self.key
            raise ConfigFileError(self.path, exc.message, key,
                                  line_of=key.replace(self.key, self.line_of, 1)) from None


def _measurements(path: Path, rows: list[tuple[_Where, Any]],
                  datasets: Sequence[str] | None = None) -> list[Measurement]:
    points = []
    for where, raw in rows:
        row = where.build(raw)
        if datasets is not None and row.dataset not in datasets:
            raise where.error(f"'{row.dataset}' is not a dataset of the profile"
                              f"{closest(row.dataset, datasets)}; it knows: "
                              f"{', '.join(datasets)}", "dataset")
        points.append(_measurement(where, row))
    if not points:
        raise ConfigFileError(path, "no measured points")
    return points


def _measurement(where: _Where, row: _Row) -> Measurement:
    try:
        config = TreeConfig.of(row.steps, row.topk, row.draft_tokens)
    except InvalidTreeError as exc:
        raise where.error(str(exc)) from None
    if row.batch < 1:
        raise where.error(f"must be >= 1, got {row.batch}", "batch")
    for name in ("baseline_tok_s", "spec_tok_s", "speedup", "accept_length"):
        value = getattr(row, name)
        if value is not None and value <= 0:
            raise where.error(f"must be > 0, got {value:g}", name)
    accept = row.accept_length
    if accept is not None and not 1 <= accept <= config.max_accept_length:
        # SGLang's accept length counts the bonus token: 1 (no draft kept) to steps + 1.
        raise where.error(f"must be between 1 and steps + 1 = {config.max_accept_length} "
                          f"(accepted drafts plus the bonus token), got {accept:g}",
                          "accept_length")
    base, spec, speedup = row.baseline_tok_s, row.spec_tok_s, row.speedup
    if speedup is None and (base is None or spec is None):
        missing = " and ".join(n for n, v in (("baseline_tok_s", base), ("spec_tok_s", spec))
                               if v is None)
        raise where.error(f"no {missing}: give baseline_tok_s and spec_tok_s, or a speedup "
                          "(e.g. speedup: 1.31 when only the speedup was published)")
    if speedup is not None and base is not None and spec is not None:
        if abs(spec / base / speedup - 1) > SPEEDUP_AGREEMENT:
            raise where.error(f"{speedup:g} disagrees with spec_tok_s / baseline_tok_s = "
                              f"{spec / base:.3f}", "speedup")
    elif speedup is not None:
        # Any two of the three give the third: a known spec throughput fixes the baseline's.
        if base is not None:
            spec = base * speedup
        elif spec is not None:
            base = spec / speedup
    return Measurement(config, row.batch, row.dataset, base, spec, row.accept_length,
                       reported_speedup=speedup)


def _csv_header(path: Path, names: Sequence[str]) -> None:
    """The header names each column once and no other than a point's fields (checked
    before any value, so that a misspelt or extra column is named as such)."""
    header = [name.strip() for name in names]
    line1 = _Where(path, csv_line=1)
    if len(header) == 1 and any(sep in header[0] for sep in ("\t", ";")):
        raise line1.error("the header is one column holding tabs or semicolons: a CSV file "
                          "separates its columns with commas")
    fields = [f.name for f in dataclasses.fields(_Row)]
    for i, name in enumerate(header):
        if not name:  # a trailing comma (spreadsheets write one): no column
            continue
        if name in header[:i]:
            raise line1.error(f"column '{name}' is given twice")
        if name not in fields:
            raise line1.error(f"unknown column '{name}'{closest(name, fields)}; a point's "
                              f"columns: {', '.join(fields)}")


def _csv_rows(path: Path) -> list[tuple[_Where, Any]]:
    numeric_int = {"steps", "topk", "draft_tokens", "batch"}
    rows = []
    reader = csv.DictReader(io.StringIO(read_text(path), newline=""))
    _csv_header(path, reader.fieldnames or [])
    for line, rec in enumerate(reader, start=2):
        where = _Where(path, csv_line=line)
        row: dict[str, Any] = {}
        for key, value in rec.items():
            if key is None:  # DictReader's home for the cells past the header's
                raise where.error(f"{len(value)} more cells than the header's columns: "
                                  f"{', '.join(map(repr, value))}")
            # An empty cell is an unknown value (a speedup-only point's throughputs).
            if value is None or not value.strip():
                continue
            key = key.strip()
            if not key:
                raise where.error(f"'{value.strip()}' is in a column the header names not")
            try:
                row[key] = (
                    int(value) if key in numeric_int
                    else value.strip() if key == "dataset" else float(value)
                )
            except ValueError:
                kind = "an integer" if key in numeric_int else "a number"
                raise where.error(f"'{value}' is not {kind}", key) from None
            if isinstance(row[key], float) and not math.isfinite(row[key]):
                raise where.error(f"'{value}' is not a finite number", key)
        rows.append((where, row))
    return rows


PUBLISHED_VALUES = ("baseline_tok_s", "spec_tok_s", "speedup")


def _published_rows(runs: Any, path: Path, key: str) -> list[tuple[_Where, Any]]:
    """Points of the published-results layout, each keyed by where the file writes it
    (`runs[1].results.humaneval`)."""
    if not isinstance(runs, list):
        raise ConfigFileError(path, "expected a list of runs", key)
    rows = []
    for i, run in enumerate(runs):
        run_key = f"{key}[{i}]"
        if not isinstance(run, dict):
            raise ConfigFileError(path, "expected a mapping with batch, tree and results",
                                  run_key)
        for name in ("batch", "tree", "results"):
            if name not in run:
                raise ConfigFileError(path, "missing required key (a run has batch, tree "
                                      "[S,K,N] and results {dataset: [baseline, spec, "
                                      "speedup]})", f"{run_key}.{name}")
        tree = run["tree"]
        if not (isinstance(tree, list) and len(tree) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) for v in tree)):
            raise ConfigFileError(path, "expected [steps, topk, draft_tokens]",
                                  f"{run_key}.tree")
        if not isinstance(run["results"], dict):
            raise ConfigFileError(path, "expected {dataset: [baseline, spec, speedup]}",
                                  f"{run_key}.results")
        shape = dict(zip(("steps", "topk", "draft_tokens"), tree, strict=True),
                     batch=run["batch"])
        for dataset, values in run["results"].items():
            cell = f"{run_key}.results.{dataset}"
            if isinstance(values, dict):  # {speedup: 1.31, accept_length: 2.8, ...}
                record = dict(values)
            elif isinstance(values, list) and 1 <= len(values) <= 3:
                for j, value in enumerate(values):
                    if value is not None and (isinstance(value, bool)
                                              or not isinstance(value, int | float)):
                        raise ConfigFileError(
                            path, f"{PUBLISHED_VALUES[j]} must be a number or null, got "
                            f"{value!r}", f"{cell}[{j}]")
                record = {n: v for n, v in zip(PUBLISHED_VALUES, values, strict=False)
                          if v is not None}
            else:
                raise ConfigFileError(
                    path, "expected [baseline_tok_s, spec_tok_s, speedup] (null for what "
                    "was not published) or a mapping of them", cell)
            rows.append((_Where(path, cell), {**shape, "dataset": dataset, **record}))
    return rows


def free_parameters(
    profile: Profile,
    measurements: Sequence[Measurement],
    calibration_fit: Sequence[str] | None = None,
    dataset_fit: Sequence[str] | None = None,
) -> list[Parameter]:
    """The parameters to fit: by default the whole calibration block and, per measured
    dataset, top-1 acceptance, rank mass, context and (MoE targets) routing diversity."""
    if dataset_fit is None:
        dataset_fit = MOE_DATASET_FIT if profile.target.moe else DEFAULT_DATASET_FIT
    names = list(calibration_fit) if calibration_fit is not None else list(CALIBRATION_BOUNDS)
    params = []
    for name in names:
        if name not in CALIBRATION_BOUNDS:
            raise TreetuneError(f"cannot fit '{name}': not a calibration parameter")
        params.append(Parameter(f"calibration.{name}", *CALIBRATION_BOUNDS[name]))
    for dataset in sorted({m.dataset for m in measurements}):
        given = per_position(profile, dataset)  # a measured dataset must exist in the profile
        for name in dataset_fit:
            if name not in DATASET_BOUNDS:
                raise TreetuneError(f"cannot fit '{name}': not a dataset parameter")
            if given and name == "acceptance.top1":
                continue  # the measured per-position top-1 overrides it: no point moves it
            params.append(Parameter(f"datasets.{dataset}.{name}", *DATASET_BOUNDS[name]))
    return params


# A fitted point further off than this (relative) is more than measurement noise explains
# (a few percent on a GPU server).
POOR_FIT = 0.10


def poor_fit(points: Sequence[PointError]) -> str:
    """Why the fit does not describe its points ('' when it does): the points it misses by
    more than POOR_FIT, the worst named."""
    off = []  # (the point's worst relative miss, the point), for those past POOR_FIT
    for e in points:
        m = e.measurement
        miss = abs(e.speedup_error) / m.speedup
        if m.accept_length is not None:
            miss = max(miss, abs(e.predicted_accept / m.accept_length - 1))
        if miss > POOR_FIT:
            off.append((miss, e))
    if not off:
        return ""
    share, worst = max(off, key=lambda pair: pair[0])
    m = worst.measurement
    return (f"the fitted profile misses {len(off)} of the {len(points)} points by more than "
            f"{POOR_FIT:.0%} (worst: {m.config.label()} at batch {m.batch} on {m.dataset}, "
            f"{share:.0%} off): more than measurement noise explains. The profile's model "
            "cannot express these points, or they contradict each other (two measurements "
            "of one cell?); check them before using the profile")


def per_position(profile: Profile, dataset: str) -> bool:
    """Whether the profile gives `dataset`'s top-1 acceptance per draft position
    (`top1_by_position`, measured), which overrides `top1` and its decay."""
    return bool(profile.dataset(dataset).acceptance.top1_by_position)


def get_value(profile: Profile, name: str) -> float:
    """A dotted name's value; "datasets.*...." is one value shared by every dataset (the
    first dataset's is read)."""
    obj: Any = profile
    for part in name.split("."):
        if isinstance(obj, dict):
            obj = next(iter(obj.values())) if part == "*" else obj[part]
        else:
            obj = getattr(obj, part)
    return float(obj)


def set_values(profile: Profile, values: dict[str, float]) -> Profile:
    """A copy of `profile` with dotted-name parameters replaced ("datasets.*...." in every
    dataset)."""
    calib = {n.split(".", 1)[1]: v for n, v in values.items() if n.startswith("calibration.")}
    datasets = dict(profile.datasets)
    for name, value in values.items():
        if not name.startswith("datasets."):
            continue
        _, which, *path = name.split(".")
        for dataset in datasets if which == "*" else [which]:
            data = datasets[dataset]
            if path[0] == "acceptance":
                acc = dataclasses.replace(data.acceptance, **{path[1]: value})
                datasets[dataset] = dataclasses.replace(data, acceptance=acc)
            else:
                datasets[dataset] = dataclasses.replace(data, **{path[0]: value})
    return profile.replace(
        calibration=dataclasses.replace(profile.calibration, **calib) if calib
        else profile.calibration,
        datasets=datasets,
    )


def point_errors(profile: Profile, measurements: Sequence[Measurement]) -> list[PointError]:
    model = PerfModel(profile)
    baselines: dict[tuple[int, str], float] = {}
    accepts: dict[tuple[TreeConfig, str], float] = {}
    errors = []
    for m in measurements:  # each baseline and accept length computed once
        cell, tree = (m.baseline_batch, m.dataset), (m.config, m.dataset)
        if cell not in baselines:
            baselines[cell] = model.throughput(BASELINE, m.baseline_batch, m.dataset)
        if tree not in accepts:
            accepts[tree] = model.accept_length(m.config, m.dataset)
        spec = m.batch * accepts[tree] / model.round_time(m.config, m.batch, m.dataset).total_s
        errors.append(PointError(m, baselines[cell], spec, accepts[tree]))
    return errors


def _soft_l1(r: float, scale: float) -> float:
    """A residual whose square is the soft-L1 loss of `r` at `scale`: `r` itself while
    small, growing as the square root of |r| beyond `scale`."""
    rho = 2 * scale * scale * (math.sqrt(1 + (r / scale) ** 2) - 1)
    return math.copysign(math.sqrt(rho), r)


class _Objective:
    """The residuals a fit minimises: data rows (launch effects, then per point its
    speedup and accept length, then each measured baseline) and a weak pull of every
    parameter towards its starting value."""

    def __init__(self, profile: Profile, measurements: Sequence[Measurement],
                 params: Sequence[Parameter], speedup_weight: float,
                 robust: float | None = None) -> None:
        self.profile, self.measurements, self.params = profile, measurements, list(params)
        self.speedup_weight = speedup_weight
        self.robust = robust
        self.low = np.array([_to_x(p, p.low) for p in self.params])
        self.high = np.array([_to_x(p, p.high) for p in self.params])
        self.x0 = np.clip([_to_x(p, get_value(profile, p.name)) for p in self.params],
                          self.low, self.high)
        # Speedup-only points have no baseline to fit: their cells are left out here.
        self.baselines = {(m.baseline_batch, m.dataset): m.baseline_tok_s
                          for m in measurements if m.baseline_tok_s is not None}
        self.groups: dict[str, list[int]] = {}
        for i, m in enumerate(measurements):
            if m.launch is not None:
                self.groups.setdefault(m.launch, []).append(i)

    def data(self, x: np.ndarray) -> np.ndarray:
        fitted = set_values(self.profile, _values(self.params, x))
        w = self.speedup_weight
        out = []
        errors = point_errors(fitted, self.measurements)
        logs = np.array([np.log(e.predicted_speedup / e.measurement.speedup) for e in errors])
        # A launch runs at its own speed (clock boost, placement): every point of one launch
        # is off by the same factor. It is profiled out, shrunk towards 1, so that the
        # model is fitted to what differs between configs, not to launch luck.
        for members in self.groups.values():
            effect = -logs[members].sum() / (len(members) + LAUNCH_SHRINK)
            logs[members] += effect
            out.append(w * np.sqrt(LAUNCH_SHRINK) * effect)
        for e, log_error in zip(errors, logs, strict=True):
            m = e.measurement
            out.append(w * (log_error if self.robust is None
                            else _soft_l1(log_error, self.robust)))
            if m.accept_length is not None:
                out.append((e.predicted_accept - m.accept_length) / m.accept_length)
        for (batch, dataset), measured in self.baselines.items():
            pred = next(e.predicted_baseline for e in errors
                        if e.measurement.baseline_batch == batch
                        and e.measurement.dataset == dataset)
            out.append(np.log(pred / measured))
        return np.asarray(out, dtype=float)

    def noise(self, cv: float) -> np.ndarray:
        """Standard deviation of each data row for a relative measurement noise `cv`, in
        the order of `data`."""
        w = self.speedup_weight
        rows = [w * cv] * len(self.groups)
        for m in self.measurements:
            rows.append(w * cv)
            if m.accept_length is not None:
                rows.append(cv)
        rows += [cv] * len(self.baselines)
        return np.asarray(rows, dtype=float)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        prior = PRIOR_WEIGHT * (x - self.x0) / np.maximum(self.high - self.low, 1e-9)
        return np.concatenate([self.data(x), prior])

    def jacobian(self, x: np.ndarray) -> np.ndarray:
        """d data / d x by central differences (one-sided at a bound)."""
        base = self.data(x)
        jac = np.zeros((len(base), len(x)))
        for j in range(len(x)):
            h = 1e-4 * max(self.high[j] - self.low[j], 1e-6)
            up, down = x.copy(), x.copy()
            up[j], down[j] = min(x[j] + h, self.high[j]), max(x[j] - h, self.low[j])
            jac[:, j] = (self.data(up) - self.data(down)) / max(up[j] - down[j], 1e-12)
        return jac


@dataclass(frozen=True)
class Identification:
    """Which free parameters the measurements determine, and which they cannot."""

    fitted: tuple[Parameter, ...]
    kept: tuple[Parameter, ...]  # the data leave these where the profile has them
    points: int
    residuals: int  # data rows: speedups, accept lengths, baselines

    @property
    def kept_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.kept)


# A parameter counts as determined when the points shrink its uncertainty to at most this
# share of the prior's (the prior: its bounds span four standard deviations).
IDENTIFIED_SHRINK = 0.3
MIN_NOISE_CV = 0.01


def identify(
    profile: Profile,
    measurements: Sequence[Measurement],
    parameters: Sequence[Parameter] | None = None,
    *,
    speedup_weight: float = 3.0,
    noise_cv: float | None = None,
) -> Identification:
    """The largest set of parameters the points determine, taken greedily, most
    determined first, given that the others stay at the profile's values.

    The information the points carry is the Jacobian of their residuals at the
    profile's values, whitened by the measurement noise (the profile's launch and
    measurement noise, unless given). A parameter joins while every chosen parameter's
    posterior standard deviation stays within IDENTIFIED_SHRINK of its prior's: four
    speedups cannot spread over twenty parameters, and a pair that only acts together
    (context length and KV bandwidth; every time cost, when no baseline throughput was
    measured) gives one of them, not both.
    """
    params = list(parameters or free_parameters(profile, measurements))
    objective = _Objective(profile, measurements, params, speedup_weight)
    cv = noise_cv if noise_cv is not None else max(
        float(np.hypot(profile.noise.launch_cv, profile.noise.measurement_cv)), MIN_NOISE_CV)
    jac = objective.jacobian(objective.x0) / objective.noise(cv)[:, None]
    prior_sd = np.maximum(objective.high - objective.low, 1e-9) / 4
    chosen = _most_determined(jac.T @ jac, prior_sd)
    return Identification(
        fitted=tuple(p for i, p in enumerate(params) if i in chosen),
        kept=tuple(p for i, p in enumerate(params) if i not in chosen),
        points=len(measurements), residuals=jac.shape[0])


def _most_determined(information: np.ndarray, prior_sd: np.ndarray) -> set[int]:
    chosen: list[int] = []
    prior_precision = 1.0 / prior_sd**2
    while True:
        best: tuple[float, int] | None = None
        for j in range(len(prior_sd)):
            if j in chosen:
                continue
            idx = [*chosen, j]
            posterior = information[np.ix_(idx, idx)] + np.diag(prior_precision[idx])
            try:
                sd = np.sqrt(np.diag(np.linalg.inv(posterior)))
            except np.linalg.LinAlgError:
                continue
            ratios = sd / prior_sd[idx]
            if ratios.max() <= IDENTIFIED_SHRINK and (best is None or ratios[-1] < best[0]):
                best = (float(ratios[-1]), j)
        if best is None:
            return set(chosen)
        chosen.append(best[1])


def calibrate(
    profile: Profile,
    measurements: Sequence[Measurement],
    parameters: Sequence[Parameter] | None = None,
    *,
    speedup_weight: float = 3.0,
    starts: int = 4,
    seed: int = 0,
    start: Profile | None = None,
    max_nfev: int = 4000,
    tolerance: float = 1e-8,
    keep_unidentified: bool = False,
    robust: float | None = None,
) -> CalibrationResult:
    """Least-squares fit of the free parameters; returns the fitted profile and errors.

    The fit is pulled weakly towards `profile`'s values and starts there, or at `start`
    (a previous fit, when refitting with more data). With `keep_unidentified`, only the
    parameters the points determine at `profile`'s values are fitted (see `identify`);
    the rest keep `profile`'s values and are named in the result's `kept`. With `robust`
    (log), a speedup's misfit beyond it counts by the soft-L1 loss instead of squared, so
    that a few cells moved by an effect the model cannot express do not drag the fit."""
    params = list(parameters or free_parameters(profile, measurements))
    if not params:
        raise TreetuneError("nothing to fit: no free parameters selected")
    if not keep_unidentified:
        return _fit(profile, measurements, params, speedup_weight, starts, seed, start,
                    max_nfev, tolerance, robust=robust)
    ident = identify(profile, measurements, params, speedup_weight=speedup_weight)
    return _fit(profile, measurements, list(ident.fitted), speedup_weight, starts, seed,
                start, max_nfev, tolerance, ident.kept_names, robust=robust)


def _fit(profile: Profile, measurements: Sequence[Measurement], params: list[Parameter],
         speedup_weight: float, starts: int, seed: int, start: Profile | None,
         max_nfev: int, tolerance: float, kept: tuple[str, ...] = (),
         robust: float | None = None) -> CalibrationResult:
    objective = _Objective(profile, measurements, params, speedup_weight, robust)
    if not params:  # nothing the points determine: the profile as it is
        cost = 0.5 * float(np.sum(objective.data(objective.x0) ** 2))
        return CalibrationResult(profile, {}, point_errors(profile, measurements), cost,
                                 kept=kept)
    low, high = objective.low, objective.high
    rng = np.random.default_rng(seed)
    first = objective.x0 if start is None else np.clip(
        [_to_x(p, get_value(start, p.name)) for p in params], low, high)
    best = None
    for attempt in range(max(starts, 1)):
        x_start = first if attempt == 0 else rng.uniform(low, high)
        fit = least_squares(objective, x_start, bounds=(low, high), x_scale="jac",
                            max_nfev=max_nfev, ftol=tolerance, xtol=tolerance,
                            gtol=tolerance)
        if best is None or fit.cost < best.cost:
            best = fit
    assert best is not None
    values = _values(params, best.x)
    fitted = set_values(profile, values)
    return CalibrationResult(fitted, values, point_errors(fitted, measurements),
                             float(best.cost), best.x, _covariance(best, params), kept)


def _covariance(fit: Any, params: Sequence[Parameter]) -> np.ndarray | None:
    """Gauss-Newton covariance of the fitted x, scaled by the residual variance, with the
    bounds as a weak prior (a uniform over them has the standard deviation (high - low) /
    sqrt(12)). A parameter the measurements do not determine (one fitted to its bound,
    where its gradient vanishes, or one they cannot tell from another) then keeps the
    variance its bounds allow, not an unbounded one: a posterior draw of it cannot land
    orders of magnitude away from the fit (a 20 ms round overhead that makes every tree
    slower than no speculation)."""
    jac, residuals = np.asarray(fit.jac), np.asarray(fit.fun)
    dof = max(len(residuals) - len(params), 1)
    scale = max(float(residuals @ residuals) / dof, 1e-6)
    width = np.array([p.high_x - p.low_x for p in params])
    try:
        return np.linalg.inv(jac.T @ jac / scale + np.diag(12.0 / width ** 2))
    except np.linalg.LinAlgError:
        return None


def values_of(params: Sequence[Parameter], x: np.ndarray) -> dict[str, float]:
    """Parameter values from a point in fitting space."""
    return _values(params, x)


def _to_x(p: Parameter, value: float) -> float:
    return float(np.log(value)) if p.log else float(value)


def _values(params: Sequence[Parameter], x: np.ndarray) -> dict[str, float]:
    return {p.name: float(np.exp(v)) if p.log else float(v) for p, v in zip(params, x, strict=True)}
