"""Parallel proposals (several workers free at once) and the simulated clock the scaling
benchmark runs them on; launches are evaluated in-process from a profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import optuna
import pytest

from treetune.config import BASELINE, TreeConfig
from treetune.perfmodel import PerfModel, load_profile
from treetune.results import LaunchResult, config_key
from treetune.space import load_space
from treetune.strategies.model import INITIAL_DESIGN, ModelStrategy
from treetune.strategies.tpe import TPEStrategy
from treetune.study.offline import (
    LaunchClock,
    Noise,
    run_offline,
    run_parallel,
    simulate_launch,
)
from treetune.study.planner import Planner, Task
from treetune.study.spec import load_study
from treetune.study.storage import StudyStore

PROFILE = "qwen3-coder-next-h200"
ROOT = Path(__file__).resolve().parent.parent
EXACT = LaunchClock(load_s=300.0, load_cv=0.0, warmup_s=5.0, warmup_cv=0.0)


def study(**over):
    prof = load_profile(PROFILE)
    return load_study(None, {
        "name": "p", "model": "m", "draft": "d", "tp": prof.tp, "datasets": list(prof.datasets),
        "batch": [1, 32], "space": "default", "budget": {"launches": 30},
        "backend": {"kind": "emulator", "profile": PROFILE}, **over})


def truth() -> PerfModel:
    prof = load_profile(PROFILE)
    return PerfModel(prof, prof.tp)


def launch_seconds(spec) -> float:
    """A successful launch on the EXACT clock: load, then every cell's warm-up and window."""
    cells = len(spec.batch) * len(spec.dataset_names)
    return EXACT.load_s + cells * (spec.measurement.duration_s + EXACT.warmup_s)


def fresh_planner(spec) -> Planner:
    store = StudyStore(spec, storage=optuna.storages.InMemoryStorage())
    return Planner(spec, store, load_space(spec.space), [], tp=spec.tp)


# ---- proposals while other launches run -------------------------------------------------

@pytest.mark.parametrize("strategy", ["model", "tpe"])
def test_free_workers_do_not_wait_for_the_baseline(strategy):
    planner = fresh_planner(study(search={"strategy": strategy}))
    tasks = [planner.next() for _ in range(4)]
    assert tasks[0] is not None and tasks[0].config is BASELINE
    trees = [t.config for t in tasks[1:] if t is not None]
    assert all(isinstance(c, TreeConfig) for c in trees)
    assert len({config_key(c) for c in trees}) == len(trees)
    if strategy == "tpe":  # its random start-up needs no speedup
        assert len(trees) == 3
        return
    # The model search's start-up design, as one worker would launch it; then it waits
    # for the baseline rather than propose from the prior alone (a blind round).
    space = load_space("default")
    assert trees == [c for c in INITIAL_DESIGN if space.allows(c.steps, c.topk,
                                                               c.draft_tokens)]
    assert tasks[3] is None


def test_the_model_search_proposes_again_once_the_baseline_is_measured():
    spec = study(search={"strategy": "model"})
    planner = fresh_planner(spec)
    tasks = [planner.next() for _ in range(3)]
    assert planner.next() is None  # the baseline and the design run; nothing blind
    rng = np.random.default_rng(0)
    baseline = tasks[0]
    assert baseline is not None and baseline.config is BASELINE
    planner.finish(baseline, simulate_launch(truth(), BASELINE, spec, rng, Noise(0.03, 0.03)))
    fresh = planner.next()
    assert fresh is not None and isinstance(fresh.config, TreeConfig)
    assert fresh.key not in {t.key for t in tasks if t is not None}


def test_the_model_search_waits_for_a_slow_baseline_after_its_design_has_finished():
    # Loading times vary: the design trees may be measured while the baseline still loads.
    # Nothing is pending then but the baseline, and still nothing blind is proposed.
    spec = study(search={"strategy": "model"})
    planner = fresh_planner(spec)
    baseline, *design = [planner.next() for _ in range(3)]
    rng = np.random.default_rng(0)
    for task in design:
        assert task is not None
        planner.finish(task, simulate_launch(truth(), task.config, spec, rng,
                                             Noise(0.03, 0.03)))
    assert planner.pending_trees() == [] and planner.baseline is None
    assert planner.next() is None
    assert baseline is not None
    planner.finish(baseline, simulate_launch(truth(), BASELINE, spec, rng, Noise(0.03, 0.03)))
    assert planner.next() is not None


def test_without_a_baseline_launched_or_running_nothing_is_proposed():
    spec = study(search={"strategy": "tpe"})
    planner = fresh_planner(spec)
    task = planner.next()
    assert task is not None and task.config is BASELINE
    planner.finish(task, LaunchResult(BASELINE, reason="crashed", exit_code=1))
    assert planner.baseline is None and planner.next() is None


def test_n_free_workers_get_n_distinct_trees_none_measured_or_running():
    spec = study(search={"strategy": "model"})
    planner = run_offline(spec, truth(), seed=2, launches=6, noise=Noise(0.03, 0.03))
    measured = {config_key(r.config) for r in planner.launched}
    tasks = [planner.next() for _ in range(8)]
    assert all(t is not None for t in tasks)
    keys = [t.key for t in tasks if t is not None]
    assert len(set(keys)) == 8
    # Re-measurements may share the queue with new trees; new trees are new.
    fresh = [t.key for t in tasks if t is not None and not t.remeasure]
    assert fresh and not set(fresh) & measured


def test_a_model_proposal_believes_the_launches_under_way():
    """The same posterior draw, once with nothing running and once with its own pick
    running: the second proposal is another tree, one that draw does not find a near twin
    of the first, and its forecast gain counts the running tree as if measured."""
    spec = study(search={"strategy": "model"})
    planner = run_offline(spec, truth(), seed=4, launches=7, noise=Noise(0.03, 0.03))
    strategy = planner.strategy
    assert isinstance(strategy, ModelStrategy)
    state = strategy.rng.bit_generator.state
    alone = strategy.propose()
    assert alone is not None
    strategy.rng.bit_generator.state = state
    planner.in_flight.append(Task(alone.config, alone))
    assert planner.pending_trees() == [alone.config]
    beside = strategy.propose()
    assert beside is not None and beside.config != alone.config
    if alone.gain is not None and beside.gain is not None:
        assert beside.gain <= alone.gain  # the incumbent now includes the running tree


def test_tpe_lies_about_running_trials_so_parallel_asks_spread_out():
    spec = study(search={"strategy": "tpe"})
    planner = fresh_planner(spec)
    assert isinstance(planner.strategy, TPEStrategy)
    for study_ in planner.store.batch_studies.values():
        sampler = study_.sampler
        assert isinstance(sampler, optuna.samplers.TPESampler)
        assert sampler._constant_liar  # Optuna's own mechanism for pending trials


# ---- the simulated clock ----------------------------------------------------------------

def test_launches_finish_in_simulated_time_order_on_every_worker():
    spec = study(search={"strategy": "tpe"})
    times: list[float] = []
    running: list[int] = []

    def after(planner: Planner, now: float) -> bool:
        times.append(now)
        running.append(len(planner.in_flight))
        return False

    run_parallel(spec, truth(), seed=0, launches=12, workers=3, clock=LaunchClock(),
                 after_launch=after)
    assert len(times) == 12 and times == sorted(times)
    assert max(running) <= 2  # the two other workers' launches, while one is handed back


def test_with_an_exact_clock_launches_of_one_wave_finish_together():
    spec = study(search={"strategy": "tpe", "max_launches_per_config": 1})
    one = launch_seconds(spec)
    times: list[float] = []
    run_parallel(spec, truth(), seed=1, launches=8, workers=4, clock=EXACT,
                 after_launch=lambda planner, now: times.append(now) and False)
    # The baseline and three trees start at 0; four more once they finish. A launch that
    # fails to start (out of memory) would end after the load alone: none does here.
    assert times == pytest.approx([one] * 4 + [2 * one] * 4)


def test_a_failed_launch_takes_only_the_load_time():
    spec = study()
    failed = LaunchResult(TreeConfig(8, 8, 64), reason="OOM", exit_code=1)
    ok = LaunchResult(BASELINE, ok=True)
    rng = np.random.default_rng(0)
    assert EXACT.duration(spec, failed, rng) == pytest.approx(EXACT.load_s)
    assert EXACT.duration(spec, ok, rng) == pytest.approx(launch_seconds(spec))


def test_one_simulated_worker_makes_the_study_a_plain_loop_makes():
    """One launch at a time, next then finish: the loop search_efficiency's studies ran
    before the clock existed (their results must not move)."""
    spec = study(search={"strategy": "tpe"})
    planner, rng = fresh_planner(spec), np.random.default_rng(3)
    while planner.launches < 10:
        task = planner.next()
        assert task is not None
        planner.finish(task, simulate_launch(truth(), task.config, spec, rng, Noise()))
    parallel = run_parallel(spec, truth(), seed=3, launches=10, workers=1)
    assert [config_key(r.config) for r in parallel.launched] == \
        [config_key(r.config) for r in planner.launched]
    assert [r.cells for r in parallel.launched] == [r.cells for r in planner.launched]


def test_simulated_nodes_name_their_workers_and_slow_every_launch_they_run():
    """Worker w runs on node w mod the count: its launches carry the node's name (as the
    runner names a Ray worker by its host) and its speed. Each node runs the baseline
    first (the planner is told the node), so the two baselines differ by the speed alone
    (no noise here)."""
    spec = study(search={"strategy": "tpe"})
    quiet = Noise(0.0, 0.0, 0.0)
    plain = run_parallel(spec, truth(), seed=2, launches=8, workers=2, clock=EXACT,
                         noise=quiet)
    slow = run_parallel(spec, truth(), seed=2, launches=8, workers=2, clock=EXACT,
                        noise=quiet, nodes=(1.0, 0.5))
    assert all(r.worker == "" for r in plain.launched)
    assert {r.worker for r in slow.launched} == {"worker-0@node-0", "worker-1@node-1"}
    first, second = slow.launched[:2]
    assert first.config == second.config == BASELINE
    assert (first.worker, second.worker) == ("worker-0@node-0", "worker-1@node-1")
    for cell in first.cells:
        assert second.cell(cell.dataset, cell.batch).output_tok_s == pytest.approx(
            0.5 * cell.output_tok_s)
    # Without nodes the second worker starts a tree: the baseline's second launch waits.
    assert plain.launched[1].config != BASELINE
    with pytest.raises(ValueError, match="node speeds"):
        run_parallel(spec, truth(), seed=2, launches=2, workers=2, nodes=(1.0, 0.0))


def test_a_drifting_machine_speeds_up_each_launch_by_its_share_per_launch_before_it():
    """Launch k runs at 1 + drift x k (a machine warming up, a neighbour leaving), whatever
    its config: compared launch by launch with the same study on a steady machine (no
    noise here; TPE's first trials are drawn before any result, so both launch the same
    configs)."""
    spec = study(search={"strategy": "tpe"})
    quiet = Noise(0.0, 0.0, 0.0)
    plain = run_parallel(spec, truth(), seed=3, launches=4, workers=1, clock=EXACT,
                         noise=quiet)
    drifting = run_parallel(spec, truth(), seed=3, launches=4, workers=1, clock=EXACT,
                            noise=quiet, drift=0.1)
    for k, (steady, drifted) in enumerate(zip(plain.launched, drifting.launched,
                                              strict=True)):
        assert drifted.config == steady.config
        for cell in steady.cells:
            assert drifted.cell(cell.dataset, cell.batch).output_tok_s == pytest.approx(
                (1 + 0.1 * k) * cell.output_tok_s)
    with pytest.raises(ValueError, match="drift"):
        run_parallel(spec, truth(), seed=3, launches=11, workers=1, drift=-0.1)


def test_the_study_ends_when_after_launch_says_so():
    spec = study(search={"strategy": "tpe"})
    planner = run_parallel(spec, truth(), seed=0, launches=20, workers=4,
                           after_launch=lambda planner, now: planner.launches >= 5)
    assert planner.launches == 5


# ---- the benchmark ----------------------------------------------------------------------

def test_the_scaling_benchmark_prints_medians_per_strategy_and_worker_count():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--strategies", "tpe",
         "--workers", "1", "2", "--seeds", "1", "--max-launches", "12", "--processes", "1",
         "--json"], capture_output=True, text=True, env=env, timeout=300, check=True)
    summary = json.loads(out.stdout)
    assert set(summary) == {"tpe"} and set(summary["tpe"]) == {"1", "2"}
    for entry in summary["tpe"].values():
        assert entry["wall_s"] > 0 and entry["launches"] >= 1
        assert entry["studies"] == 1
    assert summary["tpe"]["1"]["wall_ratio"] == 1.0
