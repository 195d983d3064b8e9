"""Shared fixtures: emulated SGLang servers run as real subprocesses.

Every emulator is started in its own process group (``start_new_session=True``) on a free
loopback port, and the whole group is killed at teardown, whatever the test did.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from treetune.server import free_port

STARTUP_TIMEOUT_S = 20.0
TMP = Path("/tmp")
STRICT_TMP = "TREETUNE_TESTS_STRICT_TMP"  # =1: any new entry in /tmp fails the session
_new_in_tmp: list[str] = []  # shown at the end of the run
RAY_NO_SERVER = "ray-no-server"  # the xdist group of the tests so marked


def _tmp_entries() -> set[str]:
    """The names in /tmp, and in /tmp/ray as `ray/NAME` (Ray's default temp dir may exist
    already, so what a run adds there shows only one level down)."""
    names = set(os.listdir(TMP))
    with contextlib.suppress(OSError):
        names |= {f"ray/{name}" for name in os.listdir(TMP / "ray")}
    return names


@pytest.fixture(scope="session", autouse=True)
def _the_suite_leaves_nothing_in_tmp(tmp_path_factory: pytest.TempPathFactory,
                                     pytestconfig: pytest.Config) -> Iterator[None]:
    """Tests write in tmp_path, and Ray in a short dir of its own that is removed after
    it (studykit.short_ray_dir); the session fails if any of those is left in /tmp, or a
    Ray session named after this process. Any other new entry of /tmp is listed at the end
    of the run, and fails it only with TREETUNE_TESTS_STRICT_TMP=1: on a shared machine
    other processes write to /tmp too, and a guard must not fail for what they do."""
    from studykit import RAY_DIRS

    basetemp = tmp_path_factory.getbasetemp().resolve()
    pytest_own = {basetemp.relative_to(TMP).parts[0]} if basetemp.is_relative_to(TMP) else set()
    before = _tmp_entries()
    yield
    new = sorted(_tmp_entries() - before - pytest_own)
    ours = [name for name in new
            if str(TMP / name) in RAY_DIRS
            or (name.startswith("ray/session_") and name.endswith(f"_{os.getpid()}"))]
    _new_in_tmp[:] = new
    if hasattr(pytestconfig, "workeroutput"):  # an xdist worker: tell the controller
        pytestconfig.workeroutput["new_in_tmp"] = new
    if ours or (new and os.environ.get(STRICT_TMP) == "1"):
        pytest.fail(f"the suite left these in /tmp: {', '.join(ours or new)}", pytrace=False)


def _heavy(item: pytest.Item) -> bool:
    """Marked slow (unless also `no_ray` or `ray_no_server`), or starting Ray: through the
    session's cluster, or asking for a Ray temp dir of its own. Fault tests all get one
    (`_fault_tests_own_ray_dir`), for its check that no process outlives them; only those
    that ask for it themselves, or are marked slow, start Ray."""
    if item.get_closest_marker("ray_no_server"):
        return False
    if item.get_closest_marker("slow") and not item.get_closest_marker("no_ray"):
        return True
    info = getattr(item, "_fixtureinfo", None)
    asked = set(info.argnames) if info is not None else set()
    asked.update(name for mark in item.iter_markers("usefixtures") for name in mark.args)
    return "ray_cluster" in getattr(item, "fixturenames", ()) or "ray_tmpdir" in asked


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n`, `--dist loadgroup`): the heavy tests (marked slow, or
    starting Ray) run one after another on one worker, while the others share the rest.
    Two heavy tests at once (two Ray clusters and their servers on 2 cores) starve each
    other's emulators far beyond one busy neighbour, which every test is built to bear;
    and the session's Ray cluster is then started once, not once per worker. A slow test
    marked `no_ray` (it starts no Ray and times no server: the report and notebooks) runs
    beside them. So does a test marked `ray_no_server` (it starts a Ray of its own but no
    server, and times nothing but its own patience), one at a time with the others so
    marked: at most one Ray start runs beside a heavy test's servers, a busy neighbour for
    seconds. A module with a shared (module-scoped) fixture keeps its tests on one worker,
    so that fixture is set up once: the heavy one if the module has heavy tests."""
    heavy = {item for item in items if _heavy(item)}
    heavy_modules = {item.module for item in heavy if isinstance(item, pytest.Function)}
    for item in items:
        module = getattr(item, "module", None)
        if item.get_closest_marker("ray_no_server"):
            if "ray_cluster" in getattr(item, "fixturenames", ()) or _has_module_fixture(item):
                raise pytest.UsageError(
                    f"{item.nodeid} is marked ray_no_server but uses the session's Ray "
                    "cluster or a module's shared fixture, which live in the heavy lane: "
                    "drop the mark")
            item.add_marker(pytest.mark.xdist_group(RAY_NO_SERVER))
        elif item in heavy or (module in heavy_modules and _has_module_fixture(item)):
            item.add_marker(pytest.mark.xdist_group("heavy"))
        elif module is not None and _has_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(module.__name__))


def _has_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs[-1].scope == "module"
               for defs in info.name2fixturedefs.values() if defs)


def pytest_configure(config: pytest.Config) -> None:
    """On the xdist controller, before any worker starts: refuse a pytest whose node ids
    xdist's grouping cannot mark; the heavy tests would silently run two at a time."""
    grouping = (not hasattr(config, "workerinput") and config.pluginmanager.has_plugin("xdist")
                and config.getoption("dist", "no") == "loadgroup"
                and config.getoption("numprocesses", None))
    if grouping and tuple(pytest.version_tuple[:2]) >= (9, 2):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} breaks pytest-xdist's --dist loadgroup "
            "(pytest-dev/pytest-xdist#1386), which keeps this suite's heavy tests on one "
            "worker: install the dev extra's pytest (<9.2), or run serially with -n 0")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # an xdist worker is done
    _new_in_tmp.extend(getattr(node, "workeroutput", {}).get("new_in_tmp", ()))


def pytest_unconfigure(config: pytest.Config) -> None:
    """After a passing run pytest removes its base temp dir (tmp_path_retention_policy),
    which leaves `/tmp/pytest-of-USER` holding only its dangling `pytest-current` link:
    that goes too, unless something else is in it (another run's, or a failed one's)."""
    if hasattr(config, "workerinput") or config.option.basetemp:
        return
    parent = TMP / f"pytest-of-{_user()}"
    with contextlib.suppress(OSError):
        links = [entry for entry in parent.iterdir()
                 if entry.is_symlink() and not entry.exists()]
        if len(links) == len(list(parent.iterdir())):
            for link in links:
                link.unlink()
            parent.rmdir()


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (ImportError, KeyError, OSError):
        return "unknown"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # Another worker's entry may have gone since a worker looked: what is still there.
    _new_in_tmp[:] = sorted({name for name in _new_in_tmp if (TMP / name).exists()})
    if _new_in_tmp:
        terminalreporter.section("new entries in /tmp since the session started")
        terminalreporter.line("(this suite's, or another process's on this machine; "
                              f"{STRICT_TMP}=1 makes them fail the run)")
        for name in _new_in_tmp:
            terminalreporter.line(f"  /tmp/{name}")


class Emulator:
    """One `python -m treetune.emulator` subprocess and its HTTP address."""

    def __init__(self, args: list[str], log_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [*args, "--host", "127.0.0.1", "--port", str(self.port)]
        log_dir.mkdir(parents=True, exist_ok=True)
        self._stderr_path = log_dir / f"emulator-{self.port}-{time.monotonic_ns()}.stderr"
        self._stderr = self._stderr_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "treetune.emulator", *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            start_new_session=True,
        )
        self.pid = self.proc.pid

    @property
    def stderr(self) -> str:
        return self._stderr_path.read_text(errors="replace")

    def health_status(self, path: str = "/health") -> int | None:
        """The HTTP status of a health probe, or None while nothing listens yet."""
        try:
            return httpx.get(self.url + path, timeout=2.0).status_code
        except httpx.TransportError:
            return None

    def wait_status(self, status: int, timeout: float = STARTUP_TIMEOUT_S,
                    path: str = "/health") -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"emulator exited with {self.proc.returncode} before {path} gave {status}; "
                    f"stderr:\n{self.stderr}")
            last = self.health_status(path)
            if last == status:
                return
            time.sleep(0.02)
        raise AssertionError(f"{path} still {last} (wanted {status}) after {timeout} s; "
                             f"stderr:\n{self.stderr}")

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> Emulator:
        self.wait_status(200, timeout)
        return self

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the whole process group (idempotent) and reap the leader."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._stderr.close()


class EmulatorFactory:
    """Starts emulators and remembers them so that teardown can kill every one."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[Emulator] = []

    def start(self, *args: str, port: int | None = None) -> Emulator:
        emulator = Emulator(list(args), self.log_dir, port)
        self.started.append(emulator)
        return emulator

    def healthy(self, *args: str, port: int | None = None) -> Emulator:
        return self.start(*args, port=port).wait_healthy()

    def kill_all(self) -> None:
        for emulator in self.started:
            emulator.kill()


@pytest.fixture
def emulators(tmp_path: Path) -> Iterator[EmulatorFactory]:
    """Start emulators inside one test; all are killed when the test ends."""
    factory = EmulatorFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.kill_all()


@pytest.fixture(scope="module")
def module_emulators(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorFactory]:
    """Like `emulators`, for servers shared by the tests of one module."""
    factory = EmulatorFactory(tmp_path_factory.mktemp("emulators"))
    try:
        yield factory
    finally:
        factory.kill_all()


@pytest.fixture(scope="session")
def small_study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished study folder (baseline, (3,4,8), (5,1,6) and searched trees at batch 1
    and 32 on mt-bench and terminal-bench), with recommendations and launch scripts, as
    `treetune search` leaves it. Its launches are drawn in-process from the emulator's own
    profile (treetune.study.offline): the report and notebooks read a study's files and
    storage, not its servers, and the search itself is tested against real servers
    elsewhere. In this profile the wide tree (3,4,8) regresses terminal-bench at batch 32."""
    from treetune.perfmodel import PerfModel
    from treetune.study.export import write_outputs
    from treetune.study.offline import Noise, run_offline
    from treetune.study.spec import SPEC_COPY, load_study
    from treetune.study.storage import StudyStore

    folder = tmp_path_factory.mktemp("small-study")
    spec = load_study(None, {
        "name": "small", "model": "Qwen/Qwen3-Coder-Next", "draft": "d", "tp": 4,
        "datasets": ["mt-bench", "terminal-bench"], "batch": [1, 32],
        "space": "default", "budget": {"launches": 10}, "seed": 0,
        "backend": {"kind": "emulator", "profile": "qwen3-coder-next-h200", "noise": False},
        "measurement": {"duration_s": 6.0, "repeats": 2},
        "compare": ["3,4,8", "5,1,6"], "output": str(folder),
    })
    spec.save(folder / SPEC_COPY)
    truth = spec.backend.facts(spec.launch_spec(), {})
    planner = run_offline(spec, PerfModel(truth, spec.tp), seed=0, launches=10,
                          noise=Noise(0.01, 0.01), store=StudyStore(spec))
    assert planner.baseline is not None
    write_outputs(spec, planner.decide(), folder)
    return folder


@pytest.fixture
def ray_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A short Ray temp dir of the test's own (Ray's socket paths break past ~100
    characters); nothing the test started under it may outlive the test, and the dir is
    removed after it. "Under it" is what names the dir in its command line or environment,
    works in it or has a file open in it (studykit.dir_holders): Ray's agents rename
    themselves and their command line no longer names it. Those of a raylet that died
    unannounced (a SIGKILLed search's, a node's that Cluster.shutdown SIGKILLed) wait a
    minute on the gone GCS: they are given a moment, then ended. Whatever else is left
    fails the test, and is killed so that nothing outlives it."""
    from studykit import end_processes, ray_env, release_ray_dir, short_ray_dir

    with short_ray_dir() as path:
        for name, value in ray_env(path).items():
            monkeypatch.setenv(name, value)
        yield path
        left = release_ray_dir(path)
        end_processes([holder.pid for holder in left])
        assert not left, "processes outlived the test:\n" + "\n".join(map(str, left))


@pytest.fixture(autouse=True)
def _fault_tests_own_ray_dir(request: pytest.FixtureRequest) -> None:
    """Fault tests (tests/faults/) provoke real faults: emulator fault switches, signals,
    killed processes. Each gets its own short Ray temp dir and must leave no process
    behind (`ray_tmpdir` checks that after every test). Asked for here, by path: an
    autouse fixture in tests/faults/conftest.py was not applied to the second fault module
    of `pytest tests/faults/a.py tests/b.py tests/faults/c.py`, whose tests then started
    Ray in /tmp/ray."""
    if "faults" in request.path.parts:
        request.getfixturevalue("ray_tmpdir")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """The address of one local Ray cluster (a head node, as `ray start --head` makes) for
    the tests that run a study through `ray_address`, as `treetune search --ray-address`
    does: a study connects to it in about a second, where starting Ray takes several
    (minutes over a suite on a busy machine). Local `ray.init`, the default, is what
    test_search.py's `finished` study and the process-fault tests run on. Emulated GPUs for
    two workers of tp=4, and 4 logical GPUs (this machine has none) for one SGLang worker;
    the cluster and its short temp dir are gone after the session."""
    from ray.cluster_utils import Cluster
    from studykit import ray_env, short_ray_dir

    with short_ray_dir() as path, pytest.MonkeyPatch.context() as env:
        for name, value in ray_env(path).items():
            env.setenv(name, value)
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 3, "num_gpus": 4, "resources": {"emulated_gpu": 8}, "temp_dir": path,
            "include_dashboard": False})
        try:
            cluster.wait_for_nodes()
            env.undo()  # each test sets its own Ray environment
            yield cluster.address
        finally:
            for name, value in ray_env(path).items():
                env.setenv(name, value)
            cluster.shutdown()

