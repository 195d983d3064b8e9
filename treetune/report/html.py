"""`treetune report`: every figure as a standalone HTML file that opens offline, an index
with the recommendations linking to their launch scripts, and PNGs when possible."""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from pathlib import Path

from treetune.config import BASELINE
from treetune.report.data import StudyData
from treetune.report.figures import all_figures
from treetune.study.export import objective_line, stale_scripts


@dataclass
class ReportOutcome:
    index: Path
    figures: list[Path] = field(default_factory=list)
    pngs: list[Path] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)


def write_report(data: StudyData, out_dir: Path) -> ReportOutcome:
    out_dir.mkdir(parents=True, exist_ok=True)
    outcome = ReportOutcome(index=out_dir / "report.html")
    figures = all_figures(data) if data.baseline is not None else {}
    if data.missing_baseline is not None:
        outcome.notices.append(f"{data.missing_baseline}; figures need a baseline, so this "
                               "report lists the launches only")
    for name, fig in figures.items():
        path = out_dir / f"{name}.html"
        # plotly.js inlined: the file opens without network access.
        fig.write_html(path, include_plotlyjs=True, full_html=True)
        outcome.figures.append(path)
    if figures:
        outcome.pngs, notice = _pngs(figures, out_dir)
        if notice:
            outcome.notices.append(notice)
    unwritten = [r.script_name for r in data.recommendations
                 if not (data.folder / r.script_name).is_file()]
    if not data.folder.is_dir():  # a storage URL read on another machine than the search's
        outcome.notices.append(f"the study's output folder ({data.folder}) is not on this "
                               "machine: its launch scripts are shown unlinked")
    elif unwritten:
        outcome.notices.append(f"{len(unwritten)} launch scripts are not written yet "
                               f"({', '.join(unwritten)}): `treetune search` writes them when "
                               "it finishes")
    stale = stale_scripts(data.spec, data.recommendations, data.folder)
    if stale:
        outcome.notices.append(f"{len(stale)} launch scripts are an earlier run's and launch "
                               f"another config than recommended now ({', '.join(stale)}): "
                               "shown unlinked; `treetune search` rewrites them when it "
                               "finishes")
    outcome.index.write_text(_index(data, outcome, out_dir, set(stale)))
    return outcome


def _pngs(figures: dict, out_dir: Path) -> tuple[list[Path], str | None]:
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return [], ("PNGs skipped: no static-image exporter (pip install "
                    "'treetune[report]', with a system Chromium)")
    import plotly.io as pio

    paths = [out_dir / f"{name}.png" for name in figures]
    try:
        if hasattr(pio, "write_images"):  # plotly >= 6.1 with kaleido >= 1
            # One browser for every figure: kaleido starts Chromium once per call.
            pio.write_images(list(figures.values()), paths, width=1200, height=700)
        else:
            for fig, path in zip(figures.values(), paths, strict=True):
                fig.write_image(path, width=1200, height=700)
    except Exception as exc:  # kaleido without a usable Chromium, among others
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return [], f"PNGs skipped: the image exporter failed ({type(exc).__name__}: {first})"
    return paths, None


def _index(data: StudyData, outcome: ReportOutcome, out_dir: Path, stale: set[str]) -> str:
    """`stale`: the launch scripts that launch another config than recommended now."""
    e = html.escape
    spec = data.spec
    rows = []
    for rec in data.recommendations:
        script = data.folder / rec.script_name
        link = os.path.relpath(script, out_dir)
        tree = "no speculation" if rec.config is BASELINE else rec.config.label()
        speedups = ", ".join(e(label) for label in rec.speedup_labels())
        linked = script.is_file() and rec.script_name not in stale
        cell = f"<a href=\"{e(link)}\">{e(tree)}</a>" if linked else e(tree)
        rows.append(f"<tr><td>{e(rec.workload)}</td><td>{rec.batch}</td>"
                    f"<td>{cell}</td><td>{speedups}</td><td>{e(str(rec.kind))}</td>"
                    f"<td>{e(rec.reason)}</td></tr>")
    figures = "".join(f"<li><a href=\"{e(p.name)}\">{e(p.stem)}</a></li>"
                      for p in outcome.figures)
    notices = "".join(f"<p class=\"notice\">{e(n)}</p>" for n in outcome.notices)
    failed = "".join(f"<li>{e(r.config.label())}: {e(r.reason)}</li>" for r in data.failed)
    measured = ", ".join(e(r.config.label()) for r in data.results if r.ok) or "none yet"
    rates = spec.criterion.rates_at(spec.max_batch)
    rate_words = (f"; rate cells ({', '.join(f'{r:g}' for r in rates)} req/s) are judged "
                  f"with batch {spec.max_batch}, whose server serves them" if rates else "")
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>treetune report: {e(spec.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:4px 10px;text-align:left}}
tr:nth-child(even){{background:#f4f4f4}}.notice{{color:#a15c00}}</style></head><body>
<h1>treetune study {e(spec.name)}</h1>
<p>{e(spec.model)} with draft {e(spec.draft or "")}, TP {spec.tp}, SGLang {e(spec.sglang_version)};
datasets {e(", ".join(spec.dataset_names))}; batch sizes {e(", ".join(map(str, spec.batch)))};
{data.launches} launches of {len(data.results)} configs ({len(data.failed)} failed);
tolerance {spec.tolerance:g}.</p>
<p>Objective: {e(objective_line(spec))}{e(rate_words)}.</p>
{notices}
<p>Measured: {measured}.</p>
<h2>Recommendations</h2>
<p>Each tree links to its launch script: the production server command, sized for its batch.
Advice: static (one tree for every batch size), pools (one server pool per tree) or
adaptive (one pool of SGLang's adaptive steps for every batch size).</p>
<table><tr><th>workload</th><th>batch</th><th>tree (steps, topk, draft tokens)</th>
<th>measured speedups [interval]</th><th>advice</th><th>why</th></tr>
{"".join(rows)}</table>
<h2>Figures</h2><ul>{figures}</ul>
{f"<h2>Failed launches</h2><ul>{failed}</ul>" if failed else ""}
</body></html>
"""
