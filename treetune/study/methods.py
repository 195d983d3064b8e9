"""A study of several draft methods (`methods:`): each method's search space, prior,
per-batch Optuna studies and strategy, for the planner to search side by side.

The study's own `algorithm` keeps today's configs, keys and Optuna studies; another
method's trees carry its name (TreeConfig.method, keys 'NEXTN:3,1,4') and have their own
per-batch studies. Tree methods (EAGLE3, EAGLE, NEXTN, STANDALONE) search the study's
`space`, NGRAM its own (draft tokens and breadth), unless a method names another. The
model search needs the prior to describe the method (a profile's `methods` entry); a
method it does not describe is searched by TPE instead, and the planner says so.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from treetune import strategies
from treetune.backends.sglang import NGRAM, profile_method
from treetune.config import TreeConfig
from treetune.errors import TreetuneError
from treetune.perfmodel import Profile
from treetune.perfmodel.prior import method_prior
from treetune.perfmodel.profile import DEFAULT_METHOD
from treetune.results import LaunchResult
from treetune.space import SearchSpace, load_space
from treetune.strategies import BatchStudies, MethodPart, MethodsStrategy, SearchContext
from treetune.strategies._trials import Waiting
from treetune.study.spec import StudySpec
from treetune.study.storage import StudyStore

NGRAM_SPACE = "ngram"  # search_spaces/ngram.yaml
FALLBACK = "tpe"  # for a method the study's strategy cannot search


def method_tag(spec: StudySpec, name: str) -> str:
    """What a config of this method carries as TreeConfig.method ("": the study's own)."""
    return "" if name == spec.algorithm else name


def method_spaces(spec: StudySpec, study_space: SearchSpace | None = None
                  ) -> dict[str, SearchSpace]:
    """Each method's space by its tag, its configs carrying it: the method's own space,
    else NGRAM's `ngram` and the study's `space` for the others. Refuses a tree space
    for NGRAM and an NGRAM space for the others, naming the method."""
    out = {}
    for method in spec.methods or ():
        source = method.space or (NGRAM_SPACE if method.name == NGRAM else spec.space)
        space = (study_space if study_space is not None and source == spec.space
                 else load_space(source))
        if space.is_ngram != (method.name == NGRAM):
            wanted = ("an NGRAM space (draft_tokens and breadth)" if method.name == NGRAM
                      else "a tree space (steps, topk and draft_tokens)")
            raise TreetuneError(f"methods: {method.name} searches {wanted}, but space "
                                f"'{source}' is not one; name another as {{name: "
                                f"{method.name}, space: SPACE}}")
        out[method_tag(spec, method.name)] = space.for_method(method_tag(spec, method.name))
    return out


def prior_of(prior: Profile | None, why_not: str, name: str) -> tuple[Profile | None, str]:
    """The model search's prior for one method, or None and why."""
    if prior is None:
        return None, why_not
    try:
        return method_prior(prior, profile_method(name)), ""
    except TreetuneError:
        return None, (f"the prior describes no {name} draft method (its methods: "
                      f"{', '.join(prior.method_names)})")


class MethodStudies:
    """The per-batch studies of every method, each launch told to its method's."""

    def __init__(self, parts: dict[str, BatchStudies]) -> None:
        self.parts = parts

    def record(self, trials: list[Waiting], result: LaunchResult,
               baseline: LaunchResult) -> None:
        assert isinstance(result.config, TreeConfig)
        self.parts[result.config.method].record(trials, result, baseline)

    def abandon(self, trials: list[Waiting], reason: str) -> None:
        for batch, trial, raw in trials:
            name = trial.study.study_name
            owner = next(p for p in self.parts.values()
                         if p.store.batch_studies[batch].study_name == name)
            owner.abandon([(batch, trial, raw)], reason)

    def abandon_all(self, reason: str) -> None:
        for part in self.parts.values():
            part.abandon_all(reason)

    def tell(self, result: LaunchResult, baseline: LaunchResult, batches: list[int]) -> None:
        assert isinstance(result.config, TreeConfig)
        self.parts[result.config.method].tell(result, baseline, batches)

    def told(self) -> dict[int, set[str]]:
        held: dict[int, set[str]] = {}
        for part in self.parts.values():
            for batch, keys in part.told().items():
                held.setdefault(batch, set()).update(keys)
        return held


@dataclass(frozen=True)
class MethodSearch:
    studies: MethodStudies
    strategy: MethodsStrategy
    strategy_name: str  # the study's own method's (a registered name)
    note: str  # which strategy searches which method, and why one fell back

    def adopt(self, spec: StudySpec, space: SearchSpace, context: SearchContext) -> list[str]:
        """A prior come later (the models downloaded by a launch, `Planner.adopt_facts`):
        each method whose strategy the study's now resolves to another is searched by that
        one from here on, with every measurement of its trees so far. Returns 'NAME (OLD ->
        NEW)' for each method that changed."""
        spaces = method_spaces(spec, space)
        changed = []
        for tag, part in list(self.strategy.parts.items()):
            own, chosen, _ = _method_search(spec, part.name, self.studies.parts[tag],
                                            spaces[tag], context)
            if chosen != part.strategy_name:
                self.strategy.parts[tag] = MethodPart(part.name, chosen,
                                                      strategies.make(chosen, own))
                self.strategy.exhausted.discard(tag)
                changed.append(f"{part.name} ({part.strategy_name} -> {chosen})")
        return changed

    @property
    def own_strategy_name(self) -> str:
        return self.strategy.parts[""].strategy_name


def search_methods(spec: StudySpec, store: StudyStore, space: SearchSpace,
                   context: SearchContext) -> MethodSearch:
    """One strategy per method of `spec` (the study's strategy, or TPE for a method it
    cannot search), over `context` narrowed to that method: its space, its per-batch
    studies, its prior and only its trees' results."""
    spaces = method_spaces(spec, space)
    parts: dict[str, MethodPart] = {}
    studies: dict[str, BatchStudies] = {}
    fallbacks = []
    for name in spec.method_names:
        tag = method_tag(spec, name)
        studies[tag] = BatchStudies(store.for_method(tag), spaces[tag])
        own, chosen, fallback = _method_search(spec, name, studies[tag], spaces[tag], context)
        if fallback:
            fallbacks.append(fallback)
        parts[tag] = MethodPart(name, chosen, strategies.make(chosen, own))
    searched = ", ".join(f"{p.name} ({p.strategy_name})" for p in parts.values())
    note = f"draft methods {searched}: one search each, taking turns"
    if fallbacks:
        note += "; " + "; ".join(fallbacks)
    return MethodSearch(MethodStudies(studies), MethodsStrategy(parts), parts[""].strategy_name,
                        note)


def _method_search(spec: StudySpec, name: str, studies: BatchStudies, space: SearchSpace,
                   context: SearchContext) -> tuple[SearchContext, str, str]:
    """One method's context, the strategy that searches it, and why it falls back ("" if
    it does not)."""
    tag = method_tag(spec, name)
    prior, why_not = prior_of(context.prior, context.prior_why_not, name)
    own_draft, draft = spec.method_draft(spec.algorithm), spec.method_draft(name)
    if (prior is not None and tag and draft is not None and own_draft is not None
            and profile_method(name) == DEFAULT_METHOD
            and context.prior is not None and context.prior.draft is not None
            and _same_draft(context.prior.draft.name, own_draft, spec.env)
            and not _same_draft(draft, own_draft, spec.env)):
        # The prior's draft head is the study's own draft (an auto prior is built from
        # it): another method's draft would be priced as that one.
        prior, why_not = None, (f"the prior's draft is {spec.algorithm}'s '{own_draft}', "
                                f"not {name}'s '{draft}'")
    own = dataclasses.replace(context, space=space, studies=studies,
                              evidence=_own_evidence(context, tag), prior=prior,
                              prior_why_not=why_not)
    try:
        return own, strategies.resolve(spec.search.strategy, own), (
            f"{name} without a model: {why_not}"  # `auto` went without the model search
            if prior is None and context.prior is not None else "")
    except TreetuneError as exc:
        if not tag:
            raise  # the study's own method: as for a study of one method
        return own, FALLBACK, f"{name} by {FALLBACK} ({exc})"


def _same_draft(one: str, other: str, env: Mapping[str, str]) -> bool:
    """Two names of one draft model, as a study or a profile writes them: the same name (a
    trailing '/' aside), or names whose config.json this machine finds to be one file (a
    hub name and its snapshot folder in the Hugging Face cache the study's env names)."""
    if one.rstrip("/") == other.rstrip("/"):
        return True
    from treetune.facts import find_config

    try:
        environment = {**os.environ, **env}
        return (find_config(one, environment).resolve()
                == find_config(other, environment).resolve())
    except TreetuneError:
        return False  # not here to tell: taken as two


def _own_evidence(context: SearchContext, tag: str
                  ) -> Callable[[], tuple[list[LaunchResult], LaunchResult | None]]:
    """`context.evidence` with only the results of one method's trees."""
    evidence = context.evidence

    def own() -> tuple[list[LaunchResult], LaunchResult | None]:
        results, baseline = evidence()
        return [r for r in results
                if isinstance(r.config, TreeConfig) and r.config.method == tag], baseline

    return own
