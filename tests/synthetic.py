"""Synthetic measured launches for recommendation and export tests (no servers): at batch
1 the wide tree wins, at batch 32 it regresses humaneval and the chain is best."""

from __future__ import annotations

from treetune.config import BASELINE, TreeConfig
from treetune.results import CellResult, LaunchResult
from treetune.study.spec import StudySpec, load_study

DATASETS = ["sharegpt", "humaneval"]  # built-in names; only the measured numbers matter


def launch(config, per_batch) -> LaunchResult:
    """per_batch: {batch: {dataset: tok/s}}"""
    cells = [CellResult(d, b, tput, None, 10, 100, 1.0, None, None)
             for b, row in per_batch.items() for d, tput in row.items()]
    return LaunchResult(config, ok=True, cells=cells)


def spec(tmp_path, **over) -> StudySpec:
    base = {"name": "t", "model": "/models/My Model $(touch pwned)", "draft": "org/draft",
            "datasets": DATASETS, "batch": [1, 32], "output": str(tmp_path / "out"),
            "server_flags": {"--attention-backend": "triton", "--trust-remote-code": None},
            "env": {"SGLANG_ENABLE_SPEC_V2": "1"},
            # Exact synthetic numbers: intervals collapse to the measured speedups.
            "search": {"launch_cv": 0.0}}
    return load_study(None, {**base, **over})


BASE = launch(BASELINE,
              {1: {"sharegpt": 100, "humaneval": 100}, 32: {"sharegpt": 1000, "humaneval": 1000}})
WIDE = launch(TreeConfig(3, 4, 8),
              {1: {"sharegpt": 150, "humaneval": 170}, 32: {"sharegpt": 1300, "humaneval": 890}})
NARROW = launch(TreeConfig(5, 1, 6),
                {1: {"sharegpt": 130, "humaneval": 140}, 32: {"sharegpt": 1100, "humaneval": 1020}})
