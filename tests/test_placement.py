"""Where a study's servers go: one placement-group bundle per server on one node, on nodes
of one GPU type; what cannot be placed is refused before any worker starts. The
multi-node studies themselves are in tests/test_cluster.py."""

from __future__ import annotations

import pytest
from studykit import small_study

from treetune.errors import TreetuneError
from treetune.study.placement import (
    ACCELERATOR_PREFIX,
    STRATEGY,
    Node,
    gpu_nodes,
    plan_placement,
)
from treetune.study.spec import load_study
from treetune.study.storage import StudyStore


def ray_node(node_id, alive=True, **resources):
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 2.0, **resources}}


def spec_of(tmp_path, **over):
    return load_study(None, small_study(tmp_path, **over))


H100 = {"emulated_gpu": 4.0, f"{ACCELERATOR_PREFIX}H100": 1.0}
A100 = {"emulated_gpu": 4.0, f"{ACCELERATOR_PREFIX}A100": 1.0}


def test_only_alive_nodes_with_the_backends_resource_are_gpu_nodes_with_their_type():
    nodes = gpu_nodes([ray_node("head"), ray_node("a", **H100), ray_node("b", **A100),
                       ray_node("gone", alive=False, **H100), ray_node("plain", emulated_gpu=2)],
                      "emulated_gpu")
    assert nodes == [Node("a", 4.0, "H100"), Node("b", 4.0, "A100"), Node("plain", 2.0, None)]


def test_each_server_reserves_one_bundle_of_tp_gpus_packed_on_one_node(tmp_path):
    nodes = [Node("a", 4.0, None), Node("b", 3.0, None)]
    placement = plan_placement(spec_of(tmp_path, tp=2), nodes)
    assert STRATEGY == "STRICT_PACK"
    assert placement.bundle() == {"emulated_gpu": 2.0, "CPU": 1.0}
    assert placement.groups == 3  # two on a, one on b: a bundle never spans nodes


def test_a_tp_larger_than_any_node_is_refused_naming_the_largest_node(tmp_path):
    # Eight GPUs in all, but no node holds a server of four.
    nodes = [Node(str(i), 2.0, None) for i in range(4)]
    with pytest.raises(TreetuneError, match=r"tp=4 needs 4 emulated GPUs on one node .* "
                                            r"the largest node of the Ray cluster has 2"):
        plan_placement(spec_of(tmp_path, tp=4), nodes)


def test_several_gpu_types_without_a_pin_are_refused_naming_them(tmp_path):
    nodes = [Node("a", 4.0, "H100"), Node("b", 4.0, "H100"), Node("c", 4.0, "A100")]
    with pytest.raises(TreetuneError) as refused:
        plan_placement(spec_of(tmp_path), nodes)
    message = str(refused.value)
    assert "mixes GPU types: A100 on 1 node, H100 on 2 nodes" in message
    assert "--gpu-type" in message


def test_a_pinned_study_uses_only_its_types_nodes_and_asks_for_the_type(tmp_path):
    nodes = [Node("a", 4.0, "H100"), Node("b", 8.0, "A100"), Node("c", 4.0, "H100")]
    placement = plan_placement(spec_of(tmp_path, gpu_type="H100"), nodes)
    assert [n.node_id for n in placement.nodes] == ["a", "c"] and placement.groups == 2
    assert placement.bundle() == {"emulated_gpu": 4.0, "CPU": 1.0,
                                  f"{ACCELERATOR_PREFIX}H100": 0.001}


def test_a_pin_to_a_type_the_cluster_lacks_is_refused(tmp_path):
    with pytest.raises(TreetuneError, match=r"gpu_type L4: no node .* it has A100 on 1 node"):
        plan_placement(spec_of(tmp_path, gpu_type="L4"), [Node("b", 4.0, "A100")])


def test_the_tp_check_counts_only_the_pinned_types_nodes(tmp_path):
    nodes = [Node("a", 2.0, "H100"), Node("b", 8.0, "A100")]
    with pytest.raises(TreetuneError, match="the largest H100 node of the Ray cluster has 2"):
        plan_placement(spec_of(tmp_path, gpu_type="H100", tp=4), nodes)


def test_one_untyped_cluster_needs_no_pin(tmp_path):
    placement = plan_placement(spec_of(tmp_path), [Node("local", 8.0, None)])
    assert placement.gpu_type is None and placement.groups == 2


def test_a_gpu_type_that_ray_could_not_name_is_refused_in_the_spec(tmp_path):
    with pytest.raises(TreetuneError, match="gpu_type 'H100 SXM' is not a GPU type"):
        spec_of(tmp_path, gpu_type="H100 SXM")


def test_a_study_measured_on_one_gpu_type_refuses_to_resume_on_another(tmp_path):
    spec = spec_of(tmp_path)
    StudyStore(spec).check_gpu_type("H100")
    StudyStore(spec).check_gpu_type("H100")  # the same type resumes
    StudyStore(spec).check_gpu_type(None)  # a cluster that names no type says nothing
    with pytest.raises(TreetuneError, match=r"measured on H100 GPUs, and this run would "
                                            r"launch on A100.*--gpu-type H100"):
        StudyStore(spec).check_gpu_type("A100")
