"""Model-guided search, noise-aware feasibility and re-measurement, on launches evaluated
in-process from a profile (the planner, strategies and recommendations are the real ones)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np
import optuna
import pytest
from scipy import stats

from treetune.config import BASELINE, TreeConfig
from treetune.perfmodel import PerfModel, Profile, Shape, load_profile
from treetune.perfmodel.calibrate import get_value
from treetune.perfmodel.prior import neutral_prior
from treetune.results import CellResult, LaunchResult, config_key, launches_of
from treetune.space import load_space
from treetune.strategies import BatchStudies, Estimate, Proposal
from treetune.strategies import model as model_strategy
from treetune.strategies.model import (
    SHARED_DEPARTURE,
    ModelFit,
    accept_misfit,
    departure,
    model_estimates,
    predicted_speedups,
    speedup_misfit,
)
from treetune.study.evidence import (
    PRIOR_LAUNCHES,
    QUIET_MIX,
    StudyNoise,
    Verdict,
    doubted,
    intervals,
    judge,
    learned_cv,
    merge,
    merge_all,
    proof_outlook,
    proof_reach,
)
from treetune.study.offline import Noise, run_offline, simulate_launch
from treetune.study.planner import (
    DEFER_GAIN,
    DEFER_MAX,
    RACE_MARGIN,
    THIN_BASELINE_LIMITS,
    THIN_SDS,
    UNRECOMMENDED_LAUNCHES,
    Planner,
    Task,
)
from treetune.study.recommend import recommend
from treetune.study.spec import StudySpec, load_study
from treetune.study.storage import StudyStore
from treetune.worlds import load_world

DESIGN = [(5, 1, 6), (3, 8, 24), (2, 4, 9), (4, 8, 64), (3, 2, 8), (1, 1, 2), (6, 2, 12),
          (2, 8, 16), (7, 1, 8), (3, 4, 8), (4, 3, 15)]


def study(profile: str, **over):
    prof = load_profile(profile)
    return load_study(None, {
        "name": "g", "model": "m", "draft": "d", "tp": prof.tp, "datasets": list(prof.datasets),
        "batch": [1, 32], "space": "default", "budget": {"launches": 30},
        "backend": {"kind": "emulator", "profile": profile}, **over})


def representable(name: str):
    """The profile with what the online model fixes set to its fixed values: no measured
    per-position top-1, KV bandwidth efficiency at the neutral 0.5."""
    truth = load_profile(name)
    datasets = {k: dataclasses.replace(v, acceptance=dataclasses.replace(
        v.acceptance, top1_by_position=None)) for k, v in truth.datasets.items()}
    return truth.replace(datasets=datasets, calibration=dataclasses.replace(
        truth.calibration, kv_bandwidth_eff=0.5))


def fit_to_launches(name: str, design: list[tuple[int, int, int]], noise: Noise | None = None,
                    seed: int = 0):
    """The profile's representable truth, and a fit from its neutral prior to launches of
    the baseline and of `design`'s trees at batch 1 and 32 (noise-free unless `noise`)."""
    truth = representable(name)
    return truth, fit_of(PerfModel(truth, truth.tp), truth, study(name), design, noise, seed)


def fit_of(model: PerfModel, profile: Profile, spec: StudySpec,
           design: list[tuple[int, int, int]],
           noise: Noise | None = None, seed: int = 0) -> ModelFit:
    """A fit from `profile`'s neutral prior to launches on `model` of the baseline and of
    `design`'s trees at batch 1 and 32 (noise-free unless `noise`)."""
    rng, noise = np.random.default_rng(seed), noise or Noise(0, 0, 0)
    baseline = simulate_launch(model, BASELINE, spec, rng, noise)
    trees = [simulate_launch(model, TreeConfig.of(*t), spec, rng, noise) for t in design]
    fit = ModelFit(neutral_prior(profile, spec.dataset_names), [1, 32], spec.dataset_names,
                   profile.tp)
    fit.update(trees, baseline)
    return fit


@pytest.mark.parametrize("name", ["qwen3-8b-h100", "qwen3-30b-a3b-h100"])
def test_without_noise_the_fit_recovers_the_acceptance_and_every_trees_speedup(name):
    """Eight trees measured without noise: the fit finds the acceptance within 1% and
    predicts every tree of the space within 1%. The fit assumes the noise a study has
    (SPEEDUP_CV, ACCEPT_CV), so calibrate's pull toward the prior holds the cost
    parameters these speedups hardly see a little toward the prior (the 30B's context
    lengths up to 18% off, the 8B's step overhead 6%), within 20% of the truth."""
    truth, fit = fit_to_launches(name, DESIGN)
    assert len(fit.params) >= 20
    assert not fit.shared_fit, "the accept lengths fit: the prior's rank ratio serves"
    for param in fit.params:
        true, fitted = get_value(truth, param.name), fit.result.parameters[param.name]
        start = get_value(fit.prior, param.name)
        if true == 0:
            assert abs(fitted) <= 0.005, param.name
        else:
            within = 0.01 if ".acceptance." in param.name else 0.2
            assert abs(fitted / true - 1) <= within, (param.name, true, fitted, start)
    configs = load_space("default").configs()
    true_speedups = predicted_speedups(truth, configs, [1, 32], fit.datasets, truth.tp)
    fitted_speedups = predicted_speedups(fit.result.profile, configs, [1, 32], fit.datasets,
                                         truth.tp)
    assert max(abs(math.log(f / t)) for c in configs for b in (1, 32)
               for f, t in zip(fitted_speedups[c][b], true_speedups[c][b], strict=True)) < 0.01


@pytest.mark.parametrize("across", [True, False])
def test_a_fit_stuck_on_the_flat_side_of_the_roofline_is_refitted_from_across_it(
        across, monkeypatch):
    """The 30B's truth has a compute efficiency of 0.12; the prior starts at 0.5, where
    none of these trees' forwards is compute-bound, so the fit's cost does not move with
    it and a fit from the prior stays there, its speedups off by more than their noise
    (launch by launch; without noise in the data). That gives it away, and a second start
    across the roofline finds the truth (calibrate's pull toward the prior holds it
    within 10%: see the test above)."""
    import treetune.strategies.model as model_search

    threshold = model_search.SPEEDUP_MISFIT
    if not across:  # the premise: without the second start, the fit stays stuck
        monkeypatch.setattr(model_search, "ACCEPT_MISFIT", float("inf"))
        monkeypatch.setattr(model_search, "SPEEDUP_MISFIT", float("inf"))
    _truth, fit = fit_to_launches("qwen3-30b-a3b-h100", [(3, 1, 4), (3, 4, 12), (4, 6, 40)])
    assert fit.prior.calibration.compute_eff == 0.5
    fitted = fit.result.profile.calibration.compute_eff
    if across:
        assert fitted == pytest.approx(0.12, rel=0.1)
        assert accept_misfit(fit.result) < 1
        assert speedup_misfit(fit.result) < 0.1
    else:
        assert fitted == pytest.approx(0.5, rel=0.05)
        assert speedup_misfit(fit.result) > threshold


@pytest.mark.parametrize("bounded", [True, False])
def test_verify_cliffs_of_small_trees_are_not_fitted_as_a_per_token_cost_without_end(
        bounded, tmp_path, monkeypatch):
    """drawn-2028-04 (`drawn_worlds.py --new-bases --seed 2028`): GLM-4.5-Air on 8 x L40S,
    its verify slower by 5.9% at each of 12, 24, 40, 80, 160 and 320 tokens. Fitted from
    the neutral prior to the small trees a traced study measured (at most 12 tokens; here
    without noise), the fit once explained those cliffs by a per-token cost of about 190
    us, which grows on where the cliffs stop: it put the best batch-32 tree, (6,6,36) at
    1.52x in truth, near 1.0x, and the study never launched it. Held to twice the largest
    per-token cost of the shipped profiles (15 us), the fit may err high there (a launch
    tells), not so low that no draw proposes it."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import drawn_worlds
    import search_efficiency

    from treetune.perfmodel import calibrate

    if not bounded:  # the premise: free up to 500 us, the fit hides the wide trees
        monkeypatch.setitem(calibrate.CALIBRATION_BOUNDS, "token_overhead_us",
                            (0.001, 500.0, True))
    path = str(drawn_worlds.write_world(4, 2028, True, tmp_path))
    world = load_world(path)
    spec = search_efficiency.study_spec(path, "model", 0, 30, 0.03, (1, 32))
    fit = fit_of(world.model(world.profile.tp), world.profile, spec,
                 [(3, 1, 4), (3, 4, 12), (4, 2, 6), (3, 2, 5), (3, 2, 4), (2, 1, 3), (4, 2, 5)])
    table, _ = search_efficiency.truth_table(world, (1, 32), "EAGLE3")
    best = max(table, key=lambda c: statistics.fmean(table[c][32]))
    assert best == TreeConfig(6, 6, 36)
    fitted = predicted_speedups(fit.profile, [best], [1, 32], spec.dataset_names,
                                world.profile.tp)
    ratio = statistics.fmean(fitted[best][32]) / statistics.fmean(table[best][32])
    overhead = fit.profile.calibration.token_overhead_us
    if bounded:
        assert ratio > 0.95, (ratio, overhead)
    else:
        assert overhead > 100 and ratio < 0.75, (ratio, overhead)


@pytest.mark.parametrize("weighed", [True, False])
def test_the_fit_weighs_accept_lengths_by_their_noise_against_the_speedups(weighed,
                                                                          monkeypatch):
    """A cell's accept length is measured to 1%, its speedup to about 3% a launch: weighed
    by their noise, the fit explains the accept lengths to their noise and finds the
    acceptance's decay with depth. Weighed as calibrate's default weighs them (a speedup's
    log error 3 times an accept length's relative error), the speedups' noise is fitted with
    the acceptance (the 30B, three trees measured, eight noisy studies)."""
    if not weighed:
        monkeypatch.setattr(model_strategy, "SPEEDUP_WEIGHT", 3.0)
    misfits, decay_errors = [], []
    for seed in range(8):
        truth, fit = fit_to_launches("qwen3-30b-a3b-h100", [(3, 1, 4), (3, 4, 12), (5, 6, 47)],
                                     Noise(), seed)
        misfits.append(accept_misfit(fit.result))
        name = "datasets.{}.acceptance.top1_decay"
        decay_errors.append(max(abs(get_value(fit.result.profile, name.format(d))
                                    - get_value(truth, name.format(d)))
                                for d in fit.datasets))
    if weighed:
        assert statistics.fmean(misfits) < 1
        assert statistics.fmean(decay_errors) < 0.15
    else:
        assert statistics.fmean(misfits) > 2
        assert statistics.fmean(decay_errors) > 0.2


def test_the_model_estimates_of_measured_trees_sit_on_the_fit_not_off_it():
    """Five trees measured in a world the model's acceptance form cannot follow: the fit
    matches their measured speedups on average (its residual mean is about 0), and the
    estimates the ranking blends with the measurements must too. The mean of posterior
    draws did not: a parameter the data hardly determine is drawn across its bounds and
    clipped there, and the draws' mean sat 12% below both the fit and the measurements."""
    world = load_world("acceptance-shape")
    truth = world.model(world.profile.tp)
    spec = study("qwen3-8b-h100", backend={"kind": "emulator", "world": "acceptance-shape"})
    planner = run_offline(spec, truth, seed=1, launches=8, noise=Noise(0.03, 0.03, 0.01))
    results, baseline = planner.evidence()
    trees = [r for r in results if r.ok and isinstance(r.config, TreeConfig)]
    fit = planner.strategy.fit
    estimates = model_estimates(fit, [r.config for r in trees], np.random.default_rng(0))
    shifts = [estimates[r.config, b, d].log_mean
              - np.log(r.cell(d, b).output_tok_s / baseline.cell(d, b).output_tok_s)
              for r in trees for b in fit.batches for d in fit.datasets]
    assert len(trees) >= 5
    assert abs(statistics.fmean(shifts)) <= 0.02, statistics.fmean(shifts)


def test_in_process_launches_serve_fixed_length_requests_whole_and_open_loop_cells():
    """A fixed-length dataset (synthetic prompts, every answer as long) is served in-process
    as the emulator serves it: whole requests, prefill and turnover included, and its rate
    cells as an open loop; a dataset of the profile's own lengths stays the steady state
    of decoding."""
    profile = load_profile("qwen3-30b-a3b-h100")
    model = PerfModel(profile, profile.tp)
    spec = load_study(None, {
        "name": "w", "model": "m", "draft": "d", "batch": [8, 64], "rates": [8],
        "datasets": [{"name": "mt-bench", "prompt_tokens": 1024, "output_tokens": 128},
                     "humaneval"],
        "backend": {"kind": "emulator", "profile": "qwen3-30b-a3b-h100"}})
    tree, shape = TreeConfig(3, 1, 4), Shape(1024, 128)
    result = simulate_launch(model, tree, spec, np.random.default_rng(0), Noise(0, 0, 0))
    for batch in (8, 64):
        served = model.closed_loop(tree, "mt-bench", shape, batch, 64)
        cell = result.cell("mt-bench", batch)
        assert cell.output_tok_s == pytest.approx(served.output_tok_s)
        assert cell.tpot.p50 == pytest.approx(served.tpot_s)
        # Whole requests pay the 1024-token prefills: below the steady state of decoding.
        assert cell.output_tok_s < 0.9 * model.throughput(tree, batch, "mt-bench")
        assert result.cell("humaneval", batch).output_tok_s == pytest.approx(
            model.throughput(tree, batch, "humaneval"))
    [rate_cell] = result.rate_cells
    opened = model.open_loop(tree, "mt-bench", shape, 8, 64)
    assert (rate_cell.dataset, rate_cell.rate) == ("mt-bench", 8)
    assert rate_cell.tpot.p99 == pytest.approx(opened.tpot_s)
    assert rate_cell.output_tok_s == pytest.approx(8 * 128)


def test_the_neutral_prior_keeps_facts_and_forgets_every_fitted_value():
    truth = load_profile("qwen3-coder-next-h200")
    prior = neutral_prior(truth, list(truth.datasets))
    assert prior.hardware == truth.hardware and prior.target == truth.target
    assert prior.calibration != truth.calibration
    for name, data in prior.datasets.items():
        assert data.acceptance != truth.datasets[name].acceptance
        assert data.output_tokens == truth.datasets[name].output_tokens


def true_speedups(profile, config, batch):
    model = PerfModel(profile, profile.tp)
    return [model.throughput(config, batch, d) / model.throughput(BASELINE, batch, d)
            for d in profile.datasets]


def test_the_model_search_finds_near_best_trees_in_a_few_launches():
    name = "qwen3-coder-next-h200"
    truth = load_profile(name)
    spec = study(name)
    planner = run_offline(spec, PerfModel(truth, truth.tp), seed=1, launches=12,
                          noise=Noise(0.03, 0.03))
    assert planner.strategy_name == "model"  # auto, on the emulator: its facts are known
    recs = recommend(spec, list(planner.results.values()), planner.baseline,
                     planner.estimates())
    # Best feasible means from the noise-free model over the default space: (2,4,9) 1.456
    # at batch 1 and (2,1,3) 1.268 at batch 32 (see test_perfmodel).
    best = {1: 1.4557, 32: 1.2684}
    for rec in (r for r in recs if r.workload == "mixed"):
        assert isinstance(rec.config, TreeConfig), rec.reason
        mean = statistics.fmean(true_speedups(truth, rec.config, rec.batch))
        assert mean >= 0.98 * best[rec.batch], (rec.batch, rec.config, mean)
        assert min(true_speedups(truth, rec.config, rec.batch)) >= 1.0
        assert all(lo <= s <= hi for (lo, hi), s in zip(rec.intervals.values(),
                                                        rec.speedups.values(), strict=True))


def test_a_proposal_draws_the_posterior_tempered_near_the_fits_best_yet_varied(monkeypatch):
    # Four launches of the 30B: the fit's posterior still spreads over the near twins at
    # the top. Proposals from whole draws wander over them; tempered ones (DRAW_INFLATE)
    # stay nearer the tree the fit expects best, and still differ from draw to draw.
    name = "qwen3-30b-a3b-h100"
    truth = load_profile(name)
    planner = run_offline(study(name), PerfModel(truth, truth.tp), seed=0, launches=4,
                          noise=Noise(0.03, 0.03))
    strategy = planner.strategy
    monkeypatch.setattr(model_strategy, "EXPLORE", 0.0)
    monkeypatch.setattr(model_strategy, "EXPLORE_MISFIT", 0.0)
    untried = [c for c in strategy.candidates if not planner.is_known(config_key(c))]
    fit = strategy.fit
    table = predicted_speedups(fit.profile, untried, fit.batches, fit.datasets, fit.tp)
    best = {b: max(statistics.fmean(v[b]) for v in table.values()) for b in fit.batches}

    def proposals(inflate: float) -> tuple[float, set[TreeConfig]]:
        """The mean share of the fit's best that 12 proposals reach, and which they are."""
        monkeypatch.setattr(model_strategy, "DRAW_INFLATE", inflate)
        reach, picks = [], set()
        for draw in range(12):
            strategy.rng = np.random.default_rng(draw)
            config = strategy.propose().config
            picks.add(config)
            reach.append(max(statistics.fmean(table[config][b]) / best[b] for b in best))
        return statistics.fmean(reach), picks

    shipped = model_strategy.DRAW_INFLATE
    assert shipped < 1.0
    whole, tempered = proposals(1.0), proposals(shipped)
    assert tempered[0] > whole[0], (tempered, whole)
    assert 2 <= len(tempered[1]) < len(whole[1]), (tempered[1], whole[1])


def cell(dataset, batch, tput, repeats=()):
    return CellResult(dataset, batch, tput, None, 10, 100, 1.0, None, None,
                      repeats=tuple(repeats))


def launch(config, tput, repeats=()):
    return LaunchResult(config, ok=True, cells=[cell("humaneval", 1, tput, repeats)])


def remeasures(planner: Planner, *steps: tuple[object, LaunchResult]) -> None:
    """The planner's next launches re-measure these configs in this order; each is
    finished with the given result."""
    for config, result in steps:
        task = planner.next()
        assert task is not None and task.remeasure and task.config == config, task
        planner.finish(task, result)


def test_repeated_launches_merge_and_narrow_the_interval():
    spec = load_study(None, {"name": "i", "model": "m", "draft": "d", "datasets": ["humaneval"],
                             "batch": [1]})
    tree = TreeConfig(3, 4, 8)
    base = launch(BASELINE, 100.0, (99, 100, 101))
    one = launch(tree, 103.0, (102, 103, 104))
    three = merge([one, launch(tree, 101.0, (100, 101, 102)), launch(tree, 102.0, (101, 102, 103))])
    assert three.cells[0].launch_tok_s == (103.0, 101.0, 102.0)
    assert three.cells[0].output_tok_s == pytest.approx(102.0)
    wide = intervals(one, base, 1, ["humaneval"], StudyNoise.prior(0.03))["humaneval"]
    narrow = intervals(three, base, 1, ["humaneval"], StudyNoise.prior(0.03))["humaneval"]
    assert wide.low < 1.0 < wide.mean, "one launch 3% faster is not surely faster"
    assert narrow.high - narrow.low < wide.high - wide.low
    # Recommended only when the lower bound clears 1: not on one launch.
    recs = recommend(spec, [base, one], base)
    assert recs[0].config is BASELINE and "lower bound" in recs[0].reason


def test_a_spread_learned_from_few_launches_widens_the_interval_as_student_t_does():
    from scipy import stats

    from treetune.study.evidence import Z_INTERVAL

    tree = TreeConfig(3, 4, 8)
    base, one = launch(BASELINE, 100.0, (100, 100, 100)), launch(tree, 120.0, (120, 120, 120))

    def reach(noise):
        iv = intervals(one, base, 1, ["humaneval"], noise)["humaneval"]
        return np.log(iv.high / iv.mean)

    sd = 0.03 * np.sqrt(2)
    # Known exactly (a study that never re-launches): the normal quantile.
    assert reach(StudyNoise.prior(0.03, learned=False)) == pytest.approx(Z_INTERVAL * sd)
    # Two degrees of freedom (the prior's alone), then eight more from re-launches: the
    # Student-t reach at the 95% level, narrowing toward the normal one.
    few, many = reach(StudyNoise(0.03)), reach(StudyNoise(0.03, launch_dof=8))
    assert few == pytest.approx(stats.t.ppf(0.975, 2) * sd, rel=1e-3)
    assert many == pytest.approx(stats.t.ppf(0.975, 10) * sd, rel=1e-3)
    assert Z_INTERVAL * sd < many < few


def test_the_ranking_weighs_a_measurement_by_its_own_error_not_the_baselines():
    """The baseline's error moves every tree's speedup alike: it does not make a
    measurement less telling of the trees' order against the model's estimate."""
    from treetune.study.evidence import judge

    tree = TreeConfig(3, 4, 8)
    one = launch(tree, 120.0, (120, 120, 120))
    noise = StudyNoise.prior(0.03, learned=False)  # each launch 3%, known exactly
    estimates = {(tree, 1, "humaneval"): Estimate(float(np.log(1.10)), 0.03 ** 2, 0.03 ** 2)}

    def rank(base):
        return judge(one, base, 1, ["humaneval"], 0.0, noise, estimates).rank

    once = launch(BASELINE, 100.0, (100, 100, 100))
    many = merge([launch(BASELINE, 100.0, (100, 100, 100)) for _ in range(4)])
    # As sure of the tree as the model is: the geometric middle of 1.20 and 1.10, however
    # often the baseline was measured (the interval itself does narrow with it).
    assert rank(once) == pytest.approx(np.sqrt(1.20 * 1.10))
    assert rank(many) == pytest.approx(rank(once))
    wide = intervals(one, once, 1, ["humaneval"], noise)["humaneval"]
    narrow = intervals(one, many, 1, ["humaneval"], noise)["humaneval"]
    assert narrow.high - narrow.low < wide.high - wide.low


def test_near_twins_are_ordered_by_the_models_own_error_not_its_level():
    """Two near twins: the model, pooling every launch, puts the one measured once 0.6%
    above the one measured three times 3% higher. Its estimates are uncertain by 1.4%,
    but most of that moves both alike (its level); what orders them is the rest. Weighed
    by the whole variance, three lucky launches outvote the model (a traced 30B study
    recommended (3,2,9), truly 1.1% below (3,2,7), for 16 launches so)."""
    twin, lucky = TreeConfig(3, 2, 7), TreeConfig(3, 2, 9)
    base = launch(BASELINE, 100.0, (100, 100, 100))
    noise = StudyNoise.prior(0.026, learned=False)
    once = launch(twin, 160.0, (160, 160, 160))
    thrice = merge([launch(lucky, 165.0, (165, 165, 165)) for _ in range(3)])

    def ranks(rank_sd):
        estimates = {(twin, 1, "humaneval"): Estimate(math.log(1.606), 0.014 ** 2, rank_sd ** 2),
                     (lucky, 1, "humaneval"): Estimate(math.log(1.596), 0.014 ** 2, rank_sd ** 2)}
        return [judge(r, base, 1, ["humaneval"], 0.0, noise, estimates).rank
                for r in (once, thrice)]

    own, whole = ranks(0.004), ranks(0.014)
    assert own[0] > own[1]
    assert whole[0] < whole[1]
    # The model's own error weighed: the ranks sit near its estimates.
    assert own == pytest.approx([1.606, 1.596], rel=0.004)


def test_a_model_whose_trees_sit_off_it_beyond_the_noise_is_doubted_in_the_ranks():
    """Six chains measured at 1% launch noise. A model that puts them where they were
    measured, but 5% higher, shares that with every tree: not doubted. One whose trees
    sit 6% either side of it is: their rank variance grows by about that spread squared,
    and the ranks follow the measurements again. A tree never measured is left alone."""
    base = merge([launch(BASELINE, 100.0, (100, 100, 100)) for _ in range(2)])
    measured = {TreeConfig(s, 1, s + 1): 100.0 + 4 * s for s in range(1, 7)}
    results = [launch(c, t, (t, t, t)) for c, t in measured.items()]
    noise = StudyNoise.prior(0.01, learned=False)
    never = TreeConfig(7, 1, 8)

    def estimates(offset):
        out = {(c, 1, "humaneval"): Estimate(math.log(t / 100.0) + offset(c.steps), 0.02 ** 2,
                                             0.002 ** 2) for c, t in measured.items()}
        return {**out, (never, 1, "humaneval"): Estimate(0.1, 0.02 ** 2, 0.002 ** 2)}

    level = doubted(estimates(lambda s: 0.05), results, base, noise)
    assert all(e.rank_variance == 0.002 ** 2 for e in level.values())
    zigzag = doubted(estimates(lambda s: 0.06 * (-1) ** s), results, base, noise)
    for (config, _, _), e in zigzag.items():
        if config == never:
            assert e.rank_variance == 0.002 ** 2
        else:
            assert 0.04 ** 2 < e.rank_variance < 0.08 ** 2
    ranks = {c: judge(r, base, 1, ["humaneval"], 0.0, noise, zigzag).rank
             for c, r in zip(measured, results, strict=True)}
    assert sorted(ranks, key=ranks.get) == list(measured)  # the measured order
    trusted = {c: judge(r, base, 1, ["humaneval"], 0.0, noise,
                        estimates(lambda s: 0.06 * (-1) ** s)).rank
               for c, r in zip(measured, results, strict=True)}
    assert sorted(trusted, key=trusted.get) != list(measured)


def test_the_model_s_rank_variance_leaves_out_what_moves_every_tree_alike():
    """The 30B's own profile, ten launches at 3% noise: the estimates of the measured
    trees share most of their posterior spread (the draws move every speedup together),
    so each tree's rank variance is well below its variance; alone, a tree has nothing
    to share it with. (Ten, not eight: with today's NumPy and SciPy the eighth launch of
    seed 6 re-measures, leaving four trees; ten give six, their mean rank variance 0.30
    of the variance, seeds 0-2 0.09-0.18.)"""
    spec = study("qwen3-30b-a3b-h100")
    truth = PerfModel(representable("qwen3-30b-a3b-h100"), spec.tp)
    planner = run_offline(spec, truth, seed=6, launches=10, noise=Noise(0.03, 0.03))
    trees = [r.config for r in planner.results.values()
             if r.ok and isinstance(r.config, TreeConfig)]
    estimates = model_estimates(planner.strategy.fit, trees, np.random.default_rng(0))
    assert len(trees) >= 5
    assert all(e.rank_variance <= e.variance for e in estimates.values())
    at_1 = [e for (c, b, d), e in estimates.items() if b == 1]
    assert (statistics.fmean(e.rank_variance for e in at_1)
            < 0.5 * statistics.fmean(e.variance for e in at_1))
    alone = model_estimates(planner.strategy.fit, trees[:1], np.random.default_rng(0))
    assert all(e.rank_variance == e.variance for e in alone.values())


def test_a_borderline_best_config_is_re_measured_before_new_proposals():
    spec = load_study(None, {"name": "b", "model": "m", "draft": "d", "datasets": ["humaneval"],
                             "batch": [1], "space": "narrow", "search": {"strategy": "tpe"}})
    store = StudyStore(spec, storage=optuna.storages.InMemoryStorage())
    chain, clear = TreeConfig(3, 1, 4), TreeConfig(2, 1, 3)
    base = launch(BASELINE, 100.0, (99, 100, 101))
    planner = Planner(spec, store, load_space("narrow"),
                      [base, launch(clear, 90.0), launch(chain, 110.0, (109, 110, 111))])
    # (3,1,4) looks 10% faster, which one launch (under a 3% launch noise only assumed, not
    # yet measured) cannot tell from noise; (2,1,3) is surely slower. The baseline, whose
    # noise moves every speedup, is re-measured first.
    remeasures(planner, (BASELINE, launch(BASELINE, 100.5, (100, 100, 101))),
               (chain, launch(chain, 110.5, (110, 110, 111))))
    assert planner.results["3,1,4"].cells[0].launch_tok_s == (110.0, 110.5)
    # Up to max_launches_per_config (3) launches, then new configs are proposed.
    tasks = [planner.next() for _ in range(3)]
    assert any(t and not t.remeasure for t in tasks)
    recs = recommend(spec, list(planner.results.values()), planner.baseline)
    assert recs[0].config == chain and recs[0].intervals["humaneval"][0] >= 1.0


def test_grid_and_random_strategies_launch_each_config_once(tmp_path):
    name = "qwen3-8b-h100"
    truth = load_profile(name)
    for strategy in ("grid", "random"):
        spec = study(name, search={"strategy": strategy, "max_launches_per_config": 1},
                     space="narrow")
        planner = run_offline(spec, PerfModel(truth, truth.tp), seed=0, launches=20)
        keys = [r.config for r in planner.launched]
        assert len(keys) == len(set(keys)) == 9  # the baseline and narrow's 8 chains


def one_dataset_study(**over):
    return load_study(None, {"name": "c", "model": "m", "draft": "d", "datasets": ["humaneval"],
                             "batch": [1], "space": "narrow", "search": {"strategy": "tpe"},
                             **over})


def test_a_tree_feasible_on_one_launch_is_confirmed_by_a_second_before_it_is_recommended():
    spec = one_dataset_study()
    chain = TreeConfig(3, 1, 4)
    base = launch(BASELINE, 100.0, (99.8, 100, 100.2))
    # 10%: likely faster, but one launch under a 3% launch noise that is only assumed (no
    # repeat has measured it: its Student-t bound reaches far) is not enough.
    lucky = launch(chain, 110.0, (109.8, 110, 110.2))
    assert intervals(lucky, base, 1, ["humaneval"], StudyNoise.prior(0.03))["humaneval"].mean > 1.05
    recs = recommend(spec, [base, lucky], base)
    assert recs[0].config is BASELINE and "99% lower bound" in recs[0].reason
    planner = Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                      load_space("narrow"), [base, lucky])
    # The baseline first: its noise moves every speedup.
    remeasures(planner, (BASELINE, launch(BASELINE, 100.2, (100, 100.2, 100.4))),
               (chain, launch(chain, 109.0, (108.8, 109, 109.2))))
    recs = recommend(spec, list(planner.results.values()), planner.baseline)
    assert recs[0].config == chain


def test_when_no_tree_serves_every_dataset_each_datasets_own_leader_is_confirmed():
    """A tree 10% faster on humaneval regresses mt-bench by 20%: no tree is even plausible
    for the mixed workload, so what a humaneval-only server would run is confirmed
    instead (the baseline first), and then recommended for humaneval. Before, confirmations
    served the mixed workload alone and this one was never made (the single-H100
    scenarios: 30 launches, no per-scenario tree confirmed)."""
    spec = one_dataset_study(datasets=["humaneval", "mt-bench"])
    chain = TreeConfig(3, 1, 4)

    def two(config, humaneval, mt_bench):
        return LaunchResult(config, ok=True, cells=[
            cell("humaneval", 1, humaneval, (humaneval - 0.2, humaneval, humaneval + 0.2)),
            cell("mt-bench", 1, mt_bench, (mt_bench - 0.2, mt_bench, mt_bench + 0.2))])

    base, tree = two(BASELINE, 100.0, 100.0), two(chain, 110.0, 80.0)
    planner = Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                      load_space("narrow"), [base, tree])
    assert [r.config for r in recommend(spec, [base, tree], base)
            if r.workload == "humaneval"] == [BASELINE]
    remeasures(planner, (BASELINE, two(BASELINE, 100.2, 100.1)),
               (chain, two(chain, 109.0, 80.5)))
    recs = recommend(spec, list(planner.results.values()), planner.baseline)
    assert {r.workload: r.config for r in recs} == {"mixed": BASELINE, "humaneval": chain,
                                                    "mt-bench": BASELINE}


class Forecaster:
    """A strategy that proposes the narrow space's chains in turn with a fixed forecast."""

    def __init__(self, gain):
        self.gain, self.chains = gain, iter([TreeConfig(2, 1, 3), TreeConfig(4, 1, 5),
                                             TreeConfig(5, 1, 6), TreeConfig(1, 1, 2)])

    def propose(self):
        return Proposal(next(self.chains), gain=self.gain)

    def observe(self, result, baseline):
        pass

    def estimates(self, configs):
        return None


def forecasting_planner(gain, budget=30):
    """A planner holding one tree feasible on one launch, whose strategy forecasts `gain`."""
    spec = one_dataset_study(budget={"launches": budget})
    base = launch(BASELINE, 100.0, (99.8, 100, 100.2))
    lucky = launch(TreeConfig(3, 1, 4), 110.0, (109.8, 110, 110.2))
    planner = Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                      load_space("narrow"), [base, lucky])
    planner.strategy_name, planner.strategy = "model", Forecaster(gain)  # it forecasts
    return planner


def kinds(planner, n):
    out = []
    for _ in range(n):
        task = planner.next()
        assert task is not None
        out.append("re" if task.remeasure else "new")
        planner.finish(task, launch(task.config, 105.0, (104.8, 105, 105.2)))
    return out


def test_a_confirmation_waits_for_a_proposal_forecast_to_gain_much_more_but_not_for_long():
    # Forecast 10% above the best measured tree: new trees first, DEFER_MAX in a row.
    assert kinds(forecasting_planner(1.10), DEFER_MAX + 2) == ["new"] * DEFER_MAX + ["re", "new"]
    assert DEFER_GAIN < 1.10
    # A smaller forecast: the confirmation (the baseline first) comes first.
    assert kinds(forecasting_planner(DEFER_GAIN - 0.01), 2) == ["re", "re"]
    # No forecast (a random or initial-design draw): the confirmation, then the proposal.
    assert kinds(forecasting_planner(None), 2) == ["re", "new"]
    # With only the confirmation's launches left in the budget (the baseline's and the
    # tree's), nothing waits.
    assert kinds(forecasting_planner(1.10, budget=4), 1) == ["re"]


def test_a_tree_far_above_the_floor_needs_no_second_launch():
    spec = one_dataset_study()
    base = launch(BASELINE, 100.0, (99.8, 100, 100.2))
    # Twice the feasibility bound's reach under the assumed, not yet measured, noise.
    clear = launch(TreeConfig(3, 1, 4), 180.0, (179.8, 180, 180.2))
    assert recommend(spec, [base, clear], base)[0].config == TreeConfig(3, 1, 4)


def test_without_re_measurement_one_launch_is_enough():
    spec = one_dataset_study(search={"strategy": "tpe", "max_launches_per_config": 1,
                                     "launch_cv": 0.01})
    base = launch(BASELINE, 100.0, (99.8, 100, 100.2))
    lucky = launch(TreeConfig(3, 1, 4), 115.0, (114.8, 115, 115.2))
    assert recommend(spec, [base, lucky], base)[0].config == TreeConfig(3, 1, 4)
    # Never re-measured, the noise is never learned: the stated 1% is taken as exact, and
    # the one-sided 99% bound (2.326 of its standard errors, no Student-t widening) decides.
    close = launch(TreeConfig(3, 1, 4), 103.0, (102.8, 103, 103.2))
    assert recommend(spec, [base, close], base)[0].config is BASELINE
    learning = one_dataset_study(search={"strategy": "tpe", "launch_cv": 0.01})
    assert recommend(learning, [base, lucky], base)[0].config is BASELINE


def test_every_launch_of_a_config_draws_its_own_seed_and_writes_its_own_log():
    from treetune.study.worker import launch_command, log_name

    spec = load_study("studies/demo.yaml")

    def seed(index: int, attempt: int = 0) -> str:
        argv = launch_command(spec, BASELINE, (), 30000, attempt, launch_index=index)
        return argv[argv.index("--seed") + 1]

    seeds = {seed(0), seed(1), seed(2), seed(0, attempt=1)}
    assert len(seeds) == 4, "a re-measurement must not replay the first launch's speed"
    assert seed(0) == seed(0)  # reproducible
    names = {log_name("baseline", i, a) for i in range(3) for a in range(2)}
    assert len(names) == 6 and log_name("3,4,8") == "3-4-8.log"


def test_a_studys_servers_keep_no_prefix_cache_and_production_keeps_sglangs_default(
        tmp_path):
    """A cell sends each prompt many times, every cell of a server the same ones: SGLang's
    radix cache (on by default) would skip their prefills after the first cell (a helper's
    audit). The emulator, which keeps no cache, takes the flag as SGLang does."""
    from treetune.emulator.args import build_parser
    from treetune.study.export import launch_argv
    from treetune.study.recommend import recommend
    from treetune.study.worker import launch_command

    spec = load_study("studies/demo.yaml")
    argv = launch_command(spec, TreeConfig(3, 1, 4), (), 30000)
    assert argv.count("--disable-radix-cache") == 1
    assert build_parser().parse_known_args(argv[3:])[1] == []
    base = launch(BASELINE, 100.0, (99, 100, 101))
    rec = recommend(spec, [base], base)[0]
    assert "--disable-radix-cache" not in launch_argv(spec, rec)
    # Set by the user, it is theirs: in production too, and not given twice.
    mine = load_study("studies/demo.yaml", {"server_flags": {"--disable-radix-cache": None}})
    assert launch_command(mine, BASELINE, (), 30000).count("--disable-radix-cache") == 1
    assert "--disable-radix-cache" in launch_argv(mine, recommend(mine, [base], base)[0])


def test_the_planner_numbers_the_launches_of_a_config():
    spec = one_dataset_study()
    base = launch(BASELINE, 100.0, (99, 100, 101))
    chain = launch(TreeConfig(3, 1, 4), 106.0, (105, 106, 107))
    planner = Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                      load_space("narrow"), [base, chain])
    first = planner.next()
    assert first is not None and first.config is BASELINE and first.index == 1
    second = planner.next()  # while the baseline's second launch runs
    assert second is not None and second.config == TreeConfig(3, 1, 4) and second.index == 1


def test_the_study_learns_its_launch_noise_from_repeated_launches():
    from treetune.study.evidence import study_noise

    truth = load_profile("qwen3-8b-h100")
    model = PerfModel(truth, truth.tp)
    spec = study("qwen3-8b-h100")
    rng = np.random.default_rng(3)
    quiet = Noise(launch_cv=0.008, measurement_cv=0.01)  # SGLang-like: well under 1%
    configs = [BASELINE, *(TreeConfig.of(*t) for t in DESIGN[:9])]
    launches = [simulate_launch(model, c, spec, rng, quiet) for c in configs for _ in range(3)]
    merged = list(merge_all(launches).values())
    noise = study_noise(merged, prior_launch_cv=0.03)
    assert noise.launch_dof == 2 * len(configs) and noise.window_dof > 100
    assert 0.004 < noise.launch_cv < 0.014, noise  # learned, not the 3% prior
    assert noise.window_cv == pytest.approx(0.01, rel=0.25)
    # Without any repeated launch the prior stands.
    once = list(merge_all(launches[::3]).values())
    assert study_noise(once, 0.03).launch_cv == pytest.approx(0.03)
    # Learned noise narrows the intervals a fixed 3% prior would draw.
    base = merge_all(launches)["baseline"]
    tree = merge_all(launches)[config_key(configs[1])]
    learned = intervals(tree, base, 1, ["mt-bench"], noise)["mt-bench"]
    fixed = intervals(tree, base, 1, ["mt-bench"], StudyNoise.prior(0.03))["mt-bench"]
    assert learned.high - learned.low < 0.6 * (fixed.high - fixed.low)


def _held_and_learned(true_cv: float, dof: int, spread: Callable[[float, int], float],
                      draws: int = 2000) -> tuple[float, float]:
    """A launch's error against the spread `spread(ss, dof)` learned from `dof` degrees of
    freedom of a `true_cv` engine: the share of 95% Student-t intervals that hold it, and
    the median learned spread over the true one."""
    rng = np.random.default_rng(11)
    held = 0
    learned = []
    for _ in range(draws):
        cv = spread(true_cv ** 2 * rng.chisquare(dof), dof)
        learned.append(cv)
        reach = stats.t.ppf(0.975, dof + PRIOR_LAUNCHES) * cv
        held += abs(rng.normal(0.0, true_cv)) <= reach
    return held / draws, float(np.median(learned)) / true_cv


def _one_scale(ss: float, dof: int) -> float:
    """The launch spread the prior of one scale learned (before stop 58): the stated 3%
    counted as PRIOR_LAUNCHES launches of variance."""
    return math.sqrt((ss + PRIOR_LAUNCHES * 0.03 ** 2) / (dof + PRIOR_LAUNCHES))


@pytest.mark.parametrize("true_cv", [0.03, 0.05])
def test_the_learned_launch_noise_is_as_sure_as_before_on_an_engine_as_noisy_as_stated(true_cv):
    """Under the default stated 3%, on an engine as noisy as stated (or noisier), the spread
    learned from 2-8 repeated launches gives intervals that hold as often as the prior of
    one scale gave (two launches of the stated variance): the quiet scale's small weight
    does not narrow them while a few repeats cannot tell the engines apart."""
    for dof in (2, 4, 8):
        held, _ = _held_and_learned(true_cv, dof, lambda ss, d: learned_cv(ss, d, 0.03))
        before, _ = _held_and_learned(true_cv, dof, _one_scale)
        assert 0.91 <= held <= 0.99, (dof, held)
        assert held >= before - 0.01, (dof, held, before)


def test_a_quiet_engines_launch_noise_is_learned_nearer_its_own():
    """SGLang's own spread is under 1%; under the default stated 3%, the prior of one scale
    learned 1.6 times a 1% engine's spread from 8 degrees of freedom and 1.4 times from 16
    (its intervals held 99.9% and 99.5%); the mix, 1.35 and 1.1 times. It is never learned
    below a third of the stated spread (the quiet scale), so a run of agreeing launches
    cannot draw a bound narrower than a quiet engine's."""
    for dof in (8, 16):
        held, ratio = _held_and_learned(0.01, dof, lambda ss, d: learned_cv(ss, d, 0.03))
        held_before, ratio_before = _held_and_learned(0.01, dof, _one_scale)
        assert ratio <= 0.88 * ratio_before, (dof, ratio, ratio_before)
        assert 0.95 <= held < held_before, (dof, held, held_before)
    assert learned_cv(0.0, 0, 0.03) == 0.03  # nothing learned: the stated spread
    floor = QUIET_MIX[1] * 0.03
    assert learned_cv(0.0, 30, 0.03) == pytest.approx(floor)  # 30 launches alike: the floor
    assert learned_cv(30 * 0.005 ** 2, 30, 0.03) == pytest.approx(floor)


def test_a_leader_by_less_than_its_noise_is_measured_again_before_new_proposals():
    # Two trees far above the floor (each sure on one launch), the leader by 1%: of trees
    # measured once, the best-looking is likely the luckiest draw, so it is re-measured
    # (the baseline first, its second launch being the study's first measure of noise).
    spec = one_dataset_study()
    lead, close = TreeConfig(3, 1, 4), TreeConfig(2, 1, 3)
    base = launch(BASELINE, 100.0, (99.8, 100, 100.2))
    planner = Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                      load_space("narrow"), [base, launch(lead, 161.0, (160.8, 161, 161.2)),
                                             launch(close, 159.5, (159.3, 159.5, 159.7))])
    remeasures(planner, (BASELINE, launch(BASELINE, 100.1, (99.9, 100.1, 100.3))),
               (lead, launch(lead, 158.0, (157.8, 158, 158.2))))
    # Both launches of the leader now stand against one of the runner-up, and no model
    # says that one launch was unlucky: no more racing (a close race needs the model's
    # estimates in the ranks, see the next tests).
    third = planner.next()
    assert third is not None and not third.remeasure


class Estimator(Forecaster):
    """A strategy with no forecast whose model estimates these speedups at batch 1."""

    def __init__(self, speedups, variance: float = 1e-4):
        super().__init__(None)
        self.speedups = speedups
        self.variance = variance

    def estimates(self, configs):
        return {(c, 1, "humaneval"): Estimate(math.log(self.speedups[c]), self.variance,
                                              self.variance)
                for c in configs if c in self.speedups}


def tree_verdicts(planner: Planner, model: bool = False) -> dict[TreeConfig, Verdict]:
    """Each tree's verdict at batch 1 as the planner judges it (its study's tolerance and
    confirming launches; the strategy's estimates blended in when `model`): a test's
    premise."""
    assert planner.baseline is not None
    spec = planner.spec
    return {r.config: judge(r, planner.baseline, 1, ["humaneval"], spec.tolerance,
                            planner.noise(), planner.estimates() if model else None,
                            spec.search.confirming_launches)
            for r in planner.results.values() if isinstance(r.config, TreeConfig)}


@pytest.mark.parametrize("leader_tput, rival_tput, above, below, sure", [
    ((126.0, 120.0), 122.0, (1.20, 1.30), (1.30, 1.20), True),
    ((116.0, 112.0), 108.0, (1.08, 1.12), (1.12, 1.05), False)],
    ids=["feasible-on-its-launch", "not-yet-sure"])
def test_a_tree_ranked_above_the_confirmed_leader_is_confirmed_though_measured_below_it(
        leader_tput, rival_tput, above, below, sure):
    """A tree plausible on its one launch (surely feasible there, or not yet: its one-launch
    bound reaching below the floor), measured a little below the confirmed leader but
    ranked above it once the model (which pools every launch) is blended in, is launched
    again: without it the ranking could never recommend it (a traced wrong-prior study
    kept a tree 1.3% below the best for 20 launches so; a traced 397B study, a tree 0.98
    of the best on one launch not yet sure, behind the confirmed 0.96: the case the
    not-yet-sure rule was written for). Not when the model agrees with the measurements.
    The model fits four more trees as measured: one tree off it is that tree's luck, not
    the model's misfit (`doubted`)."""
    spec = one_dataset_study()
    leader, rival = TreeConfig(3, 1, 4), TreeConfig(1, 1, 2)
    fitting = {TreeConfig(s, 1, s + 1): t for s, t in ((2, 106.0), (4, 104.0), (5, 100.0),
                                                       (6, 96.0))}
    launches = [launch(BASELINE, 100.0, (99.8, 100, 100.2)),
                launch(BASELINE, 104.0, (103.8, 104, 104.2)),
                *(launch(leader, t, (t - 0.2, t, t + 0.2)) for t in leader_tput),
                launch(rival, rival_tput, (rival_tput - 0.2, rival_tput, rival_tput + 0.2)),
                *(launch(c, t, (t - 0.2, t, t + 0.2)) for c, t in fitting.items())]

    def first_task(speedups):
        """The first launch after the leader's own: where its margin is thin (the
        not-yet-sure case), its baseline and then itself come first, left running here."""
        planner = planned()
        planner.strategy = Estimator({**dict(zip((leader, rival), speedups, strict=True)),
                                      **{c: t / 102.0 for c, t in fitting.items()}})
        task = planner.next()
        while task is not None and task.thin:
            assert task.config in (BASELINE, leader)
            task = planner.next()
        assert task is not None
        return task

    def planned():
        return Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                       load_space("narrow"), launches)

    planner = planned()
    verdicts = tree_verdicts(planner)
    # The premise.
    assert verdicts[leader].confirmed and verdicts[rival].plausible
    assert verdicts[rival].feasible == sure
    assert not verdicts[rival].confirmed and verdicts[rival].mean < verdicts[leader].mean
    task = first_task(above)
    assert task.remeasure and task.config == rival
    # The model agrees with the measurements: the rival is not launched again.
    assert first_task(below).config != rival


def test_a_runner_up_measured_low_once_is_measured_again_while_within_the_errors():
    """The loser's curse, the winner's mirror: a runner-up sure of its feasibility on one
    launch measured below the model's estimate, behind a leader confirmed on two by less
    than their ranks' errors, is launched once more; the order would otherwise rest on its
    one unlucky launch (a traced study kept a tree 5% below the best at batch 32 for 25
    launches so). Not when it is far behind, nor when the model sees no bad luck."""
    spec = one_dataset_study()
    leader, runner_up = TreeConfig(3, 1, 4), TreeConfig(2, 1, 3)

    def first_task(runner_up_throughput: float, estimated: float) -> Task:
        launches = [launch(BASELINE, 100.0, (99.8, 100, 100.2)),
                    launch(BASELINE, 103.0, (102.8, 103, 103.2)),
                    launch(leader, 193.0, (192.8, 193, 193.2)),
                    launch(leader, 189.0, (188.8, 189, 189.2)),
                    launch(runner_up, runner_up_throughput,
                           tuple(runner_up_throughput + d for d in (-0.2, 0.0, 0.2)))]
        planner = Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                          load_space("narrow"), launches)
        planner.strategy = Estimator({leader: 1.88, runner_up: estimated}, variance=1e-3)
        verdicts = tree_verdicts(planner, model=True)
        assert verdicts[leader].confirmed and verdicts[runner_up].confirmed  # the premise:
        assert verdicts[runner_up].launches == 1  # sure on its one launch, behind the leader
        assert verdicts[runner_up].rank < verdicts[leader].rank
        task = planner.next()
        assert task is not None
        return task

    task = first_task(184.0, 1.86)  # 4% behind as measured, 1% as the model estimates
    assert task.remeasure and task.config == runner_up
    assert not first_task(150.0, 1.60).remeasure  # 20% behind: no launch noise explains it
    assert not first_task(184.0, 1.78).remeasure  # measured above the model: no bad luck


def test_a_recommendation_feasible_by_a_thin_margin_rests_on_more_launches_of_both():
    """A recommendation confirmed on two launches whose 99% bound clears the floor by less
    than THIN_SDS standard errors: a baseline measured low and a tree measured high add up
    (a traced two-worker study shipped a tree truly 0.994 so, on the baseline's two
    launches and its own three). The baseline is launched again while it has no more
    launches than the tree (up to one past the per-config limit), then the tree (up to
    the limit), then the baseline again (up to THIN_BASELINE_LIMITS times the limit),
    until the margin is clear; then the search goes on. Past those limits, or with a
    margin of a few errors, nothing is re-measured."""
    spec = one_dataset_study()
    tree = TreeConfig(3, 1, 4)

    def planned(base_tput: tuple[float, ...], tree_tput: tuple[float, ...]) -> Planner:
        launches = [*(launch(BASELINE, t, (t - 0.2, t, t + 0.2)) for t in base_tput),
                    *(launch(tree, t, (t - 0.2, t, t + 0.2)) for t in tree_tput)]
        return Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                       load_space("narrow"), launches)

    def margin(planner: Planner) -> float:
        """The premise: its bound's margin over the floor in standard errors, where it
        is confirmed (the recommendation) but not sure."""
        verdict = tree_verdicts(planner)[tree]
        assert verdict.confirmed
        if verdict.sure:
            return math.inf
        return math.log(verdict.lower["humaneval"] / verdict.floor) / \
            verdict.intervals["humaneval"].log_sd

    def goes_on(planner: Planner) -> bool:
        task = planner.next()
        return task is not None and not task.remeasure

    planner = planned((100.0, 103.0), (111.2, 114.2))
    assert margin(planner) < THIN_SDS
    remeasures(planner, (BASELINE, launch(BASELINE, 104.0, (103.8, 104, 104.2))))
    assert margin(planner) < THIN_SDS  # the baseline now has more launches than the tree
    remeasures(planner, (tree, launch(tree, 112.0, (111.8, 112, 112.2))))
    assert margin(planner) > THIN_SDS and goes_on(planner)
    # The tree at its limit (three launches) and still thin: the baseline goes on, past
    # one more than the limit, up to THIN_BASELINE_LIMITS times it; then the search goes on.
    capped = planned((100.0, 106.0, 101.0, 104.0), (107.0, 114.0, 111.0))
    assert margin(capped) < THIN_SDS
    task = capped.next()
    assert task is not None and task.remeasure and task.config == BASELINE and task.thin
    # Twice the limit is not enough: a baseline measured 3.4% low over six launches passed
    # a tree truly 0.994 (replay-published, stop 84).
    twice = planned((100.0, 106.0, 101.0, 104.0, 100.0, 106.0), (107.0, 114.0, 111.0))
    assert margin(twice) < THIN_SDS
    task = twice.next()
    assert task is not None and task.remeasure and task.config == BASELINE and task.thin
    at_limits = planned((100.0, 106.0, 101.0, 104.0, 100.0, 106.0, 103.0, 107.0, 104.0),
                        (107.0, 114.0, 111.0))
    assert THIN_BASELINE_LIMITS * spec.search.max_launches_per_config == 9  # the premise
    assert margin(at_limits) < THIN_SDS
    assert goes_on(at_limits)
    clear = planned((100.0, 103.0), (116.0, 119.0))
    assert THIN_SDS < margin(clear) < math.inf and goes_on(clear)


def test_a_thin_recommendation_is_measured_again_before_other_trees_are_confirmed():
    """The thin recommendation's re-measurement comes before any other tree's confirmation
    and is never put off for a proposal forecast to gain: behind them it waited while trees
    at the floor took their launches, and a traced dense-band study recommended a tree truly
    at the floor from launch 15 to 30 on a baseline of two launches."""
    tree, rival = TreeConfig(3, 1, 4), TreeConfig(2, 1, 3)

    def planned(gain: float | None) -> Planner:
        spec = one_dataset_study()
        launches = [launch(BASELINE, 100.0, (99.8, 100, 100.2)),
                    launch(BASELINE, 103.0, (102.8, 103, 103.2)),
                    launch(tree, 111.2, (111.0, 111.2, 111.4)),
                    launch(tree, 114.2, (114.0, 114.2, 114.4)),
                    launch(rival, 118.0, (117.8, 118, 118.2))]
        planner = Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                          load_space("narrow"), launches)
        planner.strategy_name, planner.strategy = "model", Forecaster(gain)
        return planner

    planner = planned(None)
    verdicts = tree_verdicts(planner)
    # The premise: the tree is recommended, its bound within THIN_SDS errors of the floor;
    # the rival, measured above it once, is not yet confirmed (a confirmation to make).
    thin = verdicts[tree]
    assert thin.confirmed and not thin.sure
    assert math.log(thin.lower["humaneval"] / thin.floor) < \
        THIN_SDS * thin.intervals["humaneval"].log_sd
    assert verdicts[rival].unsettled and verdicts[rival].mean > thin.mean
    # The baseline (it has no more launches than the tree), not the rival's confirmation.
    remeasures(planner, (BASELINE, launch(BASELINE, 101.0, (100.8, 101, 101.2))))
    # A proposal forecast far above every measured tree waits for it too.
    task = planned(1.5).next()
    assert task is not None and task.remeasure and task.config == BASELINE and task.thin


def test_a_close_race_between_confirmed_trees_gets_third_launches_up_to_the_limit():
    """Two trees confirmed on two launches each, the leader ahead by less than their ranks'
    errors leave room for (by more than RACE_MARGIN): the order could be the launches'
    luck, so with a model in the ranks the runner-up is launched a third time, then the
    leader (a traced study recommended a tree truly 5% below the best at batch 32 to the
    end so). Not past the limit of launches per config, not when the lead is clear, and not
    without a model (its ranks' errors are then the prior noise's)."""
    leader, runner_up = TreeConfig(3, 1, 4), TreeConfig(2, 1, 3)

    def planned(runner_up_throughputs: tuple[float, ...], model: bool = True,
                **search) -> Planner:
        spec = one_dataset_study(search={"strategy": "tpe", **search})
        launches = [launch(BASELINE, 100.0, (99.8, 100, 100.2)),
                    launch(BASELINE, 103.0, (102.8, 103, 103.2)),
                    launch(leader, 150.0, (149.8, 150, 150.2)),
                    launch(leader, 146.0, (145.8, 146, 146.2)),
                    *(launch(runner_up, t, (t - 0.2, t, t + 0.2))
                      for t in runner_up_throughputs)]
        planner = Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                          load_space("narrow"), launches)
        if model:  # a model as unsure as the measurements, agreeing with them
            planner.strategy = Estimator({leader: 1.46, runner_up: 1.44}, variance=2e-3)
        return planner

    def racing(planner: Planner) -> bool:
        """The premise: both confirmed, and the gap within the race's reach."""
        first, second = sorted(tree_verdicts(planner, model=True).values(),
                               key=lambda v: -v.rank)
        assert first.confirmed and second.confirmed
        return (math.log(first.rank / second.rank) + RACE_MARGIN
                < math.hypot(first.rank_sd, second.rank_sd))

    planner = planned((147.0, 145.0))
    assert racing(planner)
    remeasures(planner, (runner_up, launch(runner_up, 146.0, (145.8, 146, 146.2))))
    if racing(planner):  # still close: the leader, now on fewer launches, goes again
        remeasures(planner, (leader, launch(leader, 148.0, (147.8, 148, 148.2))))
    after = planner.next()
    assert after is not None and not after.remeasure
    # At the limit (two launches per config here) the race stands as it is.
    capped = planned((147.0, 145.0), max_launches_per_config=2)
    assert racing(capped)
    assert not capped.next().remeasure
    # Without a model in the ranks, no race.
    assert not planned((147.0, 145.0), model=False).next().remeasure
    clear = planned((122.0, 120.0)).next()  # 20% behind: no launch noise explains it
    assert clear is not None and not clear.remeasure


def test_where_no_tree_is_confirmed_a_plausible_one_goes_past_the_launch_limit():
    """A batch size with no confirmed tree runs without speculation, so a tree plausible
    there (measured at or above the floor) but not yet surely feasible is launched past
    `search.max_launches_per_config`, up to UNRECOMMENDED_LAUNCHES times it (a 397B study
    recommended no speculation at batch 32, 0.52 of the best, for its last 17 launches,
    its (3,1,4) 1.12x on its slowest dataset in truth but measured low on its three launches
    against a baseline whose later launches ran high)."""
    tree = TreeConfig(3, 1, 4)
    limit = 3

    def planned(*throughputs: float, base: tuple[float, ...] = (100.0, 103.0, 98.0, 101.0)
                ) -> Planner:
        spec = one_dataset_study(search={"strategy": "tpe", "max_launches_per_config": limit})
        launches = [launch(BASELINE, t, (t - 0.2, t, t + 0.2)) for t in base]
        launches += [launch(tree, t, (t - 0.2, t, t + 0.2)) for t in throughputs]
        return Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                       load_space("narrow"), launches)

    def unsettled(planner: Planner) -> bool:
        """The premise: plausible, not confirmed, and no other tree measured."""
        (verdict,) = tree_verdicts(planner).values()
        return verdict.plausible and not verdict.confirmed

    at_limit = planned(104.0, 100.0, 106.0)
    assert unsettled(at_limit)
    remeasures(at_limit, (tree, launch(tree, 99.0, (98.8, 99, 99.2))))
    # At its cap, the tree waits for the baseline to follow it there (the next test), and
    # then nothing is launched again.
    past = planned(104.0, 100.0, 106.0, 99.0, 105.0, 100.0,
                   base=(100.0, 103.0, 98.0, 101.0, 99.0, 102.0))
    assert len(past.results["3,1,4"].cells[0].launch_tok_s) == limit * UNRECOMMENDED_LAUNCHES
    assert launches_of(past.baseline) == limit * UNRECOMMENDED_LAUNCHES
    assert unsettled(past)
    after = past.next()
    assert after is not None and not after.remeasure


def test_where_no_tree_is_confirmed_the_baseline_follows_a_plausible_tree_to_its_cap():
    """Every speedup's error is the baseline's as much as the tree's: a tree at its cap
    (UNRECOMMENDED_LAUNCHES times the limit, where no tree is confirmed) is proven no
    further while the baseline stays at the limit. So the baseline follows it, whenever
    the tree has more launches, up to the same cap (a traced study of a DeepSeek-V3 world
    ran no speculation at batch 1, 0.83 of the best, for all its 30 launches: its (1,1,2),
    5.2% clear of the floor in truth, reached six launches at launch 15 while the baseline
    had three, four from launch 22)."""
    tree = TreeConfig(3, 1, 4)
    limit = 3
    spec = one_dataset_study(search={"strategy": "tpe", "max_launches_per_config": limit})
    launches = [launch(BASELINE, t, (t - 0.2, t, t + 0.2)) for t in (100.0, 103.0, 98.0)]
    launches += [launch(tree, t, (t - 0.2, t, t + 0.2))
                 for t in (106.0, 103.0, 107.0, 104.0, 105.0, 103.0)]
    planner = Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                      load_space("narrow"), launches)
    (verdict,) = tree_verdicts(planner).values()
    # The premise: plausible, unproven, at its cap; the baseline at the per-config limit.
    assert verdict.plausible and not verdict.confirmed
    assert launches_of(planner.results["3,1,4"]) == limit * UNRECOMMENDED_LAUNCHES
    assert launches_of(planner.baseline) == limit
    remeasures(planner, (BASELINE, launch(BASELINE, 101.0, (100.8, 101, 101.2))))
    # Its fourth launch proves the tree: batch 1 has a tree to run.
    (verdict,) = tree_verdicts(planner).values()
    assert verdict.confirmed


def test_a_leader_clear_of_the_runner_up_is_not_measured_again():
    spec = one_dataset_study()
    base = launch(BASELINE, 100.0, (99.8, 100, 100.2))
    planner = Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                      load_space("narrow"),
                      [base, launch(TreeConfig(3, 1, 4), 190.0, (189.8, 190, 190.2)),
                       launch(TreeConfig(2, 1, 3), 150.0, (149.8, 150, 150.2))])
    task = planner.next()
    assert task is not None and not task.remeasure


def test_exploring_proposals_are_trees_a_wider_posterior_favours_not_random_ones(monkeypatch):
    """A share of the model search's proposals explores, so a model too sure of itself
    cannot trap the search; the exploring draw widens the posterior instead of picking
    uniformly from the space, where most trees (deep, wide ones at large batch) are slower
    than no speculation under any plausible model, and a launch there teaches little."""
    import treetune.strategies.model as model_strategy

    name = "qwen3-coder-next-h200"
    truth = load_profile(name)
    spec = study(name)
    planner = run_offline(spec, PerfModel(truth, truth.tp), seed=3, launches=8,
                          noise=Noise(0.03, 0.03))
    strategy = planner.strategy
    monkeypatch.setattr(model_strategy, "EXPLORE", 1.0)  # every proposal explores
    monkeypatch.setattr(model_strategy, "EXPLORE_MISFIT", 1.0)
    proposals = [strategy.propose() for _ in range(12)]
    assert all(p is not None and p.gain is None for p in proposals), \
        "an exploring draw's gain is no forecast"
    # Each exploring proposal is a tree that some batch size of the study would gain from
    # in truth; uniform picks from the default space mostly are not (checked below).
    def gains_somewhere(config: TreeConfig) -> bool:
        return any(min(true_speedups(truth, config, b)) >= 1.0 for b in spec.batch)

    assert sum(gains_somewhere(p.config) for p in proposals) >= 11
    uniform = np.random.default_rng(0).choice(len(strategy.candidates), 40, replace=False)
    share = statistics.fmean(gains_somewhere(strategy.candidates[i]) for i in uniform)
    assert share < 0.8, "the premise: random trees of the space are mostly no gain"


def fixed_length_study(batches: list[int], launches: int):
    """The 30B profile with one dataset of fixed-length requests (1024 in / 128 out: the
    prefills weigh) beside a dataset of the profile's own lengths."""
    return load_study(None, {
        "name": "w", "model": "m", "draft": "d", "batch": batches,
        "datasets": [{"name": "mt-bench", "prompt_tokens": 1024, "output_tokens": 128},
                     "humaneval"],
        "space": "default", "budget": {"launches": launches}, "search": {"strategy": "model"},
        "backend": {"kind": "emulator", "profile": "qwen3-30b-a3b-h100"}})


def whole_speedup(model: PerfModel, tree: TreeConfig, batch: int, most: int) -> float:
    shape = Shape(1024, 128)
    return (model.closed_loop(tree, "mt-bench", shape, batch, most).output_tok_s
            / model.closed_loop(BASELINE, "mt-bench", shape, batch, most).output_tok_s)


def test_the_model_search_predicts_cells_of_fixed_length_requests_as_whole_requests():
    """A cell of fixed-length requests measures whole requests: prefill stalls and request
    turnover dilute the speedup (at 1024 in / 128 out, (3,1,4) is 0.95 at batch 64, where
    the steady state of decoding says 1.44). The model search fits and predicts such cells
    as served, so its estimates of trees it never measured follow the whole requests."""
    profile = load_profile("qwen3-30b-a3b-h100")
    truth = PerfModel(profile, profile.tp)
    spec = fixed_length_study([8, 64], 8)
    planner = run_offline(spec, truth, seed=0, launches=8, noise=Noise(0.01, 0.01, 0.0))
    measured = {r.config for r in planner.results.values()}
    trees = [t for t in (TreeConfig(3, 1, 4), TreeConfig(2, 2, 5), TreeConfig(4, 2, 8),
                         TreeConfig(3, 4, 8)) if t not in measured]
    assert len(trees) >= 3
    estimates = planner.strategy.estimates(trees)
    for tree in trees:
        for batch in (8, 64):
            whole = whole_speedup(truth, tree, batch, 64)
            steady = (truth.throughput(tree, batch, "mt-bench")
                      / truth.throughput(BASELINE, batch, "mt-bench"))
            estimate = float(np.exp(estimates[tree, batch, "mt-bench"].log_mean))
            assert steady > 1.15 * whole  # the steady state would be far off
            assert estimate == pytest.approx(whole, rel=0.04), (tree, batch, steady)


def test_with_no_tree_clear_on_every_dataset_the_model_search_improves_each_datasets_own():
    """Where the fit predicts no tree clear of the floor on every dataset at any batch size
    (here the long prefills of the fixed-length dataset), the study recommends each
    dataset its own tree, and the search proposes for those: a tree that gains on one
    dataset, not a random one."""
    profile = load_profile("qwen3-30b-a3b-h100")
    truth = PerfModel(profile, profile.tp)
    spec = fixed_length_study([64, 128], 6)
    planner = run_offline(spec, truth, seed=0, launches=6, noise=Noise(0.01, 0.01, 0.0))
    strategy = planner.strategy
    trees = [r.config for r in planner.results.values() if isinstance(r.config, TreeConfig)]
    untried = [c for c in strategy.candidates if c not in trees]
    table = predicted_speedups(strategy.fit.profile, untried + trees, [64, 128],
                               spec.dataset_names, profile.tp)
    # The premise: served whole, no tree is clear of the floor on both datasets.
    assert strategy._gain_over(table, untried, trees, [(0, 1)], set()) is None
    gain, pick = strategy._best_under(strategy.fit.profile, untried, trees, None)
    assert max(whole_speedup(truth, pick, b, 128) for b in (64, 128)) < 1.0
    assert max(truth.throughput(pick, b, "humaneval") / truth.throughput(BASELINE, b, "humaneval")
               for b in (64, 128)) > 1.3
    assert gain > 0.9


def test_a_measured_trees_estimate_takes_its_measured_acceptance_not_the_fits(monkeypatch):
    """In a world whose acceptance holds a plateau, then drops (a shape the model's decay
    form cannot follow), the fit puts a depth-4 tree's acceptance above the truth and a
    depth-5 tree's below it, and ranks them the wrong way round. A cell's accept length is
    measured to about 1% whatever the launch's speed: the estimates of measured trees take
    it, and rank them as the truth does. (With its rank ratio fitted, the form follows this
    world within about 1%, and ranks these two right by itself: held at the prior's, as
    here, it stands for a shape the form cannot follow.)"""
    import treetune.strategies.model as model_search

    monkeypatch.setattr(model_search, "ONLINE_SHARED_FIT", ())
    world = load_world("acceptance-shape")
    truth = world.model(world.profile.tp)
    spec = study("qwen3-8b-h100", backend={"kind": "emulator", "world": "acceptance-shape"},
                 batch=[1])
    deep, shallow = TreeConfig(5, 8, 64), TreeConfig(4, 8, 64)
    rng, exact = np.random.default_rng(0), Noise(0, 0, 0)
    launched = [simulate_launch(truth, c, spec, rng, exact)
                for c in (BASELINE, *(TreeConfig.of(*t) for t in DESIGN), deep, shallow)]
    planner = Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                      load_space("default"), launched)
    estimates = planner.strategy.estimates([deep, shallow])
    fitted = model_estimates(planner.strategy.fit, [deep, shallow], np.random.default_rng(0))

    def mean(table, config):
        return statistics.fmean(table[config, 1, d].log_mean for d in spec.dataset_names)

    true = {c: statistics.fmean(np.log(truth.throughput(c, 1, d)
                                       / truth.throughput(BASELINE, 1, d))
                                for d in spec.dataset_names) for c in (deep, shallow)}
    assert true[deep] > true[shallow]
    assert mean(fitted, deep) < mean(fitted, shallow)  # the fit alone: the wrong order
    assert mean(estimates, deep) > mean(estimates, shallow)
    # The gap between them near the truth's (the fit's costs of a deeper draft may still
    # be off by a little; its acceptance alone put them 1.8% off).
    gap = mean(estimates, deep) - mean(estimates, shallow)
    assert gap == pytest.approx(true[deep] - true[shallow], abs=0.01)


@pytest.mark.parametrize("shared", [True, False])
def test_one_rank_ratio_fitted_for_every_dataset_follows_a_draft_whose_rank_2_takes_all(
        shared, monkeypatch):
    """A draft head whose rank 2 catches nearly all of the top-1 miss the lower ranks get
    (shares 0.45 and 0.03, where the model's ranks fall by half each): with the rank ratio
    held at the prior's 0.5, the other acceptance parameters bend to make up, and the fit
    to six noise-free trees predicts unmeasured trees' accept lengths 3% off. The measured
    ones' misfit too, so the fit frees one ratio for every dataset, and then predicts
    them within about 1%."""
    import treetune.strategies.model as model_search

    if not shared:  # the premise: the per-dataset parameters alone cannot
        monkeypatch.setattr(model_search, "ONLINE_SHARED_FIT", ())
    world = load_world("acceptance-shape")
    truth = world.model(world.profile.tp)
    spec = study("qwen3-8b-h100", backend={"kind": "emulator", "world": "acceptance-shape"})
    rng, exact = np.random.default_rng(0), Noise(0, 0, 0)
    baseline = simulate_launch(truth, BASELINE, spec, rng, exact)
    trees = [simulate_launch(truth, TreeConfig.of(*t), spec, rng, exact)
             for t in ((3, 1, 4), (3, 4, 12), (4, 8, 64), (6, 8, 64), (3, 3, 9), (2, 4, 9))]
    fit = ModelFit(neutral_prior(world.profile, spec.dataset_names), [1, 32],
                   spec.dataset_names, world.profile.tp)
    fit.update(trees, baseline)
    model = PerfModel(fit.profile, world.profile.tp)
    unmeasured = (TreeConfig(3, 2, 9), TreeConfig(5, 8, 64), TreeConfig(8, 8, 64))
    worst = max(abs(model.accept_length(c, d) / truth.accept_length(c, d) - 1)
                for c in unmeasured for d in spec.dataset_names)
    assert fit.shared_fit is shared
    if shared:
        ratio = fit.result.parameters["datasets.*.acceptance.rank_ratio"]
        assert ratio < 0.2, "the truth's rank 3 holds 7% of its rank 2"
        assert worst <= 0.015
    else:
        assert worst >= 0.025


@pytest.mark.parametrize("wald", [True, False])
def test_a_cost_cut_by_chance_does_not_free_the_rank_ratio(wald, monkeypatch):
    """Coder-next is its own model, whose draft's ranks fall by half as the prior's do.
    With two trees measured through 3% noise (seed 4) and the accept lengths weighed as
    calibrate's default weighs them (as until stop 55), the trial fit with the rank ratio
    freed cuts the fit's cost by more than a quarter by chance (42 data rows for 28
    parameters), the ratio within a few posterior deviations of 0.5. Freed then, the
    benchmark's study of this seed took 9 launches to its target instead of 6, and
    wrong-prior's (the same world told the wrong GPU) 15 instead of 6. The Wald test
    holds it back. (Weighed by their noise, no such cut was found in 96 studies of the
    three smaller profiles, seeds 0-7 at 3-8 launches.)"""
    import treetune.strategies.model as model_search

    monkeypatch.setattr(model_search, "SPEEDUP_WEIGHT", 3.0)
    if not wald:  # the premise: the cost cut alone frees it
        monkeypatch.setattr(model_search, "SHARED_DEPARTURE", 0.0)
    profile = load_profile("qwen3-coder-next-h200")
    spec = study("qwen3-coder-next-h200", seed=4,
                 search={"strategy": "model", "launch_cv": 0.03})
    fit = run_offline(spec, PerfModel(profile, profile.tp), 4, 5,
                      Noise(0.03, 0.03)).strategy.fit
    assert fit.shared_fit is not wald
    if not wald:
        assert departure(fit.result, fit.prior, fit.params[-1:]) < 3.0


def test_a_draft_whose_ranks_do_not_fall_by_half_frees_the_rank_ratio_through_noise():
    """The acceptance-shape world's draft (rank shares 0.45 and 0.03) is noticed through
    3% noise: by the eighth launch the ratio is freed, fitted below 0.2, more than
    SHARED_DEPARTURE posterior deviations from the prior's 0.5. Over seeds 0-7 it was
    freed at launch 5-7; seed 4 at launch 6 on one machine and 7 on another (the fits'
    floating point differs in the last bits), so the sixth launch was no margin."""
    world = load_world("acceptance-shape")
    spec = study("qwen3-8b-h100", seed=4, search={"strategy": "model", "launch_cv": 0.03},
                 backend={"kind": "emulator", "world": "acceptance-shape"})
    freed = []
    fit = run_offline(spec, world.model(world.profile.tp), 4, 8, Noise(0.03, 0.03),
                      lambda planner: freed.append(planner.strategy.fit.shared_fit)
                      ).strategy.fit
    assert freed[-1] and not freed[0]
    assert fit.result.parameters["datasets.*.acceptance.rank_ratio"] < 0.2
    assert departure(fit.result, fit.prior, fit.params[-1:]) > SHARED_DEPARTURE


def test_a_misfit_models_estimate_of_a_measured_tree_is_corrected_as_the_other_trees_teach():
    """Once the model is judged misfit, the ranking's estimate of a measured tree takes the
    learned correction without the tree's own cells (`Correction.held_out`), and an
    unmeasured tree the correction as learned from every measured one: the ranking weighs
    the estimate against the tree's measurement, which must not be in it twice."""
    world = load_world("acceptance-shape")
    truth = world.model(world.profile.tp)
    spec = study("qwen3-8b-h100", backend={"kind": "emulator", "world": "acceptance-shape"})
    planner = run_offline(spec, truth, seed=1, launches=8, noise=Noise(0.03, 0.03, 0.01))
    strategy = planner.strategy
    results, baseline = planner.evidence()
    trees = [r for r in results if r.ok and isinstance(r.config, TreeConfig)]
    strategy.refresh()
    strategy.correction.surprise([25.0] * 48)  # predictions five sigmas off: misfit
    strategy.correction.update(strategy._residuals(trees, baseline))
    assert strategy.correction.misfit
    unmeasured = TreeConfig.of(4, 2, 8)
    assert all(r.config != unmeasured for r in trees)
    configs = [r.config for r in trees] + [unmeasured]
    plain = model_estimates(strategy.fit, configs, np.random.default_rng(spec.seed))
    corrected = strategy.estimates(configs)
    moved = []
    for config in configs:
        for batch in strategy.fit.batches:
            for dataset in strategy.fit.datasets:
                shift = (corrected[config, batch, dataset].log_mean
                         - plain[config, batch, dataset].log_mean
                         - strategy.accepted.get((config, dataset), 0.0))
                held = strategy.correction.held_out(config, batch, dataset)
                learned, _ = strategy.correction.predict([config], batch, dataset)
                if config == unmeasured:
                    assert held is None and shift == pytest.approx(learned[0], abs=1e-9)
                else:
                    assert shift == pytest.approx(held[0], abs=1e-9)
                    moved.append(abs(learned[0] - held[0]))
    # Learned with its own cells, the correction sits elsewhere (here by 0.05%; 0.01%
    # is a hundred thousand times the tolerance the equalities above are held to).
    assert max(moved) > 1e-4


def proof_of(tput, caps):
    """`proof_outlook` of a tree measured at `tput` on one launch against one baseline
    launch at 100, under the stated 3% launch noise, the tree and the baseline allowed
    `caps` launches."""
    base = launch(BASELINE, 100.0, (99.8, 100, 100.2))
    tree = launch(TreeConfig(3, 1, 4), tput, (tput - 0.2, tput, tput + 0.2))
    return proof_outlook(tree, base, 1, ["humaneval"], 0.0, StudyNoise.prior(0.03), *caps)


TWO_DATASETS = ["humaneval", "mt-bench"]


def two_datasets(config, humaneval, mt_bench):
    """A launch of `config` measured on humaneval and mt-bench at batch 1."""
    return LaunchResult(config, ok=True, cells=[
        cell("humaneval", 1, humaneval, (humaneval - 0.2, humaneval, humaneval + 0.2)),
        cell("mt-bench", 1, mt_bench, (mt_bench - 0.2, mt_bench, mt_bench + 0.2))])


def two_dataset_planner(launches):
    """A TPE study of humaneval and mt-bench at batch 1 that has run `launches`."""
    spec = one_dataset_study(datasets=TWO_DATASETS)
    return Planner(spec, StudyStore(spec, storage=optuna.storages.InMemoryStorage()),
                   load_space("narrow"), launches)


def test_the_chance_of_a_proof_grows_with_the_margin_and_with_the_launches_allowed():
    """One launch of a tree and of the baseline, under the stated 3% launch noise: a tree
    measured at the floor has little chance of being proven within its caps (it may
    truly sit 5% above, or below), one measured 15% above all but sure; more launches
    allowed, more chance."""
    def chance(tput, caps=(6, 3)):
        return proof_of(tput, caps).chance

    by_margin = [chance(t) for t in (100.5, 104.0, 108.0, 115.0)]
    assert by_margin == sorted(by_margin) and len(set(by_margin)) == 4
    assert by_margin[0] < 0.25 and by_margin[-1] > 0.95
    by_caps = [chance(104.0, caps) for caps in ((1, 1), (3, 3), (6, 3), (6, 6))]
    assert by_caps == sorted(by_caps) and by_caps[0] < by_caps[-1] / 3


def test_the_launches_a_proof_needs_fall_with_the_margin_and_stop_at_the_caps():
    """One launch of a tree and of the baseline, under the stated 3% launch noise: a tree
    measured 15% above the floor needs one more launch, one measured a few percent above
    needs several, one at the floor all that the caps allow (it cannot be proven there)."""
    def needs(tput, caps=(6, 3)):
        return proof_of(tput, caps).launches

    by_margin = [needs(t) for t in (100.5, 106.0, 109.0, 115.0)]
    assert by_margin == sorted(by_margin, reverse=True) and len(set(by_margin)) >= 3
    assert by_margin[0] == (6 - 1) + (3 - 1) and by_margin[-1] == 1
    assert needs(100.5, (3, 3)) == 4


def test_a_tree_a_launch_from_its_proof_goes_before_a_faster_one_many_launches_away():
    """Two unconfirmed trees above the confirmed one: a tree 4% faster that one more launch
    proves is measured before a tree 23% faster on average whose thin margin on one
    dataset needs the tree and the baseline at their caps. Weighed by the chance of
    proof alone the far one went first, and a traced dense-band study never proved batch
    1's best tree, a launch from its proof, so (benchmarks/RESULTS.md, stop 89)."""
    safe, near, far = TreeConfig(3, 1, 4), TreeConfig(2, 1, 3), TreeConfig(1, 1, 2)
    planner = two_dataset_planner([
        two_datasets(BASELINE, 100.0, 100.0), two_datasets(BASELINE, 101.0, 101.0),
        two_datasets(safe, 111.0, 111.0), two_datasets(safe, 112.0, 112.0),
        two_datasets(near, 116.0, 116.0), two_datasets(far, 170.0, 104.0)])
    noise, limit = planner.noise(), planner.spec.search.max_launches_per_config
    verdicts = {c: judge(planner.results[config_key(c)], planner.baseline, 1, TWO_DATASETS,
                         0.0, noise, None, 2) for c in (safe, near, far)}
    outlook = {c: proof_outlook(planner.results[config_key(c)], planner.baseline, 1,
                                TWO_DATASETS, 0.0, noise, limit, limit) for c in (near, far)}
    chance = {c: o.chance for c, o in outlook.items()}
    needs = {c: o.launches for c, o in outlook.items()}
    # The premise: the safe tree confirmed, the other two not; by gain times chance the
    # far one leads, by that per launch its proof needs the near one.
    assert verdicts[safe].confirmed
    assert all(verdicts[c].unsettled and not verdicts[c].confirmed for c in (near, far))
    gain = {c: (verdicts[c].mean - verdicts[safe].mean) * chance[c] for c in (near, far)}
    assert gain[far] > 2 * gain[near]
    assert needs[near] == 1 and needs[far] >= 3
    assert gain[far] / needs[far] < gain[near]
    remeasures(planner, (near, two_datasets(near, 116.0, 116.0)))


def test_where_no_tree_is_confirmed_the_one_its_launches_can_prove_is_measured_again():
    """With no tree confirmed at a batch size the workload runs without speculation, and
    the tree measured again is the one likeliest to be confirmed for the gain, not the one
    measured fastest on average: a tree at the floor on one dataset cannot be proven by
    any launches the cap allows (a binding-floor study spent 25 launches on such trees
    and recommended no speculation, 0.50 of the best, from start to end)."""
    safe, edgy = TreeConfig(3, 1, 4), TreeConfig(2, 1, 3)
    planner = two_dataset_planner([
        two_datasets(BASELINE, 100.0, 100.0), two_datasets(BASELINE, 101.0, 101.0),
        two_datasets(safe, 111.0, 111.0), two_datasets(edgy, 131.0, 102.0)])
    noise = planner.noise()
    verdicts = {c: judge(planner.results[config_key(c)], planner.baseline, 1,
                         TWO_DATASETS, 0.0, noise, None, 2)
                for c in (safe, edgy)}
    # The premise: both unsettled (plausible, not confirmed), the edgy one faster on
    # average.
    assert all(v.plausible and not v.confirmed for v in verdicts.values())
    assert verdicts[edgy].mean > verdicts[safe].mean
    remeasures(planner, (safe, two_datasets(safe, 110.0, 110.0)))


def test_a_tree_measured_clear_of_the_floor_by_the_proofs_reach_is_even_odds_at_the_caps():
    """`proof_reach` is how far below a measurement the bound reaches once the tree and the
    baseline have the per-config limit of launches: a tree measured that far above the
    floor has its bound at the floor then, as `proof_outlook` forecasts it."""
    base = launch(BASELINE, 100.0, (99.8, 100, 100.2))
    reach = proof_reach(base, 1, ["humaneval"], StudyNoise.prior(0.03), 3)
    # 3% per launch, three launches of each: 2.326 x 0.03 x sqrt(2 / 3).
    assert reach == pytest.approx(2.326 * 0.03 * math.sqrt(2 / 3), rel=0.02)
    below, above = (proof_of(100 * math.exp(reach * f), (3, 3)).chance for f in (0.9, 1.1))
    assert below < 0.5 < above


def test_late_in_a_study_a_tree_the_proof_can_reach_goes_before_a_faster_one_it_cannot():
    """At batch 32 the measured tree and the fastest untried one clear sharegpt by 3%,
    inside the proof's reach (7%), and a tree 7% slower on average clears it by 12%. Past
    PROVABLE_AFTER launches the proposal is that tree: its gain over no speculation (no
    measured tree is provable) is larger than the fast one's over the measured tree.
    Before then, or with no proof in view, or once a provable tree is measured, the fast
    one."""
    name = "qwen3-8b-h100"
    truth = load_profile(name)
    planner = run_offline(study(name), PerfModel(truth, truth.tp), seed=0, launches=4,
                          noise=Noise(0.03, 0.03))
    strategy = planner.strategy
    assert strategy.fit.datasets[0] == "sharegpt" and strategy.fit.batches == [1, 32]
    measured, fast, safe, sure = (TreeConfig(3, 1, 4), TreeConfig(5, 2, 8), TreeConfig(4, 2, 8),
                                  TreeConfig(3, 2, 6))
    at_32 = {measured: [1.03, 2.0, 2.2, 2.1], fast: [1.03, 2.1, 2.3, 2.2],
             safe: [1.12, 1.9, 2.1, 2.0], sure: [1.12, 1.95, 2.15, 2.05]}

    def pick(trees, reach=0.07, after=0):
        table = {c: {1: [0.9] * 4, 32: list(v)} for c, v in at_32.items()}
        strategy.context = dataclasses.replace(strategy.context, proof_reach=lambda b: reach)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(model_strategy, "PROVABLE_AFTER", after)
            untried = [c for c in (fast, safe) if c not in trees]
            gain, config = strategy._gain_over(table, untried, trees, [(0, 1, 2, 3)], set())
        return config, round(gain, 3)

    assert pick([measured]) == (safe, 1.78)
    assert strategy._launched() == 4 and pick([measured], after=12)[0] == fast
    assert pick([measured], reach=0.0) == (fast, round(1.9075 / 1.8325, 3))
    assert pick([measured, sure])[0] == fast


def test_a_resumed_study_tells_the_batch_studies_the_trees_measured_before_its_baseline():
    """Trees that finished before an interrupted baseline waited in memory for it and were
    lost with the search: the resumed study's per-batch studies (TPE's, GPSampler's,
    optuna-dashboard's) never held them (a helper's audit)."""
    spec = one_dataset_study()
    store = StudyStore(spec, storage=optuna.storages.InMemoryStorage())
    chain = TreeConfig(3, 1, 4)
    base, tree = launch(BASELINE, 100.0, (99, 100, 101)), launch(chain, 110.0, (109, 110, 111))
    assert store.told() == {1: set()}
    Planner(spec, store, load_space("narrow"), [base, tree])
    assert store.told() == {1: {"3,1,4"}}
    trials = store.batch_studies[1].get_trials(deepcopy=False)
    assert len(trials) == 1 and trials[0].value == pytest.approx(1.1, abs=0.01)
    Planner(spec, store, load_space("narrow"), [base, tree])  # resumed again: told once
    assert len(store.batch_studies[1].get_trials(deepcopy=False)) == 1


def test_a_resumed_study_tells_a_tree_to_the_batch_studies_its_lost_database_left_out():
    """A launch is told to each batch study by its own write: a database lost between
    them left the tree in batch 1's study and not in batch 32's, and a resumed study told
    only trees no batch study held (a helper's audit). It now tells each the trees it
    lacks, and none twice."""
    spec = one_dataset_study(batch=[1, 32])
    store = StudyStore(spec, storage=optuna.storages.InMemoryStorage())
    chain = TreeConfig(3, 1, 4)
    base = LaunchResult(BASELINE, ok=True, cells=[cell("humaneval", b, t, (t - 1, t, t + 1))
                                                   for b, t in ((1, 100.0), (32, 900.0))])
    tree = LaunchResult(chain, ok=True, cells=[cell("humaneval", b, t, (t - 1, t, t + 1))
                                               for b, t in ((1, 110.0), (32, 860.0))])
    distributions = BatchStudies(store, load_space("narrow")).distributions
    params = {"steps": 3, "topk": 1, "draft_tokens": 4}
    store.record(1, None, params, distributions, tree, base)  # batch 32's write was lost
    held = {b: len(store.batch_studies[b].get_trials()) for b in (1, 32)}
    assert held == {1: 1, 32: 0}
    Planner(spec, store, load_space("narrow"), [base, tree])
    values = {b: [t.value for t in store.batch_studies[b].get_trials(deepcopy=False)]
              for b in (1, 32)}
    assert values[1] == [pytest.approx(1.1, abs=0.01)]
    assert values[32] == [pytest.approx(860 / 900, abs=0.01)]


def test_a_study_made_before_its_servers_ran_without_a_prefix_cache_is_known_as_such():
    """Resumed, an older SGLang study would compare launches with the radix cache on and
    off: the study records how its servers run, and the search says so when they differ."""
    from treetune.backends.emulator import EMULATOR_API
    from treetune.backends.sglang import SGLANG_API
    from treetune.study.storage import NO_PREFIX_CACHE_ATTR

    spec = one_dataset_study()
    store = StudyStore(spec, storage=optuna.storages.InMemoryStorage())
    assert not store.cached_prefixes  # made now: its servers keep no prefix cache
    store.launches.set_user_attr(NO_PREFIX_CACHE_ATTR, False)  # as an older study reads
    assert store.cached_prefixes
    assert SGLANG_API.prefix_cache and not EMULATOR_API.prefix_cache


def test_an_api_key_starting_with_a_dash_is_refused_before_any_server(tmp_path, monkeypatch):
    """SGLang's parser takes `--api-key -x...` for a flag, on the command line and from a
    config file alike: every server would fail to start (a helper's audit; about 1 in 64
    keys from secrets.token_urlsafe)."""
    from treetune.study.worker import LaunchWorker

    spec = load_study("studies/demo.yaml", {"api_key_env": "TT_DASH_KEY",
                                             "output": str(tmp_path / "out")})
    monkeypatch.setenv("TT_DASH_KEY", "-k3y")
    with pytest.raises(RuntimeError, match="starts with '-'"):
        LaunchWorker(spec, 0).ready()
    monkeypatch.setenv("TT_DASH_KEY", "k3y-")
    assert LaunchWorker(spec, 0).ready()[0].startswith("worker-0@")


def test_the_model_search_prices_a_server_at_what_its_kv_pool_runs_at_once():
    """A tree whose KV pool holds fewer requests than the study's largest batch starts,
    runs that many at once and is measured so; the model search priced it at the whole
    batch (a review: on the 30B's H100 at batch 256, (3,1,4) predicted 1.05 on mt-bench,
    served 1.21), and fitted such cells as if the batch ran. Now both go by the pool."""
    from treetune.perfmodel import RunningCaps
    from treetune.results import CellResult, LaunchResult
    from treetune.strategies.model import measurements

    profile = load_profile("qwen3-30b-a3b-h100")
    caps = RunningCaps(profile, 256, 1)
    tree = TreeConfig(3, 1, 4)
    assert (caps(BASELINE), caps(tree)) == (149, 144)
    model = PerfModel(profile, 1)
    table = predicted_speedups(profile, [tree], [1, 256], ["mt-bench"], 1, caps)
    assert table[tree][256][0] == pytest.approx(
        model.throughput(tree, 144, "mt-bench") / model.throughput(BASELINE, 149, "mt-bench"))
    assert table[tree][1][0] == pytest.approx(
        model.throughput(tree, 1, "mt-bench") / model.throughput(BASELINE, 1, "mt-bench"))
    assert table[tree][256][0] > 1.15 > predicted_speedups(
        profile, [tree], [256], ["mt-bench"], 1)[tree][256][0]

    def launch(config):
        return LaunchResult(config, ok=True, cells=[
            CellResult("mt-bench", b, 1000.0, 2.0 if config is not BASELINE else None, 10,
                       10_000, 6.0, None, None) for b in (1, 256)])

    # Fitted at what ran: a review found cells past the pools left out of the fit, and a
    # study of batch 256 alone never fitted at all.
    points = measurements([launch(tree)], launch(BASELINE), [1, 256], ["mt-bench"], caps=caps)
    assert [(p.batch, p.baseline_batch) for p in points] == [(1, 1), (144, 149)]
    from treetune.perfmodel.calibrate import point_errors

    capped = point_errors(profile, points)[1]
    assert capped.predicted_baseline == pytest.approx(
        model.throughput(BASELINE, 149, "mt-bench"))
    assert capped.predicted_speedup == pytest.approx(table[tree][256][0])


def test_a_study_whose_every_batch_outgrows_the_pools_still_fits_its_model(tmp_path):
    """Batch 256 alone on the 30B's H100: every server runs fewer at once (149 without
    speculation, 142-144 with). A review found such cells left out of the fit, so the
    search never fitted and ran on its prior for good."""
    from studykit import small_study

    from treetune.study.offline import run_offline
    from treetune.study.spec import load_study

    spec = load_study(None, small_study(
        tmp_path, model="Qwen/Qwen3-30B-A3B", draft="Tengyunw/qwen3_30b_moe_eagle3", tp=1,
        batch=[256], datasets=["mt-bench"], compare=[], search={"strategy": "model"},
        backend={"kind": "emulator", "profile": "qwen3-30b-a3b-h100"}))
    planner = run_offline(spec, PerfModel(load_profile("qwen3-30b-a3b-h100"), 1), 1, 6)
    assert planner.strategy_name == "model" and planner.strategy.fit.result is not None


def test_once_the_model_is_found_misfit_it_is_refitted_counting_large_misfits_less(
        monkeypatch):
    """The fit is least squares while the posterior predictive check finds the model
    right, and soft-L1 beyond ROBUST_SCALE once it has found it misfit."""
    name = "qwen3-8b-h100"
    truth = load_profile(name)
    planner = run_offline(study(name), PerfModel(truth, truth.tp), seed=0, launches=4,
                          noise=Noise(0.03, 0.03))
    strategy = planner.strategy
    asked: list[float | None] = []
    fitted = model_strategy.calibrate

    def calibrate(*args, **kwargs):
        asked.append(kwargs.get("robust"))
        return fitted(*args, **kwargs)

    monkeypatch.setattr(model_strategy, "calibrate", calibrate)
    for misfit in (False, True):
        asked.clear()
        strategy.correction.misfit = misfit
        strategy.fitted_on = (-1, -1)  # news: refitted
        strategy.refresh()
        assert asked and set(asked) == {model_strategy.ROBUST_SCALE if misfit else None}


def test_the_models_rank_of_two_trees_is_never_surer_than_its_form_can_be():
    """Near twins move together in every posterior draw, so the draws claim their order to
    a tenth of a percent where, in a world the form does not follow (verify cliffs), it
    is off between them by 1-2%. The estimates the ranks blend with the measurements take
    RANK_SD_FLOOR's variance on top of the draws', in rank and in level alike."""
    world = load_world("cliffs")
    truth = world.model(world.profile.tp)
    spec = study("qwen3-coder-next-h200", backend={"kind": "emulator", "world": "cliffs"})
    planner = run_offline(spec, truth, seed=1, launches=10, noise=Noise(0.03, 0.03))
    strategy = planner.strategy
    trees = [r.config for r in planner.results.values() if isinstance(r.config, TreeConfig)]
    floor = model_strategy.RANK_SD_FLOOR ** 2
    drawn = model_estimates(strategy.fit, trees, np.random.default_rng(spec.seed))
    # The premise: the draws alone claim some order finer than the floor.
    assert min(e.rank_variance for e in drawn.values()) < floor / 4
    estimates = strategy.estimates(trees)
    assert set(estimates) == set(drawn)
    for key, e in estimates.items():
        # (Once the misfit check fires, the correction's variance comes on top.)
        assert e.rank_variance >= (drawn[key].rank_variance + floor) * (1 - 1e-9)
        assert e.variance >= e.rank_variance
