"""Figures and `treetune report` on a real emulated study."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import types
import zlib
from pathlib import Path

import pytest
import synthetic

from treetune.cli import main
from treetune.config import BASELINE, TreeConfig
from treetune.errors import TreetuneError
from treetune.report import figures
from treetune.report.data import StudyData, load_study_data
from treetune.report.html import write_report
from treetune.study.recommend import recommend
from treetune.study.spec import SPEC_COPY
from treetune.study.storage import StudyStore

pytestmark = [pytest.mark.slow, pytest.mark.no_ray]  # offline studies, no Ray
WIDE, NARROW = TreeConfig(3, 4, 8), TreeConfig(5, 1, 6)


@pytest.fixture(scope="module")
def data(small_study):
    return load_study_data(small_study)


def trace_holding(fig, label: str) -> list[str]:
    return [t.name for t in fig.data if t.customdata is not None and label in list(t.customdata)]


def test_pareto_front_shows_both_published_trees_and_the_wide_one_infeasible_at_32(data):
    fig = figures.pareto_front(data)
    assert fig.layout.title.text.startswith("Pareto front")
    names = [t.name for t in fig.data]
    assert "Pareto front" in names
    # Each batch size's advice has its legend entry: a ring, or "...: no speculation".
    assert all(any(n.startswith(f"recommended for batch {b}") for n in names) for b in (1, 32))
    assert any(n.endswith("regresses at batch 32") for n in trace_holding(fig, WIDE.label()))
    assert trace_holding(fig, NARROW.label()), "the narrow tree is plotted"
    for batch in (1, 32):
        ring = next(t for t in fig.data if t.name.startswith(f"recommended for batch {batch}"))
        rec = data.recommended(batch)
        assert rec is not None
        assert list(ring.customdata) == ([rec.config.label()]
                                         if isinstance(rec.config, TreeConfig) else [])


def feasible_at(legend: str) -> set[int]:
    """The batch sizes a feasibility legend entry calls a tree feasible at."""
    match = re.match(r"feasible at batch ([\d and]+)", legend)
    return {int(b) for b in match.group(1).split(" and ")} if match else set()


def test_every_recommendation_ring_sits_on_a_tree_feasible_at_its_batch_size(data):
    """The advice is per batch size: a ring must never read as recommended-and-infeasible."""
    fig = figures.pareto_front(data)
    rings = [t for t in fig.data if t.name.startswith("recommended for batch ")]
    assert rings and sum(len(t.customdata) for t in rings) >= 1
    for ring in rings:
        batch = int(re.findall(r"\d+", ring.name)[0])
        for label in ring.customdata:
            legends = [n for n in trace_holding(fig, label) if n != ring.name
                       and not n.startswith("recommended")]
            assert len(legends) == 1 and batch in feasible_at(legends[0]), (label, legends)


LATE, LOST = TreeConfig(2, 1, 3), TreeConfig(6, 4, 24)


@pytest.fixture
def two_pools(tmp_path) -> StudyData:
    """Synthetic: the wide tree is best at batch 1 and regresses humaneval at batch 32, the
    chain is best at batch 32; one tree pays at batch 32 only, one nowhere."""
    spec = synthetic.spec(tmp_path, compare=["3,4,8", "5,1,6"])
    late = synthetic.launch(LATE, {1: {"sharegpt": 95, "humaneval": 120},
                                   32: {"sharegpt": 1050, "humaneval": 1010}})
    lost = synthetic.launch(LOST, {1: {"sharegpt": 90, "humaneval": 140},
                                   32: {"sharegpt": 700, "humaneval": 800}})
    results = [synthetic.BASE, synthetic.WIDE, synthetic.NARROW, late, lost]
    recs = recommend(spec, results, synthetic.BASE)
    return StudyData(spec, results, synthetic.BASE, recs, spec.storage_url, tmp_path)


def test_pareto_legend_names_the_batch_sizes_each_tree_is_feasible_at(two_pools):
    fig = figures.pareto_front(two_pools)
    legend = {label: [n for n in trace_holding(fig, label) if not n.startswith("recommended")]
              for label in (WIDE.label(), NARROW.label(), LATE.label(), LOST.label())}
    assert legend == {WIDE.label(): ["feasible at batch 1, regresses at batch 32"],
                      NARROW.label(): ["feasible at batch 1 and 32"],
                      LATE.label(): ["feasible at batch 32, regresses at batch 1"],
                      LOST.label(): ["regresses at batch 1 and 32"]}
    crosses = [t.name for t in fig.data if t.marker.symbol == "x"]
    assert crosses == ["regresses at batch 1 and 32"], "a cross means no batch size is safe"


def test_a_tree_faster_but_unproven_at_a_batch_size_reads_not_proven_not_regresses(
        tmp_path):
    """At 3% launch noise one launch 2% above the baseline is not proven feasible, but it
    measured no regression either: the legend must not tell a user it regresses. And a
    Pareto front of one tree is drawn (a point: a line alone draws nothing)."""
    spec = synthetic.spec(tmp_path, search={"launch_cv": 0.03})
    thin = synthetic.launch(LATE, {1: {"sharegpt": 150, "humaneval": 160},
                                   32: {"sharegpt": 1020, "humaneval": 1030}})
    sure = synthetic.launch(NARROW, {1: {"sharegpt": 200, "humaneval": 200},
                                     32: {"sharegpt": 2000, "humaneval": 2000}})
    results = [synthetic.BASE, sure, thin]
    data = StudyData(spec, results, synthetic.BASE, recommend(spec, results, synthetic.BASE),
                     spec.storage_url, tmp_path)
    fig = figures.pareto_front(data)
    assert trace_holding(fig, LATE.label())[0] == "feasible at batch 1, not proven at batch 32"
    front = next(t for t in fig.data if t.name == "Pareto front")
    assert len(front.x) == 1 and "markers" in front.mode


def test_a_tree_recommended_at_batch_1_that_regresses_at_32_is_ringed_for_batch_1_only(
        two_pools):
    fig = figures.pareto_front(two_pools)
    assert trace_holding(fig, WIDE.label()) == [
        "feasible at batch 1, regresses at batch 32", "recommended for batch 1"]
    assert trace_holding(fig, NARROW.label()) == [
        "feasible at batch 1 and 32", "recommended for batch 32"]
    ring = next(t for t in fig.data if t.name == "recommended for batch 1")
    assert list(ring.text) == ["for batch 1"]
    hover = ring.hovertext[0]
    assert hover.startswith(f"{WIDE.label()} recommended for batch 1 (mixed workload); "
                            "feasible at batch 1, regresses at batch 32")
    assert "humaneval 0.890" in hover, "the hover keeps the measured speedups"
    assert hover.endswith(by_batch(two_pools, 1).reason), "and says why it was picked"
    colours = {t.name: t.marker.line.color for t in fig.data if t.name.startswith("recommended")}
    assert len(set(colours.values())) == 2, "each batch size's ring has its own colour"


def by_batch(data: StudyData, batch: int):
    return next(r for r in data.recommendations if r.batch == batch and r.workload == "mixed")


def test_a_batch_size_best_without_speculation_says_so_in_the_legend(two_pools):
    only_risky = [r for r in two_pools.results if r.config in (BASELINE, WIDE, LOST)]
    recs = recommend(two_pools.spec, only_risky, synthetic.BASE)
    fig = figures.pareto_front(dataclasses.replace(two_pools, results=only_risky,
                                                   recommendations=recs))
    ring = next(t for t in fig.data if t.name.startswith("recommended for batch 32"))
    assert ring.name == "recommended for batch 32: no speculation" and len(ring.x) == 0
    assert trace_holding(fig, WIDE.label())[-1] == "recommended for batch 1"


def test_regression_map_marks_every_cell_below_one(data):
    fig = figures.regression_map(data)
    heat = fig.data[0]
    assert fig.layout.title.text.startswith("Regression map") and len(fig.data) == 1
    row = list(heat.y).index(WIDE.label())
    col = list(heat.x).index("terminal-bench @ batch 32")
    assert heat.z[row][col] < 1.0 and heat.text[row][col] != ""
    assert heat.zmid == 1.0
    for r, values in enumerate(heat.z):
        for c, value in enumerate(values):
            assert (heat.text[r][c] != "") == (value is not None and value < 1.0)


@pytest.mark.parametrize(("maker", "title", "min_traces"), [
    ("speedup_vs_tree_size", "Speedup vs tree size", 2),
    ("accept_vs_step_time", "Accept length vs step time", 2),
    ("user_vs_gpu_throughput", "Per-user vs per-GPU throughput", 3),
])
def test_every_figure_has_its_title_and_traces(data, maker, title, min_traces):
    fig = getattr(figures, maker)(data)
    assert fig.layout.title.text.startswith(title)
    assert len(fig.data) >= min_traces


def test_speedup_vs_tree_size_keeps_one_colour_and_legend_entry_per_topk(data):
    fig = figures.speedup_vs_tree_size(data)
    colours: dict[str, set[str]] = {}
    for trace in fig.data:
        colours.setdefault(trace.name, set()).add(trace.line.color)
    assert colours and all(len(c) == 1 for c in colours.values()), colours
    assert len({next(iter(c)) for c in colours.values()}) == len(colours)
    legend = [t.name for t in fig.data if t.showlegend is not False]
    assert sorted(legend) == sorted(colours), "each topk is named in the legend once"


def test_optimization_history_comes_from_the_batch_study(data):
    fig = figures.optimization_history(data, 32)
    assert fig.layout.title.text.startswith("Optimization history")
    trials = sum(len(t.x) for t in fig.data if t.name != "Best Value")
    trees = [r for r in data.results if isinstance(r.config, TreeConfig)]  # re-launches merged
    assert len(trees) >= 3
    assert trials == len(trees)  # every launched tree, told to the batch-32 study, feasible or not
    assert any(t.name == "Infeasible Trial" for t in fig.data)  # the wide tree at 32


def test_report_writes_every_figure_self_contained_and_links_each_recommendation(
        small_study, tmp_path, capsys):
    out = tmp_path / "report"
    main(["report", str(small_study), "--output", str(out)])
    pages = sorted(p.name for p in out.glob("*.html"))
    expected = {f"{k}.html" for k in figures.all_figures(load_study_data(small_study))}
    assert expected | {"report.html"} == set(pages)
    for page in out.glob("*.html"):
        text = page.read_text()
        assert not re.search(r"<script[^>]+src=", text), f"{page.name} loads a script"
        assert not re.search(r"<link[^>]+href=\"http", text), f"{page.name} loads a sheet"
    index = (out / "report.html").read_text()
    data = load_study_data(small_study)
    assert data.recommendations
    for rec in data.recommendations:
        script = small_study / rec.script_name
        assert script.is_file()
        assert f'href="{os.path.relpath(script, out)}"' in index, rec.script_name
    assert "PNGs" in capsys.readouterr().err or list(out.glob("*.png"))


def test_the_index_counts_launches_re_launches_included_and_configs_apart(data, tmp_path):
    # The study's budget of 10 launches measured the baseline (at least) twice.
    assert data.launches == 10 and len(data.results) < 10
    index = write_report(data, tmp_path).index.read_text()
    assert f"10 launches of {len(data.results)} configs (0 failed)" in index


def test_report_escapes_names_in_the_index(data, tmp_path):
    hostile = data.spec.replace(model="<script>alert(1)</script>")
    data.spec = hostile
    try:
        write_report(data, tmp_path)
    finally:
        data.spec = load_study_data(data.folder).spec
    index = (tmp_path / "report.html").read_text()
    assert "<script>alert(1)</script>" not in index
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in index


def test_report_on_a_study_without_a_baseline_still_writes_an_index(small_study, tmp_path):
    data = load_study_data(small_study)
    data.baseline = None
    data.recommendations = []
    result = write_report(data, tmp_path)
    assert result.index.is_file() and not result.figures
    assert any("no baseline" in n for n in result.notices)


def test_report_without_an_image_exporter_skips_pngs_with_a_one_line_notice(
        data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "kaleido", None)  # import kaleido fails
    result = write_report(data, tmp_path)
    assert result.figures and not result.pngs and not list(tmp_path.glob("*.png"))
    notice = next(n for n in result.notices if n.startswith("PNGs skipped"))
    assert "\n" not in notice and "pip install 'treetune[report]'" in notice


def test_the_cli_prints_notices_and_paths_as_written_brackets_included(
        small_study, tmp_path, capsys, monkeypatch):
    # Rich would take "[report]" or "[1]" for markup and print nothing of it.
    monkeypatch.setitem(sys.modules, "kaleido", None)
    out = tmp_path / "report[1]"
    main(["report", str(small_study), "--output", str(out)])
    printed = capsys.readouterr()
    assert "pip install 'treetune[report]'" in printed.err
    assert f"wrote {out / 'report.html'} with" in printed.out.replace("\n", "")


def test_a_failing_image_exporter_still_leaves_the_html_report(data, tmp_path, monkeypatch):
    import plotly.io

    def no_browser(*args, **kwargs):
        raise RuntimeError("Chrome not found\nsecond line of advice")

    monkeypatch.setitem(sys.modules, "kaleido", types.ModuleType("kaleido"))
    monkeypatch.setattr(plotly.io, "write_images", no_browser)
    result = write_report(data, tmp_path)
    assert result.index.is_file() and result.figures and not result.pngs
    assert any(n.startswith("PNGs skipped") and "Chrome not found" in n and "\n" not in n
               for n in result.notices)


def test_report_on_a_study_folder_whose_baseline_is_not_measured_yet_succeeds(
        small_study, tmp_path, capsys):
    """A search in progress: the compared trees finished before the baseline."""
    data = load_study_data(small_study)
    spec = data.spec.replace(output=str(tmp_path / "study"))
    spec.save(spec.output_dir / SPEC_COPY)
    store = StudyStore(spec)
    wide = next(r for r in data.results if r.config == WIDE)
    store.finish_launch(store.begin_launch(wide.config, wide.flags), wide)
    main(["report", str(spec.output_dir)])
    index = (spec.output_dir / "report" / "report.html").read_text()
    assert "no baseline has been measured yet" in index and WIDE.label() in index
    assert "no baseline" in capsys.readouterr().err
    assert [p.name for p in (spec.output_dir / "report").iterdir()] == ["report.html"]


def test_recommendations_whose_scripts_are_not_written_yet_are_not_linked(data, tmp_path):
    """While the search runs, recommendations exist before their launch scripts."""
    running = dataclasses.replace(data, folder=tmp_path / "study")
    running.folder.mkdir()  # the search's folder, before it writes its scripts
    result = write_report(running, tmp_path / "report")
    index = result.index.read_text()
    assert "launch/" not in re.sub(r"<p class=\"notice\">.*?</p>", "", index)
    assert any("launch scripts are not written yet" in n for n in result.notices)


def test_a_launch_script_of_an_earlier_run_is_not_linked_to_todays_recommendation(
        small_study, tmp_path):
    """A rerun searches on while its folder holds the last run's scripts: a script whose
    command launches another config than recommended now would send whoever follows the
    link to the wrong server. One whose header numbers alone are old is still linked."""
    copy = tmp_path / "copy"
    shutil.copytree(small_study, copy)
    data = load_study_data(copy)
    rec = next(r for r in data.recommendations if r.config is not BASELINE)
    script = copy / rec.script_name
    old = script.read_text()
    other = TreeConfig(*(1, 1, 2) if rec.config != TreeConfig(1, 1, 2) else (2, 1, 3))
    flags = f"--speculative-num-steps {rec.config.steps} "
    assert flags in old
    script.write_text(old.replace(flags, f"--speculative-num-steps {other.steps} "))
    result = write_report(data, tmp_path / "report")
    index = result.index.read_text()
    linked = re.findall(r'<a href="([^"]+\.sh)">', index)
    assert os.path.relpath(script, tmp_path / "report") not in linked
    assert linked, "the other recommendations' scripts are still linked"
    assert any("an earlier run's" in n and rec.script_name in n for n in result.notices)
    # Only the header's measured speedups differ: the command is today's, and linked.
    script.write_text(old.replace("# treetune study", "# (old numbers) treetune study", 1))
    result = write_report(data, tmp_path / "report2")
    assert os.path.relpath(script, tmp_path / "report2") in re.findall(
        r'<a href="([^"]+\.sh)">', result.index.read_text())
    assert not any("an earlier run's" in n for n in result.notices)


def test_a_report_from_a_storage_url_whose_folder_is_on_another_machine_writes_here(
        small_study, tmp_path, monkeypatch, capsys):
    """The stored spec names the search machine's folder: the report must not recreate it,
    nor say the scripts are still to be written (a review)."""
    copy = tmp_path / "db-only"
    copy.mkdir()
    shutil.copy(small_study / "study.db", copy / "study.db")
    url = f"sqlite:///{copy / 'study.db'}"
    data = load_study_data(url)
    gone = tmp_path / "elsewhere"
    monkeypatch.setattr(type(data.spec), "output_dir", property(lambda self: gone))
    monkeypatch.chdir(tmp_path)
    main(["report", url])
    index = (tmp_path / "small-report" / "report.html").read_text()
    assert not gone.exists()
    assert "launch/" not in re.sub(r"<p class=\"notice\">.*?</p>", "", index)
    err = " ".join(capsys.readouterr().err.split())
    assert f"the study's output folder ({gone}) is not on this machine" in err
    assert "not written yet" not in err


def test_a_study_whose_baseline_failed_says_so_not_that_it_is_still_to_come(small_study,
                                                                          tmp_path, capsys):
    """A failed baseline is no baseline still being measured: a rerun alone fails again."""
    data = load_study_data(small_study)
    spec = data.spec.replace(output=str(tmp_path / "study"))
    spec.save(spec.output_dir / SPEC_COPY)
    store = StudyStore(spec)
    failed = dataclasses.replace(data.baseline, ok=False, cells=[],
                                 reason="server exited during startup (exit code 1)")
    store.finish_launch(store.begin_launch(BASELINE, data.baseline.flags), failed)
    main(["report", str(spec.output_dir)])
    index = (spec.output_dir / "report" / "report.html").read_text()
    assert "the baseline launch failed (server exited during startup" in index
    assert "not been measured yet" not in index
    assert "fix what its log says" in capsys.readouterr().err


def test_the_report_takes_a_storage_url_and_the_name_of_one_of_its_studies(small_study,
                                                                            tmp_path, capsys):
    url = load_study_data(small_study).storage_url
    main(["report", url, "--study", "small", "-o", str(tmp_path / "r")])
    assert "<h1>treetune study small</h1>" in (tmp_path / "r" / "report.html").read_text()
    with pytest.raises(TreetuneError, match=r"holds the treetune studies small; name one "
                                            r"\(`treetune report URL --study NAME`"):
        load_study_data(url, "smal")
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(small_study), "--study", "small"])
    assert exit_.value.code == 2
    assert "--study names a study in a storage URL" in capsys.readouterr().err


def png_colours(path: Path) -> int:
    """Distinct colours in an 8-bit RGB(A) PNG (no Pillow needed)."""
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, channels = 8, b"", 0, 0, 3
    while pos < len(raw):
        length = int.from_bytes(raw[pos:pos + 4], "big")
        kind, body = raw[pos + 4:pos + 8], raw[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height = int.from_bytes(body[:4], "big"), int.from_bytes(body[4:8], "big")
            channels = {2: 3, 6: 4}[body[9]]
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    data = zlib.decompress(idat)
    stride, colours, prev = width * channels, set(), bytearray(width * channels)
    for y in range(height):
        start = y * (stride + 1)
        f, line = data[start], bytearray(data[start + 1:start + 1 + stride])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            p = a + b - c
            pred = {0: 0, 1: a, 2: b, 3: (a + b) // 2,
                    4: min((abs(p - a), a), (abs(p - b), b), (abs(p - c), c))[1]}[f]
            line[i] = (line[i] + pred) & 0xFF
        prev = line
        if y % 8 == 0:
            colours.update(bytes(line[i:i + 3]) for i in range(0, stride, channels * 4))
    return len(colours)


@pytest.mark.skipif(not shutil.which("chromium"), reason="no Chromium: apt-get install chromium")
def test_figures_render_in_headless_chromium(small_study, tmp_path):
    out = tmp_path / "report"
    write_report(load_study_data(small_study), out)
    png = tmp_path / "pareto.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}",
                    "--window-size=1200,800", "--virtual-time-budget=5000",
                    (out / "pareto.html").as_uri()],
                   capture_output=True, timeout=120, check=False)
    assert png.is_file(), "Chromium wrote no screenshot"
    assert png_colours(png) > 20, "the screenshot is blank: the plot did not render"


def test_a_study_loads_from_its_storage_url_as_from_its_folder(small_study):
    by_folder = load_study_data(small_study)
    by_url = load_study_data(by_folder.storage_url)
    assert by_url.spec.name == by_folder.spec.name
    assert by_url.spec.fingerprint() == by_folder.spec.fingerprint()
    assert len(by_url.results) == len(by_folder.results)
    assert [r.record() for r in by_url.recommendations] == [
        r.record() for r in by_folder.recommendations]


def test_a_copied_study_folder_is_read_from_its_own_storage(small_study, tmp_path):
    """study.yaml names the folder the search wrote; a copy (or a moved folder) is read
    from the study.db beside it, not from the original's, which may hold other data."""
    copy = tmp_path / "copy"
    shutil.copytree(small_study, copy)
    data = load_study_data(copy)
    assert data.storage_url == f"sqlite:///{(copy / 'study.db').resolve()}"
    assert len(data.results) == len(load_study_data(small_study).results)
    (copy / "study.db").unlink()
    with pytest.raises(TreetuneError, match=str(copy)):
        load_study_data(copy)
