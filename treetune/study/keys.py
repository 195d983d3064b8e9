"""How a study's server gets its API key without the key on its command line or on disk.

A command line is every local user's to read (`ps`, /proc). Where the server reads
`--config FILE.yaml` (SGLang from 0.5.3, and the emulator), the key goes in such a file;
and the file is a named pipe, in a directory only this user may enter, that hands the
YAML to one reader each time a server is about to start: no byte of the key is ever
written to a disk, so nothing is left to find when a worker is killed mid-start (Ray kills
a stopped study's workers outright, and a killed worker runs no clean-up)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

from treetune.study.spec import StudySpec

DIR_PREFIX = "treetune-key-"  # then the worker's pid and host (`own_dir`): swept once dead
POLL_S = 0.02  # how often the pipe looks for its reader
# How long an armed pipe waits, at most, for a reader to take the whole key, once it has
# one: a server reads its config file whole as it parses its flags.
HANDOFF_S = 60.0


class KeyHandoff:
    """The flags that give a server its key (`flags`), and `arm()`, to be called before
    each server process is started with them: the pipe then hands the key to one reader."""

    def __init__(self, flags: tuple[tuple[str, str], ...], pipe: _KeyPipe | None = None):
        self.flags = flags
        self._pipe = pipe

    def arm(self) -> None:
        if self._pipe is not None:
            self._pipe.arm()


@contextlib.contextmanager
def key_handoff(spec: StudySpec, api_key: str | None) -> Iterator[KeyHandoff]:
    """How servers started within the block get `api_key`: a named pipe given as
    `--config`, or, where no config file can carry it (an SGLang before 0.5.3, or a study
    whose server_flags name a --config of their own: SGLang takes one), `--api-key` on the
    command line; no key, no flags."""
    if not api_key:
        yield KeyHandoff(())
        return
    launch = spec.launch_spec()
    if (not spec.backend.reads_config_file(launch)
            or any(flag == "--config" for flag, _ in launch.extra_flags)):
        yield KeyHandoff((("--api-key", api_key),))
        return
    sweep_stale()
    # Quoted as YAML needs: a key like `true` or `1e3` stays the text it is.
    text = yaml.safe_dump({"api-key": api_key}, default_flow_style=False, width=1 << 16)
    with tempfile.TemporaryDirectory(prefix=own_dir(DIR_PREFIX)) as private:
        path = Path(private) / "api-key.yaml"  # the directory is 0700
        with _KeyPipe(path, text.encode()) as pipe:
            yield KeyHandoff((("--config", str(path)),), pipe)


def own_dir(prefix: str) -> str:
    """The start of a temp dir's name that says whose it is: this process on this host (a
    temp dir may be shared by several hosts, whose pids are not this one's)."""
    return f"{prefix}{os.getpid()}@{socket.gethostname()}-"


def sweep_stale(root: str | None = None, prefix: str = DIR_PREFIX) -> None:
    """Remove this user's directories named `own_dir(prefix)` of processes of this host no
    longer running (a killed worker leaves an empty pipe in its key directory: nothing of
    the key, but a directory in the temp dir)."""
    host = socket.gethostname()
    for folder in Path(root or tempfile.gettempdir()).glob(f"{prefix}*@*"):
        pid, _, rest = folder.name.removeprefix(prefix).partition("@")
        with contextlib.suppress(OSError):
            if (not pid.isdigit() or not rest.startswith(f"{host}-")
                    or folder.stat().st_uid != os.getuid()):
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(folder, ignore_errors=True)


class _KeyPipe:
    """A named pipe that writes `data` to one reader per `arm()`, from a thread of its own;
    the pipe holds the data only in the kernel's buffer between the two ends."""

    def __init__(self, path: Path, data: bytes) -> None:
        self.path, self.data = path, data
        self._armed = threading.Event()  # set: hand the key to the next reader
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="key-pipe", daemon=True)

    def __enter__(self) -> _KeyPipe:
        os.mkfifo(self.path, 0o600)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)

    def arm(self) -> None:
        self._armed.set()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._armed.wait(timeout=POLL_S * 5):
                continue
            self._armed.clear()  # armed twice before a reader came: one handoff
            fd = self._open_for_reader()
            if fd is None:
                return  # stopped
            try:
                self._write_all(fd)
            finally:
                os.close(fd)  # the reader sees the end of the file

    def _open_for_reader(self) -> int | None:
        """The pipe's write end, once a reader has opened it (None: stopped first). Never
        opened without a reader, so no reader ever finds it empty."""
        while not self._stop.is_set():
            try:
                return os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                    return None
            self._stop.wait(POLL_S)
        return None

    def _write_all(self, fd: int) -> None:
        view, deadline = memoryview(self.data), time.monotonic() + HANDOFF_S
        while view and not self._stop.is_set() and time.monotonic() < deadline:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:  # the buffer is full: the reader is behind
                self._stop.wait(POLL_S)
            except BrokenPipeError:  # the reader left
                return
