"""The model search's check of its own model: surprises within the noise pass, surprises
beyond it fail the check, and the learned correction follows what the model got wrong."""

from __future__ import annotations

import numpy as np
import pytest

from treetune.config import TreeConfig
from treetune.strategies._misfit import MIN_SURPRISES, Correction, Residual

DATASETS = ["mt-bench", "humaneval"]
TREES = [TreeConfig.of(s, k, n) for s, k, n in
         [(1, 1, 2), (2, 1, 3), (3, 1, 4), (5, 1, 6), (2, 2, 5), (3, 4, 8), (2, 4, 9),
          (3, 8, 24), (4, 4, 16), (5, 8, 32)]]


def residuals(shift, variance: float = 0.03 ** 2) -> list[Residual]:
    return [Residual(c, b, d, shift(c, b), variance) for c in TREES for b in (1, 32)
            for d in DATASETS]


def test_surprises_the_noise_explains_do_not_fail_the_check():
    rng = np.random.default_rng(0)
    fit = Correction(DATASETS)
    fit.surprise(list(rng.chisquare(1, 40)))  # z-scores of a model that is right
    fit.update(residuals(lambda c, b: 0.0))
    assert not fit.misfit and 0.5 < fit.ratio < 1.6
    mean, var = fit.predict(TREES, 32, "mt-bench")
    assert not mean.any() and not var.any()  # no correction while the model fits


def test_too_few_surprises_never_fail_the_check():
    fit = Correction(DATASETS)
    fit.surprise([25.0] * (MIN_SURPRISES - 1))
    fit.update(residuals(lambda c, b: 0.0))
    assert not fit.misfit


def test_surprises_beyond_the_noise_fail_the_check_and_the_correction_learns_the_shape():
    rng = np.random.default_rng(1)
    fit = Correction(DATASETS)
    fit.surprise(list(9 * rng.chisquare(1, 40)))  # predictions off by three sigmas

    def cliff(config: TreeConfig, batch: int) -> float:
        """Verify passes over 64 tokens are 15% slower than the model says."""
        return -0.15 if batch * config.draft_tokens > 64 else 0.0

    fit.update(residuals(cliff, variance=0.01 ** 2))
    assert fit.misfit and fit.ratio > 4
    over = TreeConfig.of(4, 2, 8)  # not measured: 256 tokens a verify at batch 32
    mean, var = fit.predict([over], 32, "humaneval")
    assert mean[0] < -0.08 and var[0] > 0
    under, _ = fit.predict([over], 1, "humaneval")  # 8 tokens at batch 1
    assert abs(under[0]) < 0.05


def test_a_draw_of_the_correction_moves_near_trees_together_with_the_predicted_spread():
    """Thompson sampling draws the correction jointly: near twins get near-equal shifts
    (drawn one by one, a large family of twins holds the highest of many independent
    draws by number alone), each with the spread `predict` gives it."""
    rng = np.random.default_rng(2)
    fit = Correction(DATASETS)
    fit.surprise(list(9 * rng.chisquare(1, 40)))
    fit.update(residuals(lambda c, b: -0.1 if c.steps >= 3 else 0.0, variance=0.02 ** 2))
    assert fit.misfit
    twins = [TreeConfig.of(6, 8, 63), TreeConfig.of(6, 8, 64), TreeConfig.of(1, 2, 3)]
    mean, var = fit.predict(twins, 1, "humaneval")
    draws = np.array([fit.sample(twins, 1, np.random.default_rng(seed))[:, 1]
                      for seed in range(300)])  # humaneval's column
    assert np.sqrt(var[0]) > 0.01  # far from every measured tree: uncertain
    gap = np.abs(draws[:, 0] - draws[:, 1])
    assert gap.max() < 0.2 * np.sqrt(var[0])
    assert draws.mean(axis=0) == pytest.approx(mean, abs=0.25 * np.sqrt(var.max()))
    assert draws.std(axis=0) == pytest.approx(np.sqrt(var), rel=0.2)


def test_a_measured_tree_is_held_out_of_its_own_correction():
    """What the correction says of a measured tree, for ranking it against its own
    measurement, is learned from the other trees only: the same as a GP of the same
    kernel fitted without any of that tree's cells. Learned with them, the correction
    echoes the tree's own residual (here each tree's own offset, which no other tree
    shows), and a ranking that blends the two counts one measurement twice."""
    from sklearn.gaussian_process import GaussianProcessRegressor

    from treetune.strategies._misfit import features

    rng = np.random.default_rng(3)
    offsets = {c: float(rng.normal(0, 0.03)) for c in TREES}
    fit = Correction(DATASETS)
    fit.surprise(list(9 * rng.chisquare(1, 40)))
    fit.update(residuals(lambda c, b: offsets[c] - 0.1 * (c.steps >= 3), variance=0.005 ** 2))
    assert fit.misfit
    tree = TREES[6]
    rows = [(c, b, d) for c in TREES for b in (1, 32) for d in DATASETS]
    others = [r for r in rows if r[0] != tree]
    refit = GaussianProcessRegressor(kernel=fit._gp.kernel_, optimizer=None,
                                     alpha=np.full(len(others), 0.005 ** 2))
    refit.fit(np.array([features(c, b, d, DATASETS) for c, b, d in others]),
              np.array([offsets[c] - 0.1 * (c.steps >= 3) for c, _, _ in others]))
    for batch in (1, 32):
        for dataset in DATASETS:
            mean, variance = fit.held_out(tree, batch, dataset)
            want, sd = refit.predict(np.array([features(tree, batch, dataset, DATASETS)]),
                                     return_std=True)
            assert mean == pytest.approx(want[0], abs=1e-6)
            assert variance == pytest.approx(max(sd[0] ** 2, 1e-8), rel=1e-3, abs=1e-9)
    # Learned with its own cells, the correction sits nearer the tree's own residual.
    own = offsets[tree] - 0.1 * (tree.steps >= 3)
    with_it, _ = fit.predict([tree], 1, DATASETS[0])
    assert abs(with_it[0] - own) < abs(fit.held_out(tree, 1, DATASETS[0])[0] - own)
    assert fit.held_out(TreeConfig.of(4, 2, 8), 1, DATASETS[0]) is None  # not measured
