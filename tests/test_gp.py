"""The `gp` strategy: Optuna's GPSampler behind the same protocol as TPE. PyTorch is an
optional extra (`treetune[gp]`): without it the strategy is refused with the install line
and `auto` never picks it; with it (skipped where it is not installed), a study runs on it."""

from __future__ import annotations

import optuna
import pytest

from treetune import strategies
from treetune.errors import TreetuneError
from treetune.perfmodel import PerfModel, load_profile
from treetune.space import load_space
from treetune.strategies import gp
from treetune.study.offline import run_offline
from treetune.study.planner import Planner
from treetune.study.spec import load_study
from treetune.study.storage import StudyStore

PROFILE = "qwen3-8b-h100"


def spec_with(strategy: str):
    return load_study(None, {
        "name": "g", "model": "m", "draft": "d", "datasets": ["humaneval", "mt-bench"],
        "batch": [1, 32], "space": "default", "seed": 2,
        "backend": {"kind": "emulator", "profile": PROFILE},
        "search": {"strategy": strategy, "max_launches_per_config": 1}})


def planner_for(spec) -> Planner:
    store = StudyStore(spec, storage=optuna.storages.InMemoryStorage())
    return Planner(spec, store, load_space(spec.space), [])


def test_without_pytorch_gp_is_refused_with_the_install_line_and_auto_skips_it(monkeypatch):
    monkeypatch.setattr(gp, "torch_installed", lambda: False)
    with pytest.raises(TreetuneError, match=r"pip install 'treetune\[gp\]'"):
        planner_for(spec_with("gp"))
    assert planner_for(spec_with("auto")).strategy_name != "gp"
    assert "gp" in strategies.names()


@pytest.mark.skipif(not gp.torch_installed(), reason="PyTorch not installed (treetune[gp])")
def test_a_gp_study_asks_optuna_s_gp_sampler_and_launches_each_config_once():
    spec = spec_with("gp")
    seen: list[str] = []
    planner = run_offline(spec, PerfModel(load_profile(PROFILE)), seed=0, launches=12,
                          after_launch=lambda p: seen.append(p.strategy_name))
    assert planner.strategy_name == "gp" and set(seen) == {"gp"}
    for study in planner.store.batch_studies.values():
        assert isinstance(study.sampler, optuna.samplers.GPSampler)
        # Every launched tree told to every batch size, with its no-regression constraints.
        trials = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
        assert len(trials) >= 8 and all(len(t.constraints) == 2 for t in trials)
    keys = [r.config for r in planner.launched]
    assert len(keys) == len(set(keys)) == 12
