"""The shipped qwen3-coder-next-h200 profile reproduces the published EAGLE3 study."""

import json
import os
from pathlib import Path

import pytest
import yaml

from treetune.cli import main
from treetune.config import TreeConfig
from treetune.perfmodel import PerfModel, load_profile
from treetune.perfmodel.calibrate import calibrate, free_parameters, load_measurements
from treetune.perfmodel.profile import Calibration

PUBLISHED = Path(__file__).resolve().parents[2] / "shared" / "reference" / "published-results.yaml"
ENTRY = "qwen3-coder-next-h200"


def published_cells():
    runs = yaml.safe_load(PUBLISHED.read_text())[ENTRY]["runs"]
    for run in runs:
        for dataset, (baseline, spec, speedup) in run["results"].items():
            yield tuple(run["tree"]), run["batch"], dataset, baseline, spec, speedup


def predict_json(capsys, *args):
    main(["predict", "--profile", ENTRY, "--json", *args])
    return json.loads(capsys.readouterr().out)


# Outside CI a clone may lack ../shared; in CI it is always there and these tests must run.
pytestmark = pytest.mark.skipif(
    not PUBLISHED.exists() and os.environ.get("CI") != "true",
    reason=f"{PUBLISHED} not present (it sits beside the repository in CI)",
)


def test_predict_reproduces_all_twelve_published_speedups(capsys):
    records = predict_json(capsys, "--tree", "3,4,8", "--batch", "1", "32")
    records += predict_json(capsys, "--tree", "5,1,6", "--batch", "32")
    by_cell = {((r["steps"], r["topk"], r["draft_tokens"]), r["batch"], r["dataset"]): r
               for r in records}
    cells = list(published_cells())
    assert len(cells) == 12
    for tree, batch, dataset, baseline, _spec, speedup in cells:
        r = by_cell[(tree, batch, dataset)]
        assert r["speedup"] == pytest.approx(speedup, abs=0.05), (tree, batch, dataset)
        if speedup != 1.0:  # a published 1.00 sits on the line; the narrow rule covers it
            assert (r["speedup"] < 1.0) == (speedup < 1.0), (tree, batch, dataset)
        assert r["baseline_tok_s"] == pytest.approx(baseline, rel=0.10), (batch, dataset)
        if tree == (5, 1, 6):
            assert r["speedup"] >= 1.0 - 0.01  # the narrow tree never regresses


def test_predict_json_records_have_the_stable_keys(capsys):
    records = predict_json(capsys, "--tree", "3,4,8", "--batch", "32")
    assert records and set(records[0]) == {
        "method", "steps", "topk", "draft_tokens", "batch", "dataset", "baseline_tok_s",
        "spec_tok_s", "speedup", "accept_length", "oom"}


def test_shipped_profile_is_what_calibration_to_the_published_results_gives():
    shipped = load_profile(ENTRY)
    points = load_measurements(PUBLISHED, ENTRY)
    # Start from the defaults, not from the shipped answer: calibration must find it.
    start = shipped.replace(calibration=Calibration())
    result = calibrate(start, points, free_parameters(start, points), starts=6)
    assert result.max_speedup_error <= 0.05
    assert result.max_baseline_error <= 0.10
    shipped_errors = calibrate(shipped, points, free_parameters(shipped, points), starts=1)
    assert shipped_errors.max_speedup_error <= 0.05


# ---- draft methods: EAGLE3 against the target's own MTP layer (NEXTN) --------------------

METHODS_ENTRY = "qwen3.5-397b-a17b-eagle3-vs-mtp"
METHODS_PROFILE = "qwen3.5-397b-a17b-h200"


def published_method_rows():
    """(tree, batch, {benchmark: row}) of the published EAGLE3-vs-MTP comparison."""
    entry = yaml.safe_load(PUBLISHED.read_text())[METHODS_ENTRY]
    return TreeConfig.of(*entry["tree"]), entry["batch"], entry["results"]


def method_models():
    profile = load_profile(METHODS_PROFILE)
    return PerfModel(profile), PerfModel(profile, method="NEXTN")


def test_the_qwen35_profile_reproduces_every_published_eagle3_vs_mtp_row():
    config, batch, rows = published_method_rows()
    assert batch == 1 and len(rows) == 6
    eagle3, mtp = method_models()
    for dataset, row in rows.items():
        fast_e = eagle3.request_throughput(config, dataset)
        fast_m = mtp.request_throughput(config, dataset)
        published = row["eagle3_tok_s"] / row["mtp_tok_s"]
        assert fast_e / fast_m == pytest.approx(published, rel=0.03), dataset
        assert (fast_e > fast_m) == (row["eagle3_tok_s"] > row["mtp_tok_s"]), dataset
        assert eagle3.accept_length(config, dataset) == pytest.approx(
            row["eagle3_accept_length"], abs=0.1), dataset
        assert mtp.accept_length(config, dataset) == pytest.approx(
            row["mtp_accept_length"], abs=0.1), dataset


def test_mtp_accepts_more_everywhere_yet_loses_where_published_because_its_round_costs_more():
    config, _, rows = published_method_rows()
    eagle3, mtp = method_models()
    slower_despite_longer = []
    for dataset in rows:
        assert mtp.accept_length(config, dataset) > eagle3.accept_length(config, dataset)
        e_round, m_round = eagle3.round_time(config, 1, dataset), mtp.round_time(config, 1, dataset)
        assert m_round.verify_s == pytest.approx(e_round.verify_s)  # the same target verifies
        assert m_round.draft_s > e_round.draft_s  # the MTP layer is the costlier draft
        if eagle3.request_throughput(config, dataset) > mtp.request_throughput(config, dataset):
            slower_despite_longer.append(dataset)
    assert sorted(slower_despite_longer) == sorted(
        d for d, r in rows.items() if r["eagle3_tok_s"] > r["mtp_tok_s"])
    assert len(slower_despite_longer) == 3


def test_predict_method_option_predicts_the_mtp_layer(capsys):
    main(["predict", "--profile", METHODS_PROFILE, "--method", "NEXTN", "--json",
          "--tree", "3,1,4", "--dataset", "mmstar"])
    record = json.loads(capsys.readouterr().out)[0]
    _, mtp = method_models()
    assert record["accept_length"] == pytest.approx(
        mtp.accept_length(TreeConfig.of(3, 1, 4), "mmstar"), abs=1e-3)
