"""The in-process benchmarks' own plumbing: every shipped profile runs, a job that raises
loses no other job's result, and treetune's errors cross a process pool intact."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from treetune.errors import ConfigFileError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from search_efficiency import (  # noqa: E402
    THREAD_VARIABLES,
    check_arguments,
    progress_line,
    run_pool,
)


def _invert(x: int) -> dict:
    if x == 0:
        raise ConfigFileError("study.yaml", "zero has no inverse", "datasets[1]")
    return {"x": x, "inverse": 1 / x}


def test_a_config_error_raised_in_another_process_arrives_whole():
    error = ConfigFileError("study.yaml", "unknown built-in dataset 'gsm8k'", "datasets[1]")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is ConfigFileError and str(back) == str(error)
    assert (back.path, back.key, back.message) == ("study.yaml", "datasets[1]",
                                                   "unknown built-in dataset 'gsm8k'")


def test_a_job_that_raises_is_reported_and_the_others_are_kept_in_order(capsys):
    rows, failed = run_pool(_invert, [4, 0, 2, 1], 2, lambda row: f"x={row['x']}")
    assert failed == 1
    assert [row["x"] for row in rows] == [4, 2, 1]
    err = capsys.readouterr().err
    assert "FAILED 0: ConfigFileError: study.yaml: key 'datasets[1]': zero has no inverse" in err
    assert "1 of 4 jobs failed" in err


def _threads(_: int) -> dict:
    return {name: os.environ.get(name) for name in THREAD_VARIABLES}


def test_each_pool_process_gives_pytorch_its_share_of_the_cpus_unless_the_user_chose(
        monkeypatch):
    # GPSampler's PyTorch sizes its thread pool to every CPU when it loads: two processes
    # of it on 2 cores each ran 2 threads, and took 2.1 times as long as with one.
    for name in THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    share = str(max((os.cpu_count() or 1) // 2, 1))
    rows, failed = run_pool(_threads, [0, 1], 2, str)
    assert failed == 0 and rows == [dict.fromkeys(THREAD_VARIABLES, share)] * 2
    assert all(name not in os.environ for name in THREAD_VARIABLES)  # the parent's untouched
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    rows, _ = run_pool(_threads, [0], 2, str)
    assert rows[0]["OMP_NUM_THREADS"] == "3"


def test_a_study_s_progress_line_says_whether_it_held_the_target_to_the_end():
    def line(first, stable):
        return progress_line({"world": "cliffs", "strategy": "model", "seed": 3,
                              "launches_to_target": first,
                              "launches_to_stable_target": stable, "launches": 30})

    assert line(7, 7) == "cliffs model seed 3: target at 7 launches (kept from 7)"
    assert line(7, 27).endswith("target at 7 launches (kept from 27)")
    assert line(8, 31).endswith("target at 8 launches (not held to the end)")
    assert line(31, 31) == "cliffs model seed 3: target (never reached)"  # no 31st launch
    missed = progress_line({"world": "cliffs", "strategy": "model", "seed": 3,
                            "launches_to_target": 31, "launches_to_stable_target": 31,
                            "launches": 30, "target_launched": {"1": 6, "32": None}})
    assert missed.endswith("(never reached; a target tree first launched: batch 1 at 6, "
                           "batch 32 never)")
    nothing_to_launch = progress_line({"world": "cliffs", "strategy": "model", "seed": 3,
                                      "launches_to_target": 31,
                                      "launches_to_stable_target": 31, "launches": 30,
                                      "target_launched": {"1": 0, "32": 0}})
    assert nothing_to_launch.endswith("(never reached)")  # no speculation is the best


@pytest.mark.parametrize("script", ["search_efficiency.py", "model_calibration.py"])
def test_an_unknown_world_is_a_usage_error_that_names_it(script):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--worlds",
                           "qwen3-8b-h100", "no-such-world"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2
    assert "unknown world 'no-such-world'" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("world", ["qwen3.5-397b-a17b-h200"])
def test_a_profile_whose_datasets_are_not_built_in_runs_in_process(world):
    """The 397B profile's benchmarks (gsm8k, math500, ...) have no built-in prompts: the
    in-process benchmark reads none, so it must not ask for them."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "search_efficiency.py"), "--worlds", world,
         "--seeds", "1", "--max-launches", "3", "--budget", "2", "--strategies", "random",
         "--processes", "1", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    row = data["worlds"][world]["random"]
    assert row["studies"] == 1 and 0.0 <= row["coverage"] <= 1.0
    assert row["median_launches_ci"] is None  # one study: no interval
    (study,) = data["studies"]  # every study's own row, for later pooling
    assert study["world"] == world and study["seed"] == 0
    assert set(study["target_launched"]) == {"1", "32"}
    assert 0 <= row["unreached_unlaunched"] <= row["studies"] - row["reached"]


def test_the_target_trees_are_the_truly_feasible_ones_within_one_percent_of_the_best():
    from search_efficiency import target_trees

    from treetune.config import TreeConfig

    best_tree, near, far, fast_but_slower_somewhere = (
        TreeConfig(3, 1, 4), TreeConfig(3, 4, 12), TreeConfig(5, 8, 32), TreeConfig(2, 1, 3))
    table = {best_tree: {1: [1.5, 1.5], 32: [0.9, 0.95]},
             near: {1: [1.49, 1.48], 32: [0.8, 0.9]},
             far: {1: [1.4, 1.45], 32: [0.7, 0.8]},
             fast_but_slower_somewhere: {1: [2.2, 0.99], 32: [0.95, 0.97]}}
    targets = target_trees(table, {1: 1.5, 32: 1.0})
    assert targets[1] == {best_tree, near}
    assert targets[32] == set()  # nothing is feasible: no speculation is the target


def test_a_recommendation_that_truly_regresses_a_dataset_is_never_on_target():
    """However high its mean, a tree truly slower than no speculation on a dataset is a
    shipped regression: not within the target, and the worst regret."""
    from search_efficiency import regret, within_target

    # A tree's true speedups per batch size and dataset, as judge_mixed gives them.
    feasible, regressing = {1: [1.3, 1.2]}, {1: [1.6, 0.98]}
    on_target = [(feasible, 1, 1.25 / 1.25), (None, 32, 1.0)]  # no speculation at 32
    assert within_target(on_target) and regret(on_target) == 0.0
    shipped = [(regressing, 1, 1.29 / 1.25), (None, 32, 1.0)]
    assert not within_target(shipped) and regret(shipped) == 1.0
    short = [({1: [1.2, 1.2]}, 1, 0.96), (None, 32, 1.0)]
    assert not within_target(short) and regret(short) == pytest.approx(0.04)


def test_a_budget_beyond_the_launches_a_study_may_use_is_refused():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "search_efficiency.py"),
                           "--worlds", "launch-bias", "--max-launches", "6", "--budget", "20"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--budget 20 is beyond --max-launches 6" in done.stderr


def test_the_scaling_benchmark_s_cell_window_reaches_the_simulated_study():
    """`--duration` sets each cell's window in the study the simulated clock times."""
    from search_efficiency import study_spec

    from treetune.study.offline import LaunchClock, cells_of

    short = study_spec("qwen3-8b-h100", "model", 0, 10, 0.03, (1, 32), duration_s=30.0)
    default = study_spec("qwen3-8b-h100", "model", 0, 10, 0.03, (1, 32))
    assert short.measurement.duration_s == 30.0 and cells_of(short) == 2 * 4
    clock = LaunchClock(load_s=300.0, warmup_s=5.0)
    assert clock.nominal(short) == 300.0 + 8 * (30.0 + 5.0)
    assert clock.nominal(default) - clock.nominal(short) == 8 * (default.measurement.duration_s
                                                                 - 30.0)


def test_a_profile_of_attention_groups_is_searched_by_servers_that_say_so(tmp_path):
    """A profile whose servers run data-parallel attention is the search's own model only
    if the study's servers say so (the prior then prices the groups); the attention-dp
    world's servers do not (its prior prices tensor parallelism)."""
    from search_efficiency import study_spec

    from treetune.perfmodel import load_profile
    from treetune.perfmodel.profile import with_attention_dp
    from treetune.study.planner import study_prior

    path = tmp_path / "dp4.yaml"
    with_attention_dp(load_profile("qwen3-coder-next-h200"), 4).save(path)
    own = study_spec(str(path), "model", 0, 10, 0.03, (1, 32))
    assert own.server_flags == {"--enable-dp-attention": None, "--dp-size": "4"}
    assert study_prior(own)[0].server.attention_dp == 4
    hidden = study_spec("attention-dp", "model", 0, 10, 0.03, (1, 32))
    assert hidden.server_flags == {} and study_prior(hidden)[0].server.attention_dp == 1


def test_a_study_of_another_draft_method_is_judged_by_that_method_s_truth():
    """`--method NEXTN`: the studies search the 397B's MTP layer, with no draft model, and
    are judged against NEXTN's speedups, not the EAGLE3 head's."""
    from search_efficiency import study_spec, truth_table

    from treetune.config import BASELINE, TreeConfig
    from treetune.worlds import load_world

    spec = study_spec("qwen3.5-397b-a17b-h200", "model", 0, 10, 0.03, (1,), method="NEXTN")
    assert (spec.algorithm, spec.draft) == ("NEXTN", None)
    world = load_world("qwen3.5-397b-a17b-h200")
    nextn, _ = truth_table(world, (1,), "NEXTN")
    head, _ = truth_table(world, (1,))
    chain = TreeConfig(3, 1, 4)
    assert nextn[chain][1] != head[chain][1]
    model = world.model(world.profile.tp, "NEXTN")
    assert nextn[chain][1][0] == model.throughput(chain, 1, next(iter(world.profile.datasets))
                                                  ) / model.throughput(
        BASELINE, 1, next(iter(world.profile.datasets)))


def test_the_coverage_interval_resamples_whole_studies():
    """A study whose baseline was off misses many intervals at once: the coverage's
    interval must be as wide as the studies disagree, and a point when they agree."""
    from search_efficiency import coverage_ci

    agree = [{"covered": 95, "intervals": 100} for _ in range(12)]
    assert coverage_ci(agree) == [0.95, 0.95]
    split = [{"covered": 100, "intervals": 100}] * 10 + [{"covered": 60, "intervals": 100}] * 2
    low, high = coverage_ci(split)
    assert low < 0.94 < high <= 1.0 and high - low > 0.04
    assert coverage_ci(agree[:1]) is None


def test_the_median_s_interval_says_how_far_other_seeds_could_move_it():
    """Twelve studies split between 7 and 31 launches: the median is within 7-31, and the
    interval spans both; when every study agrees it is a point."""
    from search_efficiency import median_ci

    agree = [{"launches_to_target": 8}] * 12
    assert median_ci(agree) == [8.0, 8.0]
    split = [{"launches_to_target": n} for n in [7] * 6 + [31] * 6]
    low, high = median_ci(split)
    assert low == 7.0 and high == 31.0
    lean = [{"launches_to_target": n} for n in [6, 7, 7, 8, 8, 8, 9, 9, 10, 12, 19, 31]]
    low, high = median_ci(lean)
    assert 7 <= low < 8.5 < high <= 10
    assert median_ci(agree[:1]) is None


def test_the_oracle_takes_the_batch_sizes_in_turn_best_feasible_first():
    from search_efficiency import oracle_order

    from treetune.config import TreeConfig

    a, b, c, d = (TreeConfig(2, 1, 3), TreeConfig(3, 1, 4), TreeConfig(3, 2, 6),
                  TreeConfig(5, 8, 32))
    table = {a: {1: [1.2, 1.2], 32: [1.10, 1.10]},
             b: {1: [1.4, 1.4], 32: [1.05, 1.05]},
             c: {1: [1.5, 1.5], 32: [1.20, 0.98]},  # regresses one dataset at 32
             d: {1: [1.6, 0.90], 32: [0.50, 0.50]}}  # feasible nowhere
    assert oracle_order(table) == [c, a, b, d]


def test_an_oracle_study_reaches_the_target_and_leaves_no_strategy_behind():
    from search_efficiency import Job, run_job

    from treetune import strategies

    row = run_job(Job("qwen3-8b-h100", "oracle", 0, 6, 4, 0.03, (1, 32)))
    assert row["launches"] == 6 and row["false_feasible"] == 0
    # Its first tree is the best at batch 1; with the baseline measured twice, the study
    # can be at the target by launch 3 and must be by 6 on this world of a wide margin.
    assert row["launches_to_target"] <= 6
    assert "oracle" not in strategies.names()  # a benchmark's reference, not a strategy


def test_the_model_oracle_orders_by_the_truth_without_the_worlds_cost_effects():
    from search_efficiency import Job, model_only, run_job, truth_table

    from treetune import strategies
    from treetune.worlds import load_world

    world = load_world("launch-bias")
    plain = model_only(world)
    assert world.effects.launch_bias is not None and plain.effects.launch_bias is None
    assert plain.profile == world.profile and plain.replay_path is None
    biased, _ = truth_table(world, (1,))
    unbiased, _ = truth_table(plain, (1,))
    # Same trees; the bias (within 3% for each tree and for the baseline) moves their
    # speedups, and not all alike.
    assert biased.keys() == unbiased.keys()
    ratios = [biased[c][1][0] / unbiased[c][1][0] for c in biased]
    assert 0.93 < min(ratios) < 0.98 and max(ratios) - min(ratios) > 0.04
    assert max(ratios) < 1.07
    replay = model_only(load_world("replay-cliff-grid"))
    assert replay.replay_path is None
    row = run_job(Job("launch-bias", "model-oracle", 0, 4, 4, 0.03, (1, 32)))
    assert row["launches"] == 4 and row["strategy"] == "model-oracle"
    assert "model-oracle" not in strategies.names()


def test_each_world_s_study_of_a_seed_draws_its_own_noise(monkeypatch):
    """Studies of one seed in two worlds draw different noise (with the seed alone every
    world drew one stream: the same launches slow in every slow-launch world), while every
    strategy of one world and seed draws the same (their comparison is paired)."""
    import search_efficiency as se

    seeds: list[int] = []
    real = se.run_parallel

    def spy(spec, truth, seed, *args, **kwargs):
        seeds.append(seed)
        return real(spec, truth, seed, *args, **kwargs)

    monkeypatch.setattr(se, "run_parallel", spy)
    for world, strategy in (("cliffs", "random"), ("cliffs", "grid"),
                            ("slow-launches", "random")):
        se.run_job(se.Job(world, strategy, 4, 2, 2, 0.03, (1, 32)))
    cliffs, cliffs_grid, slow = seeds
    assert cliffs == cliffs_grid == se.noise_seed(se.load_world("cliffs"), 4)
    assert slow == se.noise_seed(se.load_world("slow-launches"), 4) != cliffs
    assert se.noise_seed(se.load_world("cliffs"), 5) != cliffs

    # Their launches differ in noise: the baseline's first launch is no longer one draw.
    def first_baseline(world: str) -> float:
        w = se.load_world(world)
        spec = se.study_spec(world, "random", 4, 2, 0.03, (1,))
        planner = real(spec, w.model(w.profile.tp), se.noise_seed(w, 4), 1, 1,
                       se.Noise(0.03, 0.03))
        first = next(iter(w.profile.datasets))
        truth = w.model(w.profile.tp).throughput(se.BASELINE, 1, first)
        return planner.launched[0].cells[0].output_tok_s / truth

    assert first_baseline("cliffs") != pytest.approx(first_baseline("moe-dispatch"), rel=1e-6)


def test_scoring_the_model_s_estimates_does_not_steer_the_study(monkeypatch):
    """model_calibration.py asks the search's model for estimates after every launch; the
    study must launch what it would have launched unasked, or the scores would be of
    another search."""
    import model_calibration
    from search_efficiency import noise_seed, study_spec

    from treetune.study.offline import Noise, run_offline
    from treetune.worlds import load_world

    job = model_calibration.Job("qwen3-30b-a3b-h100", 0, 7, 30, 0.03)
    asked: list = []
    monkeypatch.setattr(model_calibration, "run_offline",
                        lambda *a, **k: asked.append(run_offline(*a, **k)))
    row = model_calibration.run_job(job)
    assert [s["launch"] for s in row["launches"]] == [4, 5, 6, 7]
    assert all(s["unmeasured"] and s["accept_misfit"] is not None for s in row["launches"])
    assert any(s["measured"] for s in row["launches"])
    world = load_world(job.world)
    spec = study_spec(job.world, "model", job.seed, job.max_launches, job.noise, job.batches)
    unasked = run_offline(spec, world.model(world.profile.tp), noise_seed(world, job.seed),
                          job.max_launches, Noise(job.noise, job.noise))
    assert [r.config for r in asked[0].launched] == [r.config for r in unasked.launched]
    summary = model_calibration.summarize([row])
    assert set(summary) == {"4-6", "7-9"} and summary["4-6"]["z2_measured"] >= 0


@pytest.mark.parametrize("as_file", [False, True])
def test_the_auto_prior_benchmark_searches_a_world_from_its_profile_s_auto_prior(
        tmp_path, as_file):
    """A world built on the 8B profile is searched from the 8B's own fixtures and GPU, and
    both arms run and are judged; named by its name or by the path of its file, and then
    nothing is written beside that file (the prior once was, and stayed behind)."""
    truth = "acceptance-shape"
    if as_file:
        copy = tmp_path / "acceptance-shape.yaml"
        copy.write_text((ROOT / "treetune" / "worlds" / "shipped" / f"{truth}.yaml").read_text())
        truth = str(copy)
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "auto_prior.py"), "--truth",
         truth, "--seeds", "1", "--max-launches", "2", "--processes", "1",
         "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == (["acceptance-shape.yaml"] if as_file
                                                    else [])
    summary = json.loads(done.stdout)[truth]
    for arm in ("truth facts", "auto"):
        (launches,) = summary[arm]["launches"]
        assert 1 <= launches <= 3 and summary[arm]["reached"] == (launches <= 2)


@pytest.mark.parametrize(("truth", "said"), [
    ("qwen3.5-397b-a17b-h200", ["no config.json fixtures for qwen3.5-397b-a17b-h200",
                                "--model, --draft and --gpu"]),
    ("no-such-world", ["unknown world 'no-such-world'"]),
])
def test_the_auto_prior_benchmark_says_what_it_cannot_search_without_a_traceback(truth, said):
    """A truth without config.json fixtures asks for them; an unknown one is named."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "auto_prior.py"), "--truth", truth,
         "--seeds", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    for words in said:
        assert words in done.stderr


def test_drawn_worlds_are_held_out_worlds_that_load_and_repeat_per_seed(tmp_path):
    """Each drawn world is an ordinary world file, the same for the same seed and index,
    with at least one effect or wrong fact; over 24 draws every kind of effect appears,
    and MoE dispatch only on MoE profiles."""
    import drawn_worlds

    from treetune.worlds import load_world

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "drawn_worlds.py"),
                           "--count", "24", "--output", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    files = sorted(tmp_path.glob("*.yaml"))
    assert [f.name for f in files] == [f"drawn-2026-{i:02d}.yaml" for i in range(24)]
    assert drawn_worlds.draw(3) == drawn_worlds.draw(3) != drawn_worlds.draw(3, seed=7)
    kinds: set[str] = set()
    for path in files:
        world = load_world(path)
        drawn = world.effects
        here = {k for k in ("verify_cliffs", "moe_dispatch", "launch_bias", "slow_launches",
                            "acceptance") if getattr(drawn, k)}
        here |= {"facts"} if world.facts.hardware != world.profile.hardware else set()
        assert here, path.name
        if drawn.moe_dispatch:
            assert world.profile.target.moe is not None
        kinds |= here
        assert world.description.startswith(f"Drawn (seed 2026, world {int(path.stem[-2:])}): "
                                            f"{world.profile.name} with ")
    assert kinds == {"verify_cliffs", "moe_dispatch", "launch_bias", "slow_launches",
                     "acceptance", "facts"}
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "drawn_worlds.py"),
                              "--count", "0", "--output", str(tmp_path)],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert refused.returncode == 2 and "--count must be >= 1" in refused.stderr


def test_drawn_worlds_with_new_bases_rest_on_no_shipped_profile(tmp_path):
    """`--new-bases`: each world's base is a fixture target on a drawn GPU at the least
    tensor parallelism its weights fit, counted as the auto prior counts it, its
    calibration a shipped profile's within +-30%; the bases sit in a subfolder, so
    `DIR/*.yaml` lists the worlds alone."""
    import math

    import drawn_worlds

    from treetune.config import BASELINE
    from treetune.facts import gpu_facts, model_facts
    from treetune.perfmodel import load_profile
    from treetune.worlds import load_world

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "drawn_worlds.py"),
                           "--new-bases", "--seed", "2028", "--count", "24",
                           "--output", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [f.name for f in sorted(tmp_path.glob("*.yaml"))] == [
        f"drawn-2028-{i:02d}.yaml" for i in range(24)]
    assert len(list((tmp_path / "bases").glob("*.yaml"))) == 24
    assert drawn_worlds.draw_base(5, 2028) == drawn_worlds.draw_base(5, 2028) \
        != drawn_worlds.draw_base(5, 2029)
    shipped = [load_profile(name).calibration for name in drawn_worlds.PROFILES]
    spread = drawn_worlds.CALIBRATION_SPREAD

    def scaled_from(value: float, shipped_value: float, efficiency: bool) -> bool:
        """Within +-spread of the shipped value (an efficiency is then held at 0.95)."""
        if efficiency and value == 0.95:
            return shipped_value * math.exp(spread) >= 0.95
        return abs(math.log(value / shipped_value)) <= spread + 1e-4
    targets, gpus, heads = set(), set(), set()
    for path in sorted(tmp_path.glob("*.yaml")):
        world = load_world(path)
        base = world.profile
        assert base.name.startswith("base-2028-") and base.name not in drawn_worlds.PROFILES
        target_name, head_name = next(
            (t, h) for t, h in drawn_worlds.TARGETS if base.description.startswith(t))
        counted = model_facts(str(drawn_worlds.FIXTURES / target_name))
        assert base.target.total_params_b == pytest.approx(counted.total_params / 1e9, rel=1e-3)
        assert base.target.kv_bytes_per_token == pytest.approx(counted.kv_bytes_per_token,
                                                             rel=1e-3)
        gpu = gpu_facts(base.hardware.gpu)
        weights = counted.total_params * counted.weight_bytes
        share = drawn_worlds.WEIGHT_SHARE * gpu.memory_gb * 1e9
        assert weights <= share * base.tp and (base.tp == 1 or weights > share * base.tp / 2)
        own = base.calibration
        assert any(all(scaled_from(getattr(own, f), getattr(c, f), f.endswith("_eff"))
                       for f in ("step_overhead_ms", "draft_overhead_ms", "compute_eff",
                                 "weight_bandwidth_eff"))
                   for c in shipped), path.name
        assert world.description.startswith(f"Drawn (seed 2028, world {int(path.stem[-2:])}): "
                                            f"{target_name} with ")
        dataset = next(iter(base.datasets))
        assert world.model(base.tp).throughput(BASELINE, 1, dataset) > 0
        targets.add(target_name)
        gpus.add(gpu.name)
        heads.add(head_name is None)
    assert len(targets) >= 4 and len(gpus) >= 4 and heads == {True, False}


@pytest.mark.parametrize(("script", "args", "message"), [
    ("search_efficiency.py", ["--seeds", "0"], "--seeds must be >= 1, got 0"),
    ("search_efficiency.py", ["--processes", "0"], "--processes must be >= 1, got 0"),
    ("search_efficiency.py", ["--output", "{tmp}/missing/x.md"], "the folder {tmp}/missing "
     "does not exist"),
    ("scaling.py", ["--worlds", "nosuch"], "unknown world 'nosuch'"),
    ("search_efficiency.py", ["--worlds", "cliffs", "--method", "nextn"], "--method NEXTN: "
     "world 'cliffs' describes EAGLE3"),
    ("auto_prior.py", ["--seeds", "0"], "argument --seeds: must be >= 1, got 0"),
    # Each failed every study of the run, exit 1 (an audit).
    ("search_efficiency.py", ["--batch", "0"], "argument --batch: must be >= 1, got 0"),
    ("search_efficiency.py", ["--noise", "nan"], "argument --noise: must be a finite number"),
    ("search_efficiency.py", ["--noise", "-0.1"], "argument --noise: must be >= 0 and < 1"),
    ("search_efficiency.py", ["--prior-noise", "inf"], "argument --prior-noise: must be a "
     "finite number"),
    ("search_efficiency.py", ["--first-seed", "-5"], "argument --first-seed: must be >= 0"),
    ("predict_agreement.py", ["--tree", "abc"], "tree 'abc' must be three integers"),
])
def test_a_benchmark_refuses_bad_arguments_before_any_study(tmp_path, script, args, message):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script),
                           *(a.format(tmp=tmp_path) for a in args)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message.format(tmp=tmp_path) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_quick_fills_only_the_benchmark_options_not_given():
    args = argparse.Namespace(quick=True, seeds=3, max_launches=None, budget=None,
                              processes=1, output=None)
    check_arguments(argparse.ArgumentParser(), args, quick={"seeds": 1, "max_launches": 16,
                                                            "budget": 12},
                    defaults={"seeds": 20, "max_launches": 30, "budget": 20})
    assert (args.seeds, args.max_launches, args.budget) == (3, 16, 12)
