"""Recommendations: per batch size, the best feasible config for the mixed workload and for
each dataset alone, with the evidence. `export` turns them into files."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.results import LaunchResult, config_from_key, config_key
from treetune.study.evidence import Estimates, Verdict, best, judge, merge_all, study_noise
from treetune.study.spec import StudySpec

MIXED = "mixed"


@dataclass(frozen=True)
class Recommendation:
    workload: str  # "mixed" or a dataset name
    batch: int
    config: ServerConfig  # BASELINE: no speculation
    speedups: dict[str, float]  # measured, per dataset of the workload
    reason: str
    intervals: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    method: str | None = None  # the draft method (SGLang algorithm) it runs; None: none

    @property
    def mean_speedup(self) -> float:
        return statistics.fmean(self.speedups.values())

    @property
    def script_name(self) -> str:
        return f"launch/{self.workload}-batch{self.batch}.sh"

    def record(self) -> dict[str, Any]:
        """The stable JSON record of recommendations.json."""
        tree = self.config if isinstance(self.config, TreeConfig) else None
        return {
            "workload": self.workload,
            "batch": self.batch,
            "steps": tree.steps if tree else None,
            "topk": tree.topk if tree else None,
            "draft_tokens": tree.draft_tokens if tree else None,
            "method": self.method,
            "speedups": {k: round(v, 4) for k, v in self.speedups.items()},
            "intervals": {k: [round(lo, 4), round(hi, 4)]
                          for k, (lo, hi) in self.intervals.items()},
            "launch_script": self.script_name,
            "reason": self.reason,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any], algorithm: str | None = None
                    ) -> Recommendation:
        """Back from `record()` (as stored with the study); `algorithm`: the study's own
        method, whose trees carry none (None: every record is of the study's own)."""
        knobs = (record["steps"], record["topk"], record["draft_tokens"])
        method = record.get("method")
        tag = f"{method}:" if method and algorithm is not None and method != algorithm else ""
        config = (BASELINE if knobs[0] is None
                  else config_from_key(tag + ",".join(map(str, knobs))))
        return cls(record["workload"], record["batch"], config, dict(record["speedups"]),
                   record["reason"], {k: (lo, hi) for k, (lo, hi) in record["intervals"].items()},
                   method)

    def speedup_labels(self) -> list[str]:
        """'dataset 1.234 [1.201, 1.268]' per dataset."""
        return [f"{d} {s:.3f}" + (f" [{self.intervals[d][0]:.3f}, {self.intervals[d][1]:.3f}]"
                                  if d in self.intervals else "")
                for d, s in self.speedups.items()]


def recommend(spec: StudySpec, results: list[LaunchResult], baseline: LaunchResult,
              estimates: Estimates | None = None) -> list[Recommendation]:
    """Per batch size and workload, the measured config with the best rank among those
    surely feasible (see `evidence.judge`). Several launches of one config are merged first.

    With model `estimates` (the model search's fitted model, which pools every launch),
    the ranking blends each measured speedup with the model's estimate; feasibility always
    comes from the measurements alone."""
    merged = merge_all(results)
    baseline = merged.get("baseline", baseline)
    measured = [r for r in merged.values() if r.ok and isinstance(r.config, TreeConfig)]
    noise = study_noise(merged.values(), spec.search.launch_cv)
    out = []
    for batch in sorted(spec.batch):
        workloads = [(MIXED, spec.dataset_names)] + [(d, [d]) for d in spec.dataset_names]
        for workload, names in workloads:
            verdicts = [judge(r, baseline, batch, names, spec.tolerance, noise, estimates,
                              spec.search.confirming_launches) for r in measured]
            chosen = best(verdicts)
            if chosen is None:
                out.append(Recommendation(workload, batch, BASELINE, {d: 1.0 for d in names},
                                          _why_none(verdicts, batch)))
                continue
            per = {d: i.mean for d, i in chosen.intervals.items()}
            confirmed = sum(v.confirmed for v in verdicts)
            once = sum(v.feasible and not v.confirmed for v in verdicts)
            unsure = sum(v.borderline for v in verdicts)
            reason = (f"best mean speedup {chosen.mean:.3f} of {confirmed} surely feasible "
                      f"configs out of {len(verdicts)} measured"
                      + (f" ({unsure} more were not slower on average but their interval "
                         "reaches below the floor)" if unsure else "")
                      + (f" ({once} more looked feasible on a single launch, not yet "
                         "confirmed by a second)" if once else ""))
            out.append(Recommendation(
                workload, batch, chosen.config, per, reason,
                {d: (i.low, i.high) for d, i in chosen.intervals.items()},
                spec.method_of(chosen.config)))
    return out


def _why_none(verdicts: list[Verdict], batch: int) -> str:
    if not verdicts:
        return "no speculative config was measured successfully"
    once = [v for v in verdicts if v.feasible]
    if once:
        top = max(once, key=lambda v: v.rank)
        return (f"no speculation: {len(once)} config(s) looked feasible at batch {batch} on a "
                f"single launch (best {top.config} at {top.mean:.3f}) but none was confirmed "
                "by a second launch; raise the budget to confirm them")
    closest = max(verdicts, key=lambda v: min(i.low for i in v.intervals.values()))
    worst, iv = min(closest.intervals.items(), key=lambda kv: kv[1].low)
    return (f"no speculation: no measured config is surely as fast as no speculation on "
            f"every dataset at batch {batch} (closest: {closest.config} at {iv.label()} on "
            f"{worst}, needs a lower bound >= {closest.floor:.2f})")


def pools_advice(recs: list[Recommendation]) -> str | None:
    """When batch sizes want different mixed-workload trees, say so as two pools."""
    mixed = {r.batch: r.config for r in recs if r.workload == MIXED}
    if len(set(mixed.values())) <= 1:
        return None
    parts = ", ".join(f"batch {b}: {c}" for b, c in sorted(mixed.items()))
    return (f"batch sizes want different trees ({parts}): run separate server pools with the "
            "same draft head and these launch flags, and route traffic by concurrency")


def summary_rows(recs: list[Recommendation], methods: bool = False
                 ) -> list[tuple[str, str, str, str]]:
    """workload, batch, tree and speedups per recommendation; `methods`: the tree as
    'METHOD S,K,N' (a study of several draft methods)."""
    def tree(r: Recommendation) -> str:
        if r.config is BASELINE:
            return "no speculation"
        if methods and isinstance(r.config, TreeConfig):
            return f"{r.method} {config_key(dataclasses.replace(r.config, method=''))}"
        return config_key(r.config)

    return [(r.workload, str(r.batch), tree(r), ", ".join(r.speedup_labels())) for r in recs]
