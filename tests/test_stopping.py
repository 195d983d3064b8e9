"""Ctrl-C and SIGTERM: a stop raised at once, or held to the end of a part that must not be
cut; a stop Python dropped raised again; and a command's interrupt exiting 130 with a word
(Typer returned 130 and `treetune` exited 0, silently)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from studykit import run_cli

from treetune import stopping


@pytest.fixture
def handlers():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are the main thread's")
    restore = stopping.install()
    yield
    restore()
    stopping.clear()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_at_once_outside_a_held_part(handlers, sig):
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), sig)
        for _ in range(1000):  # the handler runs between bytecodes
            pass
    assert stopping.asked()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_in_a_held_part_is_raised_when_the_part_ends(handlers, sig):
    steps = []
    with pytest.raises(KeyboardInterrupt), stopping.held():
        os.kill(os.getpid(), sig)
        for _ in range(1000):
            pass
        steps.append("the rest of the part ran")
    assert steps == ["the rest of the part ran"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stop_dropped_on_the_way_is_raised_at_the_next_check(handlers):
    class Dropping:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # raised here, inside __del__: Python prints and drops it
                pass

    Dropping()  # collected at once
    assert stopping.asked()
    with pytest.raises(KeyboardInterrupt):
        stopping.check()
    stopping.clear()
    stopping.check()  # handled: nothing left to raise


def test_an_interrupt_that_reaches_typer_exits_130_with_a_word(capsys, monkeypatch):
    import treetune.cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(treetune.cli, "shipped_profiles", interrupted)
    code, _out, err = run_cli(capsys, "profiles")
    assert code == 130 and "aborted" in err


@pytest.mark.parametrize("route", ["typer", "search"])
def test_an_interrupt_cut_through_an_exec_of_a_string_still_exits_130(tmp_path, route):
    """`python -m treetune search` stopped while a module imported (a dataclass or a
    namedtuple being made: an exec or eval of a string) exited by SIGINT (-2), not 130:
    CPython 3.11 leaves its "unhandled KeyboardInterrupt" flag set when the interrupt
    escapes such an exec, even once handled, and checks it at exit under `-m`. Made here
    without a clock: the command's stop escapes an exec of a string, as there."""
    import subprocess
    import sys

    (tmp_path / "stopped.py").write_text(
        "import sys, treetune.cli as cli\n"
        "@cli.app.command('stopped')\n"
        "def stopped():\n"
        "    exec('raise KeyboardInterrupt')\n"
        "@cli.app.command('stopped-search')\n"
        "def stopped_search():\n"
        "    try:\n"
        "        exec('raise KeyboardInterrupt')\n"
        "    except KeyboardInterrupt:\n"
        "        cli.exit_interrupted()  # as `search` ends an interrupted study\n"
        f"cli.main([{'stopped' if route == 'typer' else 'stopped-search'!r}])\n")
    done = subprocess.run([sys.executable, "-m", "stopped"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 130, (done.returncode, done.stderr[-2000:])
    assert ("aborted" in done.stderr) == (route == "typer")
