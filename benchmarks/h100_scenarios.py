"""studies/h100-scenarios.yaml in-process: what treetune recommends for the published
single-H100 scenarios (Qwen3-Coder-30B-A3B, tree (5,8,32)) on the shipped
qwen3-30b-a3b-h100 profile, and whether (5,8,32) survives the no-regression constraint at
concurrency 64 and 128.

The launches are drawn from the profile (treetune/study/offline.py) with its launch and
measurement noise, each server sized for the largest batch (128), so a tree that does not
fit in memory there fails as its launch would. The study's datasets are fixed-length, so
each cell is served as whole requests (prefill and request turnover included,
treetune/perfmodel/serving.py), and the chat scenario's 8 req/s is an open-loop rate
cell. The study's objective is throughput, which judges the closed-loop cells; the rate
cell's p50 TPOT is printed beside it.

    PYTHONPATH=. python benchmarks/h100_scenarios.py [--launches 16] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from search_efficiency import positive_int

from treetune.config import TreeConfig
from treetune.perfmodel import PerfModel, load_profile
from treetune.study.evidence import judge
from treetune.study.offline import Noise, run_offline
from treetune.study.spec import load_study

STUDY = Path(__file__).resolve().parents[1] / "studies" / "h100-scenarios.yaml"
PUBLISHED = TreeConfig(5, 8, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--launches", type=positive_int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    spec = load_study(STUDY)
    profile = load_profile(spec.backend.profile)  # type: ignore[attr-defined]
    truth = PerfModel(profile, spec.tp)
    print(f"noise-free model, {PUBLISHED} over no speculation (throughput):")
    for batch in spec.batch:
        ratios = {d: truth.predict(PUBLISHED, d, batch).speedup for d in spec.dataset_names}
        cells = ", ".join(f"{d} {r:.3f}" for d, r in ratios.items())
        print(f"  batch {batch}: {cells}")
    for size in spec.batch:
        starts = not truth.predict(PUBLISHED, spec.dataset_names[0], size).oom
        print(f"  starts at --max-running-requests {size}: {starts}")
    noise = Noise(profile.noise.launch_cv, profile.noise.measurement_cv, 0.01)
    planner = run_offline(spec, truth, args.seed, args.launches, noise)
    print(f"\n{planner.launches} launches, strategy {planner.strategy_name}")
    for key, result in planner.results.items():
        if not result.ok:
            print(f"  {key}: failed: {result.reason}")
    for rec in planner.decide():
        # The mixed workload, and each scenario's own cell (chat's is a rate cell).
        if rec.workload == "mixed" or (rec.batch, rec.workload) in ((64, "humaneval"),
                                                                    (128, "mt-bench")):
            print(f"  {rec.workload} at batch {rec.batch}: {rec.label()}: "
                  + ", ".join(rec.speedup_labels()))
    published = planner.results.get("5,8,32")
    if planner.baseline is None or published is None:
        raise SystemExit(f"the baseline and {PUBLISHED} were not both measured in "
                         f"{args.launches} launches: give more (--launches)")
    for batch in spec.batch:
        if not published.ok:
            print(f"  {PUBLISHED} at batch {batch}: infeasible (its launch failed)")
            continue
        verdict = judge(published, planner.baseline, batch, spec.dataset_names,
                        spec.tolerance, planner.noise())
        print(f"  {PUBLISHED} at batch {batch}: "
              + ", ".join(f"{d} {i.label()}" for d, i in verdict.intervals.items())
              + f"; feasible: {verdict.feasible}")
    for rate in spec.rates:  # the chat scenario's (sharegpt)
        base = planner.baseline.rate_cell("sharegpt", rate)
        if base is None or base.tpot is None:
            continue
        print(f"chat at {rate:g} req/s (sharegpt rate cell), p50 TPOT, no speculation "
              f"{base.tpot.p50 * 1e3:.2f} ms:")
        for key, result in planner.results.items():
            cell = result.rate_cell("sharegpt", rate) if result.ok else None
            if key != "baseline" and cell is not None and cell.tpot is not None:
                print(f"  {key}: {cell.tpot.p50 * 1e3:.2f} ms, "
                      f"{base.tpot.p50 / cell.tpot.p50:.2f}x faster per token")


if __name__ == "__main__":
    main()
