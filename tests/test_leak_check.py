"""The leak check of the tests that start Ray (ray_tmpdir in conftest.py), without Ray:
stand-in processes that hold a temp dir as Ray's renamed agents and treetune's servers and
workers do. An agent of Ray's whose raylet is gone is ended; a server or a worker left
behind is reported, not ended, for the check to fail on."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import studykit
from studykit import dir_holders, orphaned_ray_agent, release_ray_dir, wait_until

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads /proc")

SLEEP = "import sys, time; time.sleep(60)"
HOLD_A_FILE = "import os, time; f = open(os.environ['HELD'] + '/agent.log', 'w'); time.sleep(60)"


class Stand:
    """Stand-in processes, each killed at the end whatever the test did."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(argv, executable=sys.executable, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                **kwargs)
        self.procs.append(proc)
        return proc

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture
def stand() -> Iterator[Stand]:
    stands = Stand()
    try:
        yield stands
    finally:
        stands.kill()


def test_an_orphaned_ray_agent_is_ended_and_a_server_or_worker_left_is_reported(
        tmp_path, stand, monkeypatch):
    monkeypatch.setattr(studykit, "REAP_GRACE_S", 0.2)
    held = tmp_path / "rtheld"
    held.mkdir()
    (tmp_path / "rtheldx").mkdir()
    # Ray's agent, renamed (its command line names no dir), with its log open under the
    # dir; its parent is no raylet.
    agent = stand.start(["ray::DashboardAgent", "-c", HOLD_A_FILE], env={"HELD": str(held)})
    # A server started under the test's Ray env, and a worker of treetune's working in it.
    server = stand.start(["python", "-c", SLEEP], env={"RAY_TMPDIR": str(held)})
    worker = stand.start(["ray::LaunchWorker.run", "-c", SLEEP], cwd=held)
    # Another dir's, whose name only begins like it.
    stand.start(["python", "-c", SLEEP], cwd=tmp_path / "rtheldx")
    expected = {agent.pid: ("fd", True), server.pid: ("environ", False),
                worker.pid: ("cwd", False)}

    def seen() -> dict[int, tuple[str, bool]]:
        return {h.pid: (h.how, orphaned_ray_agent(h)) for h in dir_holders(str(held))}

    assert wait_until(lambda: seen() == expected, 10), seen()  # the agent opens its log

    started = time.monotonic()
    left = release_ray_dir(str(held), timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert sorted(h.pid for h in left) == sorted([server.pid, worker.pid])
    assert agent.poll() is not None, "Ray's orphaned agent was left"
    assert server.poll() is None and worker.poll() is None, "a leak was ended, not reported"


def test_a_dir_held_by_nothing_is_released_at_once(tmp_path):
    # Two scans of /proc, no waiting: well within the agents' grace even on a busy machine.
    started = time.monotonic()
    assert release_ray_dir(str(tmp_path)) == []
    assert time.monotonic() - started < studykit.REAP_GRACE_S
