"""Helpers for tests that run whole studies: a small study spec, and the processes a study
may leave behind (found through /proc, so a leak cannot hide)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
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


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


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


@contextlib.contextmanager
def short_ray_dir() -> Iterator[str]:
    """A Ray temp dir of its own directly under /tmp, removed on exit once no process holds
    it. Not under tmp_path: Ray's socket paths (<dir>/session_<date>_<pid>/sockets/...)
    break past ~107 characters, and pytest's tmp_path is deeper than that allows."""
    path = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    RAY_DIRS.append(path)
    # Ray's default temp dir under RAY_TMPDIR (see ray_env): Cluster writes its address
    # file there without creating the dir.
    os.mkdir(os.path.join(path, "ray"))
    try:
        yield path
    finally:
        # Only a dir that Ray used can still be held (most fault tests never start Ray,
        # and a /proc scan per test adds up).
        if set(os.listdir(path)) != {"ray"} or os.listdir(os.path.join(path, "ray")):
            wait_until(lambda: not processes_with(path), 30)
        remove_tree(path)
