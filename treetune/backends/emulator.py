"""treetune's emulator as a backend: SGLang's flags and API, served without a GPU by
`python -m treetune.emulator`, timed by a performance profile; plus fault switches to
rehearse how a study survives servers that fail."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from treetune.backends._base import (
    Deployment,
    LaunchContext,
    LaunchSpec,
    ServerApi,
    register,
)
from treetune.backends.sglang import (
    SGLANG_API,
    profile_method,
    server_args,
    sglang_deployment,
    supports_config_file,
    version_of,
)
from treetune.config import ServerConfig
from treetune.errors import FieldError, InvalidTreeError, TreetuneError, for_field
from treetune.results import config_from_key, config_key

if TYPE_CHECKING:
    from treetune.perfmodel import Profile

FAULT_KINDS = ("startup", "hang", "crash")
# The emulator's own block in /server_info: its profile, time scale and clock.
EMULATOR_INFO_KEY = "emulator"
# The emulator keeps an emulated clock on a shared CPU: how late it met its deadlines (see
# treetune.emulator.engine.ClockLag), as a Prometheus histogram in emulated seconds and as a
# summary under EMULATOR_INFO_KEY in /server_info.
CLOCK_LAG_METRIC = "treetune_emulator_clock_lag_seconds"
CLOCK_LAG_INFO_KEY = "clock_lag"
CLOCK_LAG_HINT = ("run fewer workers at once (--workers), or lower backend.time_scale "
                  "(--time-scale, in a new study: another --output, since a study resumes "
                  "only as it was made): the emulator runs time_scale times faster than the "
                  "GPU, on a CPU that cannot keep up")
# The emulator answers SGLang's API, and says in server_info that it is the emulator.
EMULATOR_API = dataclasses.replace(SGLANG_API,
                                   info_keys=(*SGLANG_API.info_keys, EMULATOR_INFO_KEY),
                                   clock_lag=CLOCK_LAG_METRIC, clock_lag_hint=CLOCK_LAG_HINT,
                                   prefix_cache=False)


@dataclass(frozen=True)
class Fault:
    """A fault the emulator injects, to rehearse how a study survives it.

    startup: the server exits with an error while loading; hang: it never becomes healthy;
    crash: it exits abruptly partway through the benchmark."""

    kind: str
    probability: float = 1.0  # per launch attempt, drawn from the attempt's seed
    configs: tuple[str, ...] = ()  # config keys ("3,4,8", "baseline"); empty: every tree
    attempts: int | None = None  # only a launch's first N attempts (None: all)
    # Only a config's first N launches (None: all): a fault a later launch of it no longer
    # meets (a download that broke once, a token set since).
    launches: int | None = None
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
        if self.launches is not None and self.launches < 1:
            raise ValueError("fault launches must be >= 1")
        if self.after_requests is not None and (self.kind != "crash" or self.after_requests < 1):
            raise ValueError("fault after_requests must be >= 1, for crash faults only")
        for key in self.configs:
            try:
                config_from_key(key)
            except InvalidTreeError as exc:
                raise ValueError(f"fault configs: {exc}") from None

    def applies(self, config_key: str, attempt: int, launch_index: int = 0) -> bool:
        if self.attempts is not None and attempt >= self.attempts:
            return False
        if self.launches is not None and launch_index >= self.launches:
            return False
        return config_key in self.configs if self.configs else config_key != "baseline"


def launch_seed(study_seed: int, config: ServerConfig, attempt: int = 0,
                launch_index: int = 0) -> int:
    """Reproducible per-launch randomness (the emulator's launch noise and faults). Every
    server differs: a re-measurement of a config draws a new launch speed, as a real
    relaunch does (intervals would otherwise narrow on agreement that is not real)."""
    text = f"{study_seed}:{config_key(config)}:{attempt}"
    if launch_index:
        text += f":{launch_index}"  # the first launch keeps the seed it always had
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


def check_datasets(prof: Profile, datasets: list[str]) -> Profile:
    """The emulator answers only for the datasets its profile was calibrated on."""
    from treetune.datasets import builtin_names

    for name in datasets:
        try:
            prof.dataset(name)
            continue
        except TreetuneError as exc:
            # A set treetune ships, which this profile was not calibrated on: no misspelling.
            why = (f"profile '{prof.name}' was not calibrated on the built-in dataset "
                   f"'{name}'; it knows: {', '.join(prof.datasets)}"
                   if name in builtin_names() else str(exc))
        raise TreetuneError(f"{why}; the emulator serves only its profile's datasets: use "
                            "those, or another profile, or --backend sglang")
    return prof


def emulator_command(config: ServerConfig, launch: LaunchSpec, profile: str | None = None,
                     emulator_args: Sequence[str] = (), world: str | None = None) -> list[str]:
    """SGLang's flags for `config`, served by treetune's emulator with `emulator_args`,
    from a profile or a world, as the SGLang release the flags are written for."""
    source = ["--world", world] if world is not None else ["--profile", str(profile)]
    version = ["--emulate-version", launch.engine_version] if launch.engine_version else []
    return [sys.executable, "-m", "treetune.emulator", *source, *version, *emulator_args,
            *server_args(config, launch)]


@register
@dataclass(frozen=True)
class EmulatorBackend:
    """SGLang-compatible servers emulated on the CPU; no GPU needed."""

    kind: ClassVar[str] = "emulator"
    # Ray counts emulated GPUs as a custom resource: a laptop has none of the real kind.
    gpu_resource: ClassVar[str] = "emulated_gpu"
    gpu_label: ClassVar[str] = "emulated GPUs"
    api: ClassVar[ServerApi] = EMULATOR_API

    profile: str | None = None  # shipped profile name or profile YAML: the emulated truth
    # Or a world: a profile plus effects the search's model cannot express, or replayed
    # measurements (treetune/worlds/). The search sees only its `facts`.
    world: str | None = None
    time_scale: float = 1.0  # run this many times faster than the GPU
    load_time_s: float = 2.0  # emulated model-loading time
    noise: bool = True  # the profile's measurement noise
    faults: tuple[Fault, ...] = ()  # injected faults

    def __post_init__(self) -> None:
        # Rebuilt from plain mappings when the spec is copied field by field.
        object.__setattr__(self, "faults", tuple(
            f if isinstance(f, Fault) else Fault(**{**f, "configs": tuple(f.get("configs", ()))})
            for f in self.faults))
        if not self.profile and not self.world:
            raise FieldError("profile", "the emulator backend needs backend.profile (e.g. "
                             "qwen3-coder-next-h200) or backend.world")
        if self.profile and self.world:
            raise FieldError("world", "give backend.profile or backend.world, not both")
        # An unknown name is refused where it was written, not after the study's banner.
        from treetune.perfmodel import resolve_profile_path
        from treetune.worlds import resolve_world_path

        if self.profile:
            with for_field("profile"):
                resolve_profile_path(self.profile)
        if self.world:
            with for_field("world"):
                resolve_world_path(self.world)
        if self.time_scale <= 0:
            raise FieldError("time_scale", "backend.time_scale must be > 0")
        if self.load_time_s < 0:
            raise FieldError("load_time_s", "backend.load_time_s must be >= 0, got "
                             f"{self.load_time_s:g}")

    def command(self, launch: LaunchSpec, config: ServerConfig,
                context: LaunchContext) -> list[str]:
        """The SGLang flags, served by the emulator, with its own switches first."""
        seed = launch_seed(context.study_seed, config, context.attempt, context.launch_index)
        extra = ["--time-scale", f"{self.time_scale:g}", "--load-time", f"{self.load_time_s:g}",
                 "--seed", str(seed)]
        if not self.noise:
            extra.append("--no-noise")
        extra += self.fault_switches(config, context)
        return emulator_command(config, launch, self.profile, extra, self.world)

    def fault_switches(self, config: ServerConfig, context: LaunchContext) -> list[str]:
        """The fault switches for this launch attempt: the first rule that applies and
        fires (drawn from the attempt's seed) decides."""
        key = config_key(config)
        attempt = context.attempt
        rng = random.Random(launch_seed(context.study_seed, config, attempt,
                                        context.launch_index) ^ 0x5EED)
        for fault in self.faults:
            roll = rng.random()  # drawn for every rule, so one rule's draws never shift another's
            if not fault.applies(key, attempt, context.launch_index) or roll >= fault.probability:
                continue
            if fault.kind == "startup":
                return ["--fail-on-startup"]
            if fault.kind == "hang":
                return ["--hang-on-startup"]
            # At random within the benchmark: every cell sends at least `batch` requests.
            after = fault.after_requests or rng.randint(1, max(1, context.min_requests - 1))
            return ["--crash-after-requests", str(after)]
        return []

    def deployment(self, launch: LaunchSpec, config: ServerConfig) -> Deployment:
        # What the emulator stands in for is what production runs.
        return sglang_deployment(launch, config)

    def reads_config_file(self, launch: LaunchSpec) -> bool:
        # As the SGLang release its flags target (the emulator reads one as 0.5.3+ does).
        return supports_config_file(version_of(launch))

    def truth(self) -> Profile:
        """The profile the emulator serves: its own, or its world's."""
        key = "world" if self.world is not None else "profile"
        try:
            if self.world is not None:
                from treetune.worlds import load_world

                return load_world(self.world).profile
            from treetune.perfmodel import load_profile

            assert self.profile is not None  # refused at construction otherwise
            return load_profile(self.profile)
        except TreetuneError as exc:  # "x.yaml: file not found" named no key of the study
            raise TreetuneError(f"backend.{key}: {exc}") from None

    def served_datasets(self) -> list[str]:
        """The datasets the emulator answers for (its profile's): a study naming none
        takes those of them that are built in (`spec.default_datasets`)."""
        return list(self.truth().datasets)

    def check(self, launch: LaunchSpec, datasets: list[str], env: Mapping[str, str],
              local: bool) -> None:
        prof = check_datasets(self.truth(), datasets)
        source = f"{'world' if self.world else 'profile'} '{self.world or self.profile}'"
        for algorithm in (launch.algorithm, *(name for name, _ in launch.methods)):
            if profile_method(algorithm) not in prof.method_names:
                # Every launch of that method would fail: the budget spent on nothing.
                raise TreetuneError(
                    f"the emulator's {source} describes the draft methods "
                    f"{', '.join(prof.method_names)}, not {algorithm}: drop {algorithm} from "
                    "the study's methods, or emulate a profile that has it")
        if launch.tp > prof.hardware.gpus:  # every launch, the baseline's first, would fail
            raise TreetuneError(
                f"tp {launch.tp} needs {launch.tp} GPUs per server but the emulator's "
                f"{source} emulates {prof.hardware.gpus} {prof.hardware.gpu}: set tp to at most "
                f"{prof.hardware.gpus}, or emulate a profile with more GPUs")

    def facts(self, launch: LaunchSpec, env: Mapping[str, str]) -> Profile:
        """The emulated system's hardware and model facts; for a world, only what it lets
        a prior know (its hidden effects stay hidden)."""
        if self.world is not None:
            from treetune.worlds import load_world

            return load_world(self.world).facts
        from treetune.perfmodel import load_profile

        assert self.profile is not None
        return load_profile(self.profile)

    def describe(self) -> str:
        return f"{self.kind} ({self.world or self.profile})"
