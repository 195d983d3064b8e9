"""What to launch next, and what the launches so far say.

Shared by the runner (Ray workers in parallel, servers for real) and the search-efficiency
benchmark (launches evaluated in-process): the same queue, strategies, re-measurement of
borderline configs and merged evidence drive both.

Order of work: the baseline and compared configs first; then, before any new config, a
borderline config that could become a recommendation is re-measured (the baseline first
while it has fewer launches, since its noise shifts every speedup), unless the strategy
forecasts a proposal above the best measured tree (for up to three launches); then a
leader whose rank or feasibility rests on too little (one launch, a close race, a thin
margin over the floor); then the strategy's proposal.

With `adaptive: true`, chains of ADAPTIVE_CHAIN_STEPS are queued after the compared
configs; once they are all measured, SGLang's default adaptive config and the one tuned
from them (derived once: study/schedule.py) are queued, and re-launched while a verdict on
them is unsettled. Adaptive configs are candidates like trees, but no strategy sees them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import NamedTuple

from treetune import strategies
from treetune.backends import BackendFacts, gather_facts
from treetune.backends.sglang import attention_dp_size
from treetune.config import BASELINE, AdaptiveConfig, ServerConfig, TreeConfig
from treetune.errors import TreetuneError
from treetune.objectives import Objective
from treetune.perfmodel import MemoryCheck, Profile, check_memory, load_profile
from treetune.perfmodel.prior import neutral_prior, with_datasets
from treetune.perfmodel.profile import with_attention_dp, with_memory_share
from treetune.results import LaunchResult, config_key, launches_of
from treetune.space import SearchSpace
from treetune.strategies import BatchStudies, Proposal, SearchContext
from treetune.strategies.model import ModelStrategy
from treetune.study.evidence import (
    Z_INTERVAL,
    Estimates,
    Interval,
    StudyNoise,
    Trend,
    Verdict,
    doubted,
    floor_of,
    intervals,
    judge,
    leveled_launches,
    leveling_variance,
    merge,
    merge_all,
    node_of,
    node_shifts,
    node_yardstick,
    noise_of,
    odd_launch,
    places,
    proof_outlook,
    proof_reach,
    relative_variance,
    study_noise,
    window_spread,
)
from treetune.study.methods import MethodSearch, prior_of, search_methods
from treetune.study.recommend import Recommendation, recommend, static_adaptive
from treetune.study.schedule import Tuning, adaptive_chains, tune
from treetune.study.spec import StudySpec
from treetune.study.storage import StudyStore

# A re-measurement of a tree that could become a recommendation waits (at most DEFER_MAX
# launches in a row) for a proposal the strategy forecasts to be this much faster than the
# best measured tree: confirming a tree the search is about to beat spends a launch for
# nothing. 1.05 measured no better than 1.03; any forecast gain (1.0), three in a row,
# reached the target in 113 of 144 benchmark studies where 1.03 and two reached 108
# (benchmarks/RESULTS.md, stop 23).
DEFER_GAIN = 1.0
DEFER_MAX = 3
# Two confirmed trees whose order is unsure are raced (more launches) only while the
# runner-up may be ahead by more than this: closer than that, either is as good.
RACE_MARGIN = 0.01
# Where a workload has no confirmed tree, a plausible tree may take this many times
# `search.max_launches_per_config` (see `_unsettled`).
UNRECOMMENDED_LAUNCHES = 2
# A recommendation whose 99% bound clears the floor by less than this many standard errors
# of its speedup on some dataset is measured again (the baseline first, one launch past the
# per-config limit): a low baseline and a lucky tree add up, and a thin margin is where
# that ships a regression (benchmarks/RESULTS.md, stop 44's trace).
THIN_SDS = 1.0
# With the tree at its limit and still thin, the baseline goes on up to this many times the
# limit: every speedup shares its error. A recommendation (a tree that passes) asks for
# it, not a tree yet to pass, so it is no search for a pass, though each launch moves every
# tree's speedup (the withdrawn rule that had the baseline follow an unconfirmed tree past
# the limit looked until its tree passed; benchmarks/RESULTS.md, stop 59). In a traced
# dense-band study a baseline measured 4.3% low over four launches passed a tree truly at
# the floor (stop 61). Three, not two: a replay-published study's baseline ran 3.4% low
# over its six launches and passed a chain truly 0.994 on one dataset, recommended thin for
# the 19 launches left; with three more baseline launches it was withdrawn after four
# (48 seeds: 26 false-feasible recommendations of 1263 -> 11 of 1248; stop 84).
THIN_BASELINE_LIMITS = 3
# While a tree is recommended, the baseline is launched again once its latest launch is
# this many launches older than the recommendation's latest (`_remeasure_stale`): a
# machine whose speed moves with time shows it only in a baseline launched at more than
# one time (`evidence.level_trend`), and a machine getting faster makes late trees look
# good, so no thin margin would call for the baseline.
STALE_LAUNCHES = 10


class Candidate(NamedTuple):
    """A tree that another launch (its own, or the baseline's before it) could make a
    recommendation (`Planner._unsettled`)."""

    # Over the best confirmed tree, weighed by its chance of proof, per launch the proof
    # needs (`Planner._worth`).
    gain: float
    key: str
    batch: int
    names: tuple[str, ...]  # the workload
    cap: int  # launches the tree, and the baseline before it, may take


@dataclass
class Task:
    config: ServerConfig
    proposal: Proposal | None = None
    remeasure: bool = False
    # A thin recommendation's re-measurement (`Planner._remeasure_thin`): never put off.
    thin: bool = False
    index: int = 0  # launches of this config before this one (finished or under way)
    elsewhere: bool = False  # another search of the study runs it (a shared storage)
    node: str = ""  # the node it was handed to, where the runner said (`Planner.next`)

    @property
    def key(self) -> str:
        return config_key(self.config)


def local_facts(spec: StudySpec) -> BackendFacts:
    """The backend's facts gathered in this process, with the study's environment (the
    runner gathers them on a launch worker instead, where the servers run)."""
    return gather_facts(spec.backend, spec.launch_spec(), {**os.environ, **spec.env})


def study_prior(spec: StudySpec, facts: BackendFacts | None = None
                ) -> tuple[Profile | None, str]:
    """The profile the model search starts from, and why there is none (else ""): the
    study's `search.prior` as written, or the hardware and model facts its backend knows
    (`facts`, gathered here when not given), with every free parameter neutral (for the
    emulator, its profile is the truth being searched). A study of one draft method sees
    the profile as that method (NEXTN: its `methods` entry, not its draft head); a study of
    several, each method's search does (study/methods.py)."""
    if spec.search.prior:
        prior = with_datasets(load_profile(spec.search.prior), spec.dataset_names)
    else:
        facts = facts or local_facts(spec)
        if facts.profile is None:
            return None, facts.why_not
        prior = neutral_prior(facts.profile, spec.dataset_names)
    # The study's servers run their attention in the groups their flags ask for (a divisor
    # of its tp: the study's flags are refused otherwise), whatever the profile says.
    groups = attention_dp_size(spec.server_flags)
    if groups != prior.server.attention_dp:
        prior = with_attention_dp(prior, groups)
    # And in the share of each GPU's memory their flags give SGLang, which decides the
    # trees that can start (the search proposes no other).
    if share := spec.mem_fraction_static:
        prior = with_memory_share(prior, share)
    if spec.methods:
        return prior, ""
    if spec.algorithm == "STANDALONE" and "STANDALONE" not in prior.methods \
            and prior.draft is not None:
        # A prior written before STANDALONE drafts were a method of their own (`treetune
        # prior --algorithm STANDALONE` put the model at the top level): its draft is the
        # study's, priced as a STANDALONE draft is (its own weights and KV cache).
        return prior, ""
    return prior_of(prior, "", spec.algorithm)


class Planner:
    def __init__(self, spec: StudySpec, store: StudyStore, space: SearchSpace,
                 launched: list[LaunchResult], tp: int | None = None,
                 facts: BackendFacts | None = None) -> None:
        self.spec = spec
        self.store = store
        self.launched = list(launched)  # every finished launch, oldest first
        # One per config, its launches merged, leveled by node and by a time trend.
        self.results: dict[str, LaunchResult] = {}
        self.trend: Trend | None = None  # the time trend the results are leveled by
        self._merge()
        self.in_flight: list[Task] = []
        self.deferred = 0  # re-measurements put off in a row for forecast gains
        # A baseline whose launch failed in an earlier run (a download that broke, a
        # token set since) is launched again: nothing can be judged without it.
        self.queue: list[Task] = [Task(c) for c in (BASELINE, *spec.compare)
                                  if config_key(c) not in self.results
                                  or (c is BASELINE and self.baseline is None)]
        self.queue += self._adaptive_chains()
        self.tuning: Tuning | None = None  # the adaptive config tuned from the chains
        self.pending: list[tuple[LaunchResult, Proposal | None]] = []
        self.absorbed: list[LaunchResult] = []  # other searches' results, for the strategy
        self.told_odd: set[tuple[str, int]] = set()  # (config key, launch) said odd
        self.told_nodes: set[str] = set()  # nodes said to run apart from the others
        self.told_kernels: set[str] = set()  # attention backends said to differ
        self.told_trend = False  # whether a time trend in the launches was said
        self.told_tuning = False  # whether a tuning with nothing to draft with was said
        self.told_static = False  # whether adaptive servers that served static were said
        # A resumed study's launches were judged in the session that ran them (what was
        # said is not stored): judged again now, in silence, so that none is named twice.
        if self.launched:
            self.odd_notes(config_key(BASELINE))
            self.node_notes()
            self.kernel_notes()
            self.static_notes()
            self.trend_notes()
        self.floor = floor_of(spec.tolerance)
        self.studies = BatchStudies(store, space)
        if facts is None and not spec.search.prior:
            facts = local_facts(spec)
        prior, why_not = self._prior(facts)
        self.context = context = SearchContext(
            space=space, studies=self.studies, batches=sorted(spec.batch),
            datasets=spec.dataset_names, tolerance=spec.tolerance, seed=spec.seed,
            is_known=self.is_known, evidence=self.evidence, prior=prior,
            measurement_variance=self.measurement_variance, proof_reach=self.proof_reach,
            max_batch=spec.max_batch, tp=tp,
            prior_why_not=why_not, pending=self.pending_trees,
            shapes=spec.request_shapes())
        self.strategy_name = strategies.resolve(spec.search.strategy, context)
        self.strategy = strategies.make(self.strategy_name, context)
        # Said once when `auto` had to go without the model search, so a user sees why.
        without = (f"no performance-model prior ({why_not})"
                   if prior is None and why_not and spec.search.strategy == strategies.AUTO
                   else "")
        # Models not yet on the node: a server started with their hub names downloads them,
        # and the model search takes over once it can (`adopt_facts`).
        self.awaiting_facts = bool(without) and facts is not None and facts.later
        if self.awaiting_facts:
            without += ("; asked again after each launch, since SGLang downloads the models "
                        "when a server starts: the model search takes over once they are here")
        self.note = f"strategy {self.strategy_name}: {without}" if without else ""
        self.method_search: MethodSearch | None = None
        if spec.methods:  # several draft methods: one search each, taking turns
            self.method_search = search = search_methods(spec, store, space, context)
            self.studies, self.strategy = search.studies, search.strategy  # type: ignore[assignment]
            self.strategy_name = search.strategy_name
            self.note = "; ".join(n for n in (search.note, without) if n)
        self._tell_untold()
        self._plan_adaptive()  # a resumed study may be ready for them

    def adopt_facts(self, facts: BackendFacts, tree_launched: bool) -> str:
        """The backend's facts asked again after a launch (`awaiting_facts`): the model
        search takes over from TPE once a prior can be built, with every measurement so
        far (as a resumed study's search starts). Asked until then, or until a tree's
        launch has fetched the draft too and the facts still fail. Returns a line for the
        user when the strategy changed, or when it stays for good ('' otherwise)."""
        prior, why_not = self._prior(facts)
        if prior is None:
            self.awaiting_facts = facts.later and not tree_launched
            if self.awaiting_facts:
                return ""
            return (f"strategy {self.strategy_name} stays: " + (
                "the models' config.json are not on the node even after a tree's launch"
                if facts.later else "the models are on the node now, but the prior cannot "
                "be built") + f" ({why_not})")
        self.awaiting_facts = False
        context = dataclasses.replace(self.context, prior=prior, prior_why_not="")
        why = ("the models' config.json are on the node now (SGLang downloaded them), so the "
               "performance-model prior could be built")
        if self.method_search is not None:  # each method's own search
            changed = self.method_search.adopt(self.spec, context.space, context)
            if changed:
                self.context = context
                self.strategy_name = self.method_search.own_strategy_name
            return (f"draft methods {', '.join(changed)} from launch {self.launches + 1} on: "
                    f"{why}" if changed else "")
        name = strategies.resolve(strategies.AUTO, context)
        if name == self.strategy_name:
            return ""
        self.context, self.strategy = context, strategies.make(name, context)
        before, self.strategy_name = self.strategy_name, name
        return f"strategy {name} from launch {self.launches + 1} on (was {before}): {why}"

    def _tell_untold(self) -> None:
        """A resumed study's trees the batch studies lack (`tell_untold`). With a shared
        database, told as the search learns which searches run (`_Others.follow`)."""
        if not self.spec.shared_storage:
            self.tell_untold(held=())

    def tell_untold(self, held: Collection[str]) -> None:
        """Trees measured that no batch study holds: measured before a baseline that was
        then interrupted, they waited in `pending`, in memory, and were lost with it (TPE,
        GPSampler, the optimization-history figure and optuna-dashboard never saw them).
        A tree some batch studies hold and others not (the database lost while a launch
        was told to them) is told to the others. Not the trees of `held` (config keys): a
        search that still runs measured them, and tells them itself."""
        if not self.launched:
            return
        told = self.studies.told()
        waiting = {config_key(result.config) for result, _ in self.pending}
        for key, result in self.results.items():
            if not isinstance(result.config, TreeConfig) or key in held or key in waiting:
                continue
            missing = [batch for batch, keys in told.items() if key not in keys]
            if len(missing) == len(told):  # no batch study holds it
                self.pending.append((result, None))
            elif missing and self.baseline is not None:
                self.studies.tell(result, self.baseline, missing)
        self._tell_pending()

    # ---- state ------------------------------------------------------------------------
    @property
    def baseline(self) -> LaunchResult | None:
        result = self.results.get("baseline")
        return result if result and result.ok else None

    @property
    def uses_model(self) -> bool:
        """Whether the model search proposes (for the study's own method, or another's)."""
        parts = self.method_search.strategy.parts.values() if self.method_search else ()
        return self.strategy_name == "model" or any(p.strategy_name == "model" for p in parts)

    @property
    def launches(self) -> int:
        return len(self.launched)

    def evidence(self) -> tuple[list[LaunchResult], LaunchResult | None]:
        return list(self.results.values()), self.baseline

    def estimates(self) -> Estimates | None:
        """The strategy's model estimates of every measured tree (None without a model),
        for the ranking to blend with the measurements: doubted as far as the measured
        trees sit off them (`doubted`)."""
        if self.baseline is None:
            return None
        trees = [r.config for r in self.results.values()
                 if r.ok and isinstance(r.config, TreeConfig)]
        estimates = self.strategy.estimates(trees)
        if not estimates:
            return estimates
        # Of throughput, whatever the objective: what the estimates are of.
        return doubted(estimates, self.results.values(), self.baseline,
                       self._stated_throughput_noise())

    def decide(self) -> list[Recommendation]:
        """What the launches so far recommend (nothing before the baseline)."""
        if self.baseline is None:
            return []
        return recommend(self.spec, list(self.results.values()), self.baseline,
                         self.estimates())

    def is_known(self, key: str) -> bool:
        return key in self.results or any(t.key == key for t in (*self.in_flight, *self.queue))

    def pending_trees(self) -> list[TreeConfig]:
        """Trees running or queued (here or in another search) with no result yet."""
        return [t.config for t in (*self.in_flight, *self.queue)
                if isinstance(t.config, TreeConfig) and t.key not in self.results]

    def measurement_variance(self, result: LaunchResult, baseline: LaunchResult, batch: int,
                             dataset: str) -> float:
        """Variance of one measured log speedup, from the study's learned noise."""
        noise = self._throughput_noise
        cell, base = result.cell(dataset, batch), baseline.cell(dataset, batch)
        if cell is None or base is None:
            return math.inf
        return (relative_variance(cell, noise) + relative_variance(base, noise)
                + leveling_variance(result, baseline, noise.launch_cv))

    def proof_reach(self, batch: int) -> float:
        """`SearchContext.proof_reach`: at the learned noise of throughput (what the model
        strategy fits), the per-config limit of launches each; 0 before the baseline's
        result."""
        if self.baseline is None:
            return 0.0
        return proof_reach(self.baseline, batch, self.spec.dataset_names,
                           self._throughput_noise, self.spec.search.max_launches_per_config)

    def noise(self) -> StudyNoise:
        """The study's measurement noise of its objective, learned from its launches so
        far (of throughput: the noise `_merge` learned, not learned again)."""
        if self.spec.objective is Objective.THROUGHPUT:
            return self._stated_throughput_noise()
        return noise_of(self.spec, self.results.values())

    def _stated_throughput_noise(self) -> StudyNoise:
        """The study's learned noise of throughput with its search's `learned` flag (whether
        the study re-launches at all: `StudyNoise.learned`)."""
        return dataclasses.replace(self._throughput_noise,
                                   learned=self.spec.search.learns_noise)

    def intervals(self, result: LaunchResult, batch: int, names: list[str] | None = None
                  ) -> dict[str, Interval]:
        assert self.baseline is not None
        return intervals(result, self.baseline, batch, names or self.spec.dataset_names,
                         self.noise(), criterion=self.spec.criterion)

    # ---- what next --------------------------------------------------------------------
    def next(self, node: str = "") -> Task | None:
        """The next launch, or None until a running launch finishes (or for good).
        `node`: the host of the worker that will run it, when the runner knows it: a node
        that has not run the baseline runs it first (`_baseline_here`)."""
        if self.spec.adaptive and self.static_adaptive():
            # Once a server ran static trees, no adaptive task starts: queued with it, or
            # put back (given up by another search, a lost worker).
            self.queue = [t for t in self.queue if not isinstance(t.config, AdaptiveConfig)]
        if (here := self._baseline_here(node)) is not None:
            task = here
        elif self.queue:
            task = self.queue.pop(0)
        elif self.baseline is None and not any(t.key == "baseline" for t in self.in_flight):
            return None  # speedups need the baseline before anything can be judged
        else:
            # With the baseline still running, other workers need not wait for it: the
            # strategy proposes as it would before its first result (a start-up design).
            task = self._remeasure()
            if task is None or (not task.thin and self._may_defer()):
                proposal = self.strategy.propose()
                if proposal is None:
                    if task is None:
                        return None
                elif task is None or (proposal.gain or 0.0) >= DEFER_GAIN:
                    self.deferred = self.deferred + 1 if task is not None else 0
                    task = Task(proposal.config, proposal)
                elif proposal.gain is None:
                    self.queue.insert(0, Task(proposal.config, proposal))  # after this one
            if task.remeasure:
                self.deferred = 0
        task.index = self._next_index(task.key)
        task.node = node
        self.in_flight.append(task)
        return task

    def _baseline_here(self, node: str) -> Task | None:
        """The baseline again, on a node that has run it fewer than `confirming_launches`
        times (two, unless re-measuring is off) while another node has run it: each tree
        is compared with the baseline of its own node (`level_nodes`), so a node that runs
        apart from the others (a power cap) biases no speedup, and it rests on two
        baseline launches as a tree's recommendation rests on two of its own (with one
        per node, 2 of 12 TPE studies of replay-published with a node 8% slow shipped a
        tree 0.6% slow: one traced was compared with its node's one baseline launch,
        which ran low; benchmarks/RESULTS.md, stop 43). With one node it never fires."""
        if not node or (self.baseline is None and not any(
                t.key == "baseline" for t in self.in_flight)):
            return None
        ran = [node_of(r) for r in self.launched
               if r.ok and config_key(r.config) == "baseline"]
        ran += [t.node for t in self.in_flight if t.key == "baseline"]
        # Launches of unknown node (another search's, expected or handed over) count
        # for no node.
        if not any(n and n != node for n in ran) or \
                ran.count(node) >= self.spec.search.confirming_launches:
            return None
        return Task(BASELINE, remeasure=True)

    def _may_defer(self) -> bool:
        """Whether a re-measurement may wait for a proposal the strategy forecasts to gain:
        not for long, and not near the end of the launch budget."""
        if not strategies.STRATEGIES[self.strategy_name].forecasts or self.deferred >= DEFER_MAX:
            return False
        if self.spec.objective is not Objective.THROUGHPUT:
            return False  # the forecasts are of throughput, not of the objective
        budget = self.spec.budget.launches
        return budget is None or self.launches + len(self.in_flight) < budget - DEFER_MAX

    def _remeasure(self) -> Task | None:
        """A recommendation feasible by a thin margin first (`_remeasure_thin`); else a
        config that would become a recommendation if it were confirmed (borderline, or
        feasible on one launch only): re-launched, the baseline first while it has fewer
        launches."""
        busy = {t.key for t in self.in_flight}
        limit = self.spec.search.max_launches_per_config
        if limit <= 1 or self.baseline is None:
            return None
        noise = self.noise()
        candidates: list[Candidate] = []
        every = tuple(self.spec.dataset_names)
        # Asked for only when needed: it costs a model evaluation. Its estimates are of
        # throughput, so they speak for no other objective.
        estimates = functools.cache(
            lambda: (self.estimates() or {}) if self.spec.objective is Objective.THROUGHPUT
            else {})
        # What is recommended comes first: a recommendation feasible by a thin margin is
        # measured again before any other tree is confirmed. Behind those confirmations it
        # waited while trees at the floor took their launches (a traced dense-band study
        # recommended a tree truly at the floor from launch 15 to 30 on a baseline of two
        # launches; benchmarks/RESULTS.md, stop 61).
        ranked = self._confirmed_by_rank(noise, estimates())
        if (thin := self._remeasure_thin(busy, ranked)) is not None:
            return thin
        if (stale := self._remeasure_stale(busy, ranked)) is not None:
            return stale
        for batch in self.spec.batch:
            # The mixed workload's recommendation; when no tree is even plausible for every
            # dataset at this batch size, each dataset's own (what a server dedicated to
            # that workload runs), or they would never be confirmed.
            if not self._unsettled(batch, every, noise, busy, limit, candidates, estimates) \
                    and len(every) > 1:
                for dataset in every:
                    self._unsettled(batch, (dataset,), noise, busy, limit, candidates,
                                    estimates)
        if not candidates:
            return self._remeasure_leader(busy, ranked, bool(estimates()))
        model = estimates()

        def expected_regression(key: str, batch: int, names: tuple[str, ...]) -> bool:
            config = self.results[key].config
            return any((e := model.get((config, batch, d))) is not None
                       and e.log_mean + 2 * math.sqrt(e.variance) < math.log(self.floor)
                       for d in names)

        # The model, from every launch so far, may be sure of a regression: not worth a
        # launch. A model that does not fit is not sure of much (its variance says so).
        viable = [c for c in candidates if not expected_regression(c.key, c.batch, c.names)]
        if not viable:
            return None
        pick = max(viable, key=lambda c: c.gain)
        return self._baseline_first(pick.key, busy, pick.cap)

    def _unsettled(self, batch: int, names: tuple[str, ...], noise: StudyNoise, busy: set[str],
                   limit: int, candidates: list[Candidate],
                   estimates: Callable[[], Estimates]) -> bool:
        """Add to `candidates` every tree that would lead workload `names` at `batch` if it were
        confirmed: measured above the best confirmed tree, or plausible on its launch(es)
        and ranked above it with the model's `estimates` blended in; returns whether any
        tree is plausible there. The gain is weighed by the chance that the tree's and the
        baseline's launches, up to their caps, can prove it, per launch the proof needs
        (`_worth`): a tree at the floor on one dataset leads the mean where the constraint
        binds, and no launches the caps allow confirm it (a traced binding-floor study
        re-measured such trees for 25 launches and recommended no speculation, half the
        best, to the end; benchmarks/RESULTS.md, stop 59)."""
        assert self.baseline is not None
        verdicts = {key: self._verdict(result, batch, names, noise)
                    for key, result in self.results.items()
                    if result.ok and isinstance(result.config, TreeConfig)}
        confirmed = [v.mean for v in verdicts.values() if v.confirmed]
        best = max(confirmed, default=1.0)
        # Where no tree is confirmed the workload runs without speculation, so a plausible
        # tree may take UNRECOMMENDED_LAUNCHES times the limit: a 397B study's (3,1,4),
        # 1.12x on its slowest dataset in truth, measured 4% low on three launches once the
        # baseline's third and fourth ran high, its bound a hair under the floor, and batch
        # 32 recommended no speculation (0.52 of the best) from launch 14 to the end
        # (benchmarks/RESULTS.md, stop 54).
        cap = limit if confirmed else limit * UNRECOMMENDED_LAUNCHES
        # There the baseline follows such a tree, up to the same cap, whenever the tree has
        # more launches than it: every speedup's error is as much the baseline's as the
        # tree's, so a tree at its cap is proven no further while the baseline stays at the
        # limit (a traced study of a DeepSeek-V3 world ran no speculation at batch 1, 0.83
        # of the best, for all its 30 launches: its (1,1,2), 5.2% clear of the floor on its
        # slowest dataset in truth, reached its cap of six at launch 15 while the baseline
        # had three, four from launch 22; benchmarks/RESULTS.md, stop 87).

        def launchable(key: str) -> bool:
            """The tree, or the baseline before it, may take another launch."""
            return key not in busy and (launches_of(self.results[key]) < cap or (
                not confirmed and self._baseline_due(key, busy, cap)))

        # Another launch could make these a recommendation.
        open_ = {key: v for key, v in verdicts.items() if v.unsettled and launchable(key)}
        worth = functools.cache(lambda key: self._worth(key, batch, names, noise, cap))
        candidates += [Candidate((v.mean - best) * worth(key), key, batch, names, cap)
                       for key, v in open_.items() if v.mean > best]
        # A tree plausible but unconfirmed, below the best confirmed one as measured but
        # above it as recommendations rank (the model, pooling every launch, blended in):
        # one more launch lets it be recommended. Without it a tree measured low once was
        # never confirmed, however the model ranked it (a traced wrong-prior study kept a
        # tree 1.3% below the best for 20 launches so; benchmarks/RESULTS.md, stop 37), nor
        # one whose one-launch bound still reached below the floor (a 397B study's tree 0.98
        # of the best stayed on one launch so, traced at stop 39; stop 40 measured the rule).
        behind = [key for key, v in open_.items() if v.mean <= best]
        if behind and (model := estimates()):
            ranked = {key: self._verdict(self.results[key], batch, names, noise, model)
                      for key, v in verdicts.items() if v.confirmed or key in behind}
            leader = max((v.rank for v in ranked.values() if v.confirmed), default=1.0)
            candidates += [Candidate((ranked[key].rank - leader) * worth(key), key, batch,
                                     names, cap)
                           for key in behind if ranked[key].rank > leader]
        return any(v.plausible for v in verdicts.values())

    def _worth(self, key: str, batch: int, names: tuple[str, ...], noise: StudyNoise,
               cap: int) -> float:
        """What a launch toward proving a measured tree over workload `names` at `batch` is
        worth per unit of its gain: the chance that the tree and the baseline, given up to
        `cap` launches each (`_baseline_first`), prove it, over the launches that proof
        needs at today's means (`proof_outlook`). A gain one launch away goes before a
        larger one three launches away: in a traced dense-band study batch 32's first
        tree, three launches from its proof, went first, and batch 1's best tree, one
        launch from its own, was never proven; weighed per launch, it was proven at launch
        9 and the study reached its target at 14 (benchmarks/RESULTS.md, stop 89)."""
        assert self.baseline is not None
        outlook = proof_outlook(self.results[key], self.baseline, batch, list(names),
                                self.spec.tolerance, noise, cap, cap, self.spec.criterion)
        return outlook.chance / outlook.launches

    def _verdict(self, result: LaunchResult, batch: int, names: tuple[str, ...],
                 noise: StudyNoise, model: Estimates | None = None) -> Verdict:
        """`judge` as the planner asks it: against the study's baseline, tolerance,
        confirming launches and criterion."""
        assert self.baseline is not None
        return judge(result, self.baseline, batch, list(names), self.spec.tolerance, noise,
                     model, self.spec.search.confirming_launches, self.spec.criterion)

    def _baseline_first(self, key: str, busy: set[str], cap: int | None = None) -> Task:
        """The re-measurement of `key`, or of the baseline before it (`_baseline_due`, the
        baseline up to `cap` launches; default: the per-config limit)."""
        if self._baseline_due(key, busy, cap or self.spec.search.max_launches_per_config):
            key = "baseline"
        return Task(self.results[key].config, remeasure=True)

    def _baseline_due(self, key: str, busy: set[str], cap: int) -> bool:
        """Whether the baseline is launched before `key`'s re-measurement: the baseline's
        noise shifts every speedup, and its second launch is the study's first measure of
        launch noise, so it goes first once; after that only when the tree has more
        launches, up to `cap` launches."""
        assert self.baseline is not None
        base = launches_of(self.baseline)
        return (base < cap and "baseline" not in busy
                and (base < 2 or base < launches_of(self.results[key])))

    def _confirmed_by_rank(self, noise: StudyNoise, model: Estimates
                           ) -> dict[int, list[Verdict]]:
        """Per batch size, the confirmed trees' verdicts on the mixed workload, best rank
        first (the first is the recommendation); `model`: the strategy's estimates, blended
        into the ranks."""
        names = tuple(self.spec.dataset_names)
        return {batch: sorted((verdict for result in self.results.values()
                               if result.ok and isinstance(result.config, TreeConfig)
                               and (verdict := self._verdict(result, batch, names, noise,
                                                             model)).confirmed),
                              key=lambda v: v.rank, reverse=True)
                for batch in self.spec.batch}

    def _remeasure_leader(self, busy: set[str], ranked: dict[int, list[Verdict]],
                          with_model: bool) -> Task | None:
        """The winner's curse: of many trees measured once, the one that looks best is
        likely the luckiest draw. A recommendation on one launch (sure of its feasibility)
        whose lead over the runner-up is within the noise of its measurement is measured
        once more (the baseline first, as for confirmations), so the ranking does not rest
        on one lucky launch; and a runner-up on one launch that the model says was unlucky,
        close behind a leader on more, likewise. Then, with the model, a close race (the
        runner-up possibly ahead by more than RACE_MARGIN) gives the one of the two on
        fewer launches another, up to the limit per config. `ranked`: the confirmed
        trees per batch size (`_confirmed_by_rank`); `with_model`: whether the strategy's
        estimates are blended into their ranks."""
        needs = self.spec.search.confirming_launches
        limit = self.spec.search.max_launches_per_config
        for confirmed in ranked.values():
            if len(confirmed) < 2:
                continue
            leader, runner_up = confirmed[0], confirmed[1]
            key = config_key(leader.config)
            gap = math.log(leader.rank / runner_up.rank)
            if leader.launches < needs and key not in busy:
                spread = statistics.fmean(i.log_sd for i in leader.intervals.values())
                if gap < Z_INTERVAL * spread:
                    return self._baseline_first(key, busy)
            # Its mirror, the loser's curse: a runner-up sure of its feasibility on one
            # launch measured below what the model (pooling every launch) expects of it,
            # behind a leader on more launches by less than their ranks' errors, is
            # measured once more, or the order rests on that unlucky launch (a traced
            # study kept a tree 5% below the best at batch 32 for 25 launches so). One
            # measured above the model's estimate already has its luck in its rank.
            key = config_key(runner_up.config)
            errors = math.hypot(leader.rank_sd, runner_up.rank_sd)
            if (runner_up.launches < min(needs, leader.launches) and key not in busy
                    and runner_up.rank > runner_up.mean and gap < errors):
                return self._baseline_first(key, busy)
            # A close race: while the runner-up may be ahead in truth by more than
            # RACE_MARGIN (within the gap's error, as the intervals widen it), the one of
            # the two on fewer launches (the runner-up on a tie) is measured again, up to
            # the limit (a traced study recommended a tree 5% below the best at batch 32 to
            # the end so, both on two launches). Only with a model's estimates in the
            # ranks: without them a rank's error is one tree's measurement, the prior
            # noise's until repeats teach otherwise, and races re-measured a noise-free
            # engine's trees until its budget was spent (grid, tests/test_method_study.py).
            if with_model and gap + RACE_MARGIN < errors:
                fewer = min((runner_up, leader), key=lambda v: v.launches)
                key = config_key(fewer.config)
                if fewer.launches < limit and key not in busy:
                    return self._baseline_first(key, busy)
        return None

    def _remeasure_thin(self, busy: set[str], ranked: dict[int, list[Verdict]]
                        ) -> Task | None:
        """A recommendation (the mixed workload's, at some batch size) feasible by a thin
        margin, its 99% bound within THIN_SDS standard errors of the floor on a dataset and
        not sure: the baseline again while it has no more launches than the tree (up to one
        past the per-config limit: every speedup rests on it), else the tree, up to the
        limit, and then the baseline again up to THIN_BASELINE_LIMITS times the limit. Its
        speedup then rests on less luck of either. It comes before every other
        re-measurement and is never put off for a proposal (`Task.thin`). `ranked`: as
        `_remeasure_leader` reads it."""
        assert self.baseline is not None
        limit = self.spec.search.max_launches_per_config
        base = launches_of(self.baseline)
        for confirmed in ranked.values():
            leader = confirmed[0] if confirmed else None
            if leader is None or leader.sure or not any(
                    math.log(leader.lower[d] / leader.floor) < THIN_SDS * i.log_sd
                    for d, i in leader.intervals.items()):
                continue
            # Short of the tree's limit the baseline goes while it has no more launches
            # than the tree; at the limit, up to THIN_BASELINE_LIMITS times it.
            at_limit = leader.launches >= limit
            if "baseline" not in busy and \
                    base < (THIN_BASELINE_LIMITS * limit if at_limit else leader.launches + 1):
                return Task(BASELINE, remeasure=True, thin=True)
            if not at_limit and config_key(leader.config) not in busy:
                return Task(leader.config, remeasure=True, thin=True)
        return None

    def _remeasure_stale(self, busy: set[str], ranked: dict[int, list[Verdict]]
                         ) -> Task | None:
        """The baseline again when a recommendation (the mixed workload's, at some batch
        size) was launched last STALE_LAUNCHES or more launches after the baseline's latest
        launch, running or done, up to THIN_BASELINE_LIMITS times the per-config limit
        (as a thin margin's): the recommendation is then compared with a baseline of
        another time, and only the baseline launched at several times shows whether the
        machine's speed moved in between (`evidence.level_trend`). At +1% per launch the
        trees launched late looked good, no margin was thin, and the baseline of launches 1
        and 3 was never launched again (benchmarks/RESULTS.md, stop 68). `ranked`: as
        `_remeasure_leader` reads it."""
        limit = THIN_BASELINE_LIMITS * self.spec.search.max_launches_per_config
        if "baseline" in busy or self._next_index("baseline") >= limit:
            return None
        latest: dict[str, int] = {}
        for place, result in zip(places(self.launched), self.launched, strict=True):
            key = config_key(result.config)
            latest[key] = max(place, latest.get(key, -1))
        for confirmed in ranked.values():
            if confirmed and latest.get(config_key(confirmed[0].config), -1) \
                    >= latest.get("baseline", -1) + STALE_LAUNCHES:
                return Task(BASELINE, remeasure=True)
        return None

    # ---- adaptive steps ---------------------------------------------------------------
    def _adaptive_chains(self) -> list[Task]:
        """The chains the tuning reads, measured like compared configs (`adaptive: true`)."""
        if not self.spec.adaptive:
            return []
        return [Task(c) for c in adaptive_chains() if not self.is_known(config_key(c))]

    def _plan_adaptive(self) -> None:
        """Once the baseline and every chain are measured: SGLang's default adaptive
        config and the tuned one, queued (so before the strategy's next proposal); then a
        re-launch of one whose verdict is unsettled at some batch size, one at a time."""
        if not self.spec.adaptive or self.baseline is None:
            return
        waiting = {t.key for t in (*self.queue, *self.in_flight)}
        if any(config_key(c) in waiting for c in adaptive_chains()):
            return  # the tuning waits for every chain
        if self.static_adaptive():
            # What kept one server's controller off (a model's own switch, such as
            # multi-layer EAGLE) keeps every other's off: no more adaptive launches (`next`
            # drops those queued).
            return
        known = [c for c in (*(r.config for r in self.results.values()),
                             *(t.config for t in (*self.queue, *self.in_flight)))
                 if isinstance(c, AdaptiveConfig)]
        configs = [AdaptiveConfig.sglang_default()]
        # Tuned again after every launch while no chain is surely faster than no speculation
        # anywhere (the tuning then has nothing to draft with): from one launch each, and
        # the baseline's one, 4 of 8 in-process studies of 12 launches never tuned at all;
        # tuned again, all 8 launched a tuned config, once the baseline's second launch
        # (for SGLang's default's unsettled verdict) had narrowed every interval.
        if (self.tuning is None or self.tuning.config is None) \
                and all(c.is_sglang_default for c in known):
            self.tuning = tune(self.spec.batch, self.spec.dataset_names, self.spec.tolerance,
                               self.results.values(), self.baseline, self.noise(),
                               self.strategy.estimates(adaptive_chains()),
                               self.spec.criterion, self.spec.server_flags)
            if self.tuning.config is not None:
                configs.append(self.tuning.config)
        self.queue += [Task(c) for c in configs if not self.is_known(config_key(c))]
        if any(isinstance(t.config, AdaptiveConfig) for t in (*self.queue, *self.in_flight)):
            return
        limit = self.spec.search.max_launches_per_config
        names, noise = tuple(self.spec.dataset_names), self.noise()
        unsettled: list[tuple[float, str]] = []  # (mean rank over batch sizes, key)
        for key, result in self.results.items():
            if (not isinstance(result.config, AdaptiveConfig) or not result.ok
                    or launches_of(result) >= limit or key in waiting):
                continue
            verdicts = [self._verdict(result, b, names, noise) for b in self.spec.batch]
            if any(v.unsettled for v in verdicts):
                unsettled.append((statistics.fmean(v.rank for v in verdicts), key))
        if unsettled:  # the likelier recommendation first
            self.queue.append(self._baseline_first(max(unsettled)[1], waiting))

    # ---- what happened ----------------------------------------------------------------
    def finish(self, task: Task, result: LaunchResult) -> LaunchResult:
        """Record a finished launch; returns the config's merged result."""
        self.in_flight.remove(task)
        merged = self._record(task.key, result)
        if isinstance(task.config, TreeConfig) and not task.remeasure:
            self.pending.append((merged, task.proposal))
        self._tell_pending()
        self._plan_adaptive()
        return merged

    def odd_notes(self, key: str) -> list[str]:
        """The notes (`_odd_note`) due once a launch of `key` finished: its own, then
        any other config's launched more than once, whose odd launch the noise learned
        since may show (a yardstick learned from a study's first few launches is wide, and
        a slow launch judged then alone would never be named); judged again while one is
        newly named, as a launch named leaves the others' yardstick."""
        by_key: dict[str, list[LaunchResult]] = {}
        for result in self.launched:
            by_key.setdefault(config_key(result.config), []).append(result)
        repeated = {k: self._untold(k, rs) for k, rs in by_key.items()}
        windows = window_spread(self.launched)
        keys = [key, *(k for k, rs in by_key.items() if k != key and len(rs) >= 2)]
        notes: list[str] = []
        named = True
        while named:  # each pass that names one adds to told_odd: at most one per launch
            named = False
            for k in keys:
                if note := self._odd_note(k, by_key, repeated, windows):
                    notes.append(note)
                    repeated[k] = self._untold(k, by_key[k])  # one fewer to learn from
                    named = True
        return notes

    def _untold(self, key: str, launches: list[LaunchResult]) -> LaunchResult | None:
        """`key`'s launches but those already said odd, merged: what its launch-to-launch
        spread is learned from (None when fewer than two are left, failed ones counted:
        nothing to learn; a merge of one measured launch gives nothing either)."""
        kept = [r for i, r in enumerate(launches) if (key, i) not in self.told_odd]
        return merge(kept) if len(kept) >= 2 else None

    def _odd_note(self, key: str, by_key: dict[str, list[LaunchResult]],
                  repeated: dict[str, LaunchResult | None], windows: tuple[float, int]
                  ) -> str | None:
        """A word for the user when one of `key`'s launches ran unlike its others
        (`odd_launch`, judged by the launch noise the study learned from its other configs
        and the sub-window spread of every launch), once per launch: a slow GPU or a busy
        node is worth a look. The launch still counts as measured; the learned noise, and
        every bound with it, widens by it. `by_key`, `repeated`, `windows`: the launches
        per config, `_untold` of each and the `window_spread` of every launch."""
        launches = by_key.get(key, [])
        # The launch noise from the other configs' launches but those already said odd
        # (one odd launch would widen the yardstick until the next went unnoticed); only
        # a config with two launches or more has a spread to learn it from.
        others = [m for k, m in repeated.items() if k != key and m is not None]
        # The sub-windows of every launch, this config's too: a launch-wide factor moves
        # none of a launch's sub-windows against another, and one other config's few
        # windows made the yardstick (a lagged launch's two windows, one 1.6 times the other,
        # beside two CPU hogs, hid a launch at a quarter of its config's speed).
        noise = study_noise(others, self.spec.search.launch_cv,
                            learned=self.spec.search.learns_noise, windows=windows)
        odd = odd_launch(launches, noise, {i for k, i in self.told_odd if k == key})
        if odd is None:
            return None
        others_of = sum(1 for i, r in enumerate(launches) if r.ok and r.cells
                        and i != odd.index and (key, i) not in self.told_odd)
        self.told_odd.add((key, odd.index))
        count = len(launches)
        where = f" on {odd.worker}" if odd.worker else ""
        return (f"{launches[0].config}: launch {odd.index + 1} of {count}{where} ran "
                f"{abs(odd.shift):.0%} {'slower' if odd.shift < 0 else 'faster'} than "
                f"{'its other launch' if others_of == 1 else 'its other launches'}, "
                f"{odd.sigmas:.0f} standard deviations out, where the study's launch noise "
                f"is {noise.launch_cv:.1%}: a throttled GPU or a busy node? It counts as "
                "measured; the study's noise, and every bound, widen with it")

    def node_notes(self) -> list[str]:
        """A word for the user on each node whose launches run, config for config, apart
        from the other nodes' (`node_shifts`, on the launches as measured), once per node:
        a slow node's baseline would make every tree measured elsewhere look faster, which
        is why the study compares each tree with the baseline run on its own node
        (`level_nodes`)."""
        noise = node_yardstick(self.launched, self.spec.search.launch_cv,
                               self.spec.search.learns_noise)
        notes = []
        for shift in node_shifts(self.launched, noise):
            if shift.node in self.told_nodes:
                continue
            self.told_nodes.add(shift.node)
            notes.append(
                f"node {shift.node} runs {abs(shift.shift):.0%} "
                f"{'slower' if shift.shift < 0 else 'faster'} than the other nodes on the "
                f"same configs ({shift.launches} launches of {shift.configs} configs there, "
                f"{shift.sigmas:.0f} standard errors out): the study compares each tree "
                "with the baseline run on its own node, as it does on every node, but "
                "trees measured on unlike nodes are ranked less surely. Nodes that run "
                "alike need fewer launches")
        return notes

    def trend_notes(self) -> list[str]:
        """A word for the user, once, when the machine's speed clearly moves with time
        (`level_trend`): the study then compares each tree with the baseline at the
        baseline's time, and its bounds widen by the trend's error."""
        if self.told_trend or (trend := self.trend) is None:
            return []
        self.told_trend = True
        move = math.exp(trend.slope) - 1
        return [f"the machine runs {abs(move):.2%} {'faster' if move > 0 else 'slower'} "
                f"with each launch ({trend.sigmas:.0f} standard errors out, from the "
                f"baseline's {trend.baselines} launches in {trend.launches}): "
                "a GPU warming up or a neighbour coming or going? The study compares each "
                "tree with the baseline at the baseline's time, and its bounds widen by "
                "the trend's error. A machine that runs steadily needs fewer launches"]

    def static_adaptive(self) -> list[LaunchResult]:
        """The adaptive launches whose servers served static trees (by their server info,
        `ServerApi.runs_adaptive`): they measured their starting chain, not a controller."""
        return static_adaptive(self.spec, self.launched)

    def static_notes(self) -> list[str]:
        """A word for the user, once, when an adaptive launch's server served static
        trees."""
        if self.told_static or not (static := self.static_adaptive()):
            return []
        self.told_static = True
        return [f"{static[0].config}'s server served static trees though asked for adaptive "
                "steps: no adaptive config is advised or launched again (the launch's "
                "warning says why; what turned its controller off turns it off on every "
                "server of this study)"]

    def tuning_notes(self) -> list[str]:
        """A word for the user, once, when the chains are measured and none is surely
        faster than no speculation at any batch size: the tuned adaptive config waits."""
        if self.told_tuning or self.tuning is None or self.tuning.config is not None:
            return []
        self.told_tuning = True
        return ["no chain is yet surely faster than no speculation at any batch size, so "
                "the adaptive config tuned from the chains waits: the tuning is redone after "
                "each launch, and SGLang's default adaptive config is measured meanwhile"]

    def _prior(self, facts: BackendFacts | None) -> tuple[Profile | None, str]:
        """`study_prior`, at the share of memory the study's trees' servers took
        (`memory_notes`: a resumed study's, or one whose facts came later)."""
        prior, why_not = study_prior(self.spec, facts)
        if prior is not None and (share := self._served_share()) is not None \
                and not self.spec.methods:
            prior = with_memory_share(prior, share)
        return prior, why_not

    def _served_share(self) -> float | None:
        """The share of each GPU's memory SGLang took for weights and KV cache in the
        study's trees of its own method (`server_info`), when the study's flags leave it to
        SGLang; None until such a server said. One for the study, the least where nodes of
        unlike GPUs took unlike shares (not a new search at every launch)."""
        if self.spec.mem_fraction_static is not None:
            return None
        shares = [float(value) for result in self.launched
                  if result.ok and isinstance(result.config, TreeConfig)
                  and not result.config.method
                  and isinstance(value := result.server_info.get("mem_fraction_static"),
                                 int | float) and 0 < value <= 1]
        return min(shares, default=None)

    def baseline_memory(self) -> str:
        """What the prior (the models' and the GPU's facts) says when the baseline's server
        cannot start at the study's TP, its weights leaving no room for a KV cache, and
        which TP would; '' otherwise. Said before the first launch: SGLang refuses such a
        server only once it has loaded the weights, minutes on a large model."""
        prior = self.context.prior
        if prior is None or self.baseline is not None:
            return ""

        def at(tp: int) -> MemoryCheck | None:
            try:
                return check_memory(prior, BASELINE, self.spec.max_batch, tp=tp,
                                    mem_fraction_static=self.spec.mem_fraction_static)
            except TreetuneError:  # a TP the study's attention groups do not divide
                return None

        memory = at(self.spec.tp)
        if memory is None or memory.cause != "weights":
            return ""
        # The prior's GPU count is the study's TP, not the node's: the usual 8 at most.
        larger = next((tp for tp in (2, 4, 8) if tp > self.spec.tp
                       and (check := at(tp)) is not None and check.starts), None)
        hint = (f"--tp {larger} would leave room" if larger is not None else
                "no TP within one node of 8 GPUs would")
        return (f"the prior says the baseline's server cannot start at --tp {self.spec.tp} on "
                f"{prior.hardware.gpu} ({memory.brief}); {hint}")

    def memory_notes(self) -> list[str]:
        """The model search proposes only the trees that can start at the study's largest
        batch, judged at the prior's share of GPU memory. Left to choose, SGLang sizes
        that share by itself (by the GPU's memory, the parallel size, the CUDA-graph cap,
        the draft, and differently from release to release): once a tree's server says
        what it took, the search judges at that share, and a word says so. Not in a study
        of several draft methods, whose servers reserve unlike room for their drafts."""
        share, prior = self._served_share(), self.context.prior
        if (share is None or prior is None or self.method_search is not None
                or abs(share - prior.server.mem_fraction_static) < 5e-4):
            return []
        before = prior.server.mem_fraction_static
        self.context = dataclasses.replace(self.context, prior=with_memory_share(prior, share))
        if isinstance(self.strategy, ModelStrategy):  # what it learnt stands
            self.strategy.reshare(self.context)
        return [f"SGLang took {share:g} of each GPU's memory for weights and KV cache (its "
                f"own choice, the study's server_flags leave it; the prior assumed "
                f"{before:g}): from launch {self.launches + 1} on, the model search "
                "proposes the trees that can start at that share (--mem-fraction-static in "
                "server_flags chooses it)"]

    def kernel_notes(self) -> list[str]:
        """A word for the user, once per attention backend, when a tree's server resolved
        another attention backend than its own node's baseline (`server_info`): left to
        choose, SGLang on Hopper takes fa3 for chains and no speculation but flashinfer or
        triton for trees of topk > 1, so the study would compare kernels as well as
        trees. Pinning one in `server_flags` is the remedy."""
        def backend(result: LaunchResult) -> str | None:
            value = result.server_info.get("attention_backend")
            return str(value) if result.ok and value else None

        # Each node's baselines: a tree is compared with its own node's (`level_nodes`),
        # and unlike GPUs may resolve unlike defaults.
        base: dict[str, set[str]] = {}
        for result in self.launched:
            if result.config == BASELINE and (kernel := backend(result)):
                base.setdefault(node_of(result), set()).add(kernel)
        notes = []
        for result in self.launched:
            kernel, own = backend(result), base.get(node_of(result), set())
            if (result.config == BASELINE or kernel is None or not own or kernel in own
                    or kernel in self.told_kernels):
                continue
            self.told_kernels.add(kernel)
            notes.append(
                f"{result.config} ran attention backend {kernel}, the baseline "
                f"{' and '.join(sorted(own))}: the study compares kernels as well as trees "
                "(SGLang picks the backend by topk unless told). Pin one in the study's "
                "server_flags, e.g. {--attention-backend: "
                f"{sorted(own)[0]}}}, in a new study")
        return notes

    def _record(self, key: str, result: LaunchResult) -> LaunchResult:
        """A finished launch of `key` (this search's or another's) kept; returns the
        config's merged result."""
        self.launched.append(result)
        # A baseline launch on another node can change every config's leveling.
        self._merge()
        return self.results[key]

    def _merge(self) -> None:
        """`results`: every config's launches merged, leveled by a time trend and by node
        (`leveled_launches`); `trend`: the trend leveled (None: none)."""
        leveled, self.trend = leveled_launches(self.launched, self.spec.search.launch_cv,
                                               self.spec.search.learns_noise)
        self.results = merge_all(leveled)
        # The study's learned noise of throughput, whatever the objective: what the model
        # strategy fits, and asks for every measured cell of every refit.
        self._throughput_noise = study_noise(self.results.values(), self.spec.search.launch_cv)

    def _next_index(self, key: str) -> int:
        """Which launch of `key` the next one is: those finished and those running."""
        return (sum(1 for r in self.launched if config_key(r.config) == key)
                + sum(1 for t in self.in_flight if t.key == key))

    def _tell_pending(self) -> None:
        """Once the baseline is known: the per-batch studies are told this search's
        launches, and the strategy sees every launch (another search told the studies of
        its own)."""
        if self.baseline is None:
            return
        for told, proposal in self.pending:
            self.studies.record(proposal.trials if proposal else [], told, self.baseline)
            self.strategy.observe(told, self.baseline)
        for told in self.absorbed:
            self.strategy.observe(told, self.baseline)
        self.pending.clear()
        self.absorbed.clear()

    # ---- other searches of the study (a shared storage) ---------------------------------
    def hand_over(self, task: Task) -> None:
        """Another search claimed this launch first: it runs there, and counts as running
        here until its result comes in (`absorb`) or it is given up (`given_up`)."""
        task.elsewhere = True
        task.node = ""  # wherever the other search runs it
        if task.proposal:  # the other search tells the per-batch studies
            self.studies.abandon(task.proposal.trials, "launched by another search")
            task.proposal = None

    def expect(self, config: ServerConfig, index: int) -> None:
        """A launch (the index-th of `config`) another search runs: known, and counted
        as running; the same launch waiting in the queue is dropped."""
        key = config_key(config)
        if any(t.key == key and t.index == index for t in self.in_flight):
            return
        self._drop_queued(key, index)
        self.in_flight.append(Task(config, index=index, elsewhere=True))

    def absorb(self, result: LaunchResult, index: int) -> LaunchResult:
        """A launch another search finished (the index-th of its config): counted as one
        of this search's. Returns the config's merged result."""
        key = config_key(result.config)
        self._take_elsewhere(key, index)
        self._drop_queued(key, index)
        merged = self._record(key, result)
        if isinstance(result.config, TreeConfig) and index == 0:
            self.absorbed.append(merged)
        self._tell_pending()
        self._plan_adaptive()
        return merged

    def given_up(self, key: str, index: int) -> None:
        """Another search gave a launch up (it was stopped, or died): a config this
        search would queue itself (the baseline, a compared config, an adaptive one) is
        queued again, first; a tree a strategy proposed is free to be proposed again."""
        task = self._take_elsewhere(key, index)
        if task is None or index > 0 or key in self.results:
            return  # a re-measurement is re-decided (`_remeasure`), not redone as such
        own = {config_key(c) for c in (BASELINE, *self.spec.compare)}
        if key in own or isinstance(task.config, AdaptiveConfig):
            self.queue.insert(0, Task(task.config))

    def _take_elsewhere(self, key: str, index: int) -> Task | None:
        """Another search's launch, no longer counted as running here."""
        task = next((t for t in self.in_flight
                     if t.elsewhere and t.key == key and t.index == index), None)
        if task is not None:
            self.in_flight.remove(task)
        return task

    @property
    def elsewhere(self) -> list[Task]:
        """Launches other searches run now."""
        return [t for t in self.in_flight if t.elsewhere]

    def _drop_queued(self, key: str, index: int) -> None:
        """A queued launch of `key` that would be its index-th is another search's."""
        queued = next((t for t in self.queue if t.key == key), None)
        if queued is not None and self._next_index(key) == index:
            self.queue.remove(queued)

    def requeue(self, task: Task) -> None:
        """A launch whose worker died: done again first, with the same proposal."""
        self.in_flight.remove(task)
        self.queue.insert(0, task)

    def abandon(self, reason: str) -> None:
        """The search ends: proposals still waiting for a result are failed in storage, so a
        resumed search asks again."""
        for task in (*self.in_flight, *self.queue):
            if task.proposal:
                self.studies.abandon(task.proposal.trials, reason)
        self.studies.abandon_all(reason)

