"""`python -m treetune.pdeathsig [--ppid PID] -- COMMAND...`: run COMMAND so that it dies
with the process that started it.

A server must not outlive its owner (a Ray worker killed mid-study would otherwise leave a
GPU server running). Setting the parent-death signal in `preexec_fn` is unsafe in threaded
processes, so the owner launches this tiny wrapper instead: it asks Linux for SIGKILL on the
parent's death, then execs the real command, which keeps the setting and the pid. Linux
delivers the signal when the *thread* that started the wrapper exits, so start servers from
a long-lived thread. On other systems the command is simply exec'd.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
USAGE = "usage: python -m treetune.pdeathsig [--ppid PID] -- COMMAND [ARG...]"


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` when our parent exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")
    return True


def parse(argv: list[str]) -> tuple[int | None, list[str]]:
    """(the owner's pid if given, the command)."""
    ppid = None
    if argv[:1] == ["--ppid"] and len(argv) >= 2:
        ppid = int(argv[1])
        argv = argv[2:]
    if argv[:1] != ["--"] or len(argv) < 2:
        raise SystemExit(USAGE)
    return ppid, argv[1:]


def main(argv: list[str] | None = None) -> None:
    ppid, command = parse(sys.argv[1:] if argv is None else argv)
    expected = ppid if ppid is not None else os.getppid()
    set_parent_death_signal()
    # The owner may have died before prctl took effect; the signal would then never come.
    if os.getppid() != expected:
        os._exit(1)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"treetune.pdeathsig: cannot run {command[0]!r}: {exc.strerror}",
              file=sys.stderr, flush=True)
        os._exit(127)


if __name__ == "__main__":
    main()
