"""Processes that die or are stopped under a running study: a Ray worker killed, a node
leaving the cluster, `treetune search` itself killed with SIGKILL or stopped with Ctrl-C or
SIGTERM. Nothing measured is lost or counted twice, and no server outlives its owner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import optuna
import pytest
import yaml
from optuna.trial import TrialState
from studykit import (
    dir_holders,
    parent_of,
    release_ray_dir,
    server_processes,
    small_study,
    wait_until,
)

from treetune.results import config_key
from treetune.study.runner import run_study
from treetune.study.spec import load_study
from treetune.study.storage import StudyStore

pytestmark = pytest.mark.slow
STUDIES = ("small:launches", "small:batch-1", "small:batch-8")


def launch_trials(spec, state):
    study = optuna.load_study(study_name=f"{spec.name}:launches", storage=spec.storage_url)
    return study.get_trials(states=(state,))


def assert_each_config_measured_once(spec, outcome, launches):
    keys = [config_key(r.config) for r in outcome.results]
    assert len(keys) == len(set(keys)) == launches, keys
    assert all(r.ok for r in outcome.results), [(r.config, r.reason) for r in outcome.results]
    complete = [t.user_attrs["config"] for t in launch_trials(spec, TrialState.COMPLETE)]
    assert sorted(complete) == sorted(keys), "a result was stored twice or not at all"


def kill_when(condition, action, timeout_s=120.0):
    """Run `action(value)` in the background once `condition()` returns a value."""
    done: dict[str, object] = {}

    def watch():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = condition()
            if value:
                done["value"] = value
                action(value)
                return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, done


def test_a_killed_worker_process_has_its_launch_rescheduled_on_another_worker(tmp_path,
                                                                            ray_cluster):
    # On the session's Ray cluster: what dies is a launch worker, not Ray.
    spec = load_study(None, small_study(tmp_path, budget={"launches": 5},
                                        ray_address=ray_cluster))
    marker = str(tmp_path)

    def wide_server():
        return next((pid for pid in server_processes(marker)
                     if "--speculative-eagle-topk 4 " in open(f"/proc/{pid}/cmdline", "rb")
                     .read().replace(b"\0", b" ").decode()), None)

    def kill_its_worker(server_pid):
        os.kill(parent_of(server_pid), signal.SIGKILL)  # the Ray worker that owns it

    thread, killed = kill_when(wide_server, kill_its_worker)
    outcome = run_study(spec)
    thread.join(1)
    assert "value" in killed, "the wide tree's server was never seen"
    assert wait_until(lambda: not os.path.exists(f"/proc/{killed['value']}/cmdline"), 5), \
        "the killed worker's server outlived it"
    assert_each_config_measured_once(spec, outcome, 5)
    abandoned = [t for t in launch_trials(spec, TrialState.FAIL)
                 if "worker died" in t.user_attrs.get("reason", "")]
    assert [t.user_attrs["config"] for t in abandoned] == ["3,4,8"]
    assert "launch_result" not in abandoned[0].user_attrs
    assert not server_processes(marker)


def test_a_node_leaving_the_cluster_mid_study_lets_the_study_finish_on_the_other(tmp_path):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {}, "temp_dir": os.environ["TREETUNE_RAY_TMPDIR"],
        "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=2, resources={"emulated_gpu": 4}) for _ in range(2)]
    cluster.wait_for_nodes()
    try:
        # Four launches, as test_cluster.py's node loss: the node leaves with the third
        # running, and its launch and the fourth are left to the other node.
        spec = load_study(None, small_study(tmp_path, budget={"launches": 4},
                                            ray_address=cluster.address))
        marker = str(tmp_path)

        def two_running_after_a_result():
            logs = list((spec.output_dir / "logs").glob("*.log"))
            return len(logs) >= 3 and len(server_processes(marker)) >= 2

        thread, removed = kill_when(two_running_after_a_result,
                                    lambda _: cluster.remove_node(nodes[1]), timeout_s=180)
        outcome = run_study(spec)
        thread.join(1)
        assert "value" in removed, "the node was never removed"
        assert_each_config_measured_once(spec, outcome, 4)
        rescheduled = [t for t in launch_trials(spec, TrialState.FAIL)
                       if "worker died" in t.user_attrs.get("reason", "")]
        assert rescheduled, "the removed node's launch was not rescheduled"
        assert not server_processes(marker)
    finally:
        cluster.shutdown()


def process_group(pid):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def write_study(tmp_path, **over):
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(small_study(tmp_path, **over)))
    return path


def search(path, *extra):
    """`treetune search` as a terminal starts it, with Ctrl-C's default disposition. A shell
    that starts the suite in the background (`pytest ... &` in a script) makes it ignore
    SIGINT, an ignored signal stays ignored across exec, and Python then installs no
    KeyboardInterrupt handler: the search would never see the test's Ctrl-C. A handled
    signal is reset to its default by exec, so the search is started while this process
    handles SIGINT."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen([sys.executable, "-m", "treetune", "search", "--study",
                                 str(path), *extra], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    finally:
        if previous is not None:  # None: set outside Python, so it cannot be put back
            signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM],
                         ids=["ctrl-c", "sigterm-to-the-group"])
def test_ctrl_c_or_sigterm_stops_every_server_and_resumes_cleanly(tmp_path, sig, ray_cluster):
    """Ctrl-C to the search, or SIGTERM to its whole process group, as `timeout` and job
    schedulers send it: that stops the local Ray's own processes too, and a search that
    then asked Ray's GCS to free each worker waited a minute per call (exit 1 after 60 s,
    no hint). Four launches: what is stopped is the first server's, so the resumed search
    measures about all of them; more would only lengthen the resume."""
    path = write_study(tmp_path, budget={"launches": 4})
    marker = str(tmp_path)
    proc = search(path)
    try:
        assert wait_until(lambda: server_processes(marker), 120), "no server started"
        time.sleep(0.5)
        stopped = time.monotonic()
        if sig == signal.SIGTERM:
            # Ray's processes are not in the group: a dying raylet once ended the search
            # with exit 1 before its stop was done (seen once beside a hog, stop 79).
            in_group = [h for h in dir_holders(os.environ["TREETUNE_RAY_TMPDIR"])
                        if h.pid != proc.pid and process_group(h.pid) == proc.pid]
            assert not in_group, in_group
            os.killpg(proc.pid, sig)  # its own session: the group is the search's
        else:
            proc.send_signal(sig)
        _out, err = proc.communicate(timeout=90)
        assert time.monotonic() - stopped < 40, "the search took a minute to stop"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err_text = err.decode()
    assert proc.returncode == 130, err_text[-2000:]
    hint = [line for line in err_text.splitlines() if "rerun the same command" in line]
    assert len(hint) == 1 and "Traceback" not in err_text
    assert wait_until(lambda: not server_processes(marker), 15), "a server outlived the search"
    spec = load_study(path)
    for name in STUDIES:
        study = optuna.load_study(study_name=name, storage=spec.storage_url)
        assert not study.get_trials(states=(TrialState.RUNNING,)), name
    done_before = {config_key(r.config): r.started_at for r in StudyStore(spec).results()}
    # Resumed on the session's Ray cluster: what is tested is the stopped search's storage.
    resumed = run_study(spec.replace(ray_address=ray_cluster))
    assert_each_config_measured_once(spec, resumed, 4)
    for r in resumed.results:
        if config_key(r.config) in done_before:
            assert r.started_at == done_before[config_key(r.config)], "a result was redone"


def test_sigkill_of_the_search_leaves_no_server_and_a_rerun_redoes_the_stale_launches(
        tmp_path, ray_cluster):
    # Four launches: the two running when the search is killed, and two after them.
    path = write_study(tmp_path, budget={"launches": 4})
    marker = str(tmp_path)
    proc = search(path)
    try:
        assert wait_until(lambda: len(server_processes(marker)) >= 2, 120)
        os.kill(proc.pid, signal.SIGKILL)  # the search alone: its children are on their own
        proc.wait(timeout=10)
        assert wait_until(lambda: not server_processes(marker), 30), \
            "a server outlived the killed search"
        # The killed search's local Ray goes with it, but for the agents of its raylet,
        # which wait a minute on the gone GCS: those are ended, as a user would.
        left = release_ray_dir(os.environ["TREETUNE_RAY_TMPDIR"])
        assert not left, "processes outlived the killed search:\n" + "\n".join(map(str, left))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    spec = load_study(path)
    running = launch_trials(spec, TrialState.RUNNING)
    assert running, "the killed search left its running launches marked running"
    stale = {t.user_attrs["config"] for t in running}
    notes: list[str] = []
    resumed = run_study(spec.replace(ray_address=ray_cluster),  # see the Ctrl-C test
                        lambda p: notes.extend(n for n in p.notes if n not in notes))
    assert resumed.stale_redone == len(running)
    # Said once above the progress line (it was a passing message, overwritten at once).
    assert f"{len(running)} launch(es) of an earlier run were left unfinished (its search " \
        "was killed): redoing them" in notes
    assert_each_config_measured_once(spec, resumed, 4)
    assert stale <= {config_key(r.config) for r in resumed.results}
    # Each redone launch's server logged afresh; the killed one's log is kept beside it.
    from treetune.study.worker import log_name

    for key in stale:
        log = spec.output_dir / "logs" / log_name(key)
        assert log.is_file() and log.with_name(log.name.replace(".log", ".earlier.log")
                                                ).is_file(), sorted(log.parent.iterdir())
    # Every log under a launch's own name is a stored launch's, redone or not.
    stored = {log_name(config_key(s.result.config), s.index or 0, attempt)
              for s in StudyStore(spec).finished_launches()
              for attempt in range(max(s.result.attempts, 1))}
    named = {p.name for p in (spec.output_dir / "logs").glob("*.log") if ".earlier" not in p.name}
    assert named == stored


@pytest.mark.ray_no_server  # stopped as Ray starts, before any server: beside the heavy tests
@pytest.mark.parametrize(("sig", "delay"), [(signal.SIGINT, 0.3), (signal.SIGINT, 2.0),
                                            (signal.SIGTERM, 2.0)],
                         ids=["checks", "ray-starting", "sigterm-ray-starting"])
def test_ctrl_c_while_the_search_starts_exits_130_and_leaves_no_ray_behind(
        tmp_path, sig, delay, ray_tmpdir):
    """Stopped at start-up, the search exited 0 without a word (Typer returned 130 and it
    was dropped), and stopped inside ray.init it left Ray's agents running (a helper's
    audit). Ray's start is now held: the stop comes once Ray is up, and takes it down."""
    from studykit import dir_holders

    path = write_study(tmp_path, budget={"launches": 2})
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "treetune", "search", "--study",
                                 str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline().decode()
        assert banner.startswith("study "), banner
        time.sleep(delay)
        proc.send_signal(sig)  # SIGTERM inside ray.init met Ray's own handler: exit 15
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    text = err.decode()
    assert proc.returncode == 130, text[-2000:]
    assert ("aborted" in text or "rerun the same command" in text) and "Traceback" not in text
    assert wait_until(lambda: not dir_holders(ray_tmpdir), 20), dir_holders(ray_tmpdir)
