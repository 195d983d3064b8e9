"""Helpers for tests that run whole studies: a small study spec, and the processes a study
may leave behind (found through /proc, so a leak cannot hide)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


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
        "measurement": {"duration_s": 6.0, "repeats": 2, "startup_timeout_s": 30.0},
        "compare": ["3,4,8"], "output": str(tmp_path / "out"),
        "search": {"max_launches_per_config": 1},
    }
    return {**base, **over}


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
