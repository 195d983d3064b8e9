"""A server's API key reaches it through a named pipe given as --config: never on its
command line, never written to a disk, nothing left when a worker is killed."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from treetune.config import TreeConfig
from treetune.emulator.args import build_parser, with_config_file
from treetune.study.keys import DIR_PREFIX, key_handoff, sweep_stale
from treetune.study.spec import load_study
from treetune.study.worker import launch_command

DEMO = "studies/demo.yaml"


def read_as_a_server(argv: list[str]) -> str | None:
    """The key a server started with `argv` takes: its --config read as SGLang reads it."""
    merged = with_config_file(argv[3:], build_parser())
    return build_parser().parse_known_args(merged)[0].api_key


@pytest.mark.parametrize("key", ["tt-s3cret", "true", "1e3", "a: b # c", "x\\y'\"z", "null"])
def test_a_server_takes_its_key_from_a_pipe_only_this_user_can_open(key):
    spec = load_study(DEMO)
    with key_handoff(spec, key) as keyed:
        argv = launch_command(spec, TreeConfig(3, 1, 4), (), 30000, key_flags=keyed.flags)
        path = Path(argv[argv.index("--config") + 1])
        assert key not in " ".join(argv)
        assert stat.S_ISFIFO(path.stat().st_mode) and path.stat().st_mode & 0o777 == 0o600
        assert path.parent.stat().st_mode & 0o777 == 0o700
        assert list(path.parent.iterdir()) == [path]  # no file beside it
        for _start in range(2):  # a second server (a port taken, started again) too
            keyed.arm()
            assert read_as_a_server(argv) == key  # the key, text, whatever it looks like
    assert not path.parent.exists()
    with key_handoff(spec, None) as keyed:
        assert keyed.flags == ()


def test_a_reader_the_pipe_was_not_armed_for_waits_and_never_reads_nothing():
    """An empty read would start the server without a key: a reader waits until a server
    start arms the pipe for it."""
    with key_handoff(load_study(DEMO), "k3y") as keyed:
        (_, path) = keyed.flags[0]
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(Path(path).read_bytes()),
                                  daemon=True)
        reader.start()
        reader.join(timeout=0.5)
        assert reader.is_alive() and got == []  # waiting, not reading nothing
        keyed.arm()
        reader.join(timeout=30)
        assert got == [b"api-key: k3y\n"]


@pytest.mark.parametrize("over", [{"sglang_version": "0.5.2"},
                                  {"server_flags": {"--config": "mine.yaml"}}])
def test_the_key_is_a_flag_where_no_config_file_can_carry_it(over):
    """SGLang before 0.5.3 reads no config file, and takes only one: a study with its own
    keeps the key on the command line."""
    with key_handoff(load_study(DEMO, over), "k") as keyed:
        assert keyed.flags == (("--api-key", "k"),)


KILLED = """
import sys, time
from treetune.study.keys import key_handoff
from treetune.study.spec import load_study
with key_handoff(load_study("studies/demo.yaml"), sys.argv[1]) as keyed:
    keyed.arm()
    print(keyed.flags[0][1], flush=True)
    time.sleep(600)
"""


def test_a_worker_killed_mid_start_leaves_no_byte_of_the_key(tmp_path):
    """Ray kills a stopped study's workers outright: no clean-up runs (a helper's review
    found the key in a file after a Ctrl-C). What is left holds none of it, and the next
    worker sweeps it away."""
    key = "tt-" + os.urandom(8).hex()
    worker = subprocess.Popen([sys.executable, "-c", KILLED, key], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        assert worker.stdout is not None
        path = Path(worker.stdout.readline().strip())
        assert path.parent.name.startswith(f"{DIR_PREFIX}{worker.pid}@{socket.gethostname()}-")
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    left = list(tmp_path.rglob("*"))
    assert path in left  # the pipe stays: an empty node, the key never in it
    files = [p for p in left if stat.S_ISREG(p.lstat().st_mode)]
    assert not [p for p in files if key.encode() in p.read_bytes()]
    sweep_stale(str(tmp_path))
    assert not path.parent.exists()


def test_the_sweep_keeps_a_running_worker_s_directory_and_other_hosts(tmp_path):
    """A temp dir may be shared by several hosts (an HPC cluster's): another host's pids
    are not this one's to judge (a helper's review)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    host = socket.gethostname()
    mine = tmp_path / f"{DIR_PREFIX}{os.getpid()}@{host}-abc"
    gone = tmp_path / f"{DIR_PREFIX}{dead}@{host}-abc"
    elsewhere = tmp_path / f"{DIR_PREFIX}{dead}@not-{host}-abc"
    for folder in (mine, gone, elsewhere):
        folder.mkdir()
    sweep_stale(str(tmp_path))
    assert mine.exists() and elsewhere.exists() and not gone.exists()


def test_a_pipe_armed_twice_before_its_reader_hands_the_key_over_once():
    """Two starts armed the pipe before a reader came (a first that never read it): the
    reader got the YAML twice (a helper's review)."""
    with key_handoff(load_study(DEMO), "k3y") as keyed:
        keyed.arm()
        keyed.arm()
        assert Path(keyed.flags[0][1]).read_bytes() == b"api-key: k3y\n"
