"""The one place that builds SGLang launch command lines.

Flag names follow the SGLang version a command targets: 0.5.10 split
`--cuda-graph-max-bs` into `--cuda-graph-max-bs-decode` / `--cuda-graph-max-bs-prefill`.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.errors import TreetuneError

DEFAULT_SGLANG_VERSION = "0.5.23"
CUDA_GRAPH_FLAG_SPLIT = (0, 5, 10)
# `python -m sglang.launch_server --config FILE.yaml` first shipped in SGLang 0.5.3: the 0.5.2
# wheel's srt/server_args.py has no --config, 0.5.3's has it and
# srt/server_args_config_parser.py (sgl-project/sglang PR #10534, "Initial support for input
# config files", Sept 2025). From 0.5.3 to 0.5.23 each key becomes `--{key}` verbatim, so keys
# are the long flag names with dashes; `true` on a store-true flag becomes the bare flag;
# other values are passed as str(value); the file must end in .yaml or .yml; the file's
# arguments go before the command line's, so flags on the command line win.
CONFIG_FILE_SINCE = (0, 5, 3)
ALGORITHMS = ("EAGLE3", "EAGLE", "NEXTN", "STANDALONE")


def parse_version(text: str) -> tuple[int, ...]:
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not match:
        raise TreetuneError(f"SGLang version '{text}' is not of the form MAJOR.MINOR[.PATCH]")
    return tuple(int(g or 0) for g in match.groups())


@dataclass(frozen=True)
class LaunchSpec:
    """Everything about a server launch except the tree being tried."""

    model_path: str
    draft_model_path: str | None = None
    algorithm: str = "EAGLE3"
    sglang_version: str = DEFAULT_SGLANG_VERSION
    tp: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    max_running_requests: int | None = None
    cuda_graph_max_bs: int | None = None
    attention_backend: str | None = None
    mem_fraction_static: float | None = None
    enable_metrics: bool = True
    extra_flags: tuple[tuple[str, str | None], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        parse_version(self.sglang_version)
        if self.algorithm not in ALGORITHMS:
            raise TreetuneError(
                f"speculative algorithm '{self.algorithm}' is not one of {', '.join(ALGORITHMS)}"
            )


def supports_config_file(sglang_version: str) -> bool:
    """Whether `launch_server --config FILE` exists in this SGLang version."""
    return parse_version(sglang_version) >= CONFIG_FILE_SINCE


def cuda_graph_flag(sglang_version: str) -> str:
    if parse_version(sglang_version) >= CUDA_GRAPH_FLAG_SPLIT:
        return "--cuda-graph-max-bs-decode"
    return "--cuda-graph-max-bs"


def speculative_args(config: ServerConfig, spec: LaunchSpec) -> list[str]:
    """The speculative flags: all three knobs together, or none for the baseline."""
    if config is BASELINE:
        return []
    assert isinstance(config, TreeConfig)
    if spec.draft_model_path is None and spec.algorithm != "NEXTN":
        raise TreetuneError(f"{spec.algorithm} needs a draft model path (--draft)")
    args = ["--speculative-algorithm", spec.algorithm]
    if spec.draft_model_path is not None:
        args += ["--speculative-draft-model-path", spec.draft_model_path]
    return [
        *args,
        "--speculative-num-steps", str(config.steps),
        "--speculative-eagle-topk", str(config.topk),
        "--speculative-num-draft-tokens", str(config.draft_tokens),
    ]


def server_args(
    config: ServerConfig, spec: LaunchSpec, flags: Sequence[tuple[str, str | None]] = ()
) -> list[str]:
    """SGLang `launch_server` arguments for one server (without the program)."""
    args = ["--model-path", spec.model_path, *speculative_args(config, spec)]
    args += ["--tp-size", str(spec.tp), "--host", spec.host, "--port", str(spec.port)]
    if spec.max_running_requests is not None:
        # With speculation on and this unset, SGLang caps running requests at 48.
        args += ["--max-running-requests", str(spec.max_running_requests)]
    if spec.cuda_graph_max_bs is not None:
        args += [cuda_graph_flag(spec.sglang_version), str(spec.cuda_graph_max_bs)]
    if spec.attention_backend is not None:
        args += ["--attention-backend", spec.attention_backend]
    if spec.mem_fraction_static is not None:
        args += ["--mem-fraction-static", f"{spec.mem_fraction_static:g}"]
    if spec.enable_metrics:
        args.append("--enable-metrics")
    for name, value in (*spec.extra_flags, *flags):
        args += [name] if value is None else [name, value]
    return args


def sglang_command(
    config: ServerConfig,
    spec: LaunchSpec,
    flags: Sequence[tuple[str, str | None]] = (),
    python: str = "python",
) -> list[str]:
    return [python, "-m", "sglang.launch_server", *server_args(config, spec, flags)]


def emulator_command(
    config: ServerConfig,
    spec: LaunchSpec,
    profile: str,
    flags: Sequence[tuple[str, str | None]] = (),
    emulator_args: Sequence[str] = (),
) -> list[str]:
    """The same server flags, served by treetune's emulator."""
    return [sys.executable, "-m", "treetune.emulator", "--profile", profile,
            *emulator_args, *server_args(config, spec, flags)]


def shell_line(argv: Sequence[str]) -> str:
    """A command line safe to paste into a POSIX shell: every word quoted as needed."""
    return shlex.join(argv)
