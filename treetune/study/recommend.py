"""Recommendations: per batch size, the best feasible config for the mixed workload and for
each dataset alone, with the evidence, and ready-to-paste launch scripts."""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.launch import sglang_command, shell_line
from treetune.results import LaunchResult, config_key
from treetune.study.spec import StudySpec
from treetune.study.storage import speedups
from treetune.yamlio import dump_yaml

MIXED = "mixed"


@dataclass(frozen=True)
class Recommendation:
    workload: str  # "mixed" or a dataset name
    batch: int
    config: ServerConfig  # BASELINE: no speculation
    speedups: dict[str, float]  # measured, per dataset of the workload
    reason: str

    @property
    def script_name(self) -> str:
        return f"launch/{self.workload}-batch{self.batch}.sh"

    def record(self) -> dict[str, Any]:
        """The stable JSON record of recommendations.json."""
        tree = self.config if isinstance(self.config, TreeConfig) else None
        return {
            "workload": self.workload,
            "batch": self.batch,
            "steps": tree.steps if tree else None,
            "topk": tree.topk if tree else None,
            "draft_tokens": tree.draft_tokens if tree else None,
            "speedups": {k: round(v, 4) for k, v in self.speedups.items()},
            "launch_script": self.script_name,
            "reason": self.reason,
        }


def recommend(spec: StudySpec, results: list[LaunchResult],
              baseline: LaunchResult) -> list[Recommendation]:
    measured = [r for r in results if r.ok and isinstance(r.config, TreeConfig)]
    floor = 1.0 - spec.tolerance
    out = []
    for batch in sorted(spec.batch):
        table = {r.config: speedups(r, baseline, batch, spec.dataset_names) for r in measured}
        workloads = [(MIXED, spec.dataset_names)] + [(d, [d]) for d in spec.dataset_names]
        for workload, names in workloads:
            feasible = {c: s for c, s in table.items() if all(s[d] >= floor for d in names)}
            if feasible:
                best = max(feasible, key=lambda c: statistics.fmean(feasible[c][d] for d in names))
                per = {d: feasible[best][d] for d in names}
                reason = (f"best mean speedup {statistics.fmean(per.values()):.3f} of "
                          f"{len(feasible)} feasible configs out of {len(table)} measured")
                out.append(Recommendation(workload, batch, best, per, reason))
            else:
                out.append(Recommendation(workload, batch, BASELINE, {d: 1.0 for d in names},
                                          _why_none(table, names, floor, batch)))
    return out


def _why_none(table: dict[ServerConfig, dict[str, float]], names: list[str], floor: float,
              batch: int) -> str:
    if not table:
        return "no speculative config was measured successfully"
    closest = max(table, key=lambda c: min(table[c][d] for d in names))
    worst = min(names, key=lambda d: table[closest][d])
    return (f"no speculation: every measured config is slower than no speculation on some "
            f"dataset at batch {batch} (closest: {closest} at {table[closest][worst]:.3f} on "
            f"{worst}, needs >= {floor:.2f})")


def pools_advice(recs: list[Recommendation]) -> str | None:
    """When batch sizes want different mixed-workload trees, say so as two pools."""
    mixed = {r.batch: r.config for r in recs if r.workload == MIXED}
    if len(set(mixed.values())) <= 1:
        return None
    parts = ", ".join(f"batch {b}: {c}" for b, c in sorted(mixed.items()))
    return (f"batch sizes want different trees ({parts}): run separate server pools with the "
            "same draft head and these launch flags, and route traffic by concurrency")


def write_outputs(spec: StudySpec, recs: list[Recommendation], out_dir: Path) -> None:
    """recommendations.yaml/.json and one launch script per recommendation."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "launch").mkdir(exist_ok=True)
    for rec in recs:
        path = out_dir / rec.script_name
        path.write_text(launch_script(spec, rec))
        path.chmod(0o755)
    records = [r.record() for r in recs]
    (out_dir / "recommendations.json").write_text(json.dumps(records, indent=1) + "\n")
    advice = pools_advice(recs)
    dump_yaml({"study": spec.name, "tolerance": spec.tolerance,
               **({"pools": advice} if advice else {}), "recommendations": records},
              out_dir / "recommendations.yaml")
    from treetune.study.export import write_exports  # export builds on this module

    write_exports(spec, recs, out_dir)


def launch_script(spec: StudySpec, rec: Recommendation) -> str:
    """A POSIX sh script: the study's environment and the full, quoted SGLang command for
    the study's SGLang version, sized for this batch."""
    argv = launch_argv(spec, rec)
    if spec.api_key_env:
        argv += ["--api-key", f"${{{spec.api_key_env}}}"]
    lines = ["#!/bin/sh",
             f"# treetune study '{spec.name}': {rec.workload} workload at batch {rec.batch}",
             f"# tree {rec.config}; measured speedups: "
             + ", ".join(f"{d} {s:.3f}" for d, s in rec.speedups.items()),
             f"# {rec.reason}"]
    lines += [f"export {k}={shell_line([v])}" for k, v in sorted(spec.env.items())]
    command = shell_line(argv)
    if spec.api_key_env:
        # The key stays in the environment: the script names the variable, never its value.
        command = command.replace(shell_line([f"${{{spec.api_key_env}}}"]),
                                  f'"${{{spec.api_key_env}}}"')
    lines.append(f"exec {command}")
    return "\n".join(lines) + "\n"


def launch_argv(spec: StudySpec, rec: Recommendation, port: int | None = None) -> list[str]:
    """The SGLang command of one recommendation, sized for its batch; without --api-key,
    which each output references in its own syntax."""
    base = spec.launch_spec() if port is None else spec.launch_spec(port=port)
    launch = dataclasses.replace(base, max_running_requests=rec.batch, cuda_graph_max_bs=rec.batch)
    return sglang_command(rec.config, launch, python="python")


def summary_rows(recs: list[Recommendation]) -> list[tuple[str, str, str, str]]:
    return [(r.workload, str(r.batch), "no speculation" if r.config is BASELINE
             else config_key(r.config),
             ", ".join(f"{d} {s:.3f}" for d, s in r.speedups.items())) for r in recs]
