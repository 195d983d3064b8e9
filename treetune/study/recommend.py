"""Recommendations: per batch size, the best feasible config for the mixed workload and for
each dataset alone, with the evidence, and ready-to-paste launch scripts."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.launch import sglang_command, shell_line
from treetune.results import LaunchResult, config_key
from treetune.study.evidence import Z_LOWER, Interval, intervals, merge_all
from treetune.study.spec import StudySpec
from treetune.yamlio import dump_yaml

Estimates = dict[tuple[Any, int, str], tuple[float, float]]  # see study.guided

MIXED = "mixed"


@dataclass(frozen=True)
class Recommendation:
    workload: str  # "mixed" or a dataset name
    batch: int
    config: ServerConfig  # BASELINE: no speculation
    speedups: dict[str, float]  # measured, per dataset of the workload
    reason: str
    intervals: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)

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
            "intervals": {k: [round(lo, 4), round(hi, 4)]
                          for k, (lo, hi) in self.intervals.items()},
            "launch_script": self.script_name,
            "reason": self.reason,
        }

    def speedup_labels(self) -> list[str]:
        """'dataset 1.234 [1.201, 1.268]' per dataset."""
        return [f"{d} {s:.3f}" + (f" [{self.intervals[d][0]:.3f}, {self.intervals[d][1]:.3f}]"
                                  if d in self.intervals else "")
                for d, s in self.speedups.items()]


def recommend(spec: StudySpec, results: list[LaunchResult], baseline: LaunchResult,
              estimates: Estimates | None = None) -> list[Recommendation]:
    """Per batch size and workload, the measured config with the best mean speedup among
    those surely feasible: every dataset's interval lower bound at or above
    1 - tolerance. Several launches of one config are merged first.

    With model `estimates` (the model search's fitted model, which pools every launch),
    the ranking blends each measured speedup with the model's estimate, weighted by their
    variances; feasibility always comes from the measurements alone."""
    merged = merge_all(results)
    baseline = merged.get("baseline", baseline)
    measured = [r for r in merged.values() if r.ok and isinstance(r.config, TreeConfig)]
    floor = 1.0 - spec.tolerance
    out = []
    for batch in sorted(spec.batch):
        table = {r.config: intervals(r, baseline, batch, spec.dataset_names,
                                     spec.search.launch_cv) for r in measured}
        workloads = [(MIXED, spec.dataset_names)] + [(d, [d]) for d in spec.dataset_names]
        for workload, names in workloads:
            feasible = {c: ivs for c, ivs in table.items()
                        if all(ivs[d].low >= floor for d in names)}

            def rank(config: ServerConfig, names: list[str] = names, batch: int = batch,
                     ivs: dict[ServerConfig, dict[str, Interval]] = table) -> float:
                return statistics.fmean(_blend(ivs[config][d], estimates, config, batch, d)
                                        for d in names)

            if feasible:
                best = max(feasible, key=rank)
                per = {d: feasible[best][d].mean for d in names}
                unsure = sum(1 for ivs in table.values()
                             if all(ivs[d].mean >= floor for d in names)) - len(feasible)
                reason = (f"best mean speedup {statistics.fmean(per.values()):.3f} of "
                          f"{len(feasible)} surely feasible configs out of {len(table)} "
                          "measured" + (f" ({unsure} more were not slower on average but "
                                        "their interval reaches below the floor)"
                                        if unsure else ""))
                out.append(Recommendation(
                    workload, batch, best, per, reason,
                    {d: (feasible[best][d].low, feasible[best][d].high) for d in names}))
            else:
                out.append(Recommendation(workload, batch, BASELINE, {d: 1.0 for d in names},
                                          _why_none(table, names, floor, batch)))
    return out


def _blend(measured: Interval, estimates: Estimates | None, config: ServerConfig,
           batch: int, dataset: str) -> float:
    """The measured speedup, or its inverse-variance blend with the model's estimate."""
    model = estimates.get((config, batch, dataset)) if estimates else None
    if model is None or measured.mean <= 0 or measured.high <= measured.low:
        return measured.mean
    sd = (math.log(measured.high) - math.log(measured.low)) / (2 * Z_LOWER)
    weight_m, weight_p = 1 / sd ** 2, 1 / model[1]
    return math.exp((weight_m * math.log(measured.mean) + weight_p * model[0])
                    / (weight_m + weight_p))


def _why_none(table: dict[ServerConfig, dict[str, Interval]], names: list[str], floor: float,
              batch: int) -> str:
    if not table:
        return "no speculative config was measured successfully"
    closest = max(table, key=lambda c: min(table[c][d].low for d in names))
    worst = min(names, key=lambda d: table[closest][d].low)
    iv = table[closest][worst]
    return (f"no speculation: no measured config is surely as fast as no speculation on "
            f"every dataset at batch {batch} (closest: {closest} at {iv.label()} on "
            f"{worst}, needs a lower bound >= {floor:.2f})")


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
             f"# tree {rec.config}; measured speedups [interval]: "
             + ", ".join(rec.speedup_labels()),
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
             ", ".join(r.speedup_labels())) for r in recs]
