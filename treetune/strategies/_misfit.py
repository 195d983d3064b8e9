"""When the performance model is wrong: a posterior predictive check on its residuals, and
a learned correction.

Real GPUs do not follow the model's equations (kernel cliffs, MoE dispatch, acceptance of
odd shapes). Every newly measured tree is first compared with what the model predicted for
it before it was measured (a posterior predictive check: a model with many free parameters
fits what it has seen, so only its predictions can show it wrong). If those surprises are
larger than the prediction's and the measurement's variance explain (their mean squared
z-score beyond the chi-square test's 99th percentile), the model is misfit. A Gaussian
process (scikit-learn) then learns the log residual over the tree's features, and the
search predicts model + correction, explores more, and trusts measurements over the model.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from treetune.config import TreeConfig

MISFIT_P = 0.01  # false alarm rate of the check when the model is right
MIN_SURPRISES = 8  # predictions judged before the check may fail
RECENT = 48  # the check looks at this many latest predictions: a fit can recover


@dataclass(frozen=True)
class Residual:
    config: TreeConfig
    batch: int
    dataset: str
    log_residual: float  # log(measured speedup / the model's)
    variance: float  # of the measurement's log speedup


def features(config: TreeConfig, batch: float, dataset: str,
             datasets: Sequence[str]) -> list[float]:
    """Where a tree sits for the correction: its shape, the verify size, the batch size and
    the dataset (one-hot)."""
    return [float(config.steps), math.log2(config.topk), math.log2(config.draft_tokens),
            math.log2(batch), math.log2(batch * config.draft_tokens),
            *(1.0 if dataset == d else 0.0 for d in datasets)]


class Correction:
    """The check and, when it fails, the learned correction of the model's log-speedups."""

    def __init__(self, datasets: Sequence[str]) -> None:
        self.datasets = list(datasets)
        self.ratio = 1.0  # mean squared z-score of the surprises (about 1 when it fits)
        self.misfit = False
        self.points = 0
        self.surprises: list[float] = []  # squared z-scores of predictions, oldest first
        self._gp = None
        self._rows: list[tuple[TreeConfig, float, str]] = []  # the GP's training cells
        self._held_out: dict[tuple[TreeConfig, float, str], tuple[float, float]] | None = None

    def surprise(self, z2: Sequence[float]) -> None:
        """Squared z-scores of a new tree's cells against the model's prediction for it."""
        self.surprises += list(z2)

    def update(self, residuals: Sequence[Residual]) -> None:
        """Judge the surprises so far; when the model is misfit, learn the correction from
        the residuals of the current fit."""
        self.points = len(residuals)
        recent = self.surprises[-RECENT:]
        if len(recent) < MIN_SURPRISES:
            self.ratio, self.misfit, self._gp = 1.0, False, None
            return
        self.ratio = float(np.mean(recent))
        # A launch's cells share its speed factor, so its datasets are not independent:
        # count one degree of freedom per tree and batch size.
        dof = max(len(recent) // max(len(self.datasets), 1), 1)
        self.misfit = self.ratio > stats.chi2.ppf(1 - MISFIT_P, dof) / dof
        self._gp = self._fit(residuals) if self.misfit and len(residuals) >= 4 else None
        self._rows = [(r.config, r.batch, r.dataset) for r in residuals]
        self._held_out = None

    def _fit(self, residuals: Sequence[Residual]):
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern

        x = np.array([features(r.config, r.batch, r.dataset, self.datasets) for r in residuals])
        y = np.array([r.log_residual for r in residuals])
        kernel = ConstantKernel(0.01, (1e-5, 1.0)) * Matern(
            length_scale=np.ones(x.shape[1]), length_scale_bounds=(0.1, 100.0), nu=1.5)
        gp = GaussianProcessRegressor(kernel=kernel, alpha=np.array([r.variance
                                                                     for r in residuals]),
                                      normalize_y=False, n_restarts_optimizer=0,
                                      random_state=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            gp.fit(x, y)
        return gp

    def predict(self, configs: Sequence[TreeConfig], batch: float,
                dataset: str) -> tuple[np.ndarray, np.ndarray]:
        """The correction's mean and variance of the log residual for each config (zeros
        while the model fits)."""
        if self._gp is None or not configs:
            zeros = np.zeros(len(configs))
            return zeros, zeros
        x = np.array([features(c, batch, dataset, self.datasets) for c in configs])
        mean, sd = self._gp.predict(x, return_std=True)
        return mean, sd ** 2

    def held_out(self, config: TreeConfig, batch: float,
                 dataset: str) -> tuple[float, float] | None:
        """The correction's mean and variance at a measured cell as learned without any of
        its tree's cells (None for a cell it was not learned from, or while the model
        fits): what the other trees say of this one. Learned with them, the correction
        echoes the tree's own measurement, and a ranking that weighs the two as separate
        evidence counts that measurement twice."""
        if self._gp is None:
            return None
        if self._held_out is None:
            self._held_out = self._leave_trees_out()
        return self._held_out.get((config, batch, dataset))

    def _leave_trees_out(self) -> dict[tuple[TreeConfig, float, str], tuple[float, float]]:
        """Every training cell's held-out mean and variance, by the GP's closed form for
        leaving a group out: with K the training cells' covariance (noise included) and
        P its inverse, the cells I of one tree have mean y_I - P_II^-1 (P y)_I and
        covariance P_II^-1 given the others' (Rasmussen and Williams, 5.4.2, for a group);
        less their measurement noise, the correction's own."""
        from scipy.linalg import cho_solve

        gp = self._gp
        precision = cho_solve((gp.L_, True), np.eye(len(self._rows)))
        weights = gp.alpha_.ravel()
        y = gp.y_train_.ravel()
        noise = np.asarray(gp.alpha)  # each cell's measurement variance, as it was fitted
        groups: dict[TreeConfig, list[int]] = {}
        for i, (config, _, _) in enumerate(self._rows):
            groups.setdefault(config, []).append(i)
        out = {}
        for rows in groups.values():
            block = np.linalg.inv(precision[np.ix_(rows, rows)])
            means = y[rows] - block @ weights[rows]
            variances = np.clip(np.diag(block) - noise[rows], 1e-8, None)
            for i, mean, variance in zip(rows, means, variances, strict=True):
                out[self._rows[i]] = (float(mean), float(variance))
        return out

    def sample(self, configs: Sequence[TreeConfig], batch: float,
               rng: np.random.Generator) -> np.ndarray:
        """One joint draw of the log residual of `configs` at `batch`, per dataset (shape:
        configs x datasets; zeros while the model fits). Joint, not cell by cell: near
        trees move together, as the correction says they do. Drawn independently, a large
        family of near twins would hold the highest of many draws by sheer number, and
        Thompson sampling would sweep through it one twin at a time."""
        if self._gp is None or not configs:
            return np.zeros((len(configs), len(self.datasets)))
        x = np.array([features(c, batch, d, self.datasets)
                      for c in configs for d in self.datasets])
        mean, cov = self._gp.predict(x, return_cov=True)
        values, vectors = np.linalg.eigh(cov)
        draw = mean + vectors @ (np.sqrt(np.clip(values, 0.0, None))
                                 * rng.standard_normal(len(values)))
        return draw.reshape(len(configs), len(self.datasets))
