"""The search loop: baseline and compared configs first, then proposals, launched on Ray
workers in parallel until the budget is spent; every result is stored as it arrives."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treetune import stopping
from treetune.backends import BackendFacts
from treetune.backends.sglang import groups_unpriced, tp_priced
from treetune.config import BASELINE, TreeConfig
from treetune.datasets import load_datasets
from treetune.errors import TreetuneError, clip
from treetune.results import LaunchResult, config_from_key, config_key
from treetune.space import SearchSpace, load_space
from treetune.study.claims import STALE_AFTER_S, Claim, Claims
from treetune.study.evidence import merge_all, worker_host
from treetune.study.methods import method_spaces
from treetune.study.placement import (
    CPUS_PER_SERVER,
    RAY_GPU,
    STRATEGY,
    Placement,
    gpu_nodes,
    plan_placement,
)
from treetune.study.planner import Planner, Task
from treetune.study.preflight import check_study
from treetune.study.recommend import MIXED, Recommendation
from treetune.study.spec import SPEC_COPY, StudySpec
from treetune.study.storage import STORAGE_ERRORS, StudyStore, check_writable, storage_lost
from treetune.study.worker import SHIPPED_LOGS, LaunchWorker, log_name, set_aside, store_logs

RESOURCE_TIMEOUT_S = 120.0  # how long to wait for Ray to place the workers
LOCK_FILE = ".treetune.lock"
MAX_RESCHEDULES = 2  # a launch whose worker dies more often than this is recorded failed
BASELINE_TAIL_LINES = 15  # of a failed baseline's server log, in the error (all: its log)
STAGE_POLL_S = 5.0  # how often the workers are asked what their launches do now
ORPHAN_AFTER = 10  # stale times an untagged proposal waits before it is failed (`_Others`)
FIX = " To fix: "  # where a launch warning's remedy begins (said once, `_run`)
POLL_S = 2.0  # how often a search sharing its storage looks at the other searches' launches


@dataclass
class Progress:
    """What the progress display shows; the runner updates it after every event."""

    budget: int | None
    launches_done: int = 0
    running: list[str] = field(default_factory=list)
    stages: dict[str, str] = field(default_factory=dict)  # running key -> what it does now
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
    ended: str = ""  # why the search stopped, when it was not interrupted


class _Ray:
    """Ray for the duration of a study: local unless an address is given."""

    def __init__(self, spec: StudySpec) -> None:
        import ray

        self.ray = ray
        self.started_here = False
        self.saved_env: dict[str, str | None] = {}  # what _authenticate changed
        if ray.is_initialized():
            return
        local = spec.local_ray
        self._authenticate(local)
        kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False,
                                      configure_logging=False)
        try:
            with _own_sigterm(ray):
                if not local:
                    try:
                        ray.init(address=spec.ray_address, **kwargs)
                    except Exception as exc:
                        raise TreetuneError(f"cannot reach the Ray cluster at "
                                            f"{spec.ray_address}: {exc}") from None
                else:
                    workers = spec.workers or 1
                    gpu = spec.backend.gpu_resource
                    # Ray finds real GPUs itself; a backend's own resource is declared here.
                    resources = None if gpu == RAY_GPU else {gpu: float(workers * spec.tp)}
                    temp = os.environ.get("TREETUNE_RAY_TMPDIR")
                    # Workers at the driver's niceness (Ray's default adds 15): they launch
                    # the servers and measure them, and must not get the CPU after
                    # everything else on the machine.
                    with _own_process_groups():
                        ray.init(num_cpus=workers + 1, resources=resources,
                                 _system_config={"worker_niceness": 0},
                                 **({"_temp_dir": temp} if temp else {}), **kwargs)
        except BaseException:
            # Failed or stopped midway: what ray.init started goes (its agents outlived an
            # interrupted start), and the environment is as it was.
            with contextlib.suppress(Exception):
                ray.shutdown()
            self._restore_env()
            raise
        self.started_here = True

    def _authenticate(self, local: bool) -> None:
        """Ray's authentication for this study, unless RAY_AUTH_MODE says the user's.

        A local cluster: Ray's GCS and raylets listen on every interface (Ray 2.60 has no
        loopback-only bind), so without authentication anyone who reaches this machine
        could run code in the study's workers and read their environment: token mode, with
        the user's RAY_AUTH_TOKEN or one made for the run, in the environment its Ray
        processes inherit (nothing written to ~/.ray, as Ray's own default would). A
        cluster to join: token mode when a token is at hand where Ray looks for one (for an
        explicit address Ray never turns it on itself)."""
        if "RAY_AUTH_MODE" in os.environ:
            return
        config = _ray_config()
        if not local:
            if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or (
                    Path.home() / ".ray" / "auth_token").is_file():
                self._set_env("RAY_AUTH_MODE", "token")
                if config is not None:  # Ray read its mode when imported: read it again
                    config.initialize("")
            return
        if config is None:
            # Ray read its mode when imported, and cannot be told again: as the tests run.
            self._set_env("RAY_AUTH_MODE", "disabled")
            return
        self._set_env("RAY_AUTH_MODE", "token")
        if not os.environ.get("RAY_AUTH_TOKEN"):
            self._set_env("RAY_AUTH_TOKEN", secrets.token_hex(32))
        config.initialize("")

    def _set_env(self, name: str, value: str) -> None:
        self.saved_env.setdefault(name, os.environ.get(name))
        os.environ[name] = value

    def _restore_env(self) -> None:
        for name, value in self.saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self.saved_env and (config := _ray_config()) is not None:
            config.initialize("")
        self.saved_env = {}

    def shutdown(self) -> None:
        if self.started_here:
            self.ray.shutdown()
        self._restore_env()


@contextlib.contextmanager
def _own_process_groups() -> Iterator[None]:
    """The processes a local ray.init starts (GCS, raylet, and through the raylet its agents
    and workers) in process groups of their own: a SIGTERM to the search's process group,
    as `timeout` and job schedulers send it, then reaches the search alone, which stops
    its servers and shuts its Ray down. Sent to Ray too, it let the dying raylet end the
    search first (Ray's core worker exits 1 when its raylet is gone): no hint to rerun,
    its launches left running. Ray already blocks Ctrl-C in those processes for the same
    reason. Only where they still die with the search by the kernel's parent-death signal
    (Linux): elsewhere Ray's reaper ends them by signalling its own process group, which
    they must then share. Ray starts them through `ray._private.services.ConsolePopen`;
    where a Ray has none, its processes stay in the search's group."""
    try:
        services = importlib.import_module("ray._private.services")
        utils = importlib.import_module("ray._private.utils")
    except ImportError:
        services = utils = None
    popen = getattr(services, "ConsolePopen", None)
    fate_shared = getattr(utils, "detect_fate_sharing_support", lambda: False)
    if (not sys.platform.startswith("linux") or not isinstance(popen, type)
            or not issubclass(popen, subprocess.Popen) or not fate_shared()):
        yield
        return

    class Grouped(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = Grouped
    try:
        yield
    finally:
        services.ConsolePopen = popen


@contextlib.contextmanager
def _own_sigterm(ray: Any) -> Iterator[None]:
    """ray.init installs, for its length and after, a SIGTERM handler that just exits: a
    SIGTERM while Ray starts then left its agents running (a start stopped midway is not
    Ray's to clean up). Ours stays in place instead (`treetune.stopping`: the stop waits
    for the start, and Ray is then shut down whole). Ray's installer is
    `ray._private.utils.set_sigterm_handler`; where a Ray has none, Ray's handler stands."""
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    original = getattr(utils, "set_sigterm_handler", None)
    if original is None:
        yield
        return
    utils.set_sigterm_handler = lambda handler: None  # type: ignore[union-attr]
    try:
        yield
    finally:
        utils.set_sigterm_handler = original  # type: ignore[union-attr]


def _ray_config() -> Any:
    """Ray's config, whose `initialize("")` makes Ray read its authentication settings
    from the environment again (Ray reads them when imported), as Ray does when it turns
    token authentication on itself (`authentication_token_setup`); None where this Ray has
    none to call."""
    try:
        from ray._raylet import Config
    except ImportError:
        return None
    return Config


def _placement(ray: Any, spec: StudySpec) -> Placement:
    """Where the study's servers go on this cluster (refused before any worker starts)."""
    return plan_placement(spec, gpu_nodes(ray.nodes(), spec.backend.gpu_resource))


def worker_count(spec: StudySpec, placement: Placement) -> tuple[int, str]:
    """The workers a study asks for: `workers`, or one per GPU group the cluster offers. On
    a cluster, workers beyond the groups it offers now wait for GPUs (an autoscaler's nodes,
    nodes that join later); on this machine none will come, and a note says so."""
    if spec.workers is None or not spec.local_ray or spec.workers <= placement.groups:
        return spec.workers or placement.groups, ""
    return placement.groups, (
        f"workers: {spec.workers} asked, but this machine holds {placement.groups} "
        f"server(s) of {spec.tp} {spec.backend.gpu_label} at once: the study runs with "
        f"{placement.groups}")


def _cause(exc: BaseException) -> str:
    """The one line that says why a Ray call failed (the remote exception's message)."""
    cause = getattr(exc, "cause", None) or exc
    lines = [line for line in str(cause).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(cause).__name__


class _Pool:
    """The launch workers, each in a placement group of its own (one bundle: its server's
    GPUs on one node): idle ones, and replacements for dead ones being placed."""

    def __init__(self, ray: Any, spec: StudySpec, placement: Placement) -> None:
        # The workers' copy names the output folder absolutely: a worker on this host may
        # run from another folder (a node started by `ray start` elsewhere).
        self.ray, self.placement = ray, placement
        self.spec = dataclasses.replace(spec, output=str(spec.output_dir.resolve()))
        # Loaded here, once: every worker measures the same prompts, wherever its node is
        # and whatever files it holds.
        self.prompts = ray.put(load_datasets(spec.datasets, base_dir=Path(spec.base_dir)))
        gpu = placement.resource
        options: dict[str, Any] = ({"num_gpus": spec.tp} if gpu == RAY_GPU
                                   else {"resources": {gpu: spec.tp}})
        # Restarts are ours to make: a dead worker's launch is rescheduled, not replayed by Ray.
        # Two calls at once: the progress line asks what a launch does while it runs.
        self.options = {**options, "num_cpus": CPUS_PER_SERVER, "max_restarts": 0,
                        "max_concurrency": 2}
        self.actor = ray.remote(LaunchWorker)
        self.groups: dict[Any, Any] = {}  # worker -> its placement group
        self.nodes: dict[Any, str | None] = {}  # worker -> the node its bundle is on
        self.hosts: dict[Any, str] = {}  # worker -> its host, as its launches name it
        self.idle: list[Any] = []
        self.alive = 0
        # Workers waiting for Ray to place them: ready ref -> (worker, deadline); those past
        # their deadline that the study was told of.
        self.starting: dict[Any, tuple[Any, float]] = {}
        self.told: set[Any] = set()
        self.made = 0
        self.gpu: str | None = None  # the GPU model the study's servers run on, once seen
        self.models: dict[Any, str | None] = {}  # worker -> the GPU model its tool named
        # Placement groups of workers left out for their GPU model: kept reserved, so that
        # Ray places no other worker on those GPUs (freed at shutdown).
        self.blocked: list[Any] = []

    def _spawn(self) -> Any:
        """A worker in a new placement group; it runs once Ray has placed the group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = self.ray.util.placement_group([self.placement.bundle()], strategy=STRATEGY)
        worker = self.actor.options(**self.options, scheduling_strategy=(
            PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0))
        ).remote(self.spec, self.made, self.prompts, socket.gethostname())
        self.made += 1
        self.groups[worker] = group
        return worker

    def start(self, count: int) -> str:
        """`count` workers, started once those the cluster's GPUs can hold are placed and
        ready, or RESOURCE_TIMEOUT_S has passed (at least one must be ready). The others
        wait for GPUs (a shared cluster's in use, a node an autoscaler adds or that joins
        later) and join the study when Ray places them (`settle`). Returns a note when
        fewer than `count` started ('' otherwise)."""
        workers = [self._spawn() for _ in range(count)]
        refs = {w.ready.remote(): w for w in workers}
        placeable = max(1, min(count, self.placement.groups))
        ready, waiting = self.ray.wait(list(refs), num_returns=placeable,
                                       timeout=RESOURCE_TIMEOUT_S)
        names: dict[Any, str] = {}
        gpus: dict[Any, str | None] = {}
        failed: list[str] = []  # why workers placed could not start (their node's checks)
        for ref in ready:
            try:
                names[refs[ref]], gpus[refs[ref]] = self.ray.get(ref)
            except self.ray.exceptions.RayError as exc:
                failed.append(_cause(exc))
                self.retire(refs[ref])
        self.gpu = self._study_gpu([g for g in gpus.values() if g is not None])
        apart = [w for w in names if not self._same_gpu(gpus[w])]
        for worker in apart:
            self.set_aside(worker)
        gpu_note = self._apart_note([(names.pop(w), gpus[w]) for w in apart])
        self.models.update({w: gpus[w] for w in names})
        on = f" on {self.placement.gpu_type} nodes" if self.placement.gpu_type else ""
        if not names:
            for ref in waiting:
                self.retire(refs[ref])
            if failed:
                raise TreetuneError(f"a launch worker could not start: {failed[0]}")
            raise TreetuneError(f"Ray could not place {count} workers of {self.spec.tp} "
                                f"{self.spec.backend.gpu_label}{on} within "
                                f"{RESOURCE_TIMEOUT_S:.0f} s")
        self.idle = list(names)
        self.alive = len(names)
        self.hosts = {w: worker_host(name) for w, name in names.items()}
        deadline = time.monotonic() + RESOURCE_TIMEOUT_S
        self.starting.update({ref: (refs[ref], deadline) for ref in waiting})
        notes = [f"{len(failed)} launch worker(s) could not start: {failed[0]}"] if failed else []
        notes += [gpu_note] if gpu_note else []
        if waiting:
            self.told.update(waiting)  # said here: not again when their deadline passes
            gpus = f"{self.spec.tp} {self.spec.backend.gpu_label}{on}"
            notes.append(
                f"{len(waiting)} of {count} workers wait for nodes (the cluster holds "
                f"{self.placement.groups} server(s) of {gpus}), and join when Ray places them"
                if count > self.placement.groups else
                f"Ray placed {len(ready)} of {count} workers of {gpus} within "
                f"{RESOURCE_TIMEOUT_S:.0f} s (the others' GPUs are in use): {len(waiting)} "
                "wait, and join when Ray places them")
        if notes:
            notes.append(f"the study runs with {len(names)}")
        return "; ".join(notes)

    def _study_gpu(self, seen: list[str]) -> str | None:
        """The GPU model the study runs on: the one its backend is told to assume (`gpu`)
        when a worker has it, else the one most workers have (the first's on a tie)."""
        wanted = getattr(self.spec.backend, "gpu", None)
        if wanted is not None:
            from treetune.facts import gpu_facts

            with contextlib.suppress(TreetuneError):
                if (name := gpu_facts(wanted).name) in seen:
                    return name
        return max(seen, key=seen.count, default=None)

    def _same_gpu(self, gpu: str | None) -> bool:
        """Whether a worker's GPUs may serve the study: the study's model, or one no tool
        named (nothing to compare)."""
        return gpu is None or self.gpu is None or gpu == self.gpu

    def _apart_note(self, apart: list[tuple[str, str | None]]) -> str:
        """What the study says of workers left out for their GPU model ("" for none)."""
        if not apart:
            return ""
        where = ", ".join(f"{name} ({gpu})" for name, gpu in apart)
        alike = (f" (Ray's accelerator type names them alike: {self.placement.gpu_type})"
                 if self.placement.gpu_type else "")
        return (f"{len(apart)} launch worker(s) left out for their GPUs: {where}, where the "
                f"study's servers run on {self.gpu}{alike}; one study never mixes two GPU "
                "models' measurements (run it on nodes of one model; their GPUs stay "
                "reserved, so that no other worker is placed there)")

    def set_aside(self, worker: Any) -> None:
        """A worker left out for its GPU model: gone, its GPUs kept reserved (a freed
        group would bring the next worker to the same GPUs)."""
        group = self.groups.pop(worker, None)
        if group is not None:
            self.blocked.append(group)
        self.retire(worker)

    def retire(self, worker: Any) -> None:
        """A worker gone (dead, or not placed): killed, its GPUs' reservation freed."""
        with contextlib.suppress(Exception):  # already dead, or its node gone
            self.ray.kill(worker)
        group = self.groups.pop(worker, None)
        self.nodes.pop(worker, None)
        self.hosts.pop(worker, None)
        self.models.pop(worker, None)
        if group is not None:
            with contextlib.suppress(Exception):
                self.ray.util.remove_placement_group(group)

    def node_of(self, worker: Any) -> str | None:
        """The Ray node a worker's bundle is on (kept with each launch it runs)."""
        if worker not in self.nodes:
            try:
                table = self.ray.util.placement_group_table(self.groups[worker])
                self.nodes[worker] = table.get("bundles_to_node_id", {}).get(0)
            except Exception:  # the state API is advisory here
                self.nodes[worker] = None
        return self.nodes[worker]

    def host_of(self, worker: Any) -> str:
        """The host a worker runs on, as its launches name it (`evidence.node_of`)."""
        return self.hosts.get(worker, "")

    def replace(self) -> None:
        """Ask for a new worker in place of a dead one; it joins when Ray places it."""
        worker = self._spawn()
        self.starting[worker.ready.remote()] = (worker, time.monotonic() + RESOURCE_TIMEOUT_S)

    def settle(self, refs: list[Any]) -> list[str]:
        """Take in the waiting workers that are ready. One that Ray has not placed within
        RESOURCE_TIMEOUT_S keeps waiting while the study has workers to go on with (its
        node may come back, or a new one join); with none, it is given up on."""
        notes = []
        for ref in refs:
            worker, _ = self.starting.pop(ref)
            self.told.discard(ref)
            try:
                name, gpu = self.ray.get(ref)
            except self.ray.exceptions.RayError as exc:
                self.retire(worker)
                notes.append(f"a worker that joined could not start: {_cause(exc)}")
                continue
            if not self._same_gpu(gpu):
                self.set_aside(worker)
                notes.append(self._apart_note([(name, gpu)]))
                continue
            self.gpu = self.gpu or gpu  # the first named (those before named none)
            self.models[worker] = gpu
            self.hosts[worker] = worker_host(name)
            self.idle.append(worker)
            self.alive += 1
            notes.append(f"a worker joined on {self.hosts[worker] or 'a node'}: the study "
                         f"runs with {self.alive}")
        now = time.monotonic()
        late = [ref for ref, (_, deadline) in self.starting.items() if now > deadline]
        if self.alive == 0 and late:
            for ref in late:
                self.retire(self.starting.pop(ref)[0])
                self.told.discard(ref)
            notes.append(f"no node could take {len(late)} waiting worker(s)")
        elif untold := [ref for ref in late if ref not in self.told]:
            self.told.update(untold)
            notes.append(f"{len(untold)} replacement worker(s) not placed within "
                         f"{RESOURCE_TIMEOUT_S:.0f} s: the study goes on with {self.alive}, "
                         "and they join when Ray places them (a node back, or a new one)")
        return notes

    def facts(self, worker: Any = None) -> BackendFacts:
        """The backend's facts as a worker sees them (`worker`, else the first idle one
        whose tool named the study's GPU model: the workers are alike)."""
        if worker is None:
            named = [w for w in self.idle if self.models.get(w) == self.gpu]
            worker = (named or self.idle)[0]
        try:
            return self.ray.get(worker.facts.remote(),
                                timeout=RESOURCE_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            return BackendFacts(None, f"a launch worker took more than "
                                f"{RESOURCE_TIMEOUT_S:.0f} s to gather them")
        except self.ray.exceptions.RayError as exc:
            return BackendFacts(None, f"a launch worker could not gather them: {_cause(exc)}")

    def shutdown(self) -> None:
        for worker in list(self.groups):
            self.retire(worker)
        for group in self.blocked:
            with contextlib.suppress(Exception):
                self.ray.util.remove_placement_group(group)
        self.blocked.clear()
        self.starting.clear()
        self.told.clear()


class _Stages:
    """What each running launch does now (its worker's `stage`: its server starting, the
    cell it measures), asked every STAGE_POLL_S without waiting on the answers: for the
    progress line, through launches that take minutes."""

    def __init__(self, ray: Any) -> None:
        self.ray = ray
        self.asked: dict[Any, str] = {}  # stage() ref -> its launch's config key
        self.due = 0.0

    def poll(self, in_flight: dict[Any, _Launch], progress: Progress) -> bool:
        """Take in the answers come, ask again when due; True when a stage changed."""
        changed = False
        if self.asked:
            ready, _ = self.ray.wait(list(self.asked), num_returns=len(self.asked), timeout=0)
            for ref in ready:
                key = self.asked.pop(ref)
                try:
                    stage = self.ray.get(ref)
                except self.ray.exceptions.RayError:
                    continue  # its worker died: the launch's own result says so
                if key in progress.running and progress.stages.get(key) != stage:
                    progress.stages[key] = stage
                    changed = True
        if not self.asked and in_flight and time.monotonic() >= self.due:
            self.due = time.monotonic() + STAGE_POLL_S
            self.asked = {launch.worker.stage.remote(): launch.task.key
                          for launch in in_flight.values()}
        return changed


@contextlib.contextmanager
def study_lock(spec: StudySpec) -> Iterator[None]:
    """Hold the study's output folder for this search: two searches writing one folder
    would overwrite each other's outputs, and with SQLite (one search per study) mark each
    other's running launches stale. Also proves the folder writable, before any server is
    launched."""
    folder = spec.output_dir
    if folder.exists() and not folder.is_dir():
        raise TreetuneError(f"the output folder {folder} is a file, not a folder: choose "
                            "another with --output")
    created = not folder.exists()
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
            shared = ("" if not spec.shared_storage else
                      "; searches that share a database storage each need an --output of "
                      "their own")
            raise TreetuneError(
                f"another treetune search (pid {holder}) is running study '{spec.name}' in "
                f"{folder}; wait for it to finish or stop it, then rerun to resume"
                + shared) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
        # A search refused before it wrote anything (a storage URL that does not load)
        # leaves no folder of its own making behind.
        with contextlib.suppress(OSError):  # gone or unreadable: not ours to mend
            if created and {p.name for p in folder.iterdir()} == {LOCK_FILE}:
                (folder / LOCK_FILE).unlink()
                folder.rmdir()


def run_study(spec: StudySpec, on_progress: Callable[[Progress], None] | None = None,
              store: StudyStore | None = None) -> StudyOutcome:
    """Run (or resume) a study until its budget is spent or the space is exhausted.

    SIGTERM stops it as Ctrl-C does: servers stopped, storage consistent, `interrupted` set.
    """
    check_study(spec)  # bad input is refused before anything is written or started
    restore = stopping.install()
    try:
        with study_lock(spec):
            return _run(spec, on_progress, store)
    except STORAGE_ERRORS as exc:
        raise storage_lost(spec.storage_url, exc) from None
    finally:
        restore()
        stopping.clear()  # a stop that ended the study is not the next one's


class _Others:
    """The other searches of a study that shares its storage: their finished launches are
    taken in as this search's, their running launches count as running here, and the
    unfinished launches of a search that died are failed as stale and redone."""

    def __init__(self, store: StudyStore, claims: Claims, seen: set[int]) -> None:
        self.store, self.claims = store, claims
        self.seen = seen  # trial ids of the launches this search knows
        self.due = 0.0  # when to look again
        self.stale = 0
        self.untagged: dict[int, float] = {}  # proposal naming no search -> seen since
        self.orphans_due = 0.0  # when to look for them again (every stale time)
        self.looked = False  # whether the batch studies were told what ended searches left

    def fail_orphans(self, stale_after_s: float | None = None) -> None:
        """Fail the proposals that have named no search for `stale_after_s` (ORPHAN_AFTER
        stale times): a search tags its proposal right after asking it (Optuna samples in
        between, a second at most), so one left untagged that long was asked by a search
        that died between the two writes. Left RUNNING, TPE's constant liar would count it
        as a trial running for good; nothing else waits on it, so the wait is long. A
        live search whose proposal was failed all the same asks again
        (`BatchStudies.ask`)."""
        if stale_after_s is None:
            stale_after_s = ORPHAN_AFTER * STALE_AFTER_S
        now = time.monotonic()
        self.untagged = {trial_id: self.untagged.get(trial_id, now)
                         for trial_id in self.store.untagged_proposals()}
        for trial_id, since in list(self.untagged.items()):
            if now - since >= stale_after_s:
                self.store.fail_stale(trial_id)
                del self.untagged[trial_id]

    def follow(self, planner: Planner, progress: Progress, force: bool = False) -> bool:
        """Look at the storage (every POLL_S, or now when forced); True when anything
        changed that the planner may act on."""
        if not force and time.monotonic() < self.due:
            return False
        self.due = time.monotonic() + POLL_S
        changed = reaped = False
        for driver in self.claims.dead():
            # A launch whose result it stored is not stale (`fail_stale`). Its trials are
            # failed before its claims go (`Claims.reap`): each step can be done again.
            stale = sum(trial_id is None or self.store.fail_stale(trial_id)
                        for _key, _index, trial_id in self.claims.unfinished(driver))
            self.store.mark_stale(driver)  # its proposals, and a launch not claimed yet
            reaped |= self.claims.reap(driver)
            self.stale += stale
            progress.notes.append("a search of this study stopped beating" + (
                f": its {stale} running launch(es) are stale, to be redone" if stale else ""))
            changed = True
        if time.monotonic() >= self.orphans_due:  # they wait ten stale times: no hurry
            self.orphans_due = time.monotonic() + STALE_AFTER_S
            self.fail_orphans()
        # Claims first: a claim seen done has its result stored already (stored, then done).
        running, _ = self.claims.others()
        finished = self.store.finished_launches()
        if changed:  # a dead search may have stored a result without marking its claim done
            self.claims.sync([(s.trial_id, config_key(s.result.config)) for s in finished])
        for stored in finished:
            if stored.trial_id in self.seen:
                continue
            self.seen.add(stored.trial_id)
            key = config_key(stored.result.config)
            index = stored.index if stored.index is not None else sum(
                1 for r in planner.launched if config_key(r.config) == key)
            planner.absorb(stored.result, index)
            progress.message = f"another search measured {stored.result.config}"
            changed = True
        live = {(r.key, r.index) for r in running}
        for task in planner.elsewhere:
            if (task.key, task.index) not in live:  # given up there: free to launch here
                planner.given_up(task.key, task.index)
                changed = True
        known = {(t.key, t.index) for t in planner.elsewhere}
        for claim in running:
            if (claim.key, claim.index) not in known:
                planner.expect(config_from_key(claim.key), claim.index)
                changed = True
        if reaped or not self.looked:
            # What searches that ended (or died: told by the one that reaped them) left
            # untold; a running search tells its own trees.
            self.looked = True
            beating = self.claims.beating()
            planner.tell_untold({key for key, drivers in self.store.measured_by().items()
                                 if drivers & beating})
        return changed


def _run(spec: StudySpec, on_progress: Callable[[Progress], None] | None,
         store: StudyStore | None) -> StudyOutcome:
    store = store or StudyStore(spec)
    space = load_space(spec.space)
    spec.save(spec.output_dir / SPEC_COPY)  # what `treetune report` reads back
    claims = Claims.of(store.storage, spec.name)
    shared = spec.shared_storage
    store.driver = claims.driver if claims is not None else None
    # With SQLite the output folder's lock proves this the study's only search: whatever
    # an earlier one left running is stale. Sharing a database, only what a search that
    # stopped beating left running is (found as the search goes).
    stale_launches = [] if shared else store.mark_stale()
    for key, index in stale_launches:
        if key:  # else it never started a server
            set_aside(spec.output_dir / "logs", key, index)
    stale = len(stale_launches)
    finished = store.finished_launches()
    if claims is not None:
        if not shared:
            claims.forget_unfinished()
        claims.sync([(s.trial_id, config_key(s.result.config)) for s in finished])
    launched = [s.result for s in finished]
    known = {s.trial_id for s in finished}  # the launches the planner counts, by trial id
    progress = Progress(budget=spec.budget.launches, launches_done=len(launched))
    notify = on_progress or (lambda p: None)
    if launched and store.cached_prefixes and spec.backend.api.prefix_cache:
        progress.notes.append(
            "this study's earlier launches ran with the server's prefix cache on (treetune "
            "before 2026-12-04), its new ones without: their prefills differ, so they do not "
            "compare alike; start a new study (--name or --output) to measure them alike")
    if stale:
        # Said above the progress line: the message line is overwritten by the next one.
        progress.notes.append(f"{stale} launch(es) of an earlier run were left unfinished "
                              "(its search was killed): redoing them")
    in_flight: dict[Any, _Launch] = {}  # Ray object ref -> launch under way
    # Per launch (a config's n-th): one whose worker dies more than MAX_RESCHEDULES times
    # is recorded failed; a config's other launches each get their own tries.
    reschedules: dict[tuple[str, int], int] = {}
    deadline = (time.monotonic() + spec.budget.wall_time_s) if spec.budget.wall_time_s else None
    planner: Planner | None = None
    others: _Others | None = None
    spent = False  # the study's budget is taken by other searches' claims (until a look)
    warned: dict[str, str] = {}  # each launch warning -> the config it was first seen on
    remedies: set[str] = set()  # the warnings' remedies said ("To fix: ...")

    def budget_left() -> bool:
        assert planner is not None
        used = planner.launches + len(in_flight) + len(planner.elsewhere)
        if spent or (spec.budget.launches is not None and used >= spec.budget.launches):
            return False
        return deadline is None or time.monotonic() < deadline

    def running() -> list[str]:
        return [x.task.key for x in in_flight.values()]

    failed_base = merge_all(launched).get("baseline")
    if failed_base is not None and not failed_base.ok:
        if (spent_on := _budget_spent(spec, len(launched))) is not None:
            # Nothing would be launched, and the run would end on "no baseline measured".
            raise TreetuneError(
                f"the baseline's launch failed in an earlier run "
                f"({clip(failed_base.reason, 300)}), and {spent_on}: once the server setup "
                f"is fixed, rerun with a larger --budget-launches to launch it again")
        progress.notes.append(f"the baseline's launch failed in an earlier run "
                              f"({clip(failed_base.reason, 300)}): launching it again")
    ray_session: _Ray | None = None
    interrupted = False
    pool: _Pool | None = None
    try:
        # A stop while Ray starts waits for it: Ray is then shut down whole (stopped
        # midway, ray.init left its agents running).
        with stopping.held():
            try:
                ray_session = _Ray(spec)
            except SystemExit:  # Ray's own SIGTERM handler, in place while ray.init runs
                raise KeyboardInterrupt from None
            # Where ray.init installed its own SIGTERM handler (which just exits: a Ray
            # without the installer _own_sigterm keeps out), ours again.
            stopping.install((signal.SIGTERM,))
        ray = ray_session.ray
        stages = _Stages(ray)
        placement = _placement(ray, spec)
        store.check_gpu_type(placement.gpu_type)
        pool = _Pool(ray, spec, placement)
        count, capped = worker_count(spec, placement)
        if capped:
            progress.notes.append(capped)
        if short := pool.start(count):
            progress.notes.append(short)
        # The search's prior comes from a worker: the GPUs and model files servers use.
        planner = Planner(spec, store, space, launched, tp=spec.tp, facts=pool.facts())

        def begin(task: Task, node: str | None = None) -> Any:
            """A launch's trial in storage, counted as known and claimed as this search's."""
            trial = store.begin_launch(task.config, (), launch_index=task.index, node=node,
                                       gpu_type=placement.gpu_type)
            known.add(trial._trial_id)
            if claims is not None:
                claims.attach(task.key, task.index, trial._trial_id)
            return trial

        if shared and claims is not None:
            claims.start_beating()
            others = _Others(store, claims, known)
            others.follow(planner, progress, force=True)
        _decide(planner, store, progress)
        progress.message = progress.message or f"strategy {planner.strategy_name}"
        if planner.note:
            progress.notes.append(planner.note)
        if said := planner.baseline_memory():
            progress.notes.append(f"{said}. It is launched all the same: the prior may be wrong")
        spaces = [space, *(method_spaces(spec, space).values() if spec.methods else ())]
        if (unpinned := unpinned_attention(spec, spaces, resumed=bool(launched))) is not None:
            progress.notes.append(unpinned)
        if spec.unjudged_rates:
            progress.notes.append(spec.unjudged_rates)
        priced: str | None = tp_priced(spec.server_flags)

        def tell_priced() -> None:
            """Said once the model search runs: at the start, or when it takes over."""
            nonlocal priced
            if priced is not None and planner is not None and planner.uses_model:
                said = (priced, groups_unpriced(spec.server_flags, planner.context.prior))
                progress.notes.extend(note for note in said if note)
                priced = None

        tell_priced()
        notify(progress)
        while True:
            stopping.check()  # a stop Python dropped on the way (see treetune.stopping)
            if others is not None and others.follow(planner, progress):
                spent = False
                progress.launches_done = planner.launches
                _decide(planner, store, progress)
                notify(progress)
            while pool.idle and budget_left():
                # The planner hears where the launch will run: each node runs the baseline.
                task = planner.next(pool.host_of(pool.idle[0]))
                if task is None:
                    break
                if claims is not None:
                    claim, task.index = claims.take(task.key, task.index, spec.budget.launches,
                                                    known)
                    if claim is Claim.TAKEN:
                        planner.hand_over(task)
                        progress.message = f"{task.config} is another search's launch"
                        continue
                    if claim is Claim.SPENT:
                        planner.requeue(task)
                        spent = True
                        break
                worker = pool.idle.pop(0)
                trial = begin(task, pool.node_of(worker))
                ref = worker.run.remote(task.key, [], task.index)
                in_flight[ref] = _Launch(task, trial, worker)
                progress.running = running()
                progress.message = (f"re-measuring {task.config} (borderline)" if task.remeasure
                                    else f"launched {task.config} on a worker")
                notify(progress)
            if not in_flight and (pool.idle or not pool.starting):
                if others is not None:
                    if others.follow(planner, progress, force=True):
                        spent = False
                        continue  # other searches' news: maybe more to launch here
                    if planner.elsewhere:  # their results (or failures) are still to come
                        time.sleep(POLL_S)
                        continue
                if pool.alive == 0 and (planner.queue or budget_left()):
                    apart = (f" (workers on GPUs of another model than {pool.gpu} were "
                             "left out, their GPUs kept reserved)" if pool.blocked else "")
                    raise TreetuneError("every launch worker died and none could be replaced"
                                        f"{apart}; results so far are stored: rerun to resume")
                break
            waiting = [*in_flight, *pool.starting]
            # Never longer than the stage poll (a test makes it 0.1 s to see stages).
            done, _ = ray.wait(waiting, num_returns=1, timeout=min(1.0, STAGE_POLL_S))
            if stages.poll(in_flight, progress):
                notify(progress)
            for note in pool.settle([r for r in done if r in pool.starting]):
                progress.message = note
                notify(progress)
            for ref in (r for r in done if r in in_flight):
                launch = in_flight.pop(ref)
                task = launch.task
                config = task.config
                progress.stages.pop(task.key, None)
                try:
                    data = ray.get(ref)
                    if shipped := data.pop(SHIPPED_LOGS, None):
                        store_logs(spec.output_dir / "logs", shipped)
                    result = LaunchResult.from_dict(data)
                except ray.exceptions.RayActorError as exc:
                    # The worker process (or its node) died: its server died with it. The
                    # launch is not a result: it is done again on another worker (its claim
                    # stays this search's).
                    pool.alive -= 1
                    pool.retire(launch.worker)
                    pool.replace()
                    store.abandon(launch.trial, store.launches,
                                  f"worker died: {_cause(exc)}; rescheduled")
                    tries = (task.key, task.index)
                    reschedules[tries] = reschedules.get(tries, 0) + 1
                    if reschedules[tries] <= MAX_RESCHEDULES:
                        planner.requeue(task)
                        progress.message = f"a worker died running {config}: rescheduled"
                        progress.running = running()
                        notify(progress)
                        continue
                    result = LaunchResult(config, reason=f"its worker died "
                                          f"{reschedules[tries]} times: {_cause(exc)}")
                    launch.trial = begin(task)
                except ray.exceptions.RayError as exc:
                    result = LaunchResult(config, reason=f"worker failed: {_cause(exc)}")
                    pool.idle.append(launch.worker)
                else:
                    pool.idle.append(launch.worker)
                store.finish_launch(launch.trial, result)
                if claims is not None:
                    claims.finish(task.key, task.index)
                planner.finish(task, result)
                progress.launches_done = planner.launches
                progress.running = running()
                progress.message = (f"measured {config}" if result.ok
                                    else f"{config} failed: {result.reason}")
                if result.ok and result.attempts > 1:
                    progress.message += f" (second server: {result.retried_because})"
                # The models this launch's server loaded are on its node now (the draft
                # with a tree of the study's own method, whose server loads `draft`).
                own_tree = isinstance(config, TreeConfig) and not config.method
                if (result.ok and planner.awaiting_facts and launch.worker in pool.idle
                        and (note := planner.adopt_facts(pool.facts(launch.worker),
                                                         own_tree))):
                    progress.notes.append(note)
                    tell_priced()
                if result.ok:  # a launch or a node running apart, named once
                    progress.notes += planner.odd_notes(task.key)
                    progress.notes += planner.node_notes()
                    progress.notes += planner.kernel_notes()
                    progress.notes += planner.memory_notes()
                    progress.notes += planner.trend_notes()
                    progress.notes += planner.tuning_notes()
                    progress.notes += planner.static_notes()
                progress.notes += warning_notes(str(config), result.warnings, warned, remedies)
                if config is BASELINE and not result.ok and planner.baseline is None:
                    log = spec.output_dir / "logs" / log_name(
                        task.key, task.index, max(result.attempts - 1, 0))
                    tail = "\n".join(result.log_tail.splitlines()[-BASELINE_TAIL_LINES:])
                    said = planner.baseline_memory()
                    spent_on = _budget_spent(spec, planner.launches)
                    rerun = ("a rerun launches it again once the server setup is fixed"
                             if spent_on is None else f"{spent_on}: once the server setup "
                             "is fixed, rerun with a larger --budget-launches")
                    raise TreetuneError(
                        f"the baseline launch failed: {result.reason}\n(its server's log: "
                        f"{log}; {rerun})"
                        + (f"\n{said}" if said else "")
                        + (f"\nlast lines:\n{tail}" if tail else ""))
                _decide(planner, store, progress)
                notify(progress)
    except KeyboardInterrupt:
        interrupted = True
        stopping.clear()
    finally:
        # The storage may be what failed: what it cannot record is found stale by the next
        # search, and the servers and Ray must go down all the same.
        for launch in in_flight.values():
            ray.kill(launch.worker)  # its server dies with it (parent-death signal)
        _give_up(store, planner, claims, shared, [launch.trial for launch in in_flight.values()],
                 "interrupted" if interrupted else "search ended")
        in_flight.clear()
        # A local Ray goes down whole with the session (its workers, and their servers by
        # the parent-death signal): asking its GCS to free each worker first would wait a
        # minute per call when a SIGTERM to the process group (`timeout`, a job
        # scheduler) has stopped the GCS already.
        if pool is not None and not (interrupted and ray_session is not None
                                     and ray_session.started_here):
            pool.shutdown()
        if ray_session is not None:
            ray_session.shutdown()
    if planner is None:  # interrupted before the search began: nothing new to report
        raise KeyboardInterrupt
    if others is not None:
        stale += others.stale
    ended = "" if interrupted else _why_ended(spec, planner.launches, deadline, spent)
    return StudyOutcome(spec, list(planner.results.values()), planner.baseline, interrupted,
                        stale, planner.launches, planner.strategy_name,
                        _decide(planner, store, progress), ended)


def _give_up(store: StudyStore, planner: Planner | None, claims: Claims | None, shared: bool,
             running: list[Any], reason: str) -> None:
    """The search ends: its `running` launches' trials and its queued proposals failed in
    storage, its claims released, and (`shared`: several searches share the study) its
    heartbeat stopped. The storage may be what failed: what it cannot record is found
    stale by the next search. A search that shares the study then leaves its heartbeat's
    row, so that another search (or its rerun) finds it dead and fails what it left
    running; gone while its trials ran on, nothing would name it again (a helper's
    audit)."""
    quietly = contextlib.suppress(*STORAGE_ERRORS)
    told = 0
    for trial in running:
        with quietly:
            store.abandon(trial, store.launches, "interrupted")
            told += 1
    if planner is not None:
        with quietly:
            planner.abandon(reason)
            told += 1
    recorded = told == len(running) + (planner is not None)
    if claims is not None:
        with quietly:
            claims.release_all()  # what this search will not finish, another may launch
        if shared:
            with quietly:
                claims.stop_beating(forget=recorded)


def unpinned_attention(spec: StudySpec, spaces: Iterable[SearchSpace],
                       resumed: bool = False) -> str | None:
    """The word for a study that leaves SGLang to pick its attention backend, said above
    the progress line once the search starts: the pick follows topk, so trees would be
    compared across kernels. None when it pins one, or when every tree it can launch (its
    `spaces`' and its compared ones) is a chain, all served alike. A `resumed` study has
    launched already: pinning one now makes a new study."""
    if "--attention-backend" in spec.server_flags:
        return None
    trees = [*spec.compare, *(c for space in spaces for c in space.configs())]
    if not any(isinstance(c, TreeConfig) and c.topk > 1 for c in trees):
        return None
    pin = ("pin one the GPU runs for every tree in the study's server_flags (e.g. "
           "{--attention-backend: fa3} on Hopper)")
    return ("no attention backend pinned: SGLang picks one by topk (on Hopper fa3 for "
            "chains, flashinfer or triton for wider trees), so trees may be compared across "
            "kernels; " + (f"this study has launched already: to {pin}, start a new study "
                           "(--name or --output)" if resumed else
                           f"{pin} before its first launch: pinned later, it is a new study"))


def _why_ended(spec: StudySpec, launches: int, deadline: float | None, spent: bool) -> str:
    """Why a search that was not interrupted stopped, for the user: a budget, or nothing
    left that the strategy or the proof of a recommendation would launch."""
    of = f" of {spec.budget.launches}" if spec.budget.launches is not None else ""
    if spent:
        return (f"the study's launch budget is taken by its searches together ({launches}"
                f"{of} launches here and elsewhere)")
    if (spent_on := _budget_spent(spec, launches)) is not None:
        return f"{spent_on}; raise --budget-launches and rerun to search on"
    if deadline is not None and time.monotonic() >= deadline:
        return (f"the wall-time budget of {spec.budget.wall_time_s:g} s is spent "
                f"({launches}{of} launches); rerun to go on")
    return (f"nothing left worth launching ({launches}{of} launches): the strategy proposes "
            "no tree not yet measured and no recommendation needs another launch")


def _budget_spent(spec: StudySpec, launches: int) -> str | None:
    """Said when `launches` spend the study's launch budget (None while some is left)."""
    budget = spec.budget.launches
    if budget is None or launches < budget:
        return None
    return f"the study's launch budget is spent ({launches} of {budget} launches)"


def warning_notes(config: str, warnings: Iterable[str], warned: dict[str, str],
                  remedies: set[str]) -> list[str]:
    """A launch's warnings as notes: each in full once, then by reference to the config it
    was first said of (`warned`: each warning said, and of which config); a remedy ("To
    fix: ...") in full once (`remedies`: those said), since a busy machine lags cell after
    cell alike. Both are updated."""
    notes = []
    for warning in warnings:
        first = warned.setdefault(warning, config)
        if first != config:
            notes.append(f"{config}: the same warning as {first}")
            continue
        head, cut, remedy = warning.partition(FIX)
        if cut and remedy in remedies:
            warning = f"{head}{FIX}as said above."
        remedies.add(remedy)
        notes.append(f"{config}: {warning}")
    return notes


def _decide(planner: Planner, store: StudyStore, progress: Progress) -> list[Recommendation]:
    """What the launches so far recommend: stored with the study (the report and notebooks
    read it back), and the progress line's best is the mixed recommendation per batch."""
    recs = planner.decide()
    if recs:
        store.save_recommendations(recs, planner.strategy_name)
    progress.best = {r.batch: (r.config.label(), r.mean_speedup) for r in recs
                     if r.workload == MIXED and r.config is not BASELINE}
    return recs
