"""Search efficiency: how many launches each strategy needs to find the best tree, and how
often it would ship a regression, over many seeded studies on several profiles.

Each study is `treetune search`'s planner, strategies, re-measurement and recommendations
with launches evaluated in-process (`treetune.study.offline`): every launch is drawn from
the profile (the truth) with launch and measurement noise. The default space, batch sizes 1
and 32, the profile's datasets (four on the shipped profiles), tolerance 0.

Per strategy:
- launches until the mixed-workload recommendation is within 1% of the true best feasible
  config's mean speedup at every batch size (baseline launch included; a study that never
  gets there counts as max_launches + 1): median and 90th percentile;
- the same, counted until it stays within 1% to the end (`*_stable`);
- regret at the fixed budget: 1 - (true mean speedup of the recommendation / the best's),
  the worse batch size, averaged over studies;
- false-feasible rate: recommendations (after every launch, every batch size) whose
  noise-free speedup is below 1 - tolerance on some dataset.

    .venv/bin/python benchmarks/search_efficiency.py [--seeds 20] [--quick] [--json]
        [--profile FILE ...] [--strategies model tpe grid random] [--output FILE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from treetune.config import TreeConfig
from treetune.perfmodel import PerfModel, check_memory, load_profile
from treetune.space import load_space
from treetune.strategies.model import predicted_speedups
from treetune.study.offline import Noise, run_offline
from treetune.study.planner import Planner
from treetune.study.recommend import MIXED, recommend
from treetune.study.spec import load_study

SHIPPED = ("qwen3-coder-next-h200", "qwen3-8b-h100", "qwen3-30b-a3b-h100")
STRATEGIES = ("model", "tpe", "grid", "random")
BATCHES = (1, 32)
TARGET = 0.99  # within 1% of the true best


@dataclass(frozen=True)
class Job:
    profile: str
    strategy: str
    seed: int
    max_launches: int
    budget: int
    noise: float


def truth_table(profile_name: str) -> tuple[dict, dict[int, float]]:
    """Noise-free speedups of every startable config of the default space, and the best
    feasible mean speedup per batch size."""
    profile = load_profile(profile_name)
    datasets = list(profile.datasets)
    configs = [c for c in load_space("default").configs() if isinstance(c, TreeConfig)
               and check_memory(profile, c, max(BATCHES), tp=profile.tp).fits]
    table = predicted_speedups(profile, configs, list(BATCHES), datasets, profile.tp)
    best = {b: max(statistics.fmean(v[b]) for v in table.values() if min(v[b]) >= 1.0)
            for b in BATCHES}
    return table, best


def run_job(job: Job) -> dict:
    profile = load_profile(job.profile)
    table, best = truth_table(job.profile)
    spec = load_study(None, {
        "name": "efficiency", "model": profile.target.name, "draft": profile.draft.name,
        "tp": profile.tp, "datasets": list(profile.datasets), "batch": list(BATCHES),
        "space": "default", "budget": {"launches": job.max_launches}, "seed": job.seed,
        "backend": {"kind": "emulator", "profile": job.profile},
        "search": {"strategy": job.strategy, "launch_cv": job.noise},
    })
    truth = PerfModel(profile, profile.tp)
    within: list[bool] = []
    regret_at_budget: float | None = None
    recommended = false_feasible = 0

    def after(planner: Planner) -> None:
        nonlocal regret_at_budget, recommended, false_feasible
        if planner.baseline is None:
            within.append(False)
            return
        recs = recommend(spec, list(planner.results.values()), planner.baseline,
                         planner.estimates())
        ratios = []
        for rec in recs:
            if rec.workload != MIXED:
                continue
            true = table.get(rec.config)
            mean = statistics.fmean(true[rec.batch]) if true else 1.0  # no speculation: 1
            ratios.append(mean / best[rec.batch])
            if true is not None:
                recommended += 1
                false_feasible += min(true[rec.batch]) < 1.0 - spec.tolerance
        within.append(min(ratios) >= TARGET)
        if planner.launches == job.budget:
            regret_at_budget = 1.0 - min(ratios)

    started = time.monotonic()
    noise = Noise(launch_cv=job.noise, measurement_cv=job.noise)
    planner = run_offline(spec, truth, job.seed, job.max_launches, noise, after)
    first = next((i + 1 for i, ok in enumerate(within) if ok), job.max_launches + 1)
    stable = next((i + 1 for i in range(len(within)) if all(within[i:])), job.max_launches + 1)
    return {"profile": job.profile, "strategy": job.strategy, "seed": job.seed,
            "launches_to_target": first, "launches_to_stable_target": stable,
            "regret_at_budget": regret_at_budget if regret_at_budget is not None else 1.0,
            "recommended": recommended, "false_feasible": false_feasible,
            "launches": planner.launches, "seconds": time.monotonic() - started}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q, method="higher"))


def summarize(rows: list[dict], strategies: list[str]) -> dict[str, dict]:
    out = {}
    for strategy in strategies:
        mine = [r for r in rows if r["strategy"] == strategy]
        if not mine:
            continue
        launches = [r["launches_to_target"] for r in mine]
        stable = [r["launches_to_stable_target"] for r in mine]
        recommended = sum(r["recommended"] for r in mine)
        out[strategy] = {
            "median_launches": statistics.median(launches),
            "p90_launches": percentile(launches, 90),
            "median_launches_stable": statistics.median(stable),
            "p90_launches_stable": percentile(stable, 90),
            "regret_at_budget": round(statistics.fmean(r["regret_at_budget"] for r in mine), 4),
            "false_feasible_rate": round(sum(r["false_feasible"] for r in mine)
                                         / max(recommended, 1), 4),
            "studies": len(mine),
            "reached_target": sum(r["launches_to_target"] <= r["launches"] for r in mine),
            "seconds": round(sum(r["seconds"] for r in mine), 1),
        }
    return out


def markdown(summary: dict[str, dict], args: argparse.Namespace, profiles: list[str]) -> str:
    lines = [f"# Search efficiency ({len(profiles)} profiles x {args.seeds} seeds, noise "
             f"{args.noise:.0%}, budget {args.budget}, up to {args.max_launches} launches)",
             "", f"Profiles: {', '.join(profiles)}. Default space, batch sizes 1 and 32.", "",
             "| strategy | median launches | p90 launches | median (stable) | p90 (stable) "
             "| regret at budget | false-feasible rate | reached |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['median_launches']:g} | {s['p90_launches']:g} | "
                     f"{s['median_launches_stable']:g} | {s['p90_launches_stable']:g} | "
                     f"{s['regret_at_budget']:.2%} | {s['false_feasible_rate']:.2%} | "
                     f"{s['reached_target']}/{s['studies']} |")
    if "model" in summary and "tpe" in summary:
        ratio = summary["tpe"]["median_launches"] / summary["model"]["median_launches"]
        lines += ["", f"TPE needs {ratio:.1f}x the launches of the model-guided search "
                  "(medians; a study that never reaches the target counts as "
                  f"{args.max_launches + 1})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--budget", type=int, default=20, help="launches for the regret")
    parser.add_argument("--max-launches", type=int, default=30,
                        help="launches each study may use to reach the target")
    parser.add_argument("--noise", type=float, default=0.03,
                        help="launch and measurement noise (coefficient of variation)")
    parser.add_argument("--profile", action="append", default=[],
                        help="an extra profile (name or YAML file); repeatable")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES),
                        choices=STRATEGIES)
    parser.add_argument("--quick", action="store_true",
                        help="3 seeds, up to 20 launches: a smoke run in under 3 minutes")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--output", type=Path, default=None, help="write the markdown here")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.max_launches, args.budget = 3, 20, 15
    profiles = [*SHIPPED, *args.profile]
    for name in profiles:
        load_profile(name)  # a bad --profile fails here, not in a worker
    jobs = [Job(p, s, seed, args.max_launches, args.budget, args.noise)
            for p in profiles for s in args.strategies for seed in range(args.seeds)]
    started = time.monotonic()
    rows = []
    with ProcessPoolExecutor(max_workers=args.processes) as pool:
        for done, row in enumerate(pool.map(run_job, jobs, chunksize=1), start=1):
            rows.append(row)
            print(f"  {done}/{len(jobs)} {row['profile']} {row['strategy']} seed "
                  f"{row['seed']}: target at {row['launches_to_target']} launches",
                  file=sys.stderr, flush=True)
    summary = summarize(rows, args.strategies)
    text = markdown(summary, args, profiles)
    text += f"\n{len(jobs)} studies in {time.monotonic() - started:.0f} s.\n"
    if args.output:
        args.output.write_text(text)
    if args.json:
        print(text, file=sys.stderr)  # the table still shows; stdout is the JSON alone
        print(json.dumps(summary))
    else:
        print(text)


if __name__ == "__main__":
    main()
