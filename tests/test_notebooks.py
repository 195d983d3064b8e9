"""The notebooks run headless against a study made by the emulator and show the study's
figures; the committed notebooks carry no outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treetune.config import BASELINE

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PLOTLY_JSON = "application/vnd.plotly.v1+json"


def committed() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def test_the_committed_notebooks_have_no_outputs_and_a_parameters_cell():
    assert {p.name for p in committed()} >= {"pareto.ipynb", "compare-workloads.ipynb"}
    for path in committed():
        cells = json.loads(path.read_text())["cells"]
        code = [c for c in cells if c["cell_type"] == "code"]
        for cell in code:
            assert cell["outputs"] == [] and cell["execution_count"] is None, path.name
        assert "parameters" in code[0]["metadata"].get("tags", []), path.name
        assert "".join(code[0]["source"]).startswith("study_dir = "), path.name


def execute(name: str, study_dir: Path):
    """Run a notebook as papermill would: a cell after the `parameters` one sets study_dir."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    injected = nbformat.v4.new_code_cell(f"study_dir = {str(study_dir)!r}")
    injected.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(at + 1, injected)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def shown(nb) -> list[tuple[str, int]]:
    """(title, number of traces) of every Plotly figure in the outputs, in order."""
    out = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            figure = output.get("data", {}).get(PLOTLY_JSON)
            if figure is not None:
                out.append((figure["layout"]["title"]["text"], len(figure["data"])))
    return out


def printed(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")


def signature(fig) -> tuple[str, int]:
    return fig.layout.title.text, len(fig.data)


@pytest.mark.slow
@pytest.mark.no_ray
def test_the_pareto_notebook_shows_every_figure_of_the_study(small_study):
    from treetune.report import figures
    from treetune.report.data import load_study_data

    nb = execute("pareto.ipynb", small_study)
    data = load_study_data(small_study)
    expected = [figures.pareto_front(data), figures.regression_map(data),
                figures.speedup_vs_tree_size(data), figures.accept_vs_step_time(data),
                figures.user_vs_gpu_throughput(data),
                # Only for a study that measured latencies (this one's launches are offline).
                *([figures.latency_vs_throughput(data)] if figures.latency_points(data) else []),
                *(figures.optimization_history(data, b) for b in sorted(data.spec.batch))]
    assert shown(nb) == [signature(f) for f in expected]
    prefixes = ["Pareto front", "Regression map", "Speedup vs tree size",
                "Accept length vs step time", "Per-user vs per-GPU throughput",
                *(["p99 TPOT vs throughput"] if figures.latency_points(data) else []),
                "Optimization history", "Optimization history"]
    assert all(title.startswith(p)
               for (title, _), p in zip(shown(nb), prefixes, strict=True))
    assert all(traces > 0 for _, traces in shown(nb))
    # Its budget of 10 launches measured fewer configs: the baseline (at least) twice.
    assert f"10 launches of {len(data.results)} configs (0 failed)" in printed(nb)


@pytest.mark.slow
@pytest.mark.no_ray
def test_the_compare_notebook_tabulates_workloads_and_shows_the_two_pool_choice(
        small_study):
    from treetune.report import figures
    from treetune.report.data import load_study_data

    nb = execute("compare-workloads.ipynb", small_study)
    data = load_study_data(small_study)
    expected = [figures.regression_map(data),
                figures.pareto_front(data, batch_x=1, batch_y=32),
                figures.user_vs_gpu_throughput(data)]
    assert shown(nb) == [signature(f) for f in expected]
    tables = "".join(o["data"].get("text/markdown", "") for c in nb.cells
                     for o in c.get("outputs", []) if "data" in o)
    for workload in ["mixed", "mt-bench", "terminal-bench"]:
        assert f"| {workload} |" in tables
    one, two = data.recommended(1), data.recommended(32)
    assert one is not None and two is not None

    def name(rec):
        return "no speculation" if rec.config is BASELINE else str(rec.config)

    # The search decides whether the batch sizes agree; the verdict must follow it.
    if one.config != two.config:
        assert f"batch 1: {name(one)}" in printed(nb)
        assert f"batch 32: {name(two)}" in printed(nb)
        assert "Two pools" in printed(nb)
    else:
        assert f"One pool: {name(one)}" in printed(nb)


@pytest.mark.slow
@pytest.mark.no_ray
def test_recommendations_json_the_report_and_the_notebook_agree_exactly(small_study, tmp_path):
    """One stored study, three readers: what `treetune search` wrote, the HTML report's
    table and the compare notebook's table name the same tree for every workload and batch
    size (the report and notebook read the decisions stored with the study)."""
    import html
    import re

    from treetune.report.data import load_study_data
    from treetune.report.html import write_report

    def label(record: dict) -> str:
        if record["steps"] is None:
            return "no speculation"
        return f"({record['steps']},{record['topk']},{record['draft_tokens']})"

    written = {(r["workload"], r["batch"]): label(r)
               for r in json.loads((small_study / "recommendations.json").read_text())}
    assert len(written) == 3 * 2  # mixed and two datasets, at two batch sizes

    index = write_report(load_study_data(small_study), tmp_path / "report").index
    rows = re.findall(r"<tr><td>([^<]*)</td><td>(\d+)</td><td>(?:<a [^>]*>)?([^<]*)",
                      index.read_text())
    reported = {(html.unescape(w), int(b)): html.unescape(t) for w, b, t in rows}
    assert reported == written

    nb = execute("compare-workloads.ipynb", small_study)
    tables = "\n".join(o["data"].get("text/markdown", "") for c in nb.cells
                       for o in c.get("outputs", []) if "data" in o)
    header = re.search(r"\| workload \| (.*) \|", tables)
    assert header is not None
    batches = [int(b.removeprefix("batch ")) for b in header.group(1).split(" | ")]
    shown_trees = {}
    for workload in {w for w, _ in written}:
        row = re.search(rf"^\| {re.escape(workload)} \| (.*) \|$", tables, re.M)
        assert row is not None, workload
        for batch, cell in zip(batches, row.group(1).split(" | "), strict=True):
            shown_trees[workload, batch] = cell.split(", worst")[0]
    assert shown_trees == written


@pytest.mark.slow
@pytest.mark.no_ray
def test_the_compare_notebook_advises_nothing_before_a_baseline(tmp_path):
    """A search stopped before its baseline was measured: every cell of the table is empty,
    and the notebook said "One pool: no speculation serves every batch size" (a helper's
    audit); the report says no baseline has been measured yet, and so does it now."""
    from synthetic import launch

    from treetune.config import TreeConfig
    from treetune.study.spec import SPEC_COPY, load_study
    from treetune.study.storage import StudyStore

    spec = load_study(None, {"name": "early", "model": "m", "draft": "d", "batch": [1, 32],
                             "datasets": ["humaneval"], "output": str(tmp_path / "out")})
    spec.save(spec.output_dir / SPEC_COPY)
    store = StudyStore(spec)
    tree = launch(TreeConfig(3, 1, 4), {1: {"humaneval": 110.0}, 32: {"humaneval": 900.0}})
    store.finish_launch(store.begin_launch(tree.config, ()), tree)
    nb = execute("compare-workloads.ipynb", spec.output_dir)
    assert "no baseline has been measured" in printed(nb)
    assert "One pool" not in printed(nb) and "Two pools" not in printed(nb)
