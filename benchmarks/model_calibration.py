"""Model calibration: is the model search's fitted model as sure of its estimates as it
should be?

The ranking blends each measured speedup with the model's estimate by their variances, and
every proposal draws from the model's posterior, so a model surer than its errors lets a
wrong fit outvote right measurements and explore too little. This runs the seeded studies
of `search_efficiency.py` (the model strategy, a world's truth in-process, 3% launch and
measurement noise by default) and, after every launch from the fourth, asks the search's
model for its estimates (log speedup and variance: what the ranking and the confirmations
use) of the best trees by the truth, per batch size, measured or not, and scores each
estimate against the truth: z = (estimate - log true speedup) / its standard deviation.

Per world, in windows of launches: the mean of z squared over (tree, batch size, dataset)
estimates, for trees measured by then and for the others; honest estimates give about 1,
a model twice as sure as it should be about 4. Beside it, the fit's accept-length misfit
(`accept_misfit`: the mean squared log error of its accept lengths in units of their 1%
noise; about 1 when the fit explains them).

    .venv/bin/python benchmarks/model_calibration.py [--worlds all | NAME_OR_FILE ...] [--seeds 6]
        [--max-launches 12] [--top 30] [--noise 0.03] [--json] [--output FILE.md]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass

from search_efficiency import (
    check_arguments,
    load_worlds,
    noise_seed,
    output_arguments,
    publish,
    run_pool,
    study_spec,
    truth_table,
)

from treetune.strategies.model import ModelStrategy, accept_misfit
from treetune.study.offline import Noise, run_offline
from treetune.study.planner import Planner
from treetune.worlds import load_world

WINDOWS = ((4, 6), (7, 9), (10, 12), (13, 30))


@dataclass(frozen=True)
class Job:
    world: str
    seed: int
    max_launches: int
    top: int
    noise: float
    batches: tuple[int, ...] = (1, 32)


def run_job(job: Job) -> dict:
    """One study: per launch from the fourth, z squared of every estimate of the `top`
    trees per batch size (measured ones apart), and the fit's accept-length misfit."""
    world = load_world(job.world)
    table, _ = truth_table(world, job.batches)
    spec = study_spec(job.world, "model", job.seed, job.max_launches, job.noise, job.batches)
    datasets = spec.dataset_names
    best = {b: sorted(table, key=lambda c, b=b: -statistics.fmean(table[c][b]))[:job.top]
            for b in job.batches}
    trees = list(dict.fromkeys(c for b in job.batches for c in best[b]))
    launches: list[dict] = []

    def after(planner: Planner) -> None:
        strategy = planner.strategy
        if planner.launches < WINDOWS[0][0] or not isinstance(strategy, ModelStrategy):
            return
        estimates = strategy.estimates(trees) or {}
        measured = {r.config for r in planner.results.values() if r.ok}
        z2: dict[bool, list[float]] = {True: [], False: []}
        for batch in job.batches:
            for config in best[batch]:
                for i, dataset in enumerate(datasets):
                    e = estimates.get((config, batch, dataset))
                    if e and e.variance > 0:  # none, or one the model claims to know exactly
                        z = (e.log_mean - math.log(table[config][batch][i])) / math.sqrt(
                            e.variance)
                        z2[config in measured].append(z * z)
        fit = strategy.fit.result
        launches.append({"launch": planner.launches, "measured": z2[True],
                         "unmeasured": z2[False],
                         "accept_misfit": accept_misfit(fit) if fit else None})

    noise = Noise(launch_cv=job.noise, measurement_cv=job.noise)
    run_offline(spec, world.model(world.profile.tp), noise_seed(world, job.seed), job.max_launches,
                noise, after)
    return {"world": job.world, "seed": job.seed, "launches": launches}


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per window of launches: mean z squared (measured, unmeasured) and mean misfit."""
    out = {}
    for low, high in WINDOWS:
        steps = [s for r in rows for s in r["launches"] if low <= s["launch"] <= high]
        if not steps:
            continue
        measured = [z for s in steps for z in s["measured"]]
        unmeasured = [z for s in steps for z in s["unmeasured"]]
        misfit = [s["accept_misfit"] for s in steps if s["accept_misfit"] is not None]
        out[f"{low}-{high}"] = {
            "z2_measured": statistics.fmean(measured) if measured else None,
            "z2_unmeasured": statistics.fmean(unmeasured) if unmeasured else None,
            "accept_misfit": statistics.fmean(misfit) if misfit else None}
    return out


def markdown(per_world: dict[str, dict], args: argparse.Namespace) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [f"# Model calibration ({len(per_world)} worlds x {args.seeds} seeds, noise "
             f"{args.noise:.0%}, the {args.top} best trees per batch size by the truth)", "",
             "Mean z squared of the model's estimates (about 1: honest; above: surer than "
             "its errors), and the fit's accept-length misfit (about 1: explained to their "
             "noise).", "",
             "| world | launches | z² measured | z² unmeasured | accept misfit |",
             "|---|---|---|---|---|"]
    for world, windows in per_world.items():
        for window, row in windows.items():
            lines.append(f"| {world} | {window} | {cell(row['z2_measured'])} | "
                         f"{cell(row['z2_unmeasured'])} | {cell(row['accept_misfit'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--worlds", nargs="+",
                        default=["qwen3-30b-a3b-h100", "qwen3-8b-h100", "qwen3-coder-next-h200"],
                        help="shipped world or profile names, or world/profile files; 'all': "
                        "every shipped profile and world (default: the three own-model "
                        "profiles the search reaches its target on)")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--max-launches", type=int, default=12)
    parser.add_argument("--top", type=int, default=30,
                        help="trees per batch size scored, the best by the truth")
    parser.add_argument("--noise", type=float, default=0.03,
                        help="launch and measurement noise (coefficient of variation)")
    output_arguments(parser)
    args = parser.parse_args()
    check_arguments(parser, args)
    names = list(load_worlds(parser, args.worlds))
    jobs = [Job(w, seed, args.max_launches, args.top, args.noise)
            for w in names for seed in range(args.seeds)]
    started = time.monotonic()
    rows, failed = run_pool(run_job, jobs, args.processes,
                            lambda r: f"{r['world']} seed {r['seed']}")
    per_world = {w: summarize([r for r in rows if r["world"] == w]) for w in names}
    publish(markdown(per_world, args), {"worlds": per_world}, args, len(jobs), started, failed)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
