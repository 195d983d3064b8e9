"""Studies evaluated in-process: each launch is drawn from a performance profile (the
truth) with launch and measurement noise, instead of starting a server. The planner,
strategies, re-measurement and recommendations are the ones `treetune search` runs; only
the server is replaced. For benchmarking search strategies over many seeds in minutes.

With several workers, time is simulated: each launch lasts its server's load time plus
its cells' measurement time (`LaunchClock`, drawn with noise), and launches finish in the
order a cluster would finish them (an event queue), so the planner sees the same
interleaving of proposals and results that `treetune search` on N GPU groups sees."""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import optuna

from treetune.backends.sglang import profile_method
from treetune.backends.sglang_adaptive import Schedule, graph_sizes_for, settled_steps
from treetune.config import AdaptiveConfig, ServerConfig, TreeConfig, chain
from treetune.perfmodel import PerfModel, Serving, check_memory
from treetune.perfmodel.noise import lognormal_factor
from treetune.results import CellResult, Latency, LaunchResult
from treetune.space import load_space
from treetune.study.planner import Planner, Task
from treetune.study.spec import StudySpec
from treetune.study.storage import StudyStore


@dataclass(frozen=True)
class Noise:
    launch_cv: float = 0.03  # per launch, common to all its cells
    measurement_cv: float = 0.03  # per sub-window of a cell
    accept_cv: float = 0.01  # of a cell's measured accept length


def method_truth(truth: PerfModel, config: ServerConfig) -> PerfModel:
    """The truth of a config's draft method: `truth` for the study's own, the profile's
    entry for another method's tree (TreeConfig.method)."""
    if not isinstance(config, TreeConfig) or not config.method:
        return truth
    return _method_model(truth, config.method)


@functools.lru_cache(maxsize=32)
def _method_model(truth: PerfModel, method: str) -> PerfModel:
    return truth.for_method(profile_method(method))


def adaptive_throughput(truth: PerfModel, config: AdaptiveConfig, batch: int, dataset: str,
                        graph_sizes: list[int]) -> tuple[float, float]:
    """Throughput and accept length of an adaptive server in steady state at `batch`, as
    the emulator serves it: the batch routed through the CUDA-graph sizes (`graph_sizes`,
    `graph_sizes_for` the study's batch sizes and server flags) to its slot, whose
    controller is fed the truth's mean accepted drafts of the chain it runs; the chains it
    settles on (or cycles through) timed and accepted as static chains."""
    schedule = Schedule(config.to_json(), config.initial_steps, graph_sizes)
    steps = settled_steps(schedule, batch,
                          lambda s: truth.accept_length(chain(s), dataset) - 1)
    tokens = sum(truth.accept_length(chain(s), dataset) for s in steps)
    seconds = sum(truth.round_time(chain(s), batch, dataset).total_s for s in steps)
    return batch * tokens / seconds, tokens / len(steps)


def simulate_launch(truth: PerfModel, config: ServerConfig, spec: StudySpec,
                    rng: np.random.Generator, noise: Noise, speed: float = 1.0
                    ) -> LaunchResult:
    """What a launch of `config` would measure, drawn from the truth with noise (the
    truth of its draft method, see `method_truth`); `speed`: the node's, common to every
    launch it runs (a power-capped GPU: below 1)."""
    truth = method_truth(truth, config)
    # SGLang sizes an adaptive server for its longest candidate chain.
    sized = config.longest if isinstance(config, AdaptiveConfig) else config
    shapes, most = spec.request_shapes(), max(spec.batch)
    memory = check_memory(truth.profile, sized, most, tp=truth.cost.tp, method=truth.method,
                          mem_fraction_static=spec.mem_fraction_static)
    if not memory.starts:
        return LaunchResult(config, reason="RuntimeError: Not enough memory (emulated)",
                            exit_code=1)
    # A pool that holds fewer requests than asked runs that many at once (the emulator's).
    running = memory.running(most)
    # An adaptive server's padding; a static tree's launch has no use for it.
    graphs = (graph_sizes_for(spec.batch, spec.server_flags)
              if isinstance(config, AdaptiveConfig) else [])
    launch = lognormal_factor(noise.launch_cv, rng) * truth.launch_speed(rng) * speed
    repeats = spec.measurement.repeats

    def accept_of(dataset: str) -> float | None:
        return truth.accept_length(config, dataset) if isinstance(config, TreeConfig) else None

    cells = []
    for batch in spec.batch:
        for dataset in spec.dataset_names:
            served = None
            if isinstance(config, AdaptiveConfig):
                tput, accept = adaptive_throughput(truth, config, min(batch, running),
                                                   dataset, graphs)
            elif dataset in shapes:
                served = truth.closed_loop(config, dataset, shapes[dataset], batch, running)
                tput, accept = served.output_tok_s, accept_of(dataset)
            else:
                tput = truth.throughput(config, min(batch, running), dataset)
                accept = accept_of(dataset)
            cells.append(_cell(dataset, batch, None, tput, accept, served, launch, repeats,
                               noise, rng))
    rate_cells = []
    for rate in spec.rates:
        for dataset in spec.dataset_names:
            if dataset not in shapes or isinstance(config, AdaptiveConfig):
                continue
            served = truth.open_loop(config, dataset, shapes[dataset], rate, running)
            rate_cells.append(_cell(dataset, 0, rate, served.output_tok_s, accept_of(dataset),
                                    served, launch, repeats, noise, rng))
    return LaunchResult(config, ok=True, cells=cells, rate_cells=rate_cells)


def _cell(dataset: str, batch: int, rate: float | None, tput: float, accept: float | None,
          served: Serving | None, launch: float, repeats: int, noise: Noise,
          rng: np.random.Generator) -> CellResult:
    """One measured cell: the truth's throughput (and, for whole requests, latencies,
    the same at every percentile) with the launch's and each window's noise."""
    windows = tuple(tput * launch * lognormal_factor(noise.measurement_cv, rng)
                    for _ in range(repeats))
    if accept is not None:
        accept *= lognormal_factor(noise.accept_cv, rng)
    measured = float(np.mean(windows))
    ttft = tpot = None
    if served is not None:
        slower = tput / measured if measured > 0 else 1.0  # a slow launch: slow tokens
        ttft = Latency(*[served.ttft_s * slower] * 3)
        tpot = Latency(*[served.tpot_s * slower] * 3)
    return CellResult(dataset, batch, measured, accept, requests=max(batch, 1),
                      output_tokens=0, duration_s=0.0, ttft=ttft, tpot=tpot,
                      repeats=windows, rate=rate, arrival="poisson" if rate else "")


@dataclass(frozen=True)
class LaunchClock:
    """How long a simulated launch takes: the server loads (weights, CUDA graphs), then
    measures every cell (a warm-up and the study's `measurement.duration_s` window). A
    launch that fails (out of memory) fails while loading."""

    load_s: float = 300.0
    load_cv: float = 0.15  # loading varies with the filesystem and the node's cache
    warmup_s: float = 5.0  # per cell, until every request has its first token
    warmup_cv: float = 0.5

    def duration(self, spec: StudySpec, result: LaunchResult,
                 rng: np.random.Generator) -> float:
        seconds = self.load_s * lognormal_factor(self.load_cv, rng)
        if result.ok:
            seconds += sum(spec.measurement.duration_s
                           + self.warmup_s * lognormal_factor(self.warmup_cv, rng)
                           for _ in range(cells_of(spec)))
        return seconds

    def nominal(self, spec: StudySpec) -> float:
        """A successful launch without the noise: load, then every cell's warm-up and
        window."""
        return self.load_s + cells_of(spec) * (spec.measurement.duration_s + self.warmup_s)


def cells_of(spec: StudySpec) -> int:
    """The cells one launch measures: every batch size of every dataset."""
    return len(spec.batch) * len(spec.dataset_names)


def run_offline(spec: StudySpec, truth: PerfModel, seed: int, launches: int,
                noise: Noise = Noise(),
                after_launch: Callable[[Planner], None] | None = None,
                store: StudyStore | None = None) -> Planner:
    """One study of `launches` launches (one at a time); `after_launch` sees the planner
    after every launch. Kept in memory unless a `store` is given: then every launch and
    the final recommendations are stored as `treetune search` stores them, so the report
    and the notebooks read the study like any other."""
    def each(planner: Planner, _: float) -> bool:
        if after_launch is not None:
            after_launch(planner)
        return False

    return run_parallel(spec, truth, seed, launches, workers=1, noise=noise,
                        after_launch=each, store=store)


def run_parallel(spec: StudySpec, truth: PerfModel, seed: int, launches: int, workers: int,
                 noise: Noise = Noise(), clock: LaunchClock = LaunchClock(),
                 after_launch: Callable[[Planner, float], bool | None] | None = None,
                 store: StudyStore | None = None, nodes: tuple[float, ...] = (),
                 drift: float = 0.0) -> Planner:
    """One study of `launches` launches on `workers` simulated workers: every free worker
    takes the planner's next launch (as `treetune search`'s runner does), and the launch
    finishing first in simulated time is handed back first. `after_launch` sees the
    planner and the simulated time (seconds) after every finished launch, and ends the
    study by returning True (launches still running are dropped). One worker
    makes exactly the study `run_offline` makes (durations have their own random
    stream). `nodes`: each node's speed (see `simulate_launch`); worker w runs on node
    w % len(nodes) and is named worker-w@node-n, as the runner names a Ray worker by its
    host; without nodes, workers are unnamed. `drift`: every launch's speed changes by this
    share per launch started before it (launch k runs at 1 + drift x k): a machine that
    warms up, or a neighbour that leaves, mid-study; a trend the noise model, which takes
    launches as independent, does not have."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if any(speed <= 0 for speed in nodes):
        raise ValueError(f"node speeds must be > 0, got {nodes}")
    if 1 + drift * max(launches - 1, 0) <= 0:
        raise ValueError(f"drift {drift} stops launch {launches} (its speed would be <= 0)")
    store = store or StudyStore(spec, storage=optuna.storages.InMemoryStorage())
    planner = Planner(spec, store, load_space(spec.space), [], tp=truth.cost.tp)
    rng = np.random.default_rng(seed)
    durations = np.random.default_rng([seed, workers])
    # (finish time, launch number: ties in start order, worker, task, trial, result)
    running: list[tuple[float, int, int, Task, optuna.trial.Trial, LaunchResult]] = []
    free = list(range(workers))  # idle workers: the lowest takes the next launch
    started = 0
    now = 0.0
    while True:
        while free and started < launches:
            node = free[0] % len(nodes) if nodes else 0
            task = planner.next(f"node-{node}" if nodes else "")
            if task is None:
                break  # nothing to launch until a running launch finishes (or for good)
            worker = free.pop(0)
            trial = store.begin_launch(task.config, ())
            speed = (nodes[node] if nodes else 1.0) * (1 + drift * started)
            result = simulate_launch(truth, task.config, spec, rng, noise, speed)
            if nodes:
                result.worker = f"worker-{worker}@node-{node}"
            heapq.heappush(running, (now + clock.duration(spec, result, durations), started,
                                     worker, task, trial, result))
            started += 1
        if not running:
            break
        now, _, worker, task, trial, result = heapq.heappop(running)
        free = sorted([*free, worker])
        store.finish_launch(trial, result)
        planner.finish(task, result)
        if after_launch and after_launch(planner, now):
            break
    planner.abandon("search ended")
    recs = planner.decide()
    if recs:
        store.save_recommendations(recs, planner.strategy_name)
    return planner


__all__ = ["LaunchClock", "Noise", "adaptive_throughput", "method_truth", "run_offline",
           "run_parallel", "simulate_launch"]
