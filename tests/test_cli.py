"""The `treetune` command line: predict, calibrate, profiles, and its error messages."""

import csv
import json
import re
import subprocess
import sys

import pytest
import yaml
from studykit import run_cli

from treetune.cli import expand_multi_values
from treetune.config import BASELINE, TreeConfig
from treetune.perfmodel import Calibration, PerfModel, load_profile
from treetune.perfmodel.calibrate import load_measurements
from treetune.worlds import load_world


def run(capsys, *args):
    return run_cli(capsys, *args)


def test_multi_value_options_accept_several_values_after_one_flag():
    assert expand_multi_values(["predict", "--batch", "1", "32", "--json"]) == [
        "predict", "--batch", "1", "--batch", "32", "--json"]
    assert expand_multi_values(["--tree", "3,4,8", "5,1,6", "-p", "x"]) == [
        "--tree", "3,4,8", "--tree", "5,1,6", "-p", "x"]
    assert expand_multi_values(["--tree=3,4,8", "5,1,6", "--batch=1", "32"]) == [
        "--tree=3,4,8", "--tree", "5,1,6", "--batch=1", "--batch", "32"]


def test_an_option_given_with_equals_takes_several_values_too(capsys):
    code, out, err = run(capsys, "predict", "-p", "qwen3-8b-h100", "--tree=3,4,8", "5,1,6",
                         "--batch=1", "32", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert {(r["steps"], r["topk"], r["draft_tokens"]) for r in rows} == {(3, 4, 8), (5, 1, 6)}
    assert {r["batch"] for r in rows} == {1, 32}


def test_predict_ranks_a_space_per_batch_size(capsys):
    code, out, _ = run(capsys, "predict", "-p", "qwen3-8b-h100", "--space", "narrow",
                       "--batch", "1", "32", "--top", "3")
    assert code == 0
    assert "batch 1: top 3 of 8 configs" in out and "batch 32: top 3 of 8 configs" in out


def test_predict_json_covers_every_config_dataset_and_batch(capsys):
    code, out, _ = run(capsys, "predict", "-p", "qwen3-8b-h100", "--space", "narrow",
                       "--batch", "1", "8", "--json")
    records = json.loads(out)
    datasets = len(load_profile("qwen3-8b-h100").datasets)
    assert code == 0 and len(records) == 8 * datasets * 2
    r = records[0]
    assert r["speedup"] == pytest.approx(r["spec_tok_s"] / r["baseline_tok_s"], rel=1e-3)


def predicted(capsys, *args: str) -> list[dict]:
    code, out, err = run(capsys, "predict", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_predict_prices_each_tree_with_its_own_draft_method(capsys):
    big = ("-p", "qwen3.5-397b-a17b-h200", "--dataset", "mt-bench")
    mixed = predicted(capsys, *big, "--tree", "3,1,4", "NEXTN:3,1,4", "NGRAM:7,4,8")
    assert [r["method"] for r in mixed] == ["EAGLE3", "NEXTN", "NGRAM"]
    for record in mixed:  # the same numbers as asking for that method alone
        alone = predicted(capsys, *big, "--method", record["method"].lower(), "--tree",
                          f"{record['steps']},{record['topk']},{record['draft_tokens']}")
        assert alone == [record]
    assert mixed[0]["speedup"] != mixed[1]["speedup"] != mixed[2]["speedup"]


@pytest.mark.parametrize(("args", "message"), [
    (("-p", "qwen3-8b-h100", "--tree", "NEXTN:3,1,4"), "has no draft method 'NEXTN'"),
    # SGLang's chain rule would make it (1,1,2): NGRAM's N=2, not the N=8 asked for.
    (("-p", "qwen3.5-397b-a17b-h200", "--method", "NGRAM", "--tree", "1,1,8"),
     "(1,1,8) is not an NGRAM server"),
    (("-p", "qwen3.5-397b-a17b-h200", "--method", "NGRAM", "--tree", "3,4,8"), "here (7,4,8)"),
    (("-p", "qwen3-8b-h100", "--space", "ngram"), "--space ngram holds NGRAM servers: add "
     "--method NGRAM"),
    (("-p", "qwen3.5-397b-a17b-h200", "--method", "NGRAM", "--space", "narrow"),
     "--method NGRAM takes an NGRAM space"),
])
def test_predict_refuses_a_tree_its_method_cannot_serve(capsys, args, message):
    code, _, err = run(capsys, "predict", *args)
    assert code == 2 and message in " ".join(err.split())


def test_whole_requests_too_long_for_the_kv_pool_at_a_batch_wait_for_room(capsys):
    """64 requests of 40k tokens need about 377 GB of KV cache on one 80 GB H100, whose
    pool holds 8. SGLang starts such a server, admits requests while its pool has room and
    retracts them when it runs short: batch 64 is served as 8 are, the others waiting for
    their first token. It was predicted out of memory (a helper's audit)."""
    records = predicted(capsys, "-p", "qwen3-8b-h100", "--tree", "3,1,4", "--dataset",
                        "sharegpt", "--prompt-tokens", "30000", "--output-tokens", "10000",
                        "--batch", "8", "64")
    by = {r["batch"]: r for r in records}
    assert not by[8]["oom"] and not by[64]["oom"]
    assert by[64]["spec_tok_s"] == pytest.approx(by[8]["spec_tok_s"], rel=0.01)
    assert by[64]["ttft_ms"] > 100 * by[8]["ttft_ms"]


def test_predict_json_keeps_the_top_configs_per_batch_and_merges_repeats(capsys):
    every = predicted(capsys, "-p", "qwen3-8b-h100", "--space", "narrow", "--batch", "1", "8",
                      "--dataset", "mt-bench", "mt-bench")
    top = predicted(capsys, "-p", "qwen3-8b-h100", "--space", "narrow", "--batch", "1", "1",
                    "8", "--dataset", "mt-bench", "--top", "2")
    assert len(every) == 16 and len(top) == 4
    for batch in (1, 8):
        best = sorted((r for r in every if r["batch"] == batch), key=lambda r: -r["speedup"])
        assert [r for r in top if r["batch"] == batch] == best[:2]


def test_predict_with_a_request_shape_models_whole_requests_closed_and_open(capsys):
    code, out, _ = run(capsys, "predict", "-p", "qwen3-8b-h100", "--tree", "3,4,8",
                       "--dataset", "sharegpt", "--prompt-tokens", "12", "--output-tokens",
                       "256", "--batch", "8", "--rate", "4", "--max-running-requests", "32",
                       "--json")
    assert code == 0
    closed, opened = json.loads(out)
    model = PerfModel(load_profile("qwen3-8b-h100"))
    assert (closed["batch"], closed["rate"], opened["batch"], opened["rate"]) == (8, None, 0, 4)
    assert closed["prompt_tokens"] == 12 and closed["output_tokens"] == 256
    # prefill and turnover cost a short-output cell what the steady state does not charge
    assert closed["speedup"] < model.predict(TreeConfig(3, 4, 8), "sharegpt", 8).speedup
    assert opened["spec_tok_s"] == pytest.approx(4 * 256)
    assert opened["speedup"] == pytest.approx(opened["baseline_tpot_ms"] / opened["tpot_ms"],
                                              rel=1e-3)


@pytest.mark.parametrize("args, message", [
    (["--rate", "0"], "--rate must be a finite number > 0"),
    (["--output-tokens", "0"], "--output-tokens must be >= 1"),
])
def test_predict_refuses_a_bad_request_shape_or_rate(capsys, args, message):
    code, out, err = run(capsys, "predict", "-p", "qwen3-8b-h100", "--tree", "3,4,8", *args)
    assert code != 0 and message in out + err


def test_predict_accepts_a_profile_file_path(capsys, tmp_path):
    path = tmp_path / "mine.yaml"
    load_profile("qwen3-8b-h100").replace(name="mine").save(path)
    code, out, _ = run(capsys, "predict", "-p", str(path), "--tree", "3,4,8", "--json")
    assert code == 0 and json.loads(out)[0]["dataset"] == "sharegpt"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["predict", "-p", "qwen3-8b-h100"], "give --tree"),
        (["predict", "-p", "qwen3-8b-h10", "--tree", "3,4,8"], "did you mean 'qwen3-8b-h100'"),
        (["predict", "-p", "qwen3-8b-h100", "--tree", "2,2,9"], "too large"),
        (["predict", "-p", "qwen3-8b-h100", "--tree", "3,4,8", "--dataset", "mtbench"],
         "no dataset 'mtbench'"),
        (["predict", "-p", "qwen3-8b-h100", "--tree", "3,4,8", "--batch", "0"], "batch sizes"),
        (["predict", "-p", "qwen3-8b-h100", "--space", "nope"], "unknown search space"),
    ],
)
def test_bad_input_gives_a_one_line_error_and_exit_code_two(capsys, args, fragment):
    code, _, err = run(capsys, *args)
    assert code == 2
    assert fragment in err and "Traceback" not in err


def test_a_profile_with_an_unknown_key_names_file_key_and_suggestion(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    text = load_profile("qwen3-8b-h100").to_dict()
    text["hardware"]["bandwith_tb_s"] = text["hardware"].pop("bandwidth_tb_s")
    path.write_text(yaml.safe_dump(text))
    code, _, err = run(capsys, "predict", "-p", str(path), "--tree", "3,4,8")
    assert code == 2
    assert str(path) in err.replace("\n", "") and "hardware.bandwith_tb_s" in err
    assert "did you mean 'bandwidth_tb_s'" in err


@pytest.mark.parametrize(("section", "key", "value", "message"), [
    ("server", "mem_fraction_static", 0.0, "must be in (0, 1], got 0"),
    ("server", "mem_fraction_static", 1.5, "must be in (0, 1], got 1.5"),
    ("server", "reserve_context_tokens", -5, "must be >= 0, got -5"),
    ("noise", "launch_cv", 50, "must be in [0, 1), got 50"),
])
def test_a_profile_value_out_of_its_range_is_named_not_predicted_with(capsys, tmp_path,
                                                                      section, key, value,
                                                                      message):
    """A memory share of 0 made every tree out of memory, of 1.5 more memory than the GPUs
    have, without a word (a helper's audit)."""
    path = tmp_path / "bad.yaml"
    text = load_profile("qwen3-8b-h100").to_dict()
    text.setdefault(section, {})[key] = value
    path.write_text(yaml.safe_dump(text))
    code, _, err = run(capsys, "predict", "-p", str(path), "--tree", "3,4,8")
    assert code == 2 and f"key '{section}.{key}': {message}" in " ".join(err.split()), err


def test_python_object_tags_in_yaml_are_refused(capsys, tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("name: !!python/object/apply:os.system ['echo pwned']\n")
    code, _, err = run(capsys, "predict", "-p", str(path), "--tree", "3,4,8")
    assert code == 2 and "not valid YAML" in err


def write_csv(path, rows):
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_calibrate_fits_csv_measurements_and_writes_a_loadable_profile(capsys, tmp_path):
    truth = load_profile("qwen3-8b-h100")
    model = PerfModel(truth)
    rows = []
    for tree in ("3,4,8", "5,1,6", "2,4,6", "6,4,24"):
        config = TreeConfig.parse(tree)
        for batch in (1, 16, 64):
            for dataset in ("sharegpt", "humaneval"):
                rows.append(dict(steps=config.steps, topk=config.topk,
                                 draft_tokens=config.draft_tokens, batch=batch, dataset=dataset,
                                 baseline_tok_s=model.throughput(BASELINE, batch, dataset),
                                 spec_tok_s=model.throughput(config, batch, dataset),
                                 accept_length=model.accept_length(config, dataset)))
    data = tmp_path / "points.csv"
    write_csv(data, rows)
    assert len(load_measurements(data)) == len(rows)
    # Start away from the truth; calibration must come back to fit the points.
    start = truth.replace(calibration=Calibration())
    start_path = tmp_path / "start.yaml"
    start.save(start_path)
    out_path = tmp_path / "fitted.yaml"
    code, out, _ = run(capsys, "calibrate", "-p", str(start_path), "--measurements", str(data),
                       "-o", str(out_path), "--starts", "2")
    assert code == 0 and out_path.exists()
    assert "max speedup error" in out
    fitted = PerfModel(load_profile(out_path))
    for row in rows:
        config = TreeConfig.of(row["steps"], row["topk"], row["draft_tokens"])
        assert fitted.throughput(config, row["batch"], row["dataset"]) == pytest.approx(
            row["spec_tok_s"], rel=0.03)


def test_calibrate_refuses_measurements_with_an_invalid_tree(capsys, tmp_path):
    data = tmp_path / "points.yaml"
    data.write_text("- {steps: 2, topk: 2, draft_tokens: 30, batch: 1, dataset: sharegpt,"
                    " baseline_tok_s: 100, spec_tok_s: 150}\n")
    code, _, err = run(capsys, "calibrate", "-p", "qwen3-8b-h100", "--measurements", str(data),
                       "-o", str(tmp_path / "out.yaml"))
    assert code == 2 and "points[0]" in err and "too large" in err


def test_profiles_command_lists_the_shipped_profiles(capsys):
    code, out, _ = run(capsys, "profiles")
    assert code == 0 and "qwen3-coder-next-h200" in out and "qwen3-30b-a3b-h100" in out


@pytest.mark.parametrize("command", [[], ["predict"], ["calibrate"], ["profiles"]])
def test_every_command_explains_itself_with_help(command):
    result = subprocess.run([sys.executable, "-m", "treetune", *command, "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "Usage" in result.stdout


DATASETS = ["mt-bench", "humaneval", "swebench-verified", "terminal-bench"]


def lines_with(out: str, text: str) -> int:
    return sum(text in line for line in out.splitlines())


def pieces(out: str, names: list[str]) -> list[str]:
    """Cells holding a piece of a name: rich folds a narrow column's header into
    'swebench-v' / 'erified'."""
    return [piece for line in out.splitlines() for piece in re.split(r"[\s│┃]+", line)
            if len(piece) >= 3 and any(piece != n and (n.startswith(piece) or n.endswith(piece))
                                       for n in names)]


def test_predict_tables_in_a_log_keep_every_dataset_name_whole(capsys):
    """Captured stdout is not a terminal: tables take the width they need, not 80 columns."""
    code, out, _ = run(capsys, "predict", "--profile", "qwen3-coder-next-h200",
                       "--tree", "3,4,8", "--batch", "1", "32")
    assert code == 0
    assert all(lines_with(out, d) == 2 for d in DATASETS), out  # one header per batch size
    assert not pieces(out, DATASETS), out
    assert max(len(line) for line in out.splitlines()) < 200, "not padded to some huge width"


def test_search_outcome_lists_every_measured_config_marking_the_recommended(
        capsys, tmp_path):
    from synthetic import launch, spec

    from treetune.cli import _print_outcome
    from treetune.study.recommend import advice, recommend
    from treetune.study.runner import StudyOutcome

    study = spec(tmp_path, datasets=["mt-bench"], batch=[1], compare=["3,4,8"])
    base = launch(BASELINE, {1: {"mt-bench": 100}})
    results = [base, launch(TreeConfig(3, 4, 8), {1: {"mt-bench": 150}}),
               launch(TreeConfig(5, 1, 6), {1: {"mt-bench": 130}}),
               launch(TreeConfig(2, 1, 3), {1: {"mt-bench": 120}})]
    recs = recommend(study, results, base)
    _print_outcome(study, StudyOutcome(study, results, base, launches=4, strategy="grid"),
                   recs, advice(recs))
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("│") and "(" in line.split("│")[1]}
    assert set(rows) >= {"> (3,4,8) *", "(5,1,6)", "(2,1,3)"}, rows
    assert "1.300" in rows["(5,1,6)"] and "1.200" in rows["(2,1,3)"]


def test_search_outcome_shows_the_rate_cells_its_objective_judges(capsys, tmp_path):
    from synthetic import launch, spec

    from treetune.cli import _print_outcome
    from treetune.study.recommend import advice, recommend
    from treetune.study.runner import StudyOutcome

    study = spec(tmp_path, datasets=["mt-bench"], batch=[1, 8], rates=[2.0],
                 objective="goodput", slo={"tpot_ms": 50.0})
    base = launch(BASELINE, {1: {"mt-bench": 100}, 8: {"mt-bench": 500}})
    tree = launch(TreeConfig(3, 1, 4), {1: {"mt-bench": 150}, 8: {"mt-bench": 700}})
    recs = recommend(study, [base, tree], base)
    _print_outcome(study, StudyOutcome(study, [base, tree], base, launches=2,
                                       strategy="grid"), recs, advice(recs))
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if "tree" in line)
    assert "b1 mt-bench" in header and "b8 mt-bench" in header
    assert "mt-bench at 2 req/s" in header
    assert "judges the batch cells only" not in printed


def test_rates_under_the_throughput_objective_are_said_to_judge_nothing(capsys, tmp_path):
    """The README's open-loop example (rates and an slo, no objective): the rate cells
    cost launch time and showed nowhere, without a word (an audit)."""
    from synthetic import launch, spec

    from treetune.cli import _print_outcome
    from treetune.study.recommend import advice, recommend
    from treetune.study.runner import StudyOutcome

    study = spec(tmp_path, datasets=["mt-bench"], batch=[8], rates=[2.0],
                 slo={"tpot_ms": 50.0})
    base = launch(BASELINE, {8: {"mt-bench": 500}})
    tree = launch(TreeConfig(3, 1, 4), {8: {"mt-bench": 700}})
    recs = recommend(study, [base, tree], base)
    _print_outcome(study, StudyOutcome(study, [base, tree], base, launches=2,
                                       strategy="grid"), recs, advice(recs))
    out = " ".join(capsys.readouterr().out.split())
    assert ("note: the rate cells (rates: 2 req/s) are measured, but the throughput "
            "objective judges the batch cells only") in out
    assert "set objective (tpot_p99" in out


def test_search_outcome_says_why_no_speculation_won_a_batch_size(capsys, tmp_path):
    from synthetic import launch, spec

    from treetune.cli import _print_outcome
    from treetune.study.recommend import advice, recommend
    from treetune.study.runner import StudyOutcome

    study = spec(tmp_path, datasets=["mt-bench", "humaneval"], batch=[1])
    base = launch(BASELINE, {1: {"mt-bench": 100, "humaneval": 100}})
    regresses = launch(TreeConfig(3, 4, 8), {1: {"mt-bench": 150, "humaneval": 90}})
    recs = recommend(study, [base, regresses], base)
    _print_outcome(study, StudyOutcome(study, [base, regresses], base, launches=2,
                                       strategy="grid"), recs, advice(recs))
    out = " ".join(capsys.readouterr().out.split())
    assert "batch 1: no speculation: no measured config is surely as fast" in out


def test_search_outcome_in_a_log_prints_every_column_name_whole_brackets_included(
        capsys, tmp_path):
    from synthetic import launch, spec

    from treetune.cli import _print_outcome
    from treetune.study.recommend import advice, recommend
    from treetune.study.runner import StudyOutcome

    def per_batch(b1: float, b32: float) -> dict[int, dict[str, float]]:
        return {1: dict.fromkeys(DATASETS, b1), 32: dict.fromkeys(DATASETS, b32)}

    study = spec(tmp_path, datasets=DATASETS, compare=["3,4,8"])
    base = launch(BASELINE, per_batch(100, 1000))
    results = [base, launch(TreeConfig(3, 4, 8), per_batch(150, 950)),
               launch(TreeConfig(5, 1, 6), per_batch(130, 1100))]
    recs = recommend(study, results, base)
    _print_outcome(study, StudyOutcome(study, results, base, launches=3, strategy="grid"),
                   recs, advice(recs))
    out = capsys.readouterr().out
    assert all(lines_with(out, f"b{b} {d}") == 1 for b in (1, 32) for d in DATASETS), out
    assert not pieces(out, DATASETS), out
    assert lines_with(out, "measured speedups [interval]") == 1, "the header shows brackets"
    assert lines_with(out, "[interval]: the 95% interval of the true speedup") == 1, out


@pytest.mark.parametrize("argv", [
    ["calibrate", "-p", "qwen3-8b-h100", "--measurements", "{tmp}/pts.csv",
     "-o", "{tmp}/missing/fit.yaml"],
    ["grid", "--world", "cliffs", "--space", "narrow", "-o", "{tmp}/missing/grid.csv"],
    ["prior", "--model", "m", "--draft", "d", "-o", "{tmp}/missing/p.yaml"],
])
def test_an_output_in_a_folder_that_does_not_exist_is_refused_before_any_work(
        capsys, tmp_path, argv):
    code, _, err = run_cli(capsys, *(a.format(tmp=tmp_path) for a in argv))
    assert code == 2 and "internal error" not in err
    assert f"--output {tmp_path}/missing/" in err and "does not exist" in err


def test_a_grid_that_cannot_be_filled_writes_nothing_and_refuses_a_batch_below_one(
        capsys, tmp_path):
    # A replayed table with mt-bench alone, in a world whose profile has more datasets.
    (tmp_path / "few.csv").write_text("steps,topk,draft_tokens,batch,dataset,throughput,"
                                      "accept_length\n,,,1,mt-bench,100,\n"
                                      "3,4,8,1,mt-bench,150,2.5\n")
    (tmp_path / "w.yaml").write_text("name: few\nprofile: qwen3-8b-h100\n"
                                     "replay: {file: few.csv}\n")
    out = tmp_path / "grid.csv"
    code, _, err = run_cli(capsys, "grid", "--world", str(tmp_path / "w.yaml"), "--space",
                           "narrow", "--batch", "1", "-o", str(out))
    assert code == 2 and "of profile 'qwen3-8b-h100' has no row" in err and not out.exists()
    # Onto the world's own table: its measurements would be overwritten (an audit).
    from treetune.perfmodel import load_profile

    table = "steps,topk,draft_tokens,batch,dataset,throughput,accept_length\n" + "".join(
        f",,,1,{d},100,\n3,4,8,1,{d},150,2.5\n" for d in load_profile("qwen3-8b-h100").datasets)
    (tmp_path / "few.csv").write_text(table)
    code, _, err = run_cli(capsys, "grid", "--world", str(tmp_path / "w.yaml"), "--space",
                           "narrow", "--batch", "1", "-o", str(tmp_path / "few.csv"))
    assert code == 2 and "is the world's replay table" in err
    assert (tmp_path / "few.csv").read_text() == table
    code, _, err = run_cli(capsys, "grid", "--world", "cliffs", "--batch", "0", "-o", str(out))
    assert code == 2 and "--batch 0: batch sizes must be >= 1" in err and not out.exists()


def test_a_grid_says_which_trees_memory_leaves_out_and_refuses_to_write_none(capsys, tmp_path):
    """A study's server is asked to hold its largest batch's requests: trees that cannot
    start there are not in the table at any batch size, and those whose KV pool holds
    fewer requests are tabled as serving that many. With none left the table was written
    empty, exit 0 (a helper's audit)."""
    out = tmp_path / "grid.csv"
    code, text, err = run_cli(capsys, "grid", "--world", "qwen3-8b-h100", "--batch", "1",
                              "160", "-o", str(out))
    assert code == 0, err
    said = " ".join(text.split())
    assert "43 trees" in said and "left out" not in said
    assert "(5 trees' KV pools hold fewer than 160 requests: their rows are of as many as " \
        "they hold)" in said
    rows = list(csv.DictReader(out.open()))
    widest = {r["batch"]: float(r["throughput"]) for r in rows
              if (r["steps"], r["topk"], r["draft_tokens"], r["dataset"]) == (
                  "7", "8", "16", "mt-bench")}
    model = load_world("qwen3-8b-h100").model()
    assert widest["160"] == pytest.approx(model.throughput(TreeConfig(7, 8, 16), 159,
                                                           "mt-bench"), rel=1e-5)
    # 1000 requests' logits and activations in flight: the widest trees cannot start.
    code, text, err = run_cli(capsys, "grid", "--world", "qwen3-8b-h100", "--batch", "1",
                              "1000", "-o", str(tmp_path / "wide.csv"))
    assert code == 0, err
    assert "2 of the space's trees cannot start at batch 1000 and are left out" in " ".join(
        text.split())
    code, _, err = run_cli(capsys, "grid", "--world", "qwen3-8b-h100", "--batch", "1",
                           "100000", "-o", str(tmp_path / "none.csv"))
    assert code == 2 and "starts at batch 100000" in " ".join(err.split())
    assert not (tmp_path / "none.csv").exists()


def test_a_grid_of_ngram_trees_is_refused_since_a_replay_table_has_no_method_column(
        capsys, tmp_path):
    out = tmp_path / "grid.csv"
    code, _, err = run_cli(capsys, "grid", "--world", "cliffs", "--space", "ngram", "-o",
                           str(out))
    assert code == 2 and "--space ngram holds NGRAM trees" in err and not out.exists()
    assert "replays the world's EAGLE3 draft head only" in " ".join(err.split())


@pytest.mark.parametrize("command", ["predict", "calibrate", "prior", "search", "grid"])
def test_a_command_s_description_wraps_at_the_terminal_not_at_the_source_lines(
        capsys, monkeypatch, command):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0
    description = out.split("Usage:", 1)[1].split("╭", 1)[0].splitlines()[1:]
    paragraphs = "\n".join(line.strip() for line in description).strip().split("\n\n")
    for paragraph in paragraphs:
        lines = paragraph.splitlines()
        # Every line but a paragraph's last is filled: a short one is a source line break.
        assert all(len(line) >= 55 for line in lines[:-1]), paragraph


def test_the_top_level_help_says_how_to_get_a_traceback(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "add --debug to any command" in " ".join(out.split())


def test_a_search_says_why_it_stopped(tmp_path):
    """A search that ends before its launch budget says which budget or that nothing was
    left to launch; one that spent it says how to go on."""
    import time

    from synthetic import spec

    from treetune.study.runner import _why_ended

    study = spec(tmp_path, budget={"launches": 10, "wall_time_s": 12})
    assert _why_ended(study, 10, None, False).startswith(
        "the study's launch budget is spent (10 of 10 launches); raise --budget-launches")
    assert _why_ended(study, 4, time.monotonic() - 1, False).startswith(
        "the wall-time budget of 12 s is spent (4 of 10 launches)")
    assert _why_ended(study, 5, time.monotonic() + 60, False).startswith(
        "nothing left worth launching (5 of 10 launches)")
    assert "taken by its searches together" in _why_ended(study, 3, None, True)


def test_treetune_alone_shows_its_help_and_an_unknown_command_points_to_the_list(capsys):
    code, out, err = run(capsys)
    assert "search" in out and "error" not in err  # the exit code is click's (2 from 8.2)
    code, _, err = run(capsys, "serch")
    assert code == 2 and "No such command 'serch'" in err and "(see treetune --help)" in err
    code, _, err = run(capsys, "predict", "--bogus")
    assert code == 2 and "(see treetune predict --help)" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--tree", "3,4,8", "--batch", "64", "--max-running-requests", "8"],
     "--max-running-requests 8 is below batch 64"),
    (["--space", "narrow", "--top", "-1"], "--top must be >= 0"),
])
def test_predict_refuses_a_batch_its_server_cannot_form_and_a_negative_top(capsys, args,
                                                                          message):
    code, _, err = run(capsys, "predict", "-p", "qwen3-8b-h100", *args)
    assert code == 2 and message in err


def test_every_command_summary_is_one_line_in_the_command_list():
    """The command list shows each docstring's first paragraph as written: a hard line
    break there splits the summary mid-sentence."""
    import typer

    from treetune.cli import app

    for name, command in typer.main.get_command(app).commands.items():
        summary = (command.help or "").strip().split("\n\n")[0]
        assert summary and "\n" not in summary, (name, summary)


def test_a_search_that_pins_no_attention_backend_is_told_when_it_starts(tmp_path):
    from synthetic import spec

    from treetune.space import load_space
    from treetune.study.runner import unpinned_attention

    trees, chains = [load_space("default")], [load_space("narrow")]
    assert unpinned_attention(spec(tmp_path), trees) is None  # it pins triton
    bare = spec(tmp_path, server_flags={}, compare=[])
    assert "{--attention-backend: fa3}" in unpinned_attention(bare, trees)
    assert unpinned_attention(bare, chains) is None  # chains only: SGLang serves them alike
    compared = spec(tmp_path, server_flags={}, compare=["3,4,8"])
    assert unpinned_attention(compared, chains) is not None
    # Resumed, it has launched: "before its first launch" no longer applies (a helper's
    # audit).
    resumed = unpinned_attention(bare, trees, resumed=True)
    assert "before its first launch" not in resumed
    assert resumed.endswith("this study has launched already: to pin one the GPU runs for "
                            "every tree in the study's server_flags (e.g. {--attention-backend:"
                            " fa3} on Hopper), start a new study (--name or --output)")


def test_a_storage_password_is_neither_shown_nor_written(capsys, tmp_path):
    """`--storage postgresql://user:pass@host/db` (the README's own example) printed the
    password in the banner and in the error, and wrote it to the folder's study.yaml (a
    helper's audit); libpq takes it from PGPASSWORD or ~/.pgpass instead."""
    from treetune.study.spec import load_study, shown_url, url_without_password

    url = "postgresql://tt:PGPASS-xyz@127.0.0.1:1/studies"
    code, out, err = run_cli(capsys, "search", "--study", "studies/demo.yaml", "--storage",
                             url, "--output", str(tmp_path / "out"))
    assert code == 2 and "PGPASS-xyz" not in out + err, out + err
    assert "postgresql://tt:***@127.0.0.1:1/studies" in out
    assert "cannot open study storage postgresql://tt:***@127.0.0.1:1/studies" in " ".join(
        err.split())
    spec = load_study("studies/demo.yaml", {"storage": url})
    assert spec.to_dict()["storage"] == "postgresql://tt@127.0.0.1:1/studies"
    assert url_without_password("sqlite:////a/b.db") == "sqlite:////a/b.db"
    assert shown_url("postgresql://tt@h/db") == "postgresql://tt@h/db"
    # In the query (libpq reads it there too), unencoded '@' in it, a URL that does not parse.
    assert shown_url("postgresql://u@h/d?password=pw&sslmode=require") == (
        "postgresql://u@h/d?password=***&sslmode=require")
    assert url_without_password("postgresql://u@h/d?password=pw&sslmode=require") == (
        "postgresql://u@h/d?sslmode=require")
    assert shown_url("postgresql://u:p@ss@db/x") == "postgresql://u:***@db/x"
    assert url_without_password("postgresql://u:p@ss@db/x") == "postgresql://u@db/x"
    assert shown_url("postgresql://u:pw@h:54x/d") == "postgresql://u:***@h:54x/d"
    # A database's own words quoting the password, as the error for a storage that stopped
    # answering repeats them: in the URL's user part, its query, or a URL that does not
    # parse (the error took only the first, and only from a URL that parses).
    from treetune.study.storage import storage_lost

    for url, password in [("postgresql://u:pw-1@h/d", "pw-1"),
                          ("postgresql://u@h/d?password=pw-2&sslmode=require", "pw-2"),
                          ("postgresql://u:p@ss3@db/x", "p@ss3")]:
        try:
            raise RuntimeError(f"connection refused for u with {password}\n[SQL: select]")
        except RuntimeError as cause:
            message = str(storage_lost(url, cause))
        assert password not in message and "connection refused for u with ***" in message


def test_a_stray_study_file_after_a_list_of_numbers_is_named_with_the_option_it_wants(capsys):
    """`search --batch 1 32 study.yaml` took the file for a batch size: "Input should be a
    valid integer", naming neither (a helper's audit)."""
    assert expand_multi_values(["search", "--batch", "1", "32", "s.yaml", "--rates", "2"]) == [
        "search", "--batch", "1", "--batch", "32", "s.yaml", "--rates", "2"]
    assert expand_multi_values(["predict", "--tree", "3,4,8", "5,1,6"]) == [
        "predict", "--tree", "3,4,8", "--tree", "5,1,6"]
    code, _, err = run_cli(capsys, "search", "--batch", "1", "32", "studies/demo.yaml")
    assert code == 2 and "unexpected extra argument" in err
    assert "a study file is given as --study studies/demo.yaml" in " ".join(err.split())
    # Not said of a command without --study (a helper's audit: predict has none).
    code, _, err = run_cli(capsys, "predict", "studies/demo.yaml", "-p", "qwen3-8b-h100")
    assert code == 2 and "unexpected extra argument" in err and "--study" not in err


@pytest.mark.parametrize("command", [[], ["search"], ["predict"]])
def test_dash_h_is_help(capsys, command):
    code, out, _ = run_cli(capsys, *command, "-h")
    assert code == 0 and "Usage: treetune" in out


def test_a_search_logged_to_a_file_says_each_launch_on_a_line_of_its_own(capsys):
    """rich draws the progress bar only on a terminal: a search run under nohup, tee or a
    cluster's job log printed nothing of its launches until it ended, then one line cut
    at 80 columns (a helper's audit). Off a terminal, a plain line whenever a launch
    starts or ends or the best tree changes; not for each stage of a launch."""
    from treetune.cli import _run_with_progress
    from treetune.study.runner import Progress
    from treetune.study.spec import load_study

    spec = load_study(None, {"model": "m", "draft": "d", "batch": [1, 32],
                             "budget": {"launches": 5}})

    def study(_spec, show):
        p = Progress(budget=5, message="strategy model")
        show(p)
        p.running, p.message = ["baseline"], "launched baseline on a worker"
        show(p)
        p.stages = {"baseline": "measuring humaneval at batch 32"}
        show(p)  # a stage: no line
        p.notes.append("a note")
        p.running, p.launches_done, p.message = [], 1, "measured baseline"
        p.best = {1: ("(3,1,4)", 1.6421)}
        show(p)
        return "outcome"

    assert _run_with_progress(spec, study) == "outcome"
    lines = capsys.readouterr().err.splitlines()
    assert [re.sub(r" \d\d:\d\d:\d\d ", " T ", line) for line in lines] == [
        "launches 0/5 T | best - | running - | strategy model",
        "launches 0/5 T | best - | running baseline | launched baseline on a worker",
        "note: a note",
        "launches 1/5 T | best b1: (3,1,4) 1.642 | running - | measured baseline"]

    import time

    def long_study(_spec, show):  # a day and 6 hours in: no wrap at 24 h (a review)
        show(Progress(budget=5, started=time.monotonic() - 30 * 3600 - 5))
        return "outcome"

    _run_with_progress(spec, long_study)
    assert capsys.readouterr().err.startswith("launches 0/5 30:00:0")


def test_a_file_the_machine_refuses_past_the_checks_is_an_error_not_an_internal_one(capsys):
    """`treetune prior -o /proc/x.yaml` passed the check of its folder, then failed to
    write: "internal error: FileNotFoundError", exit 1, as for a bug (a helper's audit).
    A file the machine refuses is the user's to fix: an error naming it, exit 2."""
    from test_facts import fixture

    code, _, err = run(capsys, "prior", "--model", str(fixture("Qwen/Qwen3-8B")),
                       "--draft", str(fixture("thoughtworks/Qwen3-8B-Eagle3")),
                       "--gpu", "H100-SXM", "-o", "/proc/treetune-x.yaml")
    assert code == 2 and "error: cannot use /proc/treetune-x.yaml: " in err, err
    assert "internal error" not in err


def baseline_of(spec):
    """A baseline measured at 100 tok/s in every cell of `spec`."""
    from synthetic import launch

    return launch(BASELINE, {b: dict.fromkeys(spec.dataset_names, 100.0) for b in spec.batch})


def test_a_search_stopped_before_its_first_tree_ended_says_so_not_empty_tables(
        capsys, tmp_path, monkeypatch):
    """Stopped during its first tree, a search printed a table of no tree and every
    recommendation "no speculative config was measured successfully", which reads as a
    search that failed (a helper's audit). It says that no tree ended before the stop."""
    from treetune.study import runner

    def stopped(spec, on_progress=None, store=None):
        base = baseline_of(spec)
        return runner.StudyOutcome(spec, [base], base, interrupted=True, launches=1)

    monkeypatch.setattr(runner, "run_study", stopped)
    code, out, err = run(capsys, "search", "--model", "m", "--draft", "d", "--batch", "1",
                         "--profile", "qwen3-8b-h100", "-o", str(tmp_path / "out"))
    assert code == 130 and "interrupted: " in err
    assert "no tree was measured before the interrupt" in out
    assert "measured speedups" not in out and "no speculative config" not in out
    assert (tmp_path / "out" / "recommendations.yaml").is_file()


def test_a_search_stopped_after_a_tree_failed_prints_its_tables_and_the_failure(
        capsys, tmp_path, monkeypatch):
    """A tree that failed before the stop did end: its failure is said, with the tables
    (a review: the stop's short line hid it)."""
    from treetune.results import LaunchResult
    from treetune.study import runner

    def stopped(spec, on_progress=None, store=None):
        base = baseline_of(spec)
        failed = LaunchResult(TreeConfig(3, 4, 8), reason="out of memory", exit_code=1)
        return runner.StudyOutcome(spec, [base, failed], base, interrupted=True, launches=2)

    monkeypatch.setattr(runner, "run_study", stopped)
    code, out, _ = run(capsys, "search", "--model", "m", "--draft", "d", "--batch", "1",
                       "--profile", "qwen3-8b-h100", "-o", str(tmp_path / "out"))
    assert code == 130 and "failed (3,4,8): out of memory" in " ".join(out.split()), out
    assert "no tree was measured" not in out


def test_the_version_is_printed(capsys):
    from importlib.metadata import version

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"treetune {version('treetune')}"


@pytest.mark.parametrize("command", ["search", "prior", "report", "predict"])
def test_each_command_s_help_says_how_to_see_a_traceback(capsys, command):
    """--debug was said only under `treetune --help` (a helper's audit)."""
    code, out, _ = run(capsys, command, "--help")
    assert code == 0 and "--debug" in " ".join(out.split()), out


def test_a_tree_asked_for_is_shown_even_below_the_top_of_its_space(capsys):
    """`--space narrow --tree 1,8,8 --top 2`: the tree typed is the one the user wants
    to see; it is shown below the top two, not dropped."""
    top = predicted(capsys, "-p", "qwen3-8b-h100", "--space", "narrow", "--tree", "1,8,8",
                    "--batch", "1", "--dataset", "sharegpt", "--top", "2")
    trees = [(r["steps"], r["topk"], r["draft_tokens"]) for r in top]
    assert len(trees) == 3 and trees[-1] == (1, 8, 8)
    code, out, err = run(capsys, "predict", "-p", "qwen3-8b-h100", "--space", "narrow",
                         "--tree", "1,8,8", "--batch", "1", "--dataset", "sharegpt",
                         "--top", "2")
    assert code == 0, err
    assert "(1,8,8)" in out and "and 1 asked for by --tree" in " ".join(out.split())


def test_a_server_that_would_not_start_has_no_speedup_and_ranks_last(capsys):
    """A JSON consumer sorting by speedup must not pick a server that does not start."""
    records = predicted(capsys, "-p", "qwen3-coder-next-h200", "--space", "default",
                        "--batch", "1", "--dataset", "mt-bench",
                        "--max-running-requests", "4096", "--top", "1000")
    oom = [r for r in records if r["oom"]]
    assert oom and all(r["speedup"] is None and r["spec_tok_s"] is None for r in oom)
    assert not any(r["oom"] for r in records[:len(records) - len(oom)]), "OOM ranks last"
    assert all(r["speedup"] > 0 for r in records if not r["oom"])
    served = predicted(capsys, "-p", "qwen3-coder-next-h200", "--tree", "5,8,32", "--batch",
                       "1", "--dataset", "mt-bench", "--max-running-requests", "4096",
                       "--output-tokens", "128")
    assert served and all(r["oom"] and r["speedup"] is None and r["tpot_ms"] is None
                          and r["ttft_ms"] is None and r["saturated"] is None
                          for r in served), "whole requests too: no latency of its own"
