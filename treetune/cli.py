"""The `treetune` command line."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.table import Table

from treetune import stopping
from treetune.backends.sglang import NGRAM, SPEC_DEFAULT_MAX_RUNNING, parse_method_tree
from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.errors import TreetuneError
from treetune.perfmodel import (
    PerfModel,
    Prediction,
    Profile,
    ServingPrediction,
    load_profile,
    shipped_profiles,
)
from treetune.study.spec import is_loopback, search_options, shown_url

if TYPE_CHECKING:
    from treetune.study.recommend import Recommendation
    from treetune.study.runner import Progress as StudyProgress
    from treetune.study.runner import StudyOutcome
    from treetune.study.spec import StudySpec

app = typer.Typer(
    help="Find the best EAGLE3 speculative-decoding tree settings for SGLang servers.",
    epilog="Errors are one paragraph with exit code 2; add --debug to any command (or set "
    "TREETUNE_DEBUG=1) for the traceback.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(shown: bool) -> None:
    if shown:
        from importlib.metadata import version

        out.print(f"treetune {version('treetune')}")
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", callback=_show_version, is_eager=True,
        help="Print treetune's version and exit.")] = False) -> None:
    """Find the best EAGLE3 speculative-decoding tree settings for SGLang servers."""


class _StdoutConsole(Console):
    """stdout, as wide as its content when it is a log or a pipe: there rich would squeeze
    tables to 80 columns (or the width of a terminal on stdin or stderr) and fold dataset
    names mid-word, and a log is never resized. Asked at each print, not at import, so
    that output redirected later (tests capturing it) is seen as what it is."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        return size if self.is_terminal else ConsoleDimensions(LOG_WIDTH, size.height)


LOG_WIDTH = 1000  # wider than any table; tables and text take only the width they need
out = _StdoutConsole()
err = Console(stderr=True, soft_wrap=True)  # messages stay one greppable line

ProfileOpt = Annotated[
    str, typer.Option("--profile", "-p", help="A shipped profile's name or a profile YAML path.")
]


def writable(path: Path, option: str = "--output") -> Path:
    """`path` if a file can be written there, checked before any work: else a one-line
    error naming the option."""
    parent = path.parent
    if path.is_dir():
        raise TreetuneError(f"{option} {path} is a folder: give a file name")
    if not parent.is_dir():
        raise TreetuneError(f"{option} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise TreetuneError(f"{option} {path}: cannot write in {parent}")
    return path


@app.command()
def predict(
    profile: ProfileOpt,
    batch: Annotated[
        list[int] | None, typer.Option(help="Batch size(s), e.g. --batch 1 32 (default: 1, "
                                       "none when --rate is given).")
    ] = None,
    tree: Annotated[
        list[str] | None, typer.Option(help="Tree(s) as steps,topk,draft_tokens, e.g. 3,4,8.")
    ] = None,
    space: Annotated[
        str | None, typer.Option(help="Rank every valid config of this search space.")
    ] = None,
    dataset: Annotated[
        list[str] | None, typer.Option(help="Dataset(s) of the profile (default: all).")
    ] = None,
    max_running_requests: Annotated[
        int | None, typer.Option(help="For the memory check (default: the batch size); with "
                                 "--rate, the server's cap (default: the largest batch, or "
                                 f"{SPEC_DEFAULT_MAX_RUNNING} as SGLang's with speculation).")
    ] = None,
    top: Annotated[int | None, typer.Option(help="Configs per batch size (per cell) when "
                                               "ranking a space (default: 10 in the table, "
                                               "all in --json; 0: all).")] = None,
    method: Annotated[
        str | None, typer.Option(help="Draft method of the profile (default: its own draft "
                                 "head, else its first method; `treetune profiles` lists "
                                 "each profile's methods).")
    ] = None,
    prompt_tokens: Annotated[
        int | None, typer.Option(help="Whole requests of this many prompt tokens (default "
                                 "with --output-tokens or --rate: the dataset's).")
    ] = None,
    output_tokens: Annotated[
        int | None, typer.Option(help="Whole requests of this many output tokens (default "
                                 "with --prompt-tokens or --rate: the dataset's).")
    ] = None,
    rate: Annotated[
        list[float] | None, typer.Option(help="Open-loop cells: requests/s (Poisson), e.g. "
                                         "--rate 2 8; implies whole requests.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON records instead.")] = False,
) -> None:
    """Noise-free predicted throughput, speedup and accept length per config, dataset, batch.

    By default, the steady state of decoding: every batch slot busy for ever. With
    --prompt-tokens, --output-tokens or --rate, whole requests as a benchmark sends them:
    each request's prefill, the slot its end leaves empty and, at a rate, the queueing;
    with TPOT and TTFT. The JSON form is a list of records with keys method, steps, topk,
    draft_tokens, batch, dataset, baseline_tok_s, spec_tok_s, speedup, accept_length, oom;
    whole requests add rate, prompt_tokens, output_tokens, max_running_requests, tpot_ms,
    baseline_tpot_ms, ttft_ms, baseline_ttft_ms, saturated, baseline_saturated.
    """
    from treetune.perfmodel import Shape
    from treetune.space import load_space

    prof = load_profile(profile)
    own = method.upper() if method else prof.method_names[0]  # the method of a tree typed bare
    model = PerfModel(prof, method=own)
    datasets = list(dict.fromkeys(dataset or prof.datasets))
    for name in datasets:
        prof.dataset(name)
    batches = list(dict.fromkeys(batch if batch is not None else ([] if rate else [1])))
    rate = list(dict.fromkeys(rate or []))
    if any(b < 1 for b in batches):
        raise TreetuneError(f"batch sizes must be >= 1, got {batches}")
    if any(not 0 < r < math.inf for r in rate):  # nan fails both
        raise TreetuneError(f"--rate must be a finite number > 0 requests/s, got {rate}")
    for flag, value in (("--prompt-tokens", prompt_tokens), ("--output-tokens", output_tokens),
                        ("--max-running-requests", max_running_requests)):
        if value is not None and value < 1:
            raise TreetuneError(f"{flag} must be >= 1, got {value}")
    if max_running_requests is not None and any(b > max_running_requests for b in batches):
        raise TreetuneError(f"--max-running-requests {max_running_requests} is below batch "
                            f"{max(batches)}: a server that runs {max_running_requests} "
                            "requests at once never forms that batch")
    if top is not None and top < 0:
        raise TreetuneError(f"--top must be >= 0 (0: every config), got {top}")
    if top is None:
        top = 0 if as_json else 10
    # A tree of the method asked for is typed bare; "NEXTN:3,1,4" is priced as NEXTN.
    configs: list[TreeConfig] = [_own_method(parse_method_tree(t, own), own) for t in tree or []]
    asked: set[ServerConfig] = set(configs)  # shown even below --top
    if space is not None:
        tree_space = load_space(space)
        if tree_space.is_ngram != (own == NGRAM):
            raise TreetuneError(
                f"--space {space} holds NGRAM servers: add --method NGRAM" if tree_space.is_ngram
                else f"--method NGRAM takes an NGRAM space (--space ngram): NGRAM has no steps "
                f"knob, so --space {space}'s trees would be the same servers many times")
        configs += tree_space.configs()
    if not configs:
        raise TreetuneError("nothing to predict: give --tree S,K,N and/or --space NAME")
    methods: dict[ServerConfig, str] = {c: c.method or own for c in dict.fromkeys(configs)}
    models = {m: model if m == own else PerfModel(prof, method=m) for m in set(methods.values())}

    def priced(c: ServerConfig) -> PerfModel:
        return models[methods[c]]

    title = prof.name if method is None else f"{prof.name} ({model.method_name})"
    if prompt_tokens is None and output_tokens is None and not rate:
        rows = [priced(c).predict(c, d, b, max_running_requests)
                for b in batches for c in methods for d in datasets]
        if as_json:
            kept = _top_rows(rows, top if space else None, asked)
            print(json.dumps([{"method": methods[r.config], **r.record()} for r in kept],
                             indent=1))
            return
        for b in batches:
            _print_ranking(title, b, [r for r in rows if r.batch == b], datasets,
                           top if space else None, asked)
        return

    def shape(name: str) -> Shape:
        mean = model.shape(name)
        return Shape(prompt_tokens or mean.prompt_tokens, output_tokens or mean.output_tokens)

    cap = max_running_requests or max(batches, default=SPEC_DEFAULT_MAX_RUNNING)
    cells: list[tuple[int | None, float | None]] = [(b, None) for b in batches]
    cells += [(None, r) for r in rate]
    served = [priced(c).predict_serving(c, d, shape(d), batch=b, rate=r,
                                        max_running_requests=max_running_requests if b else cap)
              for b, r in cells for c in methods for d in datasets]
    if as_json:
        kept_served = _top_rows(served, top if space else None, asked)
        print(json.dumps([{"method": methods[p.config], **p.record()} for p in kept_served],
                         indent=1))
        return
    for b, r in cells:
        _print_serving(title, [p for p in served if p.batch == (b or 0) and p.rate == r],
                       datasets, top if space else None, asked)


def _own_method(config: TreeConfig, own: str) -> TreeConfig:
    """`config` with no method when it names the one asked for: "EAGLE3:3,4,8" is 3,4,8."""
    return dataclasses.replace(config, method="") if config.method == own else config


Row = TypeVar("Row", Prediction, ServingPrediction)


def _ranked(rows: list[Row]) -> list[list[Row]]:
    """One cell's rows grouped by config, the best mean speedup over the datasets first;
    configs whose server would not start (OOM) last, whatever they would do if it did."""
    by_config: dict[ServerConfig, list[Row]] = {}
    for row in rows:
        by_config.setdefault(row.config, []).append(row)
    return sorted(by_config.values(), key=lambda rs: (any(r.oom for r in rs),
                                                      -statistics.fmean(r.speedup for r in rs)))


def _shown(ranked: list[list[Row]], top: int | None,
           asked: set[ServerConfig]) -> list[list[Row]]:
    """The `top` configs of a ranking, then the trees asked for by --tree below them (a
    tree typed is always shown); all of them without `top`."""
    if not top:
        return ranked
    return ranked[:top] + [rs for rs in ranked[top:] if rs[0].config in asked]


def _top_rows(rows: list[Row], top: int | None, asked: set[ServerConfig]) -> list[Row]:
    """The rows of each cell's `top` configs by mean speedup over the datasets, ranked
    (as the tables show them), and the trees asked for; all rows, in order, without
    `top`."""
    if not top:
        return rows
    cells: dict[tuple[int, float | None], list[Row]] = {}
    for row in rows:
        cells.setdefault((row.batch, getattr(row, "rate", None)), []).append(row)
    return [r for cell in cells.values() for rs in _shown(_ranked(cell), top, asked)
            for r in rs]


def _top_title(shown: int, ranked: int, top: int) -> str:
    extra = shown - min(top, ranked)
    return (f": top {min(top, ranked)} of {ranked} configs by mean speedup"
            + (f", and {extra} asked for by --tree" if extra else ""))


def _print_serving(profile: str, rows: list[ServingPrediction], datasets: list[str],
                   top: int | None, asked: set[ServerConfig]) -> None:
    """One cell's whole-request predictions: a row per config and dataset, configs ranked
    by mean speedup over the datasets."""
    first = rows[0]
    ranked = _ranked(rows)
    shown = _shown(ranked, top, asked)
    if first.rate is None:
        cell, speedup = f"closed loop at batch {first.batch}", "speedup over no speculation"
    else:
        cell = (f"open loop at {first.rate:g} requests/s (Poisson), at most "
                f"{first.max_running} running")
        speedup = "speedup: the baseline's TPOT over the config's"
    title = f"{profile}, {cell}"
    if top:
        title += _top_title(len(shown), len(ranked), top)
    table = Table(title=escape(title), caption=f"whole requests; {speedup}; TPOT is per "
                  "output token after the first, TTFT the median (mean at a rate); red: "
                  "slower than baseline; inf: saturated, the queue grows")
    for col in ("tree S,K,N", "dataset", "in/out", "speedup", "tok/s", "base tok/s",
                "TPOT ms", "base TPOT", "TTFT ms", "base TTFT", "accept"):
        table.add_column(col, justify="left" if col in ("tree S,K,N", "dataset") else "right")

    def ms(seconds: float) -> str:
        return "inf" if seconds == float("inf") else f"{seconds * 1e3:.2f}"

    for cells in shown:
        for p in sorted(cells, key=lambda p: datasets.index(p.dataset)):
            if p.oom:  # it would not start: nothing of its own to show
                table.add_row(p.config.label() + " OOM", escape(p.dataset),
                              f"{p.shape.prompt_tokens}/{p.shape.output_tokens}", "-", "-",
                              f"{p.baseline.output_tok_s:.1f}", "-", ms(p.baseline.tpot_s),
                              "-", ms(p.baseline.ttft_s), f"{p.accept_length:.2f}")
                continue
            table.add_row(
                p.config.label(), escape(p.dataset),
                f"{p.shape.prompt_tokens}/{p.shape.output_tokens}", f"{p.speedup:.3f}",
                f"{p.spec.output_tok_s:.1f}", f"{p.baseline.output_tok_s:.1f}",
                ms(p.spec.tpot_s), ms(p.baseline.tpot_s), ms(p.spec.ttft_s),
                ms(p.baseline.ttft_s), f"{p.accept_length:.2f}",
                style="red" if p.speedup < 1 else None)
    out.print(table)


def _print_ranking(
    profile: str, batch: int, rows: list[Prediction], datasets: list[str], top: int | None,
    asked: set[ServerConfig]
) -> None:
    ranking = _ranked(rows)
    shown = [(rs[0].config, {p.dataset: p for p in rs}) for rs in _shown(ranking, top, asked)]

    def mean_speedup(cells: dict[str, Prediction]) -> float:
        return statistics.fmean(p.speedup for p in cells.values())
    title = f"{profile}, batch {batch}"
    if top:
        title += _top_title(len(shown), len(ranking), top)
    table = Table(title=escape(title), caption="speedup over no speculation (accept length); "
                  "red: slower than baseline on some dataset")
    table.add_column("tree S,K,N")
    table.add_column("mean", justify="right")
    table.add_column("min", justify="right")
    for d in datasets:
        table.add_column(escape(d), justify="right", overflow="fold")
    for config, cells in shown:
        low = min(c.speedup for c in cells.values())
        if any(c.oom for c in cells.values()):  # it would not start: no speedup to show
            table.add_row(config.label() + " OOM", "-", "-",
                          *(f"- ({cells[d].accept_length:.2f})" for d in datasets))
            continue
        table.add_row(
            config.label(),
            f"{mean_speedup(cells):.3f}",
            f"{low:.3f}",
            *(f"{cells[d].speedup:.3f} ({cells[d].accept_length:.2f})" for d in datasets),
            style="red" if low < 1 else None,
        )
    any_cells = shown[0][1]
    baselines = (f"{any_cells[d].baseline_tok_s:.1f}" for d in datasets)
    table.add_row("baseline tok/s", "", "", *baselines, style="dim")
    out.print(table)


@app.command()
def calibrate(
    profile: ProfileOpt,
    measurements: Annotated[
        Path, typer.Option(help="Measured points: CSV, a YAML list, or published-results YAML.")
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the profile.")],
    entry: Annotated[
        str | None, typer.Option(help="Entry to read when the file holds several studies.")
    ] = None,
    name: Annotated[str | None, typer.Option(
        help="Name of the fitted profile (default: the output file's name without .yaml).")
    ] = None,
    starts: Annotated[int, typer.Option(help="Optimizer restarts (more is slower, safer).")] = 6,
) -> None:
    """Fit a profile's free parameters to measured points and write the fitted profile.

    A point is steps, topk, draft_tokens, batch, dataset and either baseline_tok_s and
    spec_tok_s or a speedup (or all three), optionally accept_length. Hardware and model
    facts are kept; of the calibration block and each measured dataset's acceptance and
    workload shape, the parameters the points determine are fitted and the others keep
    the profile's values (named in a warning).
    """
    from treetune.perfmodel.calibrate import calibrate as fit
    from treetune.perfmodel.calibrate import (
        declared_target,
        free_parameters,
        load_measurements,
        only_entry,
        per_position,
        poor_fit,
        same_model,
    )
    from treetune.perfmodel.prior import MethodView, method_prior
    from treetune.yamlio import load_yaml

    writable(output)
    if output.resolve() == measurements.resolve():
        raise TreetuneError(f"--output {output} is the measurements file: the profile would "
                            "replace the points; write it elsewhere")
    if starts < 1:
        raise TreetuneError(f"--starts must be >= 1, got {starts}")
    base = load_profile(profile)
    if base.draft is None:  # no draft head: the points are of its (first) method
        err.print(f"note: {escape(base.name)} has no draft head: the points are taken as "
                  f"its {base.method_names[0]} method's, whose acceptance is fitted")
        base = method_prior(base, base.method_names[0])
    points = load_measurements(measurements, entry, list(base.datasets))
    if entry is None and measurements.suffix.lower() != ".csv":
        entry = only_entry(load_yaml(measurements))  # a file of one entry names it
    measured = declared_target(measurements, entry)
    if measured is not None and not same_model(measured, base.target.name):
        err.print(f"[yellow]warning:[/] the points are of {escape(measured)} "
                  f"({escape(str(measurements))}), the profile of "
                  f"{escape(base.target.name)}: the fit moves this profile's parameters to "
                  "another model's measurements; give that model's profile (or "
                  "`treetune prior` of it)")
    params = free_parameters(base, points)
    given = sorted({m.dataset for m in points if per_position(base, m.dataset)})
    if given:
        err.print(f"note: {escape(base.name)} gives the top-1 acceptance of "
                  f"{escape(', '.join(given))} per draft position (top1_by_position, "
                  "measured): it is kept as given, and only the rank mass is fitted there; "
                  "remove top1_by_position from the profile to fit its acceptance")
    ratio_only = sum(m.baseline_tok_s is None for m in points)
    if ratio_only == len(points):
        err.print("note: no point has a baseline throughput: speedups fix ratios of costs, "
                  "not absolute speed, so only what they determine is fitted; the fitted "
                  "costs may still move the predicted baseline throughputs, which no point "
                  "here checks")
    elif ratio_only:
        err.print(f"note: {ratio_only} of {len(points)} points have no baseline throughput: "
                  "they fit through their speedups (ratios of costs) only")
    err.print(f"fitting up to {len(params)} parameters to {len(points)} points ...")
    result = fit(base, points, params, starts=starts, keep_unidentified=True)
    if result.kept:
        err.print(f"[yellow]warning:[/] {len(points)} points cannot determine "
                  f"{len(result.kept)} of the {len(params)} parameters; kept at "
                  f"{escape(base.name)}'s values: {escape(', '.join(result.kept))}")
    table = Table(title=escape(f"calibration of {base.name} to {measurements}"))
    accepts = any(e.measurement.accept_length is not None for e in result.points)
    for col in ("tree", "batch", "dataset", "measured", "predicted", "error", "baseline err",
                *(("accept length", "predicted accept") if accepts else ())):
        table.add_column(col, justify="right")
    for e in result.points:
        m = e.measurement
        base_error = e.baseline_rel_error
        accept = (("n/a", "n/a") if m.accept_length is None
                  else (f"{m.accept_length:.2f}", f"{e.predicted_accept:.2f}"))
        table.add_row(m.config.label(), str(m.batch), escape(m.dataset), f"{m.speedup:.3f}",
                      f"{e.predicted_speedup:.3f}", f"{e.speedup_error:+.3f}",
                      "n/a" if base_error is None else f"{base_error:+.1%}",
                      *(accept if accepts else ()))
    out.print(table)
    base_max = result.max_baseline_error
    base_text = "n/a (speedups only)" if base_max is None else f"{base_max:.1%}"
    out.print(f"max speedup error {result.max_speedup_error:.3f}, "
              f"max baseline error {base_text}")
    if misses := poor_fit(result.points):
        err.print(f"[yellow]warning:[/] {escape(misses)}")
    kept = f", {len(result.kept)} parameters kept as given" if result.kept else ""
    note = (f"Calibrated to {Path(measurements).name}"
            f"{f' ({entry})' if entry else ''}: {len(points)} points, max speedup error "
            f"{result.max_speedup_error:.3f}, max baseline error {base_text}{kept}.")
    fitted = result.profile
    if isinstance(fitted, MethodView):
        fitted = fitted.as_profile()
    fitted = fitted.replace(
        name=name or output.stem,  # not the base's: a fitted profile is another one
        description=f"{base.description.split(' Calibrated to ')[0]} {note}".strip(),
    )
    fitted.save(output)
    out.print(f"wrote {escape(str(output))}")


@app.command()
def prior(
    model: Annotated[str, typer.Option(help="Target model: a local directory, or a hub name "
                                       "in the local Hugging Face cache.")],
    draft: Annotated[str | None, typer.Option(
        help="Draft model, found the same way (not for --algorithm NEXTN).")] = None,
    tp: Annotated[int, typer.Option(help="Tensor-parallel size (GPUs per server).")] = 1,
    attn_dp_size: Annotated[int, typer.Option(
        help="Data-parallel attention groups (SGLang's --attn-dp-size, or --dp-size with "
        "--enable-dp-attention): each runs the attention of its own requests on tp / this "
        "GPUs, with its own copy of the attention weights. A study sets it from its "
        "server_flags.")] = 1,
    gpu: Annotated[str | None, typer.Option(
        help="The GPU, by its name in treetune's GPU table (A100-40GB-SXM, A100-80GB-SXM, "
        "A100-40GB-PCIe, A100-80GB-PCIe, H100-SXM, H100-PCIe, H100-NVL, H800, H20, H200, "
        "H200-NVL, B200, B300, GB200, L40S, MI300X, MI325X, MI355X) or as nvidia-smi or "
        "amd-smi prints it; default: what nvidia-smi (on AMD nodes amd-smi, else rocm-smi) "
        "shows here.")] = None,
    datasets: Annotated[list[str] | None, typer.Option(
        help="Datasets the profile holds, all neutral (default: the built-in ones).")] = None,
    kv_cache_dtype: Annotated[str | None, typer.Option(
        help="SGLang's --kv-cache-dtype, when the server stores the KV cache in another "
        "dtype than the model's (e.g. fp8_e4m3).")] = None,
    name: Annotated[str | None, typer.Option(
        help="The profile's name (default: auto-<model>-<gpu>).")] = None,
    algorithm: Annotated[str, typer.Option(
        help="The draft method the draft runs by (SGLang's --speculative-algorithm): "
        "EAGLE3 (an EAGLE3 head), EAGLE or STANDALONE (a small model of the target's "
        "tokenizer); or NEXTN, the target's own MTP layer, without --draft. A target with "
        "an MTP layer gets the NEXTN method beside its draft's either way.")] = "EAGLE3",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the profile "
                                                "here (default: print it).")] = None,
) -> None:
    """Build the model search's prior from the models' config.json and the GPU.

    The profile the model search starts from on SGLang, with every fitted value neutral.

    Nothing is downloaded: a hub name must already be in the local Hugging Face cache
    (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub). Use the file with
    `treetune search --prior FILE`, `treetune predict --profile FILE` or `treetune calibrate`.
    """
    import yaml

    from treetune.backends.sglang import ALGORITHMS, KV_CACHE_BYTES, needs_draft_model
    from treetune.facts import build_prior

    if tp < 1:
        raise TreetuneError(f"--tp must be >= 1, got {tp}")
    if attn_dp_size < 1 or tp % attn_dp_size:
        raise TreetuneError(f"--attn-dp-size must divide --tp ({tp}), got {attn_dp_size}")
    drafted = [a for a in ALGORITHMS if needs_draft_model(a)]
    if algorithm.upper() not in ALGORITHMS:
        raise TreetuneError(f"--algorithm '{algorithm}' is not one the auto prior describes "
                            f"({', '.join(ALGORITHMS)})")
    if (algorithm.upper() in drafted) != (draft is not None):
        raise TreetuneError(
            f"--algorithm {algorithm.upper()} drafts with --draft: give it" if draft is None
            else f"--algorithm {algorithm.upper()} drafts with the target's own MTP layer: "
            f"drop --draft (or draft it by {', '.join(drafted)})")
    if output is not None:
        writable(output)
    kv_bytes = None
    if kv_cache_dtype is not None and kv_cache_dtype != "auto":
        if kv_cache_dtype not in KV_CACHE_BYTES:
            raise TreetuneError(f"--kv-cache-dtype '{kv_cache_dtype}' is not one of auto, "
                                f"{', '.join(KV_CACHE_BYTES)}")
        kv_bytes = KV_CACHE_BYTES[kv_cache_dtype]
    profile = build_prior(model, draft, tp, gpu, kv_cache_bytes=kv_bytes,
                          datasets=datasets or (), name=name, algorithm=algorithm.upper(),
                          attention_dp=attn_dp_size)
    t = profile.target
    kept = (f", {t.unquantized_params_b:.2f}B of them at {t.unquantized_bytes:g} bytes (left "
            f"unquantized) and the rest at {t.weight_bytes:g}" if t.unquantized_params_b
            else "")
    # Each GPU's share of a request's KV: of its attention group's GPUs (tp without groups).
    per_request = t.kv_bytes_per_token * t.kv_share(tp // attn_dp_size)
    per_gpu = (f" (on each GPU, {per_request:.0f} of its attention group's requests)"
               if attn_dp_size > 1 else f" ({per_request:.0f} on each GPU)" if tp > 1 else "")
    whole = (f", {t.replicated_params_b:.2f}B held whole on every GPU"
             if t.replicated_params_b and tp > 1 else "")
    if attn_dp_size > 1:
        whole += (f", its {t.attention_params_b:.2f}B of attention copied to each of its "
                  f"{attn_dp_size} data-parallel attention groups")
    err.print(f"{escape(t.name)}: {t.total_params_b:.2f}B parameters ({t.active_params_b:.2f}B "
              f"active{kept}{whole}), {t.kv_bytes_per_token:.0f} KV bytes per token{per_gpu}; "
              f"{_drafts(profile)}; {tp} x {escape(profile.hardware.gpu)}", highlight=False)
    if output is None:
        sys.stdout.write(yaml.safe_dump(profile.to_dict(), sort_keys=False))
        return
    profile.save(output)
    err.print(f"wrote {escape(str(output))}", highlight=False)


def _drafts(profile: Profile) -> str:
    """The draft methods of an auto prior, each with its draft's size."""
    parts = []
    for name in profile.method_names:
        method = profile.method(name)
        if method.draft is not None:
            parts.append(f"{name} draft {method.draft.params_m:.0f}M")
        elif method.mtp is not None:
            routed = ", plus its routed experts" if method.mtp.routed_experts else ""
            parts.append(f"{name}: its MTP layer, {method.mtp.dense_params_m:.0f}M read on "
                         f"every pass{routed}")
    return "; ".join(parts)


def search(study: Path | None = None, **options: Any) -> None:
    """Search for the best tree per batch size and workload, and write launch commands.

    Launches servers (SGLang, or the emulator with --profile) on Ray workers, measures every
    (dataset, batch) cell against a no-speculation baseline, and optimizes mean speedup per
    batch size with no dataset slower than the baseline. Rerunning resumes the study.
    """
    from treetune.objectives import Objective
    from treetune.study.export import write_outputs
    from treetune.study.recommend import advice, objective_note, recommend
    from treetune.study.runner import run_study
    from treetune.study.spec import load_study, option_overrides

    spec = load_study(study, option_overrides(
        {option.key: options[option.param] for option in search_options()}))
    drafts = (f"draft methods {', '.join(spec.method_names)}" if spec.methods
              else spec.draft)
    out.print(f"study [bold]{escape(spec.name)}[/bold]: " + escape(
        f"{spec.model} + {drafts}, batch {', '.join(map(str, spec.batch))}, datasets "
        f"{', '.join(spec.dataset_names)}, backend {spec.backend.describe()}, storage "
        f"{shown_url(spec.storage_url)}"))
    if not is_loopback(spec.host):
        err.print(f"[bold yellow]warning:[/bold yellow] servers will listen on "
                  f"{escape(spec.host)}, reachable from other machines: anyone who can "
                  "reach this host can use them (set api_key_env to require a key)",
                  highlight=False)
    restore = stopping.install()  # SIGTERM stops it as Ctrl-C does
    try:
        outcome = _run_with_progress(spec, run_study)
        if outcome.baseline is not None:
            recs = outcome.recommendations
            # Another objective's picks beside throughput's, from the same launches.
            note = (objective_note(recs, recommend(spec, outcome.results, outcome.baseline,
                                                   objective=Objective.THROUGHPUT))
                    if spec.objective is not Objective.THROUGHPUT else None)
            with stopping.held():  # the outputs agree with each other: written whole
                write_outputs(spec, recs, spec.output_dir, note)
    finally:
        restore()
        stopping.clear()  # raised if it was asked for: not the next command's (in-process)
    if outcome.baseline is not None and outcome.interrupted and all(
            r.config is BASELINE for r in outcome.results):
        # Tables of no tree, each row "no speculative config was measured", read as a
        # search that failed: it was stopped before its first tree ended.
        out.print("no tree was measured before the interrupt: nothing to compare yet; "
                  f"wrote {escape(str(spec.output_dir))}/recommendations.yaml (no "
                  "speculation, so far)")
    elif outcome.baseline is not None:
        _print_outcome(spec, outcome, recs, advice(recs))
        if note:
            out.print(f"[bold]objective:[/bold] {escape(note)}")
    if outcome.ended:
        out.print(f"[bold]stopped:[/bold] {escape(outcome.ended)}")
    if outcome.interrupted:
        err.print("interrupted: servers stopped, results so far are stored; rerun the same "
                  "command to resume")
        exit_interrupted()
    if outcome.baseline is None:
        raise TreetuneError("no baseline was measured, so there is nothing to recommend")


def _search_signature() -> inspect.Signature:
    """`search`'s parameters as typer reads them: `--study`, then one option per study
    field that has one (`spec.search_options`), so none is written out twice."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("study", keyword, default=None, annotation=Annotated[
        Path | None, typer.Option(help="Study spec YAML (see studies/).")])]
    for option in search_options():
        value: Any = list[option.value_type] if option.multiple else option.value_type
        names = [option.flag, *([option.short] if option.short else [])]
        if option.value_type is bool:  # a switch, left None unless given either way
            names = [f"{option.flag}/--no-{option.flag.removeprefix('--')}"]
        params.append(inspect.Parameter(option.param, keyword, default=None, annotation=Annotated[
            value | None, typer.Option(*names, help=option.help)]))
    return inspect.Signature(params)


search.__signature__ = _search_signature()  # type: ignore[attr-defined]
app.command()(search)


def _run_with_progress(spec: StudySpec, run_study: Callable[..., StudyOutcome]) -> StudyOutcome:
    """Run the study with a progress bar, shown from its first event: a study refused
    before it starts (locked storage, bad input) prints its error alone."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("launches"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn(), TextColumn("{task.description}"))
    bar = Progress(*columns, console=err, transient=False)
    task = bar.add_task("", total=spec.budget.launches)

    said = 0
    # A log or a pipe (nohup, tee, a cluster's job log): no bar, which rich draws only on
    # a terminal, but a plain line whenever a launch starts or ends or the best changes.
    logged = not err.is_terminal
    last: tuple[Any, ...] | None = None

    def show(p: StudyProgress) -> None:
        nonlocal said, last
        if not logged and not bar.live.is_started:
            bar.start()
        for note in p.notes[said:]:  # printed above the bar, kept in the scrollback
            bar.console.print(f"[yellow]note:[/yellow] {escape(note)}", highlight=False)
        said = len(p.notes)
        best = "  ".join(f"b{b}: {c} {m:.3f}" for b, (c, m) in sorted(p.best.items()))
        if logged:
            now = (p.launches_done, tuple(p.running), best)
            if now != last:
                last = now
                total = p.budget if p.budget is not None else "-"
                running = ", ".join(p.running) or "-"
                hours, rest = divmod(int(p.elapsed_s), 3600)  # days of a long study too
                elapsed = f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"
                err.print(escape(f"launches {p.launches_done}/{total} {elapsed} | best "
                                 f"{best or '-'} | running {running}"
                                 + (f" | {p.message}" if p.message else "")), highlight=False)
            return
        running = ", ".join(f"{key} [{p.stages[key]}]" if p.stages.get(key) else key
                            for key in p.running)
        parts = [f"best {best or '-'}", f"running {running}" if running else "", p.message]
        bar.update(task, completed=p.launches_done, refresh=True,
                   description=escape(" | ".join(part for part in parts if part)[:160]))

    try:
        return run_study(spec, show)
    finally:
        if bar.live.is_started:
            bar.stop()


def _print_outcome(spec: StudySpec, outcome: StudyOutcome, recs: list[Recommendation],
                   advice: tuple[str, str] | None) -> None:
    """The measured configs, the recommendations, and the mixed workload's advice when it
    is more than one static tree: ("two pools", why) or ("one pool, adaptive", why)."""
    from treetune.study.evidence import speedups
    from treetune.study.recommend import MIXED, alternative_advice, summary_rows

    failed = [r for r in outcome.results if not r.ok]
    what = "" if spec.objective == "throughput" else f"{spec.objective.label} "
    table = Table(title=f"measured {what}speedups over no speculation ({len(outcome.results)} "
                  f"configs in {outcome.launches} launches, {len(failed)} failed; strategy "
                  f"{outcome.strategy})", caption="every measured config; > recommended "
                  "at some batch size; * compared; red: slower than no speculation")
    table.add_column("tree", no_wrap=True)
    # Every judged cell: each dataset at each batch size, and the rate cells the objective
    # judges (with the largest batch's server).
    cells = [c for b in sorted(spec.batch) for c in spec.criterion.cells(spec.dataset_names, b)]
    for c in cells:
        table.add_column(escape(f"b{c.batch} {c.name}" if c.rate is None else c.name),
                         justify="right", overflow="fold")
    shown = {r.config: r for r in outcome.results if r.ok and r.config.label() != "baseline"}
    chosen = {r.config for r in recs}
    for config, result in sorted(shown.items(), key=lambda kv: kv[0].label()):
        per = speedups(result, outcome.baseline, cells, spec.objective).values()
        values = [f"[red]{s:.3f}[/red]" if s < 1 else f"{s:.3f}" for s in per]
        tag = ("> " if config in chosen else "") + escape(spec.config_label(config)) + (
            " *" if config in spec.compare else "")
        table.add_row(tag, *values)
    out.print(table)
    # escape: rich would take "[interval]" for a markup tag and print nothing of it.
    rec_table = Table(title=f"recommendations ({spec.objective.describe()})", caption=escape(
        "[interval]: the 95% interval of the true speedup, given the measurement noise; a "
        "tree is recommended only when on every dataset its one-sided 99% lower bound (a "
        "little below the 95% interval's) clears 1 - tolerance"))
    for col in ("workload", "batch", "config (tree S,K,N)", "measured speedups [interval]"):
        rec_table.add_column(escape(col))
    for row in summary_rows(recs, methods=len(spec.method_names) > 1):
        rec_table.add_row(*map(escape, row))
    out.print(rec_table)
    for rec in recs:  # why, where a measured tree is not taken (the others: recommendations.*)
        if rec.workload == MIXED and rec.config is BASELINE and rec.reason:
            out.print(f"[bold]batch {rec.batch}:[/bold] {escape(rec.reason)}")
    if advice:
        out.print(f"[bold]{advice[0]}:[/bold] {escape(advice[1])}")
    alternative = alternative_advice(recs)
    if alternative:
        out.print(f"[bold]adaptive alternative:[/bold] {escape(alternative)} (ADAPTIVE.md)")
    for r in failed:
        out.print(f"[yellow]failed[/yellow] {escape(f'{r.config}: {r.reason}')}")
    if spec.unjudged_rates:
        out.print(f"[yellow]note:[/yellow] {escape(spec.unjudged_rates)}")
    out.print(f"wrote {escape(str(spec.output_dir))}/recommendations.yaml, "
              "recommendations.json and launch/*.sh")


@app.command()
def report(
    study_folder: Annotated[str, typer.Argument(
        help="A folder written by treetune search, or the study's storage URL "
             "(e.g. postgresql://host/db, sqlite:////abs/study.db).",
        metavar="STUDY_FOLDER|STORAGE_URL")],
    study: Annotated[str | None, typer.Option(
        "--study", help="With a storage URL that holds several studies: the study's name.",
        show_default=False)] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Where to write "
                                                "(default <study-folder>/report; for a "
                                                "storage URL, the study's output folder's "
                                                "report/ when that folder is on this "
                                                "machine, else ./<study>-report).")] = None,
) -> None:
    """Write every figure as offline HTML, a report.html index and, when possible, PNGs.

    Works on a study that is still running.
    """
    from treetune.report.data import load_study_data
    from treetune.report.html import write_report

    if study is not None and "://" not in study_folder:
        raise TreetuneError("--study names a study in a storage URL; a study folder holds "
                            "one study: drop --study, or give the storage URL")
    data = load_study_data(study_folder, study)
    # A URL's study may have been searched on another machine: its folder is not here.
    here = data.folder.is_dir()
    folder = output or (data.folder / "report" if here else Path(f"{data.spec.name}-report"))
    if folder.exists() and not folder.is_dir():
        raise TreetuneError(f"cannot write the report in {folder}: it is a file, not a "
                            "folder; choose another with --output")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TreetuneError(f"cannot write the report in {folder}: {exc.strerror}") from None
    result = write_report(data, folder)
    for notice in result.notices:
        err.print(f"[yellow]note:[/yellow] {escape(notice)}")
    out.print(f"wrote {escape(str(result.index))} with {len(result.figures)} figures"
              + (f" and {len(result.pngs)} PNGs" if result.pngs else ""))


@app.command()
def profiles() -> None:
    """List the shipped performance profiles."""
    for name in shipped_profiles():
        prof = load_profile(name)
        out.print(f"[bold]{name}[/bold]: {escape(prof.description)}")
        out.print(f"    datasets: {escape(', '.join(prof.datasets))}")
        out.print(f"    draft methods: {', '.join(prof.method_names)}")


@app.command()
def worlds() -> None:
    """List the shipped worlds: truths the search's own model cannot express.

    The emulator serves them (--world), and the search-efficiency benchmark judges by them.
    """
    from treetune.worlds import load_world, shipped_worlds

    for name in shipped_worlds():
        world = load_world(name)
        out.print(f"[bold]{name}[/bold]: {escape(world.description)}")
        out.print(f"    datasets: {escape(', '.join(world.profile.datasets))}")


@app.command()
def grid(
    world: Annotated[str, typer.Option(help="A world or profile (name or file) to measure.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="CSV file to write.")],
    space: Annotated[str, typer.Option(help="Search space whose trees to measure.")]
    = "bench-speculative",
    batch: Annotated[list[int], typer.Option(help="Batch sizes, e.g. --batch 1 32.")]
    = [1, 8, 32, 64],  # noqa: B006
) -> None:
    """Write a world's noise-free cells as a replay table (CSV).

    Every tree of the space that fits in memory at the largest batch size (a study's
    server holds that many requests, whatever the cell's batch), and the baseline, at every
    batch size and dataset, in the format replay worlds read.
    """
    import csv

    from treetune.perfmodel import RunningCaps
    from treetune.space import load_space
    from treetune.worlds import load_world

    batch = list(dict.fromkeys(batch))  # a size given twice is one size, as predict's
    bad = [b for b in batch if b < 1]
    if bad:
        raise TreetuneError(f"--batch {bad[0]}: batch sizes must be >= 1")
    writable(output)
    found = load_world(world)
    if found.replay_path is not None and output.resolve() == found.replay_path:
        raise TreetuneError(f"--output {output} is the world's replay table: its "
                            "measurements would be overwritten; give another file")
    model = found.model()
    tree_space = load_space(space)
    if tree_space.is_ngram:
        # A replay table has no method column: its trees are the world's own draft head's.
        raise TreetuneError(
            f"--space {space} holds NGRAM trees, but a replay table replays the world's "
            f"{model.method_name} draft head only: give a space of (steps, topk, "
            "draft_tokens) trees, such as default or bench-speculative")
    every = tree_space.configs()
    # A study's server is asked to hold its largest batch size's requests at once; one
    # whose KV pool holds fewer runs that many, the others waiting (as the emulator does).
    caps = RunningCaps(found.profile, max(batch), found.profile.tp)
    trees = [c for c in every if caps.starts(c)]
    if not trees:
        raise TreetuneError(
            f"no tree of --space {space} starts at batch {max(batch)} on "
            f"{found.profile.name} (a study's server is asked to hold the largest batch "
            "size's requests at once): give smaller batch sizes, or a world with more memory")
    fewer = sum(caps(c) < max(batch) for c in trees)

    def throughput(config: ServerConfig, size: int, dataset: str) -> float:
        return model.throughput(config, caps.batch(config, size), dataset)

    rows = []  # all of them before the file is opened: an error leaves no partial table
    for b in batch:
        for dataset in found.profile.datasets:
            rows.append(["", "", "", b, dataset,
                         f"{throughput(BASELINE, b, dataset):.6g}", ""])
            rows.extend([c.steps, c.topk, c.draft_tokens, b, dataset,
                         f"{throughput(c, b, dataset):.6g}",
                         f"{model.accept_length(c, dataset):.6g}"] for c in trees)
    with output.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["steps", "topk", "draft_tokens", "batch", "dataset", "throughput",
                         "accept_length"])
        writer.writerows(rows)
    dropped = (f" ({len(every) - len(trees)} of the space's trees cannot start at batch "
               f"{max(batch)} and are left out)" if len(trees) < len(every) else "")
    if fewer:
        dropped += (f" ({fewer} trees' KV pools hold fewer than {max(batch)} requests: "
                    "their rows are of as many as they hold)")
    out.print(f"wrote {escape(str(output))}: {len(trees)} trees and the baseline at batch "
              f"{', '.join(map(str, batch))} on {len(found.profile.datasets)} datasets"
              f"{dropped}")


@functools.cache
def multi_value_options() -> frozenset[str]:
    """Options that take several values after one flag, as in `--batch 1 32`: those of any
    command declared as a list (click calls them `multiple`)."""
    commands = typer.main.get_command(app).commands.values()  # type: ignore[attr-defined]
    return frozenset(name for command in commands for param in command.params
                     if getattr(param, "multiple", False) for name in param.opts)


def expand_multi_values(argv: list[str]) -> list[str]:
    """Turn `--batch 1 32` (or `--batch=1 32`) into `--batch 1 --batch 32` (click options
    take one value)."""
    result: list[str] = []
    current: str | None = None
    numbers = False  # the list's first value is a number
    options = multi_value_options()
    for arg in argv:
        if arg.startswith("-") and not _is_number(arg):
            name = arg.split("=", 1)[0]
            current = name if name in options else None
            numbers = "=" in arg and _is_number(arg.split("=", 1)[1])
            result.append(arg)
        elif current is not None and result and result[-1] == current:
            numbers = _is_number(arg)  # the list's first value
            result.append(arg)
        elif current is not None and (_is_number(arg) or not numbers):
            result += [current, arg]
        else:
            # A word that is no number ends a list of numbers: `--batch 1 32 study.yaml`
            # is a stray study file (click names it), not a batch size.
            current = None
            result.append(arg)
    return result


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _reflowed(doc: str) -> str:
    """A docstring as help text: each paragraph one line, for the terminal to wrap (Typer
    keeps a docstring's line breaks, so at 80 columns every source line broke in two)."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


for _info in app.registered_commands:
    if _info.help is None and _info.callback is not None and _info.callback.__doc__:
        _info.help = _reflowed(_info.callback.__doc__)


# Said under every command's help too: a user reads the command's, not treetune's.
for _command in app.registered_commands:
    _command.epilog = _command.epilog or app.info.epilog


def exit_interrupted() -> NoReturn:
    """Exit 130: a stop (Ctrl-C, SIGTERM) was handled. Under `python -m treetune`, CPython
    (3.11 to 3.13) would exit by SIGINT instead when the KeyboardInterrupt had escaped an
    exec or eval of a string on its way (a dataclass or namedtuple being made in a module
    whose import the stop cut short): that leaves its "unhandled KeyboardInterrupt" flag
    set, which the next exec of a string clears."""
    exec("")
    sys.exit(130)


def main(argv: list[str] | None = None) -> None:
    args = expand_multi_values(list(sys.argv[1:] if argv is None else argv))
    debug = "--debug" in args or os.environ.get("TREETUNE_DEBUG") == "1"
    args = [a for a in args if a != "--debug"]
    try:
        # Without standalone mode Typer returns an exit code instead of exiting: 130 for a
        # Ctrl-C (or SIGTERM) that reached it, which it caught.
        code = app(args, prog_name="treetune", standalone_mode=False)
        if code == 130:
            err.print("aborted")
            exit_interrupted()
        if isinstance(code, int) and code:
            sys.exit(code)
    except TreetuneError as exc:
        if debug:
            raise
        err.print(f"[bold red]error:[/bold red] {escape(str(exc))}", highlight=False)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        exit_interrupted()
    except Exception as exc:  # click usage errors, a file the machine refused, the unexpected
        import click

        # Typer >= 0.20 ships its own copy of click: its usage errors are not click's.
        if isinstance(exc, click.ClickException | typer.TyperException) and hasattr(
                exc, "format_message"):
            if type(exc).__name__ == "NoArgsIsHelpError":  # `treetune` alone: the help
                sys.exit(getattr(exc, "exit_code", 2))      # was printed, no error to add
            commands = getattr(typer.main.get_command(app), "commands", {})
            where = f"treetune {args[0]}" if args and args[0] in commands else "treetune"
            message = exc.format_message()
            stray = [a for a in args if a.endswith((".yaml", ".yml")) and a in message]
            command = commands.get(args[0]) if args else None
            takes_study = any(p.name == "study" for p in getattr(command, "params", ()))
            if stray and takes_study and "--study" not in args \
                    and "unexpected extra argument" in message:
                message += f"; a study file is given as --study {stray[0]}"
            err.print(f"[bold red]error:[/bold red] {escape(message)} (see "
                      f"{where} --help)", highlight=False)
            sys.exit(getattr(exc, "exit_code", 2))
        if debug:
            raise
        if isinstance(exc, OSError) and exc.filename:
            # A file the machine would not let us read or write, past any check made first
            # (an immutable file, a /proc path, a folder gone meanwhile): the user's to fix.
            err.print(f"[bold red]error:[/bold red] cannot use {escape(str(exc.filename))}: "
                      f"{escape(exc.strerror or type(exc).__name__)} (rerun with --debug for "
                      "the traceback)", highlight=False)
            sys.exit(2)
        err.print(f"[bold red]internal error:[/bold red] {type(exc).__name__}: "
                  f"{escape(str(exc))} "
                  "(rerun with --debug for the traceback)")
        sys.exit(1)
