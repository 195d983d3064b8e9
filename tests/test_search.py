"""`treetune search` end to end on the emulator: Ray workers, Optuna storage, resume,
Ctrl-C, recommendations, and the SGLang backend running through the same code."""

from __future__ import annotations

import json
import shlex
import sys

import optuna
import pytest
from optuna.trial import TrialState
from studykit import fake_sglang, ray_env, short_ray_dir, small_study

from treetune.config import TreeConfig
from treetune.results import config_key
from treetune.space import load_space
from treetune.strategies._trials import holds, knob_distributions, params_of
from treetune.study.export import write_outputs
from treetune.study.recommend import recommend
from treetune.study.runner import run_study
from treetune.study.spec import load_study
from treetune.study.storage import StudyStore

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_tmpdir")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("study")
    # Its own short Ray dir, removed once the study is done; the environment is restored,
    # so later tests never inherit this module's Ray dir.
    with pytest.MonkeyPatch.context() as env, short_ray_dir() as ray_dir:
        for name, value in ray_env(ray_dir).items():
            env.setenv(name, value)
        spec = load_study(None, small_study(tmp))
        notes: list[str] = []
        outcome = run_study(spec, lambda p: notes.extend(n for n in p.notes if n not in notes))
    return spec, outcome, notes


def test_a_study_measures_every_cell_of_every_launch_against_one_baseline(finished):
    spec, outcome, _ = finished
    assert len(outcome.results) == 5 and all(r.ok for r in outcome.results)
    keys = [config_key(r.config) for r in outcome.results]
    assert keys.count("baseline") == 1 and "3,4,8" in keys
    assert len(set(keys)) == len(keys), "no SGLang-equivalent config is launched twice"
    for result in outcome.results:
        assert {(c.dataset, c.batch) for c in result.cells} == {
            (d, b) for d in spec.dataset_names for b in spec.batch}
        for cell in result.cells:
            assert cell.output_tok_s > 0 and cell.errors == 0
            assert (cell.accept_length is None) == (config_key(result.config) == "baseline")
    assert {r.worker.split("@")[0] for r in outcome.results} == {"worker-0", "worker-1"}
    assert outcome.ended.startswith("the study's launch budget is spent (5 of 5 launches)")


def test_a_tree_served_by_another_attention_backend_than_the_baseline_is_named(finished):
    """The study pins no attention backend: the emulator, as SGLang on Hopper, serves the
    baseline and chains with fa3 and trees of topk > 1 with flashinfer, so the study
    compares kernels too. Said once, with the flag that pins one."""
    _, outcome, notes = finished
    kernels = {getattr(r.config, "topk", 0): r.server_info["attention_backend"]
               for r in outcome.results}
    assert kernels[0] == "fa3" and kernels[4] == "flashinfer"  # (3,4,8) is compared
    named = [n for n in notes if "ran attention backend" in n]
    assert len(named) == 1, notes
    assert "ran attention backend flashinfer, the baseline fa3" in named[0]
    assert "{--attention-backend: fa3}" in named[0]
    assert sum("no attention backend pinned" in n for n in notes) == 1  # said at the start


def test_the_storage_holds_launches_and_a_constrained_study_per_batch(finished):
    spec, outcome, _ = finished
    names = {s.study_name for s in optuna.get_all_study_summaries(spec.storage_url)}
    assert names == {"small:launches", "small:batch-1", "small:batch-8"}
    study = optuna.load_study(study_name="small:batch-8", storage=spec.storage_url)
    trials = study.get_trials(states=(TrialState.COMPLETE,))
    # Every launched tree the samplers' distributions can hold is told to every batch size
    # once (the model search may launch (5,1,6), whose 6 draft tokens the grid lacks).
    dists = knob_distributions(load_space(spec.space))
    trees = {config_key(r.config) for r in outcome.results if isinstance(r.config, TreeConfig)
             and all(holds(dists[k], v) for k, v in params_of(r.config).items())}
    assert sorted(t.user_attrs["config"] for t in trials) == sorted(trees) and len(trees) >= 3
    for trial in trials:
        assert set(trial.constraints) == {"regression:humaneval", "regression:mt-bench"}
        assert trial.value > 0


def test_recommendations_and_launch_scripts_are_written(finished):
    spec, outcome, _ = finished
    write_outputs(spec, recommend(spec, outcome.results, outcome.baseline), spec.output_dir)
    records = json.loads((spec.output_dir / "recommendations.json").read_text())
    assert {(r["workload"], r["batch"]) for r in records} == {
        (w, b) for w in ("mixed", "humaneval", "mt-bench") for b in (1, 8)}
    for record in records:
        argv = shlex.split((spec.output_dir / record["launch_script"]).read_text()
                           .splitlines()[-1].removeprefix("exec "))
        assert argv[argv.index("--max-running-requests") + 1] == str(record["batch"])
        if record["steps"] is not None:
            assert argv[argv.index("--speculative-num-steps") + 1] == str(record["steps"])
            assert argv[argv.index("--speculative-eagle-topk") + 1] == str(record["topk"])


def test_rerunning_resumes_without_relaunching_completed_configs(finished, ray_cluster):
    spec, outcome, _ = finished
    # Resumed on another Ray (an address is not part of what a study is).
    more = spec.replace(budget=spec.budget.__class__(launches=7), ray_address=ray_cluster)
    again = run_study(more)
    keys = [config_key(r.config) for r in again.results]
    assert len(keys) == 7 and len(set(keys)) == 7
    launches = optuna.load_study(study_name="small:launches", storage=spec.storage_url)
    assert len(launches.get_trials(states=(TrialState.COMPLETE,))) == 7
    before = {config_key(r.config): r.started_at for r in outcome.results}
    for r in again.results:
        if config_key(r.config) in before:
            assert r.started_at == before[config_key(r.config)], "a done launch was redone"


def test_a_changed_spec_is_refused_before_any_launch(finished):
    spec, _, _ = finished
    changed = spec.replace(batch=(1, 16))
    changed_batch = r"different spec \(batch: stored \[1, 8\], now \[1, 16\]\)"
    with pytest.raises(Exception, match=changed_batch):
        StudyStore(changed)


def test_the_sglang_backend_runs_the_same_code_pointed_at_the_emulator(tmp_path,
                                                                     ray_cluster):
    """`python -m sglang.launch_server` resolves to a stand-in package that execs the
    emulator: command building, process lifecycle, load and storage are the real ones (on
    a Ray cluster whose GPUs are logical: this machine has none)."""
    study = small_study(tmp_path, name="viasglang", budget={"launches": 2}, workers=1,
                        backend={"kind": "sglang", "python": sys.executable},
                        env=fake_sglang(tmp_path / "fake"), compare=[],
                        ray_address=ray_cluster)
    spec = load_study(None, study)
    outcome = run_study(spec)
    assert len(outcome.results) == 2 and all(r.ok for r in outcome.results), [
        (r.reason, r.log_tail) for r in outcome.results]
    logs = list((spec.output_dir / "logs").glob("*.log"))
    assert any("emulating" in p.read_text() for p in logs)
    tree = next(r for r in outcome.results if config_key(r.config) != "baseline")
    assert tree.server_info["speculative_num_steps"] == tree.config.steps
    # The share of memory it took, which the search judges the trees that can start by.
    assert tree.server_info["mem_fraction_static"] == 0.85


def tight_30b_study(tmp_path, name: str, share: str, *, batch: int, launches: int,
                    tree: str, load_time_s: float, ray_address: str) -> dict:
    """A study of the 30B MoE on one H100 at a small --mem-fraction-static (`share`), of
    the baseline and `tree`, on the emulator without noise."""
    return small_study(
        tmp_path, name=name, tp=1, datasets=["humaneval"], batch=[batch], workers=1,
        budget={"launches": launches}, compare=[tree],
        server_flags={"--mem-fraction-static": share},
        backend={"kind": "emulator", "profile": "qwen3-30b-a3b-h100", "time_scale": 20.0,
                 "load_time_s": load_time_s, "noise": False}, ray_address=ray_address)


def test_failed_launches_are_recorded_with_their_cause_and_never_retried(tmp_path,
                                                                          ray_cluster):
    # At --mem-fraction-static 0.383 the 30B MoE's weights leave one H100 a small KV pool
    # (0.1 GB: one request at a time) and its weights with the draft head's none: every
    # tree fails at start-up, "Not enough memory", as SGLang does.
    spec = load_study(None, tight_30b_study(tmp_path, "oom", "0.383", batch=8, launches=3,
                                            tree="3,4,8", load_time_s=10.0,
                                            ray_address=ray_cluster))
    outcome = run_study(spec)
    failed = [r for r in outcome.results if not r.ok]
    assert outcome.baseline is not None and len(failed) == 2
    for result in failed:
        assert "Not enough memory" in result.reason or "Not enough memory" in result.log_tail
        assert result.exit_code not in (None, 0)
    recs = recommend(spec, outcome.results, outcome.baseline)
    mixed = next(r for r in recs if r.workload == "mixed")
    assert mixed.config is outcome.baseline.config and "no speculative config" in mixed.reason
    again = run_study(spec.replace(budget=spec.budget.__class__(launches=4)))
    keys = [config_key(r.config) for r in again.results]
    assert len(keys) == len(set(keys)) == 4, "a failed config was launched again"


def test_a_server_whose_kv_pool_runs_full_is_measured_and_named(tmp_path, ray_cluster):
    """At --mem-fraction-static 0.41 the 30B MoE's pool on one H100 holds 9 requests
    without speculation and 7 with (3,1,4): a batch of 12 starts (SGLang refuses only a
    server without a pool) and runs that many at once, the others waiting, and the server
    says its pool is full (SGLang at each retraction). The launch is measured and says so,
    with the times its server logged it: once as the pool fills, and again whenever the
    queue drained and filled (a load generator late on a busy machine lets it drain), so
    the count is read from the launch's own log, not assumed."""
    spec = load_study(None, tight_30b_study(
        tmp_path, "pool", "0.41", batch=12, launches=2, tree="3,1,4", load_time_s=0.5,
        ray_address=ray_cluster))
    outcome = run_study(spec)
    tree = next(r for r in outcome.results if config_key(r.config) == "3,1,4")
    assert tree.ok, (tree.reason, tree.log_tail)
    said = [w for w in tree.warnings if "KV cache pool ran full" in w]
    logged = sum("KV cache pool is full. Retract requests." in line
                 for log in (spec.output_dir / "logs").glob("3-1-4*.log")
                 for line in log.read_text(errors="replace").splitlines())
    times = f"{logged} time{'s' if logged > 1 else ''})"
    assert logged >= 1 and len(said) == 1 and \
        f"logged \"KV cache pool is full. Retract requests.\" {times}" in said[0], \
        (logged, tree.warnings)
    assert tree.cells[0].output_tok_s > 0


def test_the_pool_full_warning_counts_every_server_of_the_launch(tmp_path):
    """A launch's second server measures only the cells its first left (a review): what
    the first logged counts too; a log gone counts nothing."""
    from treetune.study.worker import pool_full_warning

    said = "KV cache pool is full. Retract requests."
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    first.write_text(f"[x] {said} #retracted_reqs: 1\n[x] Decode batch\n[x] {said}\n")
    second.write_text("[x] Decode batch\n")
    assert "logged \"KV cache pool is full. Retract requests.\" 2 times)" in pool_full_warning(
        said, [first, second, tmp_path / "gone.log"])
    assert pool_full_warning(said, [second]) == pool_full_warning("", [first]) == ""



def test_a_compared_tree_outside_the_space_is_measured_and_the_search_goes_on(
        tmp_path, ray_cluster):
    # (5,1,6) has draft_tokens 6, which bench-speculative's grid (2,4,8,16,32) cannot hold.
    spec = load_study(None, small_study(tmp_path, name="outside", space="bench-speculative",
                                        compare=["5,1,6"], budget={"launches": 4}, workers=1,
                                        batch=[1], datasets=["humaneval"],
                                        ray_address=ray_cluster,
                                        # One launch per config: this test is about the
                                        # TPE distributions, not re-measurement.
                                        search={"strategy": "tpe",
                                                "max_launches_per_config": 1}))
    outcome = run_study(spec)
    keys = {config_key(r.config) for r in outcome.results}
    assert "5,1,6" in keys and len(keys) == 4 and all(r.ok for r in outcome.results)


def test_a_failed_baseline_names_its_log_and_a_rerun_launches_it_again(tmp_path, ray_cluster,
                                                                      monkeypatch):
    """A baseline that failed to start (a download that broke, a token set only since)
    ended the study with its whole log tail and no log path, and every rerun refused the
    study for good: "start a new study" (a helper's audit of a fresh GPU node)."""
    from treetune.errors import TreetuneError
    from treetune.study import runner

    backend = {"kind": "emulator", "profile": "qwen3-coder-next-h200", "time_scale": 20.0,
               "load_time_s": 10.0, "noise": False}
    study = small_study(tmp_path, name="nobase", datasets=["humaneval"], batch=[1],
                        workers=1, budget={"launches": 3}, compare=[], ray_address=ray_cluster,
                        backend={**backend, "faults": [{"kind": "startup", "launches": 1,
                                                        "configs": ["baseline"]}]})
    with pytest.raises(TreetuneError) as failed:
        run_study(load_study(None, study))
    message = str(failed.value)
    log = tmp_path / "out" / "logs" / "baseline.log"
    assert message.startswith("the baseline launch failed: ") and log.is_file()
    assert f"(its server's log: {log}; a rerun launches it again once the server setup is " \
        "fixed)" in message
    assert len(message.split("last lines:\n", 1)[1].splitlines()) <= 15
    notes: list[str] = []
    seen: set[str] = set()  # what the running launches were said to do

    def progress(p):
        notes.extend(n for n in p.notes if n not in notes)
        seen.update(p.stages.values())

    monkeypatch.setattr(runner, "STAGE_POLL_S", 0.1)
    spec = load_study(None, study)  # its first launch of the baseline failed only
    outcome = run_study(spec, progress)
    # The failed launch was a launch: it counts in the budget of 3, beside the two here.
    assert outcome.baseline is not None and len(outcome.results) == 2 and all(
        r.ok for r in outcome.results)
    assert any(n.startswith("the baseline's launch failed in an earlier run (") and
               n.endswith("): launching it again") for n in notes), notes
    assert (tmp_path / "out" / "logs" / "baseline.launch2.log").is_file()
    # The progress line says what each launch does: on real SGLang a launch takes minutes
    # (loading, then every cell), and it showed only its name and a clock (a helper's audit
    # of a fresh GPU node). Asked about once a second here.
    assert "starting server" in seen, seen
    assert "cell 1/1: humaneval b1" in seen, seen  # its one cell
    assert all(s in ("", "starting server") or s.startswith("cell ") for s in seen), seen
    # A failed baseline that spends the budget says so, and not that a rerun would launch
    # it again: a rerun of the same budget is refused (tests/faults/test_bad_input.py).
    faults = [{"kind": "startup", "launches": 2, "configs": ["baseline"]}]
    spent = small_study(tmp_path / "spent", name="spent", datasets=["humaneval"], batch=[1],
                        workers=1, budget={"launches": 2}, compare=[],
                        ray_address=ray_cluster, backend={**backend, "faults": faults})
    for _ in range(2):  # the budget's first launch, then its second
        with pytest.raises(TreetuneError) as failed:
            run_study(load_study(None, spent))
    assert "a rerun launches it again" not in str(failed.value)
    assert ("; the study's launch budget is spent (2 of 2 launches): once the server setup is "
            "fixed, rerun with a larger --budget-launches)") in str(failed.value)
