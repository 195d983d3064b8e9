"""The search loop: baseline and compared configs first, then proposals, launched on Ray
workers in parallel until the budget is spent; every result is stored as it arrives."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.errors import TreetuneError
from treetune.results import LaunchResult, config_key
from treetune.space import load_space
from treetune.study.propose import Proposal, TPEProposer
from treetune.study.spec import StudySpec
from treetune.study.storage import StudyStore, speedups

RESOURCE_TIMEOUT_S = 120.0  # how long to wait for Ray to place the workers
EMULATED_GPU = "emulated_gpu"
SPEC_COPY = "study.yaml"


@dataclass
class Progress:
    """What the progress display shows; the runner updates it after every event."""

    budget: int | None
    launches_done: int = 0
    running: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    best: dict[int, tuple[str, float]] = field(default_factory=dict)  # batch -> (config, mean)
    message: str = ""

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


@dataclass
class _Launch:
    config: ServerConfig
    trial: Any  # its trial in the launches study
    proposal: Proposal | None
    worker: Any


@dataclass
class StudyOutcome:
    spec: StudySpec
    results: list[LaunchResult]
    baseline: LaunchResult | None
    interrupted: bool = False
    stale_redone: int = 0


class _Ray:
    """Ray for the duration of a study: local unless an address is given."""

    def __init__(self, spec: StudySpec) -> None:
        import ray

        self.ray = ray
        self.started_here = False
        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False,
                                      configure_logging=False)
        if spec.ray_address:
            try:
                ray.init(address=spec.ray_address, **kwargs)
            except Exception as exc:
                raise TreetuneError(f"cannot reach the Ray cluster at {spec.ray_address}: "
                                    f"{exc}") from None
        else:
            workers = spec.workers or 1
            resources = ({EMULATED_GPU: float(workers * spec.tp)}
                         if spec.backend.kind == "emulator" else None)
            temp = os.environ.get("TREETUNE_RAY_TMPDIR")
            ray.init(num_cpus=workers + 1, resources=resources,
                     **({"_temp_dir": temp} if temp else {}), **kwargs)
        self.started_here = True

    def shutdown(self) -> None:
        if self.started_here:
            self.ray.shutdown()


def _start_workers(ray: Any, spec: StudySpec) -> list[Any]:
    from treetune.study.worker import LaunchWorker

    if spec.backend.kind == "emulator":
        options: dict[str, Any] = {"resources": {EMULATED_GPU: spec.tp}, "num_cpus": 1}
        available = ray.cluster_resources().get(EMULATED_GPU, 0)
    else:
        options = {"num_gpus": spec.tp, "num_cpus": 1}
        available = ray.cluster_resources().get("GPU", 0)
    groups = int(available // spec.tp)
    if groups < 1:
        kind = "emulated GPUs" if spec.backend.kind == "emulator" else "GPUs"
        raise TreetuneError(
            f"the Ray cluster offers {available:g} {kind}, fewer than one group of tp={spec.tp}"
            + ("; without GPUs use the emulator: --backend emulator --profile NAME"
               if spec.backend.kind == "sglang" else ""))
    count = min(spec.workers or groups, groups)
    actor = ray.remote(LaunchWorker).options(**options, max_restarts=0)
    workers = [actor.remote(spec, i) for i in range(count)]
    try:
        ray.get([w.ready.remote() for w in workers], timeout=RESOURCE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise TreetuneError(f"Ray could not place {count} workers of {spec.tp} GPUs within "
                            f"{RESOURCE_TIMEOUT_S:.0f} s") from None
    return workers


def run_study(spec: StudySpec, on_progress: Callable[[Progress], None] | None = None,
              store: StudyStore | None = None) -> StudyOutcome:
    """Run (or resume) a study until its budget is spent or the space is exhausted."""
    store = store or StudyStore(spec)
    space = load_space(spec.space)
    spec.save(spec.output_dir / SPEC_COPY)  # what `treetune report` reads back
    stale = store.mark_stale()
    results = {config_key(r.config): r for r in store.results()}
    progress = Progress(budget=spec.budget.launches, launches_done=len(results))
    notify = on_progress or (lambda p: None)
    if stale:
        progress.message = f"{stale} launch(es) of an earlier run were stale: redoing them"

    def baseline() -> LaunchResult | None:
        result = results.get("baseline")
        return result if result and result.ok else None

    in_flight: dict[Any, _Launch] = {}  # Ray object ref -> launch under way
    proposer = TPEProposer(store, space, spec.seed,
                           is_known=lambda k: k in results or any(
                               config_key(x.config) == k for x in in_flight.values()))
    base = baseline()
    if base is not None:
        for r in results.values():
            if isinstance(r.config, TreeConfig):
                _update_best(progress, spec, r, base)
    queue: list[ServerConfig] = [c for c in (BASELINE, *spec.compare)
                                 if config_key(c) not in results]
    pending_tell: list[tuple[LaunchResult, Proposal | None]] = []
    deadline = (time.monotonic() + spec.budget.wall_time_s) if spec.budget.wall_time_s else None

    def budget_left() -> bool:
        used = len(results) + len(in_flight)
        if spec.budget.launches is not None and used >= spec.budget.launches:
            return False
        return deadline is None or time.monotonic() < deadline

    if "baseline" in results and not results["baseline"].ok:
        raise TreetuneError(f"the baseline launch failed: {results['baseline'].reason}; fix the "
                            "server setup and start a new study")
    notify(progress)
    ray_session = _Ray(spec)
    ray = ray_session.ray
    interrupted = False
    try:
        workers = _start_workers(ray, spec)
        idle = list(workers)
        while True:
            while idle and budget_left():
                if queue:
                    config: ServerConfig = queue.pop(0)
                    proposal = None
                elif baseline() is None:
                    break  # speedups need the baseline before the search can learn
                else:
                    proposal = proposer.next()
                    if proposal is None:
                        break
                    config = proposal.config
                worker = idle.pop(0)
                trial = store.begin_launch(config, ())
                ref = worker.run.remote(config_key(config), [])
                in_flight[ref] = _Launch(config, trial, proposal, worker)
                progress.running = [config_key(x.config) for x in in_flight.values()]
                progress.message = f"launched {config} on a worker"
                notify(progress)
            if not in_flight:
                break
            done, _ = ray.wait(list(in_flight), num_returns=1, timeout=1.0)
            for ref in done:
                launch = in_flight.pop(ref)
                config, proposal = launch.config, launch.proposal
                idle.append(launch.worker)
                try:
                    result = LaunchResult.from_dict(ray.get(ref))
                except ray.exceptions.RayError as exc:
                    result = LaunchResult(config, reason=f"worker failed: {exc}")
                store.finish_launch(launch.trial, result)
                results[config_key(config)] = result
                progress.launches_done = len(results)
                progress.running = [config_key(x.config) for x in in_flight.values()]
                progress.message = (f"measured {config}" if result.ok
                                    else f"{config} failed: {result.reason}")
                if config is BASELINE and not result.ok:
                    raise TreetuneError(f"the baseline launch failed: {result.reason}\n"
                                        f"{result.log_tail}")
                if isinstance(config, TreeConfig):
                    pending_tell.append((result, proposal))
                base = baseline()
                if base is not None:
                    for told, prop in pending_tell:
                        proposer.observe(prop.trials if prop else [], told, base)
                        _update_best(progress, spec, told, base)
                    pending_tell.clear()
                notify(progress)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for launch in in_flight.values():
            store.abandon(launch.trial, store.launches, "interrupted")
            for batch, btrial, _ in (launch.proposal.trials if launch.proposal else []):
                store.abandon(btrial, store.batch_studies[batch], "interrupted")
            ray.kill(launch.worker)  # its server dies with it (parent-death signal)
        proposer.abandon_all("interrupted" if interrupted else "search ended")
        in_flight.clear()
        ray_session.shutdown()
    return StudyOutcome(spec, list(results.values()), baseline(), interrupted, stale)


def _update_best(progress: Progress, spec: StudySpec, result: LaunchResult,
                 baseline: LaunchResult) -> None:
    if not result.ok:
        return
    floor = 1.0 - spec.tolerance
    for batch in spec.batch:
        per = speedups(result, baseline, batch, spec.dataset_names)
        if min(per.values()) < floor:
            continue
        mean = statistics.fmean(per.values())
        if batch not in progress.best or mean > progress.best[batch][1]:
            progress.best[batch] = (result.config.label(), mean)
