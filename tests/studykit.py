"""Helpers for tests that run whole studies: a small study spec, and the processes a study
may leave behind (found through /proc, so a leak cannot hide)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

# Every short Ray temp dir the suite made, so that the session's /tmp guard (conftest.py)
# can tell a leaked one of ours from another process's entry in /tmp.
RAY_DIRS: list[str] = []


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`treetune ARGS` in this process: (exit code, stdout, stderr)."""
    from treetune.cli import main

    code = 0
    try:
        main(list(args))
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def small_study(tmp_path: Path, **over) -> dict:
    """A study of five launches on the emulator that takes seconds, not minutes.

    One launch per config: the tests built on it count configs by launches (N launches are
    N distinct configs, each with one stored result), which re-measurement would break,
    since the noise-aware planner re-launches borderline trees and the baseline whenever
    the timing of a busy machine makes a tree borderline. Re-measurement is tested on
    in-process launches in test_guided.py."""
    base = {
        "name": "small", "model": f"{tmp_path}/model-under-test", "draft": "org/draft",
        "tp": 4, "datasets": ["humaneval", "mt-bench"], "batch": [1, 8],
        "space": "bench-speculative", "budget": {"launches": 5}, "workers": 2, "seed": 3,
        "backend": {"kind": "emulator", "profile": "qwen3-coder-next-h200",
                    "time_scale": 20.0, "load_time_s": 10.0, "noise": False},
        # Servers at time scale 20 on a busy 2-core machine: their clock lags by tens of
        # ms at times, which these studies are not about (tests/test_clock_lag.py is).
        "measurement": {"duration_s": 6.0, "repeats": 2, "startup_timeout_s": 30.0,
                        "max_clock_lag_s": 0.25},
        "compare": ["3,4,8"], "output": str(tmp_path / "out"),
        "search": {"max_launches_per_config": 1},
    }
    return {**base, **over}


def unlagged(warnings: list[str]) -> list[str]:
    """A launch's warnings but those of a server clock or load generator that lagged on a
    busy machine (a server ran 2 s behind at time scale 20 in a suite beside two benchmark
    processes): what the launch itself warns of. tests/test_clock_lag.py tests lag."""
    return [w for w in warnings if "behind its schedule" not in w]


def cmdlines() -> dict[int, str]:
    """Every live process's command line, arguments joined by spaces."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if raw and state not in ("Z", "X"):
            found[int(entry.name)] = raw.replace(b"\0", b" ").decode(errors="replace")
    return found


def server_processes(marker: str) -> list[int]:
    """Pids of live emulator servers whose command line holds `marker` (the model path of
    `small_study` holds the test's tmp_path)."""
    return [pid for pid, cmd in cmdlines().items()
            if marker in cmd and "treetune.emulator" in cmd]


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose command line holds `marker` (Ray's processes hold their
    temp dir)."""
    return [pid for pid, cmd in cmdlines().items() if marker in cmd]


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (state, parent, ...); OSError once
    the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parent_of(pid: int) -> int:
    return int(_stat_fields(pid)[1])


def wait_until(condition: Callable[[], object], timeout_s: float, poll_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return bool(condition())


def remove_tree(path: str, attempts: int = 5) -> None:
    """Remove a directory tree; a Ray process still exiting may add a log file while it
    goes, so a tree found non-empty is tried again before giving up loudly."""
    for attempt in range(attempts):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.2)


def ray_env(ray_dir: str) -> dict[str, str]:
    """The environment that keeps every Ray session a test starts inside `ray_dir`:
    treetune's own (TREETUNE_RAY_TMPDIR), and Ray's default for whatever is not told a
    temp dir (RAY_TMPDIR, for `RAY_TMPDIR/ray`: ray.cluster_utils.Cluster writes
    /tmp/ray/ray_current_cluster otherwise, which another Ray on the machine would read and
    which would leave /tmp/ray behind)."""
    return {"TREETUNE_RAY_TMPDIR": ray_dir, "RAY_TMPDIR": ray_dir, "RAY_AUTH_MODE": "disabled"}


# Ray's own processes that rename themselves (setproctitle), so that their command line no
# longer names their temp dir: the agents every raylet starts, and its pooled idle workers.
RAY_RENAMED = ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::IDLE")
# Their scripts, for the moment before the rename.
RAY_AGENT_SCRIPTS = ("dashboard/agent.py", "_private/runtime_env/agent/main.py")
REAP_GRACE_S = 2.5  # an agent notices its raylet gone in 5 checks 0.4 s apart


@dataclass(frozen=True)
class Holder:
    """A live process that holds a dir: how (cmdline, cwd, fd, environ) and what it is."""

    pid: int
    ppid: int
    title: str  # its command line, as ps shows it (Ray's processes rename themselves)
    how: str

    def __str__(self) -> str:
        return f"{self.pid} {self.title[:100]!r} (by {self.how}, parent {self.ppid})"


def _names(text: str, path: str) -> bool:
    """`text` names `path` itself or something under it: not /tmp/rtabcd for /tmp/rtabc
    (what follows a name of mkdtemp's letters, digits and underscores ends it)."""
    start = text.find(path)
    while start >= 0:
        after = text[start + len(path):start + len(path) + 1]
        if not (after.isalnum() or after == "_"):
            return True
        start = text.find(path, start + 1)
    return False


def _how_held(pid: int, path: str) -> str | None:
    proc = f"/proc/{pid}"
    try:
        if _names((Path(proc) / "cmdline").read_bytes().decode(errors="replace"), path):
            return "cmdline"
    except OSError:
        return None  # gone
    with contextlib.suppress(OSError):
        if _names(os.readlink(f"{proc}/cwd"), path):
            return "cwd"
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"{proc}/fd"):
            with contextlib.suppress(OSError):
                if _names(os.readlink(f"{proc}/fd/{fd}"), path):
                    return "fd"
    with contextlib.suppress(OSError):
        if _names((Path(proc) / "environ").read_bytes().decode(errors="replace"), path):
            return "environ"
    return None


def dir_holders(path: str) -> list[Holder]:
    """Every live process but this one that names `path` in its command line or its
    environment (what a test started while its Ray env was set: Ray's processes, the
    search, its servers), works in it, or has a file open under it (Ray's renamed agents,
    whose command line no longer names it). This process is left out: a Ray driver keeps
    its core-worker log files open after ray.shutdown(), and it is the one asking."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        if fields[0] in ("Z", "X"):
            continue
        how = _how_held(pid, path)
        if how is None:
            continue
        with contextlib.suppress(OSError):
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            title = raw.replace(b"\0", b" ").decode(errors="replace").strip()
            found.append(Holder(pid, int(fields[1]), title, how))
    return found


@functools.cache
def _ray_package() -> str:
    spec = importlib.util.find_spec("ray")
    locations = spec.submodule_search_locations if spec else None
    return str(Path(next(iter(locations))).resolve()) if locations else "/nonexistent/ray"


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def orphaned_ray_agent(holder: Holder) -> bool:
    """One of Ray's renamed agents or idle workers whose raylet is gone. A raylet that dies
    without SIGTERM (its driver was SIGKILLed, or it outlived Cluster.shutdown's one
    second of grace) leaves its agents to report that to a GCS that may be gone too: they
    wait 60 s on it (ray._private.process_watcher), the ~45-60 s they were seen to outlive
    such tests. Not one of these: whatever still names the dir in its command line (GCS,
    raylet, Ray's dashboard and monitors), which goes with its session, and any worker
    running treetune's actors (`ray::LaunchWorker...`), which treetune must end."""
    if holder.how == "cmdline" or _comm(holder.ppid) == "raylet":
        return False
    words = holder.title.split()
    if not words:
        return False
    if words[0] in RAY_RENAMED:
        return True
    package = _ray_package()
    return any(word.startswith(package) and word.endswith(RAY_AGENT_SCRIPTS)
               for word in words[1:3])


def _alive(pid: int) -> bool:
    try:
        state = _stat_fields(pid)[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def end_processes(pids: list[int], term_wait_s: float = 1.0) -> None:
    """SIGTERM, then SIGKILL what is still there after `term_wait_s`, and wait for them to
    go."""
    for sig, wait_s in ((signal.SIGTERM, term_wait_s), (signal.SIGKILL, 5.0)):
        live = [pid for pid in pids if _alive(pid)]
        for pid in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        if wait_until(lambda live=live: not any(map(_alive, live)), wait_s, 0.05):
            return


def release_ray_dir(path: str, timeout_s: float = 30.0) -> list[Holder]:
    """Wait up to `timeout_s` for every process holding a Ray temp dir to go, but Ray's
    orphaned agents (orphaned_ray_agent): those get REAP_GRACE_S to go by themselves and
    are then ended, as a user would end what a killed Ray left. Returns what is still
    there and not Ray's to reap: a leak of treetune's (a server, a worker, a Ray session
    left running), which the caller reports."""
    grace_ends = time.monotonic() + REAP_GRACE_S  # counted from now: they wait beside
    staying = wait_for(lambda: [h for h in dir_holders(path) if not orphaned_ray_agent(h)],
                       timeout_s)
    orphans = wait_for(lambda: [h for h in dir_holders(path) if orphaned_ray_agent(h)],
                       max(0.0, grace_ends - time.monotonic()))
    if orphans:  # they were seen to ignore SIGTERM for 10 s: barely waited for
        end_processes([h.pid for h in orphans], term_wait_s=0.2)
    return staying


def wait_for(found: Callable[[], list], timeout_s: float, poll_s: float = 0.2) -> list:
    """Poll `found` until it finds nothing or `timeout_s` passes: what it last found."""
    deadline = time.monotonic() + timeout_s
    while (left := found()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return left


def ray_dir_used(path: str) -> bool:
    """Whether Ray wrote in a dir of short_ray_dir (most fault tests never start Ray)."""
    return set(os.listdir(path)) != {"ray"} or bool(os.listdir(os.path.join(path, "ray")))


@contextlib.contextmanager
def short_ray_dir() -> Iterator[str]:
    """A Ray temp dir of its own directly under /tmp, removed on exit once no process holds
    it. Not under tmp_path: Ray's socket paths (<dir>/session_<date>_<pid>/sockets/...)
    break past ~107 characters, and pytest's tmp_path is deeper than that allows. On exit,
    Ray's orphaned agents are ended (release_ray_dir), and anything else still holding the
    dir after 30 s is killed, so that nothing is left; ray_tmpdir (conftest.py) fails the
    test for it first."""
    path = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    RAY_DIRS.append(path)
    # Ray's default temp dir under RAY_TMPDIR (see ray_env): Cluster writes its address
    # file there without creating the dir.
    os.mkdir(os.path.join(path, "ray"))
    try:
        yield path
    finally:
        # Only a dir that Ray used can still be held (a /proc scan per test adds up).
        if ray_dir_used(path):
            end_processes([holder.pid for holder in release_ray_dir(path)])
        remove_tree(path)


def fake_sglang(root: Path, prelude: str = "") -> dict[str, str]:
    """A stand-in `sglang` package under `root` whose `python -m sglang.launch_server`
    runs `prelude` (Python lines) and then treetune's emulator of Qwen3-Coder-Next at time
    scale 20 with the flags it was given (a real server's command, process lifecycle and
    HTTP API; this machine has no GPU). Returns the study `env` that puts it first on
    PYTHONPATH."""
    package = root / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(
        "import sys\n" + prelude +
        "from treetune.emulator.__main__ import main\n"
        "sys.exit(main(['--profile', 'qwen3-coder-next-h200', '--time-scale', '20',"
        " '--load-time', '10', '--no-noise', *sys.argv[1:]]))\n")
    return {"PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
