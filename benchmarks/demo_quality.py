"""Run studies/demo.yaml (local Ray, SQLite, emulator) and judge its recommendations
against the noise-free `treetune predict` ranking of the same space.

    .venv/bin/python benchmarks/demo_quality.py [--output DIR] [--json]

Checks: the batch-1 mixed recommendation is within 2% of the best feasible config; the
batch-32 mixed recommendation has every dataset's true speedup >= 1.0; the published wide
tree (3,4,8) measurably regresses at least one dataset at batch 32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from treetune.config import TreeConfig
from treetune.objectives import CellKey
from treetune.perfmodel import PerfModel, load_profile
from treetune.space import load_space
from treetune.study.evidence import speedups
from treetune.study.export import write_outputs
from treetune.study.runner import run_study
from treetune.study.spec import load_study

DEMO = Path(__file__).resolve().parents[1] / "studies" / "demo.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--output", default=None,
                        help="study folder, kept (default: a temp dir, removed at the end)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.output:
        measure(args.output, args.json)
        return
    with tempfile.TemporaryDirectory(prefix="demo-") as out:
        measure(out, args.json)


def measure(out: str, as_json: bool) -> None:
    """Run the demo study into `out` and print how its picks compare with the truth."""
    spec = load_study(DEMO, {"output": out})
    start = time.monotonic()
    outcome = run_study(spec)
    elapsed = time.monotonic() - start
    assert outcome.baseline is not None
    recs = outcome.recommendations
    write_outputs(spec, recs, spec.output_dir)

    model = PerfModel(load_profile(spec.backend.profile or ""))
    names = spec.dataset_names

    def truth(config: TreeConfig, batch: int) -> list[float]:
        return [model.predict(config, d, batch).speedup for d in names]

    report: dict[str, object] = {"launches": len(outcome.results), "wall_s": round(elapsed, 1)}
    for batch in spec.batch:
        feasible = [(statistics.fmean(s), c) for c in load_space(spec.space).configs()
                    if min(s := truth(c, batch)) >= 1.0]
        best_mean, best = max(feasible, key=lambda mc: mc[0])
        rec = next(r for r in recs if r.workload == "mixed" and r.batch == batch)
        true = truth(rec.config, batch) if isinstance(rec.config, TreeConfig) else [1.0]
        report[f"batch{batch}"] = {
            "recommended": rec.config.label(), "true_mean": round(statistics.fmean(true), 4),
            "true_min": round(min(true), 4), "best_feasible": best.label(),
            "best_mean": round(best_mean, 4),
            "fraction_of_best": round(statistics.fmean(true) / best_mean, 4),
        }
    wide = next(r for r in outcome.results if r.config == TreeConfig(3, 4, 8))
    wide32 = {cell.dataset: s for cell, s in speedups(
        wide, outcome.baseline, [CellKey(d, 32) for d in names]).items()}
    report["wide_3_4_8_batch32"] = {d: round(s, 3) for d, s in wide32.items()}
    b1, b32 = report["batch1"], report["batch32"]
    assert isinstance(b1, dict) and isinstance(b32, dict)
    report["checks"] = {
        "batch1_within_2pct": b1["fraction_of_best"] >= 0.98,
        "batch32_no_true_regression": b32["true_min"] >= 1.0,
        "wide_tree_regresses_at_32": min(wide32.values()) < 1.0,
        "under_10_minutes": elapsed < 600,
    }
    print(json.dumps(report, indent=None if as_json else 1))


if __name__ == "__main__":
    main()
