"""Recommendations: per batch size, the best feasible config for the mixed workload and for
each dataset alone, with the evidence. `export` turns them into files.

Each workload's advice is of one of three kinds (`Recommendation.kind`):
- static: one tree (or no speculation) is the best confirmed config at every batch size;
- pools: batch sizes want different trees: one server pool per tree;
- adaptive: one pool running SGLang's adaptive steps with a measured adaptive config. It is
  chosen when that config is confirmed feasible at every batch size (every dataset's lower
  bound clears the floor, on enough launches; where its slot never drafts, not surely
  slower, since plain decoding cannot be proven faster) and at each batch size the upper
  bound of its mean speedup reaches the static pick's mean speedup (as good within the
  noise). Where one static tree would do, it must also be no worse on the means at any
  batch size. Of several such configs, the best mean rank over the batch sizes.
When no adaptive config qualifies but one is surely feasible at every batch size, it is
kept as the workload's `alternative` (one pool, at the measured cost it says), and
exported next to the recommendation.
"""

from __future__ import annotations

import dataclasses
import enum
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from treetune.backends.sglang_adaptive import graph_sizes_for
from treetune.config import BASELINE, AdaptiveConfig, ServerConfig, TreeConfig, tree_fields
from treetune.objectives import Objective
from treetune.results import LaunchResult, config_from_key, config_key
from treetune.study.evidence import (
    Estimates,
    StudyNoise,
    Verdict,
    best,
    judge,
    merge_all,
    noise_of,
)
from treetune.study.schedule import best_chain, chain_verdicts, estimated_steps
from treetune.study.spec import MIXED, StudySpec


class Advice(enum.StrEnum):
    """The kind of a workload's advice (recommendations.json's `kind`)."""

    STATIC = "static"  # one tree, or no speculation, at every batch size
    POOLS = "pools"  # one server pool per tree, batch sizes wanting different trees
    ADAPTIVE = "adaptive"  # one pool of SGLang's adaptive steps


STATIC, POOLS, ADAPTIVE = Advice.STATIC, Advice.POOLS, Advice.ADAPTIVE


def script_name(workload: str, batch: int, kind: Advice = STATIC) -> str:
    """One launch script per batch size; one for an adaptive pool, which serves them all."""
    if kind is ADAPTIVE:
        return f"launch/{workload}-adaptive.sh"
    return f"launch/{workload}-batch{batch}.sh"


@dataclass(frozen=True)
class Recommendation:
    workload: str  # "mixed" or a dataset name
    batch: int
    config: ServerConfig  # BASELINE: no speculation
    speedups: dict[str, float]  # measured, per dataset of the workload
    reason: str
    intervals: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    method: str | None = None  # the draft method (SGLang algorithm) it runs; None: none
    kind: Advice = STATIC  # the workload's advice
    # One adaptive pool instead, surely feasible at every batch size but not chosen (its
    # reason says what it would cost here); None when none is, or when it is the advice.
    alternative: Recommendation | None = None
    # What the speedups are of (treetune/objectives.py): 'throughput', 'tpot_p99', ...
    objective: str = Objective.THROUGHPUT.value
    # An adaptive server's: of its slot's candidates here, the chain measured best for the
    # workload (`_fixed_chain`; None: none of them measured), the step a fixed schedule
    # runs here (`export.chain_schedule`).
    chain_steps: int | None = None

    @property
    def mean_speedup(self) -> float:
        return statistics.fmean(self.speedups.values())

    @property
    def script_name(self) -> str:
        return script_name(self.workload, self.batch, self.kind)

    def label(self) -> str:
        return "no speculation" if self.config is BASELINE else self.config.label()

    def record(self) -> dict[str, Any]:
        """The stable JSON record of recommendations.json (steps, topk and draft_tokens
        are null for no speculation and for an adaptive server: see `config`)."""
        return {
            "workload": self.workload,
            "batch": self.batch,
            "kind": str(self.kind),
            "config": config_key(self.config),
            **tree_fields(self.config),
            "method": self.method,
            "speedups": {k: round(v, 4) for k, v in self.speedups.items()},
            "intervals": {k: [round(lo, 4), round(hi, 4)]
                          for k, (lo, hi) in self.intervals.items()},
            "launch_script": self.script_name,
            "reason": self.reason,
            "alternative": self.alternative.record() if self.alternative else None,
            "objective": self.objective,
            "chain_steps": self.chain_steps,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any], algorithm: str | None = None
                    ) -> Recommendation:
        """Back from `record()` (as stored with the study, also before `config` was kept);
        `algorithm`: the study's own method, whose trees carry none (None: every record is
        of the study's own)."""
        knobs = (record["steps"], record["topk"], record["draft_tokens"])
        method = record.get("method")
        tag = f"{method}:" if method and algorithm is not None and method != algorithm else ""
        config = (config_from_key(record["config"]) if "config" in record
                  else BASELINE if knobs[0] is None
                  else config_from_key(tag + ",".join(map(str, knobs))))
        return cls(record["workload"], record["batch"], config, dict(record["speedups"]),
                   record["reason"], {k: (lo, hi) for k, (lo, hi) in record["intervals"].items()},
                   method=method, kind=Advice(record.get("kind", STATIC)),
                   alternative=(cls.from_record(record["alternative"], algorithm)
                                if record.get("alternative") else None),
                   objective=record.get("objective", Objective.THROUGHPUT.value),
                   chain_steps=record.get("chain_steps"))

    def speedup_labels(self) -> list[str]:
        """'dataset 1.234 [1.201, 1.268]' per dataset."""
        return [f"{d} {s:.3f}" + (f" [{self.intervals[d][0]:.3f}, {self.intervals[d][1]:.3f}]"
                                  if d in self.intervals else "")
                for d, s in self.speedups.items()]


def recommend(spec: StudySpec, results: list[LaunchResult], baseline: LaunchResult,
              estimates: Estimates | None = None, objective: Objective | None = None
              ) -> list[Recommendation]:
    """Per batch size and workload, the measured tree with the best rank among those
    surely feasible (see `evidence.judge`), or for every batch size of a workload one
    adaptive server (see the module's rule). Several launches of one config are merged
    first. Speedups are of the study's objective, or of `objective` when given (what
    another objective would recommend from the same launches).

    With model `estimates` (the model search's fitted model, which pools every launch),
    the ranking blends each measured speedup with the model's estimate; feasibility always
    comes from the measurements alone."""
    merged = merge_all(results)
    baseline = merged.get("baseline", baseline)
    measured = [r for r in merged.values() if r.ok and isinstance(r.config, TreeConfig)]
    # An adaptive config one of whose servers served static trees measured its starting
    # chain, not the controller: never advised (its launch carries a warning why).
    static = {config_key(r.config) for r in static_adaptive(spec, results)}
    adaptive = [r for r in merged.values() if r.ok and isinstance(r.config, AdaptiveConfig)
                and config_key(r.config) not in static]
    if objective is not None and objective is not spec.objective:
        spec = spec.replace(objective=objective)
    noise = noise_of(spec, merged.values())
    batches = sorted(spec.batch)
    workloads = [(MIXED, spec.dataset_names)] + [(d, [d]) for d in spec.dataset_names]
    chosen: dict[tuple[str, int], Recommendation] = {}
    for workload, names in workloads:
        static = {batch: _static(spec, workload, names, batch, measured, baseline, noise,
                                 estimates) for batch in batches}
        kind = POOLS if len({r.config for r in static.values()}) > 1 else STATIC
        pick, alternative = _adaptive(spec, workload, names, static, adaptive, baseline,
                                      noise, kind, list(merged.values()))
        for batch in batches:
            chosen[workload, batch] = (pick[batch] if pick else dataclasses.replace(
                static[batch], kind=kind,
                alternative=alternative[batch] if alternative else None))
    return [chosen[workload, batch] for batch in batches for workload, _ in workloads]


def _ranked(chosen: Verdict, what: str, blended: bool) -> str:
    """Why `chosen` leads the surely feasible configs: its measured mean speedup, or, where
    the fitted model's estimates moved the ranking (`blended`: some surely feasible
    config's rank is not its measured mean; `evidence.judge`), that rank beside the mean
    measured, which alone may be another config's best."""
    measured = f"mean {what}speedup {chosen.mean:.3f} measured"
    if not blended:
        return f"best {measured}"
    return (f"best ranked ({chosen.rank:.3f}: each measured speedup blended with the fitted "
            f"model's estimate, which pools every launch; {measured})")


def static_adaptive(spec: StudySpec, launches: Iterable[LaunchResult]) -> list[LaunchResult]:
    """The adaptive launches whose servers served static trees, by the server info each
    kept (`ServerApi.runs_adaptive`): they measured their starting chain, not a
    controller."""
    api = spec.backend.api
    return [r for r in launches if isinstance(r.config, AdaptiveConfig) and r.ok
            and not api.runs_adaptive(r.server_info)]


def _static(spec: StudySpec, workload: str, names: list[str], batch: int,
            measured: list[LaunchResult], baseline: LaunchResult, noise: StudyNoise,
            estimates: Estimates | None) -> Recommendation:
    """The best confirmed tree at one batch size, or no speculation, and why."""
    verdicts = [judge(r, baseline, batch, names, spec.tolerance, noise, estimates,
                      spec.search.confirming_launches, spec.criterion) for r in measured]
    chosen = best(verdicts)
    if chosen is None:
        return Recommendation(workload, batch, BASELINE,
                              {k.name: 1.0 for k in spec.criterion.cells(names, batch)},
                              _why_none(verdicts, batch), objective=spec.objective.value)
    per = {d: i.mean for d, i in chosen.intervals.items()}
    confirmed = sum(v.confirmed for v in verdicts)
    once = sum(v.feasible and not v.confirmed for v in verdicts)
    unsure = sum(v.borderline for v in verdicts)
    what = "" if spec.objective is Objective.THROUGHPUT else f"{spec.objective.label} "
    blended = any(abs(v.rank - v.mean) >= 5e-4 for v in verdicts if v.confirmed)
    reason = (f"{_ranked(chosen, what, blended)} of {confirmed} surely feasible configs out of "
              f"{len(verdicts)} measured"
              + (f" ({unsure} more were not slower on average but their interval "
                 "reaches below the floor)" if unsure else "")
              + (f" ({once} more looked feasible on a single launch, not yet "
                 "confirmed by a second)" if once else ""))
    return Recommendation(workload, batch, chosen.config, per, reason,
                          {d: (i.low, i.high) for d, i in chosen.intervals.items()},
                          method=spec.method_of(chosen.config),
                          objective=spec.objective.value)


def _adaptive(spec: StudySpec, workload: str, names: list[str],
              static: dict[int, Recommendation], adaptive: list[LaunchResult],
              baseline: LaunchResult, noise: StudyNoise, kind: Advice,
              results: list[LaunchResult]
              ) -> tuple[dict[int, Recommendation] | None, dict[int, Recommendation] | None]:
    """Per batch size, the adaptive server to run for every batch size of a workload
    instead of the static picks (the module's rule), or else the best one surely feasible
    everywhere, as the alternative; None for either when there is none."""
    safe: list[tuple[bool, float, dict[int, Verdict]]] = []  # (qualifies, rank, verdicts)
    graphs = graph_sizes_for(static, spec.server_flags)
    for result in adaptive:
        assert isinstance(result.config, AdaptiveConfig)
        verdicts = {b: judge(result, baseline, b, names, spec.tolerance, noise,
                             needs_launches=spec.search.confirming_launches,
                             criterion=spec.criterion) for b in static}
        # Where its slot never drafts it runs plain decode rounds: no launch can prove
        # them no slower than no speculation, so not surely slower is what it needs.
        plain = {b for b in static if result.config.slot_for(b, graphs).steps == (0,)}
        if not all(v.confirmed or (b in plain and v.possible) for b, v in verdicts.items()):
            continue
        qualifies = all(v.overall.high >= static[b].mean_speedup
                        and (kind is POOLS or v.mean >= static[b].mean_speedup)
                        for b, v in verdicts.items())
        safe.append((qualifies, statistics.fmean(v.rank for v in verdicts.values()),
                     verdicts))
    if not safe:
        return None, None
    qualifies, _, verdicts = max(safe, key=lambda f: f[:2])
    config = next(iter(verdicts.values())).config
    assert isinstance(config, AdaptiveConfig)
    guessed = estimated_steps(config, results)
    instead = ("two pools" if kind is POOLS else "one static tree")
    out = {}
    for b, v in verdicts.items():
        rival = static[b]
        here = (f"here mean speedup {v.mean:.3f} [{v.overall.low:.3f}, "
                f"{v.overall.high:.3f}] against {rival.label()} at {rival.mean_speedup:.3f}")
        why_not = ("the pools measured faster beyond the noise" if kind is POOLS
                   else "one static tree measured faster")
        reason = (f"one pool, adaptive, instead of {instead}: surely feasible at every batch "
                  f"size, and {here}" if qualifies else
                  f"not recommended ({why_not} at some batch size): one pool, adaptive, "
                  f"surely feasible at every batch size; {here}")
        if guessed:
            reason += (f"; its candidate chains {', '.join(map(str, guessed))} were never "
                       "measured in this study (SGLang's guess or the model's estimate)")
        out[b] = Recommendation(workload, b, config, {d: i.mean for d, i in v.intervals.items()},
                                reason, {d: (i.low, i.high) for d, i in v.intervals.items()},
                                method=spec.method_of(config), kind=ADAPTIVE,
                                objective=spec.objective.value,
                                chain_steps=_fixed_chain(spec, names, b, config, graphs,
                                                         results, baseline, noise))
    return (out, None) if qualifies else (None, out)


def _fixed_chain(spec: StudySpec, names: list[str], batch: int, config: AdaptiveConfig,
                 graphs: list[int], results: list[LaunchResult], baseline: LaunchResult,
                 noise: StudyNoise) -> int | None:
    """What a fixed per-batch-size schedule runs at `batch` in place of `config`'s slot
    there: of the slot's candidates, the chain measured best over the workload's datasets
    among those surely no slower than no speculation (0, where the slot holds it, when
    none beats it; else the best measured), or None when none was measured. A controller
    climbs past it only for traffic that accepts more; a fixed schedule cannot step back
    down. `graphs`: the servers' CUDA-graph batch sizes (`graph_sizes_for`)."""
    candidates = config.slot_for(batch, graphs).steps
    verdicts = {s: v for s, v in chain_verdicts(results, baseline, batch, names,
                                                spec.tolerance, noise,
                                                criterion=spec.criterion).items()
                if s in candidates}
    if not verdicts:
        return None
    best = best_chain(verdicts)
    if best == 0 and 0 not in candidates:
        return max(verdicts, key=lambda s: verdicts[s].rank)
    return best


def _why_none(verdicts: list[Verdict], batch: int) -> str:
    if not verdicts:
        return "no speculative config was measured successfully"
    once = [v for v in verdicts if v.feasible]
    if once:
        top = max(once, key=lambda v: v.rank)
        return (f"no speculation: {len(once)} config(s) looked feasible at batch {batch} on a "
                f"single launch (best {top.config} at {top.mean:.3f}) but none was confirmed "
                "by a second launch; raise the budget to confirm them")
    closest = max(verdicts, key=lambda v: min(v.lower.values()))
    worst, low = min(closest.lower.items(), key=lambda kv: kv[1])
    return (f"no speculation: no measured config is surely as fast as no speculation on "
            f"every dataset at batch {batch} (closest: {closest.config} at "
            f"{closest.intervals[worst].label()} (95% interval) on {worst}, whose one-sided "
            f"99% lower bound {low:.3f} must reach {closest.floor:.2f})")


def pools_advice(recs: list[Recommendation]) -> str | None:
    """When batch sizes want different mixed-workload trees, say so as two pools."""
    mixed = {r.batch: r.config for r in recs if r.workload == MIXED}
    if len(set(mixed.values())) <= 1:
        return None
    parts = ", ".join(f"batch {b}: {c}" for b, c in sorted(mixed.items()))
    return (f"batch sizes want different trees ({parts}): run separate server pools, each "
            "with its launch flags, and route traffic by concurrency")


def adaptive_advice(recs: list[Recommendation]) -> str | None:
    """When one adaptive server serves the mixed workload at every batch size, say so."""
    mixed = [r for r in recs if r.workload == MIXED and r.kind is ADAPTIVE]
    if not mixed:
        return None
    return (f"{mixed[0].config} serves every batch size in one pool (SGLang's adaptive "
            f"steps, its JSON config next to {mixed[0].script_name}): measured as fast as "
            "the best static tree of each batch size, within the noise")


def alternative_advice(recs: list[Recommendation]) -> str | None:
    """The mixed workload's adaptive alternative, when it has one, and what it costs."""
    mixed = sorted((r for r in recs if r.workload == MIXED and r.alternative is not None),
                   key=lambda r: r.batch)
    if not mixed:
        return None
    alternative = mixed[-1].alternative
    assert alternative is not None
    costs = "; ".join(f"batch {r.batch}: {r.alternative.mean_speedup:.3f} against "
                      f"{r.label()} at {r.mean_speedup:.3f}"
                      for r in mixed if r.alternative is not None)
    return (f"{alternative.config} in one pool ({alternative.script_name}), surely feasible "
            f"at every batch size but not as fast: mean speedup {costs}")


def advice(recs: list[Recommendation]) -> tuple[str, str] | None:
    """The mixed workload's advice beyond one static tree: ("two pools", why) or
    ("one pool, adaptive", why)."""
    if (text := adaptive_advice(recs)) is not None:
        return "one pool, adaptive", text
    if (text := pools_advice(recs)) is not None:
        return "two pools", text
    return None


def summary_rows(recs: list[Recommendation], methods: bool = False
                 ) -> list[tuple[str, str, str, str]]:
    """workload, batch, server and speedups per recommendation; `methods`: a tree as
    'METHOD S,K,N' (a study of several draft methods)."""
    def server(r: Recommendation) -> str:
        if r.config is BASELINE:
            return "no speculation"
        if isinstance(r.config, AdaptiveConfig):
            return r.label()
        if methods and isinstance(r.config, TreeConfig):
            return f"{r.method} {config_key(dataclasses.replace(r.config, method=''))}"
        return config_key(r.config)

    return [(r.workload, str(r.batch), server(r), ", ".join(r.speedup_labels())) for r in recs]


def objective_note(recs: list[Recommendation], throughput: list[Recommendation]
                   ) -> str | None:
    """For a study optimizing another objective than throughput: per batch size, the mixed
    workload's pick beside what the throughput objective picks from the same launches
    (`throughput`: `recommend(..., objective=Objective.THROUGHPUT)`), and whether they
    differ. None for a throughput study."""
    mine = {r.batch: r for r in recs if r.workload == MIXED}
    other = {r.batch: r for r in throughput if r.workload == MIXED}
    if not mine or next(iter(mine.values())).objective == Objective.THROUGHPUT.value:
        return None
    label = Objective(next(iter(mine.values())).objective).label
    parts = []
    for batch in sorted(mine):
        rec, alt = mine[batch], other.get(batch)
        text = (f"batch {batch}: {label} picks {rec.label()} (mean {label} speedup "
                f"{rec.mean_speedup:.3f})")
        if alt is not None:
            same = "the same" if alt.config == rec.config else alt.label()
            text += (f", throughput picks {same} (mean throughput speedup "
                     f"{alt.mean_speedup:.3f})")
        parts.append(text)
    differs = any(b in other and other[b].config != r.config for b, r in mine.items())
    return (f"objective {label}" + (" changes the pick" if differs else
                                     " picks what throughput picks")
            + ": " + "; ".join(parts))
