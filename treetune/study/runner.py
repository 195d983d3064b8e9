"""The search loop: baseline and compared configs first, then proposals, launched on Ray
workers in parallel until the budget is spent; every result is stored as it arrives."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from treetune.backends import BackendFacts
from treetune.config import BASELINE
from treetune.errors import TreetuneError
from treetune.results import LaunchResult
from treetune.space import load_space
from treetune.study.evidence import merge_all
from treetune.study.planner import Planner, Task
from treetune.study.preflight import check_study
from treetune.study.recommend import MIXED, Recommendation
from treetune.study.spec import SPEC_COPY, StudySpec
from treetune.study.storage import StudyStore, check_writable

RESOURCE_TIMEOUT_S = 120.0  # how long to wait for Ray to place the workers
RAY_GPU = "GPU"  # the resource Ray detects on GPU nodes by itself
LOCK_FILE = ".treetune.lock"
MAX_RESCHEDULES = 2  # a launch whose worker dies more often than this is recorded failed


@dataclass
class Progress:
    """What the progress display shows; the runner updates it after every event."""

    budget: int | None
    launches_done: int = 0
    running: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    best: dict[int, tuple[str, float]] = field(default_factory=dict)  # batch -> (config, mean)
    message: str = ""
    notes: list[str] = field(default_factory=list)  # said once each, above the progress line

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


@dataclass
class _Launch:
    task: Task
    trial: Any  # its trial in the launches study
    worker: Any


@dataclass
class StudyOutcome:
    spec: StudySpec
    results: list[LaunchResult]
    baseline: LaunchResult | None
    interrupted: bool = False
    stale_redone: int = 0
    launches: int = 0  # server launches stored, re-measurements included
    strategy: str = ""
    recommendations: list[Recommendation] = field(default_factory=list)  # as stored


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
            gpu = spec.backend.gpu_resource
            # Ray finds real GPUs itself; a backend's own resource is declared here.
            resources = None if gpu == RAY_GPU else {gpu: float(workers * spec.tp)}
            temp = os.environ.get("TREETUNE_RAY_TMPDIR")
            ray.init(num_cpus=workers + 1, resources=resources,
                     **({"_temp_dir": temp} if temp else {}), **kwargs)
        self.started_here = True

    def shutdown(self) -> None:
        if self.started_here:
            self.ray.shutdown()


def _worker_options(ray: Any, spec: StudySpec) -> tuple[Any, int]:
    """The launch-worker actor class, and how many GPU groups the cluster offers."""
    from treetune.study.worker import LaunchWorker

    gpu = spec.backend.gpu_resource
    options: dict[str, Any] = ({"num_gpus": spec.tp} if gpu == RAY_GPU
                               else {"resources": {gpu: spec.tp}})
    available = ray.cluster_resources().get(gpu, 0)
    groups = int(available // spec.tp)
    if groups < 1:
        raise TreetuneError(
            f"the Ray cluster offers {available:g} {spec.backend.gpu_label}, fewer than one "
            f"group of tp={spec.tp}"
            + ("; without GPUs use the emulator: --backend emulator --profile NAME"
               if gpu == RAY_GPU else ""))
    # Restarts are ours to make: a dead worker's launch is rescheduled, not replayed by Ray.
    return ray.remote(LaunchWorker).options(**options, num_cpus=1, max_restarts=0), groups


def _start_workers(ray: Any, spec: StudySpec) -> tuple[Any, list[Any]]:
    actor, groups = _worker_options(ray, spec)
    count = min(spec.workers or groups, groups)
    workers = [actor.remote(spec, i) for i in range(count)]
    try:
        ray.get([w.ready.remote() for w in workers], timeout=RESOURCE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        for worker in workers:
            ray.kill(worker)
        raise TreetuneError(f"Ray could not place {count} workers of {spec.tp} GPUs within "
                            f"{RESOURCE_TIMEOUT_S:.0f} s") from None
    except ray.exceptions.RayError as exc:
        for worker in workers:
            ray.kill(worker)
        raise TreetuneError(f"a launch worker could not start: {_cause(exc)}") from None
    return actor, workers


def _cause(exc: BaseException) -> str:
    """The one line that says why a Ray call failed (the remote exception's message)."""
    cause = getattr(exc, "cause", None) or exc
    lines = [line for line in str(cause).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(cause).__name__


class _Pool:
    """The launch workers: idle ones, and replacements for dead ones being placed."""

    def __init__(self, ray: Any, actor: Any, workers: list[Any]) -> None:
        self.ray, self.actor = ray, actor
        self.idle = list(workers)
        self.alive = len(workers)
        self.starting: dict[Any, tuple[Any, float]] = {}  # ready ref -> (worker, deadline)
        self.made = len(workers)

    def replace(self, spec: StudySpec) -> None:
        """Ask for a new worker in place of a dead one; it joins when Ray places it."""
        worker = self.actor.remote(spec, self.made)
        self.made += 1
        self.starting[worker.ready.remote()] = (worker, time.monotonic() + RESOURCE_TIMEOUT_S)

    def settle(self, refs: list[Any]) -> list[str]:
        """Take in replacements that are ready; give up on those Ray cannot place."""
        notes = []
        for ref in refs:
            worker, _ = self.starting.pop(ref)
            try:
                self.ray.get(ref)
                self.idle.append(worker)
                self.alive += 1
                notes.append("a replacement worker joined")
            except self.ray.exceptions.RayError as exc:
                self.ray.kill(worker)
                notes.append(f"a replacement worker failed: {_cause(exc)}")
        now = time.monotonic()
        for ref, (worker, deadline) in list(self.starting.items()):
            if now > deadline:
                del self.starting[ref]
                self.ray.kill(worker)
                notes.append("no node could take a replacement worker: going on with "
                             f"{self.alive}")
        return notes

    def facts(self) -> BackendFacts:
        """The backend's facts as a worker sees them (the workers are alike: the first
        idle one is asked)."""
        try:
            return self.ray.get(self.idle[0].facts.remote(), timeout=RESOURCE_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            return BackendFacts(None, f"a launch worker took more than "
                                f"{RESOURCE_TIMEOUT_S:.0f} s to gather them")
        except self.ray.exceptions.RayError as exc:
            return BackendFacts(None, f"a launch worker could not gather them: {_cause(exc)}")

    def shutdown(self) -> None:
        for worker, _ in self.starting.values():
            self.ray.kill(worker)
        self.starting.clear()


@contextlib.contextmanager
def study_lock(spec: StudySpec) -> Iterator[None]:
    """Hold the study's output folder for this search: two searches of one study would
    mark each other's running launches stale. Also proves the folder writable, before any
    server is launched."""
    folder = spec.output_dir
    try:
        folder.mkdir(parents=True, exist_ok=True)
        check_writable(folder)
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise TreetuneError(f"the output folder {folder} is not writable ({exc.strerror}); "
                            "choose another with --output or fix its permissions") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise TreetuneError(
                f"another treetune search (pid {holder}) is running study '{spec.name}' in "
                f"{folder}; wait for it to finish or stop it, then rerun to resume") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def run_study(spec: StudySpec, on_progress: Callable[[Progress], None] | None = None,
              store: StudyStore | None = None) -> StudyOutcome:
    """Run (or resume) a study until its budget is spent or the space is exhausted.

    SIGTERM stops it as Ctrl-C does: servers stopped, storage consistent, `interrupted` set.
    """
    check_study(spec)  # bad input is refused before anything is written or started
    previous = _stop_on_sigterm()
    try:
        with study_lock(spec):
            return _run(spec, on_progress, store)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stop_on_sigterm() -> Any:
    """Make SIGTERM raise KeyboardInterrupt (main thread only); returns the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _interrupt)


def _run(spec: StudySpec, on_progress: Callable[[Progress], None] | None,
         store: StudyStore | None) -> StudyOutcome:
    store = store or StudyStore(spec)
    space = load_space(spec.space)
    spec.save(spec.output_dir / SPEC_COPY)  # what `treetune report` reads back
    stale = store.mark_stale()
    launched = store.results()
    progress = Progress(budget=spec.budget.launches, launches_done=len(launched))
    notify = on_progress or (lambda p: None)
    if stale:
        progress.message = f"{stale} launch(es) of an earlier run were stale: redoing them"
    in_flight: dict[Any, _Launch] = {}  # Ray object ref -> launch under way
    reschedules: dict[str, int] = {}
    deadline = (time.monotonic() + spec.budget.wall_time_s) if spec.budget.wall_time_s else None
    planner: Planner | None = None

    def budget_left() -> bool:
        assert planner is not None
        used = planner.launches + len(in_flight)
        if spec.budget.launches is not None and used >= spec.budget.launches:
            return False
        return deadline is None or time.monotonic() < deadline

    def running() -> list[str]:
        return [x.task.key for x in in_flight.values()]

    failed_base = merge_all(launched).get("baseline")
    if failed_base is not None and not failed_base.ok:
        raise TreetuneError(f"the baseline launch failed: {failed_base.reason}; fix the "
                            "server setup and start a new study")
    ray_session = _Ray(spec)
    _stop_on_sigterm()  # ray.init installs its own SIGTERM handler, which just exits
    ray = ray_session.ray
    interrupted = False
    pool: _Pool | None = None
    try:
        pool = _Pool(ray, *_start_workers(ray, spec))
        # The search's prior comes from a worker: the GPUs and model files servers use.
        planner = Planner(spec, store, space, launched, tp=spec.tp, facts=pool.facts())
        _decide(planner, store, progress)
        progress.message = progress.message or f"strategy {planner.strategy_name}"
        if planner.note:
            progress.notes.append(planner.note)
        notify(progress)
        while True:
            while pool.idle and budget_left():
                task = planner.next()
                if task is None:
                    break
                worker = pool.idle.pop(0)
                trial = store.begin_launch(task.config, ())
                ref = worker.run.remote(task.key, [], task.index)
                in_flight[ref] = _Launch(task, trial, worker)
                progress.running = running()
                progress.message = (f"re-measuring {task.config} (borderline)" if task.remeasure
                                    else f"launched {task.config} on a worker")
                notify(progress)
            if not in_flight and (pool.idle or not pool.starting):
                if pool.alive == 0 and (planner.queue or budget_left()):
                    raise TreetuneError("every launch worker died and none could be replaced; "
                                        "results so far are stored: rerun to resume")
                break
            waiting = [*in_flight, *pool.starting]
            done, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            for note in pool.settle([r for r in done if r in pool.starting]):
                progress.message = note
                notify(progress)
            for ref in (r for r in done if r in in_flight):
                launch = in_flight.pop(ref)
                task = launch.task
                config = task.config
                try:
                    result = LaunchResult.from_dict(ray.get(ref))
                except ray.exceptions.RayActorError as exc:
                    # The worker process (or its node) died: its server died with it. The
                    # launch is not a result: it is done again on another worker.
                    pool.alive -= 1
                    pool.replace(spec)
                    store.abandon(launch.trial, store.launches,
                                  f"worker died: {_cause(exc)}; rescheduled")
                    reschedules[task.key] = reschedules.get(task.key, 0) + 1
                    if reschedules[task.key] <= MAX_RESCHEDULES:
                        planner.requeue(task)
                        progress.message = f"a worker died running {config}: rescheduled"
                        progress.running = running()
                        notify(progress)
                        continue
                    result = LaunchResult(config, reason=f"its worker died "
                                          f"{reschedules[task.key]} times: {_cause(exc)}")
                    launch.trial = store.begin_launch(config, ())
                except ray.exceptions.RayError as exc:
                    result = LaunchResult(config, reason=f"worker failed: {_cause(exc)}")
                    pool.idle.append(launch.worker)
                else:
                    pool.idle.append(launch.worker)
                store.finish_launch(launch.trial, result)
                planner.finish(task, result)
                progress.launches_done = planner.launches
                progress.running = running()
                progress.message = (f"measured {config}" if result.ok
                                    else f"{config} failed: {result.reason}")
                if result.ok and result.attempts > 1:
                    progress.message += f" (second server: {result.retried_because})"
                progress.notes += [f"{config}: {warning}" for warning in result.warnings]
                if config is BASELINE and not result.ok and planner.baseline is None:
                    raise TreetuneError(f"the baseline launch failed: {result.reason}\n"
                                        f"{result.log_tail}")
                _decide(planner, store, progress)
                notify(progress)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for launch in in_flight.values():
            store.abandon(launch.trial, store.launches, "interrupted")
            ray.kill(launch.worker)  # its server dies with it (parent-death signal)
        if planner is not None:
            planner.abandon("interrupted" if interrupted else "search ended")
        in_flight.clear()
        if pool is not None:
            pool.shutdown()
        ray_session.shutdown()
    if planner is None:  # interrupted before the search began: nothing new to report
        raise KeyboardInterrupt
    return StudyOutcome(spec, list(planner.results.values()), planner.baseline, interrupted,
                        stale, planner.launches, planner.strategy_name,
                        _decide(planner, store, progress))


def _decide(planner: Planner, store: StudyStore, progress: Progress) -> list[Recommendation]:
    """What the launches so far recommend: stored with the study (the report and notebooks
    read it back), and the progress line's best is the mixed recommendation per batch."""
    recs = planner.decide()
    if recs:
        store.save_recommendations(recs, planner.strategy_name)
    progress.best = {r.batch: (r.config.label(), r.mean_speedup) for r in recs
                     if r.workload == MIXED and r.config is not BASELINE}
    return recs
