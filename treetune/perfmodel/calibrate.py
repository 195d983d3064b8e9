"""Fit a profile's free parameters to measured throughputs and accept lengths.

Only the calibration block and the per-dataset acceptance and workload shape are free;
hardware and model facts stay as written. Residuals are log-ratios of predicted to
measured throughput (baseline and speculative) and relative accept-length errors, with a
weak pull towards the starting profile so that parameters the data cannot see stay put.
"""

from __future__ import annotations

import csv
import dataclasses
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
from treetune.yamlio import build, load_yaml


@dataclass(frozen=True)
class Measurement:
    """One measured cell: a config on a dataset at a batch size, with its baseline."""

    config: TreeConfig
    batch: int
    dataset: str
    baseline_tok_s: float
    spec_tok_s: float
    accept_length: float | None = None
    launch: str | None = None  # points of one launch share its speed factor (see calibrate)

    @property
    def speedup(self) -> float:
        return self.spec_tok_s / self.baseline_tok_s


@dataclass(frozen=True)
class _Row:
    steps: int
    topk: int
    draft_tokens: int
    batch: int
    dataset: str
    baseline_tok_s: float
    spec_tok_s: float
    accept_length: float | None = None


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


CALIBRATION_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "step_overhead_ms": (0.05, 50.0, True),
    "draft_overhead_ms": (0.01, 20.0, True),
    "round_overhead_ms": (0.001, 20.0, True),
    "token_overhead_us": (0.001, 500.0, True),
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
    def baseline_rel_error(self) -> float:
        return self.predicted_baseline / self.measurement.baseline_tok_s - 1.0


@dataclass(frozen=True)
class CalibrationResult:
    profile: Profile
    parameters: dict[str, float]
    points: list[PointError]
    cost: float
    x: np.ndarray | None = None  # the fitted parameters in fitting space (log where log)
    covariance: np.ndarray | None = None  # of x: Gauss-Newton, residual variance scaled

    @property
    def max_speedup_error(self) -> float:
        return max(abs(p.speedup_error) for p in self.points)

    @property
    def max_baseline_error(self) -> float:
        return max(abs(p.baseline_rel_error) for p in self.points)


def load_measurements(path: str | Path, entry: str | None = None) -> list[Measurement]:
    """Measured points from CSV, a YAML list of records, or the published-results layout
    (`runs: [{batch, tree: [S,K,N], results: {dataset: [baseline, spec, speedup]}}]`)."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        rows = _csv_rows(path)
    else:
        data = load_yaml(path)
        if isinstance(data, dict) and entry is not None:
            if entry not in data:
                raise ConfigFileError(path, f"no entry '{entry}'; entries: {', '.join(data)}")
            data = data[entry]
        if isinstance(data, dict) and "runs" in data:
            rows = _published_rows(data["runs"], path)
        elif isinstance(data, dict) and "points" in data:
            rows = data["points"]
        elif isinstance(data, list):
            rows = data
        else:
            raise ConfigFileError(
                path,
                "expected a list of points (steps, topk, draft_tokens, batch, dataset, "
                "baseline_tok_s, spec_tok_s[, accept_length]), a 'points' list, or 'runs'"
                + ("; this file has several entries: pick one with --entry" if entry is None
                   and isinstance(data, dict) else ""),
            )
    points = []
    for i, raw in enumerate(rows):
        row = build(_Row, raw, path, f"points[{i}]")
        try:
            config = TreeConfig.of(row.steps, row.topk, row.draft_tokens)
        except InvalidTreeError as exc:
            raise ConfigFileError(path, str(exc), f"points[{i}]") from None
        if row.batch < 1 or row.baseline_tok_s <= 0 or row.spec_tok_s <= 0:
            raise ConfigFileError(path, "batch and throughputs must be > 0", f"points[{i}]")
        points.append(
            Measurement(config, row.batch, row.dataset, row.baseline_tok_s, row.spec_tok_s,
                        row.accept_length)
        )
    if not points:
        raise ConfigFileError(path, "no measured points")
    return points


def _csv_rows(path: Path) -> list[dict[str, Any]]:
    numeric_int = {"steps", "topk", "draft_tokens", "batch"}
    rows = []
    try:
        with path.open(newline="") as fh:
            for line, rec in enumerate(csv.DictReader(fh), start=2):
                row: dict[str, Any] = {}
                for key, value in rec.items():
                    if key is None or value in (None, ""):
                        continue
                    key = key.strip()
                    try:
                        row[key] = (
                            int(value) if key in numeric_int
                            else value.strip() if key == "dataset" else float(value)
                        )
                    except ValueError:
                        raise ConfigFileError(
                            path, f"line {line}: '{value}' is not a number", key
                        ) from None
                rows.append(row)
    except FileNotFoundError:
        raise ConfigFileError(path, "file not found") from None
    return rows


def _published_rows(runs: Any, path: Path) -> list[dict[str, Any]]:
    rows = []
    for i, run in enumerate(runs or []):
        try:
            steps, topk, draft_tokens = run["tree"]
            for dataset, values in run["results"].items():
                base, spec = values[0], values[1]
                rows.append(dict(steps=steps, topk=topk, draft_tokens=draft_tokens,
                                 batch=run["batch"], dataset=dataset,
                                 baseline_tok_s=base, spec_tok_s=spec))
        except (KeyError, TypeError, ValueError):
            raise ConfigFileError(
                path, "each run needs batch, tree [S,K,N] and results {dataset: [base, spec]}",
                f"runs[{i}]",
            ) from None
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
        profile.dataset(dataset)  # a measured dataset must exist in the profile
        for name in dataset_fit:
            if name not in DATASET_BOUNDS:
                raise TreetuneError(f"cannot fit '{name}': not a dataset parameter")
            params.append(Parameter(f"datasets.{dataset}.{name}", *DATASET_BOUNDS[name]))
    return params


def get_value(profile: Profile, name: str) -> float:
    obj: Any = profile
    for part in name.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return float(obj)


def set_values(profile: Profile, values: dict[str, float]) -> Profile:
    """A copy of `profile` with dotted-name parameters replaced."""
    calib = {n.split(".", 1)[1]: v for n, v in values.items() if n.startswith("calibration.")}
    datasets = dict(profile.datasets)
    for name, value in values.items():
        if not name.startswith("datasets."):
            continue
        _, dataset, *path = name.split(".")
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
        cell, tree = (m.batch, m.dataset), (m.config, m.dataset)
        if cell not in baselines:
            baselines[cell] = model.throughput(BASELINE, m.batch, m.dataset)
        if tree not in accepts:
            accepts[tree] = model.accept_length(m.config, m.dataset)
        spec = m.batch * accepts[tree] / model.round_time(m.config, m.batch, m.dataset).total_s
        errors.append(PointError(m, baselines[cell], spec, accepts[tree]))
    return errors


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
) -> CalibrationResult:
    """Least-squares fit of the free parameters; returns the fitted profile and errors.

    The fit is pulled weakly towards `profile`'s values and starts there, or at `start`
    (a previous fit, when refitting with more data)."""
    params = list(parameters or free_parameters(profile, measurements))
    if not params:
        raise TreetuneError("nothing to fit: no free parameters selected")
    low = np.array([_to_x(p, p.low) for p in params])
    high = np.array([_to_x(p, p.high) for p in params])
    x0 = np.clip([_to_x(p, get_value(profile, p.name)) for p in params], low, high)
    baselines = {(m.batch, m.dataset): m.baseline_tok_s for m in measurements}
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(measurements):
        if m.launch is not None:
            groups.setdefault(m.launch, []).append(i)

    def residuals(x: np.ndarray) -> np.ndarray:
        fitted = set_values(profile, _values(params, x))
        out = []
        errors = point_errors(fitted, measurements)
        logs = np.array([np.log(e.predicted_speedup / e.measurement.speedup) for e in errors])
        # A launch runs at its own speed (clock boost, placement): every point of one launch
        # is off by the same factor. It is profiled out, shrunk towards 1, so that the
        # model is fitted to what differs between configs, not to launch luck.
        for members in groups.values():
            effect = -logs[members].sum() / (len(members) + LAUNCH_SHRINK)
            logs[members] += effect
            out.append(speedup_weight * np.sqrt(LAUNCH_SHRINK) * effect)
        for e, log_error in zip(errors, logs, strict=True):
            m = e.measurement
            out.append(speedup_weight * log_error)
            if m.accept_length is not None:
                out.append((e.predicted_accept - m.accept_length) / m.accept_length)
        for (batch, dataset), measured in baselines.items():
            pred = next(e.predicted_baseline for e in errors
                        if e.measurement.batch == batch and e.measurement.dataset == dataset)
            out.append(np.log(pred / measured))
        out.extend(PRIOR_WEIGHT * (x - x0) / np.maximum(high - low, 1e-9))
        return np.asarray(out)

    rng = np.random.default_rng(seed)
    first = x0 if start is None else np.clip(
        [_to_x(p, get_value(start, p.name)) for p in params], low, high)
    best = None
    for attempt in range(max(starts, 1)):
        x_start = first if attempt == 0 else rng.uniform(low, high)
        fit = least_squares(residuals, x_start, bounds=(low, high), x_scale="jac",
                            max_nfev=max_nfev, ftol=tolerance, xtol=tolerance,
                            gtol=tolerance)
        if best is None or fit.cost < best.cost:
            best = fit
    assert best is not None
    values = _values(params, best.x)
    fitted = set_values(profile, values)
    return CalibrationResult(fitted, values, point_errors(fitted, measurements),
                             float(best.cost), best.x, _covariance(best, len(params)))


def _covariance(fit: Any, n: int) -> np.ndarray | None:
    """Gauss-Newton covariance of the fitted x, scaled by the residual variance."""
    jac, residuals = np.asarray(fit.jac), np.asarray(fit.fun)
    dof = max(len(residuals) - n, 1)
    scale = max(float(residuals @ residuals) / dof, 1e-6)
    try:
        return np.linalg.pinv(jac.T @ jac) * scale
    except np.linalg.LinAlgError:
        return None


def values_of(params: Sequence[Parameter], x: np.ndarray) -> dict[str, float]:
    """Parameter values from a point in fitting space."""
    return _values(params, x)


def _to_x(p: Parameter, value: float) -> float:
    return float(np.log(value)) if p.log else float(value)


def _values(params: Sequence[Parameter], x: np.ndarray) -> dict[str, float]:
    return {p.name: float(np.exp(v)) if p.log else float(v) for p, v in zip(params, x, strict=True)}
