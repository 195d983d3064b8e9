"""The one place that knows a server process's lifecycle: start, wait until healthy, stop.

A server (SGLang or the emulator) runs as its own process group, so that stopping it also
stops every process it spawned, and through `treetune.pdeathsig`, so that it dies with its
owner. Its stdout and stderr go to one log file, whose tail explains a failed start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO

from treetune.backends import ServerApi
from treetune.backends.sglang import SGLANG_API
from treetune.client import health_status
from treetune.errors import TreetuneError, clip

LOG_TAIL_LINES = 40
PORT_IN_USE = re.compile(r"address already in use|port \d+ is (?:already )?in use|EADDRINUSE",
                         re.IGNORECASE)
# What makes a log line the reason for a failed start, from most to least telling: the last
# line of a Python traceback ("RuntimeError: CUDA out of memory ..."), then any error line.
REASON_PATTERNS = (
    re.compile(r"\w(?:Error|Exception)\b:|out of memory"),
    re.compile(r"error|exception|killed|abort", re.IGNORECASE),
)
MAX_REASON_CHARS = 300
# A server still writing its log at its start-up timeout is waited for while the log grows
# (silent for LIVE_LOG_S, or a quarter of the timeout if shorter: stopped), up to
# STARTUP_STRETCH times the timeout.
LIVE_LOG_S = 120.0
STARTUP_STRETCH = 3.0
GROUP_EXIT_S = 30.0  # how long a stopped server's processes may take to exit
PROC = Path("/proc")  # where Linux lists processes (`group_members`)
EXITED_STATES = ("Z", "X")  # a process's state letter once it has exited: zombie, dead


class ServerStartError(TreetuneError):
    """A server that exited before it was healthy, or never became healthy."""

    def __init__(self, reason: str, *, exit_code: int | None, log_tail: str,
                 log_path: Path | None = None) -> None:
        where = f"; log: {log_path}" if log_path is not None else ""
        code = f" (exit code {exit_code})" if exit_code is not None else ""
        super().__init__(f"server failed to start{code}: {reason}{where}")
        self.reason = reason
        self.exit_code = exit_code
        self.log_tail = log_tail
        self.log_path = log_path

    @property
    def port_in_use(self) -> bool:
        return bool(PORT_IN_USE.search(self.reason) or PORT_IN_USE.search(self.log_tail))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the kernel's pick; another process may take it
    before the server binds, which `start_server` retries)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def group_members(pgid: int) -> list[int]:
    """Processes of process group `pgid` that have not exited (zombies left out: a
    container's init may never reap the orphans, and a leader not yet reaped is one).
    Read from /proc, else (macOS, the BSDs) from `ps`; none when neither answers."""
    if not PROC.is_dir():
        return _ps_group_members(pgid)
    members = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] not in EXITED_STATES and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _ps_group_members(pgid: int) -> list[int]:
    """`group_members` from `ps` (its pid, pgid and state columns), where there is no
    /proc: without it the standard library cannot list processes."""
    try:
        listing = subprocess.run(["ps", "-A", "-o", "pid=,pgid=,stat="], capture_output=True,
                                 text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    members = []
    for line in listing.splitlines():
        fields = line.split()
        if (len(fields) >= 3 and fields[1] == str(pgid)
                and not fields[2].startswith(EXITED_STATES)):
            members.append(int(fields[0]))
    return members


class ServerProcess:
    """One server process group, its address and its log."""

    def __init__(self, proc: subprocess.Popen[bytes], *, log_path: Path, host: str,
                 port: int, pump: threading.Thread | None = None) -> None:
        self._proc = proc
        self._pump = pump
        self.log_path = log_path
        self.host = host
        self.port = port
        self.ready_after_s: float | None = None  # how long it took to become healthy

    @classmethod
    def start(cls, argv: list[str], *, log_path: Path, env: dict[str, str] | None = None,
              host: str = "127.0.0.1", port: int,
              secrets: tuple[str, ...] = ()) -> ServerProcess:
        """Start `argv` (which must make the server listen on `host:port`); returns at once.

        `env` is the server's whole environment (None: inherit ours). The server gets
        SIGKILL when the calling *thread* exits (Linux ties the parent-death signal to it),
        so start servers from a thread that lives as long as they do. Each of `secrets` is
        written to the log as `***` (SGLang logs its arguments, --api-key included).
        """
        if not argv:
            raise ValueError("empty server command")
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        wrapper = [sys.executable, "-m", "treetune.pdeathsig", "--ppid", str(os.getpid()), "--"]
        secrets = tuple(s for s in secrets if s)
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [*wrapper, *argv],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if secrets else log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: stop() reaches every child
            )
        pump = None
        if secrets:
            assert proc.stdout is not None
            pump = threading.Thread(target=_copy_redacted, args=(proc.stdout, log_path, secrets),
                                    name=f"log-{proc.pid}", daemon=True)
            pump.start()
        return cls(proc, log_path=log_path, host=host, port=port, pump=pump)

    # ---- facts ------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        """The server's pid, also its process group id (the wrapper execs the command)."""
        return self._proc.pid

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def exit_code(self) -> int | None:
        """The exit code once the server has exited (what it spawned ended with it), else
        None."""
        return self.exit_code_within(0.0)

    def exit_code_within(self, wait_s: float) -> int | None:
        """The exit code once the server has exited, waiting up to `wait_s` for it; None
        if it is still running. A crashing server closes its sockets before its process
        is gone: a client that found it not answering asks this, not `exit_code`."""
        if self._proc.returncode is None and self._leader_exited(wait_s=wait_s):
            return self._end_group()
        return self._proc.returncode

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the server's log ('' if there is none yet)."""
        if self._pump is not None and self._proc.returncode is not None:
            self._pump.join(timeout=2)  # the last lines the server wrote before it exited
        try:
            with self.log_path.open("rb") as log:
                log.seek(0, os.SEEK_END)
                size = log.tell()
                log.seek(max(0, size - max(65536, 400 * lines)))
                data = log.read()
        except FileNotFoundError:
            return ""
        text = data.decode(errors="replace").splitlines()
        return "\n".join(text[-lines:]) if lines > 0 else ""

    # ---- lifecycle --------------------------------------------------------------------
    def wait_ready(self, timeout_s: float, poll_s: float = 0.2,
                   api: ServerApi = SGLANG_API) -> None:
        """Poll `GET <api.health>` until it answers 200 (`ready_after_s` then says when).

        Raises ServerStartError if the server exits first (with its exit code and the log
        line that says why), or is not healthy after `timeout_s` (then it is killed). A
        server still writing its log at the timeout is still starting (loading weights,
        compiling kernels and capturing CUDA graphs all print progress, and a large model's
        first start can take longer than any fixed timeout): it is waited for while its
        log keeps growing, up to STARTUP_STRETCH times `timeout_s` (lines about its
        health checks, the route's access lines and `api.health_log`'s, do not count).
        """
        started = time.monotonic()
        quiet_s = min(LIVE_LOG_S, timeout_s / 4)  # silent this long: not starting any more
        limit, cap = started + timeout_s, started + STARTUP_STRETCH * timeout_s
        read, grew_at = 0, started
        url = self.base_url + api.health
        while True:
            if self._leader_exited():
                code = self._end_group()  # whatever it spawned goes with it
                tail = self.log_tail()
                raise ServerStartError(failure_reason(tail, code), exit_code=code,
                                       log_tail=tail, log_path=self.log_path)
            now = time.monotonic()
            read, progressed = self._log_progress(read, (api.health, *api.health_log))
            if progressed:
                grew_at = now
            if now >= limit:
                if now < cap and now - grew_at < quiet_s:
                    limit = min(cap, grew_at + quiet_s)
                else:
                    code = self.stop(grace_s=0)
                    waited = now - started if limit > started + timeout_s else None
                    raise ServerStartError(
                        not_healthy(timeout_s, waited, at_cap=now >= cap),
                        exit_code=code, log_tail=self.log_tail(), log_path=self.log_path)
            # SGLang's health check runs a real generation: give it time to answer.
            if health_status(url, timeout_s=min(max(limit - now, poll_s), 10.0)) == 200:
                self.ready_after_s = time.monotonic() - started
                return
            time.sleep(min(poll_s, max(0.0, limit - time.monotonic())))

    def _log_progress(self, offset: int, checks: tuple[str, ...]) -> tuple[int, bool]:
        """Where the log ends now, and whether it gained a line since `offset` other than
        one about our own health checks (holding one of `checks`: SGLang's HTTP server
        logs each request, and each check that timed out)."""
        try:
            with self.log_path.open("rb") as log:
                end = log.seek(0, os.SEEK_END)
                if end <= offset:
                    return end, False
                log.seek(max(offset, end - 65536))
                text = log.read().decode(errors="replace")
        except FileNotFoundError:
            return offset, False
        return end, any(line.strip() and not any(mark in line for mark in checks)
                        for line in re.split(r"[\r\n]", text))

    def stop(self, grace_s: float = 10) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; returns the exit code.

        Idempotent. Processes the server spawned are killed too, even if it exited cleanly.
        """
        if self._proc.returncode is None:
            if not self._leader_exited():
                self._kill_group(signal.SIGTERM)
                self._leader_exited(wait_s=grace_s)
            self._end_group()
        return self._proc.returncode

    def _end_group(self) -> int | None:
        """Kill what is left of the server's process group, wait until it is gone, then
        reap the leader; returns its exit code. Until reaped the leader is a zombie, so its
        pid (the group id) cannot have been reused: the signal and the wait reach only the
        server's own processes. A tensor-parallel worker frees its GPU memory only as it
        exits: the next server on these GPUs must not start before the whole group is
        gone (up to GROUP_EXIT_S)."""
        self._kill_group(signal.SIGKILL)
        deadline = time.monotonic() + GROUP_EXIT_S
        while group_members(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        return self._proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _kill_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def _leader_exited(self, wait_s: float = 0.0) -> bool:
        """Whether the server process has exited, waiting up to `wait_s`, without reaping it."""
        deadline = time.monotonic() + wait_s
        while True:
            if self._proc.returncode is not None:
                return True
            if not hasattr(os, "waitid"):  # macOS: reaping is the only way to ask
                if self._proc.poll() is not None:
                    return True
            else:
                try:
                    info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    return True
                if info is not None:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def secret_forms(secret: str) -> list[bytes]:
    """The ways a server may print `secret`: as it is, and as a Python repr or a JSON
    string escapes it (SGLang logs `server_args=ServerArgs(..., api_key='...')`, where a
    backslash comes out doubled); longest first, so that no part of one is left."""
    forms = {secret, repr(secret)[1:-1], json.dumps(secret)[1:-1],
             json.dumps(secret, ensure_ascii=False)[1:-1]}
    return sorted((f.encode() for f in forms if f), key=len, reverse=True)


def _copy_redacted(source: IO[bytes], log_path: Path, secrets: tuple[str, ...]) -> None:
    """Copy the server's output to its log line by line, each secret replaced by ***. A
    line ends at a carriage return too: a progress bar redraws itself with one, and each
    redraw is start-up progress (`ServerProcess.wait_ready`); a key holds neither."""
    encoded = [form for s in secrets for form in secret_forms(s)]
    pending = b""
    with source, log_path.open("ab") as log:
        while chunk := source.read1(65536):  # type: ignore[attr-defined]
            pending += chunk
            end = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
            if end:
                log.write(_redacted(pending[:end], encoded))
                log.flush()
                pending = pending[end:]
        if pending:
            log.write(_redacted(pending, encoded))


def _redacted(data: bytes, secrets: list[bytes]) -> bytes:
    for secret in secrets:
        data = data.replace(secret, b"***")
    return data


def failure_reason(log_tail: str, exit_code: int | None) -> str:
    """One line saying why a server exited: the last log line that names an error."""
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    for pattern in REASON_PATTERNS:
        for line in reversed(lines):
            if pattern.search(line):
                return clip(line, MAX_REASON_CHARS)
    if exit_code is not None and exit_code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exit_code).name}"
    if lines:
        return clip(lines[-1], MAX_REASON_CHARS)
    return f"exited with code {exit_code} before it was healthy"


def not_healthy(timeout_s: float, waited_s: float | None = None, at_cap: bool = False) -> str:
    """Why a start was given up: the timeout; or, waited for past it (`waited_s`) while
    its log grew, the cap or the log's silence."""
    if waited_s is None:
        return f"not healthy after {timeout_s:g} s"
    shown = f"{waited_s:.0f}" if waited_s >= 10 else f"{waited_s:.1f}"
    if at_cap:
        return (f"not healthy after {shown} s: still writing its log, it was waited for up to "
                f"{STARTUP_STRETCH:g} times the start-up timeout ({timeout_s:g} s)")
    return (f"not healthy after {shown} s: its log grew past the start-up timeout "
            f"({timeout_s:g} s), then stopped")


def start_server(command: Callable[[int], list[str]], *, log_path: Path,
                 env: dict[str, str] | None = None, host: str = "127.0.0.1",
                 timeout_s: float, port: int | None = None, retries: int = 3,
                 poll_s: float = 0.2, secrets: tuple[str, ...] = (),
                 api: ServerApi = SGLANG_API) -> ServerProcess:
    """Start `command(port)` and wait until it is healthy.

    If the port turns out to be taken (the server exits with "address already in use"),
    retries up to `retries` times on another free port. Raises ServerStartError otherwise.
    `secrets` never reach the log (see `ServerProcess.start`).
    """
    port = free_port(host) if port is None else port
    for attempt in range(retries + 1):
        server = ServerProcess.start(command(port), log_path=log_path, env=env, host=host,
                                     port=port, secrets=secrets)
        try:
            server.wait_ready(timeout_s, poll_s=poll_s, api=api)
            return server
        except ServerStartError as exc:
            if not exc.port_in_use or attempt == retries:
                raise
        port = free_port(host)
    raise AssertionError("unreachable")
