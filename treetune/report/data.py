"""Study results as figures and notebooks need them: read from a study folder (or a
storage URL plus study name), never from the search's internals."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import optuna

from treetune.config import BASELINE, AdaptiveConfig, TreeConfig
from treetune.errors import TreetuneError, first_line
from treetune.results import LaunchResult
from treetune.study.evidence import judge, merge_leveled, noise_of
from treetune.study.recommend import Recommendation, recommend
from treetune.study.spec import (
    SPEC_COPY,
    StudySpec,
    load_study,
    shown_url,
    study_from_mapping,
)
from treetune.study.storage import SPEC_ATTR, read_only_storage, read_study

LAUNCHES = ":launches"


@dataclass(frozen=True)
class ConfigRow:
    """One launched tree (or adaptive server) at one batch size, with everything the
    figures plot."""

    config: TreeConfig | AdaptiveConfig
    batch: int
    speedups: dict[str, float]  # dataset -> measured speedup over the baseline
    accept_length: float | None  # mean over datasets
    output_tok_s: float  # mean over datasets, whole batch
    step_time_s: float  # mean time of one round (batch * accept length / throughput)
    feasible: bool  # surely no regression at this batch (see evidence.Verdict.feasible)
    compared: bool  # listed in the study's `compare`
    # Measured below the floor on some judged cell at this batch. A tree neither feasible
    # nor regressing is not proven: measured above the floor, its interval reaching below.
    regresses: bool = False

    @property
    def mean_speedup(self) -> float:
        return statistics.fmean(self.speedups.values())


@dataclass
class StudyData:
    spec: StudySpec
    results: list[LaunchResult]
    baseline: LaunchResult | None
    recommendations: list[Recommendation]
    storage_url: str
    folder: Path
    strategy: str = ""
    stored_launches: int | None = None  # re-launches counted (None: one per config)

    @property
    def launches(self) -> int:
        """Server launches so far, a re-measured config's every launch counted."""
        return len(self.results) if self.stored_launches is None else self.stored_launches

    @property
    def failed(self) -> list[LaunchResult]:
        return [r for r in self.results if not r.ok]

    @property
    def missing_baseline(self) -> str | None:
        """Why there is no baseline to compare with, in words for the report and the
        notebooks; None when there is one. A failed baseline is not one still to come: a
        rerun launches it again, and fails again until what its log says is fixed."""
        if self.baseline is not None:
            return None
        failed = next((r for r in self.failed if r.config is BASELINE), None)
        if failed is None:
            return ("no baseline has been measured yet: the search was stopped before it, "
                    "or is still measuring it")
        return (f"the baseline launch failed ({failed.reason}): nothing can be compared "
                "without it; fix what its log says, then rerun `treetune search`, which "
                "launches it again")

    def rows(self, batch: int | None = None) -> list[ConfigRow]:
        """Every measured tree at every (or one) batch size; empty before the baseline."""
        return self._rows(TreeConfig, batch)

    def adaptive_rows(self, batch: int | None = None) -> list[ConfigRow]:
        """Every measured adaptive server at every (or one) batch size."""
        return self._rows(AdaptiveConfig, batch)

    def _rows(self, kind: type, batch: int | None) -> list[ConfigRow]:
        if self.baseline is None:
            return []
        names = self.spec.dataset_names
        noise = noise_of(self.spec, self.results)
        out = []
        for result in self.results:
            if not result.ok or not isinstance(result.config, kind):
                continue
            for b in sorted(self.spec.batch):
                if batch is not None and b != batch:
                    continue
                cells = [result.cell(d, b) for d in names]
                if any(c is None for c in cells) or any(
                        k.cell(result) is None for k in self.spec.criterion.cells(names, b)):
                    continue  # a launch still being measured, or cut short (rate cells too)
                verdict = judge(result, self.baseline, b, names, self.spec.tolerance, noise,
                                criterion=self.spec.criterion)
                per = {d: i.mean for d, i in verdict.intervals.items()}
                accepts = [c.accept_length for c in cells if c and c.accept_length]
                tput = statistics.fmean(c.output_tok_s for c in cells if c)
                accept = statistics.fmean(accepts) if accepts else None
                step = b * (accept or 1.0) / tput if tput > 0 else float("nan")
                assert isinstance(result.config, TreeConfig | AdaptiveConfig)
                out.append(ConfigRow(result.config, b, per, accept, tput, step,
                                     verdict.feasible, result.config in self.spec.compare,
                                     any(i.mean < verdict.floor
                                         for i in verdict.intervals.values())))
        return out

    def recommended(self, batch: int, workload: str = "mixed") -> Recommendation | None:
        return next((r for r in self.recommendations
                     if r.batch == batch and r.workload == workload), None)


def load_study_data(source: str | Path, study: str | None = None) -> StudyData:
    """A study folder written by `treetune search`, or an Optuna storage URL (with the
    study's name when the storage holds several); works while the search still runs."""
    text = str(source)
    if "://" in text:
        spec = _spec_from_storage(text, study)
        folder = spec.output_dir
    else:
        folder = Path(source)
        spec_path = folder / SPEC_COPY
        if not folder.exists():
            raise TreetuneError(f"{folder} does not exist: give the folder `treetune search` "
                                "wrote (its --output, runs/<name> by default)")
        if not folder.is_dir():
            raise TreetuneError(f"{folder} is a file, not a study folder: give the folder "
                                "`treetune search` wrote (its --output, runs/<name> by "
                                "default)")
        if not spec_path.is_file():
            raise TreetuneError(f"{folder} is not a treetune study folder: no {SPEC_COPY} in "
                                "it (run `treetune search` with --output pointing there)")
        spec = load_study(spec_path)
        if spec.storage is None and spec.output_dir.resolve() != folder.resolve():
            # A folder moved or copied since the search: its own study.db, not the one
            # where the search left it (which may be gone, or another study's by now).
            spec = spec.replace(output=str(folder))
    stored = read_study(spec)
    # One per config, re-launches merged, nodes leveled: what the search judged.
    results = list(merge_leveled(stored.results, spec.search.launch_cv,
                                  spec.search.learns_noise).values())
    baseline = next((r for r in results if r.ok and r.config is BASELINE), None)
    recs = stored.recommendations
    if recs is None:  # stored before decisions were kept with the study: judge here
        recs = recommend(spec, results, baseline) if baseline else []
    return StudyData(spec, results, baseline, recs, spec.storage_url, folder, stored.strategy,
                     stored_launches=len(stored.results))


def _spec_from_storage(url: str, study: str | None) -> StudySpec:
    storage = read_only_storage(url)
    try:
        names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    except Exception as exc:  # SQLAlchemy raises many kinds
        raise TreetuneError(f"cannot open study storage {shown_url(url)}: "
                            f"{first_line(exc)}") from None
    studies = sorted(n.removesuffix(LAUNCHES) for n in names if n.endswith(LAUNCHES))
    if study is None and len(studies) == 1:
        study = studies[0]
    if study not in studies:
        raise TreetuneError(f"{shown_url(url)} holds the treetune studies "
                            f"{', '.join(studies) or '(none)'}; name one (`treetune "
                            "report URL --study NAME`, or the notebooks' `study_name`)"
                            + (f" (not '{study}')" if study else ""))
    attrs = optuna.load_study(study_name=f"{study}{LAUNCHES}", storage=storage).user_attrs
    if SPEC_ATTR not in attrs:
        raise TreetuneError(f"study '{study}' in {shown_url(url)} predates specs kept in "
                            "storage; open its output folder instead")
    spec = study_from_mapping(attrs[SPEC_ATTR], f"{shown_url(url)} ({study})", Path("."))
    return spec.replace(storage=url)
