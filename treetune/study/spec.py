"""Study specs: what to tune, on what, with which budget. YAML in studies/, fields also
settable on the command line (the command line wins). Validated here, once.

`StudySpec` and its sections are the one source of both: the study file's schema is derived
from their fields (`file_schema`), and so are `treetune search`'s options (`search_options`,
from each field's metadata, made with `meta`). Adding a field adds its key, and with
`meta(option=...)` its option.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import re
import types
import typing
import unicodedata
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treetune.backends import BACKENDS, Backend, LaunchSpec, backend_class
from treetune.backends._base import parse_version
from treetune.backends.sglang import (
    ADAPTIVE_CONFIG_FLAG,
    ADAPTIVE_FLAG,
    ALGORITHMS,
    DEFAULT_SGLANG_VERSION,
    KNOWN_ALGORITHMS,
    NGRAM,
    NGRAM_SINCE,
    ONE_VALUE_FLAGS,
    SGLangBackend,
    abbreviated_graph_flag,
    adaptive_blocker,
    cuda_graphs_for,
    flag_not_in_release,
    managed_flag,
    method_tree_problem,
    needs_draft_model,
    parallel_flag_problem,
    parse_method_tree,
    running_requests_for,
)
from treetune.backends.sglang_adaptive import (
    SLOT_CONFIG_SINCE,
    shared_graph_size,
    unsupported_reason,
)
from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.datasets import DEFAULT_DATASETS, DatasetSpec, builtin_names
from treetune.errors import (
    ConfigFileError,
    FieldError,
    InvalidTreeError,
    TreetuneError,
    for_field,
)
from treetune.facts.gpus import DEVICE_VARIABLES
from treetune.objectives import OBJECTIVES, Criterion, Objective
from treetune.perfmodel import resolve_profile_path
from treetune.perfmodel.serving import Shape
from treetune.results import Slo, config_key
from treetune.space import resolve_space_path
from treetune.yamlio import build, closest, dump_yaml, finite, load_yaml

# The workload of every dataset at once; a dataset may not take its name.
MIXED = "mixed"
# A study's, a dataset's and a GPU type's names: they name files (`launch/<workload>-batch1.sh`)
# and stand in emitted scripts' comments, so no '/', no leading '.', no space or newline.
NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
ENV_NAME = r"[A-Za-z_][A-Za-z0-9_]*"  # an environment variable, as a shell exports it
SPEC_COPY = "study.yaml"  # the resolved spec, saved in the output folder for readers
COMMAND_LINE = "command line"  # where a value given as an option comes from


def meta(option: str | None = None, help: str = "", *, short: str | None = None,
         file_type: Any = None, in_file: bool = True) -> dict[str, Any]:
    """A spec field's metadata: the `treetune search` option that sets it (with its help
    and short form), the type a study file holds for it when looser than the field's own
    (names and mappings the loader turns into typed values), or that no file may set it."""
    data: dict[str, Any] = {"in_file": in_file}
    if option is not None:
        data |= {"option": option, "help": help, "short": short}
    if file_type is not None:
        data["file_type"] = file_type
    return data


# A rate cell whose schedule expects fewer requests than this is refused: with none sent
# its latencies are unknown, and every tree was vetoed as if it regressed there.
MIN_RATE_REQUESTS = 5


@dataclass(frozen=True)
class Budget:
    launches: int | None = field(default=30, metadata=meta(
        "--budget-launches", "Server launches, baseline included; at least 2."))
    wall_time_s: float | None = field(default=None, metadata=meta(
        "--budget-time", "Wall-time budget, seconds (default: none, the launches decide)."))

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
    # A closed-loop cell's window, server seconds; an open-loop (rate) cell sends requests
    # for this long, then waits as long again at most for them to finish.
    duration_s: float = 60.0
    warmup_s: float | None = None  # None: until every request has its first token
    repeats: int = 3  # sub-windows per cell, for the spread of a measurement
    # Wall seconds a launch may take to become healthy (up to 3 times that while its log
    # shows it still starting: treetune.server.STARTUP_STRETCH).
    startup_timeout_s: float = 900.0
    arrival: str = "poisson"  # how a rate cell's requests arrive: poisson or fixed (interval)
    max_requests: int = 1000  # requests a rate cell sends at most
    # A cell whose server clock ran later than this behind its schedule, on average (server
    # seconds; the emulator's clock lag), is measured again; if it lags again it is kept,
    # marked lagged, and the study warns. 50 ms is a few decode rounds of the shipped
    # profiles: below it the emulator's throughput holds (its clock catches up) and
    # latencies are off by the lag.
    max_clock_lag_s: float = 0.05

    def __post_init__(self) -> None:
        from treetune.loadgen.arrivals import ARRIVALS

        for key, value, bad in (("duration_s", self.duration_s, self.duration_s <= 0),
                                ("repeats", self.repeats, self.repeats < 1),
                                ("startup_timeout_s", self.startup_timeout_s,
                                 self.startup_timeout_s <= 0)):
            if bad:
                raise FieldError(key, f"measurement.{key} must be "
                                 f"{'>= 1' if key == 'repeats' else '> 0'}, got {value:g}")
        if self.warmup_s is not None and self.warmup_s < 0:
            raise FieldError("warmup_s", f"measurement.warmup_s must be >= 0 (or null: until "
                             f"every request has its first token), got {self.warmup_s:g}")
        if self.arrival not in ARRIVALS:
            raise FieldError("arrival", f"measurement.arrival must be one of "
                             f"{', '.join(ARRIVALS)}, got '{self.arrival}'")
        if self.max_requests < 1:
            raise FieldError("max_requests", "measurement.max_requests must be >= 1")
        if self.max_clock_lag_s <= 0:
            raise FieldError("max_clock_lag_s", "measurement.max_clock_lag_s must be > 0")


# Measurement keys added after studies were stored: left out of a study's fingerprint at
# their defaults, so that those studies still resume.
_LATER_MEASUREMENT_KEYS = ("arrival", "max_requests", "max_clock_lag_s")


@dataclass(frozen=True)
class Search:
    """How the next launch is chosen, and how sure a measurement must be."""

    strategy: str = field(default="auto", metadata=meta(
        "--strategy", "How the next tree is chosen: model (fit the performance model to what "
        "was measured and launch its predicted best), tpe, grid, random, or gp (Optuna's "
        "GPSampler; needs PyTorch, from the optional extra gp). Default auto: model "
        "when a prior is known (the emulator's profile, --prior, or on SGLang the auto prior "
        "from the models' config.json and the GPU), else tpe."))
    # The profile whose hardware and model facts the model search uses (default for the
    # emulator: its profile, with every free parameter neutral).
    prior: str | None = field(default=None, metadata=meta(
        "--prior", "Profile (name or YAML) with the hardware and model facts the model search "
        "starts from; its fitted values are refined by the measurements."))
    launch_cv: float = 0.03  # launch-to-launch spread assumed until re-launches measure it
    # A borderline config is re-measured up to this; the baseline one more behind a
    # recommendation feasible by a thin margin (Planner._remeasure_thin), and a tree twice
    # this where no tree is confirmed, the baseline following it (planner.UNRECOMMENDED_LAUNCHES).
    max_launches_per_config: int = 3

    @property
    def confirming_launches(self) -> int:
        """Launches a feasible tree needs before it is recommended (unless its margin is
        wide): two, so that one lucky launch is never shipped; one when re-measuring is
        off."""
        return min(2, self.max_launches_per_config)

    @property
    def learns_noise(self) -> bool:
        """Whether re-launches can measure the launch noise; without, `launch_cv` is taken
        as stated (exact), as nothing in the study could revise it."""
        return self.max_launches_per_config > 1

    def __post_init__(self) -> None:
        # Imported here: the strategies pull in SciPy and Optuna, and every `treetune`
        # command imports this module for the options of `search`.
        from treetune import strategies

        if self.strategy not in strategies.names():
            raise FieldError("strategy", f"search.strategy must be one of "
                             f"{', '.join(strategies.names())}, got '{self.strategy}'"
                             f"{closest(self.strategy, strategies.names())}")
        if not 0 <= self.launch_cv < 1:
            raise FieldError("launch_cv", "search.launch_cv must be in [0, 1)")
        if self.max_launches_per_config < 1:
            raise FieldError("max_launches_per_config",
                             "search.max_launches_per_config must be >= 1")
        if self.prior is not None:
            with for_field("prior"):
                resolve_profile_path(self.prior)


@dataclass(frozen=True)
class DraftMethod:
    """A draft method a study searches (SGLang's --speculative-algorithm), with its own
    draft model where it needs one that is not the study's `draft` (a STANDALONE small
    model beside an EAGLE3 head), and its own search space (default: NGRAM's `ngram`,
    the study's `space` for the others)."""

    name: str
    draft: str | None = None
    space: str | None = None

    def __post_init__(self) -> None:
        # SGLang reads --speculative-algorithm in any case (SpeculativeAlgorithm.from_string).
        object.__setattr__(self, "name", self.name.upper())
        if self.name not in KNOWN_ALGORITHMS:
            raise FieldError("name", f"draft method '{self.name}'"
                             f"{closest(self.name, KNOWN_ALGORITHMS)} is not one of "
                             f"{', '.join(KNOWN_ALGORITHMS)}")
        if self.draft is not None and not needs_draft_model(self.name):
            raise FieldError("draft", f"{self.name} runs no draft model (NEXTN drafts with "
                             "the target's own MTP layer, NGRAM from a suffix trie): remove "
                             "its draft")
        if self.space is not None:
            with for_field("space"):
                resolve_space_path(self.space)

    def entry(self) -> str | dict[str, str]:
        """As a study file lists it: the name alone, or a mapping with what it adds."""
        extra = {k: v for k, v in (("draft", self.draft), ("space", self.space)) if v}
        return {"name": self.name, **extra} if extra else self.name


@dataclass(frozen=True)
class StudySpec:
    # Every field may be left out of a study file (the command line may give it); a file's
    # `name: null` means the default name, and `model: null` a model from the command line.
    name: str = field(metadata=meta("--name", "Study name (default: file or model).",
                                    file_type=str | None))
    model: str = field(metadata=meta("--model", "Target model path or name.",
                                     file_type=str | None))
    datasets: tuple[DatasetSpec, ...] = field(metadata=meta(
        "--datasets", "Datasets: built-in names or .json/.jsonl files, e.g. --datasets "
        "mt-bench humaneval data/chat.jsonl (default: mt-bench humaneval swebench-verified "
        "terminal-bench; on the emulator, those of its profile's datasets that are "
        "built in).",
        file_type=list[Any]))  # names, or mappings with a file
    batch: tuple[int, ...] = field(metadata=meta(
        "--batch", "Batch sizes, e.g. --batch 1 32 (required without --study).",
        file_type=list[int]))
    # Open-loop cells beside the batch sizes: requests arriving at each rate (measurement.
    # arrival), measured and stored (LaunchResult.rate_cells) but not searched over.
    rates: tuple[float, ...] = field(default=(), metadata=meta(
        "--rates", "Also measure open-loop cells at these request rates (requests/s, server "
        "time), e.g. --rates 2 8.", file_type=list[float]))
    # The latency target rate and batch cells report goodput against (empty: none).
    slo: Slo = field(default_factory=Slo)
    # What a tree must improve and may not make worse, per dataset and cell (see
    # treetune/objectives.py); `file_type` str: the name, checked in __post_init__.
    objective: Objective = field(default=Objective.THROUGHPUT, metadata=meta(
        "--objective", f"What to optimize: {', '.join(OBJECTIVES)} (default throughput). "
        "Latency objectives (p50/p99 time per output token, p99 time to first token) count "
        "lower as better: a tree's speedup is no speculation's latency over its own; "
        "goodput is requests/s within the slo (needs --slo-tpot-ms or --slo-ttft-ms). "
        "Every objective but throughput also judges the rate cells (--rates), with the "
        "largest batch size.", file_type=str))
    draft: str | None = field(default=None, metadata=meta("--draft",
                                                          "Draft head path or name."))
    algorithm: str = field(default="EAGLE3", metadata=meta(
        "--algorithm", "EAGLE3 (default), EAGLE, NEXTN, STANDALONE; with --methods, the "
        "first of them unless given."))
    # Several draft methods searched side by side (names, or mappings {name, draft, space}
    # in a file); empty: `algorithm` alone. The baseline is shared; recommendations name
    # the method; a tree of another method than `algorithm` carries it (TreeConfig.method).
    methods: tuple[DraftMethod, ...] = field(default=(), metadata=meta(
        "--methods", "Draft methods to search, e.g. --methods EAGLE3 NEXTN (NGRAM needs no "
        "draft model; a STANDALONE model beside a draft head needs its own, in the study "
        "file: {name: STANDALONE, draft: PATH}).", file_type=list[Any]))
    sglang_version: str = field(default=DEFAULT_SGLANG_VERSION, metadata=meta(
        "--sglang-version", f"SGLang version the launch flags target (default "
        f"{DEFAULT_SGLANG_VERSION})."))
    tp: int = field(default=1, metadata=meta("--tp", "Tensor-parallel size (GPUs per server)."))
    # Values may be numbers in a file; null marks a bare flag, a list a flag of several.
    server_flags: dict[str, str | list[str] | None] = field(
        default_factory=dict, metadata=meta(file_type=dict[str, Any]))
    env: dict[str, str] = field(default_factory=dict, metadata=meta(file_type=dict[str, Any]))
    space: str = field(default="default", metadata=meta(
        "--space", "Search space name or YAML path."))
    budget: Budget = field(default_factory=Budget)
    tolerance: float = field(default=0.0, metadata=meta(
        "--tolerance", "Allowed slowdown per dataset (0: never slower than no speculation)."))
    # In a file: {kind: NAME, ...that backend's own fields}; options in BACKEND_OPTIONS.
    backend: Backend = field(default_factory=SGLangBackend,
                             metadata=meta(file_type=dict[str, Any]))
    ray_address: str | None = field(default=None, metadata=meta(
        "--ray-address", "Ray cluster (default: local)."))
    # GPU groups to use; None: all the cluster offers when the study starts (local: 1). On a
    # cluster, workers beyond what it offers wait for nodes to come (runner.worker_count).
    workers: int | None = field(default=None, metadata=meta(
        "--workers", "GPU groups to use in parallel (default: all the cluster has; on a "
        "cluster, more wait for nodes that join)."))
    # The GPU type a study runs on, as Ray names a node's GPUs (its accelerator_type:TYPE
    # resource); None: the cluster's only type. Never part of the fingerprint: the type the
    # launches ran on is stored with the study and checked on every run.
    gpu_type: str | None = field(default=None, metadata=meta(
        "--gpu-type", "Run servers only on Ray nodes of this GPU type (Ray's accelerator "
        "type, e.g. H100); needed when the cluster mixes GPU types."))
    storage: str | None = field(default=None, metadata=meta(
        "--storage", "Optuna storage URL (default: SQLite in the output folder); a "
        "PostgreSQL URL lets several searches share the study."))
    seed: int = field(default=0, metadata=meta("--seed", "Random seed."))
    compare: tuple[TreeConfig, ...] = field(default=(), metadata=meta(
        "--compare", "Trees always measured, e.g. --compare 3,4,8 5,1,6.",
        file_type=list[Any]))  # [S, K, N] lists or "S,K,N" strings
    adaptive: bool = field(default=False, metadata=meta(
        "--adaptive", "Also measure SGLang's adaptive steps: chains of 1, 2, 3 and 5 steps, "
        "then SGLang's default adaptive config and one tuned from those chains; one "
        "adaptive pool is recommended where it is as good as the trees (default: off)."))
    output: str | None = field(default=None, metadata=meta(
        "--output", "Output folder (default runs/<name>).", short="-o"))
    host: str = field(default="127.0.0.1", metadata=meta(
        "--host", "Address servers listen on (default 127.0.0.1; others are warned about)."))
    api_key_env: str | None = field(default=None, metadata=meta(
        "--api-key-env", "Environment variable holding SGLang's --api-key; the key itself is "
        "never written anywhere."))
    measurement: Measurement = field(default_factory=Measurement)
    search: Search = field(default_factory=Search)
    # The folder relative dataset paths resolve against: where the file is, never in it.
    base_dir: str = field(default=".", metadata=meta(in_file=False))

    def __post_init__(self) -> None:
        if not re.fullmatch(NAME, self.name):
            raise FieldError("name", f"name '{self.name}' may only hold letters, digits, '.', "
                             "'_', '-'")
        if not self.datasets:
            raise FieldError("datasets", "datasets: give at least one dataset (--datasets "
                             "mt-bench humaneval, or a study file's `datasets:`)")
        with for_field("space"):
            resolve_space_path(self.space)
        if self.storage and "://" not in self.storage:
            path = Path(self.storage).expanduser().resolve()
            raise FieldError("storage", f"storage '{self.storage}' is not a database URL: "
                             f"for an SQLite file give sqlite:///{path}, for a database "
                             "server postgresql://user@host/db")
        if self.storage and _in_memory(self.storage):
            raise FieldError("storage", f"storage '{self.storage}' is an in-memory SQLite "
                             "database, gone when the search ends with every launch it "
                             "measured (a rerun or a report finds nothing): give an SQLite "
                             "file, sqlite:///PATH, or leave storage out for the output "
                             "folder's study.db")
        if not self.batch:
            raise FieldError("batch", "batch: give at least one batch size (--batch 1 32, or "
                             "a study file's `batch:`)")
        if any(b < 1 for b in self.batch):
            raise FieldError("batch", f"batch sizes must be >= 1, got {list(self.batch)}")
        if len(set(self.batch)) != len(self.batch):  # each would be measured twice a launch
            raise FieldError("batch", f"batch sizes are listed twice: {list(self.batch)}")
        if any(r <= 0 for r in self.rates) or len(set(self.rates)) != len(self.rates):
            raise FieldError("rates", f"rates must be > 0 and different, got {list(self.rates)}")
        for rate in self.rates:
            expected = rate * self.measurement.duration_s
            if expected < MIN_RATE_REQUESTS:
                raise FieldError("rates", (
                    f"rate {rate:g} req/s sends about {expected:.3g} requests in "
                    f"measurement.duration_s ({self.measurement.duration_s:g} s): too few for "
                    f"a latency (at least {MIN_RATE_REQUESTS}); raise the rate or lengthen "
                    "measurement.duration_s"))
        if self.tp < 1:
            raise FieldError("tp", f"tp must be >= 1, got {self.tp}")
        if not 0 <= self.tolerance < 1:
            raise FieldError("tolerance", f"tolerance must be in [0, 1), got {self.tolerance}")
        self._check_methods()
        self._check_objective()
        if self.workers is not None and self.workers < 1:
            raise FieldError("workers", "workers must be >= 1")
        # Each batch size's sampler is seeded with seed + its batch size, which Optuna's
        # samplers (numpy) take below 2**32.
        highest = 2**32 - 1 - max(self.batch)
        if not 0 <= self.seed <= highest:
            raise FieldError("seed", f"seed must be in 0..{highest} (each batch size's "
                             f"search is seeded with seed + its batch size), got {self.seed}")
        if not self.host.strip() or any(c.isspace() for c in self.host):
            raise FieldError("host", f"host {self.host!r} is not an address to listen on "
                             "(127.0.0.1, the default; 0.0.0.0 for every interface)")
        if self.gpu_type is not None and not re.fullmatch(NAME, self.gpu_type):
            raise FieldError("gpu_type", f"gpu_type '{self.gpu_type}' is not a GPU type as Ray "
                             "names them (H100, A100-80G, L4, ...)")
        try:
            version = parse_version(self.sglang_version)
        except TreetuneError as exc:
            raise FieldError("sglang_version", str(exc)) from None
        if self.adaptive and version < SLOT_CONFIG_SINCE:
            raise FieldError("adaptive", "adaptive: SGLang reads a per-batch-size adaptive "
                             "config from 0.5.13 on (0.5.11-0.5.12 ignore its slots, older "
                             "releases have no --speculative-adaptive), and this study targets "
                             f"sglang_version {self.sglang_version}: give adaptive: false, or "
                             "a newer sglang_version")
        shared = shared_graph_size(self.batch, self.server_flags) if self.adaptive else None
        if shared is not None:
            a, b, size = shared
            raise FieldError("batch", f"batch sizes {a} and {b} both run as CUDA-graph batch "
                             f"size {size} (SGLang pads a running batch up to the next size "
                             "it captured, then picks its adaptive slot), so one slot would "
                             "serve both: keep one of them, or give adaptive: false")
        if version < NGRAM_SINCE and NGRAM in (n.upper() for n in self.method_names):
            raise FieldError("methods", f"SGLang serves {NGRAM} from 0.5.3 on, and this study "
                             f"targets sglang_version {self.sglang_version}: drop {NGRAM}, "
                             "or give a newer sglang_version")
        names = [d.name for d in self.datasets]
        for i, name in enumerate(names):
            if not re.fullmatch(NAME, name):
                raise FieldError(f"datasets[{i}].name", f"dataset name {name!r} may only hold "
                                 "letters, digits, '.', '_', '-', and starts with a letter or "
                                 "digit: it names the workload's launch files")
            if name == MIXED:
                raise FieldError(f"datasets[{i}].name", f"dataset name '{MIXED}' is the "
                                 "workload of every dataset at once: give the dataset another")
        if len(set(names)) != len(names):
            raise FieldError("datasets", f"datasets are listed twice: {names}")
        if self.api_key_env is not None and not re.fullmatch(ENV_NAME, self.api_key_env):
            raise FieldError("api_key_env", f"api_key_env '{self.api_key_env}' is not an "
                             "environment variable name")
        for name, value in self.env.items():
            # Both go into the launch scripts (`export NAME=VALUE`) and config files' comments.
            if not re.fullmatch(ENV_NAME, name):
                raise FieldError(f"env.{name}", f"env: {name!r} is not an environment "
                                 "variable name (letters, digits and '_', not first a digit)")
            if any(unicodedata.category(c) == "Cc" and c != "\t" for c in value):
                raise FieldError(f"env.{name}", f"env: {name}'s value holds a control "
                                 "character (a newline, ...): give it on one line")
            if name in DEVICE_VARIABLES:
                raise FieldError(f"env.{name}", f"env: {name} is set per worker, to the GPUs "
                                 "Ray gave it: one value for every server would put several "
                                 "servers on the same GPUs; leave it out")
        for flag in self.server_flags:
            if not flag.startswith("--"):
                raise FieldError("server_flags", f"server_flags: '{flag}' must start with '--'")
            if "=" in flag:
                name, _, value = flag.partition("=")
                raise FieldError("server_flags", f"server_flags: '{flag}': give the value as "
                                 f"the flag's, {{{name}: {value}}}")
            value = self.server_flags[flag]
            for word in value if isinstance(value, list) else [value] if value else []:
                if word.startswith("--"):
                    # SGLang would read it as a flag of its own, past the checks below.
                    raise FieldError("server_flags", f"server_flags: '{flag}': its value "
                                     f"'{word}' starts with '--': give each flag as a key "
                                     "of its own")
            if isinstance(value, list) and (not value or flag in ONE_VALUE_FLAGS):
                raise FieldError("server_flags", f"server_flags: '{flag}' takes "
                                 f"{'one value' if value else 'at least one value'}, got "
                                 f"{value} (null marks a bare flag)")
            if self.adaptive and flag in (ADAPTIVE_FLAG, ADAPTIVE_CONFIG_FLAG):
                raise FieldError("server_flags", f"server_flags: '{flag}' is set by treetune "
                                 "on this study's adaptive launches (adaptive: true), each "
                                 "with the config it measures; a flag here would launch every "
                                 "server of the study adaptive, with one config")
            if missing := flag_not_in_release(flag, self.sglang_version):
                raise FieldError("server_flags", f"server_flags: {missing} (sglang_version is "
                                 "the release the study's commands are written for)")
            if (managed := managed_flag(flag)) is not None:
                name, where = managed
                what = f"'{flag}'" if flag == name else f"'{flag}' (short for '{name}')"
                raise FieldError("server_flags", f"server_flags: {what} is set by treetune "
                                 f"for every launch ({where}); given here too, it would "
                                 "override that (the last value wins)")
            if short := abbreviated_graph_flag(flag):
                raise FieldError("server_flags", f"server_flags: {short}")
        if problem := parallel_flag_problem(self.server_flags, self.method_names, self.tp):
            raise FieldError("server_flags", f"server_flags: {problem}")
        if self.adaptive and (blocker := adaptive_blocker(self.server_flags)):
            # SGLang would serve the adaptive launches as static chains, labeled adaptive.
            flag, reason = blocker
            raise FieldError("adaptive", f"adaptive: SGLang's adaptive steps do not run with "
                             f"server_flags '{flag}' ({reason}): give adaptive: false, or "
                             f"leave '{flag}' out")

    def _check_objective(self) -> None:
        if not isinstance(self.objective, Objective):
            if self.objective not in OBJECTIVES:
                raise FieldError("objective", f"objective must be one of "
                                 f"{', '.join(OBJECTIVES)}, got '{self.objective}'"
                                 f"{closest(str(self.objective), OBJECTIVES)}")
            object.__setattr__(self, "objective", Objective(self.objective))
        if self.objective is Objective.GOODPUT and not self.slo.bounded:
            raise FieldError("objective", "objective goodput counts requests within the "
                             "slo: give slo: {tpot_ms: ..., ttft_ms: ...} (or --slo-tpot-ms, "
                             "--slo-ttft-ms)")

    @property
    def criterion(self) -> Criterion:
        """What every verdict of this study judges: its objective, over which cells."""
        return Criterion(self.objective, self.rates, self.max_batch)

    def _check_methods(self) -> None:
        """The algorithm, the draft methods and their drafts, and the compared trees'
        methods; compared trees of `algorithm` are stored without a method."""
        object.__setattr__(self, "algorithm", self.algorithm.upper())  # as SGLang reads it
        unsupported = unsupported_reason(self.algorithm, None) if self.adaptive else None
        if unsupported is not None:
            # SGLang would serve the adaptive launches as static chains, labeled adaptive.
            raise FieldError("adaptive", f"adaptive: SGLang's adaptive steps do not run with "
                             f"{self.algorithm} ({unsupported}): give adaptive: false, or "
                             "make an EAGLE or EAGLE3 method the study's first")
        names = self.method_names
        if not self.methods and self.algorithm not in ALGORITHMS:
            ngram = (f" ({NGRAM} has its own search space: list it in methods)"
                     if self.algorithm == NGRAM else "")
            raise FieldError("algorithm", f"algorithm must be one of {', '.join(ALGORITHMS)}"
                             + ngram)
        if not self.methods and self.draft is not None \
                and not needs_draft_model(self.algorithm):
            # SGLang would load it: NEXTN is EAGLE to it, and a draft path given wins over
            # the target's own MTP layer.
            raise FieldError("draft", f"{self.algorithm} runs no draft model (it drafts with "
                             "the target's own MTP layer), and SGLang would run this one as "
                             f"EAGLE instead: remove draft, or list methods: "
                             f"[{self.algorithm}, EAGLE3] to search the draft beside it")
        if len(set(names)) != len(names):
            raise FieldError("methods", f"methods are listed twice: {list(names)}")
        if self.algorithm not in names:
            raise FieldError("algorithm", f"algorithm {self.algorithm} is not one of the "
                             f"methods ({', '.join(names)}): list it there, or leave "
                             "algorithm out (it is then the first method)")
        drafts: dict[str, str] = {}
        for name in names:
            draft = self.method_draft(name)
            if draft is None and needs_draft_model(name):
                if name == self.algorithm:
                    raise FieldError("draft", f"{name} needs a draft model: set draft")
                raise FieldError("methods", f"{name} needs a draft model: set draft, or list "
                                 f"it as {{name: {name}, draft: PATH}}")
            if draft is not None and draft in drafts.values():
                other = next(n for n, d in drafts.items() if d == draft)
                raise FieldError("methods", f"{name} and {other} both run the draft model "
                                 f"{draft}: give {name} its own, as {{name: {name}, draft: "
                                 "PATH}")
            if draft is not None:
                drafts[name] = draft
        compare = []
        for i, tree in enumerate(self.compare):
            method = "" if tree.method == self.algorithm else tree.method
            if method and method not in names:
                raise FieldError("compare", f"compare[{i}]: {tree} is a tree of {method}, "
                                 f"which is not one of the study's methods "
                                 f"({', '.join(names)})")
            problem = method_tree_problem(method or self.algorithm, tree)
            if problem is not None:
                raise FieldError("compare", f"compare[{i}]: {problem}")
            compare.append(dataclasses.replace(tree, method=method))
        object.__setattr__(self, "compare", tuple(compare))

    @property
    def method_names(self) -> tuple[str, ...]:
        """The draft methods the study searches, `algorithm` (its own) among them."""
        return tuple(m.name for m in self.methods) or (self.algorithm,)

    def method_draft(self, name: str) -> str | None:
        """The draft model a method runs: its own, else the study's draft (None for a
        method that needs none)."""
        if not needs_draft_model(name):
            return None
        own = next((m.draft for m in self.methods if m.name == name), None)
        return own or self.draft

    @property
    def written_storage(self) -> str | None:
        """The storage URL as files keep it: without its password (the user's; never kept),
        an SQLite file's path absolute (a copy read from another folder names the file)."""
        return url_without_password(absolute_sqlite(self.storage)) if self.storage else None

    @property
    def unjudged_rates(self) -> str | None:
        """What a user who gave `rates` under the throughput objective should know: their
        cells are measured but judge nothing (None when rates are judged, or there are
        none)."""
        if not self.rates or self.objective.judges_rate_cells:
            return None
        return ("the rate cells (rates: " + ", ".join(f"{r:g}" for r in self.rates)
                + " req/s) are measured, but the throughput objective judges the batch cells "
                "only (at a rate, a server that keeps up delivers that rate whatever its "
                "tree): their latencies are kept, not judged; to judge them, set objective "
                "(tpot_p99, tpot_p50, ttft_p99, or goodput with an slo)")

    def unused_draft(self) -> str | None:
        """Why the study's `draft` is run by none of its methods (None when some method
        runs it, or it has none): the launches would run without it, not a word said.
        Asked before a search, not when a spec is read: a study stored so still reports."""
        drafts = {self.method_draft(name) for name in self.method_names}
        if not self.methods or self.draft is None or self.draft in drafts:
            return None
        runs = ("none of them runs a draft model (NEXTN drafts with the target's MTP layer, "
                "NGRAM with the prompt's n-grams)" if drafts == {None} else
                "each that runs one names its own")
        return (f"draft {self.draft} is run by none of the methods "
                f"({', '.join(self.method_names)}): {runs}; remove draft, or list a method "
                "that runs it (EAGLE3, EAGLE or STANDALONE)")

    def method_of(self, config: ServerConfig) -> str | None:
        """The algorithm a server runs (None: no speculation)."""
        if config is BASELINE:
            return None
        return (config.method if isinstance(config, TreeConfig) else "") or self.algorithm

    def config_label(self, config: ServerConfig) -> str:
        """A config as tables show it: with its method when the study has several."""
        if len(self.method_names) > 1 and isinstance(config, TreeConfig) and not config.method:
            return f"{self.algorithm} {config.label()}"
        return config.label()

    @property
    def output_dir(self) -> Path:
        return Path(self.output or Path("runs") / self.name)

    @property
    def local_ray(self) -> bool:
        """Whether the study starts a Ray of its own on this machine (no cluster to join)."""
        return self.ray_address in (None, "", "local")

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.output_dir / 'study.db').resolve()}"

    @property
    def shared_storage(self) -> bool:
        """Whether the storage is a database server that several searches of the study may
        share (SQLite serves one machine, one search: its folder's lock)."""
        return not self.storage_url.startswith("sqlite")

    @property
    def max_batch(self) -> int:
        return max(self.batch)

    @property
    def mem_fraction_static(self) -> float | None:
        """The share of each GPU's memory the study's servers give SGLang for weights and
        KV cache (--mem-fraction-static in server_flags); None: SGLang's own choice."""
        value = self.server_flags.get("--mem-fraction-static")
        return float(value) if value else None

    @property
    def dataset_names(self) -> list[str]:
        return [d.name for d in self.datasets]

    def request_shapes(self) -> dict[str, Shape]:
        """The datasets of fixed-length requests (synthetic prompts, every answer exactly
        as long): their cells are served as whole requests, prefill and turnover included
        (`treetune.perfmodel.serving`), by an in-process launch as by the emulator, and the
        model search predicts them so. The others are the steady state of decoding at the
        profile's context."""
        return {d.name: Shape(d.prompt_tokens, d.output_tokens) for d in self.datasets
                if d.synthetic and d.prompt_tokens and isinstance(d.output_tokens, int)}

    def launch_spec(self, port: int = 30000, host: str | None = None) -> LaunchSpec:
        """Server flags shared by every launch: the batch must really form at every batch
        size, and CUDA graphs must cover it."""
        flags = {k: v for k, v in self.server_flags.items()}
        attention = flags.pop("--attention-backend", None)
        flags.pop("--mem-fraction-static", None)
        return LaunchSpec(
            model_path=self.model,
            # With methods, each runs its own draft (NEXTN none, though `draft` is set).
            draft_model_path=self.method_draft(self.algorithm) if self.methods else self.draft,
            algorithm=self.algorithm,
            methods=tuple((name, self.method_draft(name)) for name in self.method_names
                          if name != self.algorithm),
            engine_version=self.sglang_version,
            tp=self.tp,
            host=host or self.host,
            port=port,
            # With D attention groups each takes max_running_requests // D: a multiple
            # of D lets the largest batch form (SGLang asserts each gets one or more).
            max_running_requests=running_requests_for(self.max_batch, self.server_flags),
            cuda_graph_max_bs=cuda_graphs_for(self.max_batch, self.server_flags, self.tp),
            attention_backend=attention,
            mem_fraction_static=self.mem_fraction_static,
            extra_flags=tuple((k, tuple(v) if isinstance(v, list) else v)
                              for k, v in flags.items()),
        )

    def fingerprint(self) -> str:
        """What a stored study must match to be resumed: everything that changes results."""
        return hashlib.sha256(json.dumps(self.fingerprinted(), sort_keys=True)
                              .encode()).hexdigest()[:16]

    def fingerprinted(self) -> dict[str, Any]:
        """The fields `fingerprint` hashes, by name (what a changed study names)."""
        relevant: dict[str, Any] = {
            "model": self.model, "draft": self.draft, "algorithm": self.algorithm,
            "sglang_version": self.sglang_version, "tp": self.tp,
            "server_flags": self.server_flags, "env": self.env,
            "datasets": self.to_dict()["datasets"],  # paths resolved: copies match
            "batch": sorted(self.batch), "tolerance": self.tolerance,
            # Unset backend fields are left out, so a field added later with a None
            # default does not orphan the studies stored before it.
            "backend": {k: v for k, v in self.backend_dict().items() if v is not None},
            "measurement": {k: v for k, v in dataclasses.asdict(self.measurement).items()
                            if k not in _LATER_MEASUREMENT_KEYS
                            or v != getattr(Measurement, k)},
        }
        if self.rates:  # studies without open-loop cells keep their old fingerprint
            relevant["rates"] = sorted(self.rates)
        if self.slo.bounded:
            relevant["slo"] = dataclasses.asdict(self.slo)
        if self.objective is not Objective.THROUGHPUT:  # throughput studies: as before
            relevant["objective"] = self.objective.value
        if self.method_names != (self.algorithm,):  # a study of one method: as before
            relevant["methods"] = {n: self.method_draft(n) for n in self.method_names}
        return relevant

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
        data["rates"] = list(self.rates)
        data["objective"] = self.objective.value
        data["compare"] = [config_key(c) if c.method else [c.steps, c.topk, c.draft_tokens]
                           for c in self.compare]
        data["methods"] = [m.entry() for m in self.methods]
        # This goes to the output folder's copy and the storage's own record of the study.
        data["storage"] = self.written_storage
        data.pop("base_dir")
        return data

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        dump_yaml(self.to_dict(), path)


# user:password@ in a URL SQLAlchemy cannot read, the password up to the last '@' (one
# written unencoded may hold '@' itself).
_PASSWORD_PART = re.compile(r"(://[^:/@]*):([^/]*)@")


def _parsed(url: str) -> Any:
    """`url` as SQLAlchemy reads it; None when it cannot."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return None
    # An '@' left in the host: the password held one, unencoded, and was cut short there.
    return None if "@" in (parsed.host or "") else parsed


def shown_url(url: str) -> str:
    """A storage URL as it may be printed: its password, if any, as *** (in the URL's
    user part or its query)."""
    parsed = _parsed(url)
    if parsed is None:
        return _PASSWORD_PART.sub(r"\1:***@", url)
    if parsed.password is None and "password" not in parsed.query:
        return url
    if "password" in parsed.query:
        parsed = parsed.update_query_dict({"password": "***"})
    return parsed.render_as_string(hide_password=True).replace("%2A%2A%2A", "***")


def password_of(url: str) -> str | None:
    """A storage URL's password (in its user part or its query), None without one: what
    no message may show, wherever a database quotes it."""
    parsed = _parsed(url)
    if parsed is None:
        found = _PASSWORD_PART.search(url)
        return found.group(2) if found else None
    query = parsed.query.get("password")
    return parsed.password or (query if isinstance(query, str) else None)


def url_without_password(url: str) -> str:
    """A storage URL as it may be written to a file: without its password, which the
    database's client then takes from its own place (PostgreSQL: PGPASSWORD, ~/.pgpass)."""
    parsed = _parsed(url)
    if parsed is None:
        return _PASSWORD_PART.sub(r"\1@", url)
    if parsed.password is None and "password" not in parsed.query:
        return url
    return parsed._replace(password=None).difference_update_query(
        ["password"]).render_as_string(hide_password=False)


def _fields(cls: type[Any]) -> Iterator[tuple[dataclasses.Field[Any], Any]]:
    """A dataclass's fields with their resolved types."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield f, hints[f.name]


# The study file's sections: a mapping each, merged key by key with the command line's.
# The backend's keys depend on its kind, so it is read by `_backend`, not by one class.
SECTIONS: dict[str, type[Any] | None] = {
    **{f.name: hint for f, hint in _fields(StudySpec) if dataclasses.is_dataclass(hint)},
    "backend": None,
}


def file_schema() -> type[Any]:
    """The study file's schema for `yamlio.build`: StudySpec's fields at their file types
    (see `meta`), sections as their own dataclasses, plus the file-only `description`.

    Every key defaults to None because only the keys a file holds are read: StudySpec's
    own defaults fill the rest, so they are written once.
    """
    keys = [(f.name, f.metadata.get("file_type", hint), field(default=None))
            for f, hint in _fields(StudySpec) if f.metadata.get("in_file", True)]
    return dataclasses.make_dataclass(
        "StudyFile", [*keys, ("description", str, field(default=""))], frozen=True,
        namespace={"__module__": __name__, "__doc__": "A study file, as written."})


_StudyFile = file_schema()


@dataclass(frozen=True)
class SpecOption:
    """One `treetune search` option: the dotted study key it sets and its help."""

    key: str  # "tp", "budget.launches", "backend.profile"
    flag: str  # "--tp"
    help: str
    value_type: type[Any]  # one value on the command line: int, float or str; bool: a switch
    multiple: bool = False  # several values after one flag: `--batch 1 32`
    short: str | None = None
    implies: tuple[tuple[str, Any], ...] = ()  # keys it also sets, unless given too

    @property
    def param(self) -> str:
        """The option's Python parameter name: `--budget-launches` -> budget_launches."""
        return self.flag.removeprefix("--").replace("-", "_")


def _either(names: typing.Iterable[str]) -> str:
    *rest, last = names
    return f"{', '.join(rest)} or {last}" if rest else last


# The only hand-written options: the backend section's keys depend on its kind, so they are
# not one dataclass's fields (tests/test_spec_single_source.py checks that each names a
# field of a registered backend). `--profile` alone means the emulator, the one backend
# with a profile.
BACKEND_OPTIONS = (
    SpecOption("backend.kind", "--backend", f"{_either(BACKENDS)} (default: sglang; "
               "--profile or --world imply the emulator).", str),
    SpecOption("backend.profile", "--profile", "Emulator profile: a shipped one's name (see "
               "`treetune profiles`) or a profile file (implies --backend emulator).",
               str, implies=(("backend.kind", "emulator"),)),
    SpecOption("backend.world", "--world", "Emulate a world instead of a profile: a shipped "
               "world (see `treetune worlds`) or a world file (implies --backend emulator).",
               str, implies=(("backend.kind", "emulator"),)),
    SpecOption("backend.time_scale", "--time-scale", "Emulator speed-up: server seconds per "
               "wall second (default 1, real time).", float),
    SpecOption("backend.gpu", "--gpu", "SGLang: the GPU the auto prior assumes (a name in "
               "treetune's GPU table, see `treetune prior --help`); default: what nvidia-smi "
               "or amd-smi shows a launch worker.", str),
)


def search_options() -> list[SpecOption]:
    """Every option `treetune search` takes, in StudySpec's field order: from the metadata
    of its fields and its sections' fields, with BACKEND_OPTIONS in the backend's place."""
    return list(_options(StudySpec, ""))


def _options(cls: type[Any], prefix: str) -> Iterator[SpecOption]:
    for f, hint in _fields(cls):
        key = prefix + f.name
        if hint is Backend:
            yield from BACKEND_OPTIONS
        elif dataclasses.is_dataclass(hint):
            yield from _options(hint, f"{key}.")  # type: ignore[arg-type]
        elif "option" in f.metadata:
            value = _value_type(hint)
            multiple = typing.get_origin(value) in (list, tuple)
            item = typing.get_args(value)[0] if multiple else value
            help = f.metadata["help"]
            # Options default to None (a study file's value stands): the help names the
            # field's own default, which is what a study without either gets.
            if (isinstance(f.default, int | float | str) and not isinstance(f.default, bool)
                    and "default" not in help):
                shown = repr(f.default) if isinstance(f.default, str) else f.default
                help = f"{help.rstrip('.')} (default {shown})."
            yield SpecOption(key, f.metadata["option"], help,
                             # Trees, datasets and names are text on the command line.
                             item if item in (int, float, bool) else str, multiple,
                             f.metadata["short"])


def _value_type(hint: Any) -> Any:
    """The type without its None: an option left out is None anyway."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = (a for a in typing.get_args(hint) if a is not type(None))
    return hint


def option_overrides(values: Mapping[str, Any]) -> dict[str, Any]:
    """`load_study`'s overrides from option values by dotted key (None: not given), with
    what the given ones imply: {"budget.launches": 5} -> {"budget": {"launches": 5}}."""
    given = {k: v for k, v in values.items() if v is not None}
    for option in search_options():
        if option.key in given:
            for key, value in option.implies:
                given.setdefault(key, value)
    overrides: dict[str, Any] = {}
    for key, value in given.items():
        section, _, name = key.rpartition(".")
        (overrides.setdefault(section, {}) if section else overrides)[name] = value
    return overrides


def load_study(path: str | Path | None, overrides: dict[str, Any] | None = None) -> StudySpec:
    """A study from a YAML file (or none), with command-line overrides applied on top."""
    try:
        if path is None:
            return study_from_mapping({}, COMMAND_LINE, Path("."), overrides)
        loaded = load_yaml(path)
        if not isinstance(loaded, dict):
            raise ConfigFileError(path, "a study file must be a mapping of fields")
        return study_from_mapping(loaded, Path(path), Path(path).parent, overrides)
    except ConfigFileError as exc:
        raise as_typed(exc, overrides or {}) from None


def as_typed(exc: ConfigFileError, overrides: dict[str, Any]) -> ConfigFileError:
    """An error in a value typed on the command line (in `overrides`), named by its option
    ("command line: --budget-launches (budget.launches): ..."), not by the study file's
    key alone. A value no option gave (a field left out) keeps the key."""
    key = re.split(r"\[", exc.key or "")[0]
    flag = {o.key: o.flag for o in search_options()}.get(key)
    typed: Any = overrides
    for part in key.split("."):
        typed = typed.get(part) if isinstance(typed, dict) else None
    if exc.path != COMMAND_LINE or flag is None or typed is None:
        return exc
    named = ConfigFileError(f"{COMMAND_LINE}: {flag} ({exc.key})", exc.message)
    named.key = exc.key
    return named


def study_from_mapping(data: dict[str, Any], where: Path | str, base: Path,
                       overrides: dict[str, Any] | None = None) -> StudySpec:
    """A study from already-parsed fields; `where` names their source in errors."""
    path = where if isinstance(where, Path) else None
    raw = build(_StudyFile, data, where)
    # Only the keys the file holds (sections as mappings, to merge with the command line's).
    merged = {key: dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
              for key, value in ((k, getattr(raw, k)) for k in data)}
    # A space, profile, world or prior file named in a study file is found next to it, as
    # dataset files are.
    if path is not None:
        if "space" in merged:
            merged["space"] = next_to(base, merged["space"])
        merged = files_next_to(merged, base)
    given: set[str] = set()  # dotted keys the command line set
    _finite_options(overrides or {})
    for key, value in (overrides or {}).items():
        if key in SECTIONS and isinstance(value, dict):
            # Options left unset on the command line keep the file's values.
            set_here = {k: v for k, v in value.items() if v is not None}
            section = merged.get(key) or {}
            if key == "backend":
                if set_here.get("kind", section.get("kind")) != section.get("kind"):
                    section = {}  # another backend: the file's section was for the old one
                for one, other in (("world", "profile"), ("profile", "world")):
                    if one in set_here and other not in set_here:  # one or the other
                        section = {k: v for k, v in section.items() if k != other}
            merged[key] = {**section, **set_here}
            given |= {f"{key}.{k}" for k in set_here}
        elif value is not None:
            merged[key] = value
            given.add(key)

    def origin(key: str) -> Path | str:
        """Where the value at `key` ("datasets[0]", "backend.world") came from: the command
        line when it set the key or the field it is in, else the file."""
        return (COMMAND_LINE if key in given or re.split(r"[.\[]", key)[0] in given
                else where)

    def refused(exc: ValueError, section: str = "") -> TreetuneError:
        """The error for a value a check refused, blamed on the file or the command line."""
        if not isinstance(exc, FieldError):
            return TreetuneError(f"{where}: {exc}")
        key = f"{section}.{exc.key}" if section else exc.key
        return ConfigFileError(origin(key), str(exc), key)

    for nested, cls in SECTIONS.items():
        if nested not in merged:
            continue  # StudySpec's default
        try:
            merged[nested] = (_backend(merged[nested], where, given) if cls is None
                              else cls(**merged[nested]))
        except ValueError as exc:
            raise refused(exc, nested) from None
    merged.pop("description", None)
    if not merged.get("model"):
        raise TreetuneError(f"{where}: no model: give --model or set 'model' in the study file")
    merged["name"] = merged.get("name") or _default_name(merged["model"], path)
    if "datasets" not in merged:  # none named anywhere: the default (`default_datasets`)
        merged["datasets"] = default_datasets(merged.get("backend"), where)
    merged["datasets"] = tuple(_dataset(d, origin("datasets"), i)
                               for i, d in enumerate(merged["datasets"]))
    merged["batch"] = tuple(merged.get("batch", ()))
    merged["rates"] = tuple(float(r) for r in merged.get("rates", ()))
    merged["methods"] = tuple(_method(m, origin("methods"), i,
                                      base if path is not None and "methods" not in given
                                      else None)
                              for i, m in enumerate(merged.get("methods", ())))
    if merged["methods"] and "algorithm" not in merged:
        merged["algorithm"] = merged["methods"][0].name  # the first method is the study's own
    algorithm = str(merged.get("algorithm")
                    or StudySpec.__dataclass_fields__["algorithm"].default).upper()
    merged["compare"] = tuple(_tree(t, origin("compare"), i, algorithm)
                              for i, t in enumerate(merged.get("compare", ())))
    merged["server_flags"] = {str(k): _flag_value(v)
                              for k, v in merged.get("server_flags", {}).items()}
    merged["env"] = {str(k): _env_value(v, origin(f"env.{k}"), f"env.{k}")
                     for k, v in merged.get("env", {}).items()}
    merged["base_dir"] = str(base)
    try:
        return StudySpec(**merged)
    except ValueError as exc:
        raise refused(exc) from None


# The files of a study's sections that a study file may name relative to itself.
SECTION_FILES = (("backend", "profile"), ("backend", "world"), ("search", "prior"))


def files_next_to(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """A study's fields with the profile, world and prior files its sections name found
    next to `base` (`next_to`)."""
    out = dict(data)
    for section, key in SECTION_FILES:
        part = out.get(section)
        if isinstance(part, dict) and isinstance(part.get(key), str):
            out[section] = {**part, key: next_to(base, part[key])}
    return out


def next_to(base: Path, value: Any) -> Any:
    """A relative .yaml path a study file names, as the path of that file next to the
    study file when there is one there; anything else as written."""
    if not isinstance(value, str):
        return value
    named = Path(value)
    if not named.is_absolute() and named.suffix in (".yaml", ".yml") \
            and (base / named).is_file():
        return str((base / named).resolve())
    return value


def _finite_options(value: Any, key: str = "") -> None:
    """Command-line numbers are parsed before any field sees them: each checked as a
    file's are (`yamlio.finite`)."""
    if isinstance(value, dict):
        for k, v in value.items():
            _finite_options(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _finite_options(v, f"{key}[{i}]")
    elif isinstance(value, float):
        finite(value, COMMAND_LINE, key)


def _env_value(value: Any, where: Path | str, key: str) -> str:
    """An environment variable's value: text, or a number written as YAML shows it."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    got = ("nothing" if value is None else "true/false" if isinstance(value, bool)
           else f"a {type(value).__name__}")
    raise ConfigFileError(where, f"an environment variable's value is text or a number, got "
                          f"{got}: quote it (e.g. \"1\")", key)


def _flag_value(value: Any) -> str | list[str] | None:
    """A server flag's value as the command line takes it: None for a bare flag, a list
    for a flag of several values (SGLang's `--cuda-graph-bs-decode 1 2 4 8`), a mapping as its
    JSON (SGLang's `--cuda-graph-config`; Python's spelling of it is no JSON), else one
    word."""
    def word(v: Any) -> str:
        # default=str: a YAML date or the like inside the mapping, as its text.
        return json.dumps(v, default=str) if isinstance(v, dict) else str(v)

    if value is None:
        return None
    if isinstance(value, list | tuple):
        return [word(v) for v in value]
    return word(value)


def _backend(section: dict[str, Any], where: Path | str, given: set[str]) -> Backend:
    """The backend a section names (`kind`, SGLang by default), built from its other keys,
    which must be that backend's own fields."""
    fields = {k: v for k, v in section.items() if k != "kind"}
    kind = section.get("kind") or "sglang"
    cls = backend_class(kind)
    source = COMMAND_LINE if any(f"backend.{k}" in given for k in fields) else where
    settings = {k: {f.name for f in dataclasses.fields(c)} for k, c in BACKENDS.items()}
    for key in set(fields) - settings[kind]:
        other = next((k for k, names in settings.items() if key in names), None)
        if other is not None:
            raise ConfigFileError(COMMAND_LINE if f"backend.{key}" in given else where,
                                  f"'{key}' is a setting of the {other} backend, and this "
                                  f"study's backend is {kind}", f"backend.{key}")
    return build(cls, fields, source, "backend")


def default_datasets(backend: Backend | None, where: Path | str) -> list[str]:
    """A study's datasets when it names none: DEFAULT_DATASETS on a real server; the
    emulator serves only its profile's datasets, so there those of them treetune ships
    (none, for a profile of other sets: the study, from `where`, is refused, naming
    them)."""
    served_by = getattr(backend, "served_datasets", None)
    if served_by is None:
        return list(DEFAULT_DATASETS)
    served = served_by()
    shipped = [name for name in served if name in builtin_names()]
    if not shipped:
        raise TreetuneError(
            f"{where}: no datasets named, and the emulator's profile serves none of the "
            f"built-in ones (it knows: {', '.join(served)}): name them with a prompt "
            f"file each, e.g. datasets: [{{name: {served[0]}, path: prompts.jsonl}}]")
    return shipped


def absolute_sqlite(url: str) -> str:
    """A storage URL with an SQLite file's relative path made absolute, as SQLite opens it
    (from the current folder): a copy read from another folder names the same file."""
    if not url.startswith("sqlite:///") or _in_memory(url):
        return url
    path, mark, query = url.removeprefix("sqlite:///").partition("?")
    if path.startswith(("/", "file:")):
        return url
    return f"sqlite:///{Path(path).absolute()}{mark}{query}"


def _in_memory(url: str) -> bool:
    """Whether a storage URL is an SQLite database held in memory (sqlite://,
    sqlite:///:memory:, a file: URI with mode=memory)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:  # said as the storage opens
        return False
    if parsed.get_backend_name() != "sqlite":
        return False
    database = parsed.database or ""
    return database in ("", ":memory:") or database.startswith("file::memory:") \
        or "mode=memory" in database or parsed.query.get("mode") == "memory"


def is_loopback(host: str) -> bool:
    """Whether servers bound to `host` are reachable from this machine only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _default_name(model: str, path: str | Path | None) -> str:
    """The study file's name, else the model's, made a valid study name ("my study.yaml"
    is study "my-study")."""
    return _safe_name(Path(path).stem if path is not None else model.rsplit("/", 1)[-1],
                      "study")


def _safe_name(source: str, fallback: str) -> str:
    """`source` made a valid name (NAME): accents dropped, other characters runs of '-'."""
    ascii_only = unicodedata.normalize("NFKD", source).encode("ascii", "ignore").decode()
    return re.sub(r"[^A-Za-z0-9._-]+", "-", ascii_only).strip("-._") or fallback


DATASET_SUFFIXES = (".json", ".jsonl")  # a dataset entry ending so is a file's path


def _dataset(value: Any, where: Path | str, index: int) -> DatasetSpec:
    if isinstance(value, DatasetSpec):
        return value
    if isinstance(value, str):
        try:
            if value not in builtin_names() and (
                    "/" in value or value.lower().endswith(DATASET_SUFFIXES)):
                return _dataset_file(value, where)
            return DatasetSpec(name=value)
        except ValueError as exc:
            raise ConfigFileError(where, str(exc), f"datasets[{index}]") from None
    return build(DatasetSpec, value, where, f"datasets[{index}]")


def _dataset_file(value: str, where: Path | str) -> DatasetSpec:
    """A file named where a dataset's name goes (`--datasets data/chat.jsonl`): named after
    the file ("my chats.jsonl" is dataset "my-chats"), its format read from its first
    record; given on the command line, its path is the working directory's (a study
    file's paths are the file's folder's)."""
    name = _safe_name(Path(value).stem, "dataset")
    if name in builtin_names():
        raise ValueError(f"the file '{value}' would be named '{name}', a built-in dataset's "
                         f"name: give it its own, {{name: my-{name}, path: {value}}}")
    path = str(Path(value).resolve()) if where == COMMAND_LINE else value
    return DatasetSpec(name=name, path=path)


def _method(value: Any, where: Path | str, index: int, base: Path | None) -> DraftMethod:
    """A `methods` entry: a name, or a mapping {name, draft, space}; a space file named
    in a study file is found next to it, as the study's space is."""
    if isinstance(value, DraftMethod):
        return value
    key = f"methods[{index}]"
    if isinstance(value, str):
        try:
            return DraftMethod(value)
        except FieldError as exc:
            raise ConfigFileError(where, str(exc), key) from None
    method = build(DraftMethod, value, where, key)
    if base is not None and method.space:
        method = dataclasses.replace(method, space=next_to(base, method.space))
    return method


def _tree(value: Any, where: Path | str, index: int, algorithm: str) -> TreeConfig:
    """A compared tree as written, a server of its method (`algorithm` when it names none)."""
    if isinstance(value, TreeConfig):
        return value
    try:
        if isinstance(value, list) and len(value) == 3 and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            value = ",".join(map(str, value))
        if isinstance(value, str):
            return parse_method_tree(value, algorithm)
    except (InvalidTreeError, TypeError) as exc:
        raise ConfigFileError(where, str(exc), f"compare[{index}]") from None
    raise ConfigFileError(where, "expected [steps, topk, draft_tokens], 'S,K,N' or, for "
                          "another draft method of the study, 'METHOD:S,K,N'",
                          f"compare[{index}]")
