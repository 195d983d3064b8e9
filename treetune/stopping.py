"""Ctrl-C and SIGTERM for a search: both stop it as KeyboardInterrupt, raised at once or,
inside `held()` (Ray starting, the outputs being written), when the held part ends, so
that it is never left half done; a second stop is raised at once, held or not (a part that
hangs can still be stopped). Python drops a KeyboardInterrupt raised inside a weakref
callback or a `__del__` (it prints "Exception ignored in ..."): the stop stays asked for
until it is handled (`clear()`), and `check()` raises it again where the search can take
it. A signal ignored when the command started (a background job of a script) stays
ignored."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_asked = False  # a stop was asked for and not yet handled
_held = 0  # depth of held() blocks


def handler(signum: int, frame: object) -> None:
    """The signal handler: ask for the stop, and raise it unless it is held and the
    first."""
    global _asked
    again, _asked = _asked, True
    if not _held or again:
        raise KeyboardInterrupt


def install(signals: tuple[signal.Signals, ...] = SIGNALS) -> Callable[[], None]:
    """`handler` for `signals` (main thread only: elsewhere nothing is installed); returns
    what puts the previous handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous: dict[signal.Signals, Any] = {
        s: signal.signal(s, handler) for s in signals if signal.getsignal(s) != signal.SIG_IGN}

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return restore


def asked() -> bool:
    return _asked


def check() -> None:
    """Raise the stop asked for, if it was lost on the way."""
    if _asked:
        raise KeyboardInterrupt


def clear() -> None:
    """The stop was handled: a later one is a new one."""
    global _asked
    _asked = False


@contextmanager
def held() -> Iterator[None]:
    """A part that a stop must not cut: one asked for meanwhile is raised at its end."""
    global _held
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _asked:
            raise KeyboardInterrupt
