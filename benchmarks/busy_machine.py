"""A study's cells beside CPU hogs: what Ray's worker niceness does to a measurement.

    .venv/bin/python benchmarks/busy_machine.py [--hogs 2] [--json]

Three runs of a two-launch study (no speculation and the tree (3,4,8) on the coder-next
profile, humaneval and mt-bench at batch 8, time scale 20, noise off), each on a Ray of
its own:
on an idle machine; beside `--hogs` busy loops at niceness 0, with Ray's workers at
niceness 0 (what treetune starts); and beside them with Ray's default worker niceness (15),
kept (the worker's own return to niceness 0, `normal_priority`, switched off as where a
worker may not lower it).
Printed per run and cell: the baseline's throughput as a ratio of the idle run's, the
tree's measured speedup, and how late the load generator and the server ran (the larger
over both launches, mean over the cell, server milliseconds; a cell over
`max_clock_lag_s` = 50 ms is measured again and kept marked lagged).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from treetune.config import TreeConfig
from treetune.results import CellResult, LaunchResult
from treetune.study.runner import run_study
from treetune.study.spec import load_study

DATASETS = ["humaneval", "mt-bench"]
BATCH = 8
TREE = TreeConfig(3, 4, 8)
RAY_DEFAULT_NICENESS = 15


@contextlib.contextmanager
def hogs(count: int) -> Iterator[None]:
    """`count` busy loops at this process's niceness (0), killed afterwards."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            started.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                            stdin=subprocess.DEVNULL))
        yield
    finally:
        for hog in started:
            hog.kill()
            hog.wait(timeout=10)


def keep_niceness() -> None:
    """In each Ray worker of the niced run: launch at the niceness Ray gave."""
    import treetune.study.worker

    treetune.study.worker.normal_priority = lambda: None


def run(niceness: int, out: str) -> tuple[list[CellResult], list[CellResult]]:
    """The baseline's and the tree's cells, on a Ray started here with its workers at
    `niceness`."""
    import ray

    spec = load_study(None, {
        "name": "busy", "model": f"{out}/model-under-test", "draft": "org/draft",
        "tp": 4, "datasets": DATASETS, "batch": [BATCH], "space": "bench-speculative",
        "budget": {"launches": 2}, "workers": 1, "seed": 3, "compare": [str(TREE)[1:-1]],
        "backend": {"kind": "emulator", "profile": "qwen3-coder-next-h200",
                    "time_scale": 20.0, "load_time_s": 5.0, "noise": False},
        "measurement": {"duration_s": 16.0, "repeats": 2, "startup_timeout_s": 60.0},
        "output": f"{out}/study"})
    with tempfile.TemporaryDirectory(prefix="rt_", dir="/tmp") as temp:
        ray.init(num_cpus=2, resources={spec.backend.gpu_resource: float(spec.tp)},
                 include_dashboard=False, log_to_driver=False, configure_logging=False,
                 _temp_dir=temp, _system_config={"worker_niceness": niceness},
                 runtime_env={"worker_process_setup_hook": keep_niceness} if niceness else None)
        try:
            outcome = run_study(spec)
        finally:
            ray.shutdown()
    launches = {r.config: r for r in outcome.results}
    return cells(launches.get(outcome.baseline.config if outcome.baseline else None)), cells(
        launches.get(TREE))


def cells(result: LaunchResult | None) -> list[CellResult]:
    if result is None or not result.ok:
        raise SystemExit(f"a launch failed: {result.reason if result else 'it never ran'}")
    return [c for d in DATASETS if (c := result.cell(d, BATCH)) is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--hogs", type=int, default=2, help="busy loops beside the study")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    arms = {"idle": (0, 0), f"{args.hogs} hogs, workers at niceness 0": (args.hogs, 0),
            f"{args.hogs} hogs, workers at niceness {RAY_DEFAULT_NICENESS}":
                (args.hogs, RAY_DEFAULT_NICENESS)}
    measured: dict[str, tuple[list[CellResult], list[CellResult]]] = {}
    for name, (count, niceness) in arms.items():
        print(f"{name} ...", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="busy-") as out, hogs(count):
            measured[name] = run(niceness, out)
    idle = {c.dataset: c.output_tok_s for c in measured["idle"][0]}
    report = {name: {b.dataset: {
        "baseline_vs_idle": round(b.output_tok_s / idle[b.dataset], 3),
        "speedup": round(t.output_tok_s / b.output_tok_s, 3),
        "client_lag_ms": round(1e3 * max(b.client_lag_s or 0.0, t.client_lag_s or 0.0), 1),
        "server_lag_ms": round(1e3 * max(b.clock_lag_s or 0.0, t.clock_lag_s or 0.0), 1),
        "lagged": b.lagged or t.lagged}
        for b, t in zip(*pair, strict=True)} for name, pair in measured.items()}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for name, cells in report.items():
        for dataset, row in cells.items():
            print(f"{name:34s} {dataset:10s} baseline {row['baseline_vs_idle']:.3f}x idle, "
                  f"(3,4,8) speedup {row['speedup']:.3f}, load generator "
                  f"{row['client_lag_ms']:7.1f} ms, server {row['server_lag_ms']:6.1f} ms"
                  f"{', lagged' if row['lagged'] else ''}")


if __name__ == "__main__":
    main()
