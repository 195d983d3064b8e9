"""GP: Optuna's GPSampler (a Gaussian process with constrained expected improvement) asks
the per-batch studies in turn, as TPE does; the strongest off-the-shelf peer of the model
search. It needs PyTorch, which only the optional extra `treetune[gp]` installs."""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Sequence

import numpy as np
import optuna

from treetune.config import TreeConfig
from treetune.results import LaunchResult
from treetune.strategies._base import Proposal, SearchContext, register
from treetune.strategies.tpe import ask_untried

STARTUP_TRIALS = 6  # random proposals before the GP fits: as many as TPE's


def torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def missing_torch() -> str | None:
    if not torch_installed():
        return ("strategy 'gp' needs PyTorch (Optuna's GPSampler runs on it), which the core "
                "install leaves out: pip install 'treetune[gp]', or choose another strategy")
    return None


@register("gp", "Optuna's GPSampler with the no-regression constraints, per batch size "
          "(needs treetune[gp])", requires=missing_torch)
class GPStrategy:
    def __init__(self, context: SearchContext) -> None:
        self.context = context
        self.batches = itertools.cycle(context.batches)
        self.rng = np.random.default_rng(context.seed)
        # Each batch size's study asks its own GP; the constraints are the ones every
        # launch records on its trials (regression:<dataset> <= 0 is feasible).
        context.studies.use_sampler(lambda batch: optuna.samplers.GPSampler(
            seed=context.seed + batch, n_startup_trials=STARTUP_TRIALS,
            warn_independent_sampling=False))

    def propose(self) -> Proposal | None:
        return ask_untried(self.context, self.batches, self.rng)

    def observe(self, result: LaunchResult, baseline: LaunchResult) -> None:
        """Nothing to do: the GP learns through the batch studies, which record every
        launch."""

    def estimates(self, configs: Sequence[TreeConfig]) -> None:
        return None
