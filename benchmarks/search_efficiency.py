"""Search efficiency: how many launches each strategy needs to find the best tree, how often
it would ship a regression, and whether its intervals are honest, over many seeded studies
in several worlds, including worlds the search's model cannot express.

Each study is `treetune search`'s planner, strategies, re-measurement and recommendations
with launches evaluated in-process (`treetune.study.offline`): every launch is drawn from a
world's truth (`treetune.worlds`) with launch and measurement noise. The search sees only
what a server shows and, as its prior, the world's facts. The default space, the world's
datasets (four on the shipped ones), tolerance 0.

Per world and strategy:
- launches until the mixed-workload recommendation is within 1% of the true best feasible
  config's mean speedup at every batch size ("no speculation", 1.0, where nothing is
  feasible; baseline launch included; a study that never gets there counts as
  max_launches + 1): median and 90th percentile;
- the same, counted until it stays within 1% to the end (`*_stable`);
- where the misses are: of the studies that never reach the target, how many never
  launched a target tree (within 1% of the best, truly feasible) at some batch size
  (`unreached_unlaunched`: the search did not find it), the others having launched one
  at every batch size but never recommended target trees at all of them at once (the
  proof or the ranking missed them);
- regret at the fixed budget: 1 - (true mean speedup of the recommendation / the best's),
  the worse batch size, averaged over studies (a truly infeasible recommendation: 1; a
  study that ends before the budget: its last recommendation);
- false-feasible rate: recommendations (after every launch, every batch size) whose
  noise-free speedup is below 1 - tolerance on some dataset, over all recommended trees;
- coverage: the share of the final speedup intervals (every measured tree, batch size and
  dataset) that hold the true speedup; they are meant as about 95% intervals. With it, a
  90% bootstrap interval over the studies (a study's intervals share its baseline's error,
  so a dozen studies pin the coverage down to a few points, not to a tenth).

    .venv/bin/python benchmarks/search_efficiency.py [--worlds all | NAME_OR_FILE ...]
        [--batch 1 32] [--seeds 20] [--first-seed 0] [--noise 0.03] [--prior-noise CV]
        [--workers 1] [--node-speeds SPEED ...] [--quick] [--json] [--output FILE.md]
        [--strategies model tpe grid random gp oracle model-oracle]  (gp: with treetune[gp]
        installed; oracle: a reference that reads the truth, the floor under every strategy;
        model-oracle: one that reads the truth's profile but not the world's effects)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from treetune import strategies
from treetune.backends.sglang import profile_method
from treetune.cli import writable
from treetune.config import BASELINE, TreeConfig
from treetune.datasets import builtin_names
from treetune.errors import TreetuneError
from treetune.perfmodel import RunningCaps, shipped_profiles
from treetune.space import load_space
from treetune.strategies import gp
from treetune.strategies._base import register
from treetune.strategies.grid import GridStrategy
from treetune.study.evidence import intervals
from treetune.study.offline import Noise, run_parallel
from treetune.study.planner import Planner
from treetune.study.recommend import MIXED, recommend
from treetune.study.spec import StudySpec, load_study
from treetune.worlds import World, load_world, shipped_worlds

# gp (Optuna's GPSampler) runs where PyTorch is installed (`pip install -e '.[gp]'`).
STRATEGIES = ("model", "tpe", "grid", "random", *(("gp",) if gp.torch_installed() else ()))
TARGET = 0.99  # within 1% of the true best
ORACLE = "oracle"
MODEL_ORACLE = "model-oracle"
# References, not searches: what each reads of the world to order its trees.
ORACLES = {ORACLE: "the world's truth",
           MODEL_ORACLE: "the truth's profile without the world's effects"}


class Oracle(GridStrategy):
    """A reference, not a search: proposes the truly best feasible trees first, taking the
    batch sizes in turn, while the planner re-measures and recommends as it does for any
    strategy. Its launches to the target are what noise and the no-regression proof alone
    cost: the floor under every strategy's count. `trees` is set for each study (see
    `oracle_known`)."""

    trees: ClassVar[list[TreeConfig]] = []

    def order(self) -> list[TreeConfig]:
        return self.trees


def truly_feasible(speedups: Sequence[float], tolerance: float = 0.0) -> bool:
    """No dataset's noise-free speedup below 1 - tolerance."""
    return min(speedups) >= 1.0 - tolerance


def oracle_order(table: dict[TreeConfig, dict[int, list[float]]]) -> list[TreeConfig]:
    """Every tree, the batch sizes in turn, each batch size's feasible trees best first
    (those feasible nowhere last)."""
    ranked = [sorted((c for c, v in table.items() if truly_feasible(v[b])),
                     key=lambda c, b=b: -statistics.fmean(table[c][b]))
              for b in sorted(next(iter(table.values())))]
    turns = (c for turn in itertools.zip_longest(*ranked) for c in turn if c is not None)
    return list(dict.fromkeys([*turns, *table]))


@dataclass(frozen=True)
class Job:
    world: str
    strategy: str
    seed: int
    max_launches: int
    budget: int
    noise: float
    batches: tuple[int, ...]
    prior_noise: float | None = None  # the study's stated launch_cv (None: the true noise)
    workers: int = 1  # launches running at once (simulated time, `run_parallel`)
    nodes: tuple[float, ...] = ()  # each node's speed; worker w runs on node w % len(nodes)
    drift: float = 0.0  # launch k runs at 1 + drift x k (`run_parallel`)
    method: str = "EAGLE3"  # the study's draft method (SGLang's algorithm)


def noise_seed(world: World, seed: int) -> int:
    """The seed of the noise a study of `world` draws (launch factors, slow launches,
    sub-windows): the study's `seed` and the world's name, so that every strategy of a
    world and seed draws from one stream (launch by launch while their launches draw
    alike: a baseline draws no accept lengths) but no two worlds do. With `seed` alone, every
    world's study of that seed drew one stream: the same launches were slow in every
    slow-launch world, the same launch factors fell on every world's baseline, and the
    coverage of two dozen studies moved by five points with one launch more or less
    (benchmarks/RESULTS.md, stop 83)."""
    digest = hashlib.sha256(f"{world.name}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def truth_table(world: World, batches: tuple[int, ...], method: str = "EAGLE3"
                ) -> tuple[dict[TreeConfig, dict[int, list[float]]], dict[int, float]]:
    """Noise-free speedups of every startable tree of the default space, per batch size and
    dataset, and the best feasible mean per batch size (1.0, no speculation, if none), for
    draft `method`."""
    model = world.model(world.profile.tp, profile_method(method))
    datasets = list(world.profile.datasets)
    # A server whose KV pool holds fewer than the largest batch runs that many at once.
    caps = RunningCaps(world.profile, max(batches), world.profile.tp, profile_method(method))
    trees = [c for c in load_space("default").configs() if caps.starts(c)]
    base = {(b, d): model.throughput(BASELINE, caps.batch(BASELINE, b), d)
            for b in batches for d in datasets}
    table = {c: {b: [model.throughput(c, caps.batch(c, b), d) / base[b, d] for d in datasets]
                 for b in batches} for c in trees}
    best = {b: max((statistics.fmean(v[b]) for v in table.values() if truly_feasible(v[b])),
                   default=1.0) for b in batches}
    return table, best


def study_spec(world_name: str, strategy: str, seed: int, max_launches: int, noise: float,
               batches: tuple[int, ...], duration_s: float | None = None,
               prior: str | None = None, method: str = "EAGLE3") -> StudySpec:
    """The benchmark's study of a world: its datasets, the default space, tolerance 0, the
    world's facts as the emulator's (the search's prior, unless a `prior` profile is
    given), `noise` as the launch noise it states (`search.launch_cv`, the prior its
    learned noise starts from); `duration_s`, each cell's measurement window (the study's
    default when None); `method`, the draft method it searches (NEXTN: no draft model)."""
    world = load_world(world_name)
    source = {"profile": world_name} if world.own_model else {"world": world_name}
    # A profile of servers whose attention runs in groups is the search's own model only
    # when the study's servers say so (a world's groups are hidden from its prior).
    groups = world.profile.server.attention_dp if world.own_model else 1
    flags = {"--enable-dp-attention": None, "--dp-size": str(groups)} if groups > 1 else {}
    builtins = builtin_names()
    drafter = world.profile.method(profile_method(method)).draft
    return load_study(None, {
        "name": "efficiency", "model": world.profile.target.name, "algorithm": method,
        "draft": drafter.name if drafter is not None else None, "tp": world.profile.tp,
        "datasets": [name if name in builtins else {"name": name, "path": f"{name}.jsonl"}
                     for name in world.profile.datasets],  # in-process: no prompt is read
        "batch": list(batches),
        "space": "default", "budget": {"launches": max_launches}, "seed": seed,
        "backend": {"kind": "emulator", **source}, "server_flags": flags,
        "search": {"strategy": strategy, "launch_cv": noise,
                   **({"prior": prior} if prior is not None else {})},
        **({"measurement": {"duration_s": duration_s}} if duration_s is not None else {}),
    })


def judge_mixed(spec: StudySpec, planner: Planner, table: dict[TreeConfig, dict[int, list[float]]],
                best: dict[int, float]) -> list[tuple[list[float] | None, int, float]]:
    """The mixed-workload recommendation at every batch size, against the truth: its true
    speedups per dataset (None: no speculation), its batch size, and its true mean speedup
    over the best feasible one's (the target is every ratio >= TARGET)."""
    if planner.baseline is None:
        return []
    out = []
    for rec in recommend(spec, list(planner.results.values()), planner.baseline,
                         planner.estimates()):
        if rec.workload != MIXED:
            continue
        true = table.get(rec.config) if isinstance(rec.config, TreeConfig) else None
        mean = statistics.fmean(true[rec.batch]) if true else 1.0  # no speculation: 1
        out.append((true, rec.batch, mean / best[rec.batch]))
    return out


def ships_a_regression(judged: list[tuple[list[float] | None, int, float]]) -> bool:
    """Some batch size's recommendation is a tree truly slower than no speculation on a
    dataset (no speculation itself never is)."""
    return any(true is not None and not truly_feasible(true[batch]) for true, batch, _ in judged)


def within_target(judged: list[tuple[list[float] | None, int, float]]) -> bool:
    """Every batch size's recommendation truly feasible and within 1% of the best feasible
    mean: a tree that regresses a dataset is false-feasible, never on target, however high
    its mean."""
    return (bool(judged) and not ships_a_regression(judged)
            and min(ratio for _, _, ratio in judged) >= TARGET)


def regret(judged: list[tuple[list[float] | None, int, float]]) -> float:
    """1 - the worse batch size's true mean speedup over the best feasible one's; a truly
    infeasible recommendation (a shipped regression) is the worst there is, 1."""
    return 1.0 if ships_a_regression(judged) else 1.0 - min(ratio for _, _, ratio in judged)


def target_trees(table: dict[TreeConfig, dict[int, list[float]]], best: dict[int, float]
                 ) -> dict[int, set[TreeConfig]]:
    """Per batch size, the trees a recommendation within the target could be: truly
    feasible, their mean speedup within 1% of the best's (none where the best is no
    speculation)."""
    return {b: {c for c, v in table.items()
                if truly_feasible(v[b]) and statistics.fmean(v[b]) >= TARGET * best[b]}
            for b in best}


@contextlib.contextmanager
def oracle_known(order: list[TreeConfig], name: str = ORACLE) -> Iterator[None]:
    """The oracle `name`, proposing `order`, is a strategy the planner knows, within the
    block."""
    register(name, f"benchmark only: reads {ORACLES[name]}")(
        type("Oracle", (Oracle,), {"trees": order}))
    try:
        yield
    finally:
        strategies.STRATEGIES.pop(name, None)


def model_only(world: World) -> World:
    """The world as the search's own model would have it: its truth's profile (acceptance
    effects included, as the profile states them), no cost effects, no replayed table. An
    oracle of it knows everything a perfect fit of the model could, and nothing more."""
    return dataclasses.replace(world, effects=type(world.effects)(), replay_path=None)


def run_job(job: Job) -> dict:
    world = load_world(job.world)
    table, best = truth_table(world, job.batches, job.method)
    if job.strategy not in ORACLES:
        return study(job, world, table, best)
    known = table if job.strategy == ORACLE else truth_table(model_only(world), job.batches,
                                                             job.method)[0]
    with oracle_known(oracle_order(known), job.strategy):
        return study(job, world, table, best)


def study(job: Job, world: World, table: dict[TreeConfig, dict[int, list[float]]],
          best: dict[int, float]) -> dict:
    """One seeded study of `job`, judged against the world's `table` and `best`."""
    stated = job.noise if job.prior_noise is None else job.prior_noise
    spec = study_spec(job.world, job.strategy, job.seed, job.max_launches, stated, job.batches,
                      method=job.method)
    truth = world.model(world.profile.tp, profile_method(job.method))
    within: list[bool] = []
    regret_at_budget: float | None = None
    recommended = false_feasible = 0
    targets = target_trees(table, best)
    # Per batch size, the launch that first ran one of its target trees (0: none needed,
    # no speculation is the best).
    found: dict[int, int | None] = {b: None if targets[b] else 0 for b in job.batches}

    def after(planner: Planner) -> None:
        nonlocal regret_at_budget, recommended, false_feasible
        launched = planner.launched[-1].config if planner.launched else None
        for b, trees in targets.items():
            if found[b] is None and launched in trees:
                found[b] = planner.launches
        judged = judge_mixed(spec, planner, table, best)
        for true, batch, _ in judged:
            if true is not None:
                recommended += 1
                false_feasible += not truly_feasible(true[batch], spec.tolerance)
        within.append(within_target(judged))
        if judged and planner.launches <= job.budget:  # the last by the budget: a study
            regret_at_budget = regret(judged)           # may end before it

    started = time.monotonic()
    noise = Noise(launch_cv=job.noise, measurement_cv=job.noise)
    planner = run_parallel(spec, truth, noise_seed(world, job.seed), job.max_launches,
                           job.workers, noise, after_launch=lambda p, _: after(p),
                           nodes=job.nodes, drift=job.drift)
    first = next((i + 1 for i, ok in enumerate(within) if ok), job.max_launches + 1)
    stable = next((i + 1 for i in range(len(within)) if all(within[i:])), job.max_launches + 1)
    covered, judged = coverage(planner, table, spec.dataset_names, job.batches)
    return {"world": job.world, "strategy": job.strategy, "seed": job.seed,
            "launches_to_target": first, "launches_to_stable_target": stable,
            "target_launched": {str(b): found[b] for b in job.batches},
            "regret_at_budget": regret_at_budget if regret_at_budget is not None else 1.0,
            "recommended": recommended, "false_feasible": false_feasible,
            "covered": covered, "intervals": judged,
            "launches": planner.launches, "seconds": time.monotonic() - started}


def coverage(planner: Planner, table: dict, datasets: list[str],
             batches: tuple[int, ...]) -> tuple[int, int]:
    """(intervals holding the true speedup, intervals judged) over the final measurements,
    with the study's learned noise. The intervals are two-sided at Z_INTERVAL (1.96)
    standard errors: about 95%."""
    if planner.baseline is None:
        return 0, 0
    covered = judged = 0
    for result in planner.results.values():
        true = table.get(result.config) if isinstance(result.config, TreeConfig) else None
        if not result.ok or true is None:
            continue
        for batch in batches:
            ivs = intervals(result, planner.baseline, batch, datasets, planner.noise())
            for i, dataset in enumerate(datasets):
                judged += 1
                covered += ivs[dataset].low <= true[batch][i] <= ivs[dataset].high
    return covered, judged


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q, method="higher"))


def summarize(rows: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for row in rows:
        out.setdefault(row["strategy"], []).append(row)  # type: ignore[arg-type]
    return {strategy: _summary(mine) for strategy, mine in out.items()}  # type: ignore[arg-type]


def resamples(mine: list[dict], draws: int = 2000) -> np.ndarray | None:
    """Bootstrap resamples of the studies (indices, one row per draw), seeded so a summary
    is reproducible; None below two studies. The study is the unit: its launches and its
    intervals share one baseline's error."""
    if len(mine) < 2:
        return None
    return np.random.default_rng(0).integers(len(mine), size=(draws, len(mine)))


def coverage_ci(mine: list[dict]) -> list[float] | None:
    """A 90% bootstrap interval of the coverage, resampling whole studies."""
    covered = np.array([r["covered"] for r in mine], dtype=float)
    judged = np.array([r["intervals"] for r in mine], dtype=float)
    picks = resamples(mine)
    if picks is None or judged.sum() == 0:
        return None
    shares = covered[picks].sum(axis=1) / np.maximum(judged[picks].sum(axis=1), 1)
    return [round(float(q), 4) for q in np.percentile(shares, [5, 95])]


def median_ci(mine: list[dict]) -> list[float] | None:
    """A 90% bootstrap interval of the median launches to the target: how far another set
    of seeds could move the median (single seeds move by tens of launches on small
    changes, so a median a launch off a goal may be the seeds' doing)."""
    launches = np.array([r["launches_to_target"] for r in mine], dtype=float)
    picks = resamples(mine)
    if picks is None:
        return None
    medians = np.median(launches[picks], axis=1)
    return [float(q) for q in np.percentile(medians, [5, 95])]


def _summary(mine: list[dict]) -> dict:
    launches = [r["launches_to_target"] for r in mine]
    stable = [r["launches_to_stable_target"] for r in mine]
    recommended = sum(r["recommended"] for r in mine)
    judged = sum(r["intervals"] for r in mine)
    return {
        "median_launches": statistics.median(launches),
        "median_launches_ci": median_ci(mine),
        "p90_launches": percentile(launches, 90),
        "median_launches_stable": statistics.median(stable),
        "p90_launches_stable": percentile(stable, 90),
        "regret_at_budget": round(statistics.fmean(r["regret_at_budget"] for r in mine), 4),
        "false_feasible_rate": round(sum(r["false_feasible"] for r in mine)
                                     / max(recommended, 1), 4),
        "coverage": round(sum(r["covered"] for r in mine) / judged, 4) if judged else None,
        "coverage_ci": coverage_ci(mine),
        "studies": len(mine),
        "reached": sum(r["launches_to_target"] <= r["launches"] for r in mine),
        "unreached_unlaunched": sum(r["launches_to_target"] > r["launches"]
                                    and None in r["target_launched"].values() for r in mine),
        "seconds": round(sum(r["seconds"] for r in mine), 1),
    }


def markdown(worlds: dict[str, dict[str, dict]], overall: dict[str, dict],
             args: argparse.Namespace, kinds: dict[str, str]) -> str:
    batches = ", ".join(map(str, args.batch))
    stated = "" if args.prior_noise is None else f" (stated: {args.prior_noise:.0%})"
    if args.workers > 1 or args.node_speeds:
        stated += f", {args.workers} workers"  # the heading's settings beside the noise
    if args.node_speeds:
        stated += ", node speeds " + " ".join(f"{s:g}" for s in args.node_speeds)
    if args.drift:
        stated += f", drift {args.drift:+.2%} per launch"
    lines = [f"# Search efficiency ({len(worlds)} worlds x {args.seeds} seeds, noise "
             f"{args.noise:.0%}{stated}, budget {args.budget}, up to {args.max_launches} launches, "
             f"batch sizes {batches})", "",
             "| world | kind | strategy | median launches (90% CI) | p90 launches "
             "| median (stable) | p90 (stable) | regret at budget | false-feasible | coverage "
             "| reached |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, summary in [*worlds.items(), ("all", overall)]:
        for strategy, s in summary.items():
            cov = f"{s['coverage']:.1%}" if s["coverage"] is not None else "-"
            if s.get("coverage_ci"):
                cov += " ({:.0%}-{:.0%})".format(*s["coverage_ci"])
            median = f"{s['median_launches']:g}"
            if s.get("median_launches_ci"):
                median += " ({:g}-{:g})".format(*s["median_launches_ci"])
            lines.append(
                f"| {name} | {kinds.get(name, '')} | {strategy} | {median} | "
                f"{s['p90_launches']:g} | {s['median_launches_stable']:g} | "
                f"{s['p90_launches_stable']:g} | {s['regret_at_budget']:.2%} | "
                f"{s['false_feasible_rate']:.2%} | {cov} | {s['reached']}/{s['studies']} |")
    missed = [(strategy, s["studies"] - s["reached"], s["unreached_unlaunched"])
              for strategy, s in overall.items() if s["studies"] > s["reached"]]
    if missed:
        lines += ["", "Unreached studies that never launched a target tree at some batch "
                  "size (the search did not find it; the others launched one at every "
                  "batch size but never recommended target trees at all of them at "
                  "once): " + ", ".join(
                      f"{strategy} {never} of {unreached}"
                      for strategy, unreached, never in missed) + "."]
    if "model" in overall and "tpe" in overall:
        ratio = overall["tpe"]["median_launches"] / overall["model"]["median_launches"]
        lines += ["", f"Over all worlds TPE needs {ratio:.1f}x the launches of the "
                  "model-guided search (medians; a study that never reaches the target "
                  f"counts as {args.max_launches + 1})."]
    return "\n".join(lines) + "\n"


def world_names(requested: list[str]) -> list[str]:
    if not requested or requested == ["all"]:
        return [*shipped_profiles(), *shipped_worlds()]
    return requested


def load_worlds(parser: argparse.ArgumentParser, requested: list[str]) -> dict[str, World]:
    """The requested worlds by name ('all': every shipped profile and world), loaded here,
    so that a bad one is a usage error naming it, not a traceback from a worker."""
    worlds = {}
    for name in world_names(requested):
        try:
            worlds[name] = load_world(name)
        except TreetuneError as exc:
            parser.error(str(exc))
    return worlds


def output_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every in-process benchmark shares: --json, --output and --processes."""
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--output", type=Path, default=None, help="write the markdown here")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (a count of launches, seeds, processes)."""
    return _whole(text, 1)


def whole_int(text: str) -> int:
    """An argparse type: a whole number >= 0 (a seed)."""
    return _whole(text, 0)


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def finite_float(text: str) -> float:
    """An argparse type: a finite number (nan and inf crashed every study of the run)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def noise_share(text: str) -> float:
    """An argparse type: a coefficient of variation, 0 or more and below 1."""
    value = finite_float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 0 and < 1 (0.03: 3%), got {text}")
    return value


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    quick: dict[str, int] | None = None,
                    defaults: dict[str, int] | None = None) -> None:
    """Fill the options left unset (None): from `quick` with --quick, else `defaults`, so
    that what is given explicitly stands; then refuse, as usage errors before any study
    runs, what would crash later or lose the run: counts below one, an --output that
    cannot be written."""
    for name, value in (defaults or {}).items():
        if getattr(args, name) is None:
            setattr(args, name, (quick or {}).get(name, value)
                    if getattr(args, "quick", False) else value)
    for name, least in (("processes", 1), ("seeds", 1), ("max_launches", 2), ("budget", 1)):
        value = getattr(args, name, None)
        if value is not None and value < least:
            parser.error(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    if args.output is not None:
        try:
            writable(args.output)
        except TreetuneError as exc:
            parser.error(str(exc))


# The variables PyTorch's thread pools are sized by when it loads (the gp strategy's
# GPSampler runs on it).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _share_cpus(values: dict[str, str]) -> None:
    """A pool process's initializer: PyTorch's thread pools are sized by `values` (the
    process's share of the CPUs, or what the user set), whatever environment the pool's
    start method gave the process. Each process sizes them to every CPU otherwise: four
    GPSampler studies of the 30B on two processes of 2 cores took 144 s, against 69 s
    with one thread each, with the same results (stop 85). The jobs load PyTorch, not
    the pool's parent."""
    os.environ.update(values)


def run_pool(run: Callable[[Any], dict], jobs: list, processes: int,
             describe: Callable[[dict], str]) -> tuple[list[dict], int]:
    """Every job in a process pool, a progress line each on stderr: the rows in job order,
    and how many jobs raised (each reported, left out; the others' results are kept). Each
    process's PyTorch threads are its share of the CPUs (`_share_cpus`)."""
    rows: dict[int, dict] = {}
    failed = 0
    share = str(max((os.cpu_count() or 1) // processes, 1))
    threads = {name: os.environ.get(name, share) for name in THREAD_VARIABLES}
    with ProcessPoolExecutor(max_workers=processes, initializer=_share_cpus,
                             initargs=(threads,)) as pool:
        futures = {pool.submit(run, job): i for i, job in enumerate(jobs)}
        for done, future in enumerate(as_completed(futures), start=1):
            try:
                rows[futures[future]] = row = future.result()
            except Exception as exc:  # one bad job must not lose the run
                failed += 1
                print(f"  {done}/{len(jobs)} FAILED {jobs[futures[future]]}: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                continue
            print(f"  {done}/{len(jobs)} {describe(row)}", file=sys.stderr, flush=True)
    if failed:
        print(f"{failed} of {len(jobs)} jobs failed (above); the summary leaves them out",
              file=sys.stderr)
    return [rows[i] for i in sorted(rows)], failed


def publish(text: str, data: dict, args: argparse.Namespace, studies: int,
            started: float, failed: int = 0) -> None:
    """The markdown (to --output, and to stdout or beside the JSON) and the JSON summary;
    `studies` run, `failed` of them raised (left out of the tables)."""
    lost = f" ({failed} failed, left out)" if failed else ""
    text += (f"\n{studies - failed} studies{lost} in {time.monotonic() - started:.0f} s "
             f"({time.strftime('%Y-%m-%d')}).\n")
    if args.json:
        print(text, file=sys.stderr)  # the table still shows; stdout is the JSON alone
        print(json.dumps(data))
    else:
        print(text)
    if args.output:  # printed first: a file that cannot be written loses nothing
        try:
            args.output.write_text(text)
        except OSError as exc:
            print(f"could not write --output {args.output}: {exc.strerror}", file=sys.stderr)


def progress_line(row: dict) -> str:
    """One study's outcome: when it first reached the target, and from when it held it to
    the end (a recommendation can fall back out of the target as launches come in)."""
    first, stable = row["launches_to_target"], row["launches_to_stable_target"]
    held = (f"kept from {stable}" if stable <= row["launches"]
            else "not held to the end" if first <= row["launches"] else "never reached")
    line = (f"{row['world']} {row['strategy']} seed {row['seed']}: "
            + (f"target at {first} launches" if first <= row["launches"] else "target"))
    # Never reached: was a target tree launched? (0: no speculation is the best there)
    found = {b: at for b, at in row.get("target_launched", {}).items() if at != 0}
    if first > row["launches"] and found:
        held += "; a target tree first launched: " + ", ".join(
            f"batch {b} {'never' if at is None else f'at {at}'}" for b, at in found.items())
    return f"{line} ({held})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--worlds", nargs="+", default=["all"],
                        help="shipped world or profile names, or world/profile files; 'all' "
                        "(default): every shipped profile (the search's own model) and world")
    parser.add_argument("--batch", nargs="+", type=positive_int, default=[1, 32])
    parser.add_argument("--method", type=str.upper, default="EAGLE3",
                        choices=("EAGLE3", "EAGLE", "NEXTN", "STANDALONE"),
                        help="the draft method the studies search (default EAGLE3, the "
                        "worlds' own draft head); the worlds must describe it (NEXTN: "
                        "qwen3.5-397b-a17b-h200)")
    parser.add_argument("--seeds", type=int, default=None, help="studies per world and "
                        "strategy (default 20; 1 with --quick)")
    parser.add_argument("--first-seed", type=whole_int, default=0,
                        help="seeds are first-seed .. first-seed + seeds - 1")
    parser.add_argument("--budget", type=int, default=None,
                        help="launches for the regret (default 20; 12 with --quick)")
    parser.add_argument("--max-launches", type=int, default=None,
                        help="launches each study may use to reach the target (default 30; "
                        "16 with --quick)")
    parser.add_argument("--noise", type=noise_share, default=0.03,
                        help="launch and measurement noise (coefficient of variation)")
    parser.add_argument("--prior-noise", type=noise_share, default=None,
                        help="the launch noise the studies state (search.launch_cv, the "
                        "prior the learned noise starts from); default: --noise. E.g. "
                        "--noise 0.01 --prior-noise 0.03: a quiet engine (SGLang's own "
                        "run-to-run spread is under 1%%) under the default prior")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES),
                        choices=[*strategies.STRATEGIES, *ORACLES],
                        help="oracle: a reference that reads the world's truth and proposes "
                        "its best trees first (the floor noise and proof set); "
                        "model-oracle: the same from the truth's profile without the "
                        "world's effects (what a perfect fit of the model could do)")
    parser.add_argument("--workers", type=int, default=None,
                        help="launches each study runs at once, in simulated time (default: "
                        "1, or one per --node-speeds)")
    parser.add_argument("--node-speeds", nargs="+", type=finite_float, default=[],
                        help="each node's speed, common to every launch it runs (e.g. 1 0.92:"
                        " a second node 8%% slow); worker w runs on node w mod the count")
    parser.add_argument("--drift", type=finite_float, default=0.0,
                        help="each launch's speed changes by this share per launch before "
                        "it (launch k at 1 + drift x k; e.g. 0.003: 9%% faster by launch 30,"
                        " a machine warming up or a neighbour leaving), which the search's "
                        "noise model, taking launches as independent, does not expect")
    parser.add_argument("--quick", action="store_true",
                        help="every world, 1 seed, up to 16 launches: a smoke run (options "
                        "given explicitly stand)")
    output_arguments(parser)
    args = parser.parse_args()
    check_arguments(parser, args, quick={"seeds": 1, "max_launches": 16, "budget": 12},
                    defaults={"seeds": 20, "max_launches": 30, "budget": 20})
    if args.budget > args.max_launches:
        parser.error(f"--budget {args.budget} is beyond --max-launches {args.max_launches}: "
                     "the regret is read at the budget's launch, which no study reaches")
    if args.workers is None:
        args.workers = max(1, len(args.node_speeds))
    if args.workers < 1 or any(s <= 0 for s in args.node_speeds):
        parser.error("--workers must be >= 1 and every --node-speeds value > 0")
    if 1 + args.drift * (args.max_launches - 1) <= 0:
        parser.error(f"--drift {args.drift} would stop launch {args.max_launches} "
                     "(its speed <= 0)")
    worlds = load_worlds(parser, args.worlds)
    names = list(worlds)
    kinds = {name: "own model" if world.own_model else
             "replay" if world.replay_path else "misspecified"
             for name, world in worlds.items()}
    batches = tuple(sorted(set(args.batch)))
    for name, world in worlds.items():
        if profile_method(args.method) not in world.profile.method_names:
            parser.error(f"--method {args.method}: world '{name}' describes "
                         f"{', '.join(world.profile.method_names)}")
    jobs = [Job(w, s, seed, args.max_launches, args.budget, args.noise, batches,
                args.prior_noise, args.workers, tuple(args.node_speeds), args.drift,
                args.method)
            for w in names for s in args.strategies
            for seed in range(args.first_seed, args.first_seed + args.seeds)]
    started = time.monotonic()
    rows, failed = run_pool(run_job, jobs, args.processes, progress_line)
    per_world = {name: summarize([r for r in rows if r["world"] == name]) for name in names}
    overall = summarize(rows)
    publish(markdown(per_world, overall, args, kinds),
            {"worlds": per_world, "all": overall, "studies": rows}, args, len(jobs), started,
            failed)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
