"""Checks that refuse a study before Ray or any server starts: a bad dataset file, an
unreachable cluster, and whatever the backend refuses (an unknown profile, SGLang missing).
Each failure is one TreetuneError saying what is wrong and what to do, in seconds rather
than after a Ray start and a launch."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from treetune import strategies
from treetune.backends.sglang import DEEPEP_CAP_VARIABLE, branching_problem, deepep_problem
from treetune.backends.sglang_adaptive import multi_layer_problem
from treetune.datasets import load_datasets
from treetune.errors import TreetuneError
from treetune.facts import model_facts, seen_model
from treetune.perfmodel import load_profile
from treetune.space import SearchSpace, load_space
from treetune.study.methods import method_spaces
from treetune.study.placement import RAY_GPU
from treetune.study.spec import SPEC_COPY, StudySpec, shown_url
from treetune.yamlio import load_yaml

RAY_CONNECT_TIMEOUT_S = 5.0
RAY_CLIENT_PORT = 10001  # ray:// addresses without a port
UNCHECKED_ADDRESSES = ("auto", "local")  # Ray resolves these itself


def check_study(spec: StudySpec) -> None:
    """Everything about `spec` that can be refused before Ray starts: its datasets load,
    its search space (each draft method's) loads and fits the method, its strategy is
    installed, its prior profile loads, the cluster address answers, and the backend's
    own checks pass."""
    if (unused := spec.unused_draft()) is not None:
        raise TreetuneError(f"draft: {unused}")
    check_output_folder(spec)
    load_datasets(spec.datasets, Path(spec.base_dir))
    spaces = study_spaces(spec)
    env = {**os.environ, **spec.env}
    # The study's env alone: it is what the exported scripts carry (and remote workers).
    if problem := deepep_problem(spec.server_flags, spec.env, spec.tp, spec.max_batch,
                                 widest_passes(spec, spaces)):
        if DEEPEP_CAP_VARIABLE in os.environ and DEEPEP_CAP_VARIABLE not in spec.env:
            problem += (f" ({DEEPEP_CAP_VARIABLE} is set in this shell, but the launch "
                        "scripts and the servers on other nodes get only the study's env: "
                        "set it there)")
        raise TreetuneError(f"server_flags: {problem}")
    check_branching(spec, spaces, env)
    check_adaptive_target(spec, env)
    why = strategies.missing_requirement(spec.search.strategy)
    if why is not None:
        raise TreetuneError(why)
    if spec.search.prior is not None:
        load_profile(spec.search.prior)
    if spec.ray_address:
        check_ray_address(spec.ray_address, RAY_CONNECT_TIMEOUT_S)
    spec.backend.check(spec.launch_spec(), spec.dataset_names, env, local=spec.local_ray)


def study_spaces(spec: StudySpec) -> dict[str, SearchSpace]:
    """Each draft method's search space, by its tag ("" for a study of one method). A
    space of NGRAM servers for a study of one tree method is refused (its values would be
    read as the tree's knobs), as method_spaces refuses it per method."""
    if spaces := method_spaces(spec):
        return spaces
    space = load_space(spec.space)
    if space.is_ngram:  # a study's own algorithm is never NGRAM (spec.py)
        raise TreetuneError(
            f"space '{spec.space}' holds NGRAM servers (draft_tokens and breadth), but the "
            f"study drafts by {spec.algorithm}: give a tree space (steps, topk and "
            "draft_tokens: --space default), or search NGRAM beside it (methods: "
            f"[{spec.algorithm}, NGRAM])")
    return {"": space}


def check_branching(spec: StudySpec, spaces: Mapping[str, SearchSpace],
                    env: Mapping[str, str], node_gpu: str | None = None) -> None:
    """Refuse a study whose branching trees (searched or compared) SGLang would fail at
    every start (`branching_problem`): for the target's config.json when it is here to
    read, on `node_gpu` (what a cluster node's own GPUs are), else the GPU the backend
    names or, with a local Ray of real GPUs, the one this machine shows."""
    branching = {tree.method or spec.algorithm for space in spaces.values()
                 for tree in space.configs() if tree.topk > 1}
    branching |= {tree.method or spec.algorithm for tree in spec.compare if tree.topk > 1}
    if not branching:
        return
    try:
        target = model_facts(spec.model, env)
    except TreetuneError:
        target = None  # not on this machine: the nodes' servers will tell
    gpu = node_gpu or getattr(spec.backend, "gpu", None)
    if gpu is None and spec.local_ray and target is not None \
            and spec.backend.gpu_resource == RAY_GPU:  # an emulator's GPU is its profile's
        gpu = seen_model(env)
    attention = spec.launch_spec().attention_backend
    for method in sorted(branching):
        if problem := branching_problem(spec.server_flags, attention, target, gpu, method):
            raise TreetuneError(f"{spec.model}: {problem}")


def check_adaptive_target(spec: StudySpec, env: Mapping[str, str]) -> None:
    """Refuse adaptive steps where the target's own override in the engine keeps them off
    (`multi_layer_problem`), when its config.json is here to read: every adaptive launch
    would serve static trees."""
    if not spec.adaptive:
        return
    try:
        target = model_facts(spec.model, env)
    except TreetuneError:
        return  # not on this machine: each adaptive launch's server will tell
    if problem := multi_layer_problem(spec.algorithm, target.architecture):
        raise TreetuneError(f"{spec.model}: {problem}")


def widest_passes(spec: StudySpec, spaces: Mapping[str, SearchSpace]) -> dict[str, int]:
    """Per draft method, the most tokens one request sends through the target's MoE layers
    in a pass: its trees' (searched or compared) draft tokens, and for NEXTN, whose draft is
    the target's MoE layer, its topk too."""
    out: dict[str, int] = {}
    trees = [c for space in spaces.values() for c in space.configs()] + list(spec.compare)
    for tree in trees:
        name = tree.method or spec.algorithm
        tokens = max(tree.draft_tokens, tree.topk if name == "NEXTN" else 0)
        out[name] = max(out.get(name, 0), tokens)
    return out


def check_output_folder(spec: StudySpec) -> None:
    """The output folder is new, or this study's: another study's spec copy, scripts and
    recommendations there would be overwritten by this one's, and mixed with them."""
    copy = spec.output_dir / SPEC_COPY
    if not copy.is_file():
        return
    try:
        held = load_yaml(copy)
    except TreetuneError:
        return  # not a spec copy this check can read; the study's own checks follow
    name = held.get("name") if isinstance(held, dict) else None
    if isinstance(name, str) and name != spec.name:
        raise TreetuneError(
            f"the output folder {spec.output_dir} holds study '{name}' ({copy}); this is "
            f"study '{spec.name}': give it another --output, or --name {name} to resume "
            "that study")
    if not isinstance(held, dict) or "storage" not in held:
        return
    stored, given = held["storage"], spec.written_storage  # both without a password
    own_db = spec.output_dir / "study.db"
    if _same_storage(stored, given, own_db) or (stored is None and not own_db.is_file()):
        return
    # Another database holds none of the folder's launches: the study would start over,
    # its scripts and recommendations overwritten by those of a few launches.
    was = shown_url(stored) if stored else f"the folder's own {own_db.name}"
    now = shown_url(given) if given else f"the folder's own {own_db.name}"
    resume = f"--storage {shown_url(stored)}" if stored else "no --storage"
    raise TreetuneError(
        f"the output folder {spec.output_dir} holds a study stored in {was} ({copy}), and "
        f"this search would store it in {now}, starting it over: give {resume} to resume "
        f"it, or another --output for a new study (if the database moved, delete {copy} "
        "first)")


def check_ray_address(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """A "host:port" or "ray://host:port" address answers as a Ray head within `timeout_s`
    (ray.init would retry an unreachable one for minutes); "auto" and "local" are Ray's to
    resolve."""
    if address in UNCHECKED_ADDRESSES:
        return
    host, port = _host_port(address)
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except TimeoutError:
        reason: str | None = f"no answer within {timeout_s:g} s"
    except socket.gaierror as exc:
        reason = f"unknown host '{host}' ({exc.strerror})"
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
    else:
        reason = _not_grpc(host, port, deadline, timeout_s)
    if reason is not None:
        raise TreetuneError(
            f"cannot reach the Ray cluster at {address}: {reason}; check the address (ray "
            "status on the head node) or leave ray_address unset to run locally")


def _not_grpc(host: str, port: int, deadline: float, timeout_s: float) -> str | None:
    """Why the server at host:port is not a Ray head, or None.

    A bare TCP connection proves little (proxies and sandboxes accept anything), but Ray's
    head (GCS, and the client server behind ray://) is a gRPC server: a call to a method it
    does not have comes back UNIMPLEMENTED from gRPC itself, while anything else in
    between answers with a plain HTTP status or not at all. Under TLS (RAY_USE_TLS) the
    handshake is Ray's own business."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None
    import grpc  # a dependency of treetune (and of Ray's cluster mode)

    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)]) as channel:
        ping = channel.unary_unary("/treetune.Preflight/Ping")
        try:
            ping(b"", timeout=max(deadline - time.monotonic(), 0.1))
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""  # type: ignore[attr-defined]
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"no answer within {timeout_s:g} s"
            if code == grpc.StatusCode.UNAVAILABLE:
                return details or "unavailable"
            if details.startswith("Received http2 header with status"):
                return "something answers there, but not a Ray head (no gRPC)"
    return None


def _host_port(address: str) -> tuple[str, int]:
    client = address.startswith("ray://")
    rest = address.removeprefix("ray://").rstrip("/")
    host, colon, port = rest.rpartition(":")
    if client and (not colon or "]" in port):  # ray://host: the client server's port
        host, port = rest, str(RAY_CLIENT_PORT)
    host = host.removeprefix("[").removesuffix("]")  # [::1]:6379
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TreetuneError(
            f"ray_address '{address}' is not an address: give host:port (the head node's "
            "GCS port, 6379 by default), ray://host:port, auto, or leave it unset to run "
            "locally")
    return host, int(port)


def _same_storage(a: str | None, b: str | None, own_db: Path) -> bool:
    """Whether two storage URLs (None: the output folder's `own_db`) name one database:
    an SQLite file by its path (relative: from the current folder, as SQLite opens it),
    another database by its server, port, user and name (not its password or options)."""
    def key(url: str | None) -> tuple[object, ...]:
        url = url or f"sqlite:///{own_db}"
        if url.startswith("sqlite:///"):
            path = url.removeprefix("sqlite:///").partition("?")[0]
            return ("sqlite", str(Path(path.removeprefix("file:")).absolute().resolve()))
        try:
            parsed = make_url(url)
        except ArgumentError:
            return (url,)
        backend = parsed.get_backend_name()
        return (backend, (parsed.host or "").lower(), parsed.port or DEFAULT_PORTS.get(backend),
                parsed.username, parsed.database)

    return key(a) == key(b)


DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306}
