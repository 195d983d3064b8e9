"""Studies on a multi-node Ray cluster (ray.cluster_utils.Cluster: logical nodes, each with
logical emulated GPUs and Ray's GPU-type resource `accelerator_type:TYPE`): each server in
a placement group of its own on one node, a cluster of two GPU types refused without a pin,
a pinned study on its type's nodes only, two studies pinned to two types side by side, and
a node lost mid-study."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import optuna
import pytest
import yaml
from optuna.trial import TrialState
from studykit import ray_env, server_processes, short_ray_dir, small_study, wait_until

from treetune.errors import TreetuneError
from treetune.results import config_key
from treetune.study.placement import ACCELERATOR_PREFIX
from treetune.study.runner import run_study
from treetune.study.spec import load_study

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_tmpdir")]

GPUS_PER_NODE = 4  # emulated, as small_study's tp


def typed_node(cluster, gpu_type):
    return cluster.add_node(num_cpus=2, resources={
        "emulated_gpu": GPUS_PER_NODE, f"{ACCELERATOR_PREFIX}{gpu_type}": 1})


def start_cluster(path, types):
    """A head without GPUs and one node per entry of `types`: (cluster, {type: [nodes]})."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "temp_dir": path, "include_dashboard": False})
    nodes: dict[str, list] = {}
    for gpu_type in types:
        nodes.setdefault(gpu_type, []).append(typed_node(cluster, gpu_type))
    cluster.wait_for_nodes()
    return cluster, nodes


@pytest.fixture(scope="module")
def two_types():
    """Two H100 nodes and one A100 node: (address, {type: node ids})."""
    with short_ray_dir() as path, pytest.MonkeyPatch.context() as env:
        for name, value in ray_env(path).items():
            env.setenv(name, value)
        cluster, nodes = start_cluster(path, ["H100", "H100", "A100"])
        try:
            env.undo()  # each test sets its own Ray environment
            yield cluster.address, {t: {n.node_id for n in ns} for t, ns in nodes.items()}
        finally:
            for name, value in ray_env(path).items():
                env.setenv(name, value)
            cluster.shutdown()


def launch_trials(spec, *states):
    study = optuna.load_study(study_name=f"{spec.name}:launches", storage=spec.storage_url)
    return study.get_trials(states=states or (TrialState.COMPLETE,))


def nodes_used(spec):
    return {t.user_attrs["node"] for t in launch_trials(spec) if "node" in t.user_attrs}


def test_a_cluster_of_two_gpu_types_is_refused_without_a_pin(tmp_path, two_types):
    address, _ = two_types
    spec = load_study(None, small_study(tmp_path, ray_address=address))
    with pytest.raises(TreetuneError) as refused:
        run_study(spec)
    assert "mixes GPU types: A100 on 1 node, H100 on 2 nodes" in str(refused.value)
    assert "--gpu-type" in str(refused.value)
    assert not (spec.output_dir / "logs").exists(), "a worker started"


def test_a_tp_larger_than_any_node_is_refused_before_any_worker_starts(tmp_path, two_types):
    address, _ = two_types
    # Eight H100 GPUs in the cluster, four per node: a server of eight fits nowhere. The
    # emulated profile is one of 8 GPUs, so that the cluster, not the profile, refuses it.
    backend = {**small_study(tmp_path)["backend"], "profile": "qwen3.5-397b-a17b-h200"}
    spec = load_study(None, small_study(tmp_path, ray_address=address, gpu_type="H100", tp=8,
                                        backend=backend))
    started = time.monotonic()
    with pytest.raises(TreetuneError, match=r"tp=8 needs 8 emulated GPUs on one node .* "
                                            r"the largest H100 node of the Ray cluster has 4"):
        run_study(spec)
    assert time.monotonic() - started < 60, "it waited for Ray instead of refusing"
    assert not (spec.output_dir / "logs").exists(), "a worker started"


def test_each_server_is_a_strict_pack_placement_group_of_tp_gpus_on_its_pinned_type(
        tmp_path, two_types):
    import ray

    address, nodes = two_types
    spec = load_study(None, small_study(tmp_path, ray_address=address, gpu_type="H100",
                                        budget={"launches": 2}))
    groups: list[dict] = []

    def look(progress):  # in the search's process, while its two servers run
        if len(progress.running) == 2 and not groups:
            groups.extend(g for g in ray.util.placement_group_table().values()
                          if g["state"] == "CREATED")

    outcome = run_study(spec, look)
    assert len(outcome.results) == 2 and all(r.ok for r in outcome.results)
    assert len(groups) == 2, groups
    for group in groups:
        assert group["strategy"] == "STRICT_PACK"
        assert group["bundles"] == {0: {"emulated_gpu": 4.0, "CPU": 1.0,
                                        f"{ACCELERATOR_PREFIX}H100": 0.001}}
        assert group["bundles_to_node_id"][0] in nodes["H100"]
    assert nodes_used(spec) <= nodes["H100"] and nodes_used(spec)
    assert {t.user_attrs["gpu_type"] for t in launch_trials(spec)} == {"H100"}


def search(path):
    return subprocess.Popen([sys.executable, "-m", "treetune", "search", "--study", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def test_two_studies_pinned_to_two_gpu_types_run_side_by_side_each_on_its_own_nodes(
        tmp_path, two_types):
    address, nodes = two_types
    specs, procs = {}, {}
    for gpu_type in ("H100", "A100"):
        folder = tmp_path / gpu_type
        folder.mkdir()
        data = small_study(folder, name=f"on-{gpu_type}", ray_address=address,
                           gpu_type=gpu_type, workers=1, budget={"launches": 2})
        (folder / "study.yaml").write_text(yaml.safe_dump(data))
        specs[gpu_type] = load_study(folder / "study.yaml")
    try:
        for gpu_type in specs:
            procs[gpu_type] = search(tmp_path / gpu_type / "study.yaml")
        for gpu_type, proc in procs.items():
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"{gpu_type}: {err.decode()[-2000:]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.communicate()
    for gpu_type, spec in specs.items():
        assert len(launch_trials(spec)) == 2
        assert nodes_used(spec) and nodes_used(spec) <= nodes[gpu_type], gpu_type


def test_losing_a_node_mid_study_reschedules_its_launch_on_the_pinned_types_other_node(
        tmp_path):
    cluster, nodes = start_cluster(os.environ["TREETUNE_RAY_TMPDIR"], ["H100", "H100", "A100"])
    try:
        spec = load_study(None, small_study(tmp_path, budget={"launches": 4}, gpu_type="H100",
                                            ray_address=cluster.address))
        marker = str(tmp_path)
        removed: list[str] = []

        def two_running_after_a_result():
            logs = list((spec.output_dir / "logs").glob("*.log"))
            return len(logs) >= 3 and len(server_processes(marker)) >= 2

        def remove_a_node():
            if wait_until(two_running_after_a_result, 180):
                node = nodes["H100"][1]
                cluster.remove_node(node)
                removed.append(node.node_id)

        thread = threading.Thread(target=remove_a_node, daemon=True)
        thread.start()
        outcome = run_study(spec)
        thread.join(5)
        assert removed, "the node was never removed"
        keys = [config_key(r.config) for r in outcome.results]
        assert len(keys) == len(set(keys)) == 4 and all(r.ok for r in outcome.results), [
            (key, r.reason, r.retried_because) for key, r in zip(keys, outcome.results,
                                                                 strict=True)]
        rescheduled = [t for t in launch_trials(spec, TrialState.FAIL)
                       if "worker died" in t.user_attrs.get("reason", "")]
        assert rescheduled, "the removed node's launch was not rescheduled"
        h100 = {n.node_id for n in nodes["H100"]}
        assert nodes_used(spec) <= h100, "a launch ran on the A100 node"
        assert not server_processes(marker)
    finally:
        cluster.shutdown()


def test_a_node_that_joins_mid_study_takes_the_workers_that_waited_for_gpus(tmp_path):
    """`workers: 2` on a cluster of one node holding one server: the second worker waits
    for GPUs (it was retired after 120 s, and a node that joined later was never used),
    and joins when a node is added mid-study; that node then runs launches of its own.

    The budget is far more than the first node runs while the added node starts (a busy
    machine once ran all of a 5-launch budget first), and the study is stopped, as Ctrl-C
    stops it, once the added node has finished a launch: the test waits on that event, not
    on how fast either node is."""
    cluster, nodes = start_cluster(os.environ["TREETUNE_RAY_TMPDIR"], ["H100"])
    try:
        spec = load_study(None, small_study(tmp_path, budget={"launches": 40}, workers=2,
                                            ray_address=cluster.address))
        notes: list[str] = []
        done: dict[str, object] = {}
        added: list[str] = []
        counted = [0]

        def progress(p):
            notes.extend(n for n in [*p.notes, p.message] if n not in notes)
            if added and p.launches_done > counted[0]:
                counted[0] = p.launches_done
                if added[0] in nodes_used(spec):
                    raise KeyboardInterrupt  # the stop a user's Ctrl-C makes

        def search():
            try:
                done["outcome"] = run_study(spec, progress)
            except BaseException as exc:  # re-raised below, in the test
                done["error"] = exc

        # The study in a thread: Ray's Cluster.add_node installs signal handlers, which
        # only the main thread may.
        thread = threading.Thread(target=search, daemon=True)
        thread.start()
        if wait_until(lambda: len(list((spec.output_dir / "logs").glob("*.log"))) >= 2
                      or not thread.is_alive(), 180) and thread.is_alive():
            added.append(typed_node(cluster, "H100").node_id)
        thread.join(400)
        assert not thread.is_alive(), "the study did not end"
        if "error" in done:
            raise done["error"]  # type: ignore[misc]
        outcome = done["outcome"]
        assert added, "the node was never added"
        assert any(n.startswith("1 of 2 workers wait for nodes (the cluster holds 1 server(s) "
                                "of 4 emulated GPUs on H100 nodes), and join when Ray places "
                                "them") for n in notes), notes
        assert any(n.startswith("a worker joined") for n in notes), notes
        assert outcome.interrupted, "the added node ran no launch within the budget"
        assert all(r.ok for r in outcome.results)
        assert nodes_used(spec) == {nodes["H100"][0].node_id, added[0]}
    finally:
        cluster.shutdown()
