"""A server's process lifecycle: start, wait until healthy, stop, and die with its owner.

Servers are the real emulator run as subprocesses through `ServerProcess` on free ports,
always stopped at teardown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import treetune.server as server_module
from treetune.backends import LaunchSpec
from treetune.backends.emulator import emulator_command
from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.server import (
    ServerProcess,
    ServerStartError,
    failure_reason,
    free_port,
    group_members,
    start_server,
)

PROFILE = "qwen3-coder-next-h200"
TREE = TreeConfig(3, 4, 8)
EMULATOR_ARGS = ("--no-noise", "--seed", "1", "--time-scale", "10", "--load-time", "0.5")
TIMEOUT_S = 20.0

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="process checks read /proc (Linux)")


def command(config: ServerConfig = TREE, *emulator_args: str,
            flags: tuple[tuple[str, str | None], ...] = ()) -> Callable[[int], list[str]]:
    """The emulator command for a port, built as the emulator backend builds it."""
    def build(port: int) -> list[str]:
        spec = LaunchSpec(model_path="Qwen/Qwen3-Coder-Next",
                          draft_model_path="thoughtworks/Qwen3-Coder-Next-Eagle3",
                          tp=4, port=port)
        spec = dataclasses.replace(spec, extra_flags=flags)
        return emulator_command(config, spec, PROFILE, [*EMULATOR_ARGS, *emulator_args])
    return build


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    """Servers a test starts; all stopped at teardown."""
    started: list[ServerProcess] = []
    try:
        yield started
    finally:
        for server in started:
            server.stop(grace_s=2)


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_server_is_ready_after_loading_and_its_log_file_receives_the_server_log(
        tmp_path, servers):
    port = free_port()
    log = tmp_path / "logs" / "server.log"
    server = ServerProcess.start(command()(port), log_path=log, port=port)
    servers.append(server)
    assert server.base_url == f"http://127.0.0.1:{port}"

    server.wait_ready(TIMEOUT_S)

    assert alive(server.pid)
    assert "fired up and ready to roll" in log.read_text()
    assert "fired up and ready to roll" in server.log_tail(5)


@pytest.mark.parametrize("lister", ["proc", "ps"])
def test_stop_kills_the_whole_process_group_even_children_that_ignore_sigterm(
        tmp_path, servers, monkeypatch, lister):
    """Waited for until the whole group is gone, whether the processes are listed from
    /proc (Linux) or, where there is none (macOS), from `ps`."""
    if lister == "ps":
        if shutil.which("ps") is None:
            pytest.skip("no ps on this machine")
        monkeypatch.setattr(server_module, "PROC", tmp_path / "no-proc")
    spawner = textwrap.dedent("""
        import subprocess, sys, time
        child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \\
                "print('child up', flush=True); time.sleep(600)"
        subprocess.Popen([sys.executable, "-c", child])
        time.sleep(600)
    """)
    server = ServerProcess.start([sys.executable, "-c", spawner], log_path=tmp_path / "log",
                                 port=free_port())
    servers.append(server)
    assert wait_until(lambda: "child up" in server.log_tail(), 10)
    assert len(group_members(server.pid)) == 2

    code = server.stop(grace_s=1)

    assert code == -signal.SIGTERM
    assert not alive(server.pid)
    assert not group_members(server.pid)  # stop() returns once the whole group is gone
    assert server.stop() == code  # idempotent


def test_a_server_that_exits_on_its_own_takes_what_it_spawned_with_it(tmp_path, servers):
    """A crash (the leader gone, a tensor-parallel worker left holding the GPUs) is ended
    whole when the exit is noticed: the next launch on those GPUs must not start beside
    the straggler. The leader is reaped only after its group is gone."""
    spawner = textwrap.dedent("""
        import subprocess, sys, time
        child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \\
                "print('child up', flush=True); time.sleep(600)"
        subprocess.Popen([sys.executable, "-c", child])
        time.sleep(1.0)
        sys.exit(3)
    """)
    server = ServerProcess.start([sys.executable, "-c", spawner], log_path=tmp_path / "log",
                                 port=free_port())
    servers.append(server)
    assert wait_until(lambda: "child up" in server.log_tail(), 10)
    assert server.exit_code_within(30) == 3
    assert not group_members(server.pid)  # no wait: the straggler went before the return
    assert server.stop() == 3


def test_context_manager_stops_the_server(tmp_path):
    port = free_port()
    with ServerProcess.start(command()(port), log_path=tmp_path / "log", port=port) as server:
        server.wait_ready(TIMEOUT_S)
        pid = server.pid
    assert not alive(pid)
    assert server.exit_code is not None


def test_a_server_exiting_at_startup_raises_with_its_exit_code_and_the_reason_from_its_log(
        tmp_path, servers):
    invalid_tree = (("--speculative-algorithm", "EAGLE3"),
                    ("--speculative-draft-model-path", "thoughtworks/Qwen3-Coder-Next-Eagle3"),
                    ("--speculative-num-steps", "2"), ("--speculative-eagle-topk", "2"),
                    ("--speculative-num-draft-tokens", "20"))
    port = free_port()
    server = ServerProcess.start(command(BASELINE, flags=invalid_tree)(port),
                                 log_path=tmp_path / "log", port=port)
    servers.append(server)

    with pytest.raises(ServerStartError) as caught:
        server.wait_ready(TIMEOUT_S)

    error = caught.value
    assert error.exit_code == 1
    assert "selected index out of range" in error.reason
    assert "\n" not in error.reason
    assert error.reason in error.log_tail
    assert "exit code 1" in str(error) and str(tmp_path / "log") in str(error)


def test_a_server_never_healthy_is_killed_after_the_timeout(tmp_path, servers):
    """A server that stays silent and never answers. (The emulator's --hang-on-startup
    writes its start-up lines as it imports, which on a busy machine came within the last
    quarter of the 1.5 s: the wait was then stretched, as it should be for a server still
    loading, and the reason said so; the tests below are about that.)"""
    port = free_port()
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]
    server = ServerProcess.start(silent, log_path=tmp_path / "log", port=port)
    servers.append(server)
    started = time.monotonic()

    with pytest.raises(ServerStartError, match=r"not healthy after 1\.5 s") as caught:
        server.wait_ready(timeout_s=1.5)

    assert time.monotonic() - started < 5
    assert caught.value.reason == "not healthy after 1.5 s"
    assert not alive(server.pid)
    assert not group_members(server.pid)


def test_a_port_already_in_use_is_replaced_by_another_free_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        seen: list[int] = []

        def build(port: int) -> list[str]:
            seen.append(port)
            return command()(port)

        with start_server(build, log_path=tmp_path / "log", timeout_s=TIMEOUT_S,
                          port=busy) as server:
            assert seen[0] == busy
            assert server.port != busy and server.port == seen[-1]
            assert len(seen) == 2
            assert alive(server.pid)


def test_a_port_in_use_is_retried_at_most_retries_times(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        with pytest.raises(ServerStartError, match="address already in use") as caught:
            start_server(lambda port: command()(busy), log_path=tmp_path / "log",
                         timeout_s=TIMEOUT_S, port=busy, retries=1)
        assert caught.value.port_in_use


OWNER = """
import sys, time
from pathlib import Path
from treetune.server import ServerProcess
argv, port, log = sys.argv[3:], int(sys.argv[1]), Path(sys.argv[2])
server = ServerProcess.start(argv, log_path=log, port=port)
server.wait_ready(20)
print(server.pid, flush=True)
time.sleep(600)
"""


def test_the_server_dies_when_its_owner_is_killed_with_sigkill(tmp_path):
    port = free_port()
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(port), str(tmp_path / "log"), *command()(port)],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    server_pid = None
    try:
        assert owner.stdout is not None
        server_pid = int(owner.stdout.readline())
        assert alive(server_pid)

        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=5)

        assert wait_until(lambda: not alive(server_pid), 5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            owner.kill()
        owner.wait(timeout=5)
        if server_pid is not None and alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)


def test_pdeathsig_wrapper_execs_the_command_in_place():
    wrapped = subprocess.Popen(
        [sys.executable, "-m", "treetune.pdeathsig", "--", sys.executable, "-c",
         "import os; print(os.getpid())"],
        stdout=subprocess.PIPE, text=True)
    out, _ = wrapped.communicate(timeout=10)
    assert int(out) == wrapped.pid
    missing = subprocess.run([sys.executable, "-m", "treetune.pdeathsig", "--",
                              "treetune-no-such-program"], capture_output=True, text=True)
    assert missing.returncode == 127 and "treetune-no-such-program" in missing.stderr


def test_failure_reason_is_the_last_log_line_naming_an_error():
    log = "loading\nWARNING: x\nTraceback (most recent call last):\n  ...\n" \
          "RuntimeError: CUDA out of memory. Tried to allocate 2 GiB\nexiting\n"
    assert failure_reason(log, 1) == "RuntimeError: CUDA out of memory. Tried to allocate 2 GiB"
    assert failure_reason("", -9) == "killed by SIGKILL"
    assert failure_reason("", 3) == "exited with code 3 before it was healthy"


def test_a_server_on_its_way_out_is_waited_for_its_exit_code(tmp_path):
    # A crashing server stops answering before its process is gone: the launch's reason
    # says how it ended only if the exit is waited for (a fault test lost the code so).
    script = "import sys, time; time.sleep(0.5); sys.exit(70)"
    server = ServerProcess.start([sys.executable, "-c", script], log_path=tmp_path / "log",
                                 port=free_port("127.0.0.1"))
    try:
        assert server.exit_code is None  # still on its way out
        assert server.exit_code_within(10.0) == 70
    finally:
        server.stop()
    still = ServerProcess.start([sys.executable, "-c", "import time; time.sleep(30)"],
                                log_path=tmp_path / "log2", port=free_port("127.0.0.1"))
    try:
        assert still.exit_code_within(0.2) is None
    finally:
        still.stop(grace_s=0)


# A server that prints start-up progress every 20 ms for `loading` seconds, each update
# ending with `end` ("n": a line; "r": a progress bar's redraw), then serves its health
# route ("serve": 200; "refuse": 503, with an access line and SGLang's line for a check that
# timed out, as SGLang logs each) or goes silent ("silent").
STARTING = textwrap.dedent("""
    import http.server, sys, time
    port, loading, then = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    end = {"n": "\\n", "r": "\\r"}[sys.argv[4]]
    stop = time.monotonic() + loading
    while time.monotonic() < stop:
        print(f"Loading safetensors checkpoint shards: {stop - time.monotonic():.2f}",
              end=end, flush=True)
        time.sleep(0.02)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if then == "serve" else 503)
            self.end_headers()
        def log_message(self, *args):
            print(f'INFO: 127.0.0.1 - "GET {self.path} HTTP/1.1" 503', flush=True)
            print("Health check failed. Server couldn't get a response from detokenizer "
                  f"for last 20 seconds. tic start time: {time.time():.0f}", flush=True)
    if then == "silent":
        time.sleep(3600)
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")
# Starts take 4 s; a server silent for a quarter of that (1 s, 50 of its progress updates)
# has stopped starting.
START_TIMEOUT_S = 4.0


def starting(tmp_path: Path, servers: list[ServerProcess], loading_s: float, then: str,
             end: str = "n", secrets: tuple[str, ...] = ()) -> ServerProcess:
    port = free_port()
    server = ServerProcess.start([sys.executable, "-c", STARTING, str(port), str(loading_s),
                                  then, end], log_path=tmp_path / "log", port=port,
                                 secrets=secrets)
    servers.append(server)
    return server


@pytest.mark.parametrize(("end", "secrets"), [("n", ()), ("r", ("k3y",))])
def test_a_server_still_printing_progress_at_the_timeout_is_waited_for(tmp_path, servers,
                                                                       end, secrets):
    """Loading weights, compiling kernels and capturing CUDA graphs print progress: a large
    model's first start may outlast any fixed timeout and is no hang. A progress bar redraws
    itself with a carriage return, and a study with an API key copies the log through its
    redaction: each redraw still counts (a helper's review)."""
    from treetune.study.worker import slow_start

    server = starting(tmp_path, servers, 2.0 * START_TIMEOUT_S, "serve", end, secrets)
    server.wait_ready(timeout_s=START_TIMEOUT_S)
    assert server.ready_after_s is not None and server.ready_after_s > START_TIMEOUT_S
    assert "startup_timeout_s" in slow_start(server.ready_after_s, START_TIMEOUT_S)
    assert slow_start(START_TIMEOUT_S / 2, START_TIMEOUT_S) == ""


def test_a_start_that_prints_for_ever_is_stopped_at_three_times_the_timeout(tmp_path,
                                                                            servers):
    server = starting(tmp_path, servers, 3600, "serve")
    started = time.monotonic()
    with pytest.raises(ServerStartError, match="up to 3 times the start-up timeout") as caught:
        server.wait_ready(timeout_s=START_TIMEOUT_S)
    assert 3 * START_TIMEOUT_S <= time.monotonic() - started < 3 * START_TIMEOUT_S + 10
    assert caught.value.exit_code is not None and not alive(server.pid)


def test_a_start_whose_log_stops_past_the_timeout_is_stopped(tmp_path, servers):
    server = starting(tmp_path, servers, 1.5 * START_TIMEOUT_S, "silent")
    with pytest.raises(ServerStartError, match=r"grew past the start-up timeout \(4 s\), "
                                               "then stopped"):
        server.wait_ready(timeout_s=START_TIMEOUT_S)
    assert not alive(server.pid)


def test_its_own_health_checks_in_the_log_are_no_progress(tmp_path, servers):
    """SGLang's HTTP server logs every request, and each health check that timed out: a
    server answering 503 to each check grows its log with our own polling, which says
    nothing of a start."""
    server = starting(tmp_path, servers, 0, "refuse")
    with pytest.raises(ServerStartError) as caught:
        server.wait_ready(timeout_s=START_TIMEOUT_S, poll_s=0.05)
    assert caught.value.reason == "not healthy after 4 s"
    log = (tmp_path / "log").read_text()
    assert "GET /health_generate" in log and "Health check failed" in log
