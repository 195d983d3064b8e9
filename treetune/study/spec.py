"""Study specs: what to tune, on what, with which budget. YAML in studies/, every field
also settable on the command line (the command line wins). Validated here, once."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treetune.config import TreeConfig
from treetune.datasets import DatasetSpec
from treetune.errors import ConfigFileError, FieldError, InvalidTreeError, TreetuneError
from treetune.launch import ALGORITHMS, DEFAULT_SGLANG_VERSION, LaunchSpec, parse_version
from treetune.yamlio import build, dump_yaml, load_yaml

BACKENDS = ("sglang", "emulator")


@dataclass(frozen=True)
class Budget:
    launches: int | None = 30  # server launches, the baseline included
    wall_time_s: float | None = None

    def __post_init__(self) -> None:
        if self.launches is not None and self.launches < 2:
            raise FieldError("launches",
                             "budget.launches must be >= 2 (the baseline plus one tree)")
        if self.wall_time_s is not None and self.wall_time_s <= 0:
            raise FieldError("wall_time_s", "budget.wall_time_s must be > 0")
        if self.launches is None and self.wall_time_s is None:
            raise ValueError("give budget.launches and/or budget.wall_time_s")


FAULT_KINDS = ("startup", "hang", "crash")


@dataclass(frozen=True)
class Fault:
    """A fault the emulator injects, to rehearse how a study survives it (emulator only).

    startup: the server exits with an error while loading; hang: it never becomes healthy;
    crash: it exits abruptly partway through the benchmark."""

    kind: str
    probability: float = 1.0  # per launch attempt, drawn from the attempt's seed
    configs: tuple[str, ...] = ()  # config keys ("3,4,8", "baseline"); empty: every tree
    attempts: int | None = None  # only a launch's first N attempts (None: all)
    after_requests: int | None = None  # crash: after this many requests (None: at random
    # within the benchmark)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(FAULT_KINDS)}, got "
                             f"'{self.kind}'")
        if not 0 <= self.probability <= 1:
            raise ValueError(f"fault probability must be in [0, 1], got {self.probability}")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError("fault attempts must be >= 1")
        if self.after_requests is not None and (self.kind != "crash" or self.after_requests < 1):
            raise ValueError("fault after_requests must be >= 1, for crash faults only")
        for key in self.configs:
            if key != "baseline":
                try:
                    TreeConfig.parse(key)
                except InvalidTreeError as exc:
                    raise ValueError(f"fault configs: {exc}") from None

    def applies(self, config_key: str, attempt: int) -> bool:
        if self.attempts is not None and attempt >= self.attempts:
            return False
        return config_key in self.configs if self.configs else config_key != "baseline"


@dataclass(frozen=True)
class Backend:
    kind: str = "sglang"
    profile: str | None = None  # emulator only: shipped profile name or file
    time_scale: float = 1.0  # emulator only: run this many times faster than the GPU
    load_time_s: float = 2.0  # emulator only: emulated model-loading time
    noise: bool = True  # emulator only: the profile's measurement noise
    python: str = "python"  # sglang only: interpreter that has sglang installed
    faults: tuple[Fault, ...] = ()  # emulator only: injected faults

    def __post_init__(self) -> None:
        # Rebuilt from plain mappings when the spec is copied field by field.
        object.__setattr__(self, "faults", tuple(
            f if isinstance(f, Fault) else Fault(**{**f, "configs": tuple(f.get("configs", ()))})
            for f in self.faults))
        if self.faults and self.kind != "emulator":
            raise ValueError("backend.faults are injected by the emulator: they need "
                             "backend.kind emulator")
        if self.kind not in BACKENDS:
            raise FieldError("kind", f"backend.kind must be one of {', '.join(BACKENDS)}, got "
                             f"'{self.kind}'")
        if self.kind == "emulator" and not self.profile:
            raise FieldError("profile", "the emulator backend needs backend.profile (e.g. "
                             "qwen3-coder-next-h200)")
        if self.time_scale <= 0:
            raise FieldError("time_scale", "backend.time_scale must be > 0")


@dataclass(frozen=True)
class Measurement:
    duration_s: float = 60.0  # measurement window per cell, server seconds
    warmup_s: float | None = None  # None: until every request has its first token
    repeats: int = 3  # sub-windows per cell, for the spread of a measurement
    startup_timeout_s: float = 900.0  # wall seconds a launch may take to become healthy

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.repeats < 1 or self.startup_timeout_s <= 0:
            raise ValueError("measurement needs duration_s > 0, repeats >= 1, "
                             "startup_timeout_s > 0")


STRATEGIES = ("auto", "model", "tpe", "grid", "random")


@dataclass(frozen=True)
class Search:
    """How the next launch is chosen, and how sure a measurement must be."""

    strategy: str = "auto"  # auto: model when a prior profile is known, else tpe
    prior: str | None = None  # profile whose hardware and model facts the model search
    # uses (default for the emulator: its profile, with every free parameter neutral)
    launch_cv: float = 0.03  # launch-to-launch spread assumed until re-launches measure it
    max_launches_per_config: int = 3  # a borderline config is re-measured up to this

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"search.strategy must be one of {', '.join(STRATEGIES)}, got "
                             f"'{self.strategy}'")
        if not 0 <= self.launch_cv < 1:
            raise ValueError("search.launch_cv must be in [0, 1)")
        if self.max_launches_per_config < 1:
            raise ValueError("search.max_launches_per_config must be >= 1")


@dataclass(frozen=True)
class StudySpec:
    name: str
    model: str
    datasets: tuple[DatasetSpec, ...]
    batch: tuple[int, ...]
    draft: str | None = None
    algorithm: str = "EAGLE3"
    sglang_version: str = DEFAULT_SGLANG_VERSION
    tp: int = 1
    server_flags: dict[str, str | None] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    space: str = "default"
    budget: Budget = field(default_factory=Budget)
    tolerance: float = 0.0
    backend: Backend = field(default_factory=Backend)
    ray_address: str | None = None
    workers: int | None = None  # GPU groups to use; None: all the cluster offers (local: 1)
    storage: str | None = None  # Optuna storage URL; None: SQLite in the output folder
    seed: int = 0
    compare: tuple[TreeConfig, ...] = ()
    output: str | None = None  # None: runs/<name>
    host: str = "127.0.0.1"
    api_key_env: str | None = None  # environment variable holding SGLang's --api-key
    measurement: Measurement = field(default_factory=Measurement)
    search: Search = field(default_factory=Search)
    base_dir: str = "."  # folder relative dataset paths resolve against

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            raise FieldError("name", f"name '{self.name}' may only hold letters, digits, '.', "
                             "'_', '-'")
        if not self.datasets:
            raise FieldError("datasets", "datasets: give at least one dataset")
        if not self.batch or any(b < 1 for b in self.batch):
            raise FieldError("batch", f"batch sizes must be >= 1, got {list(self.batch)}")
        if self.tp < 1:
            raise FieldError("tp", f"tp must be >= 1, got {self.tp}")
        if not 0 <= self.tolerance < 1:
            raise FieldError("tolerance", f"tolerance must be in [0, 1), got {self.tolerance}")
        if self.algorithm not in ALGORITHMS:
            raise FieldError("algorithm", f"algorithm must be one of {', '.join(ALGORITHMS)}")
        if self.draft is None and self.algorithm != "NEXTN":
            raise FieldError("draft", f"{self.algorithm} needs a draft model: set draft")
        if self.workers is not None and self.workers < 1:
            raise FieldError("workers", "workers must be >= 1")
        parse_version(self.sglang_version)
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise FieldError("datasets", f"datasets are listed twice: {names}")
        if self.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*",
                                                             self.api_key_env):
            raise FieldError("api_key_env", f"api_key_env '{self.api_key_env}' is not an "
                             "environment variable name")
        for flag in self.server_flags:
            if not flag.startswith("--"):
                raise FieldError("server_flags", f"server_flags: '{flag}' must start with '--'")

    @property
    def output_dir(self) -> Path:
        return Path(self.output or Path("runs") / self.name)

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.output_dir / 'study.db').resolve()}"

    @property
    def max_batch(self) -> int:
        return max(self.batch)

    @property
    def dataset_names(self) -> list[str]:
        return [d.name for d in self.datasets]

    def launch_spec(self, port: int = 30000, host: str | None = None) -> LaunchSpec:
        """Server flags shared by every launch: the batch must really form at every batch
        size, and CUDA graphs must cover it."""
        flags = {k: v for k, v in self.server_flags.items()}
        attention = flags.pop("--attention-backend", None)
        mem_fraction = flags.pop("--mem-fraction-static", None)
        return LaunchSpec(
            model_path=self.model,
            draft_model_path=self.draft,
            algorithm=self.algorithm,
            sglang_version=self.sglang_version,
            tp=self.tp,
            host=host or self.host,
            port=port,
            max_running_requests=self.max_batch,
            cuda_graph_max_bs=self.max_batch,
            attention_backend=attention,
            mem_fraction_static=float(mem_fraction) if mem_fraction else None,
            extra_flags=tuple(flags.items()),
        )

    def fingerprint(self) -> str:
        """What a stored study must match to be resumed: everything that changes results."""
        relevant = {
            "model": self.model, "draft": self.draft, "algorithm": self.algorithm,
            "sglang_version": self.sglang_version, "tp": self.tp,
            "server_flags": self.server_flags, "env": self.env,
            "datasets": self.to_dict()["datasets"],  # paths resolved: copies match
            "batch": sorted(self.batch), "tolerance": self.tolerance,
            "backend": dataclasses.asdict(self.backend), "measurement": dataclasses.asdict(
                self.measurement),
        }
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> StudySpec:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The spec as a study file: loading it again gives the same study (dataset paths
        made absolute, since the copy lives elsewhere)."""
        data = dataclasses.asdict(self)
        base = Path(self.base_dir)
        data["datasets"] = [
            {k: v for k, v in {**d, "path": str((base / d["path"]).resolve())
                               if d["path"] else None}.items() if v is not None}
            for d in data["datasets"]]
        data["output"] = str(self.output_dir.resolve())
        data["batch"] = list(self.batch)
        data["compare"] = [[c.steps, c.topk, c.draft_tokens] for c in self.compare]
        data.pop("base_dir")
        return data

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        dump_yaml(self.to_dict(), path)


@dataclass(frozen=True)
class _SpecFile:
    name: str | None = None
    model: str | None = None
    draft: str | None = None
    algorithm: str = "EAGLE3"
    sglang_version: str = DEFAULT_SGLANG_VERSION
    tp: int = 1
    server_flags: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    datasets: list[Any] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    space: str = "default"
    budget: Budget = field(default_factory=Budget)
    tolerance: float = 0.0
    backend: Backend = field(default_factory=Backend)
    ray_address: str | None = None
    workers: int | None = None
    storage: str | None = None
    seed: int = 0
    compare: list[Any] = field(default_factory=list)
    output: str | None = None
    host: str = "127.0.0.1"
    api_key_env: str | None = None
    measurement: Measurement = field(default_factory=Measurement)
    search: Search = field(default_factory=Search)
    description: str = ""


def load_study(path: str | Path | None, overrides: dict[str, Any] | None = None) -> StudySpec:
    """A study from a YAML file (or none), with command-line overrides applied on top."""
    if path is None:
        return study_from_mapping({}, "command line", Path("."), overrides)
    loaded = load_yaml(path)
    if not isinstance(loaded, dict):
        raise ConfigFileError(path, "a study file must be a mapping of fields")
    return study_from_mapping(loaded, Path(path), Path(path).parent, overrides)


def study_from_mapping(data: dict[str, Any], where: Path | str, base: Path,
                       overrides: dict[str, Any] | None = None) -> StudySpec:
    """A study from already-parsed fields; `where` names their source in errors."""
    path = where if isinstance(where, Path) else None
    raw = build(_SpecFile, data, where)
    merged = dataclasses.asdict(raw)
    # A space file named in a study file is found next to it, as dataset files are.
    space = Path(merged["space"])
    if path is not None and not space.is_absolute() and space.suffix in (".yaml", ".yml") \
            and (base / space).is_file():
        merged["space"] = str((base / space).resolve())
    sections = {"budget": Budget, "backend": Backend, "measurement": Measurement,
                "search": Search}
    given: set[str] = set()  # dotted keys the command line set
    for key, value in (overrides or {}).items():
        if key in sections and isinstance(value, dict):
            # Options left unset on the command line keep the file's values.
            set_here = {k: v for k, v in value.items() if v is not None}
            merged[key] = {**merged[key], **set_here}
            given |= {f"{key}.{k}" for k in set_here}
        elif value is not None:
            merged[key] = value
            given.add(key)

    def refused(exc: ValueError, section: str = "") -> TreetuneError:
        """The error for a value a check refused, blamed on the file or the command line."""
        if not isinstance(exc, FieldError):
            return TreetuneError(f"{where}: {exc}")
        key = f"{section}.{exc.key}" if section else exc.key
        source = "command line" if key in given or key.split(".")[0] in given else where
        return ConfigFileError(source, str(exc), key)

    for nested, cls in sections.items():
        try:
            merged[nested] = cls(**merged[nested])
        except ValueError as exc:
            raise refused(exc, nested) from None
    merged.pop("description", None)
    if not merged.get("model"):
        raise TreetuneError(f"{where}: no model: give --model or set 'model' in the study file")
    merged["name"] = merged.get("name") or _default_name(merged["model"], path)
    merged["datasets"] = tuple(_dataset(d, where, i) for i, d in enumerate(merged["datasets"]))
    merged["batch"] = tuple(merged["batch"])
    merged["compare"] = tuple(_tree(t, where, i) for i, t in enumerate(merged["compare"]))
    merged["server_flags"] = {str(k): None if v is None else str(v)
                              for k, v in merged["server_flags"].items()}
    merged["env"] = {str(k): str(v) for k, v in merged["env"].items()}
    merged["base_dir"] = str(base)
    try:
        return StudySpec(**merged)
    except ValueError as exc:
        raise refused(exc) from None


def _default_name(model: str, path: str | Path | None) -> str:
    if path is not None:
        return Path(path).stem
    return re.sub(r"[^A-Za-z0-9._-]+", "-", model.rsplit("/", 1)[-1]).strip("-") or "study"


def _dataset(value: Any, where: Path | str, index: int) -> DatasetSpec:
    if isinstance(value, DatasetSpec):
        return value
    if isinstance(value, str):
        try:
            return DatasetSpec(name=value)
        except ValueError as exc:
            raise ConfigFileError(where, str(exc), f"datasets[{index}]") from None
    return build(DatasetSpec, value, where, f"datasets[{index}]")


def _tree(value: Any, where: Path | str, index: int) -> TreeConfig:
    if isinstance(value, TreeConfig):
        return value
    try:
        if isinstance(value, str):
            return TreeConfig.parse(value)
        if isinstance(value, list) and len(value) == 3:
            return TreeConfig.of(*value)
    except (InvalidTreeError, TypeError) as exc:
        raise ConfigFileError(where, str(exc), f"compare[{index}]") from None
    raise ConfigFileError(where, "expected [steps, topk, draft_tokens] or 'S,K,N'",
                          f"compare[{index}]")
