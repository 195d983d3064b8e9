"""What a serving backend is to a study: the small protocol every backend module implements.

A backend is a frozen dataclass whose fields are its section of the study spec
(`backend: {kind: NAME, ...fields}`) and whose methods say what it launches, on which Ray
resource, what it checks before anything starts, how its server is read and what it emits
for production. The study never asks which backend it holds.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, runtime_checkable

from treetune.config import ServerConfig
from treetune.errors import ConfigNotFoundError, FieldError, TreetuneError

if TYPE_CHECKING:
    from treetune.perfmodel import Profile


Flags = Sequence[tuple[str, str | None]]


class AdaptiveState(NamedTuple):
    """A server's runtime step controller as its info reports it."""

    active: bool  # False: the server serves static trees, whatever its flags asked for
    steps_per_slot: dict[int, int]  # batch-size slot (its smallest batch) -> current steps


@dataclass(frozen=True)
class ServerApi:
    """What a server's HTTP API calls things: routes, and the metrics a cell is read from."""

    health: str  # 200 once the server can generate
    server_info: tuple[str, ...]  # tried in order (older releases use later names)
    flush_cache: str
    metrics: str
    completions: Mapping[str, str]  # "chat" / "completion" -> route
    generated_tokens: str  # counter: output tokens
    verify_calls: str  # counter: speculative verify passes (accept length = tokens / calls)
    running: str  # gauge: requests running
    queued: str  # gauge: requests waiting
    info_keys: tuple[str, ...]  # server facts worth keeping from server_info (never secrets)
    # Reads a runtime step controller's state from server_info (None: the engine has none).
    adaptive_state: Callable[[Mapping[str, Any]], AdaptiveState] | None = None
    # Where a healthy server does not serve what its flags asked for, one line each, from
    # its launch flags, server_info and start-up log (SGLang drops some flags with only a
    # log warning).
    launch_warnings: Callable[[Flags, Mapping[str, Any], str], list[str]] | None = None
    # A histogram of how late the server's clock met its schedule, in server seconds (None:
    # the server runs on a real clock, as SGLang does); its _sum over its _count over a cell
    # is the cell's mean clock lag. With what to do when it (or the load generator) lags,
    # for the study's warning.
    clock_lag: str | None = None
    prompt_tokens: str | None = None  # counter: prompt tokens prefilled (another sign of work)
    clock_lag_hint: str = ("give the load generator a CPU to itself: run fewer workers at "
                           "once (--workers) or the study on a less busy machine")
    # Why a server may show no verify counter at all (its engine's releases before it).
    verify_calls_hint: str = ""
    # Whether the engine keeps a prefix cache (which a study's servers run without:
    # LaunchSpec.prefix_cache); the emulator keeps none.
    prefix_cache: bool = False
    # What the server logs about health checks that failed: no sign of a start going on
    # (a server still writing its log at its start-up timeout is waited for), as the
    # access lines for the health route are not either.
    health_log: tuple[str, ...] = ()
    # What the server logs when its KV cache pool runs full while it serves (requests then
    # run fewer at once than a cell's batch, the others waiting or retracted).
    pool_full_log: str = ""

    def runs_adaptive(self, info: Mapping[str, Any]) -> bool:
        """Whether a server asked for runtime adaptive steps runs them, by the server info
        its launch kept: False where the info says its controller is off (SGLang then
        serves static trees and only logs why, also for a switch a model turns on by
        itself, such as multi-layer EAGLE); True where nothing can tell (an engine without
        a controller reader, or a launch that kept no info: an in-process one)."""
        return self.adaptive_state is None or not info or self.adaptive_state(info).active


@dataclass(frozen=True)
class LaunchSpec:
    """Everything about a server launch except the tree being tried."""

    model_path: str
    draft_model_path: str | None = None
    algorithm: str = "EAGLE3"
    # The study's other draft methods, each with its draft model (None: it needs none): a
    # config whose `method` names one is launched as that algorithm (`for_method`).
    methods: tuple[tuple[str, str | None], ...] = ()
    engine_version: str = ""  # the engine release the flags target ("" = the backend's default)
    tp: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    max_running_requests: int | None = None
    cuda_graph_max_bs: int | None = None
    attention_backend: str | None = None
    mem_fraction_static: float | None = None
    enable_metrics: bool = True
    # False for a study's servers: a cell sends each prompt of its set many times, and
    # every cell of a server the same ones, where a prefix cache would skip nearly every
    # prefill after the first cell (no production server sees that, and neither the model
    # search nor the emulator prices it). Production commands keep the engine's default.
    prefix_cache: bool = True
    # (flag, value): None for a bare flag, a tuple for a flag of several values.
    extra_flags: tuple[tuple[str, str | tuple[str, ...] | None], ...] = field(
        default_factory=tuple)
    # An adaptive server's JSON config file, as the server's command names it (the launch
    # worker writes it next to the server's log; an export, next to the launch script).
    adaptive_config_path: str | None = None

    def for_method(self, method: str) -> LaunchSpec:
        """The launch of a config of draft method `method` (a TreeConfig's; "": the
        study's own algorithm): that algorithm with its own draft model."""
        if not method or method == self.algorithm:
            return self
        drafts = dict(self.methods)
        if method not in drafts:
            listed = ", ".join([self.algorithm, *drafts])
            raise TreetuneError(f"draft method {method} is not one of this launch's "
                                f"methods ({listed}): list it in the study's methods")
        return dataclasses.replace(self, algorithm=method, draft_model_path=drafts[method],
                                   methods=())


@dataclass(frozen=True)
class LaunchContext:
    """What one launch attempt needs beyond its flags: reproducible randomness and the
    benchmark's size (a backend that injects faults draws from them)."""

    study_seed: int = 0
    attempt: int = 0  # 0 for the first server of a launch, 1 for its replacement
    launch_index: int = 0  # how many launches of this config came before this one
    min_requests: int = 1  # requests the benchmark sends at least, over all cells


@dataclass(frozen=True)
class Deployment:
    """How production runs one recommended server."""

    argv: list[str]  # the whole command, program first
    # The same flags as the engine's config file, and the command that reads it (None when
    # the engine release cannot read config files).
    config_file: dict[str, Any] | None = None
    config_command: list[str] | None = None
    config_note: str = ""  # which release first reads config files, for the file's header
    # Flags the config file cannot hold, on the command line after it.
    config_tail: list[str] = field(default_factory=list)


@runtime_checkable
class Backend(Protocol):
    """A serving backend: one module, one class, registered under its `kind`."""

    kind: ClassVar[str]  # its name in study files and on the command line
    gpu_resource: ClassVar[str]  # the Ray resource one GPU of a server is counted in
    gpu_label: ClassVar[str]  # that resource, in words
    api: ClassVar[ServerApi]

    def command(self, launch: LaunchSpec, config: ServerConfig,
                context: LaunchContext) -> list[str]:
        """The program and arguments that start one server for `config`."""
        ...

    def deployment(self, launch: LaunchSpec, config: ServerConfig) -> Deployment:
        """What a user pastes into production for `config` (never with secrets)."""
        ...

    def reads_config_file(self, launch: LaunchSpec) -> bool:
        """Whether a server started as `launch` says reads `--config FILE.yaml`, a mapping
        of its long flags (SGLang's `launch_server --config`). A study's servers then take
        their API key from a private file of that kind, not from their command line, which
        every user of the machine can read (`ps`)."""
        ...

    def check(self, launch: LaunchSpec, datasets: list[str], env: Mapping[str, str],
              local: bool) -> None:
        """Refuse, with a TreetuneError saying what to do, what cannot work before Ray or
        any server starts (servers launched as `launch` says). `local`: servers run on this
        machine."""
        ...

    def facts(self, launch: LaunchSpec, env: Mapping[str, str]) -> Profile | None:
        """Hardware and model facts the model search may start from, or None when the
        backend knows none. Runs where its servers run (on a launch worker, with the
        study's environment), so it sees their GPUs and their model files; raises
        TreetuneError saying why when it cannot build them."""
        ...

    def describe(self) -> str:
        """One line for the study's header: the backend and its main setting."""
        ...


@dataclass(frozen=True)
class BackendFacts:
    """A backend's facts, or in one line why there are none (the search then goes without
    a performance model)."""

    profile: Profile | None
    why_not: str = ""
    # Whether they may be there later: a model's config.json not yet on the node, which a
    # server started with the model's hub name downloads into the local cache.
    later: bool = False


def gather_facts(backend: Backend, launch: LaunchSpec, env: Mapping[str, str]) -> BackendFacts:
    """`backend.facts`, never raising for what a user can fix: facts are a head start for
    the search, and a study runs without them."""
    try:
        profile = backend.facts(launch, env)
    except ConfigNotFoundError as exc:
        return BackendFacts(None, str(exc), later=exc.fetchable)
    except TreetuneError as exc:
        return BackendFacts(None, str(exc))
    except Exception as exc:  # a model or machine the facts code did not foresee
        return BackendFacts(None, f"building them failed: {type(exc).__name__}: {exc}")
    return BackendFacts(profile, "" if profile is not None else
                        f"the {backend.kind} backend knows no hardware or model facts")


BACKENDS: dict[str, type[Backend]] = {}


def register(cls: type[Any]) -> type[Any]:
    """Class decorator: make a backend available under `cls.kind`."""
    BACKENDS[cls.kind] = cls
    return cls


def backend_class(kind: str) -> type[Backend]:
    try:
        return BACKENDS[kind]
    except KeyError:
        raise FieldError("kind", f"backend.kind must be one of {', '.join(BACKENDS)}, got "
                         f"'{kind}'") from None


def server_facts(api: ServerApi, info: Mapping[str, Any]) -> dict[str, Any]:
    """What to keep of a server's info: the resolved settings that matter, never secrets."""
    return {k: info[k] for k in api.info_keys if k in info}


def shell_line(argv: Sequence[str]) -> str:
    """A command line safe to paste into a POSIX shell: every word quoted as needed."""
    return shlex.join(argv)


def parse_version(text: str, engine: str = "SGLang") -> tuple[int, ...]:
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not match:
        raise TreetuneError(f"{engine} version '{text}' is not of the form MAJOR.MINOR[.PATCH]")
    return tuple(int(g or 0) for g in match.groups())
