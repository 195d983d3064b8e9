"""Deployment forms of the recommendations, next to each launch script: an SGLang config
file, a container argument list, and, when batch sizes want different trees, POOLS.md on
running one server pool per tree behind SGLang's router."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from treetune.config import BASELINE, ServerConfig
from treetune.errors import TreetuneError
from treetune.launch import shell_line, supports_config_file
from treetune.study.recommend import MIXED, Recommendation, launch_argv, pools_advice
from treetune.study.spec import StudySpec

POOLS_FILE = "POOLS.md"
SERVER_PORT_BASE = 30000  # pool i serves on 30000 + i
ROUTER_PORT_BASE = 31000  # its router on 31000 + i
ROUTER_METRICS_PORT_BASE = 29000  # the router's Prometheus port defaults to 29000: one each


def config_name(rec: Recommendation) -> str:
    return rec.script_name.removesuffix(".sh") + ".config.yaml"


def args_name(rec: Recommendation) -> str:
    return rec.script_name.removesuffix(".sh") + ".args.json"


def config_mapping(server_args: Sequence[str]) -> dict[str, Any]:
    """launch_server arguments as a --config mapping: long names without the leading dashes,
    bare flags as true, numbers typed (a later repeat of a flag wins, as on the command line)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(server_args):
        flag = server_args[i]
        if not flag.startswith("--"):
            raise TreetuneError(f"cannot write '{flag}' to an SGLang config file: expected a "
                                "--flag")
        if i + 1 < len(server_args) and not server_args[i + 1].startswith("--"):
            out[flag[2:]] = _typed(server_args[i + 1])
            i += 2
        else:
            out[flag[2:]] = True
            i += 1
    return out


def _typed(value: str) -> int | float | str:
    """A number when it prints back exactly as given, so SGLang's str(value) restores it."""
    for kind in (int, float):
        try:
            number = kind(value)
        except ValueError:
            continue
        if str(number) == value:
            return number
    return value


def config_file(spec: StudySpec, rec: Recommendation) -> str:
    """The launch script's flags as a YAML file for `launch_server --config`."""
    argv = launch_argv(spec, rec)
    lines = [f"# SGLang server config (SGLang >= 0.5.3): python -m sglang.launch_server "
             f"--config {config_name(rec)}",
             f"# treetune study '{spec.name}': {rec.workload} workload at batch {rec.batch}, "
             + ("no speculation" if rec.config is BASELINE else f"tree {rec.config}")]
    if spec.env:
        lines.append("# environment: " + " ".join(f"{k}={shell_line([v])}"
                                                  for k, v in sorted(spec.env.items())))
    if spec.api_key_env:
        lines.append(f'# the API key is not in this file: add --api-key "${{{spec.api_key_env}}}" '
                     "to the command")
    body = yaml.safe_dump(config_mapping(argv[3:]), sort_keys=False, allow_unicode=True)
    return "\n".join(lines) + "\n" + body


def container_args(spec: StudySpec, rec: Recommendation) -> list[str]:
    """The launch script's argv after the program (`python`), for a container spec's args.
    The API key is a Kubernetes `$(VAR)` reference, expanded from the container's env."""
    argv = launch_argv(spec, rec)[1:]
    if spec.api_key_env:
        argv += ["--api-key", f"$({spec.api_key_env})"]
    return argv


@dataclass(frozen=True)
class Pool:
    """Servers running one tree, for the batch sizes that want it."""

    index: int  # 1-based, by batch size
    config: ServerConfig
    batches: tuple[int, ...]
    rec: Recommendation  # the largest batch's: its script sizes the server for the others

    @property
    def port(self) -> int:
        return SERVER_PORT_BASE + self.index

    @property
    def router_port(self) -> int:
        return ROUTER_PORT_BASE + self.index

    @property
    def metrics_port(self) -> int:
        return ROUTER_METRICS_PORT_BASE + self.index


def pools(recs: list[Recommendation]) -> list[Pool]:
    """One pool per distinct mixed-workload tree, ordered by batch size."""
    groups: dict[ServerConfig, list[Recommendation]] = {}
    for rec in sorted((r for r in recs if r.workload == MIXED), key=lambda r: r.batch):
        groups.setdefault(rec.config, []).append(rec)
    return [Pool(i, config, tuple(r.batch for r in members), members[-1])
            for i, (config, members) in enumerate(groups.items(), start=1)]


def pools_readme(spec: StudySpec, recs: list[Recommendation]) -> str | None:
    """POOLS.md: how to run one pool per tree behind the SGLang router; None when one tree
    serves every batch size."""
    advice = pools_advice(recs)
    if advice is None:
        return None
    found = pools(recs)
    key = f'"${{{spec.api_key_env}}}"' if spec.api_key_env else None
    worker_host = _reachable(spec.host)
    out = [f"# Server pools for study '{spec.name}'", "",
           f"treetune advice: {advice}.", "",
           "| pool | batch sizes | tree | launch script | server port | router port |",
           "|---|---|---|---|---|---|"]
    for p in found:
        out.append(f"| {p.index} | {', '.join(map(str, p.batches))} | {p.config} | "
                   f"`{p.rec.script_name}` | {p.port} | {p.router_port} |")
    out += ["", "Every pool loads the same target and draft checkpoints; only the speculative "
            "flags and the batch sizing differ. Each needs its own GPU group (TP "
            f"{spec.tp}): on a shared host give each command its own `CUDA_VISIBLE_DEVICES`.",
            "", "## Start the servers", "",
            "Each command is its pool's launch script with `--port` changed; run each in its "
            "own terminal or service unit:", "", "```sh"]
    out += [f"export {k}={shell_line([v])}" for k, v in sorted(spec.env.items())]
    for p in found:
        command = shell_line(launch_argv(spec, p.rec, port=p.port))
        out += [f"# pool {p.index}: {p.rec.script_name} on port {p.port}",
                command + (f" --api-key {key}" if key else "")]
    out.append("```")
    if supports_config_file(spec.sglang_version):
        out += ["", "or, with the config files (flags on the command line win over the file):",
                "", "```sh"]
        out += [f"python -m sglang.launch_server --config {config_name(p.rec)} --port {p.port}"
                + (f" --api-key {key}" if key else "") for p in found]
        out.append("```")
    out += ["", "## Put the router in front", "",
            "The SGLang router (`pip install sglang-router`) balances requests over the "
            "workers it is given (`--policy` `cache_aware`, the default, `round_robin`, "
            "`random`, `power_of_two`; newer releases add `manual`, sticky per "
            "`X-SMG-Routing-Key` header). No policy looks at how many requests a client keeps "
            "in flight, so one router over both pools would mix the traffic each tree was "
            "chosen for. Run one router per pool, and let each client, or the proxy in front, "
            "pick the endpoint that matches its concurrency:", "", "```sh"]
    for p in found:
        router = ["python", "-m", "sglang_router.launch_router",
                  "--worker-urls", f"http://{worker_host}:{p.port}",
                  "--host", "0.0.0.0", "--port", str(p.router_port),
                  "--prometheus-port", str(p.metrics_port)]
        out += [f"# pool {p.index}: traffic at batch {', '.join(map(str, p.batches))}",
                shell_line(router) + (f" --api-key {key}" if key else "")]
    out += ["```", "",
            "Add replicas to a pool by listing their URLs after its router's `--worker-urls`. "
            "Concurrency between the measured batch sizes was not measured: send it to the "
            "nearer pool, or add the batch size to the study."]
    if key:
        out += ["", f"The API key stays in `{spec.api_key_env}`; the routers pass it to the "
                "workers."]
    return "\n".join(out) + "\n"


def _reachable(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def write_exports(spec: StudySpec, recs: list[Recommendation], out_dir: Path) -> None:
    """Next to each launch script: `.args.json`, and `.config.yaml` when the study's SGLang
    version reads config files; POOLS.md when batch sizes want different trees. Files that
    no longer apply (a re-run changed the advice) are removed."""
    with_config = supports_config_file(spec.sglang_version)
    for rec in recs:
        (out_dir / args_name(rec)).write_text(json.dumps(container_args(spec, rec), indent=1)
                                              + "\n")
        config = out_dir / config_name(rec)
        if with_config:
            config.write_text(config_file(spec, rec))
        else:
            config.unlink(missing_ok=True)
    readme = pools_readme(spec, recs)
    if readme:
        (out_dir / POOLS_FILE).write_text(readme)
    else:
        (out_dir / POOLS_FILE).unlink(missing_ok=True)
