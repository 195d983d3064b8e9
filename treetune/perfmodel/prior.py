"""Priors: what a search may assume before it has measured anything."""

from __future__ import annotations

from treetune.perfmodel.acceptance import Acceptance
from treetune.perfmodel.profile import Calibration, Dataset, Profile

NEUTRAL_ACCEPTANCE = Acceptance(top1=0.6, top1_decay=0.05, rank_mass=0.5, rank_ratio=0.5)
NEUTRAL_CONTEXT = 2048.0


def neutral_prior(profile: Profile, datasets: list[str]) -> Profile:
    """The profile's hardware and model facts with every free parameter at a neutral
    value: what the search may assume before it has measured anything."""
    shapes = {}
    for name in datasets:
        known = profile.datasets.get(name)
        shapes[name] = Dataset(
            acceptance=NEUTRAL_ACCEPTANCE, context_tokens=NEUTRAL_CONTEXT,
            prompt_tokens=known.prompt_tokens if known else 512,
            output_tokens=known.output_tokens if known else 512)
    return profile.replace(calibration=Calibration(), datasets=shapes)


def with_datasets(prior: Profile, datasets: list[str]) -> Profile:
    """A prior as written, with neutral values for the datasets it does not know."""
    missing = [d for d in datasets if d not in prior.datasets]
    if not missing:
        return prior
    neutral = neutral_prior(prior, missing)
    return prior.replace(datasets={**prior.datasets, **neutral.datasets})
