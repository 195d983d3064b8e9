"""Do two Ray workers overlap launches? Runs the same emulated study budget with one worker
and with two, in one process, and reports the wall-time ratio (goal: under 0.7).

    .venv/bin/python benchmarks/worker_overlap.py [--launches 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from search_efficiency import positive_int

from treetune.study.runner import run_study
from treetune.study.spec import load_study


def study(workers: int, launches: int, out: str) -> float:
    spec = load_study(None, {
        "name": f"overlap-{workers}", "model": "Qwen/Qwen3-Coder-Next",
        "draft": "thoughtworks/Qwen3-Coder-Next-Eagle3", "tp": 4,
        "datasets": ["humaneval"], "batch": [1, 8], "space": "default",
        "budget": {"launches": launches}, "workers": workers, "seed": 1,
        "backend": {"kind": "emulator", "profile": "qwen3-coder-next-h200",
                    "time_scale": 10.0, "load_time_s": 30.0},
        "measurement": {"duration_s": 10.0, "repeats": 2, "startup_timeout_s": 60.0},
        "output": f"{out}/w{workers}",
    })
    os.environ["TREETUNE_RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    start = time.monotonic()
    outcome = run_study(spec)
    elapsed = time.monotonic() - start
    assert len(outcome.results) == launches and all(r.ok for r in outcome.results)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--launches", type=positive_int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with tempfile.TemporaryDirectory() as out:
        one = study(1, args.launches, out)
        two = study(2, args.launches, out)
    result = {"launches": args.launches, "one_worker_s": round(one, 1),
              "two_workers_s": round(two, 1), "ratio": round(two / one, 3),
              "goal": "ratio < 0.7", "met": two / one < 0.7}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.launches} launches: 1 worker {one:.1f} s, 2 workers {two:.1f} s, "
              f"ratio {two / one:.3f} (goal < 0.7: {'met' if two / one < 0.7 else 'NOT met'})")


if __name__ == "__main__":
    main()
