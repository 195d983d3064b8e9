"""Several `treetune search` processes sharing one study in a PostgreSQL database: together
they launch what one search would, each launch once, and lose no result. The server is a
real PostgreSQL, started here in a temp dir of its own on a port of its own, and stopped
and removed after; without PostgreSQL installed these tests skip, saying so."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa
import yaml
from optuna.trial import TrialState
from studykit import processes_with, server_processes, small_study, wait_until

from treetune.results import config_key
from treetune.server import free_port
from treetune.space import load_space
from treetune.study.claims import CLAIMS, DRIVERS, Claim, Claims
from treetune.study.spec import load_study
from treetune.study.storage import STALE_REASON

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_tmpdir")]


def postgres_bin() -> Path | None:
    """The folder of PostgreSQL's server programs: Debian's versioned folder, or PATH."""
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(folder, "initdb").is_file():
            return Path(folder)
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PrivatePostgres:
    """A private PostgreSQL server: its own data dir and port (as root, the server runs as
    the `postgres` user: PostgreSQL refuses to run as root); `url` names its `studies`
    database. It can be stopped and started again while a test runs."""

    def __init__(self, programs: Path, folder: str, as_user: list[str]) -> None:
        self.programs, self.folder, self.as_user = programs, folder, as_user
        self.data, self.port = f"{folder}/data", free_port()
        self.url = f"postgresql://treetune@127.0.0.1:{self.port}/studies"
        subprocess.run([*as_user, str(programs / "initdb"), "-D", self.data, "-U", "treetune",
                        "--auth=trust", "-E", "UTF8", "--no-sync"],
                       check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories="
                   "'' -c fsync=off -c full_page_writes=off")
        subprocess.run([*self.as_user, str(self.programs / "pg_ctl"), "-D", self.data, "-l",
                        f"{self.folder}/server.log", "-w", "-t", "60", "-o", options, "start"],
                       check=True, capture_output=True, timeout=90)

    def stop(self) -> None:
        subprocess.run([*self.as_user, str(self.programs / "pg_ctl"), "-D", self.data, "-m",
                        "fast", "-w", "-t", "60", "stop"], capture_output=True, timeout=90)
        assert wait_until(lambda: not processes_with(self.data), 30), "PostgreSQL outlived it"


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """A PrivatePostgres, started with its `studies` database, stopped and removed after;
    without PostgreSQL installed the test skips, saying so."""
    programs = postgres_bin()
    if programs is None:
        pytest.skip("PostgreSQL is not installed (no initdb under /usr/lib/postgresql/*/bin "
                    "or on PATH); .ci/run installs it where it can")
    pytest.importorskip("psycopg", reason="psycopg is not installed: pip install -e '.[dev]'")
    as_user: list[str] = []
    folder = tempfile.mkdtemp(prefix="pg", dir="/tmp")
    try:
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("running as root and there is no 'postgres' user to run "
                            "PostgreSQL as")
            shutil.chown(folder, "postgres")
            as_user = ["runuser", "-u", "postgres", "--"]
        server = PrivatePostgres(programs, folder, as_user)
        server.start()
        try:
            admin = sa.create_engine(f"postgresql://treetune@127.0.0.1:{server.port}/postgres",
                                     isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(sa.text("CREATE DATABASE studies"))
            admin.dispose()
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert not os.path.exists(folder)


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """The URL of a database on a private PostgreSQL server, for the module."""
    with private_postgres() as server:
        yield server.url


def test_claims_raced_on_postgresql_give_each_launch_to_one_search_within_the_budget(
        postgres):
    engine = sa.create_engine(postgres)
    searches = [Claims(engine, "race") for _ in range(4)]
    won: list[tuple[str, str]] = []
    start = threading.Barrier(len(searches))

    def claim_all(claims):
        start.wait()
        for n in range(2, 18):  # every search wants every config: most lose
            claim, _ = claims.take(f"1,1,{n}", 0, budget=10)
            if claim is Claim.MINE:
                won.append((claims.driver, f"1,1,{n}"))

    threads = [threading.Thread(target=claim_all, args=(c,)) for c in searches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    configs = [config for _, config in won]
    assert len(configs) == len(set(configs)) == 10, won
    with engine.connect() as conn:
        slots = conn.execute(sa.select(CLAIMS.c.slot).where(CLAIMS.c.study == "race")).scalars()
        assert sorted(slots) == list(range(10))
    engine.dispose()


def search(path: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "treetune", "search", "--study", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def test_two_searches_sharing_a_postgresql_study_launch_what_one_would_each_once(
        tmp_path, postgres, ray_cluster):
    budget = 6
    studies = []
    for driver in ("first", "second"):  # each its own output folder, as on two machines
        data = small_study(tmp_path, budget={"launches": budget}, workers=1, storage=postgres,
                           ray_address=ray_cluster, output=str(tmp_path / driver),
                           search={"strategy": "grid", "max_launches_per_config": 1})
        path = tmp_path / f"{driver}.yaml"
        path.write_text(yaml.safe_dump(data))
        studies.append(path)
    procs = [search(path) for path in studies]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err.decode()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    spec = load_study(studies[0])
    # One search of this study: the baseline, the compared tree, then the grid in order.
    compared = [config_key(c) for c in spec.compare]
    grid = [k for k in map(config_key, load_space(spec.space).configs()) if k not in compared]
    one_search = ["baseline", *compared, *grid[:budget - 1 - len(compared)]]

    launches = optuna.load_study(study_name=f"{spec.name}:launches", storage=postgres)
    complete = launches.get_trials(states=(TrialState.COMPLETE,))
    keys = [t.user_attrs["config"] for t in complete]
    assert sorted(keys) == sorted(one_search), "launched twice, or not what one search would"
    assert all("launch_result" in t.user_attrs for t in complete), "a result was lost"
    assert not launches.get_trials(states=(TrialState.RUNNING, TrialState.FAIL))
    drivers = {t.user_attrs["driver"] for t in complete}
    assert len(drivers) == 2, "one search did every launch: they did not run side by side"
    # Both searches end with every launch, so they decide alike.
    recs = [json.loads((tmp_path / d / "recommendations.json").read_text())
            for d in ("first", "second")]
    assert recs[0] == recs[1]
    engine = sa.create_engine(postgres)
    with engine.connect() as conn:
        claims = conn.execute(sa.select(CLAIMS.c.done).where(CLAIMS.c.study == spec.name)).all()
        beating = conn.execute(sa.select(DRIVERS.c.driver)).all()
    engine.dispose()
    assert [done for (done,) in claims] == [True] * budget and not beating


def test_a_killed_search_sharing_a_study_has_its_running_launch_redone_by_another(
        tmp_path, postgres, ray_cluster, monkeypatch):
    budget = 3
    paths = {}
    for driver in ("killed", "rescuer"):
        data = small_study(tmp_path, name="crashed", budget={"launches": budget}, workers=1,
                           storage=postgres, ray_address=ray_cluster,
                           output=str(tmp_path / driver),
                           search={"strategy": "grid", "max_launches_per_config": 1})
        paths[driver] = tmp_path / f"{driver}.yaml"
        paths[driver].write_text(yaml.safe_dump(data))
    marker = str(tmp_path)
    killed = search(paths["killed"])
    try:
        assert wait_until(lambda: server_processes(marker), 120), "no server started"
        os.kill(killed.pid, signal.SIGKILL)  # the search alone; Ray stops its workers
        killed.communicate(timeout=30)
    finally:
        if killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
            killed.communicate()
    assert wait_until(lambda: not server_processes(marker), 60), "a server outlived its search"
    spec = load_study(paths["killed"])
    launches = optuna.load_study(study_name=f"{spec.name}:launches", storage=postgres)
    (left,) = launches.get_trials(states=(TrialState.RUNNING,))  # its claimed launch

    # The other search waits for the claimed launch until its search stops beating.
    monkeypatch.setenv("TREETUNE_STALE_AFTER_S", "2")
    rescuer = search(paths["rescuer"])
    _, err = rescuer.communicate(timeout=300)
    assert rescuer.returncode == 0, err.decode()[-3000:]

    compared = [config_key(c) for c in spec.compare]
    grid = [k for k in map(config_key, load_space(spec.space).configs()) if k not in compared]
    one_search = ["baseline", *compared, *grid[:budget - 1 - len(compared)]]
    complete = launches.get_trials(states=(TrialState.COMPLETE,))
    assert sorted(t.user_attrs["config"] for t in complete) == sorted(one_search)
    (stale,) = launches.get_trials(states=(TrialState.FAIL,))
    assert stale.number == left.number and stale.user_attrs["reason"] == STALE_REASON
    assert stale.user_attrs["config"] in one_search and "launch_result" not in stale.user_attrs
    for name in (f"{spec.name}:batch-{b}" for b in spec.batch):
        study = optuna.load_study(study_name=name, storage=postgres)
        assert not study.get_trials(states=(TrialState.RUNNING,)), name


def test_a_database_stopped_mid_study_is_said_plainly_and_a_rerun_finishes_the_study(
        tmp_path, ray_cluster, monkeypatch):
    """The study's PostgreSQL server stopped while launches ran: the search ended with
    "internal error: StorageInternalError: ... invalid data in the commit", exit 1, and
    its cleanup stopped at the first storage call (a helper's audit). It now says the
    storage stopped answering, exit 2, stops its servers; the rerun redoes what ran."""
    with private_postgres() as server:
        path = tmp_path / "study.yaml"
        path.write_text(yaml.safe_dump(small_study(
            tmp_path, name="lost", budget={"launches": 4}, workers=2, storage=server.url,
            ray_address=ray_cluster, search={"strategy": "grid",
                                             "max_launches_per_config": 1})))
        marker = str(tmp_path)
        proc = search(path)
        try:
            assert wait_until(lambda: len(list((tmp_path / "out" / "logs").glob("*.log"))) >= 3
                              and server_processes(marker), 120), "no launch after the first"
            server.stop()
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
            server.start()
        text = err.decode()
        assert proc.returncode == 2, text[-3000:]
        assert f"error: the study storage {server.url} stopped answering (" in text, text
        assert "rerun the same command once it answers again" in text and "Traceback" not in text
        assert wait_until(lambda: not server_processes(marker), 30), "a server outlived it"
        monkeypatch.setenv("TREETUNE_STALE_AFTER_S", "2")  # the stopped search's beat
        rerun = search(path)
        _, err = rerun.communicate(timeout=300)
        assert rerun.returncode == 0, err.decode()[-3000:]
        launches = optuna.load_study(study_name="lost:launches", storage=server.url)
        complete = [t.user_attrs["config"] for t in launches.get_trials(
            states=(TrialState.COMPLETE,))]
        assert len(complete) == len(set(complete)) == 4, (
            [(t.number, t.state, t.user_attrs) for t in launches.get_trials()], err.decode())
        assert not launches.get_trials(states=(TrialState.RUNNING,))
