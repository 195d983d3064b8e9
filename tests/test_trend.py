"""A machine whose speed moves with time (it warms up, a neighbour leaves): the time trend
of the baseline's launches is leveled out when it is clear, so a tree launched late is
compared with the baseline at the baseline's time; the interval carries the slope's error.
Launches are drawn in-process (treetune.study.offline)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import optuna
import pytest
from studykit import small_study

from treetune.config import BASELINE
from treetune.perfmodel import PerfModel
from treetune.results import config_key
from treetune.space import load_space
from treetune.study.evidence import (
    StudyNoise,
    launch_trend,
    level_nodes,
    leveled_launches,
    leveling_variance,
    merge_all,
    noise_of,
    places,
    speedup_interval,
)
from treetune.study.offline import Noise, simulate_launch
from treetune.study.planner import STALE_LAUNCHES, THIN_BASELINE_LIMITS, Planner
from treetune.study.spec import StudySpec, load_study
from treetune.study.storage import StudyStore

DRIFT = 0.01  # launch k runs at 1 + DRIFT x k
# Launch by launch: the baseline at 0, 1, 8 and 14, six trees between, two trees last.
BASE_AT = (0, 1, 8, 14)


def fresh(tmp_path, **over) -> tuple[StudySpec, Planner, PerfModel]:
    """A small grid study's spec, a planner with nothing launched, and its truth."""
    spec = load_study(None, small_study(tmp_path, **over, search={
        "strategy": "grid", "max_launches_per_config": 4}))
    planner = Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                      load_space(spec.space), [])
    return spec, planner, PerfModel(spec.backend.facts(spec.launch_spec(), {}), spec.tp)


def drifting_study(tmp_path, drift: float, noise: Noise, seed: int = 0, repeats: int = 0):
    """A planner fed, launch by launch on one machine whose launch k runs at
    1 + drift x k: the baseline at launches BASE_AT, eleven trees once each between and
    after (the last two at launches 15 and 16), and then the first `repeats` trees once
    more."""
    spec, planner, truth = fresh(tmp_path)
    rng = np.random.default_rng(seed)
    trees = list(load_space(spec.space).configs())[:13]
    order = list(trees[:13])
    for place in BASE_AT:
        order.insert(place, BASELINE)
    order = order[:17] + trees[:repeats]
    seen: dict[str, int] = {}
    for k, config in enumerate(order):
        key = config_key(config)
        planner.absorb(simulate_launch(truth, config, spec, rng, noise, 1 + drift * k),
                       seen.get(key, 0))
        seen[key] = seen.get(key, 0) + 1
    return spec, planner, truth, order[15:17]


def true_speedup(truth: PerfModel, config, dataset: str, batch: int) -> float:
    return truth.throughput(config, batch, dataset) / truth.throughput(BASELINE, batch, dataset)


def test_a_late_tree_on_a_warming_machine_is_compared_at_the_baselines_time(tmp_path):
    """1% faster per launch, a tree launched 10 launches after the baseline's mean time:
    unleveled it looks about 9% faster than it is; leveled, its speedup is the truth's
    and the interval holds it."""
    spec, planner, truth, late = drifting_study(tmp_path, DRIFT, Noise(0.005, 0.005))
    _, trend = leveled_launches(planner.launched, spec.search.launch_cv)
    assert trend is not None and trend.clear and trend.baselines == 4
    assert trend.slope == pytest.approx(DRIFT, rel=0.3)
    raw = merge_all(planner.launched)
    noise = planner.noise()
    for config in late:
        leveled = planner.results[config_key(config)]
        for dataset in spec.dataset_names:
            true = true_speedup(truth, config, dataset, 8)
            got = speedup_interval(leveled, planner.baseline, dataset, 8, noise)
            before = speedup_interval(raw[config_key(config)], raw["baseline"], dataset, 8,
                                      noise)
            assert before.mean > true * 1.06
            assert got.mean == pytest.approx(true, rel=0.03)
            assert got.low <= true <= got.high
    # Leveled, the baseline's launches agree again: the learned launch noise is theirs,
    # not the trend's.
    assert noise.launch_cv < noise_of(spec, raw.values()).launch_cv


def test_the_leveled_speedup_carries_the_slopes_error_over_the_time_between(tmp_path):
    spec, planner, _, late = drifting_study(tmp_path, DRIFT, Noise(0.005, 0.005))
    _, trend = leveled_launches(planner.launched, spec.search.launch_cv)
    assert trend is not None
    base, tree = planner.baseline, planner.results[config_key(late[-1])]
    # The baseline ran at launches 0, 1, 8 and 14 (mean 5.75); the last tree at launch 16.
    gap = 16 - sum(BASE_AT) / len(BASE_AT)
    assert base.trend == pytest.approx(0.0, abs=1e-12)
    assert tree.trend == pytest.approx(gap * trend.se)
    assert leveling_variance(tree, base, 0.02) == pytest.approx((gap * trend.se) ** 2)
    assert leveling_variance(base, base, 0.02) == 0.0
    noise = dataclasses.replace(planner.noise(), learned=False)
    with_trend = speedup_interval(tree, base, "humaneval", 8, noise)
    without = speedup_interval(dataclasses.replace(tree, trend=0.0), base, "humaneval", 8,
                               noise)
    assert with_trend.log_sd ** 2 == pytest.approx(without.log_sd ** 2 + (gap * trend.se) ** 2)


def test_the_trend_is_fitted_from_the_baseline_alone_and_judged_by_the_launch_noise(tmp_path):
    """Trees launched again because they looked good come back lower (regression to the
    mean): their repeats would read as a falling trend. The fit takes the baseline's
    launches alone, and its error is the study's launch noise over their spread in time."""
    _, planner, _, _ = drifting_study(tmp_path, 0.0, Noise(0.005, 0.005), repeats=3)
    only = launch_trend(planner.launched, StudyNoise(0.02))
    base = [r for r in planner.launched if r.config == BASELINE]
    assert only is not None and only.baselines == len(base) == 4
    mean = sum(BASE_AT) / len(BASE_AT)
    spread = sum((t - mean) ** 2 for t in BASE_AT)
    assert only.se == pytest.approx(0.02 / spread ** 0.5)
    # The trees' repeats, each made 20% slower, move nothing.
    slowed = [dataclasses.replace(r, cells=[
        dataclasses.replace(c, output_tok_s=0.8 * c.output_tok_s) for c in r.cells])
        if i >= 17 else r for i, r in enumerate(planner.launched)]
    assert launch_trend(slowed, StudyNoise(0.02)).slope == pytest.approx(only.slope)
    # Nothing to fit from one baseline launch; nothing clear from two.
    assert launch_trend(planner.launched[:1], StudyNoise(0.02)) is None
    two = launch_trend(planner.launched[:2], StudyNoise(1e-6))
    assert two is not None and two.baselines == 2 and not two.clear


def test_the_user_is_told_of_the_trend_once_and_a_resumed_study_not_again(tmp_path):
    spec, planner, _, _ = drifting_study(tmp_path, DRIFT, Noise(0.005, 0.005))
    notes = planner.trend_notes()
    assert len(notes) == 1, notes
    said = re.match(r"the machine runs (\d\.\d\d)% faster with each launch", notes[0])
    assert said and 0.7 <= float(said[1]) <= 1.3, notes
    assert "from the baseline's 4 launches in 17" in notes[0]
    assert "compares each tree with the baseline at the baseline's time" in notes[0]
    assert planner.trend_notes() == []
    resumed = Planner(spec, planner.store, load_space(spec.space), planner.launched)
    assert resumed.trend_notes() == []
    _, steady, _, _ = drifting_study(tmp_path, 0.0, Noise(0.005, 0.005))
    assert steady.trend_notes() == []


@pytest.mark.parametrize("seed", range(8))
def test_a_steady_machine_levels_nothing(tmp_path, seed):
    """The same launches at 3% launch noise on a machine that does not drift: no trend is
    clear, and every launch is judged as measured."""
    spec, planner, _, _ = drifting_study(tmp_path, 0.0, Noise(0.03, 0.01), seed=seed)
    leveled, trend = leveled_launches(planner.launched, spec.search.launch_cv)
    assert trend is None
    assert all(a is b for a, b in zip(leveled, level_nodes(planner.launched)[0], strict=True))
    assert all(r.trend == 0.0 for r in planner.results.values())


def test_a_slight_trend_under_much_noise_is_left_as_measured(tmp_path):
    """0.1% per launch under 3% launch noise: too unsure to level (a wrong slope would
    bias every late tree more than the trend does)."""
    spec, planner, _, _ = drifting_study(tmp_path, 0.001, Noise(0.03, 0.01), seed=1)
    noise = noise_of(spec, merge_all(planner.launched).values())
    trend = launch_trend(planner.launched, noise)
    assert trend is not None and not trend.clear
    assert leveled_launches(planner.launched, spec.search.launch_cv)[1] is None


def test_nodes_taking_turns_read_as_no_trend(tmp_path):
    """Every config launched on node a, then at once on node b 12% slower: the baseline's
    launches are fitted about each node's own mean, so the nodes' gap reads as no trend."""
    spec, planner, truth = fresh(tmp_path)
    rng = np.random.default_rng(0)
    trees = list(load_space(spec.space).configs())[:8]
    for config in [BASELINE, *trees[:4], BASELINE, *trees[4:], BASELINE]:
        for i, (node, speed) in enumerate((("gpu-node-a", 1.0), ("gpu-node-b", 0.88))):
            result = simulate_launch(truth, config, spec, rng, Noise(0.005, 0.005), speed)
            result.worker = f"worker-{i}@{node}"
            planner.absorb(result, i)
    trend = launch_trend(planner.launched, StudyNoise(0.005))
    assert trend is not None and trend.baselines == 6 and not trend.clear
    assert all(r.trend == 0.0 for r in planner.results.values())


def test_a_recommendation_launched_long_after_the_baseline_calls_the_baseline_again(tmp_path):
    """A machine getting faster makes late trees look good: no margin is thin, and the
    baseline of the study's first launches would never run again, so no trend could show.
    Once the recommendation's latest launch is STALE_LAUNCHES after the baseline's, the
    baseline goes next (not while one runs); launched, it is fresh again."""
    spec, planner, truth = fresh(tmp_path, compare=[])
    rng = np.random.default_rng(0)
    quiet = Noise(0.005, 0.005)

    def absorb(config) -> None:
        index = sum(1 for r in planner.launched if r.config == config)
        planner.absorb(simulate_launch(truth, config, spec, rng, quiet), index)

    def stale(busy: frozenset[str] = frozenset()):
        ranked = planner._confirmed_by_rank(planner.noise(), {})
        return planner._remeasure_stale(set(busy), ranked), ranked

    absorb(BASELINE)
    absorb(BASELINE)
    for config in list(load_space(spec.space).configs())[:STALE_LAUNCHES - 1]:
        absorb(config)
    task, ranked = stale()
    leaders = {config_key(v[0].config) for v in ranked.values() if v}
    assert leaders and task is None  # every tree within STALE_LAUNCHES - 1 of launch 1
    absorb(ranked[max(spec.batch)][0].config)  # the leader again, at launch 11
    task, _ = stale()
    assert task is not None and task.config == BASELINE and task.remeasure
    assert stale(frozenset({"baseline"}))[0] is None
    task = planner.next()
    assert task.config == BASELINE
    planner.finish(task, simulate_launch(truth, BASELINE, spec, rng, quiet))
    assert stale()[0] is None
    # Stale again and again: up to THIN_BASELINE_LIMITS times the per-config limit, as a
    # thin margin's baseline, and no further.
    cap = THIN_BASELINE_LIMITS * spec.search.max_launches_per_config
    def lead_until_stale(launches: int) -> bool:
        """The leader at the largest batch size launched again and again (it may change
        hands), until the baseline is called for or `launches` are spent."""
        for _ in range(launches):
            absorb(stale()[1][max(spec.batch)][0].config)
            if stale()[0] is not None:
                return True
        return False

    while sum(1 for r in planner.launched if r.config == BASELINE) < cap:
        assert lead_until_stale(4 * STALE_LAUNCHES)
        absorb(BASELINE)
    assert not lead_until_stale(4 * STALE_LAUNCHES)


def test_two_nodes_whose_baselines_ran_at_other_times_are_leveled_once(tmp_path):
    """1% faster per launch, nearly no noise: the baseline on node a at launches 0, 1, 24
    and 25, on node b (12% slower) at 2 and 3, twenty trees between taking turns. Node b's
    baseline ran early, so its gap holds part of the trend: the trend is taken out of the
    launches as measured, before the nodes are leveled, or node b's trees would come out
    about 6% fast and node a's 2.5% slow."""
    spec, planner, truth = fresh(tmp_path)
    rng = np.random.default_rng(0)
    trees = list(load_space(spec.space).configs())[:20]
    plan = [(BASELINE, "a"), (BASELINE, "a"), (BASELINE, "b"), (BASELINE, "b"),
            *((tree, "ab"[i % 2]) for i, tree in enumerate(trees)),
            (BASELINE, "a"), (BASELINE, "a")]
    seen: dict[str, int] = {}
    for k, (config, node) in enumerate(plan):
        speed = (1 + DRIFT * k) * (0.88 if node == "b" else 1.0)
        result = simulate_launch(truth, config, spec, rng, Noise(0.001, 0.001), speed)
        result.worker = f"worker-0@gpu-node-{node}"
        planner.absorb(result, seen.get(config_key(config), 0))
        seen[config_key(config)] = seen.get(config_key(config), 0) + 1
    assert planner.trend_notes()
    for tree in trees:
        got = speedup_interval(planner.results[config_key(tree)], planner.baseline,
                               "humaneval", 8, planner.noise())
        assert got.mean == pytest.approx(true_speedup(truth, tree, "humaneval", 8), rel=0.015)


def test_a_launchs_time_is_when_it_started_not_when_it_finished(tmp_path):
    """Two workers: launches finish out of the order they began. The planner keeps them in
    finish order, the stored study in begin order; the trend is judged by when each
    started, so both read the same slope and every speedup alike."""
    spec, planner, _, _ = drifting_study(tmp_path, DRIFT, Noise(0.005, 0.005))
    begun = [dataclasses.replace(r, started_at=100.0 + 10 * k)
             for k, r in enumerate(planner.launched)]
    finished = list(begun)
    for k in range(2, len(finished) - 1, 2):  # each pair finishes the other way round
        finished[k], finished[k + 1] = finished[k + 1], finished[k]
    assert places(finished) != list(range(len(finished)))
    one, trend = leveled_launches(begun, spec.search.launch_cv)
    other, again = leveled_launches(finished, spec.search.launch_cv)
    assert trend is not None and again is not None
    assert again.slope == pytest.approx(trend.slope) and again.se == pytest.approx(trend.se)
    assert merge_all(one)["baseline"].cells[0].output_tok_s == pytest.approx(
        merge_all(other)["baseline"].cells[0].output_tok_s)


def test_the_learned_noise_a_refit_reads_follows_every_launch(tmp_path):
    """The noise the model strategy's measurement variances come from is learned once per
    state of the study, and a new launch (another baseline, a tree again) is learned from
    at once: after each launch, the same variances as a planner resumed from those
    launches, which learns afresh."""
    spec, planner, truth = fresh(tmp_path)
    rng = np.random.default_rng(3)
    trees = list(load_space(spec.space).configs())[:3]
    order = [BASELINE, *trees, BASELINE, trees[0], BASELINE, trees[1]]
    seen: dict[str, int] = {}
    variances = []
    for config in order:
        key = config_key(config)
        planner.absorb(simulate_launch(truth, config, spec, rng, Noise(0.03, 0.01)),
                       seen.get(key, 0))
        seen[key] = seen.get(key, 0) + 1
        resumed = Planner(spec, planner.store, load_space(spec.space), planner.launched)
        baseline = planner.results[config_key(BASELINE)]
        for result in planner.results.values():
            for dataset in spec.dataset_names:
                expected = resumed.measurement_variance(result, baseline, 1, dataset)
                assert planner.measurement_variance(result, baseline, 1, dataset) == expected
        variances.append(planner.measurement_variance(baseline, baseline, 1,
                                                      spec.dataset_names[0]))
    assert len(set(variances)) >= 3, variances
