"""Security: loopback by default, no shell anywhere, quoted commands, safe YAML, an API key
that reaches the server and the load generator and nothing else, escaped report HTML."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from studykit import ray_env, short_ray_dir, small_study

import treetune

pytestmark = pytest.mark.slow
HOSTILE_MODEL = "/m/$(touch x); y <script>alert(1)</script>"


@pytest.mark.no_ray  # reads the source: beside the heavy tests
def test_no_shell_is_ever_used():
    package = Path(treetune.__file__).parent
    offenders = []
    for path in package.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if re.search(r"shell\s*=\s*True|os\.system\(|os\.popen\(|commands\.getoutput",
                         line):
                offenders.append(f"{path.relative_to(package)}:{number}: {line.strip()}")
    assert not offenders, offenders


@pytest.mark.no_ray  # refused before Ray starts: beside the heavy tests
def test_a_python_object_tag_in_a_study_file_is_refused(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text(f"name: !!python/object/apply:os.system ['touch {tmp_path}/pwned']\n")
    done = subprocess.run([sys.executable, "-m", "treetune", "search", "--study", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and "not valid YAML" in done.stderr
    assert str(path) in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "pwned").exists()


@pytest.fixture(scope="module")
def keyed_study(tmp_path_factory):
    """A real search whose servers require an API key, listening on every interface,
    for a model whose path is hostile to shells and HTML; then its report."""
    tmp = tmp_path_factory.mktemp("keyed")
    # A backslash and a quote: SGLang logs its arguments as a repr, which escapes them.
    key = "tt-" + secrets.token_hex(16) + "\\q'"
    study = small_study(tmp, name="keyed", model=HOSTILE_MODEL, batch=[1],
                        datasets=["humaneval"], budget={"launches": 3}, workers=1,
                        api_key_env="TT_TEST_API_KEY", host="0.0.0.0",
                        # one launch per config, so each config's server log is its own
                        search={"max_launches_per_config": 1})
    path = tmp / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    with short_ray_dir() as ray_dir:  # removed once both commands are done
        env = {**os.environ, "TT_TEST_API_KEY": key, **ray_env(ray_dir)}
        with CommandLines() as seen:  # what `ps` shows other users while the search runs
            search = subprocess.run([sys.executable, "-m", "treetune", "search", "--study",
                                     str(path)], capture_output=True, text=True, timeout=300,
                                    env=env, cwd=tmp)
        report = subprocess.run([sys.executable, "-m", "treetune", "report", str(tmp / "out")],
                                capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
    return tmp, key, [search, report], seen.lines


class CommandLines:
    """Every process's command line on this machine, read from /proc every 20 ms (as `ps`
    does) while the block runs: each distinct one, as its arguments."""

    def __init__(self) -> None:
        self.lines: set[tuple[str, ...]] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> CommandLines:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(0.02):
            for entry in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    raw = entry.read_bytes()
                except OSError:  # the process ended
                    continue
                self.lines.add(tuple(raw.decode(errors="replace").split("\0")))


def test_the_api_key_reaches_the_servers_and_the_load_generator(keyed_study):
    tmp, _key, (search, _report), _seen = keyed_study
    assert search.returncode == 0, search.stderr[-3000:]
    # The emulator refuses unauthenticated requests (401), so measured cells prove the
    # load generator sent the key; each server logged it, redacted.
    logs = list((tmp / "out" / "logs").glob("*.log"))
    assert len(logs) == 3
    for log in logs:
        assert re.search(r"api_key=(['\"])\*\*\*\1", log.read_text()), log.read_text()


def test_the_api_key_is_in_no_log_storage_report_script_or_output(keyed_study):
    from treetune.server import secret_forms

    tmp, key, runs, _seen = keyed_study
    forms = secret_forms(key)
    assert b"\\\\q" in b"".join(forms)  # the repr's doubled backslash among them
    leaks = [str(p) for p in (tmp / "out").rglob("*")
             if p.is_file() and any(form in p.read_bytes() for form in forms)]
    assert not leaks, leaks
    for run in runs:
        assert not any(form.decode() in run.stdout + run.stderr for form in forms)
    for script in (tmp / "out" / "launch").glob("*.sh"):
        assert '--api-key "${TT_TEST_API_KEY:?' in script.read_text()


def test_no_command_line_shows_the_api_key(keyed_study):
    """Every user of a machine can read its processes' command lines: each server took
    its key from a file only this user can read, removed once the server had started."""
    from treetune.server import secret_forms

    _tmp, key, _runs, seen = keyed_study
    forms = [form.decode() for form in secret_forms(key)]
    # This study's servers (its model), not another's on the machine: a server of a study
    # run beside the suite has no --config (no key).
    servers = [argv for argv in seen if "treetune.emulator" in argv and HOSTILE_MODEL in argv]
    assert len(servers) >= 3, servers  # three configs, three servers
    assert not [argv for argv in seen if any(form in " ".join(argv) for form in forms)]
    files = [Path(argv[argv.index("--config") + 1]) for argv in servers]
    assert all(path.name == "api-key.yaml" for path in files)
    assert not [path for path in files if path.exists() or path.parent.exists()]


def test_a_non_loopback_host_is_warned_about(keyed_study):
    _tmp, _key, (search, _report), _seen = keyed_study
    warning = [line for line in search.stderr.splitlines() if "warning:" in line]
    assert warning and "0.0.0.0" in warning[0] and "reachable from other machines" in warning[0]


def test_launch_scripts_of_a_hostile_model_path_execute_nothing_injected(keyed_study):
    tmp, _key, _runs, _seen = keyed_study
    stub = tmp / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "python").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    (stub / "python").chmod(0o755)
    scripts = sorted((tmp / "out" / "launch").glob("*.sh"))
    assert scripts
    for script in scripts:
        args_out = tmp / "args.txt"
        env = {"PATH": f"{stub}:/usr/bin:/bin", "ARGS_OUT": str(args_out),
               "TT_TEST_API_KEY": "k"}
        subprocess.run(["sh", str(script)], env=env, cwd=tmp, check=True, timeout=30)
        args = args_out.read_text().splitlines()
        assert HOSTILE_MODEL in args, args
        assert not (tmp / "x").exists(), f"{script.name} ran the injected command"


def test_the_report_escapes_the_model_name(keyed_study):
    tmp, _key, (_search, report), _seen = keyed_study
    assert report.returncode == 0, report.stderr[-2000:]
    index = (tmp / "out" / "report" / "report.html").read_text()
    assert "<script>alert(1)</script>" not in index
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in index


LOCAL_RAY = """
import os, subprocess, sys
if os.environ.get("IMPORT_RAY_FIRST"):
    import ray  # an in-process caller: Ray read its mode already
from treetune.study.runner import _Ray
from treetune.study.spec import load_study

session = _Ray(load_study("studies/demo.yaml", {"workers": 1}))
ray = session.ray
try:
    token = os.environ.get("RAY_AUTH_TOKEN", "")
    print("mode", os.environ.get("RAY_AUTH_MODE"), "token", len(token))
    print("task", ray.get(ray.remote(lambda: 41 + 1).remote()))
    gcs = ray.get_runtime_context().gcs_address
    # Another user on the network: Ray's GCS listens on every interface. Its patience is
    # not what is tested (Ray retries a refused connection for 20 s by default): the
    # refusal's reason is.
    intruder = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    intruder["RAY_gcs_server_port_wait_time_s"] = "2"
    done = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={gcs!r})"],
                          env=intruder, capture_output=True, text=True, timeout=120)
    print("intruder", done.returncode, done.stderr.strip().splitlines()[-1:])
    print("refused for its token", "InvalidAuthToken" in done.stderr)
finally:
    session.shutdown()
print("after", os.environ.get("RAY_AUTH_MODE"), os.environ.get("RAY_AUTH_TOKEN"))
"""


@pytest.mark.ray_no_server  # one Ray task, no server: beside the heavy tests
@pytest.mark.parametrize(("mode", "first"), [(None, False), (None, True), ("disabled", False)],
                         ids=["fresh", "ray-imported-first", "disabled-by-the-user"])
def test_a_local_ray_takes_a_token_of_its_own_unless_the_user_chose_a_mode(tmp_path, mode,
                                                                          first):
    """Ray 2.60's GCS and raylets listen on every interface; with authentication disabled
    (treetune's default before), a process on another machine joined the study's cluster,
    ran code in it and read the API key from its environment (a helper's audit). The token
    lives in the run's environment only: nothing is written to ~/.ray, and the environment
    is as it was afterwards."""
    with short_ray_dir() as ray_dir:
        env = {k: v for k, v in {**os.environ, **ray_env(ray_dir)}.items()
               if not k.startswith("RAY_AUTH")} | {"HOME": str(tmp_path)}
        if mode:
            env["RAY_AUTH_MODE"] = mode
        if first:
            env["IMPORT_RAY_FIRST"] = "1"
        done = subprocess.run([sys.executable, "-c", LOCAL_RAY], env=env, capture_output=True,
                              text=True, timeout=300, cwd=Path(treetune.__file__).parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "task 42" in lines
    if mode is None:
        assert "mode token token 64" in lines
        assert next(x for x in lines if x.startswith("intruder")).startswith("intruder 1")
        assert "Failed to connect" in done.stdout
        assert "refused for its token True" in lines
    else:
        assert "mode disabled token 0" in lines
    assert lines[-1] == f"after {mode} None"
    assert not (tmp_path / ".ray").exists()


HEAD = """
import os, sys
from treetune.study.runner import _Ray
from treetune.study.spec import load_study

session = _Ray(load_study("studies/demo.yaml", {"workers": 1}))
try:
    print(session.ray.get_runtime_context().gcs_address, os.environ["RAY_AUTH_TOKEN"],
          flush=True)
    sys.stdin.readline()  # until the test is done with it
finally:
    session.shutdown()
"""
JOIN = """
import os, sys
from treetune.study.runner import _Ray
from treetune.study.spec import load_study

session = _Ray(load_study("studies/demo.yaml", {"workers": 1, "ray_address": sys.argv[1]}))
try:
    print("mode", os.environ.get("RAY_AUTH_MODE"))
    print("task", session.ray.get(session.ray.remote(lambda: 41 + 1).remote()))
finally:
    session.shutdown()
"""


@pytest.mark.ray_no_server  # one Ray task, no server: beside the heavy tests
def test_a_cluster_with_token_authentication_is_joined_with_the_token_at_hand(tmp_path):
    """Joining --ray-address, token mode is asked for when a token is where Ray looks;
    Ray had read its mode when imported, so the join was refused for a missing token
    (a helper's audit)."""
    with short_ray_dir() as ray_dir:
        env = {k: v for k, v in {**os.environ, **ray_env(ray_dir)}.items()
               if not k.startswith("RAY_AUTH")} | {"HOME": str(tmp_path)}
        cwd = Path(treetune.__file__).parents[1]
        head = subprocess.Popen([sys.executable, "-c", HEAD], env=env, cwd=cwd, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        try:
            assert head.stdout is not None and head.stdin is not None
            address, token = head.stdout.readline().split()
            done = subprocess.run([sys.executable, "-c", JOIN, address],
                                  env={**env, "RAY_AUTH_TOKEN": token}, cwd=cwd,
                                  capture_output=True, text=True, timeout=300)
        finally:
            with contextlib.suppress(OSError, ValueError):
                head.stdin.close()  # type: ignore[union-attr]
            head.wait(timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mode token" in done.stdout and "task 42" in done.stdout
