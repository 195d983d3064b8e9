"""Where a study's servers run on a Ray cluster: each server's GPUs are one placement-group
bundle (its backend's Ray resource, TP of them, STRICT_PACK: on one node), on nodes of one
GPU type only.

Ray gives a GPU node the resource `accelerator_type:<TYPE>` (accelerator_type:H100), and a
cluster may mix types. A study measures one: the type it is pinned to (`gpu_type`), or the
cluster's only one; a cluster of several types without a pin is refused, so one study never
mixes measurements of different GPUs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from treetune.errors import TreetuneError
from treetune.study.spec import StudySpec

ACCELERATOR_PREFIX = "accelerator_type:"  # Ray's resource naming a node's GPU type
# What a bundle asks of a node's accelerator_type resource (1 per node): Ray's own share
# for `accelerator_type=`, so that any number of servers fit on a node of that type.
ACCELERATOR_SHARE = 0.001
STRATEGY = "STRICT_PACK"  # a server's GPUs never span nodes: tensor parallelism needs NVLink
RAY_GPU = "GPU"  # the resource Ray detects on GPU nodes by itself
CPUS_PER_SERVER = 1  # the launch worker's own CPU (the server's are its process's business)


@dataclass(frozen=True)
class Node:
    """One alive Ray node that offers the backend's GPU resource."""

    node_id: str
    gpus: float  # of the backend's resource
    gpu_type: str | None  # its accelerator type (None: Ray names none)


@dataclass(frozen=True)
class Placement:
    """How a study's servers are placed: the bundle each reserves, and how many fit."""

    resource: str  # the backend's Ray resource for one GPU
    tp: int
    gpu_type: str | None  # the type of every node used (None: the nodes name none)
    nodes: tuple[Node, ...]  # the nodes servers may use

    @property
    def groups(self) -> int:
        """Servers that fit on the nodes at once (a bundle never spans nodes)."""
        return sum(int(node.gpus // self.tp) for node in self.nodes)

    def bundle(self) -> dict[str, float]:
        """One server's reservation: its GPUs, its worker's CPU, and its GPU type."""
        bundle = {self.resource: float(self.tp), "CPU": float(CPUS_PER_SERVER)}
        if self.gpu_type is not None:
            bundle[ACCELERATOR_PREFIX + self.gpu_type] = ACCELERATOR_SHARE
        return bundle


def gpu_nodes(ray_nodes: Iterable[Mapping[str, Any]], resource: str) -> list[Node]:
    """The alive nodes of `ray.nodes()` that offer `resource`, with their GPU types."""
    nodes = []
    for info in ray_nodes:
        resources = info.get("Resources", {})
        if not info.get("Alive") or resources.get(resource, 0) <= 0:
            continue
        types = sorted(name.removeprefix(ACCELERATOR_PREFIX) for name in resources
                       if name.startswith(ACCELERATOR_PREFIX))
        nodes.append(Node(info["NodeID"], float(resources[resource]),
                          types[0] if len(types) == 1 else "+".join(types) or None))
    return nodes


def plan_placement(spec: StudySpec, nodes: list[Node]) -> Placement:
    """Where the study's servers go, or a TreetuneError saying why they cannot go anywhere:
    no node of the pinned type, several types and no pin, or a TP no node holds."""
    backend = spec.backend
    label = backend.gpu_label
    if not nodes:
        raise TreetuneError(
            f"the Ray cluster offers 0 {label}, fewer than one group of tp={spec.tp}"
            + ("; without GPUs use the emulator: --backend emulator --profile NAME"
               if backend.gpu_resource == RAY_GPU else ""))
    if spec.gpu_type is not None:
        chosen = [n for n in nodes if n.gpu_type == spec.gpu_type]
        if not chosen:
            raise TreetuneError(
                f"gpu_type {spec.gpu_type}: no node of the Ray cluster has {label} of that "
                f"type (resource {ACCELERATOR_PREFIX}{spec.gpu_type}); it has "
                f"{_census(nodes, label)}")
    else:
        types = {n.gpu_type for n in nodes}
        if len(types) > 1:
            raise TreetuneError(
                f"the Ray cluster mixes GPU types: {_census(nodes, label)}; one study measures "
                "one type, or its speedups would mix GPUs: pin it with --gpu-type TYPE (study "
                "field gpu_type), one study per type")
        chosen = nodes
    pinned = spec.gpu_type if spec.gpu_type is not None else (
        chosen[0].gpu_type if chosen else None)
    placement = Placement(backend.gpu_resource, spec.tp, pinned, tuple(chosen))
    largest = max((n.gpus for n in chosen), default=0.0)
    if largest < spec.tp:
        where = f"{pinned} node" if pinned else "node"
        raise TreetuneError(
            f"tp={spec.tp} needs {spec.tp} {label} on one node (a server's GPUs are one "
            f"placement-group bundle, never split over nodes), but the largest {where} of the "
            f"Ray cluster has {largest:g}: lower --tp or add a node with {spec.tp}")
    return placement


def _census(nodes: list[Node], label: str) -> str:
    """'H100 on 2 nodes, A100 on 1 node': the cluster's GPU nodes by type."""
    if not nodes:
        return f"no node with {label}"
    counts = Counter(n.gpu_type or "no GPU type" for n in nodes)
    return ", ".join(f"{t} on {c} node{'s' if c > 1 else ''}" for t, c in sorted(counts.items()))
