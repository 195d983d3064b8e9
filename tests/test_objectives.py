"""Objectives (throughput, p50/p99 TPOT, p99 TTFT, goodput): what a speedup means under
each, which cells a verdict judges, the noise learned per objective, the recommendations
and the note that sets an objective's picks beside throughput's. No servers: measured
launches are built by hand."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from synthetic import spec

from treetune.config import BASELINE, TreeConfig
from treetune.errors import TreetuneError
from treetune.objectives import Criterion, Objective
from treetune.results import CellResult, Latency, LaunchResult, Slo
from treetune.study.evidence import judge, merge, study_noise
from treetune.study.export import write_outputs
from treetune.study.recommend import objective_note, recommend
from treetune.study.spec import load_study
from treetune.yamlio import dump_yaml

CHAIN, WIDE = TreeConfig(3, 1, 4), TreeConfig(3, 4, 8)


def cell(tput: float, tpot_ms: float, *, batch: int = 32, rate: float | None = None,
         ttft_ms: float = 100.0, goodput: float | None = None, unfinished: int = 0,
         requests: int = 100) -> CellResult:
    tpot = Latency(tpot_ms * 0.8e-3, tpot_ms * 0.9e-3, tpot_ms * 1e-3)
    ttft = Latency(ttft_ms * 0.5e-3, ttft_ms * 0.8e-3, ttft_ms * 1e-3)
    return CellResult("sharegpt", 0 if rate is not None else batch, tput, None, requests,
                      1000, 20.0, ttft, tpot, rate=rate, arrival="poisson" if rate else "",
                      goodput=goodput, unfinished=unfinished,
                      slo=Slo(tpot_ms=25) if goodput is not None else None)


def launch(config, closed: CellResult, *rates: CellResult) -> LaunchResult:
    return LaunchResult(config, ok=True, cells=[closed], rate_cells=list(rates))


# The shape studies/slo.yaml measures: at 32 concurrent requests the chain delivers the
# most tokens/s (the wide tree's verify pass costs), while at 2 requests/s, where the
# running batch stays small, the wide tree cuts p99 TPOT the most.
BASE = launch(BASELINE, cell(1000, 30.0), cell(500, 12.0, rate=2.0))
CHAIN_RUN = launch(CHAIN, cell(1500, 20.0), cell(500, 7.0, rate=2.0))
WIDE_RUN = launch(WIDE, cell(1400, 21.0), cell(500, 5.0, rate=2.0))


def study(tmp_path, **over):
    return spec(tmp_path, **{"datasets": ["sharegpt"], "batch": [32], "rates": [2],
                             "slo": {"tpot_ms": 25}, **over})


def by(recs, workload, batch):
    return next(r for r in recs if r.workload == workload and r.batch == batch)


# ---- what a speedup means ---------------------------------------------------------------

def test_a_latency_speedup_is_the_baselines_latency_over_the_trees():
    objective = Objective.TPOT_P99
    assert objective.value_of(cell(1000, 30.0)) == pytest.approx(30.0)
    assert objective.ratio(20.0, 30.0) == pytest.approx(1.5)  # 30 ms -> 20 ms
    assert objective.ratio(40.0, 30.0) == pytest.approx(0.75)  # worse: below the floor
    assert Objective.THROUGHPUT.ratio(1500, 1000) == pytest.approx(1.5)


def test_unfinished_requests_beyond_the_percentiles_reach_make_it_unbounded():
    # 2 of 100 requests never finished: the p99 is one of them, the p50 is not.
    overloaded = cell(500, 10.0, rate=2.0, requests=98, unfinished=2)
    assert math.isinf(Objective.TPOT_P99.value_of(overloaded))
    assert Objective.TPOT_P50.value_of(overloaded) == pytest.approx(8.0)
    assert Objective.TPOT_P99.ratio(math.inf, 10.0) == 0.0


def test_goodput_never_divides_by_zero_when_nobody_met_the_slo():
    never = cell(1000, 30.0, goodput=0.0)
    assert Objective.GOODPUT.value_of(never) == pytest.approx(0.5 / 20.0)
    assert Objective.GOODPUT.ratio(Objective.GOODPUT.value_of(cell(1, 1, goodput=2.0)),
                                   Objective.GOODPUT.value_of(never)) == pytest.approx(80.0)


# ---- which cells a verdict judges -------------------------------------------------------

def test_rate_cells_join_the_largest_batch_sizes_verdict_except_under_throughput():
    tpot = Criterion(Objective.TPOT_P99, (2.0, 6.0), 32)
    assert [k.name for k in tpot.cells(["sharegpt"], 32)] == [
        "sharegpt", "sharegpt at 2 req/s", "sharegpt at 6 req/s"]
    assert [k.name for k in tpot.cells(["sharegpt"], 1)] == ["sharegpt"]
    through = Criterion(Objective.THROUGHPUT, (2.0, 6.0), 32)
    assert [k.name for k in through.cells(["sharegpt"], 32)] == ["sharegpt"]


def test_a_tree_that_makes_p99_tpot_worse_in_a_rate_cell_is_infeasible():
    worse = launch(WIDE, cell(1400, 21.0), cell(500, 13.0, rate=2.0))
    criterion = Criterion(Objective.TPOT_P99, (2.0,), 32)
    noise = study_noise([BASE, worse], 0.0, Objective.TPOT_P99)
    verdict = judge(worse, BASE, 32, ["sharegpt"], 0.0, noise, criterion=criterion)
    assert verdict.intervals["sharegpt"].mean == pytest.approx(30 / 21)
    assert verdict.intervals["sharegpt at 2 req/s"].mean == pytest.approx(12 / 13)
    assert not verdict.feasible
    # Under throughput the same launch is judged at the closed loop alone, and passes.
    plain = judge(worse, BASE, 32, ["sharegpt"], 0.0, study_noise([BASE, worse], 0.0))
    assert plain.feasible and set(plain.intervals) == {"sharegpt"}


# ---- noise per objective ----------------------------------------------------------------

def test_the_launch_noise_of_a_latency_is_learned_from_its_own_spread_across_launches():
    again = launch(BASELINE, cell(1000, 33.0), cell(500, 10.0, rate=2.0))
    merged = merge([BASE, again])
    assert merged.cells[0].tpot.p99 == pytest.approx(31.5e-3)
    assert [m["tpot_p99"] for m in merged.cells[0].launch_metrics] == pytest.approx([30, 33])
    assert merged.rate_cells[0].launch_tok_s == (500, 500)
    latency = study_noise([merged], 0.03, Objective.TPOT_P99)
    throughput = study_noise([merged], 0.03)
    # Throughput did not move between the launches; p99 TPOT moved by 10% and 18%.
    assert latency.launch_dof == 2 and latency.launch_cv > 0.06
    assert throughput.launch_cv < latency.launch_cv


# ---- recommendations --------------------------------------------------------------------

def test_the_objective_picks_another_tree_than_throughput_and_the_note_shows_both(tmp_path):
    results = [BASE, CHAIN_RUN, WIDE_RUN]
    s = study(tmp_path, objective="tpot_p99", search={"launch_cv": 0.0,
                                                      "max_launches_per_config": 1})
    mine = recommend(s, results, BASE)
    theirs = recommend(s, results, BASE, objective=Objective.THROUGHPUT)
    # p99 TPOT: chain 30/20 = 1.5 and 12/7 = 1.71; wide 30/21 = 1.43 and 12/5 = 2.4.
    assert by(mine, "mixed", 32).config == WIDE
    assert by(mine, "mixed", 32).speedups == pytest.approx(
        {"sharegpt": 30 / 21, "sharegpt at 2 req/s": 12 / 5})
    assert by(theirs, "mixed", 32).config == CHAIN
    note = objective_note(mine, theirs)
    assert note is not None and "changes the pick" in note
    assert "p99 TPOT picks (3,4,8)" in note and "throughput picks (3,1,4)" in note
    assert objective_note(theirs, theirs) is None


def test_outputs_name_the_objective_in_records_yaml_and_launch_script_headers(tmp_path):
    s = study(tmp_path, objective="tpot_p99", search={"launch_cv": 0.0,
                                                      "max_launches_per_config": 1})
    recs = recommend(s, [BASE, CHAIN_RUN, WIDE_RUN], BASE)
    write_outputs(s, recs, s.output_dir, note="objective p99 TPOT changes the pick: ...")
    records = json.loads((s.output_dir / "recommendations.json").read_text())
    assert {r["objective"] for r in records} == {"tpot_p99"}
    text = (s.output_dir / "recommendations.yaml").read_text()
    assert "objective: tpot_p99" in text and "objective_note:" in text
    script = (s.output_dir / "launch" / "mixed-batch32.sh").read_text()
    assert ("# objective: p99 TPOT (lower is better; speedup = no speculation's p99 TPOT / "
            "tree's); SLO tpot <= 25 ms") in script


def test_a_throughput_study_keeps_its_records_and_ignores_rate_cells(tmp_path):
    s = study(tmp_path)
    recs = recommend(s, [BASE, CHAIN_RUN, WIDE_RUN], BASE)
    assert by(recs, "mixed", 32).config == CHAIN
    assert set(by(recs, "mixed", 32).speedups) == {"sharegpt"}
    assert by(recs, "mixed", 32).record()["objective"] == "throughput"


# ---- the study file ---------------------------------------------------------------------

def test_objective_is_a_study_field_and_an_option_and_changes_the_fingerprint(tmp_path):
    plain = study(tmp_path)
    tpot = study(tmp_path, objective="tpot_p99")
    assert plain.objective is Objective.THROUGHPUT and tpot.objective is Objective.TPOT_P99
    assert plain.fingerprint() == study(tmp_path, objective="throughput").fingerprint()
    assert tpot.fingerprint() != plain.fingerprint()
    tpot.save(tmp_path / "copy.yaml")
    assert load_study(tmp_path / "copy.yaml").objective is Objective.TPOT_P99


@pytest.mark.parametrize("over,match", [
    ({"objective": "p99"}, r"objective must be one of throughput, tpot_p50, tpot_p99"),
    ({"objective": "goodput", "slo": {}}, r"objective goodput counts requests within the slo"),
])
def test_a_bad_objective_is_refused_naming_its_key(tmp_path, over, match):
    path = tmp_path / "study.yaml"
    dump_yaml({"name": "t", "model": "m", "draft": "d", "datasets": ["sharegpt"],
               "batch": [8], **over}, path)
    with pytest.raises(TreetuneError, match=rf"study\.yaml.*key 'objective'.*{match}"):
        load_study(path)


def test_the_per_batch_optuna_constraints_cover_the_rate_cells(tmp_path):
    import optuna

    from treetune.study.storage import StudyStore

    s = study(tmp_path, objective="tpot_p99")
    store = StudyStore(s, storage=optuna.storages.InMemoryStorage())
    value, constraints = store.objective(32, WIDE_RUN, BASE)
    assert value == pytest.approx((30 / 21 + 12 / 5) / 2)
    assert set(constraints) == {"regression:sharegpt", "regression:sharegpt at 2 req/s"}
    failed = store.objective(32, LaunchResult(WIDE), BASE)[1]
    assert set(failed) == set(constraints)


# ---- studies/slo.yaml, made small: every launch a real emulated server --------------------

@pytest.mark.slow
@pytest.mark.usefixtures("ray_tmpdir")
def test_the_slo_study_runs_on_ray_judging_p99_tpot_in_every_cell(tmp_path, ray_cluster):
    # On the session's Ray cluster: starting Ray is not what this test is about.
    from pathlib import Path

    from treetune.report import figures
    from treetune.report.data import load_study_data
    from treetune.study.runner import run_study

    spec = load_study(Path(__file__).resolve().parents[1] / "studies" / "slo.yaml", {
        "batch": [16], "rates": [4], "compare": ["3,1,4", "3,4,8"],
        "budget": {"launches": 3}, "search": {"max_launches_per_config": 1},
        "model": f"{tmp_path}/model-under-test", "output": str(tmp_path / "out"),
        "backend": {"time_scale": 10.0, "load_time_s": 5.0}, "ray_address": ray_cluster,
        "measurement": {"duration_s": 6.0, "repeats": 2, "startup_timeout_s": 60.0,
                        "max_clock_lag_s": 0.25}})
    outcome = run_study(spec)
    assert [r.ok for r in outcome.results] == [True] * 3
    base = outcome.baseline
    assert base is not None and base.rate_cell("sharegpt", 4.0) is not None
    rec = next(r for r in outcome.recommendations if r.workload == "mixed")
    assert rec.objective == "tpot_p99"
    assert set(rec.speedups) == {"sharegpt", "sharegpt at 4 req/s"}
    if rec.config is not BASELINE:
        # The recorded speedups are the baseline's p99 TPOT over the tree's, cell by cell,
        # and the tree is surely no worse than no speculation in each.
        tree = next(r for r in outcome.results if r.config == rec.config)
        assert rec.speedups["sharegpt"] == pytest.approx(
            base.cell("sharegpt", 16).tpot.p99 / tree.cell("sharegpt", 16).tpot.p99)
        assert rec.speedups["sharegpt at 4 req/s"] == pytest.approx(
            base.rate_cell("sharegpt", 4.0).tpot.p99 / tree.rate_cell("sharegpt", 4.0).tpot.p99)
        assert min(lo for lo, _ in rec.intervals.values()) >= 1.0
    theirs = recommend(spec, outcome.results, base, objective=Objective.THROUGHPUT)
    assert set(by(theirs, "mixed", 16).speedups) == {"sharegpt"}
    note = objective_note(outcome.recommendations, theirs)
    assert note is not None and "p99 TPOT picks" in note and "throughput picks" in note
    write_outputs(spec, outcome.recommendations, spec.output_dir, note)
    fig = figures.latency_vs_throughput(load_study_data(spec.output_dir))
    assert {t.name for t in fig.data if t.showlegend is not False} == {"batch 16", "4 req/s"}
    assert [s.y0 for s in fig.layout.shapes] == [25.0]  # the SLO, drawn


def test_the_regression_map_shows_the_rate_cells_a_latency_objective_judges(tmp_path):
    """A tree that regresses only at a rate must show a red cell there: the verdicts the
    recommendation rests on judge that cell with the batch size's server."""
    from treetune.report import figures
    from treetune.report.data import StudyData

    slow_at_rate = launch(WIDE, cell(1400, 21.0), cell(500, 14.0, rate=2.0))
    s = study(tmp_path, objective="tpot_p99")
    results = [BASE, CHAIN_RUN, slow_at_rate]
    data = StudyData(s, results, BASE, recommend(s, results, BASE), s.storage_url, tmp_path)
    heat = figures.regression_map(data).data[0]
    assert list(heat.x) == ["sharegpt @ batch 32", "sharegpt at 2 req/s (batch 32's server)"]
    value = heat.z[list(heat.y).index(WIDE.label())][1]
    assert value == pytest.approx(12.0 / 14.0)
    assert heat.text[list(heat.y).index(WIDE.label())][1] == f"{12.0 / 14.0:.2f}"


def test_a_rate_no_speculation_cannot_keep_up_with_compares_the_servers_by_capacity(
        tmp_path):
    """At a rate beyond no speculation's capacity its p99 TPOT is unbounded. A tree that
    keeps up was 'inf' times faster there, which made every such tree's rank inf (the pick
    arbitrary, `Infinity` in recommendations.json); a tree saturated too was 0 (vetoed,
    though it completed more). Both are judged by what the servers complete."""
    base = launch(BASELINE, cell(1000, 30.0),
                  cell(2000, 12.0, rate=20.0, requests=150, unfinished=250))
    keeps_up = launch(CHAIN, cell(1500, 20.0), cell(5000, 9.0, rate=20.0, requests=400))
    faster = launch(TreeConfig(4, 1, 5), cell(1600, 19.0),
                    cell(5000, 8.0, rate=20.0, requests=400))
    saturated = launch(WIDE, cell(1400, 21.0),
                       cell(3800, 11.0, rate=20.0, requests=285, unfinished=115))
    s = study(tmp_path, rates=[20], objective="tpot_p99")
    noise = study_noise([], 0.0, Objective.TPOT_P99)
    verdicts = {r.config: judge(r, base, 32, ["sharegpt"], s.tolerance, noise,
                                criterion=s.criterion) for r in (keeps_up, faster, saturated)}
    at_rate = "sharegpt at 20 req/s"
    assert verdicts[CHAIN].intervals[at_rate].mean == pytest.approx(2.5)
    assert verdicts[WIDE].intervals[at_rate].mean == pytest.approx(1.9)
    assert all(math.isfinite(v.rank) and v.feasible for v in verdicts.values())
    pick = by(recommend(s, [base, keeps_up, saturated, faster], base), "mixed", 32)
    assert pick.config == TreeConfig(4, 1, 5), "the finite cells decide between keepers"
    json.dumps(pick.record(), allow_nan=False)  # strict JSON: no Infinity


def test_a_goodput_of_none_met_is_floored_alike_for_servers_whose_windows_differ():
    """No request met the SLO on either server: their goodputs are equal (0), whatever
    their windows (a slower server's ends later). The floor was half a request per
    measured window, which made 1.04-1.59x 'speedups' out of window lengths."""
    slow = dataclasses.replace(cell(500, 30.0, rate=2.0, goodput=0.0), duration_s=20.0)
    fast = dataclasses.replace(cell(500, 9.0, rate=2.0, goodput=0.0), duration_s=12.6)
    objective = Objective.GOODPUT
    assert objective.ratio(objective.value_of(fast), objective.value_of(slow)) == 1.0


def test_a_launch_without_its_rate_cell_yet_is_no_red_zero_in_the_figures(tmp_path):
    """A launch being measured (or cut short) before its rate cell: not a regression of
    0.00 in the map and 'regresses' in the Pareto legend, but not shown yet (a review)."""
    from treetune.report import figures
    from treetune.report.data import StudyData

    s = study(tmp_path, objective="tpot_p99")
    partial = LaunchResult(WIDE, ok=True, cells=[cell(1400, 21.0)])
    results = [BASE, CHAIN_RUN, partial]
    data = StudyData(s, results, BASE, recommend(s, results, BASE), s.storage_url, tmp_path)
    assert {r.config for r in data.rows()} == {CHAIN}
    assert list(figures.regression_map(data).data[0].y) == [CHAIN.label()]
