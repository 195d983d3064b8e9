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

from treetune import strategies
from treetune.backends import Backend, LaunchSpec, backend_class
from treetune.backends._base import parse_version
from treetune.backends.sglang import ALGORITHMS, DEFAULT_SGLANG_VERSION, SGLangBackend
from treetune.config import TreeConfig
from treetune.datasets import DatasetSpec
from treetune.errors import ConfigFileError, FieldError, InvalidTreeError, TreetuneError
from treetune.yamlio import build, dump_yaml, load_yaml

SPEC_COPY = "study.yaml"  # the resolved spec, saved in the output folder for readers


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


@dataclass(frozen=True)
class Search:
    """How the next launch is chosen, and how sure a measurement must be."""

    strategy: str = "auto"  # auto: the model search when a prior is known, else tpe
    prior: str | None = None  # profile whose hardware and model facts the model search
    # uses (default for the emulator: its profile, with every free parameter neutral)
    launch_cv: float = 0.03  # launch-to-launch spread assumed until re-launches measure it
    max_launches_per_config: int = 3  # a borderline config is re-measured up to this

    def __post_init__(self) -> None:
        if self.strategy not in strategies.names():
            raise ValueError(f"search.strategy must be one of {', '.join(strategies.names())}, "
                             f"got '{self.strategy}'")
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
    backend: Backend = field(default_factory=SGLangBackend)
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
            engine_version=self.sglang_version,
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
            # Unset backend fields are left out, so a field added later with a None
            # default does not orphan the studies stored before it.
            "backend": {k: v for k, v in self.backend_dict().items() if v is not None},
            "measurement": dataclasses.asdict(self.measurement),
        }
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]

    def backend_dict(self) -> dict[str, Any]:
        """The backend section as a study file holds it: its kind and its own fields."""
        return {"kind": self.backend.kind, **dataclasses.asdict(self.backend)}  # type: ignore[call-overload]

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
        data["backend"] = self.backend_dict()
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
    backend: dict[str, Any] = field(default_factory=dict)  # its kind's own fields
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
    sections = {"budget": Budget, "backend": dict, "measurement": Measurement,
                "search": Search}
    given: set[str] = set()  # dotted keys the command line set
    for key, value in (overrides or {}).items():
        if key in sections and isinstance(value, dict):
            # Options left unset on the command line keep the file's values.
            set_here = {k: v for k, v in value.items() if v is not None}
            if key == "backend" and set_here.get("kind", merged[key].get("kind")) != \
                    merged[key].get("kind"):
                merged[key] = {}  # another backend: the file's section was for the old one
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
            merged[nested] = (_backend(merged[nested], where, given) if cls is dict
                              else cls(**merged[nested]))
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


def _backend(section: dict[str, Any], where: Path | str, given: set[str]) -> Backend:
    """The backend a section names (`kind`, SGLang by default), built from its other keys,
    which must be that backend's own fields."""
    fields = {k: v for k, v in section.items() if k != "kind"}
    cls = backend_class(section.get("kind") or "sglang")
    source = "command line" if any(f"backend.{k}" in given for k in fields) else where
    return build(cls, fields, source, "backend")


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
