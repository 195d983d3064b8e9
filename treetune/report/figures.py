"""Figures of a study, each a function from `StudyData` to a plotly Figure.

Read them in notebooks (`notebooks/`) or as HTML from `treetune report`. Speedups are
measured against the study's no-speculation baseline; 1.0 is the no-regression line.
"""

from __future__ import annotations

import html
import math
import re
import statistics
from collections.abc import Callable

import optuna
import plotly.colors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from treetune.backends.sglang_adaptive import graph_sizes_for
from treetune.config import BASELINE, AdaptiveConfig, TreeConfig
from treetune.objectives import CellKey, Objective
from treetune.report.data import ConfigRow, StudyData
from treetune.study.evidence import merge_all

RED, GREEN, GREY, BLUE = "#d62728", "#2ca02c", "#7f7f7f", "#1f77b4"
ORANGE, PURPLE = "#ff7f0e", "#9467bd"
PALETTE = plotly.colors.qualitative.Plotly


def _hover(rows: list[ConfigRow]) -> str:
    parts = [f"{r.config} at batch {r.batch}: " + ", ".join(
        f"{d} {s:.3f}" for d, s in r.speedups.items()) for r in rows]
    return "<br>".join(parts)


def _batches(data: StudyData) -> list[int]:
    return sorted(data.spec.batch)


def _where_feasible(verdicts: dict[int, bool], regresses: dict[int, bool]) -> str:
    """Legend words for a tree's feasibility, batch size by batch size: advice is given per
    batch size, so a tree regressing at one must still read as feasible at the others. A
    batch size where it is not feasible reads "regresses" only where some dataset measured
    below the floor; elsewhere "not proven" (its interval reaches below the floor)."""
    def at(batches: list[int]) -> str:
        return "batch " + " and ".join(map(str, batches))

    words = []
    for word, batches in (
            ("feasible", [b for b, ok in sorted(verdicts.items()) if ok]),
            ("not proven", [b for b, ok in sorted(verdicts.items())
                            if not ok and not regresses[b]]),
            ("regresses", [b for b, ok in sorted(verdicts.items()) if not ok and regresses[b]])):
        if batches:
            words.append(f"{word} at {at(batches)}")
    return ", ".join(words)


def _marker(verdicts: dict[int, bool], bx: int) -> dict[str, object]:
    """Green circles are safe at every plotted batch size, red crosses at none; a diamond
    is safe at one of the two only, orange when that one is the x axis's batch size."""
    if all(verdicts.values()):
        return {"color": GREEN, "symbol": "circle"}
    if not any(verdicts.values()):
        return {"color": RED, "symbol": "x"}
    return {"color": ORANGE if verdicts[bx] else PURPLE, "symbol": "diamond"}


# Rings of recommendations, one colour per batch size; none is a feasibility colour.
RINGS = [BLUE, "#17becf", "#8c564b", "#e377c2", "#000000"]


def pareto_front(data: StudyData, batch_x: int | None = None,
                 batch_y: int | None = None) -> go.Figure:
    """Mean speedup at one batch size against another, per launched tree: the trade-off a
    single server pool has to make, with the non-dominated trees feasible at both joined.
    Feasibility and recommendations are per batch size, as the advice is: a tree ringed
    as recommended for batch 1 may well regress at batch 32 (the case for two pools).
    Adaptive servers (SGLang's adaptive steps: one pool for every batch size) are stars,
    one trace each."""
    batches = _batches(data)
    bx = batch_x if batch_x is not None else batches[0]
    by = batch_y if batch_y is not None else batches[-1]
    fig = go.Figure()
    at = {b: {r.config: r for r in data.rows(b) + data.adaptive_rows(b)} for b in {bx, by}}
    everything = [c for c in at[bx] if c in at[by]]
    configs = [c for c in everything if isinstance(c, TreeConfig)]
    adaptive = [c for c in everything if isinstance(c, AdaptiveConfig)]
    verdicts = {c: {b: at[b][c].feasible for b in at} for c in everything}
    regressing = {c: {b: at[b][c].regresses for b in at} for c in everything}
    graphs = graph_sizes_for(data.spec.batch, data.spec.server_flags)

    def size(c: TreeConfig | AdaptiveConfig) -> float:
        if isinstance(c, TreeConfig):
            return float(c.draft_tokens)
        return float(max(c.slot_for(by, graphs).steps) + 1)  # its longest chain there

    def point(c: TreeConfig | AdaptiveConfig) -> tuple[float, float]:
        if bx == by:  # one batch size: speedup against tree size
            return size(c), at[by][c].mean_speedup
        return at[bx][c].mean_speedup, at[by][c].mean_speedup

    def hover(c: TreeConfig | AdaptiveConfig) -> str:
        return _hover([at[bx][c]] + ([at[by][c]] if by != bx else []))

    groups: dict[str, list[TreeConfig]] = {}
    # Safe everywhere first, so the legend reads from the best news to the worst.
    for c in sorted(configs, key=lambda c: -sum(verdicts[c].values())):
        groups.setdefault(_where_feasible(verdicts[c], regressing[c]), []).append(c)
    for name, members in groups.items():
        fig.add_trace(go.Scatter(
            x=[point(c)[0] for c in members], y=[point(c)[1] for c in members],
            mode="markers+text", name=name,
            text=[c.label() if c in data.spec.compare else "" for c in members],
            textposition="top center",
            customdata=[c.label() for c in members],
            hovertext=[f"{c.label()}: {name}<br>{hover(c)}" for c in members],
            hoverinfo="text", marker={"size": 9, **_marker(verdicts[members[0]], bx)}))
    for c in adaptive:
        where = _where_feasible(verdicts[c], regressing[c])
        fig.add_trace(go.Scatter(
            x=[point(c)[0]], y=[point(c)[1]], mode="markers+text", name=f"{c.label()}: {where}",
            text=["adaptive"], textposition="top center", customdata=[c.label()],
            hovertext=[f"{c.label()}: {where}<br>{hover(c)}"], hoverinfo="text",
            marker={"size": 14, "symbol": "star", "line": {"color": "#000000", "width": 1},
                    "color": _marker(verdicts[c], bx)["color"]}))
    feasible = [c for c in everything if all(verdicts[c].values())]
    front = [c for c in feasible if not any(
        point(o)[0] >= point(c)[0] and point(o)[1] >= point(c)[1] and point(o) != point(c)
        for o in feasible)] if bx != by else []
    front.sort(key=lambda c: point(c)[0])
    # Markers too: a front of one tree is one point, which a line alone does not draw.
    fig.add_trace(go.Scatter(x=[point(c)[0] for c in front], y=[point(c)[1] for c in front],
                             mode="lines+markers", name="Pareto front",
                             line={"color": GREEN}, marker={"size": 5, "color": GREEN},
                             hoverinfo="skip"))
    for i, batch in enumerate(batches):
        # The mixed-workload advice of each batch size. No speculation is not a point here,
        # so the legend says it rather than show a ring with nothing in it.
        rec = data.recommended(batch)
        picked = [rec.config] if rec is not None and rec.config in everything else []
        name = f"recommended for batch {batch}" + (
            ": no speculation" if rec is not None and rec.config is BASELINE else "")
        fig.add_trace(go.Scatter(
            x=[point(c)[0] for c in picked], y=[point(c)[1] for c in picked],
            mode="markers+text", name=name, text=[f"for batch {batch}" for c in picked],
            textposition="bottom center", textfont={"color": RINGS[i % len(RINGS)]},
            customdata=[c.label() for c in picked],
            # The reason too: a pick ranked with the model's estimates may sit below a
            # tree measured a little faster, and the reason says so.
            hovertext=[f"{c.label()} {name} (mixed workload); "
                       f"{_where_feasible(verdicts[c], regressing[c])}<br>{hover(c)}"
                       f"<br>{html.escape(rec.reason)}" for c in picked if rec is not None],
            hoverinfo="text",
            # Nested rings: a tree recommended at several batch sizes shows each.
            marker={"size": 18 + 8 * i, "color": "rgba(0,0,0,0)",
                    "line": {"color": RINGS[i % len(RINGS)], "width": 3}}))
    xtitle = "draft tokens" if bx == by else f"mean speedup at batch {bx}"
    fig.update_layout(title=f"Pareto front: mean speedup at batch {bx} vs batch {by}"
                      if bx != by else f"Pareto front: mean speedup at batch {by} vs tree size",
                      xaxis_title=xtitle, yaxis_title=f"mean speedup at batch {by}")
    fig.add_hline(y=1.0, line_dash="dot", line_color=GREY)
    if bx != by:
        fig.add_vline(x=1.0, line_dash="dot", line_color=GREY)
    return fig


def regression_map(data: StudyData) -> go.Figure:
    """Every launched tree against every cell its verdicts judge: each (dataset, batch)
    cell, and the rate cells a latency objective or SLO judges with the batch size whose
    server serves them. Red below 1.0."""
    rows = data.rows()
    configs = sorted({r.config for r in rows})
    names = data.spec.dataset_names
    cells = [(k.name, b) for b in _batches(data) for k in data.spec.criterion.cells(names, b)]
    table = {(r.config, d, r.batch): s for r in rows for d, s in r.speedups.items()}
    z = [[table.get((c, d, b)) for d, b in cells] for c in configs]
    text = [[f"{v:.2f}" if v is not None and v < 1.0 else "" for v in row] for row in z]
    values = [v for row in z for v in row if v is not None]
    spread = max([abs(v - 1.0) for v in values] + [0.05])
    fig = go.Figure(go.Heatmap(
        z=z, x=[f"{d} @ batch {b}" if d in names else f"{d} (batch {b}'s server)"
                for d, b in cells], y=[c.label() for c in configs],
        text=text, texttemplate="%{text}", colorscale="RdBu", zmid=1.0,
        zmin=1.0 - spread, zmax=1.0 + spread, colorbar={"title": "speedup"},
        hovertemplate="%{y} on %{x}: %{z:.3f}<extra></extra>"))
    fig.update_layout(title="Regression map: speedup per tree and cell (red: slower than "
                      "no speculation)", height=max(400, 22 * len(configs) + 150))
    return fig


def speedup_vs_tree_size(data: StudyData) -> go.Figure:
    """How the mean speedup moves with verify size, per branching factor and batch size."""
    batches = _batches(data)
    fig = make_subplots(rows=1, cols=len(batches), shared_yaxes=True,
                        subplot_titles=[f"batch {b}" for b in batches])
    # One colour per topk in every subplot: the legend names each topk once.
    topks = sorted({r.config.topk for r in data.rows()})
    colours = {k: PALETTE[i % len(PALETTE)] for i, k in enumerate(topks)}
    shown: set[int] = set()
    for col, batch in enumerate(batches, start=1):
        rows = data.rows(batch)
        for topk in sorted({r.config.topk for r in rows}):
            members = sorted((r for r in rows if r.config.topk == topk),
                             key=lambda r: (r.config.draft_tokens, r.config.steps))
            fig.add_trace(go.Scatter(
                x=[r.config.draft_tokens for r in members], y=[r.mean_speedup for r in members],
                mode="lines+markers", name=f"topk {topk}", legendgroup=f"topk {topk}",
                showlegend=topk not in shown, line={"color": colours[topk]},
                hovertext=[_hover([r]) for r in members], hoverinfo="text"), row=1, col=col)
            shown.add(topk)
        fig.add_hline(y=1.0, line_dash="dot", line_color=GREY, row=1, col=col)
        fig.update_xaxes(title_text="draft tokens", row=1, col=col)
    fig.update_yaxes(title_text="mean speedup", row=1, col=1)
    fig.update_layout(title="Speedup vs tree size, one line per topk")
    return fig


def accept_vs_step_time(data: StudyData) -> go.Figure:
    """Accept length against round time: SGLang's bench_speculative view. Speed is their
    ratio, so trees up and to the left are faster."""
    fig = go.Figure()
    for batch in _batches(data):
        rows = [r for r in data.rows(batch) if r.accept_length]
        fig.add_trace(go.Scatter(
            x=[r.step_time_s * 1000 for r in rows], y=[r.accept_length for r in rows],
            mode="markers", name=f"batch {batch}", hovertext=[_hover([r]) for r in rows],
            hoverinfo="text"))
    fig.update_layout(title="Accept length vs step time per tree",
                      xaxis_title="time of one speculative round (ms)",
                      yaxis_title="accept length (tokens per round)")
    return fig


def user_vs_gpu_throughput(data: StudyData) -> go.Figure:
    """Tokens/s each request sees against tokens/s each GPU delivers, per batch size."""
    fig = go.Figure()
    gpus = data.spec.tp
    for batch in _batches(data):
        rows = data.rows(batch)
        fig.add_trace(go.Scatter(
            x=[r.output_tok_s / gpus for r in rows], y=[r.output_tok_s / batch for r in rows],
            mode="markers", name=f"batch {batch}", hovertext=[_hover([r]) for r in rows],
            hoverinfo="text"))
    if data.baseline is not None:
        points = []
        for batch in _batches(data):
            cells = [data.baseline.cell(d, batch) for d in data.spec.dataset_names]
            tput = [c.output_tok_s for c in cells if c]
            if tput:
                points.append((batch, sum(tput) / len(tput)))
        fig.add_trace(go.Scatter(
            x=[t / gpus for _, t in points], y=[t / b for b, t in points],
            mode="markers+text", name="no speculation", text=[f"batch {b}" for b, _ in points],
            textposition="bottom center", marker={"symbol": "square", "size": 11,
                                                  "color": GREY}))
    fig.update_layout(title="Per-user vs per-GPU throughput (mean over datasets)",
                      xaxis_title="output tokens/s per GPU",
                      yaxis_title="output tokens/s per request")
    return fig


def optimization_history(data: StudyData, batch: int) -> go.Figure:
    """Optuna's view of the search at one batch size: each trial and the best so far."""
    study = optuna.load_study(study_name=f"{data.spec.name}:batch-{batch}",
                              storage=data.storage_url)
    fig = optuna.visualization.plot_optimization_history(study)
    fig.update_layout(title=f"Optimization history at batch {batch} (mean "
                      f"{data.spec.objective.label} speedup)")
    return fig


def latency_metric(data: StudyData) -> Objective:
    """The latency a latency-vs-throughput figure plots: the study's objective when it is
    one, else the one its SLO bounds (TPOT first), else p99 TPOT."""
    if data.spec.objective.is_latency:
        return data.spec.objective
    if data.spec.slo.ttft_ms is not None and data.spec.slo.tpot_ms is None:
        return Objective.TTFT_P99
    return Objective.TPOT_P99


def latency_points(data: StudyData) -> list[tuple[str, str, float, float]]:
    """(config label, cell label, output tokens/s, latency in ms) per measured config
    (no speculation included) and cell: the largest batch size's closed loop and each
    rate, mean over the datasets."""
    metric = latency_metric(data)
    merged = merge_all(data.results)
    names = data.spec.dataset_names
    keys = [(f"batch {data.spec.max_batch}", [CellKey(d, data.spec.max_batch) for d in names])]
    keys += [(f"{r:g} req/s", [CellKey(d, 0, r) for d in names])
             for r in sorted(data.spec.rates)]
    points = []
    for result in merged.values():
        if not result.ok:
            continue
        label = "no speculation" if result.config is BASELINE else result.config.label()
        for cell_label, cell_keys in keys:
            cells = [k.cell(result) for k in cell_keys]
            values = [metric.value_of(c) for c in cells if c is not None]
            if not values or any(v is None or math.isinf(v) for v in values):
                continue  # unmeasured, or requests left unfinished (latency unbounded)
            tput = statistics.fmean(c.output_tok_s for c in cells if c is not None)
            points.append((label, cell_label, tput,
                           statistics.fmean(v for v in values if v is not None)))
    return points


def latency_vs_throughput(data: StudyData) -> go.Figure:
    """The latency a user sees against the throughput a server delivers, per config and
    cell (the largest batch size, and every rate cell): the front joins, per cell, the
    configs no other beats on both; the SLO is the dashed line. Recommended configs are
    ringed. Open-loop cells deliver their rate whatever the tree, so they spread mostly
    along the latency axis: their throughput counts until the last request ends, so a
    slower config's tail lowers it, the more the shorter the window."""
    metric = latency_metric(data)
    points = latency_points(data)
    fig = go.Figure()
    picked = {r.label() for r in data.recommendations if r.batch == data.spec.max_batch
              and r.workload == "mixed"}
    for i, cell in enumerate(dict.fromkeys(c for _, c, _, _ in points)):
        mine = [p for p in points if p[1] == cell]
        colour = PALETTE[i % len(PALETTE)]
        fig.add_trace(go.Scatter(
            x=[p[2] for p in mine], y=[p[3] for p in mine], mode="markers", name=cell,
            legendgroup=cell, marker={"color": colour, "size": [14 if p[0] in picked else 8
                                                               for p in mine],
                                      "symbol": ["square" if p[0] == "no speculation"
                                                 else "circle" for p in mine],
                                      "line": {"width": [3 if p[0] in picked else 0
                                                         for p in mine], "color": "black"}},
            hovertext=[f"{p[0]} at {cell}: {p[2]:.0f} tok/s, {metric.label} {p[3]:.1f} ms"
                       for p in mine], hoverinfo="text"))
        front = sorted((p for p in mine
                        if not any(q[2] >= p[2] and q[3] <= p[3] and q != p for q in mine)),
                       key=lambda p: p[2])
        fig.add_trace(go.Scatter(x=[p[2] for p in front], y=[p[3] for p in front],
                                 mode="lines", line={"color": colour, "dash": "dot"},
                                 legendgroup=cell, showlegend=False, hoverinfo="skip"))
    bound = data.spec.slo.tpot_ms if metric in (Objective.TPOT_P50, Objective.TPOT_P99) \
        else data.spec.slo.ttft_ms
    if bound is not None:
        fig.add_hline(y=bound, line_dash="dash", line_color=RED,
                      annotation_text=f"SLO {bound:g} ms", annotation_position="top left")
    fig.update_layout(title=f"{metric.label} vs throughput per config and cell (objective: "
                      f"{data.spec.objective.label}; ringed: recommended at batch "
                      f"{data.spec.max_batch}; squares: no speculation)",
                      xaxis_title="output tokens/s (whole server)",
                      yaxis_title=f"{metric.label} (ms, mean over datasets)")
    return fig


def all_figures(data: StudyData) -> dict[str, go.Figure]:
    """Every figure of a study, keyed by a file-safe name."""
    makers: dict[str, Callable[[], go.Figure]] = {
        "pareto": lambda: pareto_front(data),
        "regression-map": lambda: regression_map(data),
        "speedup-vs-tree-size": lambda: speedup_vs_tree_size(data),
        "accept-vs-step-time": lambda: accept_vs_step_time(data),
        "user-vs-gpu-throughput": lambda: user_vs_gpu_throughput(data),
    }
    if latency_points(data):  # latencies were measured (studies stored before: not)
        makers["latency-vs-throughput"] = lambda: latency_vs_throughput(data)
    for batch in _batches(data):
        makers[f"optimization-history-batch{batch}"] = (
            lambda b=batch: optimization_history(data, b))  # type: ignore[misc]
    return {re.sub(r"[^a-z0-9-]", "-", k): make() for k, make in makers.items()}
