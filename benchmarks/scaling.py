"""Scaling: how the wall time of a study falls with the number of workers (GPU groups),
and what that costs in launches, for the model-guided search and TPE.

Each study is `treetune search`'s planner with launches evaluated in-process
(`treetune.study.offline.run_parallel`) on a simulated clock: a launch lasts its server's
load time plus its cells' warm-up and measurement window (`LaunchClock`, drawn with
noise; a launch that fails, fails while loading), every free worker takes the planner's
next launch, and launches finish in simulated-time order (an event queue). The target is
search_efficiency.py's: the mixed-workload recommendation within 1% of the true best
feasible config's mean speedup at every batch size (its code, imported). A study that
never reaches it within `--max-launches` counts as its last finish plus one mean launch,
and `max-launches + 1` launches.

Per strategy and worker count, medians over seeds: simulated wall time (`wall_s`) until
the target, launches finished by then (`launches`) and launches started by then
(`started`: those still running were paid for too). Goals (issue 14): 4 workers reach
the target in <= 0.35x the wall time of 1 worker, 8 workers in <= 0.25x, with no more
than 1.5x the launches of 1 worker.

    .venv/bin/python benchmarks/scaling.py [--workers 1 2 4 8 16] [--strategies model tpe]
        [--worlds qwen3-coder-next-h200] [--seeds 10] [--max-launches 100] [--quick] [--json]
        [--output FILE.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # search_efficiency, beside us

from search_efficiency import (
    check_arguments,
    judge_mixed,
    load_worlds,
    noise_seed,
    output_arguments,
    publish,
    run_pool,
    study_spec,
    truth_table,
    within_target,
)

from treetune.study.offline import LaunchClock, Noise, run_parallel
from treetune.study.planner import Planner
from treetune.worlds import load_world

WORKERS = (1, 2, 4, 8, 16)
GOALS = {4: 0.35, 8: 0.25}  # wall time vs 1 worker
LAUNCH_GOAL = 1.5  # launches vs 1 worker
GOAL_NAMES = {"4": "4 workers <= 0.35x the wall time", "8": "8 workers <= 0.25x",
              "launches": f"launches <= {LAUNCH_GOAL}x"}


@dataclass(frozen=True)
class Job:
    world: str
    strategy: str
    workers: int
    seed: int
    max_launches: int
    noise: float
    batches: tuple[int, ...]
    clock: LaunchClock
    duration_s: float  # each cell's measurement window


def run_job(job: Job) -> dict:
    """One study on `job.workers` simulated workers, until the target or the budget."""
    world = load_world(job.world)
    table, best = truth_table(world, job.batches)
    spec = study_spec(job.world, job.strategy, job.seed, job.max_launches, job.noise,
                      job.batches, job.duration_s)
    reached: dict[str, float] = {}
    last = {"wall_s": 0.0}

    def after(planner: Planner, now: float) -> bool:
        """Ends the study at the target: what happens after it is not measured."""
        last["wall_s"] = now
        if within_target(judge_mixed(spec, planner, table, best)):
            reached.update(wall_s=now, launches=planner.launches,
                           started=planner.launches + len(planner.in_flight))
            return True
        return False

    started = time.monotonic()
    noise = Noise(launch_cv=job.noise, measurement_cv=job.noise)
    planner = run_parallel(spec, world.model(world.profile.tp), noise_seed(world, job.seed),
                           job.max_launches, job.workers, noise, job.clock, after)
    hit = bool(reached)
    if not hit:
        reached.update(wall_s=last["wall_s"] + job.clock.nominal(spec),
                       launches=job.max_launches + 1,
                       started=job.max_launches + 1)
    return {"world": job.world, "strategy": job.strategy, "workers": job.workers,
            "seed": job.seed, "reached": hit,
            "wall_s": reached["wall_s"], "launches": reached["launches"],
            "started": reached["started"],
            "distinct_configs": len({r.config for r in planner.launched}),
            "seconds": time.monotonic() - started}


def summarize(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """Medians per strategy and worker count (keys as strings, for JSON), with the ratios
    to one worker's medians."""
    out: dict[str, dict[str, dict]] = {}
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        per: dict[str, dict] = {}
        for workers in sorted({r["workers"] for r in rows if r["strategy"] == strategy}):
            mine = [r for r in rows if r["strategy"] == strategy and r["workers"] == workers]
            per[str(workers)] = {
                "wall_s": round(statistics.median(r["wall_s"] for r in mine), 1),
                "launches": statistics.median(r["launches"] for r in mine),
                "started": statistics.median(r["started"] for r in mine),
                "reached": sum(r["reached"] for r in mine), "studies": len(mine),
            }
        one = per.get("1")
        for entry in per.values():
            if one:
                entry["wall_ratio"] = round(entry["wall_s"] / one["wall_s"], 3)
                entry["launch_ratio"] = round(entry["launches"] / one["launches"], 3)
        out[strategy] = per
    return out


def goals_met(per: dict[str, dict]) -> dict[str, bool]:
    """Each goal of issue 14 for one strategy: "4" and "8" (wall-time ratio) and
    "launches" (every worker count of the goals within LAUNCH_GOAL of one worker's)."""
    out = {}
    for workers, limit in GOALS.items():
        entry = per.get(str(workers))
        if entry and "wall_ratio" in entry:
            out[str(workers)] = entry["wall_ratio"] <= limit
    ratios = [per[str(w)]["launch_ratio"] for w in GOALS if "launch_ratio" in per.get(str(w), {})]
    if ratios:
        out["launches"] = max(ratios) <= LAUNCH_GOAL
    return out


def markdown(summary: dict[str, dict[str, dict]], args: argparse.Namespace) -> str:
    clock = args.clock
    lines = [f"# Scaling ({', '.join(args.worlds)}; {args.seeds} seeds; launch = load "
             f"{clock.load_s:g} s (cv {clock.load_cv:.0%}) + {args.cells} cells x "
             f"({args.duration:g} s + warm-up ~{clock.warmup_s:g} s); up to "
             f"{args.max_launches} launches; noise {args.noise:.0%})", "",
             "| strategy | workers | wall time to target (median) | vs 1 worker | launches "
             "(median) | vs 1 worker | started | reached |",
             "|---|---|---|---|---|---|---|---|"]
    for strategy, per in summary.items():
        for workers, e in per.items():
            lines.append(
                f"| {strategy} | {workers} | {e['wall_s'] / 3600:.2f} h | "
                f"{e.get('wall_ratio', float('nan')):.2f}x | {e['launches']:g} | "
                f"{e.get('launch_ratio', float('nan')):.2f}x | {e['started']:g} | "
                f"{e['reached']}/{e['studies']} |")
    lines.append("")
    for strategy, per in summary.items():
        met = goals_met(per)
        said = ", ".join(f"{GOAL_NAMES[k]}: {'met' if v else 'missed'}" for k, v in met.items())
        lines.append(f"- {strategy}: {said or 'no goal measured (needs 1, 4 and 8 workers)'}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--workers", nargs="+", type=int, default=list(WORKERS))
    parser.add_argument("--strategies", nargs="+", default=["model", "tpe"])
    parser.add_argument("--worlds", nargs="+", default=["qwen3-coder-next-h200"],
                        help="shipped world or profile names, or files (default: the demo's "
                        "published Qwen3-Coder-Next profile, 4 datasets)")
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--seeds", type=int, default=None,
                        help="studies per strategy and worker count (default 10; 3 with "
                        "--quick)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--max-launches", type=int, default=None,
                        help="launches a study may use to reach the target (TPE needs "
                        "dozens at one worker; default 100, 60 with --quick)")
    parser.add_argument("--noise", type=float, default=0.03,
                        help="launch and measurement noise (coefficient of variation)")
    parser.add_argument("--load-s", type=float, default=300.0, help="mean server load time")
    parser.add_argument("--duration", type=float, default=60.0,
                        help="each cell's measurement window, seconds")
    parser.add_argument("--quick", action="store_true",
                        help="3 seeds, up to 60 launches: under 3 minutes on 2 quiet cores")
    output_arguments(parser)
    args = parser.parse_args()
    check_arguments(parser, args, quick={"seeds": 3, "max_launches": 60},
                    defaults={"seeds": 10, "max_launches": 100})
    if any(w < 1 for w in args.workers):
        parser.error("--workers must be >= 1")
    batches = tuple(sorted(set(args.batch)))
    args.clock = LaunchClock(load_s=args.load_s)
    jobs = [Job(world, strategy, workers, seed, args.max_launches, args.noise, batches,
                args.clock, args.duration)
            for world in args.worlds for strategy in args.strategies
            for workers in sorted(set(args.workers))
            for seed in range(args.first_seed, args.first_seed + args.seeds)]
    worlds = load_worlds(parser, args.worlds)  # a bad name is a usage error, before any study
    args.cells = len(batches) * len(next(iter(worlds.values())).profile.datasets)
    started = time.monotonic()
    rows, failed = run_pool(run_job, jobs, args.processes, lambda row: (
        f"{row['strategy']} x{row['workers']} seed {row['seed']}: target at "
        f"{row['wall_s'] / 3600:.2f} h, {row['launches']} launches"))
    summary = summarize(rows)
    publish(markdown(summary, args), summary, args, len(jobs), started, failed)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
