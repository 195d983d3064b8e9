"""SGLang's adaptive steps tuned from a study's measurements.

SGLang's controller (domain.md section 7) chases accept length: in each batch-size slot it
climbs to a longer chain whenever the drafts it accepts say a longer one would accept more,
whatever that costs the verify pass. So a slot's candidate set is the only lever, and the
measured chains decide it: per study batch size, the best chain (by its verdict's rank over
the workload's datasets, among chains surely no slower than no speculation on any dataset;
no drafting, 0, when none is) and the shorter feasible chains whose interval reaches the
best's rank (within the noise of it), up to the longest chain that is the best for some
dataset alone. The controller follows each request stream's acceptance: traffic that
accepts much (code, say) climbs to the longer chain that is best for it, traffic that
accepts less steps down. Chains longer than every dataset's best are left out even when
within the noise, so the controller cannot climb past them.

Each measured batch size gets a slot, keyed halfway (geometrically) from the previous one,
the first at 1: a running batch thins out for a moment whenever a request finishes, and
should stay in its own slot rather than fall into the smaller batch size's. Chains nobody
measured may enter from the model's estimates, flagged as estimated.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treetune.backends.sglang_adaptive import graph_sizes_for, padded_batch
from treetune.config import AdaptiveConfig, AdaptiveSlot, TreeConfig, chain
from treetune.objectives import THROUGHPUT, Criterion, Objective
from treetune.results import LaunchResult
from treetune.strategies import Estimates
from treetune.study.evidence import StudyNoise, Verdict, estimated_verdict, judge

# The chains a study with `adaptive: true` measures at every batch size (whatever its
# space holds: adaptive servers run chains only), SGLang's default candidates among them.
ADAPTIVE_CHAIN_STEPS = (1, 2, 3, 5)


def adaptive_chains() -> list[TreeConfig]:
    return [TreeConfig.of(s, 1, s + 1) for s in ADAPTIVE_CHAIN_STEPS]


def slot_keys(batches: Iterable[int], server_flags: Mapping[str, Any] | None = None
              ) -> list[int]:
    """The smallest running batch each study batch size's slot serves: 1 for the first,
    then halfway (geometrically) from the previous batch size, but above the CUDA-graph
    batch size SGLang pads the previous one to (`graph_sizes_for`) and not above this one:
    SGLang routes a batch by its padded size, and with batch sizes 1, 33 and 48 a key at
    the midpoint, 40, would serve 33 (padded to 40) from 48's slot. Two batch sizes padded
    alike share every slot (`shared_graph_size` refuses them in a study)."""
    ordered = sorted(set(batches))
    graphs = graph_sizes_for(ordered, server_flags)
    return [1] + [min(max(math.ceil(math.sqrt(a * b)), padded_batch(a, graphs) + 1), b)
                  for a, b in itertools.pairwise(ordered)]


@dataclass(frozen=True)
class SlotTuning:
    """One slot's choice and why."""

    batch: int  # the study batch size it was tuned at
    key: int  # the smallest running batch it serves
    best: int  # the best chain's steps (0: no speculation)
    steps: tuple[int, ...]  # its candidates
    estimated: tuple[int, ...] = ()  # candidates resting on the model's estimates

    def describe(self) -> str:
        flagged = (f" ({', '.join(map(str, self.estimated))} from model estimates)"
                   if self.estimated else "")
        return (f"batch {self.batch} (slot from {self.key}): best chain {self.best}, "
                f"candidates {{{','.join(map(str, self.steps))}}}{flagged}")


@dataclass(frozen=True)
class Tuning:
    slots: tuple[SlotTuning, ...]

    @property
    def config(self) -> AdaptiveConfig | None:
        """The tuned config; None when no slot would draft (that is the baseline)."""
        if not any(s > 0 for slot in self.slots for s in slot.steps):
            return None
        return AdaptiveConfig(tuple(AdaptiveSlot(s.key, s.steps) for s in self.slots))

    @property
    def estimated(self) -> bool:
        return any(slot.estimated for slot in self.slots)

    def describe(self) -> str:
        return "; ".join(slot.describe() for slot in self.slots)


def chain_verdicts(results: Iterable[LaunchResult], baseline: LaunchResult, batch: int,
                   datasets: list[str], tolerance: float, noise: StudyNoise,
                   estimates: Estimates | None = None,
                   steps: Sequence[int] = ADAPTIVE_CHAIN_STEPS,
                   criterion: Criterion = THROUGHPUT) -> dict[int, Verdict]:
    """Per chain length, the verdict at one batch size: measured chains (merged results)
    as measured; of `steps`, those not measured from the model's estimates, if any (of
    throughput: under another objective, measured chains only)."""
    verdicts = {r.config.steps: judge(r, baseline, batch, datasets, tolerance, noise, estimates,
                                      criterion=criterion)
                for r in results if r.ok and isinstance(r.config, TreeConfig)
                and r.config.is_chain and not r.config.method}  # the study's own method
    if criterion.objective is not Objective.THROUGHPUT:
        return verdicts
    for s in steps:
        if s not in verdicts and (v := estimated_verdict(chain(s), batch, datasets, tolerance,
                                                         estimates)) is not None:
            verdicts[s] = v
    return verdicts


def best_chain(verdicts: dict[int, Verdict]) -> int:
    """The steps of the best surely feasible chain, 0 (no drafting) when none is faster
    than not drafting at all."""
    feasible = {s: v for s, v in verdicts.items() if v.feasible}
    best = max(feasible, key=lambda s: feasible[s].rank, default=0)
    return best if best and feasible[best].rank > 1.0 else 0


def tune_slot(batch: int, key: int, verdicts: dict[int, Verdict],
              per_dataset: Sequence[dict[int, Verdict]] = ()) -> SlotTuning:
    """The candidates for one slot from its chains' verdicts over the workload, and over
    each of its datasets alone (see the module's rule)."""
    best = best_chain(verdicts)
    if best == 0:
        return SlotTuning(batch, key, 0, (0,))
    feasible = {s: v for s, v in verdicts.items() if v.feasible}
    top = feasible[best].rank
    ceiling = max([best, *(best_chain(v) for v in per_dataset)])
    steps = tuple(sorted(s for s, v in feasible.items()
                         if s == best or (s < best and v.overall.high >= top)
                         or best < s <= ceiling))
    return SlotTuning(batch, key, best, steps,
                      tuple(s for s in steps if feasible[s].estimated))


def tune(batches: Iterable[int], datasets: list[str], tolerance: float,
         results: Iterable[LaunchResult], baseline: LaunchResult, noise: StudyNoise,
         estimates: Estimates | None = None, criterion: Criterion = THROUGHPUT,
         server_flags: Mapping[str, Any] | None = None) -> Tuning:
    """A tuned adaptive config from a study's (merged) results, one slot per batch size,
    by the study's objective (`criterion`), keyed for the servers' CUDA-graph padding
    (their `server_flags`, `slot_keys`)."""
    results = list(results)
    ordered = sorted(set(batches))
    steps = ADAPTIVE_CHAIN_STEPS
    return Tuning(tuple(
        tune_slot(batch, key, chain_verdicts(results, baseline, batch, datasets, tolerance,
                                             noise, estimates, steps, criterion),
                  [chain_verdicts(results, baseline, batch, [d], tolerance, noise, estimates,
                                  steps, criterion)
                   for d in datasets] if len(datasets) > 1 else ())
        for batch, key in zip(ordered, slot_keys(ordered, server_flags), strict=True)))


def estimated_steps(config: AdaptiveConfig, results: Iterable[LaunchResult]) -> list[int]:
    """The positive candidate steps of `config` whose chain no launch measured: where an
    adaptive config rests on the model's estimates (or on SGLang's guess)."""
    measured = {r.config.steps for r in results
                if r.ok and isinstance(r.config, TreeConfig) and r.config.is_chain
                and not r.config.method}
    return [s for s in config.candidate_steps if s > 0 and s not in measured]
