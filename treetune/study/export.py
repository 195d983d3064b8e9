"""Recommendations as files: recommendations.yaml/.json, a paste-ready launch script per
recommendation and, next to each, the engine's config file and a container argument list;
when batch sizes want different trees, POOLS.md on running one server pool per tree behind
SGLang's router; when one adaptive server serves every batch size, one script for it, its
JSON config next to it, the equivalent chain schedules for vLLM and TensorRT-LLM, and
ADAPTIVE.md. What production runs comes from the study's backend."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from treetune.backends import Deployment, shell_line
from treetune.backends.chain_schedules import ChainSchedule, trtllm_schedule, vllm_schedule
from treetune.backends.sglang import cuda_graphs_for, running_requests_for
from treetune.backends.sglang_adaptive import graph_sizes_for
from treetune.config import BASELINE, AdaptiveConfig, ServerConfig, TreeConfig
from treetune.study.recommend import (
    ADAPTIVE,
    MIXED,
    Recommendation,
    adaptive_advice,
    pools_advice,
    script_name,
)
from treetune.study.spec import StudySpec, is_loopback
from treetune.yamlio import dump_yaml

POOLS_FILE = "POOLS.md"
ADAPTIVE_FILE = "ADAPTIVE.md"
# Where a launch script's adaptive config is: next to the script, wherever it is run from.
# The word stands for it in the command line until the script says it in shell.
_NEXT_TO_SCRIPT = "TREETUNE_ADAPTIVE_CONFIG"
# Pool i serves on 30001 + 100 (i - 1), its router 50 above. Spaced: with data-parallel
# attention SGLang also binds ports derived from --port (its ZMQ and rendezvous ports at
# --port + 233 to + 240, a handshake at --port + 13), which consecutive ports would share.
SERVER_PORT_BASE = 30001
POOL_PORT_STEP = 100
ROUTER_PORT_OFFSET = 50
ROUTER_METRICS_PORT_BASE = 29000  # the router's Prometheus port defaults to 29000: one each


def server(rec: Recommendation) -> str:
    """What a recommendation runs, in words: 'EAGLE3 tree (3,1,4)' or 'no speculation'."""
    if rec.config is BASELINE:
        return "no speculation"
    if isinstance(rec.config, AdaptiveConfig):
        return f"{rec.method} {rec.config}" if rec.method else str(rec.config)
    tree = (dataclasses.replace(rec.config, method="")
            if isinstance(rec.config, TreeConfig) else rec.config)
    return f"{rec.method} tree {tree}" if rec.method else f"tree {tree}"


def config_name(rec: Recommendation) -> str:
    return rec.script_name.removesuffix(".sh") + ".config.yaml"


def args_name(rec: Recommendation) -> str:
    return rec.script_name.removesuffix(".sh") + ".args.json"


def adaptive_name(workload: str) -> str:
    """An adaptive server's JSON config, next to its launch script."""
    return f"launch/{workload}.adaptive.json"


def vllm_name(workload: str) -> str:
    return f"launch/{workload}.vllm-schedule.json"


def trtllm_name(workload: str) -> str:
    return f"launch/{workload}.trtllm-schedule.json"


def sized_for(spec: StudySpec, rec: Recommendation) -> int:
    """The batch a recommendation's server is sized for: its own, or for an adaptive pool,
    which serves every batch size, the largest."""
    return spec.max_batch if isinstance(rec.config, AdaptiveConfig) else rec.batch


def deployment(spec: StudySpec, rec: Recommendation, port: int | None = None,
               adaptive_path: str | None = None) -> Deployment:
    """How production runs one recommendation, sized for its batch; without --api-key,
    which each output references in its own syntax. An adaptive server's JSON config is
    named as `adaptive_path`, by default by its file name (next to the config file and
    the container's argument list, in the launch folder)."""
    base = spec.launch_spec() if port is None else spec.launch_spec(port=port)
    batch = sized_for(spec, rec)
    path = None
    if isinstance(rec.config, AdaptiveConfig):
        path = adaptive_path or Path(adaptive_name(rec.workload)).name
    launch = dataclasses.replace(
        base, max_running_requests=running_requests_for(batch, spec.server_flags),
        cuda_graph_max_bs=cuda_graphs_for(batch, spec.server_flags, spec.tp),
        adaptive_config_path=path)
    return spec.backend.deployment(launch, rec.config)


def launch_argv(spec: StudySpec, rec: Recommendation, port: int | None = None,
                adaptive_path: str | None = None) -> list[str]:
    return deployment(spec, rec, port, adaptive_path).argv


_KEY_PLACEHOLDER = "<the API key>"


def key_word(variable: str) -> str:
    """The API key as a shell word that names its variable, never its value, and stops the
    script when the variable is unset or empty: SGLang takes an empty --api-key as none
    and would serve without authentication."""
    return f'"${{{variable}:?is unset or empty: the server would run without an API key}}"'


def launch_script(spec: StudySpec, rec: Recommendation,
                  group: list[Recommendation] | None = None) -> str:
    """A POSIX sh script: the study's environment and the full, quoted command for the
    study's engine version, sized for this batch. `group`: every recommendation the
    script serves (an adaptive pool's, one per batch size), for its header."""
    group = sorted(group or [rec], key=lambda r: r.batch)
    argv = launch_argv(spec, rec, adaptive_path=_NEXT_TO_SCRIPT)
    if spec.api_key_env:
        argv += ["--api-key", _KEY_PLACEHOLDER]
    if isinstance(rec.config, AdaptiveConfig):
        batches = ", ".join(str(r.batch) for r in group)
        lines = ["#!/bin/sh",
                 f"# treetune study '{spec.name}': {rec.workload} workload, one adaptive "
                 f"pool for batch {batches}",
                 f"# {rec.config}; its slots in {Path(adaptive_name(rec.workload)).name}"]
        lines += [f"# batch {r.batch}: measured speedups [interval]: "
                  + ", ".join(r.speedup_labels()) for r in group]
    else:
        lines = ["#!/bin/sh",
                 f"# treetune study '{spec.name}': {rec.workload} workload at batch "
                 f"{rec.batch}",
                 f"# {server(rec)}; measured speedups [interval]: "
                 + ", ".join(rec.speedup_labels())]
    lines.append(f"# {rec.reason}")
    lines.append(f"# objective: {objective_line(spec)}")
    lines += [f"export {k}={shell_line([v])}" for k, v in sorted(spec.env.items())]
    command = shell_line(argv)
    if spec.api_key_env:
        # The key stays in the environment: the script names the variable, never its value.
        command = command.replace(shell_line([_KEY_PLACEHOLDER]), key_word(spec.api_key_env))
    if isinstance(rec.config, AdaptiveConfig):
        command = command.replace(shell_line([_NEXT_TO_SCRIPT]),
                                  f'"$(dirname "$0")/{Path(adaptive_name(rec.workload)).name}"')
    lines.append(f"exec {command}")
    return "\n".join(lines) + "\n"


def config_file(spec: StudySpec, rec: Recommendation) -> str | None:
    """The launch script's flags as the engine's config file, or None when the study's
    engine version reads none."""
    found = deployment(spec, rec)
    if found.config_file is None or found.config_command is None:
        return None
    # An adaptive server's JSON config is named by its file name: the command runs from the
    # launch folder, where both files are (other configs' from the study's output folder).
    adaptive = isinstance(rec.config, AdaptiveConfig)
    name = Path(config_name(rec)).name if adaptive else config_name(rec)
    lines = [f"# server config ({found.config_note}): "
             f"{shell_line([*found.config_command, name, *found.config_tail])}",
             f"# treetune study '{spec.name}': {rec.workload} workload at batch {rec.batch}, "
             + server(rec)]
    if adaptive:
        lines[1] = (f"# treetune study '{spec.name}': {rec.workload} workload, {rec.config} "
                    f"for every batch size")
        lines.append(f"# run it from this file's folder, where "
                     f"{Path(adaptive_name(rec.workload)).name} is: the adaptive config "
                     "path names it by file name")
    if spec.env:
        lines.append("# environment: " + " ".join(f"{k}={shell_line([v])}"
                                                  for k, v in sorted(spec.env.items())))
    if spec.api_key_env:
        lines.append(f"# the API key is not in this file: add --api-key "
                     f"{key_word(spec.api_key_env)} to the command")
    body = yaml.safe_dump(found.config_file, sort_keys=False, allow_unicode=True)
    return "\n".join(lines) + "\n" + body


def container_args(spec: StudySpec, rec: Recommendation) -> list[str]:
    """The launch script's argv after the program (`python`), for a container spec's args.
    The API key is a Kubernetes `$(VAR)` reference, expanded from the container's env;
    every other `$` is written `$$`, which Kubernetes passes on as one `$` (a `$(VAR)` in a
    path would be expanded, a `$$` halved)."""
    argv = [arg.replace("$", "$$") for arg in launch_argv(spec, rec)[1:]]
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
        return SERVER_PORT_BASE + POOL_PORT_STEP * (self.index - 1)

    @property
    def router_port(self) -> int:
        return self.port + ROUTER_PORT_OFFSET

    @property
    def metrics_port(self) -> int:
        return ROUTER_METRICS_PORT_BASE + self.index


def pools(recs: list[Recommendation], workload: str = MIXED, first: int = 1) -> list[Pool]:
    """One pool per distinct tree of `workload`, ordered by batch size, numbered from
    `first` (so that every pool of POOLS.md has ports of its own)."""
    groups: dict[ServerConfig, list[Recommendation]] = {}
    for rec in sorted((r for r in recs if r.workload == workload), key=lambda r: r.batch):
        groups.setdefault(rec.config, []).append(rec)
    return [Pool(i, config, tuple(r.batch for r in members), members[-1])
            for i, (config, members) in enumerate(groups.items(), start=first)]


def pooled_workloads(spec: StudySpec, recs: list[Recommendation]) -> dict[str, list[Pool]]:
    """The workloads whose batch sizes want different trees (the mixed traffic first, then
    each dataset alone), with their pools, numbered on through the file."""
    out: dict[str, list[Pool]] = {}
    first = 1
    for workload in (MIXED, *spec.dataset_names):
        found = pools(recs, workload, first)
        if len(found) > 1:
            out[workload] = found
            first += len(found)
    return out


def pools_readme(spec: StudySpec, recs: list[Recommendation]) -> str | None:
    """POOLS.md: how to run one pool per tree behind the SGLang router, for the mixed
    traffic and for each dataset served alone whose batch sizes want different trees;
    None when one tree serves every batch size of every workload."""
    workloads = pooled_workloads(spec, recs)
    if not workloads:
        return None
    key = key_word(spec.api_key_env) if spec.api_key_env else None
    worker_host = _reachable(spec.host)
    out = [f"# Server pools for study '{spec.name}'", ""]
    for n, (workload, found) in enumerate(workloads.items()):
        if workload == MIXED:
            out += [f"treetune advice: {pools_advice(recs)}.", ""]
        else:
            trees = ", ".join(f"batch {b}: {p.config}" for p in found for b in p.batches)
            if n == 0:  # the mixed traffic is served by one tree (its launch scripts)
                out += ["The mixed traffic is served by one tree at every batch size; a "
                        "dataset served alone below is not.", ""]
            out += [f"## {workload} alone", "",
                    f"Where {workload}'s traffic is served on its own, its batch sizes want "
                    f"different trees ({trees})."
                    + (" These pools are numbered on from the ones above, so that every "
                       "pool has ports of its own." if n else ""), ""]
        out += _pools_section(spec, found, key, worker_host, first=n == 0,
                              sub="##" if workload == MIXED else "###")
    out += [f"The routers listen on {spec.host}, the study's host, as its servers do"
            + (": only this machine reaches them; to serve others, give the study a "
               "non-loopback `host` (`--host`) and an API key (`api_key_env`)."
               if is_loopback(spec.host) else ".")]
    if key:
        out += ["", f"The API key stays in `{spec.api_key_env}`; the routers pass it to the "
                "workers."]
    return "\n".join(out) + "\n"


def _pools_section(spec: StudySpec, found: list[Pool], key: str | None, worker_host: str,
                   first: bool, sub: str) -> list[str]:
    """One workload's pools: the table, the servers' commands and the routers' (under
    headings of level `sub`); the explanations in the first section only."""
    out = ["| pool | batch sizes | tree | launch script | server port | router port |",
           "|---|---|---|---|---|---|"]
    for p in found:
        out.append(f"| {p.index} | {', '.join(map(str, p.batches))} | {p.config} | "
                   f"`{p.rec.script_name}` | {p.port} | {p.router_port} |")
    if first:
        out += ["", "Every pool loads the same target checkpoint; only the speculative flags "
                "(a no-speculation pool has none, and loads no draft) and the batch sizing "
                "differ. Each needs its own GPU group "
                f"(TP {spec.tp}): on a shared host give each command its own "
                "`CUDA_VISIBLE_DEVICES`."]
    out += ["", f"{sub} Start the servers", ""]
    if first:
        out += ["Each command is its pool's launch script with `--port` changed; run each in "
                "its own terminal or service unit:", ""]
    out.append("```sh")
    out += [f"export {k}={shell_line([v])}" for k, v in sorted(spec.env.items())]
    for p in found:
        command = shell_line(launch_argv(spec, p.rec, port=p.port))
        out += [f"# pool {p.index}: {p.rec.script_name} on port {p.port}",
                command + (f" --api-key {key}" if key else "")]
    out.append("```")
    with_files = [(p, d) for p in found
                  if (d := deployment(spec, p.rec)).config_command is not None]
    if with_files:
        out += ["", "or, with the config files (flags on the command line win over the file):",
                "", "```sh"]
        out += [f"{shell_line([*d.config_command, config_name(p.rec), *d.config_tail])} "
                f"--port {p.port}" + (f" --api-key {key}" if key else "")
                for p, d in with_files]
        out.append("```")
    out += ["", f"{sub} Put the router in front", ""]
    if first:
        out += ["The SGLang router (`pip install sglang-router`) balances requests over the "
                "workers it is given (`--policy` `cache_aware`, the default, `round_robin`, "
                "`random`, `power_of_two`; newer releases add `manual`, sticky per "
                "`X-SMG-Routing-Key` header). No policy looks at how many requests a client "
                "keeps in flight, so one router over both pools would mix the traffic each "
                "tree was chosen for. Run one router per pool, and let each client, or the "
                "proxy in front, pick the endpoint that matches its concurrency:", ""]
    out.append("```sh")
    for p in found:
        router = ["python", "-m", "sglang_router.launch_router",
                  "--worker-urls", f"http://{worker_host}:{p.port}",
                  "--host", spec.host, "--port", str(p.router_port),
                  "--prometheus-port", str(p.metrics_port)]
        out += [f"# pool {p.index}: traffic at batch {', '.join(map(str, p.batches))}",
                shell_line(router) + (f" --api-key {key}" if key else "")]
    out.append("```")
    if first:
        out += ["", "Add replicas to a pool by listing their URLs after its router's "
                "`--worker-urls`. Concurrency between the measured batch sizes was not "
                "measured: send it to the nearer pool, or add the batch size to the study."]
    return [*out, ""]


def _reachable(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def chain_schedule(spec: StudySpec, config: AdaptiveConfig,
                   recs: Sequence[Recommendation] = ()) -> ChainSchedule:
    """The fixed chain schedule an adaptive config amounts to: per slot the best chain
    measured at the batch size it serves (`recs`, the config's recommendations: their
    `chain_steps`), not its longest candidate, which a controller climbs to only for
    traffic that accepts more and a fixed schedule would run for all of it; SGLang's
    default config, a guess, and a slot no measured chain speaks for: the longest
    candidate."""
    graphs = graph_sizes_for(spec.batch, spec.server_flags)
    measured = {} if config.is_sglang_default else {
        config.slot_for(r.batch, graphs).batch: r.chain_steps
        for r in recs if r.config == config and r.chain_steps is not None}
    return ChainSchedule(tuple((slot.batch, measured.get(slot.batch, max(slot.steps)))
                               for slot in config.slots), spec.max_batch)


def adaptive_pools(recs: list[Recommendation]) -> dict[str, list[Recommendation]]:
    """Per workload, the adaptive server's recommendations, one per batch size: the advice,
    or the alternative to it."""
    pools: dict[str, list[Recommendation]] = {}
    for rec in sorted(recs, key=lambda r: r.batch):
        pick = rec if isinstance(rec.config, AdaptiveConfig) else rec.alternative
        if pick is not None:
            pools.setdefault(rec.workload, []).append(pick)
    return pools


def adaptive_readme(spec: StudySpec, recs: list[Recommendation]) -> str | None:
    """ADAPTIVE.md: the adaptive pools (the advice, or the alternative to it) and the files
    next to their scripts; None when no workload has one."""
    pools = adaptive_pools(recs)
    if not pools:
        return None
    advice = adaptive_advice(recs)
    out = [f"# Adaptive steps for study '{spec.name}'", ""]
    if advice:
        out += [f"treetune advice: {advice}.", ""]
    out += ["SGLang's `--speculative-adaptive` serves chains (topk 1) and switches their "
            "length at run time, per batch-size slot, among the slot's candidate steps. "
            "treetune measured the adaptive config below like any tree, on every cell, and "
            "recommends it where it is as fast as the best static tree of each batch size "
            "within the noise; where it is not, it is the alternative: one pool, at the "
            "cost measured below.", ""]
    for workload, group in pools.items():
        rec = group[-1]
        config = rec.config
        assert isinstance(config, AdaptiveConfig)
        advised = any(r.config == config for r in recs if r.workload == workload)
        out += [f"## {workload}: " + ("the advice" if advised else
                                      "an alternative, not the advice"), ""]
        out += [f"- batch {r.batch}: {r.reason}" for r in group]
        out += ["",
                f"- SGLang: `{rec.script_name}` runs `{config}` with "
                f"`{adaptive_name(rec.workload)}` (sized for batch {sized_for(spec, rec)}). "
                f"`{args_name(rec)}` and `{config_name(rec)}` name that JSON by its file "
                "name, which SGLang opens from its working directory: in a container, "
                "mount the launch folder and start the server there.",
                "", "| slot (running batch from) | candidate steps |", "|---|---|"]
        out += [f"| {slot.batch} | {', '.join(map(str, slot.steps))} |" for slot in config.slots]
        schedule = chain_schedule(spec, config, group)
        out += ["", "The same per-batch-size chains as a fixed schedule (each slot's best "
                "chain measured at its batch size; for SGLang's default, its longest "
                "candidate), for engines treetune does not launch: advice, not measured on "
                "those engines.", "",
                f"- vLLM: `{vllm_name(rec.workload)}` is a `--speculative-config` JSON "
                "(`num_speculative_tokens_per_batch_size`).",
                f"- TensorRT-LLM: `{trtllm_name(rec.workload)}` holds `speculative_config` "
                "(`draft_len_schedule`) for the LLM API options file."]
        try:
            _, notes = trtllm_schedule(schedule, spec.algorithm, spec.draft)
        except ValueError as exc:
            notes = [f"not written: {exc}"]
        out += [f"  - {note}" for note in notes]
        if config.is_sglang_default:
            # Its longest candidates are SGLang's guess: 7 steps at batch 1 for vLLM, a
            # chain no study measures (a helper's audit of the adaptive study's outputs).
            out += ["", "This is SGLang's default adaptive config: each slot's longest "
                    "candidate, which these schedules take, is SGLang's guess, not a chain "
                    "this study found best (the chains it measured are in the report); "
                    "measure before using them."]
        out.append("")
    return "\n".join(out)


def objective_line(spec: StudySpec) -> str:
    """What the study optimized, and its SLO: for headers and recommendations.yaml."""
    slo = ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms"
                    for k, v in (("ttft_ms", spec.slo.ttft_ms), ("tpot_ms", spec.slo.tpot_ms))
                    if v is not None)
    return spec.objective.describe() + (f"; SLO {slo}" if slo else "")


def script_groups(recs: list[Recommendation]
                  ) -> list[tuple[Recommendation, list[Recommendation]]]:
    """Per launch script: the recommendation it is written for (an adaptive pool's is the
    largest batch's, which sizes the server) and every recommendation it serves (the
    recommendations' alternatives included)."""
    groups: dict[str, list[Recommendation]] = {}
    alternatives = [r.alternative for r in recs if r.alternative is not None]
    for rec in (*recs, *alternatives):
        groups.setdefault(rec.script_name, []).append(rec)
    return [(max(group, key=lambda r: r.batch), group) for group in groups.values()]


def stale_scripts(spec: StudySpec, recs: list[Recommendation], out_dir: Path) -> list[str]:
    """The launch scripts in `out_dir` whose command is not the one `write_outputs` would
    write for `recs` now: an earlier run's, while a rerun searches (its header's measured
    speedups may differ; its command may not)."""
    stale = []
    for rec, group in script_groups(recs):
        path = out_dir / rec.script_name
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue  # not written yet: the caller says so
        if _command(text) != _command(launch_script(spec, rec, group)) or not _same_slots(
                rec, out_dir):
            stale.append(rec.script_name)
    return stale


def _same_slots(rec: Recommendation, out_dir: Path) -> bool:
    """Whether an adaptive pool's JSON config beside its script (which the script's command
    names, not holds) is the recommended config's; True for a tree."""
    if not isinstance(rec.config, AdaptiveConfig):
        return True
    try:
        written = json.loads((out_dir / adaptive_name(rec.workload)).read_text())
    except (OSError, ValueError):
        return False
    return bool(written == json.loads(json.dumps(rec.config.to_json())))


def _command(script: str) -> str | None:
    return next((line for line in script.splitlines() if line.startswith("exec ")), None)


def write_outputs(spec: StudySpec, recs: list[Recommendation], out_dir: Path,
                  note: str | None = None) -> None:
    """recommendations.yaml/.json, one launch script per recommendation and, next to each
    script, `.args.json` and `.config.yaml` (when the engine version reads config files);
    POOLS.md when batch sizes want different trees; for an adaptive pool (the advice, or
    the alternative to it) one script (for all batch sizes), its JSON config, the vLLM and
    TensorRT-LLM schedules and ADAPTIVE.md.
    Files that no longer apply (a re-run changed the advice) are removed. `note`: for
    another objective than throughput, its picks beside throughput's (`objective_note`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "launch").mkdir(exist_ok=True)
    records = [r.record() for r in recs]
    (out_dir / "recommendations.json").write_text(json.dumps(records, indent=1) + "\n")
    advice = pools_advice(recs)
    adaptive = adaptive_advice(recs)
    dump_yaml({"study": spec.name, "tolerance": spec.tolerance,
               "objective": spec.objective.value, "objective_means": objective_line(spec),
               **({"objective_note": note} if note else {}),
               **({"pools": advice} if advice else {}),
               **({"adaptive": adaptive} if adaptive else {}), "recommendations": records},
              out_dir / "recommendations.yaml")
    for rec, group in script_groups(recs):
        script = out_dir / rec.script_name
        script.unlink(missing_ok=True)  # made afresh: an earlier run's mode is not kept
        script.write_text(launch_script(spec, rec, group))
        # Executable by whoever the umask lets read it: the script holds the study's env.
        script.chmod(script.stat().st_mode | (script.stat().st_mode & 0o444) >> 2)
        (out_dir / args_name(rec)).write_text(json.dumps(container_args(spec, rec), indent=1)
                                              + "\n")
        config = out_dir / config_name(rec)
        text = config_file(spec, rec)
        if text is not None:
            config.write_text(text)
        else:
            config.unlink(missing_ok=True)
    pools = adaptive_pools(recs)
    for workload in {r.workload for r in recs}:
        _write_adaptive(spec, pools.get(workload, []), workload, out_dir)
    for name, text in ((POOLS_FILE, pools_readme(spec, recs)),
                       (ADAPTIVE_FILE, adaptive_readme(spec, recs))):
        if text:
            (out_dir / name).write_text(text)
        else:
            (out_dir / name).unlink(missing_ok=True)


def _write_adaptive(spec: StudySpec, group: list[Recommendation], workload: str,
                    out_dir: Path) -> None:
    """An adaptive pool's files for one workload (`group`: its recommendations, one per
    batch size), or none (removed if an earlier run wrote them)."""
    files: dict[str, object] = dict.fromkeys(
        (adaptive_name(workload), vllm_name(workload), trtllm_name(workload)))
    if group:
        config = group[-1].config
        assert isinstance(config, AdaptiveConfig)
        schedule = chain_schedule(spec, config, group)
        files[adaptive_name(workload)] = config.to_json()
        files[vllm_name(workload)] = vllm_schedule(schedule, spec.algorithm, spec.draft)
        with contextlib.suppress(ValueError):  # ADAPTIVE.md says why
            files[trtllm_name(workload)] = trtllm_schedule(schedule, spec.algorithm,
                                                           spec.draft)[0]
    else:
        script = script_name(workload, 0, ADAPTIVE)
        for name in (script, script.removesuffix(".sh") + ".args.json",
                     script.removesuffix(".sh") + ".config.yaml"):
            (out_dir / name).unlink(missing_ok=True)
    for name, data in files.items():
        if data is None:
            (out_dir / name).unlink(missing_ok=True)
        else:
            (out_dir / name).write_text(json.dumps(data, indent=1) + "\n")
