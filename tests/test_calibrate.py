"""`treetune calibrate` takes what people publish (speedups without throughputs, nulls,
several studies in one file), names the entry the user wrote when it refuses one, and
fits only what the points determine."""

import dataclasses
import math
import re
from pathlib import Path

import pytest
import yaml
from studykit import run_cli

from treetune.config import BASELINE, TreeConfig
from treetune.errors import ConfigFileError
from treetune.perfmodel import PerfModel, load_profile
from treetune.perfmodel.calibrate import (
    Measurement,
    calibrate,
    declared_target,
    free_parameters,
    get_value,
    identify,
    load_measurements,
    set_values,
)

PRIOR = load_profile("qwen3-30b-a3b-h100")
# What the measured server "is": the prior with other overheads and acceptance.
TRUTH = PRIOR.replace(
    calibration=dataclasses.replace(PRIOR.calibration, step_overhead_ms=3.0,
                                    token_overhead_us=8.0),
    datasets={**PRIOR.datasets, "humaneval": dataclasses.replace(
        PRIOR.datasets["humaneval"], acceptance=dataclasses.replace(
            PRIOR.datasets["humaneval"].acceptance, top1=0.72))})
CELLS = [((3, 4, 8), 1), ((3, 4, 8), 32), ((5, 1, 6), 32)]


def true_speedup(tree, batch, dataset) -> float:
    model, config = PerfModel(TRUTH), TreeConfig.of(*tree)
    return model.throughput(config, batch, dataset) / model.throughput(BASELINE, batch, dataset)


def speedup_points(datasets=("mt-bench", "humaneval")) -> list[dict]:
    return [dict(steps=t[0], topk=t[1], draft_tokens=t[2], batch=b, dataset=d,
                 speedup=round(true_speedup(t, b, d), 4))
            for t, b in CELLS for d in datasets]


def write(tmp_path, name: str, data) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return str(path)


def test_speedup_only_yaml_points_are_accepted_and_fitted(capsys, tmp_path):
    data = write(tmp_path, "points.yaml", {"points": speedup_points()})
    points = load_measurements(data)
    assert all(m.baseline_tok_s is None and m.spec_tok_s is None for m in points)
    out_path = tmp_path / "fitted.yaml"
    code, out, err = run_cli(capsys, "calibrate", "-p", "qwen3-30b-a3b-h100",
                             "--measurements", data, "-o", str(out_path), "--starts", "2")
    assert code == 0, err
    assert "no point has a baseline throughput" in err and "n/a (speedups only)" in out
    assert load_profile(out_path).name == "fitted"  # the file's, not the base profile's
    fitted = PerfModel(load_profile(out_path))
    for p in speedup_points():
        config = TreeConfig.of(p["steps"], p["topk"], p["draft_tokens"])
        assert fitted.predict(config, p["dataset"], p["batch"]).speedup == pytest.approx(
            p["speedup"], abs=0.02)
    # Speedups fix ratios only: the fitted model does not claim to know absolute speed,
    # it keeps at least one of the time costs where the profile had it.
    times = {"calibration.step_overhead_ms", "calibration.draft_overhead_ms",
             "calibration.round_overhead_ms", "calibration.token_overhead_us",
             "calibration.weight_bandwidth_eff", "calibration.compute_eff"}
    result = calibrate(PRIOR, points, free_parameters(PRIOR, points), starts=1,
                       keep_unidentified=True)
    assert times & set(result.kept)


def test_speedup_only_csv_points_are_accepted_with_empty_throughput_cells(tmp_path):
    rows = speedup_points()
    header = "steps,topk,draft_tokens,batch,dataset,baseline_tok_s,spec_tok_s,speedup\n"
    body = "".join(f"{r['steps']},{r['topk']},{r['draft_tokens']},{r['batch']},{r['dataset']}"
                   f",,,{r['speedup']}\n" for r in rows)
    points = load_measurements(write(tmp_path, "points.csv", header + body))
    assert [m.speedup for m in points] == [r["speedup"] for r in rows]
    result = calibrate(PRIOR, points, starts=1, keep_unidentified=True)
    assert result.max_speedup_error < 0.02 and result.max_baseline_error is None


def test_a_null_baseline_is_accepted_when_a_speedup_is_given(tmp_path):
    data = write(tmp_path, "published.yaml", """\
mine:
  runs:
    - batch: 32
      tree: [3, 4, 8]
      results:
        mt-bench: [null, 2009.4, 1.31]      # the baseline follows from spec / speedup
        humaneval: [null, null, 1.03]       # a speedup only
        terminal-bench: {speedup: 0.89, accept_length: 2.4}
    - batch: 1
      tree: [3, 4, 8]
      results:
        mt-bench: [166.5, 196.0]            # throughputs only
""")
    chat, code, terminal, single = load_measurements(data, "mine")
    assert chat.baseline_tok_s == pytest.approx(2009.4 / 1.31) and chat.speedup == 1.31
    assert code.baseline_tok_s is None and code.speedup == 1.03
    assert terminal.speedup == 0.89 and terminal.accept_length == 2.4
    assert single.speedup == pytest.approx(196.0 / 166.5)


def line_of(path: str, text: str, after: str = "") -> int:
    lines = Path(path).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if after in line) if after else 0
    return next(i for i, line in enumerate(lines) if i >= start and text in line) + 1


@pytest.mark.parametrize(("cell", "fragment"), [
    ("[null, null, null]", "give baseline_tok_s and spec_tok_s, or a speedup"),
    ("[100, 150, 1.9]", "1.9 disagrees with spec_tok_s / baseline_tok_s = 1.500"),
    ("[100, -5]", "must be > 0"),
    ("fast", "expected [baseline_tok_s, spec_tok_s, speedup]"),
])
def test_a_refused_published_cell_is_named_as_the_file_writes_it_with_its_line(
        capsys, tmp_path, cell, fragment):
    data = write(tmp_path, "measurements.yaml", f"""\
other: {{runs: []}}
mine:
  source: a blog post
  runs:
    - batch: 1
      tree: [3, 4, 8]
      results:
        humaneval: [171.1, 237.9, 1.39]
    - batch: 32
      tree: [3, 4, 8]
      results:
        mt-bench: [1529.1, 2009.4, 1.31]
        humaneval: {cell}
""")
    with pytest.raises(ConfigFileError) as exc:
        load_measurements(data, "mine")
    message = str(exc.value)
    line = line_of(data, "humaneval:", after="batch: 32")
    assert f"measurements.yaml, line {line}: key 'mine.runs[1].results.humaneval" in message
    assert fragment in message and "points[" not in message
    code, _, err = run_cli(capsys, "calibrate", "-p", "qwen3-30b-a3b-h100", "--entry", "mine",
                           "--measurements", data, "-o", str(tmp_path / "out.yaml"))
    assert code == 2 and f"line {line}" in err


def test_a_refused_point_names_its_key_or_csv_line(tmp_path):
    points = speedup_points()
    points[2]["speedup"] = "fast"
    data = write(tmp_path, "points.yaml", {"points": points})
    with pytest.raises(ConfigFileError) as exc:
        load_measurements(data)
    assert "key 'points[2].speedup'" in str(exc.value)
    assert f"line {line_of(data, 'speedup: fast')}" in str(exc.value)
    bare = write(tmp_path, "bare.yaml", yaml.safe_dump(points, sort_keys=False))
    with pytest.raises(ConfigFileError) as exc:
        load_measurements(bare)
    assert "points[2].speedup" in str(exc.value)
    assert f"line {line_of(bare, 'speedup: fast')}" in str(exc.value)
    csv = write(tmp_path, "points.csv", "steps,topk,draft_tokens,batch,dataset,speedup\n"
                "3,4,8,1,mt-bench,1.2\n3,4,8,32,mt-bench,\n")
    with pytest.raises(ConfigFileError, match=r"points\.csv: line 3: no baseline_tok_s"):
        load_measurements(csv)
    misspelt = write(tmp_path, "misspelt.csv", "steps,topk,draft_tokens,batch,dataset,speedups\n"
                     "3,4,8,1,mt-bench,1.2\n")
    with pytest.raises(ConfigFileError, match=r"line 1: unknown column 'speedups' "
                       r"\(did you mean 'speedup'\?\)"):
        load_measurements(misspelt)


@pytest.mark.parametrize("accept", ["9.5", "0.5"])
def test_an_accept_length_no_server_can_have_is_refused_on_its_line(tmp_path, accept):
    # SGLang's accept length counts the bonus token: from 1 to steps + 1 (4 for (3,1,4)).
    data = write(tmp_path, "points.csv", "steps,topk,draft_tokens,batch,dataset,baseline_tok_s,"
                 f"spec_tok_s,accept_length\n3,1,4,1,mt-bench,150,250,{accept}\n")
    with pytest.raises(ConfigFileError, match=r"line 2: column 'accept_length': must be "
                       rf"between 1 and steps \+ 1 = 4 .*got {accept}"):
        load_measurements(data)


def test_the_calibration_table_shows_measured_against_predicted_accept_lengths(
        capsys, tmp_path):
    data = write(tmp_path, "points.csv", "steps,topk,draft_tokens,batch,dataset,baseline_tok_s,"
                 "spec_tok_s,accept_length\n3,1,4,1,mt-bench,150,250,3.5\n"
                 "3,4,8,1,mt-bench,150,270,\n")
    out_path = tmp_path / "fit.yaml"
    code, out, err = run_cli(capsys, "calibrate", "-p", "qwen3-8b-h100", "--measurements",
                             data, "-o", str(out_path), "--starts", "1")
    assert code == 0, err
    predicted = PerfModel(load_profile(str(out_path))).accept_length(
        TreeConfig(3, 1, 4), "mt-bench")
    row = next(line for line in out.splitlines() if "(3,1,4)" in line)
    assert "accept length" in out and "3.50" in row and f"{predicted:.2f}" in row
    assert "n/a" in next(line for line in out.splitlines() if "(3,4,8)" in line)


def test_four_points_cannot_determine_twenty_parameters_and_the_rest_stay_at_the_prior(
        capsys, tmp_path):
    datasets = ("mt-bench", "humaneval", "sharegpt", "swebench-verified")
    four = [p for p in speedup_points(datasets) if p["batch"] == 32 and p["topk"] == 4]
    assert len(four) == 4
    points = load_measurements(write(tmp_path, "four.yaml", four))
    params = free_parameters(PRIOR, points)
    assert len(params) >= 20
    ident = identify(PRIOR, points, params)
    assert 1 <= len(ident.fitted) <= len(points) and len(ident.kept) >= len(params) - 4
    result = calibrate(PRIOR, points, params, starts=2, keep_unidentified=True)
    assert "calibration.draft_overhead_ms" in result.kept
    for name in result.kept:  # left exactly as the profile has them
        assert get_value(result.profile, name) == get_value(PRIOR, name), name
    assert result.max_speedup_error < 0.02

    out_path = tmp_path / "fitted.yaml"
    code, _, err = run_cli(capsys, "calibrate", "-p", "qwen3-30b-a3b-h100", "--measurements",
                           str(tmp_path / "four.yaml"), "-o", str(out_path), "--starts", "2")
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert code == 0 and len(warnings) == 1
    assert "4 points cannot determine" in warnings[0]
    assert "calibration.draft_overhead_ms" in warnings[0]
    fitted = load_profile(out_path)
    assert fitted.calibration.draft_overhead_ms == PRIOR.calibration.draft_overhead_ms


def test_a_pair_that_only_acts_together_is_not_fitted_twice():
    # KV bandwidth only ever divides the KV bytes a context makes: many points with
    # throughputs determine the product, so one of the two stays where it was.
    model, points = PerfModel(TRUTH), []
    for tree in ((3, 4, 8), (5, 1, 6), (2, 4, 6), (6, 4, 24)):
        config = TreeConfig.of(*tree)
        for batch in (1, 16, 64):
            points.append(Measurement(
                config, batch, "mt-bench", model.throughput(BASELINE, batch, "mt-bench"),
                model.throughput(config, batch, "mt-bench"),
                model.accept_length(config, "mt-bench")))
    fitted = {p.name for p in identify(PRIOR, points).fitted}
    assert not {"calibration.kv_bandwidth_eff", "datasets.mt-bench.context_tokens"} <= fitted
    assert "datasets.mt-bench.acceptance.top1" in fitted


def test_a_parameter_of_every_dataset_is_set_in_each_and_read_as_one():
    name = "datasets.*.acceptance.rank_ratio"
    changed = set_values(PRIOR, {name: 0.2, "datasets.humaneval.acceptance.top1": 0.7})
    assert {d: data.acceptance.rank_ratio for d, data in changed.datasets.items()} == {
        d: 0.2 for d in PRIOR.datasets}
    assert get_value(changed, name) == 0.2
    assert changed.datasets["humaneval"].acceptance.top1 == 0.7
    assert changed.datasets["mt-bench"].acceptance.top1 == PRIOR.datasets[
        "mt-bench"].acceptance.top1


def test_a_point_of_a_dataset_the_profile_lacks_and_an_entry_the_file_has_not_are_refused(
        tmp_path, capsys):
    """A dataset the profile cannot fit is named on the point's line before any fitting;
    --entry on a file of one set of points, and --starts below 1, are refused, not
    ignored."""
    points = speedup_points()
    points[1]["dataset"] = "mtbench"
    data = write(tmp_path, "points.yaml", {"points": points})
    with pytest.raises(ConfigFileError) as exc:
        load_measurements(data, datasets=["mt-bench", "humaneval"])
    message = str(exc.value)
    assert "key 'points[1].dataset'" in message and f"line {line_of(data, 'mtbench')}" in message
    assert "(did you mean 'mt-bench'?)" in message
    csv = write(tmp_path, "points.csv", "steps,topk,draft_tokens,batch,dataset,speedup\n"
                "3,4,8,1,mt-bench,1.2\n")
    with pytest.raises(ConfigFileError, match="--entry mine: a CSV file holds one set"):
        load_measurements(csv, "mine")
    out = str(tmp_path / "fit.yaml")
    code, _, err = run_cli(capsys, "calibrate", "-p", "qwen3-8b-h100", "--measurements",
                           str(csv), "--starts", "0", "-o", out)
    assert code == 2 and "--starts must be >= 1" in err


def test_a_file_of_one_entry_is_read_without_entry_and_several_ask_for_it(tmp_path):
    """A published-results file of one entry was refused as if it held several (a helper's
    audit); its points are named under the entry, as with --entry."""
    one = write(tmp_path, "one.yaml", {"mine": {"points": speedup_points(),
                                                "target": {"name": "deepseek-ai/DeepSeek-V3"}}})
    assert load_measurements(one) == load_measurements(one, "mine")
    assert declared_target(one) == "deepseek-ai/DeepSeek-V3"  # its target named too
    points = speedup_points()
    points[0]["dataset"] = "mtbench"
    bad = write(tmp_path, "bad.yaml", {"mine": {"points": points}})
    with pytest.raises(ConfigFileError, match=r"key 'mine\.points\[0\]\.dataset'"):
        load_measurements(bad, datasets=["mt-bench", "humaneval"])
    two = write(tmp_path, "two.yaml", {"a": {"points": speedup_points()},
                                       "b": {"points": speedup_points()}})
    with pytest.raises(ConfigFileError, match="this file has several entries: pick one"):
        load_measurements(two)
    # CSV text in a file not named *.csv is read as YAML: said so.
    text = write(tmp_path, "points.txt", "steps,topk,draft_tokens,batch,dataset,speedup\n"
                 "3,4,8,1,mt-bench,1.2\n")
    with pytest.raises(ConfigFileError, match=r"read as YAML, as its name does not end in "
                       r"\.csv"):
        load_measurements(text)


def test_the_measurements_file_is_never_the_output(capsys, tmp_path):
    data = write(tmp_path, "points.yaml", {"points": speedup_points()})
    before = Path(data).read_text()
    code, _, err = run_cli(capsys, "calibrate", "-p", "qwen3-30b-a3b-h100", "--measurements",
                           data, "-o", data)
    assert code == 2 and "is the measurements file" in err
    assert Path(data).read_text() == before


def test_points_the_fit_misses_by_more_than_noise_are_warned_about(capsys, tmp_path):
    """Two measurements of one cell that contradict each other: no profile fits both, and
    a profile written without a word would be used as if it did (a helper's audit)."""
    rows = "steps,topk,draft_tokens,batch,dataset,speedup\n"
    rows += "".join(f"{t[0]},{t[1]},{t[2]},{b},mt-bench,{true_speedup(t, b, 'mt-bench'):.4f}\n"
                    for t, b in CELLS)
    good = write(tmp_path, "good.csv", rows)
    bad = write(tmp_path, "bad.csv", rows + "3,4,8,1,mt-bench,0.6\n")
    for data, warned in ((good, False), (bad, True)):
        code, _, err = run_cli(capsys, "calibrate", "-p", "qwen3-30b-a3b-h100",
                               "--measurements", data, "-o", str(tmp_path / "fit.yaml"),
                               "--starts", "2")
        assert code == 0, err
        text = " ".join(err.split())
        assert ("misses 2 of the 4 points by more than 10% (worst: (3,4,8) at batch 1 on "
                "mt-bench" in text) == warned, text


def test_a_dataset_with_measured_per_position_acceptance_keeps_it_and_says_so(capsys,
                                                                             tmp_path):
    """Its top-1 per position overrides top1, which no point can then move: fitting it
    only reported it as undetermined by too few points (a helper's audit)."""
    prior = load_profile("qwen3-8b-h100")
    assert prior.datasets["sharegpt"].acceptance.top1_by_position
    rows = [dict(steps=3, topk=1, draft_tokens=4, batch=1, dataset="sharegpt", speedup=1.5)]
    points = load_measurements(write(tmp_path, "sg.yaml", rows))
    names = [p.name for p in free_parameters(prior, points)]
    assert "datasets.sharegpt.acceptance.top1" not in names
    assert "datasets.sharegpt.acceptance.rank_mass" in names
    code, _, err = run_cli(capsys, "calibrate", "-p", "qwen3-8b-h100", "--measurements",
                           str(tmp_path / "sg.yaml"), "-o", str(tmp_path / "fit.yaml"),
                           "--starts", "1")
    assert code == 0, err
    assert "per draft position (top1_by_position, measured): it is kept as given" in " ".join(
        err.split())


@pytest.mark.parametrize(("header", "message"), [
    ("steps,topk,draft_tokens,batch,Dataset,speedup",
     "line 1: unknown column 'Dataset' (did you mean 'dataset'?)"),
    ("steps,topk,draft_tokens,batch,dataset,speedup,notes", "line 1: unknown column 'notes'"),
    ("steps,topk,draft_tokens,batch,dataset,speedup,speedup",
     "line 1: column 'speedup' is given twice"),
    ("steps\ttopk\tdraft_tokens\tbatch\tdataset\tspeedup",
     "line 1: the header is one column holding tabs or semicolons"),
])
def test_a_csv_header_is_checked_before_its_values(tmp_path, header, message):
    """A misspelt or extra column was reported as a value that is not a number, and a
    second column of one name silently replaced the first (a helper's audit)."""
    sep = "\t" if "\t" in header else ","
    row = sep.join(["3", "4", "8", "1", "mt-bench", "1.5", "hello"][:header.count(sep) + 1])
    data = write(tmp_path, "points.csv", f"{header}\n{row}\n")
    with pytest.raises(ConfigFileError, match=re.escape(message)):
        load_measurements(data)


def test_a_trailing_comma_is_no_column(tmp_path):
    data = write(tmp_path, "points.csv", "steps,topk,draft_tokens,batch,dataset,speedup,\n"
                 "3,4,8,1,mt-bench,1.5,\n")
    assert [m.speedup for m in load_measurements(data)] == [1.5]


@pytest.mark.parametrize(("target", "warned"), [("meta-llama/Llama-3.1-70B-Instruct", True),
                                                ("Qwen3-30B-A3B", False)])
def test_points_of_another_model_than_the_profile_s_are_warned_about(capsys, tmp_path, target,
                                                                     warned):
    data = write(tmp_path, "measurements.yaml", f"""\
mine:
  target: {{name: {target}}}
  runs:
    - batch: 1
      tree: [3, 4, 8]
      results:
        humaneval: [171.1, 237.9, 1.39]
""")
    code, _, err = run_cli(capsys, "calibrate", "-p", "qwen3-30b-a3b-h100", "--entry", "mine",
                           "--measurements", data, "-o", str(tmp_path / "out.yaml"),
                           "--starts", "1")
    assert code == 0, err
    text = " ".join(err.split())
    assert (f"the points are of {target}" in text) == warned, text
    if warned:
        assert "the profile of Qwen/Qwen3-30B-A3B" in text


# ---- a fit that a few cells cannot drag ---------------------------------------------------

CLIFF_TREES = [(1, 1, 2), (2, 1, 3), (3, 1, 4), (3, 2, 6), (4, 2, 8), (3, 4, 8), (5, 2, 10),
               (4, 4, 12), (5, 4, 16)]


def cliff_points(jump: float) -> tuple[list[Measurement], list[tuple]]:
    """TRUTH's cells of CLIFF_TREES at batch 1 and 32 on two datasets, each launch's own,
    with the verify step `jump` slower (a throughput `1 - jump`) where a batch's draft
    tokens pass 256, as a kernel's tile or a CUDA graph's bucket does on a real GPU: the
    three widest trees at batch 32, a sixth of the cells. Returns the points and the
    cells the cliff spares (every cell when `jump` is 0)."""
    model, points, spared = PerfModel(TRUTH), [], []
    for tree in CLIFF_TREES:
        config = TreeConfig.of(*tree)
        for batch in (1, 32):
            hit = jump > 0 and batch * config.draft_tokens > 256
            for dataset in ("mt-bench", "humaneval"):
                points.append(Measurement(
                    config, batch, dataset, model.throughput(BASELINE, batch, dataset),
                    model.throughput(config, batch, dataset) * (1 - jump if hit else 1.0),
                    accept_length=model.accept_length(config, dataset),
                    launch=config.label()))
                if not hit:
                    spared.append((tree, batch, dataset))
    return points, spared


def spared_error(profile, spared: list[tuple]) -> float:
    """The mean |log| error of a fitted profile's speedups on the cells a cliff spared."""
    model = PerfModel(profile)
    errors = [abs(math.log(model.throughput(TreeConfig.of(*t), b, d)
                           / model.throughput(BASELINE, b, d) / true_speedup(t, b, d)))
              for t, b, d in spared]
    return sum(errors) / len(errors)


def test_a_robust_fit_is_dragged_less_by_the_cells_of_a_cliff_the_model_cannot_express():
    """The model search refits with `robust` once it has found its model misfit. A cliff
    moves a sixth of the cells 10-15%; least squares bends the fitted costs towards them
    and mispredicts the trees the cliff spared, soft-L1 a little less (here the fit
    absorbs most of the cliff, and what is left of it in the cells it hit is near the
    scale). Where the model explains every cell, the robust fit is the least-squares fit."""
    for jump in (0.10, 0.15):
        points, spared = cliff_points(jump)
        params = free_parameters(PRIOR, points)
        squared, robust = (spared_error(calibrate(PRIOR, points, params, starts=1,
                                                  robust=scale).profile, spared)
                           for scale in (None, 0.05))
        assert robust < squared - 1e-4, (jump, robust, squared)

    clean, spared = cliff_points(0.0)
    assert len(spared) == len(clean)  # no cell hit
    params = free_parameters(PRIOR, clean)
    squared, robust = (calibrate(PRIOR, clean, params, starts=1, robust=scale)
                       for scale in (None, 0.05))
    assert spared_error(squared.profile, spared) < 1e-3
    assert robust.parameters == pytest.approx(squared.parameters, rel=1e-3)
