"""The package's seams hold: no import cycles, engine facts only in backends/, and a new
serving backend is one class plus its registration."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import pytest
from studykit import small_study

import treetune
from treetune.backends import (
    BACKENDS,
    Deployment,
    LaunchContext,
    LaunchSpec,
    ServerApi,
    register,
)
from treetune.backends.emulator import emulator_command
from treetune.backends.sglang import SGLANG_API
from treetune.config import ServerConfig

PACKAGE = Path(treetune.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every treetune module `path` imports anywhere in it: at the top, inside functions
    and under TYPE_CHECKING alike (an import inside a function hides a cycle, not breaks it)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(
        ".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            # `from treetune.x import y`: y may be a module of x, or a name defined in x.
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != "treetune":
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(paths)) - {name} for name, path in paths.items()}


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan). A package face
    (`__init__`) importing its own modules is not a cycle unless they import it back."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_the_package_has_no_import_cycle_even_through_imports_inside_functions():
    graph = import_graph()
    assert graph.get("treetune.study.planner")
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle_hidden_inside_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_an_emulated_server_and_a_launch_worker_start_without_scipy_stats():
    """Every launch starts both (a Ray worker per study, an emulator per launch): importing
    scipy.stats, which the performance model's serving curves use, cost each most of a
    second. Imported as they are started: a fresh interpreter with nothing else loaded."""
    code = ("import sys, treetune.emulator.server, treetune.study.worker; "
            "print(sorted(m for m in sys.modules if m.startswith(('scipy.stats', "
            "'scipy.optimize'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "[]"


def test_no_backend_kind_is_branched_on_outside_backends():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "backends" in path.relative_to(PACKAGE).parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if re.search(r"kind\s*(==|!=)|\.kind\s+(not\s+)?in\b", line):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert offenders == []


def test_sglang_facts_live_in_its_backend_module_only():
    facts = ("sglang:", "/health_generate", "/server_info", "sglang.launch_server",
             "--speculative-num-steps", "--cuda-graph-max-bs")
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        # The emulator is a program that plays SGLang: it must answer to these names.
        if relative.parts[0] in ("backends", "emulator"):
            continue
        text = path.read_text()
        offenders += [f"{relative}: {fact}" for fact in facts if fact in text]
    assert offenders == []


# ---- a backend that treetune does not ship ----------------------------------------------

TOY_API = dataclasses.replace(SGLANG_API, info_keys=("version", "emulator"))


@dataclasses.dataclass(frozen=True)
class ToyBackend:
    """Serves through the emulator but is its own engine: its own GPU resource, its own
    production command, its own checks."""

    kind: ClassVar[str] = "toy"
    gpu_resource: ClassVar[str] = "toy_gpu"
    gpu_label: ClassVar[str] = "toy GPUs"
    api: ClassVar[ServerApi] = TOY_API

    profile: str = "qwen3-coder-next-h200"
    checked_marker: str = ""  # a file check() writes, to show it ran before any launch

    def command(self, launch: LaunchSpec, config: ServerConfig,
                context: LaunchContext) -> list[str]:
        return emulator_command(config, launch, self.profile,
                                ["--time-scale", "20", "--load-time", "1", "--no-noise",
                                 "--seed", str(context.study_seed)])

    def deployment(self, launch: LaunchSpec, config: ServerConfig) -> Deployment:
        return Deployment(["toy-serve", "--model", launch.model_path,
                           "--tree", getattr(config, "label", lambda: "none")()])

    def reads_config_file(self, launch: LaunchSpec) -> bool:
        return False

    def check(self, launch: LaunchSpec, datasets: list[str], env: Mapping[str, str],
              local: bool) -> None:
        if self.checked_marker:
            Path(self.checked_marker).write_text(",".join(datasets))

    def facts(self, launch: LaunchSpec, env: Mapping[str, str]) -> None:
        return None

    def describe(self) -> str:
        return "toy"


@pytest.fixture
def toy_registered():
    """The toy backend is registered for this test only: other tests see treetune's own."""
    register(ToyBackend)
    yield
    assert BACKENDS.pop("toy") is ToyBackend


@pytest.mark.slow
@pytest.mark.usefixtures("ray_tmpdir", "toy_registered")
def test_a_backend_added_by_one_class_and_its_registration_runs_a_study(tmp_path):
    import ray.cloudpickle

    from treetune.study.export import write_outputs
    from treetune.study.runner import run_study
    from treetune.study.spec import load_study

    # Ray ships the spec (and so this test's class) to its workers by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    marker = tmp_path / "checked"
    data = small_study(tmp_path, name="toy", batch=[1], datasets=["humaneval"], workers=1,
                       budget={"launches": 2}, compare=["3,4,8"],
                       backend={"kind": "toy", "checked_marker": str(marker)},
                       search={"strategy": "tpe", "max_launches_per_config": 1})
    spec = load_study(None, data)
    assert isinstance(spec.backend, ToyBackend)
    outcome = run_study(spec)
    assert marker.read_text() == "humaneval"
    assert outcome.strategy == "tpe"  # no facts: auto would fall back to TPE too
    assert [r.ok for r in outcome.results] == [True, True], [r.reason for r in outcome.results]
    assert all(r.server_info.keys() <= {"version", "emulator"} and r.server_info
               for r in outcome.results)
    write_outputs(spec, outcome.recommendations, spec.output_dir)
    script = (spec.output_dir / outcome.recommendations[0].script_name).read_text()
    assert "exec toy-serve --model" in script and "sglang" not in script


@pytest.mark.usefixtures("toy_registered")
def test_a_toy_backend_section_is_validated_against_its_own_fields(tmp_path):
    from treetune.errors import TreetuneError
    from treetune.study.spec import load_study

    with pytest.raises(TreetuneError, match=r"backend\.profle.*did you mean 'profile'"):
        load_study(None, small_study(tmp_path, backend={"kind": "toy", "profle": "x"}))
