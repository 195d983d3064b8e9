"""Workers on other hosts than the driver: no filesystem is shared, so each worker measures
the prompts the driver loaded and hands its servers' logs back to the driver's logs/."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest
from studykit import small_study

from treetune.results import LaunchResult
from treetune.study.spec import load_study
from treetune.study.worker import LOGS_PREFIX, SHIPPED_LOGS, LaunchWorker, store_logs


def test_a_worker_on_another_host_hands_its_logs_back_and_keeps_none(tmp_path, monkeypatch):
    """A node's logs went to the node's own `runs/` (relative to wherever `ray start` ran),
    not to the driver's output folder (a helper's audit of the cluster path)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its temp dirs, apart
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text('{"prompt": "Write a haiku about GPUs."}\n'
                         '{"prompt": "Explain speculative decoding."}\n')
    spec = load_study(None, small_study(tmp_path, batch=[1], compare=[],
                                        datasets=[{"name": "mt-bench", "path": str(data_file)}]))
    here = LaunchWorker(spec, 0)  # the driver's host: its prompts, from the study's files
    data_file.unlink()  # the node has no such file
    worker = LaunchWorker(spec, 1, here.prompts, driver_host=f"not-{socket.gethostname()}")
    data = worker.run("3,1,4", [])
    shipped = data.pop(SHIPPED_LOGS)
    assert LaunchResult.from_dict(data).ok, data["reason"]
    assert list(shipped) == ["3-1-4.log"] and "fired up" in shipped["3-1-4.log"]
    assert not list(Path(tempfile.gettempdir()).glob(f"{LOGS_PREFIX}{os.getpid()}@*"))
    assert not (spec.output_dir / "logs" / "3-1-4.log").exists()
    store_logs(spec.output_dir / "logs", shipped)
    store_logs(spec.output_dir / "logs", {"3-1-4.log": "again", "../escape.log": "x"})
    logs = spec.output_dir / "logs"
    assert (logs / "3-1-4.log").read_text() == "again"
    assert "fired up" in (logs / "3-1-4.earlier.log").read_text()
    assert (logs / "escape.log").exists() and not (spec.output_dir / "escape.log").exists()


@pytest.mark.usefixtures("ray_tmpdir")
def test_a_study_s_remote_workers_logs_land_in_the_driver_s_folder(tmp_path, monkeypatch):
    """The whole path, through Ray: the workers' host is this machine's, the driver is
    told another name, so every worker takes itself for remote."""
    from treetune.study.runner import run_study

    monkeypatch.setattr(socket, "gethostname", lambda: "the-driver")  # this process only
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the workers' temp dirs, apart
    spec = load_study(None, small_study(tmp_path, batch=[1], datasets=["humaneval"],
                                        workers=1, budget={"launches": 2}, compare=[],
                                        search={"max_launches_per_config": 1}))
    outcome = run_study(spec)
    assert [r.ok for r in outcome.results] == [True, True]
    names = sorted(p.name for p in (spec.output_dir / "logs").iterdir())
    assert len(names) == 2 and "baseline.log" in names
    assert all("fired up" in (spec.output_dir / "logs" / n).read_text() for n in names)
    assert not list(tmp_path.glob(f"{LOGS_PREFIX}*"))


class _Worker(str):
    """A worker as a fake Ray holds it: its name, and a `ready` call."""

    @property
    def ready(self):
        return type("call", (), {"remote": staticmethod(lambda: self)})


class _BusyCluster:
    """Just the Ray calls _Pool.start makes, on a cluster where only `free` workers can be
    placed (the others' GPUs are in use): no clock, no cluster."""

    class exceptions:  # as Ray names its module
        RayError = RuntimeError
        GetTimeoutError = TimeoutError

    def __init__(self, free: int, broken: int = 0,
                 gpus: dict[str, str | None] | None = None) -> None:
        self.free, self.broken, self.killed = free, broken, []
        self.gpus = gpus or {}  # worker -> the GPU model its node's tool names
        self.util = type("util", (), {"remove_placement_group": staticmethod(lambda g: None)})

    def put(self, value):
        return value

    def remote(self, cls):
        return cls

    def wait(self, refs, num_returns, timeout):
        return refs[:self.free], refs[self.free:]

    def get(self, ref):
        if int(ref.rsplit("-", 1)[1]) < self.broken:  # its node failed the checks
            raise RuntimeError("on node-a: SGLang is not installed for python")
        return f"{ref}@node", self.gpus.get(ref)

    def kill(self, worker):
        self.killed.append(worker)


@pytest.mark.parametrize(("free", "broken"), [(4, 0), (2, 0), (0, 0), (4, 1), (2, 2)])
def test_the_pool_starts_with_the_workers_a_busy_cluster_can_place(tmp_path, free, broken):
    """The pool is sized from the cluster's GPUs, not from those free: with some in use
    the study ended after 120 s, retiring the workers already placed (a helper's audit).
    A node whose checks fail retires its own workers only (a helper's review). Those not
    placed wait for GPUs and join when Ray places them: they were retired, so GPUs freed
    later (or a node that joined) were never used."""
    from treetune.errors import TreetuneError
    from treetune.study.placement import Node, Placement
    from treetune.study.runner import _Pool

    spec = load_study(None, small_study(tmp_path, batch=[1], datasets=["humaneval"], tp=1))
    placement = Placement(resource="emulated_gpu", tp=1, gpu_type=None,
                          nodes=(Node(node_id="n", gpus=4.0, gpu_type=None),))
    ray = _BusyCluster(free, broken)
    pool = _Pool(ray, spec, placement)
    made = iter(range(100))
    pool._spawn = lambda: _Worker(f"worker-{next(made)}")  # type: ignore[method-assign]
    started = free - broken
    if started == 0:
        message = "could not start: on node-a" if broken else "could not place 4 workers"
        with pytest.raises(TreetuneError, match=message):
            pool.start(4)
        assert len(ray.killed) == 4 and not pool.starting
        return
    note = pool.start(4)
    assert pool.alive == started and len(pool.idle) == started
    assert len(ray.killed) == broken and len(pool.starting) == 4 - free
    if started == 4:
        assert note == ""
    if broken:  # a node's failed check retires its workers, not the study
        assert note.startswith(f"{broken} launch worker(s) could not start: on node-a")
    if free < 4:
        assert f"Ray placed {free} of 4 workers" in note and f"{4 - free} wait" in note
    if started < 4:
        assert note.endswith(f"the study runs with {started}")
    # The GPUs free up: Ray places the waiting workers, and they join.
    notes = pool.settle(list(pool.starting))
    assert pool.alive == free - broken + (4 - free) and not pool.starting
    assert len(notes) == 4 - free and all("a worker joined" in n for n in notes)


SXM, PCIE = "H100-SXM", "H100-PCIe"  # as the workers name them: their GPU table entries


def test_workers_on_another_gpu_model_than_the_studys_are_left_out(tmp_path):
    """Ray names an H100 SXM node and an H100 PCIe node alike (accelerator_type:H100), so
    a study pinned to H100 placed workers on both and mixed their measurements (a GPU
    with two thirds of the bandwidth). Each worker says what its GPUs are; those of
    another model than most (the first's, on a tie) are left out, at the start and when
    they join; a worker whose tool names nothing is kept."""
    from treetune.study.placement import Node, Placement
    from treetune.study.runner import _Pool

    spec = load_study(None, small_study(tmp_path, batch=[1], datasets=["humaneval"], tp=1))
    placement = Placement(resource="GPU", tp=1, gpu_type="H100",
                          nodes=(Node(node_id="n", gpus=4.0, gpu_type="H100"),))
    gpus = {"worker-0": PCIE, "worker-1": SXM, "worker-2": SXM, "worker-3": None,
            "worker-4": PCIE, "worker-5": SXM}
    ray = _BusyCluster(4, gpus=gpus)
    pool = _Pool(ray, spec, placement)
    made = iter(range(100))
    pool._spawn = lambda: _Worker(f"worker-{next(made)}")  # type: ignore[method-assign]
    note = pool.start(4)
    assert pool.gpu == SXM and pool.alive == 3 and ray.killed == ["worker-0"]
    assert note == (f"1 launch worker(s) left out for their GPUs: worker-0@node ({PCIE}), "
                    f"where the study's servers run on {SXM} (Ray's accelerator type names "
                    "them alike: H100); one study never mixes two GPU models' measurements "
                    "(run it on nodes of one model; their GPUs stay reserved, so that no "
                    "other worker is placed there); the study runs with 3")
    pool.replace()
    pool.replace()
    notes = pool.settle(list(pool.starting))
    assert notes[0].startswith(f"1 launch worker(s) left out for their GPUs: worker-4@node "
                               f"({PCIE}), where the study's servers run on {SXM}")
    assert notes[1] == "a worker joined on node: the study runs with 4"
    assert ray.killed == ["worker-0", "worker-4"] and "worker-5" in pool.idle
    # Two of each: the first worker's model is the study's.
    tie = _Pool(_BusyCluster(4, gpus={"worker-0": PCIE, "worker-1": SXM, "worker-2": SXM,
                                      "worker-3": PCIE}), spec, placement)
    made = iter(range(100))
    tie._spawn = lambda: _Worker(f"worker-{next(made)}")  # type: ignore[method-assign]
    tie.start(4)
    assert tie.gpu == PCIE and sorted(tie.idle) == ["worker-0", "worker-3"]
    # The GPU the study tells the model search to assume wins over the count.
    pinned = load_study(None, small_study(tmp_path, batch=[1], datasets=["humaneval"], tp=1,
                                          backend={"kind": "sglang", "python": "python",
                                                   "gpu": "H100-SXM"}))
    few = _Pool(_BusyCluster(4, gpus={"worker-0": PCIE, "worker-1": PCIE, "worker-2": SXM,
                                      "worker-3": PCIE}), pinned, placement)
    made = iter(range(100))
    few._spawn = lambda: _Worker(f"worker-{next(made)}")  # type: ignore[method-assign]
    few.start(4)
    assert few.gpu == SXM and few.idle == ["worker-2"]


def test_a_worker_left_out_keeps_its_gpus_reserved_and_the_facts_come_from_the_studys_model(
        tmp_path):
    """A freed placement group brought the next worker to the same wrong GPUs (a review's
    finding): a left-out worker's group stays reserved until the study ends. The facts
    are gathered on a worker whose tool named the study's GPU."""
    from treetune.study.placement import Node, Placement
    from treetune.study.runner import _Pool

    spec = load_study(None, small_study(tmp_path, batch=[1], datasets=["humaneval"], tp=1))
    placement = Placement(resource="GPU", tp=1, gpu_type="H100",
                          nodes=(Node(node_id="n", gpus=3.0, gpu_type="H100"),))
    removed: list[str] = []
    ray = _BusyCluster(3, gpus={"worker-0": None, "worker-1": PCIE, "worker-2": SXM,
                                "worker-3": SXM})
    ray.util = type("util", (), {"remove_placement_group": staticmethod(removed.append)})
    pool = _Pool(ray, spec, placement)
    made = iter(range(100))
    asked: list[str] = []

    class Asked(_Worker):
        @property
        def facts(self):
            return type("call", (), {"remote": staticmethod(
                lambda: asked.append(str(self)) or "facts")})

    def spawn():
        worker = Asked(f"worker-{next(made)}")
        pool.groups[worker] = f"group-of-{worker}"
        return worker

    pool._spawn = spawn  # type: ignore[method-assign]
    pool.start(3)  # one of each: the first named model on a tie
    assert pool.gpu == PCIE and sorted(pool.idle) == ["worker-0", "worker-1"]
    assert pool.blocked == ["group-of-worker-2"] and removed == []
    # worker-0's tool named no GPU: the facts come from worker-1.
    ray.get = lambda ref, timeout=None: ref  # type: ignore[method-assign]
    assert pool.facts() == "facts" and asked == ["worker-1"]
    pool.shutdown()
    assert "group-of-worker-2" in removed and pool.blocked == []


def test_a_worker_names_the_gpu_model_its_tool_shows_it_and_none_when_emulated(
        tmp_path, monkeypatch):
    from test_facts import stand_in_nvidia_smi

    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", f"{PCIE}, 81559 MiB\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # as Ray sets it for the worker
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin"}
    real = load_study(None, small_study(tmp_path, batch=[1], env=env, backend={
        "kind": "sglang", "python": "python", "gpu": "H100-SXM"}))
    name, gpu = LaunchWorker(real, 0).ready()
    assert name == f"worker-0@{socket.gethostname()}" and gpu == PCIE
    assert (bin_dir / "args").read_text().split()[-1] == "--id=1"  # its own GPUs only
    emulated = load_study(None, small_study(tmp_path, batch=[1], env=env))
    assert LaunchWorker(emulated, 0).ready()[1] is None  # no GPU to ask about
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-4f3c")  # a share of a GPU: no match
    assert LaunchWorker(real, 0).ready()[1] == "MIG instances"


def test_a_worker_ray_cannot_place_waits_while_others_work_and_is_given_up_with_none(
        tmp_path, monkeypatch):
    """A replacement for a lost node's worker was given up on after 120 s, so the node
    back (or a new one) was never used. It now waits while the study has workers, said
    once; with none left it is given up on, and the study ends with its error."""
    from treetune.study import runner
    from treetune.study.placement import Node, Placement
    from treetune.study.runner import _Pool

    spec = load_study(None, small_study(tmp_path, batch=[1], datasets=["humaneval"], tp=1))
    placement = Placement(resource="emulated_gpu", tp=1, gpu_type=None,
                          nodes=(Node(node_id="n", gpus=2.0, gpu_type=None),))
    ray = _BusyCluster(2)
    pool = _Pool(ray, spec, placement)
    made = iter(range(100))
    pool._spawn = lambda: _Worker(f"worker-{next(made)}")  # type: ignore[method-assign]
    assert pool.start(2) == ""
    clock = [1000.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: clock[0])
    pool.alive -= 1  # a worker's node was lost
    pool.replace()
    assert pool.settle([]) == []  # within its deadline: nothing to say
    clock[0] += runner.RESOURCE_TIMEOUT_S + 1
    first = pool.settle([])
    assert len(first) == 1 and "not placed within" in first[0] and "goes on with 1" in first[0]
    assert pool.settle([]) == [] and len(pool.starting) == 1 and not ray.killed
    pool.alive = 0  # the last worker lost too: nothing to go on with
    assert pool.settle([]) == ["no node could take 1 waiting worker(s)"]
    assert not pool.starting and len(ray.killed) == 1


def test_a_cluster_worker_runs_the_checks_the_driver_left_to_the_nodes(tmp_path):
    """On a cluster the driver does not check the engine installed on the nodes (theirs,
    not its own): no one did, and a node without SGLang failed the baseline's launch and
    ended the study (a helper's audit). Each worker checks its own node, naming it."""
    import sys

    from treetune.errors import TreetuneError

    over = {"backend": {"kind": "sglang", "python": sys.executable}}  # has no SGLang
    here = LaunchWorker(load_study(None, small_study(tmp_path, batch=[1], **over)), 0)
    assert here.ready()  # on this machine the driver checked it already
    cluster = load_study(None, small_study(tmp_path, batch=[1], ray_address="head:6379",
                                           **over))
    with pytest.raises(TreetuneError, match=f"on {socket.gethostname()}: SGLang is not "
                                            "installed"):
        LaunchWorker(cluster, 0).ready()


def test_workers_beyond_what_the_machine_holds_are_said_and_on_a_cluster_asked_for(tmp_path):
    """`--workers 3` on a node holding one server ran one without a word (a helper's audit
    of a fresh GPU node); on a cluster the others wait for nodes to join."""
    from treetune.study.placement import Node, Placement
    from treetune.study.runner import worker_count

    placement = Placement(resource="GPU", tp=4, gpu_type="H100",
                          nodes=(Node(node_id="n", gpus=4.0, gpu_type="H100"),))
    local = load_study(None, small_study(tmp_path, workers=3))
    count, note = worker_count(local, placement)
    assert count == 1 and note == ("workers: 3 asked, but this machine holds 1 server(s) of 4 "
                                   "emulated GPUs at once: the study runs with 1")
    assert worker_count(load_study(None, small_study(tmp_path, workers=1)), placement) == (1, "")
    assert worker_count(load_study(None, small_study(tmp_path, workers=None)),
                        placement) == (1, "")
    cluster = load_study(None, small_study(tmp_path, workers=3, ray_address="head:6379"))
    assert worker_count(cluster, placement) == (3, "")


def test_a_cluster_worker_refuses_trees_sglang_would_fail_on_its_own_gpus(tmp_path,
                                                                          monkeypatch):
    """On a cluster the driver may hold neither the model's config.json nor the nodes'
    GPU: each worker checks on its node, where both are (a B200 here, whose default
    backend for gpt-oss drafts chains only), and names the node. A space of chains
    passes."""
    import sys

    from test_facts import stand_in_nvidia_smi

    from treetune.errors import TreetuneError

    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", "NVIDIA B200, 183359 MiB\n")
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin"}
    model = str(Path(__file__).parent / "fixtures" / "hf" / "openai" / "gpt-oss-120b")
    over = {"backend": {"kind": "sglang", "python": sys.executable}, "env": env,
            "model": model, "ray_address": "head:6379", "batch": [1]}
    with pytest.raises(TreetuneError, match=f"^on {socket.gethostname()}: .*gpt-oss-120b: "
                       "SGLang fails EAGLE3 trees that branch .* the trtllm_mha attention "
                       "backend, which SGLang picks for GptOssForCausalLM on B200"):
        LaunchWorker(load_study(None, small_study(tmp_path, **over)), 0).ready()
    chains = load_study(None, small_study(tmp_path, space="narrow", compare=["3,1,4"], **over))
    with pytest.raises(TreetuneError, match="SGLang is not installed"):  # the next check
        LaunchWorker(chains, 0).ready()
