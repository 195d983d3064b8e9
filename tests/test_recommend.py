"""Recommendations and launch scripts from measured launches."""

import json
import math
import shlex
import subprocess

from synthetic import BASE, NARROW, WIDE, spec

from treetune.config import BASELINE, TreeConfig
from treetune.strategies import Estimate
from treetune.study.export import write_outputs
from treetune.study.recommend import pools_advice, recommend


def by(recs, workload, batch):
    return next(r for r in recs if r.workload == workload and r.batch == batch)


def test_mixed_recommendation_is_the_best_config_with_no_dataset_below_baseline(tmp_path):
    recs = recommend(spec(tmp_path), [BASE, WIDE, NARROW], BASE)
    assert by(recs, "mixed", 1).config == TreeConfig(3, 4, 8)
    assert by(recs, "mixed", 32).config == TreeConfig(5, 1, 6)  # the wide tree regresses code
    assert by(recs, "sharegpt", 32).config == TreeConfig(3, 4, 8)  # chat alone may go wide
    assert by(recs, "mixed", 32).speedups == {"sharegpt": 1.1, "humaneval": 1.02}


def test_no_feasible_config_recommends_no_speculation_and_says_why(tmp_path):
    recs = recommend(spec(tmp_path), [BASE, WIDE], BASE)
    mixed = by(recs, "mixed", 32)
    assert mixed.config is BASELINE
    assert "no speculation" in mixed.reason and "humaneval" in mixed.reason
    assert mixed.record()["steps"] is None


def test_tolerance_admits_small_regressions(tmp_path):
    recs = recommend(spec(tmp_path, tolerance=0.15), [BASE, WIDE, NARROW], BASE)
    assert by(recs, "mixed", 32).config == TreeConfig(3, 4, 8)


def test_different_trees_per_batch_size_become_two_pool_advice(tmp_path):
    recs = recommend(spec(tmp_path), [BASE, WIDE, NARROW], BASE)
    advice = pools_advice(recs)
    assert advice and "batch 1: (3,4,8)" in advice and "batch 32: (5,1,6)" in advice


def test_outputs_have_the_stable_json_records_and_a_script_each(tmp_path):
    s = spec(tmp_path)
    recs = recommend(s, [BASE, WIDE, NARROW], BASE)
    write_outputs(s, recs, s.output_dir)
    records = json.loads((s.output_dir / "recommendations.json").read_text())
    assert len(records) == 2 * 3
    for record in records:
        assert set(record) >= {"workload", "batch", "steps", "topk", "draft_tokens",
                               "speedups", "launch_script"}
        assert (s.output_dir / record["launch_script"]).is_file()
    assert "pools" in (s.output_dir / "recommendations.yaml").read_text()


def test_launch_scripts_hold_every_flag_quoted_for_the_configured_version(tmp_path):
    s = spec(tmp_path, sglang_version="0.5.6")
    recs = recommend(s, [BASE, WIDE, NARROW], BASE)
    write_outputs(s, recs, s.output_dir)
    script = (s.output_dir / "launch" / "mixed-batch32.sh").read_text()
    command = script.splitlines()[-1].removeprefix("exec ")
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert argv[argv.index("--model-path") + 1] == "/models/My Model $(touch pwned)"
    for flag, value in [("--speculative-num-steps", "5"), ("--speculative-eagle-topk", "1"),
                        ("--speculative-num-draft-tokens", "6"), ("--attention-backend", "triton"),
                        ("--max-running-requests", "32"), ("--cuda-graph-max-bs", "32"),
                        ("--speculative-draft-model-path", "org/draft")]:
        assert argv[argv.index(flag) + 1] == value
    assert "--trust-remote-code" in argv and "--cuda-graph-max-bs-decode" not in argv
    assert "export SGLANG_ENABLE_SPEC_V2=1" in script
    new = spec(tmp_path, sglang_version="0.5.23")
    write_outputs(new, recs, new.output_dir)
    assert "--cuda-graph-max-bs-decode 32" in (new.output_dir / "launch" / "mixed-batch32.sh"
                                                ).read_text()


def test_running_a_launch_script_executes_nothing_injected(tmp_path):
    s = spec(tmp_path)
    recs = recommend(s, [BASE, WIDE, NARROW], BASE)
    write_outputs(s, recs, s.output_dir)
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    (stub / "python").chmod(0o755)
    args_out = tmp_path / "args.txt"
    env = {"PATH": f"{stub}:/usr/bin:/bin", "ARGS_OUT": str(args_out)}
    subprocess.run(["sh", str(s.output_dir / "launch" / "mixed-batch1.sh")], env=env,
                   cwd=tmp_path, check=True, timeout=30)
    assert not (tmp_path / "pwned").exists()
    assert "/models/My Model $(touch pwned)" in args_out.read_text().splitlines()


def test_a_pick_ranked_by_the_model_says_so_beside_its_measured_mean(tmp_path):
    """With the model search's estimates the ranking blends each measured speedup with
    the fitted model's: the pick may be measured slower than another feasible tree, and
    its reason must not claim the best measured mean then."""
    estimates = {(config, batch, dataset): Estimate(math.log(value), 1e-6, 1e-6)
                 for config, value in ((WIDE.config, 1.30), (NARROW.config, 1.50))
                 for batch in (1, 32) for dataset in ("sharegpt", "humaneval")}
    quiet = spec(tmp_path, search={"launch_cv": 0.01})
    plain = by(recommend(quiet, [BASE, WIDE, NARROW], BASE), "mixed", 1)
    assert plain.config == WIDE.config
    assert plain.reason.startswith("best mean speedup 1.600 measured of 2 surely feasible")
    blended = by(recommend(quiet, [BASE, WIDE, NARROW], BASE, estimates), "mixed", 1)
    assert blended.config == NARROW.config  # measured 1.350 against the wide tree's 1.600
    assert blended.reason.startswith("best ranked (1.500: each measured speedup blended with "
                                     "the fitted model's estimate")
    assert "mean speedup 1.350 measured" in blended.reason
    # The model agreeing with the pick's measurement and pulling the other down: the pick's
    # own rank is its mean, yet the ranking was still the blend's (a review).
    pulled = {key: Estimate(math.log(1.0 if key[0] == WIDE.config else 1.35), 1e-6, 1e-6)
              for key in estimates}
    agreed = by(recommend(quiet, [BASE, WIDE, NARROW], BASE, pulled), "mixed", 1)
    assert agreed.config == NARROW.config and agreed.reason.startswith("best ranked (1.350")
