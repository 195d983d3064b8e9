"""Nodes that run apart: every node a study uses runs the baseline, and each tree is
compared with the baseline measured on its own node (its launches leveled by the node's
baseline mean against the others'), so a node slow for every launch cannot bias a
speedup; the interval carries that node's baseline error. Launches are drawn in-process
(treetune.study.offline); the runner names a launch's worker by its host the same way."""

from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np
import optuna
import pytest
from studykit import small_study

from treetune.config import BASELINE, TreeConfig
from treetune.perfmodel import PerfModel
from treetune.report.data import load_study_data
from treetune.results import config_key
from treetune.space import load_space
from treetune.study.evidence import (
    judge,
    learned_cv,
    level_nodes,
    merge_all,
    node_variance,
    noise_of,
    speedup_interval,
)
from treetune.study.offline import Noise, run_parallel, simulate_launch
from treetune.study.planner import Planner
from treetune.study.spec import SPEC_COPY, load_study
from treetune.study.storage import StudyStore

SLOW = 0.88  # node b's speed: a power-capped GPU


def spec_of(tmp_path, **over):
    return load_study(None, small_study(tmp_path, **{
        "search": {"strategy": "grid", "max_launches_per_config": 4}, **over}))


def two_node_study(tmp_path, slow: float, noise: Noise, seed: int = 0, shared: int = 8,
                   again: int = 0):
    """A planner fed the baseline and `shared` trees launched on both nodes, the first
    `again` of them once more on node a (repeats on one node: how the study learns its
    launch noise apart from the nodes' gap), then three trees on node b alone; node b runs
    at `slow` of node a's speed."""
    spec = spec_of(tmp_path)
    planner = Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                      load_space(spec.space), [])
    truth = PerfModel(spec.backend.facts(spec.launch_spec(), {}), spec.tp)
    rng = np.random.default_rng(seed)
    trees = list(load_space(spec.space).configs())
    for config in [BASELINE, *trees[:shared]]:
        for i, (node, speed) in enumerate((("gpu-node-a", 1.0), ("gpu-node-b", slow))):
            result = simulate_launch(truth, config, spec, rng, noise, speed)
            result.worker = f"worker-{i}@{node}"
            planner.absorb(result, i)
    for config in [BASELINE, *trees[:shared]][:again]:
        result = simulate_launch(truth, config, spec, rng, noise)
        result.worker = "worker-0@gpu-node-a"
        planner.absorb(result, 2)
    alone = trees[shared:shared + 3]
    for config in alone:
        result = simulate_launch(truth, config, spec, rng, noise, slow)
        result.worker = "worker-1@gpu-node-b"
        planner.absorb(result, 0)
    return spec, planner, truth, alone


def true_speedup(truth: PerfModel, config, dataset: str, batch: int) -> float:
    return truth.throughput(config, batch, dataset) / truth.throughput(BASELINE, batch, dataset)


def test_a_slow_nodes_trees_are_judged_against_its_own_baseline(tmp_path):
    """Node b 12% slow, a tree launched there alone: its speedup against the baseline
    (measured on both nodes) is the truth's, as against node b's baseline; unleveled, it
    would be 6% low."""
    # Half a percent of noise: one baseline launch per node pins its level to a percent.
    spec, planner, truth, alone = two_node_study(tmp_path, SLOW, Noise(0.005, 0.005))
    noise = planner.noise()
    raw = merge_all(planner.launched)
    for config in alone:
        leveled = planner.results[config_key(config)]
        assert leveled.leveled and leveled.leveled[0][0] == "gpu-node-b"
        for dataset in spec.dataset_names:
            true = true_speedup(truth, config, dataset, 8)
            got = speedup_interval(leveled, planner.baseline, dataset, 8, noise)
            before = speedup_interval(raw[config_key(config)], raw["baseline"], dataset, 8,
                                      noise)
            assert got.mean == pytest.approx(true, rel=0.03)
            # Unleveled: the tree at node b's speed over a baseline at both nodes' mean.
            assert before.mean == pytest.approx(true * SLOW / ((1 + SLOW) / 2), rel=0.03)
            assert got.low <= true <= got.high
    # Each node's launches of one config now agree: the learned launch noise is the
    # launches' own (half a percent), not the gap between nodes.
    assert noise.launch_cv < 0.02
    assert noise_of(spec, merge_all(planner.launched).values()).launch_cv > 0.04


def test_a_speedup_on_one_node_carries_that_nodes_baseline_error(tmp_path):
    _, planner, _, alone = two_node_study(tmp_path, SLOW, Noise(0.01, 0.01))
    tree = planner.results[config_key(alone[0])]
    base = planner.baseline
    # The baseline ran once on each node; the tree on node b alone.
    assert base.leveled == (("gpu-node-a", 0.5, 1.0), ("gpu-node-b", 0.5, 1.0))
    assert tree.leveled == (("gpu-node-b", 1.0, 1.0),)
    # Against node b's one baseline launch, not the pooled two: 1 - 1/2 of a launch more.
    assert node_variance(tree, base, 0.02) == pytest.approx(0.02 ** 2 / 2)
    assert node_variance(base, base, 0.02) == 0.0
    # A tree launched on both nodes alike weighs both baselines alike: nothing more.
    shared = planner.results[config_key(next(iter(load_space("bench-speculative").configs())))]
    assert node_variance(shared, base, 0.02) == pytest.approx(0.0)
    # Without the Student-t widening (the noise taken as known), the variances add up.
    noise = dataclasses.replace(planner.noise(), learned=False)
    with_gap = speedup_interval(tree, base, "humaneval", 8, noise)
    without = speedup_interval(dataclasses.replace(tree, leveled=()),
                               dataclasses.replace(base, leveled=()), "humaneval", 8, noise)
    assert with_gap.log_sd ** 2 == pytest.approx(without.log_sd ** 2
                                                 + noise.launch_cv ** 2 / 2)


def test_the_baselines_own_node_means_cost_its_launch_noise_their_degrees_of_freedom(
        tmp_path):
    """Leveled on two nodes, one launch each, the baseline's launches agree by
    construction: they teach the study nothing of its launch noise."""
    _, planner, _, _ = two_node_study(tmp_path, SLOW, Noise(0.03, 0.01), shared=0)
    assert planner.baseline.leveled and planner.noise().launch_dof == 0
    _, again, _, _ = two_node_study(tmp_path, SLOW, Noise(0.03, 0.01), shared=0, again=1)
    assert again.noise().launch_dof == 1  # a second launch on node a: one to learn from


def test_the_leveled_baselines_window_noise_is_taken_out_on_its_own_degrees_of_freedom(
        tmp_path):
    """Three baseline launches leveled on two nodes keep one degree of freedom: their
    deviations hold one launch variance and one sub-window variance of the launch mean,
    not two (the k - 1 of a baseline on one node)."""
    _, planner, _, _ = two_node_study(tmp_path, SLOW, Noise(0.03, 0.03), seed=1, shared=0, again=1)
    base = planner.baseline
    noise = planner.noise()
    assert len(base.leveled) == 2 and noise.launch_dof == 1
    cells = base.cells
    k = len(cells[0].launch_tok_s)
    assert k == 3
    deviations = [statistics.fmean(
        math.log(c.launch_tok_s[i]) - statistics.fmean(math.log(v) for v in c.launch_tok_s)
        for c in cells) for i in range(k)]
    windows = len(cells[0].repeats) // k
    window_var = noise.window_cv ** 2
    ss = sum(d * d for d in deviations) - (k - 2) * window_var / (windows * len(cells))
    assert ss > 0  # this seed's launches spread more than their windows explain
    # One degree of freedom, shrunk toward the prior (`learned_cv`).
    assert noise.launch_cv == pytest.approx(learned_cv(ss, 1, 0.03), rel=1e-9)


def test_the_baseline_on_every_node_runs_at_one_level_after_leveling(tmp_path):
    _, planner, _, _ = two_node_study(tmp_path, SLOW, Noise(0.03, 0.01), again=3)
    leveled, gaps = level_nodes(planner.launched)
    assert set(gaps) == {"gpu-node-a", "gpu-node-b"}
    assert sum(gaps.values()) == pytest.approx(0.0)
    assert gaps["gpu-node-b"] < gaps["gpu-node-a"]
    means = {}
    for result in leveled:
        if result.config == BASELINE:
            level = statistics.fmean(math.log(c.output_tok_s) for c in result.cells)
            means.setdefault(result.worker, []).append(level)
    a, b = (statistics.fmean(v) for v in means.values())
    assert a == pytest.approx(b)


def test_one_node_is_never_leveled(tmp_path):
    spec = spec_of(tmp_path)
    truth = PerfModel(spec.backend.facts(spec.launch_spec(), {}), spec.tp)
    rng = np.random.default_rng(0)
    launched = []
    for config in [BASELINE, TreeConfig(3, 1, 4), BASELINE]:
        result = simulate_launch(truth, config, spec, rng, Noise(0.03, 0.03), 0.5)
        result.worker = "worker-0@gpu-node-a"
        launched.append(result)
    assert level_nodes(launched) == (launched, {})


def test_the_report_judges_a_stored_two_node_study_as_the_search_did(tmp_path):
    """The notebooks' and the report's reading of a stored study levels its nodes as the
    search did: the same recommendations from the same launches."""
    spec = spec_of(tmp_path, search={"strategy": "model"}, budget={"launches": 24})
    truth = PerfModel(spec.backend.facts(spec.launch_spec(), {}), spec.tp)
    spec.output_dir.mkdir(parents=True, exist_ok=True)
    spec.save(spec.output_dir / SPEC_COPY)
    planner = run_parallel(spec, truth, seed=1, launches=24, workers=2, noise=Noise(0.01, 0.01),
                           store=StudyStore(spec), nodes=(1.0, 0.8))
    assert any(r.leveled for r in planner.results.values()), "premise: node b leveled"
    data = load_study_data(spec.output_dir)
    searched = {config_key(r.config): r for r in planner.results.values()}
    for result in data.results:
        assert result.leveled == searched[config_key(result.config)].leveled
        # Stored in start order, the search's in finish order: the same launches.
        for cell, same in zip(result.cells, searched[config_key(result.config)].cells,
                              strict=True):
            assert cell.output_tok_s == pytest.approx(same.output_tok_s)
            assert sorted(cell.launch_tok_s) == pytest.approx(sorted(same.launch_tok_s))
    assert len(data.results) == len(searched)
    # The report's table: each tree's speedups and feasibility as the search judged them.
    rows = data.rows(8)
    assert rows
    for row in rows:
        result = searched[config_key(row.config)]
        verdict = judge(result, planner.baseline, 8, spec.dataset_names, spec.tolerance,
                        planner.noise())
        assert row.feasible == verdict.feasible
        for dataset, speedup in row.speedups.items():
            assert speedup == pytest.approx(verdict.intervals[dataset].mean)



def test_each_node_runs_the_baseline_twice_before_anything_else_there(tmp_path):
    """Told the node of the worker a launch goes to, the planner gives a node that has run
    the baseline (or runs it) fewer than twice, while another node has, the baseline;
    once with re-measuring off; one node, or no node named, never gets an extra one."""
    def planner_of(limit: int) -> Planner:
        spec = spec_of(tmp_path, search={"strategy": "tpe", "max_launches_per_config": limit})
        return Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                       load_space(spec.space), [])

    planner = planner_of(3)
    keys = [planner.next(node).key for node in ("a", "a", "b", "b", "b", "a", "a")]
    assert keys[:2] == ["baseline", keys[1]] and keys[1] != "baseline"  # one node so far
    assert keys[2:4] == ["baseline", "baseline"] and keys[4] != "baseline"
    assert keys[5] == "baseline" and keys[6] != "baseline"  # node a's second
    assert [t.node for t in planner.in_flight] == ["a", "a", "b", "b", "b", "a", "a"]
    unnamed = planner_of(3)
    assert [unnamed.next().key for _ in range(3)].count("baseline") == 1
    alone = planner_of(3)
    assert [alone.next("a").key for _ in range(3)].count("baseline") == 1
    # Another search's launch, of unknown node, is no second node.
    shared = planner_of(3)
    shared.expect(BASELINE, 0)
    assert [shared.next("a").key for _ in range(3)].count("baseline") == 0
    once = planner_of(1)
    assert [once.next(node).key for node in ("a", "b", "b", "a")].count("baseline") == 2
