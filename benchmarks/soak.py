"""Soak: a 100-launch emulated study with injected faults, against the same study without.

The faulty run has random start-up failures (10% of launch attempts), crashes partway
through the benchmark (5%) and two Ray worker processes killed with SIGKILL while they run
a server. The benchmark reports launches attempted, completed, failed with cause, results
lost (must be 0), processes left behind (must be 0), and whether the recommendations equal
those of the fault-free run with the same seed.

The space has exactly 99 trees, so both runs try every config and differ only by the
faults; measurement noise is off so that a retried launch measures what it would have.

    .venv/bin/python benchmarks/soak.py [--launches 100] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import optuna
import yaml
from search_efficiency import positive_int

from treetune.results import LaunchResult, config_key
from treetune.space import load_space
from treetune.study.recommend import recommend
from treetune.study.runner import run_study
from treetune.study.spec import StudySpec, load_study

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from studykit import parent_of, processes_with, server_processes, wait_until

SPACE = {"description": "soak: 99 trees", "steps": {"min": 1, "max": 6}, "topk": [1, 2, 4],
         "draft_tokens": {"min": 2, "max": 10}, "include_baseline": True}
QUICK_SPACE = {**SPACE, "description": "soak --quick: 17 trees", "steps": {"min": 1, "max": 3},
               "topk": [1, 2], "draft_tokens": {"min": 2, "max": 7}}
FAULTS = [{"kind": "startup", "probability": 0.10}, {"kind": "crash", "probability": 0.05}]


def make_spec(root: Path, name: str, space: Path, launches: int, seed: int,
              faults: list[dict[str, Any]]) -> StudySpec:
    return load_study(None, {
        "name": name, "model": f"{root}/soak-model", "draft": "org/draft", "tp": 1,
        "datasets": ["humaneval", "mt-bench"], "batch": [1, 8], "space": str(space),
        "budget": {"launches": launches}, "workers": 2, "seed": seed,
        "backend": {"kind": "emulator", "profile": "qwen3-coder-next-h200", "time_scale": 10.0,
                    "load_time_s": 10.0, "noise": False, "faults": faults},
        "measurement": {"duration_s": 10.0, "repeats": 2, "startup_timeout_s": 60.0},
        # One launch per config, so that the budget covers the whole space and every
        # config has exactly one result to account for.
        "search": {"strategy": "tpe", "max_launches_per_config": 1},
        "output": str(root / name),
    })


class WorkerKiller:
    """Kills the Ray worker running a server, with SIGKILL, once `at` launches started."""

    def __init__(self, spec: StudySpec, at: list[int]) -> None:
        self.spec, self.at, self.kills = spec, list(at), []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)

    def watch(self) -> None:
        logs = self.spec.output_dir / "logs"
        marker = str(self.spec.model)
        while self.at and not self.stop.wait(0.2):
            started = len(list(logs.glob("*.log"))) if logs.exists() else 0
            running = server_processes(marker)
            if started >= self.at[0] and running:
                try:
                    worker = parent_of(running[0])
                    os.kill(worker, signal.SIGKILL)
                except (OSError, ValueError):
                    continue  # the server finished meanwhile: try the next one
                self.kills.append({"after_launches_started": started, "worker_pid": worker})
                self.at.pop(0)


RAY_DIRS: list[str] = []


def run(spec: StudySpec, kill_at: list[int]) -> tuple[float, list[dict[str, Any]]]:
    os.environ["TREETUNE_RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    RAY_DIRS.append(os.environ["TREETUNE_RAY_TMPDIR"])
    killer = WorkerKiller(spec, kill_at)
    killer.thread.start()
    started = time.monotonic()
    last = [0.0]

    def progress(p: Any) -> None:
        if time.monotonic() - last[0] > 15:
            last[0] = time.monotonic()
            print(f"  [{spec.name}] {p.launches_done}/{p.budget} launches, "
                  f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)

    run_study(spec, progress)
    killer.stop.set()
    killer.thread.join(5)
    return time.monotonic() - started, killer.kills


def audit(spec: StudySpec, space_size: int) -> dict[str, Any]:
    """What the storage holds, checked against what the study must have done."""
    launches = optuna.load_study(study_name=f"{spec.name}:launches", storage=spec.storage_url)
    trials = launches.get_trials(deepcopy=False)
    final = [LaunchResult.from_dict(json.loads(t.user_attrs["launch_result"]))
             for t in trials if "launch_result" in t.user_attrs]
    abandoned = [t for t in trials if "launch_result" not in t.user_attrs]
    keys = collections.Counter(config_key(r.config) for r in final)
    begun = {t.user_attrs.get("config") for t in trials}
    cells = {(d, b) for d in spec.dataset_names for b in spec.batch}
    causes: collections.Counter[str] = collections.Counter()
    for r in final:
        if not r.ok:
            causes["start-up failure" if "NCCL" in r.reason else
                   "crashed on both servers" if "benchmark failed" in r.reason else
                   r.reason.split(":")[0]] += 1
    lost = (len(begun - set(keys))  # a launch begun but with no result
            + sum(n - 1 for n in keys.values())  # a config with two results
            + sum(1 for r in final if r.ok and {(c.dataset, c.batch) for c in r.cells} != cells)
            + max(0, min(space_size, spec.budget.launches or space_size) - len(keys)))
    return {
        "launches_attempted": sum(r.attempts for r in final) + len(abandoned),
        "launch_results": len(final),
        "completed": sum(r.ok for r in final),
        "retried_after_crash_and_completed": sum(r.ok and r.attempts > 1 for r in final),
        "rescheduled_after_worker_death": sum("worker died" in t.user_attrs.get("reason", "")
                                              for t in abandoned),
        "failed": sum(not r.ok for r in final),
        "failed_by_cause": dict(causes),
        "results_lost": lost,
        "results": final,
    }


def recommendations(spec: StudySpec, results: list[LaunchResult],
                    keep: set[str] | None = None) -> dict[str, str]:
    chosen = [r for r in results if keep is None or config_key(r.config) in keep]
    base = next(r for r in chosen if config_key(r.config) == "baseline")
    return {f"{rec.workload}@{rec.batch}": config_key(rec.config)
            for rec in recommend(spec, chosen, base)}


def differences(spec: StudySpec, clean: list[LaunchResult], faulty: list[LaunchResult],
                rec_clean: dict[str, str], rec_faulty: dict[str, str]) -> list[dict[str, Any]]:
    """For each workload whose pick differs: both picks' measured means in both runs (a
    pick that failed to start in the faulty run, or a gap inside measurement noise)."""
    runs = {"fault_free": {config_key(r.config): r for r in clean},
            "faulty": {config_key(r.config): r for r in faulty}}
    out = []
    for workload, pick in rec_clean.items():
        other = rec_faulty.get(workload)
        if other == pick:
            continue
        name, batch = workload.rsplit("@", 1)
        datasets = spec.dataset_names if name == "mixed" else [name]
        row: dict[str, Any] = {"workload": workload, "fault_free_pick": pick,
                               "faulty_pick": other}
        for run_name, results in runs.items():
            base = results["baseline"]
            for label, key in (("fault_free_pick", pick), ("faulty_pick", other)):
                r = results.get(key or "")
                if r is None or not r.ok or key == "baseline":
                    value: Any = r.reason if r is not None and not r.ok else None
                else:
                    value = round(sum(r.cell(d, int(batch)).output_tok_s
                                      / base.cell(d, int(batch)).output_tok_s
                                      for d in datasets) / len(datasets), 4)
                row[f"{label}_mean_in_{run_name}"] = value
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--launches", type=positive_int, default=100)
    parser.add_argument("--seed", type=int, default=0,
                        help="the studies' seed (both runs share it)")
    parser.add_argument("--quick", action="store_true", help="20 launches, 1 worker kill")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--keep", type=Path, default=None, help="keep the studies here")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        soak(args, args.keep)
        return
    with tempfile.TemporaryDirectory(prefix="soak-") as root:  # gone however the run ends
        soak(args, Path(root))


def soak(args: argparse.Namespace, root: Path) -> None:
    """The two studies in `root`, and the report."""
    launches = 20 if args.quick else args.launches
    space_file = root / "soak-space.yaml"
    space_file.write_text(yaml.safe_dump(QUICK_SPACE if args.quick else SPACE))
    space_size = len(load_space(str(space_file)).configs()) + 1
    kill_at = [launches // 2] if args.quick else [launches // 3, 2 * launches // 3]

    clean = make_spec(root, "fault-free", space_file, launches, args.seed, [])
    faulty = make_spec(root, "faulty", space_file, launches, args.seed, FAULTS)
    print(f"soak: {launches} launches over a space of {space_size} configs, 2 workers; "
          f"studies in {root}" + ("" if args.keep else " (removed at the end: --keep DIR "
                                   "keeps them)"), file=sys.stderr)
    clean_s, _ = run(clean, [])
    faulty_s, kills = run(faulty, kill_at)
    def leftovers() -> list[int]:  # servers (their model path) and Ray's processes
        found = server_processes(str(clean.model)) + server_processes(str(faulty.model))
        return found + [pid for d in RAY_DIRS for pid in processes_with(d)]

    wait_until(lambda: not leftovers(), 30)
    orphans = leftovers()

    ref, got = audit(clean, space_size), audit(faulty, space_size)
    measured = {config_key(r.config) for r in got["results"] if r.ok}
    rec_clean, rec_faulty = recommendations(clean, ref["results"]), recommendations(
        faulty, got["results"])
    rec_common = recommendations(clean, ref["results"], keep=measured)
    report = {
        "launches": launches, "space_configs": space_size, "seed": args.seed,
        "wall_s": {"fault_free": round(clean_s, 1), "faulty": round(faulty_s, 1)},
        "worker_kills": kills,
        **{k: v for k, v in got.items() if k != "results"},
        "fault_free_results_lost": ref["results_lost"],
        "orphan_processes": len(orphans),
        "recommendations_equal": rec_clean == rec_faulty,
        "recommendations_equal_on_configs_both_measured": rec_common == rec_faulty,
        "recommendations": {"fault_free": rec_clean, "faulty": rec_faulty},
        "differences": differences(clean, ref["results"], got["results"], rec_clean,
                                   rec_faulty),
        "goals_met": got["results_lost"] == 0 and not orphans and len(kills) == len(kill_at),
    }
    if args.json:
        print(json.dumps(report))
        return
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
