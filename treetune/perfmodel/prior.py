"""Priors: what a search may assume before it has measured anything."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from treetune.errors import TreetuneError
from treetune.perfmodel.acceptance import Acceptance
from treetune.perfmodel.profile import DEFAULT_METHOD, Calibration, Dataset, Method, Profile

NEUTRAL_ACCEPTANCE = Acceptance(top1=0.6, top1_decay=0.05, rank_mass=0.5, rank_ratio=0.5)
NEUTRAL_CONTEXT = 2048.0


def neutral_prior(profile: Profile, datasets: list[str]) -> Profile:
    """The profile's hardware and model facts with every free parameter at a neutral
    value: what the search may assume before it has measured anything. Its other draft
    methods keep their cost facts, with neutral acceptance and their fitted pass overhead
    left to the calibration's."""
    shapes = {}
    for name in datasets:
        known = profile.datasets.get(name)
        shapes[name] = Dataset(
            acceptance=NEUTRAL_ACCEPTANCE, context_tokens=NEUTRAL_CONTEXT,
            prompt_tokens=known.prompt_tokens if known else 512,
            output_tokens=known.output_tokens if known else 512)
    methods = {name: dataclasses.replace(
        method, acceptance={d: NEUTRAL_ACCEPTANCE for d in datasets},
        pass_overhead_ms=None) for name, method in profile.methods.items()}
    return profile.replace(calibration=Calibration(), datasets=shapes, methods=methods)


def with_datasets(prior: Profile, datasets: list[str]) -> Profile:
    """A prior as written, with neutral values for the datasets it does not know."""
    missing = [d for d in datasets if d not in prior.datasets]
    if not missing:
        return prior
    neutral = neutral_prior(prior, missing)
    methods = {name: dataclasses.replace(method, acceptance={
        **method.acceptance, **neutral.methods[name].acceptance})
        for name, method in prior.methods.items()}
    return prior.replace(datasets={**prior.datasets, **neutral.datasets}, methods=methods)


@dataclass(frozen=True)
class MethodView(Profile):
    """A profile seen from one of its draft methods: `PerfModel(view)` predicts that
    method, and the datasets' acceptance is that method's, so the model search's fit
    (which refits the datasets' acceptance and the calibration) learns that method."""

    view_of: str = DEFAULT_METHOD
    # The datasets' own acceptance in the profile viewed (its draft head's), put back by
    # `as_profile`.
    head_acceptance: dict[str, Acceptance] = dataclasses.field(default_factory=dict)

    def as_profile(self) -> Profile:
        """The profile this view is of, with what was fitted through it: the datasets'
        acceptance written back as its method's (the datasets keep `base`'s own, the
        draft head's), every other field as the view has it."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(Profile)}
        own = self.methods[self.view_of]
        fields["methods"] = {**self.methods, self.view_of: dataclasses.replace(
            own, acceptance={d: data.acceptance for d, data in self.datasets.items()})}
        fields["datasets"] = {d: dataclasses.replace(data, acceptance=self.head_acceptance.get(
            d, data.acceptance)) for d, data in self.datasets.items()}
        return Profile(**fields)

    def method(self, name: str | None = None) -> Method:
        if name is None or name == self.view_of:
            own = self.methods[self.view_of]
            return dataclasses.replace(own, acceptance={d: data.acceptance
                                                        for d, data in self.datasets.items()})
        raise TreetuneError(f"profile '{self.name}' is seen as its {self.view_of} method "
                            f"here, not as {name}")


def method_prior(profile: Profile, method: str) -> Profile:
    """The prior of one draft method (a name of the profile's `method_names`): the
    profile itself for its own draft head, else its view from that method. Raises
    TreetuneError (via `Profile.method`) when the profile does not describe it."""
    own = profile.method(method)
    if method == DEFAULT_METHOD:
        return profile
    fields = {f.name: getattr(profile, f.name) for f in dataclasses.fields(Profile)}
    fields["datasets"] = {d: dataclasses.replace(data, acceptance=own.acceptance[d])
                          for d, data in profile.datasets.items()}
    return MethodView(**fields, view_of=method, head_acceptance={
        d: data.acceptance for d, data in profile.datasets.items()})
