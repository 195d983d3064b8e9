"""Storage that cannot be written, and the ports and process groups of servers: each
refused or handled before a GPU is wasted."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from optuna.trial import TrialState
from studykit import processes_with, run_cli, server_processes, small_study, wait_until

from treetune.results import config_key
from treetune.study.runner import run_study
from treetune.study.spec import load_study
from treetune.study.storage import StudyStore

pytestmark = pytest.mark.slow


def write_study(tmp_path, **over):
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(small_study(tmp_path, **over)))
    return path


def search(path, timeout_s=60):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "treetune", "search", "--study", str(path)],
                          capture_output=True, text=True, timeout=timeout_s)
    return done.returncode, done.stderr, time.monotonic() - started


def assert_refused_before_any_launch(tmp_path, code, err):
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err
    assert not (tmp_path / "out" / "logs").exists(), "a worker started"
    assert not server_processes(str(tmp_path))
    assert not processes_with(os.environ["TREETUNE_RAY_TMPDIR"]), "Ray was started"


HOLD_SQLITE = textwrap.dedent("""
    import sqlite3, sys, time
    db = sqlite3.connect(sys.argv[1], isolation_level=None)
    db.execute("BEGIN EXCLUSIVE")
    print("locked", flush=True)
    time.sleep(120)
""")


@pytest.mark.no_ray  # refused before Ray starts (asserted): beside the heavy tests
def test_a_storage_locked_by_another_process_is_refused_before_any_launch(tmp_path):
    path = write_study(tmp_path)
    StudyStore(load_study(path))  # the storage exists, as after an earlier run
    holder = subprocess.Popen([sys.executable, "-c", HOLD_SQLITE,
                               str(tmp_path / "out" / "study.db")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        code, err, took = search(path)
    finally:
        holder.kill()
        holder.wait()
    assert_refused_before_any_launch(tmp_path, code, err)
    assert "locked by another process" in err and "study.db" in err
    assert took < 30


HOLD_LOCK = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    print("locked", flush=True)
    time.sleep(120)
""")


@pytest.mark.no_ray  # refused before Ray starts (asserted): beside the heavy tests
def test_a_second_search_of_the_same_study_is_refused_naming_the_first(tmp_path):
    path = write_study(tmp_path)
    (tmp_path / "out").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK,
                               str(tmp_path / "out" / ".treetune.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        code, err, _ = search(path)
    finally:
        holder.kill()
        holder.wait()
    assert_refused_before_any_launch(tmp_path, code, err)
    assert f"another treetune search (pid {holder.pid})" in err


@contextlib.contextmanager
def read_only(folder):
    """Make `folder` read-only for us, root included (chattr +i where chmod is not enough)."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o555)
    immutable = False
    if os.geteuid() == 0:
        immutable = subprocess.run(["chattr", "+i", str(folder)],
                                   capture_output=True).returncode == 0
    try:
        probe = folder / "probe"
        try:
            probe.write_text("")
            probe.unlink()
            pytest.skip("cannot make a folder read-only here")
        except OSError:
            pass
        yield folder
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        os.chmod(folder, 0o755)


@pytest.mark.no_ray  # refused before Ray starts (asserted): beside the heavy tests
def test_a_read_only_output_folder_is_refused_before_any_launch(tmp_path):
    path = write_study(tmp_path)
    with read_only(tmp_path / "out"):
        code, err, _ = search(path)
    assert_refused_before_any_launch(tmp_path, code, err)
    assert "not writable" in err and str(tmp_path / "out") in err


@pytest.mark.no_ray  # refused before Ray starts (asserted): beside the heavy tests
def test_a_read_only_storage_folder_is_refused_before_any_launch(tmp_path):
    path = write_study(tmp_path, storage=f"sqlite:///{tmp_path}/db/study.db")
    with read_only(tmp_path / "db"):
        code, err, _ = search(path)
    assert_refused_before_any_launch(tmp_path, code, err)
    assert "cannot write the study storage" in err and "not writable" in err


@pytest.mark.no_ray  # refused before Ray starts (asserted): beside the heavy tests
@pytest.mark.parametrize(("kind", "fragment"), [
    ("text file", "is not an SQLite database (file is not a database)"),
    ("folder", "is a folder: give a database file's path"),
])
def test_a_storage_that_is_no_database_is_refused_naming_it(tmp_path, kind, fragment):
    where = tmp_path / "db" / "study.db"
    if kind == "folder":
        where.mkdir(parents=True)
    else:
        where.parent.mkdir()
        where.write_text("notes, not a database\n")
    code, err, _ = search(write_study(tmp_path, storage=f"sqlite:///{where}"))
    assert_refused_before_any_launch(tmp_path, code, err)
    assert f"the study storage {where} {fragment}" in " ".join(err.split())


# A stand-in `sglang.launch_server` that behaves as SGLang does at start-up: it spawns a
# scheduler process, then never becomes healthy (a wedged NCCL init, say).
HANGING_SGLANG = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "scheduler",
                      sys.argv[sys.argv.index("--model-path") + 1]])
    print("loading weights ...", flush=True)
    time.sleep(600)
""")


def test_a_server_never_healthy_is_killed_with_every_process_it_spawned(tmp_path, ray_cluster):
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(HANGING_SGLANG)
    spec = load_study(None, small_study(
        tmp_path, name="hang", budget={"launches": 2}, workers=1, compare=[],
        backend={"kind": "sglang", "python": sys.executable},
        env={"PYTHONPATH": str(tmp_path / "fake")},
        measurement={"duration_s": 6.0, "repeats": 2, "startup_timeout_s": 4.0},
        ray_address=ray_cluster))
    marker = str(tmp_path / "model-under-test")
    with contextlib.suppress(Exception):  # the baseline fails: the study stops
        run_study(spec)
    seen = processes_with(marker)
    assert not seen, "a process of the hung server's group survived"
    (result,) = StudyStore(spec).results()
    assert config_key(result.config) == "baseline" and not result.ok
    assert result.reason == "not healthy after 4 s" and "loading weights" in result.log_tail


def test_a_port_already_in_use_makes_the_worker_choose_another(tmp_path, monkeypatch):
    """The kernel's free port is taken by someone else before the server binds it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        import treetune.server as server_module

        real = server_module.free_port
        monkeypatch.setattr(server_module, "free_port",
                            lambda host="127.0.0.1": next(ports, None) or real(host))
        from treetune.study.worker import LaunchWorker

        spec = load_study(None, small_study(tmp_path, batch=[1], datasets=["humaneval"],
                                            compare=[]))
        worker = LaunchWorker(spec, 0)
        from treetune.results import LaunchResult

        result = LaunchResult.from_dict(worker.run("baseline", []))
        assert next(ports, None) is None, "the busy port was offered to the server"
    assert result.ok and result.attempts == 1, result.reason
    assert {c.dataset for c in result.cells} == {"humaneval"}
    assert wait_until(lambda: not server_processes(str(tmp_path)), 5)


def test_storage_lost_between_a_launchs_two_writes_keeps_its_measurement_for_the_rerun(
        tmp_path, ray_cluster, monkeypatch):
    """The database stopped after a launch's result was written and before its end: the
    rerun failed that launch as stale yet counted it as finished (a failed trial holding a
    result), so the compared tree was neither kept nor redone and the study stored 3 of its
    4 launches (a stopped PostgreSQL server, 1 run in 22: a helper's finding). The cut is
    made here without a clock: the result is written, then the storage error raised."""
    import json

    import sqlalchemy as sa

    from treetune.errors import TreetuneError
    from treetune.study.storage import RESULT_ATTR

    spec = load_study(None, small_study(tmp_path, budget={"launches": 4},
                                        ray_address=ray_cluster,
                                        search={"strategy": "grid",
                                                "max_launches_per_config": 1}))
    finish = StudyStore.finish_launch

    def cut_after_the_result(self, trial, result):
        if config_key(result.config) != "3,4,8":
            return finish(self, trial, result)
        trial.set_user_attr(RESULT_ATTR, json.dumps(result.to_dict()))
        raise sa.exc.OperationalError("COMMIT", {}, ConnectionError(
            "server closed the connection unexpectedly"))

    monkeypatch.setattr(StudyStore, "finish_launch", cut_after_the_result)
    with pytest.raises(TreetuneError, match="stopped answering"):
        run_study(spec)
    monkeypatch.undo()
    measured = json.loads(next(
        t for t in StudyStore(spec).launches.get_trials()
        if t.user_attrs["config"] == "3,4,8").user_attrs[RESULT_ATTR])
    notes: list[str] = []
    outcome = run_study(spec, lambda p: notes.extend(n for n in p.notes if n not in notes))
    keys = [config_key(r.config) for r in outcome.results]
    assert len(keys) == len(set(keys)) == 4 and "3,4,8" in keys, keys
    kept = next(r for r in outcome.results if config_key(r.config) == "3,4,8")
    assert kept.ok and kept.started_at == measured["started_at"], "measured twice"
    complete = [t.user_attrs["config"] for t in StudyStore(spec).launches.get_trials(
        states=(TrialState.COMPLETE,))]
    assert sorted(complete) == sorted(keys)  # as the stopped-PostgreSQL test counts them
    # Ended from its stored result: not stale (the others were abandoned as the first
    # search stopped, its storage still answering them).
    assert outcome.stale_redone == 0 and not any("left unfinished" in n for n in notes), notes
    assert not server_processes(str(tmp_path))


@pytest.fixture
def study_copy(tmp_path, small_study) -> Path:
    """A finished study's folder of this test's own, to damage."""
    folder = tmp_path / "study"
    shutil.copytree(small_study, folder)
    return folder


@pytest.mark.parametrize("damage", ["a key of another version", "not json"])
def test_a_stored_launch_another_version_wrote_is_refused_naming_it(capsys, tmp_path,
                                                                    study_copy, damage):
    """A launch stored with a cell key this version does not know (or text that is no
    JSON) made `report` and a resumed search end on an internal error (an audit)."""
    from treetune.study.storage import RESULT_ATTR

    folder = study_copy
    spec = load_study(folder / "study.yaml", {"output": str(folder)})
    store = StudyStore(spec)
    trial = store.launches.get_trials(states=(TrialState.COMPLETE,))[0]
    stored = json.loads(trial.user_attrs[RESULT_ATTR])
    stored["cells"][0]["new_metric"] = 1.0
    text = json.dumps(stored) if damage != "not json" else "{cells: ["
    with sqlite3.connect(folder / "study.db") as db:  # a finished trial, as stored
        assert db.execute("UPDATE trial_user_attributes SET value_json = ? WHERE trial_id = ? "
                          "AND key = ?", (json.dumps(text), trial._trial_id, RESULT_ATTR)
                          ).rowcount == 1
    db.close()
    code, _, err = run_cli(capsys, "report", str(folder), "--output", str(tmp_path / "r"))
    assert code == 2, err
    assert f"a stored launch (trial {trial.number} of the launches study) cannot be read" in err
    assert "another treetune version" in err and "Traceback" not in err


def test_a_truncated_study_db_is_said_in_sqlite_s_words(capsys, tmp_path, study_copy):
    """Optuna's "An exception is raised during the commit ... exceeding max length" stood
    for a damaged file (an audit): the database's own words, and the URL as given."""
    folder = study_copy
    db = folder / "study.db"
    db.write_bytes(db.read_bytes()[:20000])
    code, _, err = run_cli(capsys, "report", str(folder), "--output", str(tmp_path / "r"))
    assert code == 2 and f"cannot open study storage sqlite:///{db}: (sqlite3." in err, err
    assert "during the commit" not in err and "mode=ro" not in err
