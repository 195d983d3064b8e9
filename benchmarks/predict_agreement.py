"""Does the emulator, measured by an independent client, agree with `treetune predict`?

Launches the emulator (noise off) once per config, baseline and a tree, and measures it with
a small streaming client written here (aiohttp, OpenAI `/v1/completions`, not treetune's
load generator): closed loops at concurrency 1, 8 and 32 and open loops (Poisson arrivals)
at the rates where the baseline runs about 1, 8 and 32 requests, each with short outputs
(12 in / 256 out) and long ones (512 in / 1024 out). `treetune predict --prompt-tokens
--output-tokens --batch/--rate --json` predicts the same cells. Goal (issue 13): within 2%
on speedup and throughput, within 5% on p50 TPOT.

Closed loop: speedup is the ratio of output throughputs; open loop, where both servers
deliver what arrives, the ratio of the baseline's p50 TPOT to the tree's. Times are
emulated seconds: wall seconds times the time scale.

    .venv/bin/python benchmarks/predict_agreement.py [--quick] [--json] [--tree 3,4,8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from treetune.config import TreeConfig
from treetune.errors import InvalidTreeError
from treetune.server import start_server

PROFILE = "qwen3-8b-h100"
DATASET = "sharegpt"
SHAPES = {"short": (12, 256), "long": (512, 1024)}
BATCHES = (1, 8, 32)
MAX_RUNNING = 64  # the servers' cap: open loops at a baseline batch of 32 must not hit it
GOALS = {"speedup": 0.02, "tok_s": 0.02, "tpot_p50": 0.05}
# A closed loop's tree starts its requests together and their phases spread slowly (the
# model predicts the spread state): the warm-up lasts this many request durations, the
# window WINDOW of them (fewer with --quick).
WARMUP, WINDOW = 20, 15
# Open loops: requests per cell by the baseline's mean requests in the system. The load
# itself fluctuates for seconds; at ~32 in the system, 200 requests measured a speedup
# with a spread of 1.5% between arrival seeds (a discrete-event run of the same scheduler),
# 1000 requests 0.8%.
OPEN_REQUESTS = {1: 80, 8: 200, 32: 1000}
CHUNKS = 5  # consecutive parts of a cell's measurement: their spread gives its standard error


@dataclass(frozen=True)
class Cell:
    shape: str
    batch: int  # closed loop: the concurrency; open loop: the baseline's mean requests in
    rate: float | None = None  # requests/s (emulated), open loop

    @property
    def label(self) -> str:
        loop = f"closed c={self.batch}" if self.rate is None else \
            f"open {self.rate:.3g}/s (~{self.batch})"
        return f"{self.shape:5} {loop}"


@dataclass
class Stream:
    sent: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens so far)


async def request(session: aiohttp.ClientSession, url: str, prompt_tokens: int,
                  output_tokens: int, streams: list[Stream]) -> None:
    """One streamed completion; times in wall seconds (time.monotonic)."""
    stream = Stream(time.monotonic())
    streams.append(stream)
    body = {"model": "m", "prompt": "abcd" * prompt_tokens, "max_tokens": output_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with session.post(url, json=body, headers={"X-Treetune-Dataset": DATASET}) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            usage = json.loads(line[6:]).get("usage")
            if not usage or usage["completion_tokens"] <= stream.tokens:
                continue
            now = time.monotonic()
            stream.first = stream.first or now
            stream.tokens = usage["completion_tokens"]
            stream.arrivals.append((now, stream.tokens))
    stream.end = time.monotonic()


def summarize(streams: list[Stream], start: float, stop: float, scale: float,
              output_tokens: int) -> dict[str, float]:
    """Output tokens/s streamed inside [start, stop] and the p50 TPOT of the requests that
    ended inside it, in emulated time."""
    tokens = 0
    for s in streams:
        before = 0
        for at, count in s.arrivals:
            if start <= at <= stop:
                tokens += count - before
            before = count
    done = [s for s in streams if s.end is not None and start <= s.end <= stop
            and s.tokens == output_tokens and s.first is not None]
    tpots = [(s.end - s.first) * scale / (output_tokens - 1) for s in done]  # type: ignore[operator]
    return {"tok_s": tokens / ((stop - start) * scale),
            "tpot_p50": statistics.median(tpots) if tpots else float("nan"),
            "requests": float(len(done))}


async def closed_loop(url: str, cell: Cell, scale: float, warmup_s: float,
                      window_s: float) -> dict[str, float]:
    prompt, output = SHAPES[cell.shape]
    streams: list[Stream] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def client() -> None:
            while True:
                await request(session, url, prompt, output, streams)

        t0 = time.monotonic()
        tasks = [asyncio.create_task(client()) for _ in range(cell.batch)]
        await asyncio.sleep((warmup_s + window_s) / scale)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    start, stop = t0 + warmup_s / scale, t0 + (warmup_s + window_s) / scale
    got = summarize(streams, start, stop, scale, output)
    edges = np.linspace(start, stop, CHUNKS + 1)
    got["chunks"] = [summarize(streams, a, b, scale, output)["tok_s"]  # type: ignore[assignment]
                     for a, b in itertools.pairwise(edges)]
    return got


async def open_loop(url: str, cell: Cell, scale: float, requests: int,
                    seed: int) -> dict[str, float]:
    """`requests` Poisson arrivals at the cell's rate; the first tenth and the last tenth
    warm up and keep the load on, the middle is measured; then every request is drained."""
    assert cell.rate is not None
    prompt, output = SHAPES[cell.shape]
    gaps = np.random.default_rng(seed).exponential(1.0 / cell.rate, requests)
    # A Poisson process given its count: the sample's own rate is the cell's, so that a
    # short run's luck does not change the load it offers; and so within the measured
    # middle, whose arrivals span the throughput's window (a window of 20 light-load
    # requests otherwise measures its own luck: 29% high in one run).
    edge = requests // 10
    for part in (slice(1, edge + 1), slice(edge + 1, requests - edge),
                 slice(requests - edge, requests)):
        if gaps[part].size:
            gaps[part] *= 1.0 / cell.rate / gaps[part].mean()
    times = np.cumsum(gaps) - gaps[0]
    streams: list[Stream] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.monotonic()
        tasks = []
        for at in times:
            await asyncio.sleep(max(0.0, t0 + at / scale - time.monotonic()))
            tasks.append(asyncio.create_task(request(session, url, prompt, output, streams)))
        await asyncio.gather(*tasks)
    measured = sorted(streams, key=lambda s: s.sent)[requests // 10: requests - requests // 10]
    tpots = [(s.end - s.first) * scale / (output - 1) for s in measured]  # type: ignore[operator]
    # Tokens streamed while the measured requests arrived: what the server delivered.
    window = summarize(streams, measured[0].sent, measured[-1].sent, scale, output)
    chunks = [statistics.median(part) for part in np.array_split(tpots, CHUNKS)]
    return {"tok_s": window["tok_s"], "tpot_p50": statistics.median(tpots),
            "requests": float(len(measured)), "chunks": chunks}  # type: ignore[dict-item]


@contextlib.contextmanager
def emulator(tree: str | None, scale: float, log: str) -> Iterator[str]:
    """An emulator on a free port, noise off, started and stopped as a study's servers
    are, until the block ends."""
    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "treetune.emulator", "--profile", PROFILE, "--no-noise",
               "--seed", "1", "--time-scale", str(scale), "--load-time", "0",
               "--model-path", "Qwen/Qwen3-8B", "--port", str(port), "--host", "127.0.0.1",
               "--max-running-requests", str(MAX_RUNNING)]
        if tree:
            steps, topk, draft = tree.split(",")
            cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
                    "--speculative-num-steps", steps, "--speculative-eagle-topk", topk,
                    "--speculative-num-draft-tokens", draft]
        return cmd

    with start_server(command, log_path=Path(log), timeout_s=60) as server:
        yield server.base_url


async def clock_lag(base: str) -> float:
    """The emulator's worst clock lag since start (emulated seconds)."""
    async with aiohttp.ClientSession() as session, session.get(f"{base}/server_info") as r:
        info = await r.json()
    lags = [s.get("clock_lag", {}).get("max_s", 0.0) for s in info.get("internal_states", [])]
    return max(lags, default=0.0)


def rates_for() -> dict[tuple[str, int], float]:
    """Per shape and batch, the Poisson rate at which the baseline holds that many requests
    on average, queued or running (Little's law on the model's open loop, bisected)."""
    from treetune.config import BASELINE
    from treetune.perfmodel import PerfModel, Shape, load_profile

    model = PerfModel(load_profile(PROFILE))
    rates = {}
    for name, (prompt, output) in SHAPES.items():
        shape = Shape(prompt, output)
        for batch in BATCHES:
            low, high = 1e-3, model.closed_loop(BASELINE, DATASET, shape, MAX_RUNNING).request_rate
            for _ in range(20):
                mid = (low + high) / 2
                served = model.open_loop(BASELINE, DATASET, shape, mid, MAX_RUNNING)
                in_system = mid * (served.ttft_s + served.tpot_s * (output - 1))  # Little
                low, high = (mid, high) if in_system < batch else (low, mid)
            rates[name, batch] = round(low, 3 if low < 10 else 2)
    return rates


def predictions(tree: str, cells: list[Cell]) -> dict[Cell, dict[str, float]]:
    """`treetune predict --json` for the cells, one call per shape."""
    out: dict[Cell, dict[str, float]] = {}
    for name, (prompt, output) in SHAPES.items():
        mine = [c for c in cells if c.shape == name]
        if not mine:
            continue
        cmd = [sys.executable, "-m", "treetune", "predict", "--profile", PROFILE,
               "--tree", tree, "--dataset", DATASET, "--prompt-tokens", str(prompt),
               "--output-tokens", str(output), "--max-running-requests", str(MAX_RUNNING),
               "--json"]
        closed = sorted({c.batch for c in mine if c.rate is None})
        rates = sorted({c.rate for c in mine if c.rate is not None})
        if closed:
            cmd += ["--batch", *map(str, closed)]
        if rates:
            cmd += ["--rate", *map(str, rates)]
        records = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                            text=True).stdout)
        for cell in mine:
            rec = next(r for r in records if (r["rate"] == cell.rate if cell.rate is not None
                                              else r["batch"] == cell.batch and not r["rate"]))
            if rec["oom"]:  # a server that does not start has no prediction to compare
                raise SystemExit(f"predict calls {tree} at {cell} out of memory: it would "
                                 "not start")
            out[cell] = {"speedup": rec["speedup"], "tok_s": rec["spec_tok_s"],
                         "base_tok_s": rec["baseline_tok_s"],
                         "tpot_p50": (rec["tpot_ms"] or float("nan")) / 1e3,
                         "base_tpot_p50": (rec["baseline_tpot_ms"] or float("nan")) / 1e3}
    return out


def measure(tree: str, cells: list[Cell], scale: float, fine_scale: float, quick: bool,
            logdir: str) -> dict[Cell, dict[str, float]]:
    """Each cell on the baseline and on the tree, one server per config and time scale."""
    sides: dict[str, dict[Cell, dict[str, float]]] = {"base": {}, "spec": {}}
    # A closed loop's successor must reach the server within the pass after its
    # predecessor's last round, as a real client does: the client's reaction, in wall time,
    # counts `scale` times in emulated time, so turnover-bound cells run at a slower clock.
    groups = {fine_scale: [c for c in cells if c.rate is None and c.shape == "short"]}
    groups.setdefault(scale, []).extend(c for c in cells if c not in groups[fine_scale])
    for (side, config), (cell_scale, group) in itertools.product(
            (("base", None), ("spec", tree)), groups.items()):
        if not group:
            continue
        scale = cell_scale
        with emulator(config, scale, f"{logdir}/{side}-{scale:g}.log") as base:
            url = f"{base}/v1/completions"
            for cell in group:
                output = SHAPES[cell.shape][1]
                if cell.rate is None:
                    # Long enough for a tree's requests to spread out of their common start.
                    request_s = output * 0.01
                    warmup = request_s * (3 if quick else WARMUP)
                    window = request_s * (5 if quick else WINDOW)
                    got = asyncio.run(closed_loop(url, cell, scale, warmup, window))
                else:
                    count = (60 if cell.batch > 1 else 24) if quick else \
                        OPEN_REQUESTS[cell.batch]
                    got = asyncio.run(open_loop(url, cell, scale, count, seed=cell.batch))
                sides[side][cell] = got
                print(f"  {side:4} {cell.label}: {got['tok_s']:.1f} tok/s, p50 TPOT "
                      f"{got['tpot_p50'] * 1e3:.3f} ms, {got['requests']:.0f} requests",
                      file=sys.stderr, flush=True)
            lag = asyncio.run(clock_lag(base))
            print(f"  {side} server at time scale {scale:g}: worst clock lag "
                  f"{lag * 1e3:.1f} ms emulated",
                  file=sys.stderr, flush=True)
    measured = {}
    for cell in cells:
        b, s = sides["base"][cell], sides["spec"][cell]
        speedup = (s["tok_s"] / b["tok_s"] if cell.rate is None
                   else b["tpot_p50"] / s["tpot_p50"])
        # The same chunk of both sides: the same stretch of time (closed) or the same
        # arrivals (open, one seed for both).
        parts = (np.divide(s["chunks"], b["chunks"]) if cell.rate is None
                 else np.divide(b["chunks"], s["chunks"]))
        measured[cell] = {"speedup": speedup, "tok_s": s["tok_s"], "base_tok_s": b["tok_s"],
                          "tpot_p50": s["tpot_p50"], "base_tpot_p50": b["tpot_p50"],
                          "speedup_se": float(np.std(parts, ddof=1) / np.sqrt(CHUNKS)
                                              / speedup)}
    return measured


def tree_text(text: str) -> str:
    """An argparse type: a tree as `treetune predict --tree` takes it, checked here."""
    try:
        TreeConfig.parse(text)
    except InvalidTreeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--tree", default="3,4,8", type=tree_text,
                        help="the tree, steps,topk,draft_tokens")
    parser.add_argument("--quick", action="store_true",
                        help="shorter windows and fewer open-loop requests (about 4 minutes; "
                        "the full run about 25)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="emulator time scale (default: 4, 8 with --quick)")
    parser.add_argument("--fine-time-scale", type=float, default=2.0,
                        help="time scale of the closed loops with short outputs, where the "
                        "client's reaction time counts (default 2)")
    parser.add_argument("--closed-only", action="store_true", help="skip the open loops")
    parser.add_argument("--only", default="",
                        help="only the cells whose label contains this, e.g. 'short closed'")
    parser.add_argument("--json", action="store_true", help="print JSON records")
    args = parser.parse_args()
    scale = args.time_scale or (8.0 if args.quick else 4.0)
    rates = rates_for()
    cells = [Cell(shape, b) for shape in SHAPES for b in BATCHES]
    if not args.closed_only:
        cells += [Cell(shape, b, rates[shape, b]) for shape in SHAPES for b in BATCHES]
    cells = [c for c in cells if args.only in c.label]
    started = time.monotonic()
    predicted = predictions(args.tree, cells)
    with tempfile.TemporaryDirectory(prefix="agree") as logdir:
        measured = measure(args.tree, cells, scale, args.fine_time_scale, args.quick,
                           logdir)
    rows = []
    for cell in cells:
        p, m = predicted[cell], measured[cell]
        errors = {k: p[k] / m[k] - 1 for k in GOALS}
        rows.append({"shape": cell.shape, "loop": "closed" if cell.rate is None else "open",
                     "batch": cell.batch, "rate": cell.rate,
                     **{f"measured_{k}": round(v, 6) for k, v in m.items()},
                     **{f"predicted_{k}": round(v, 6) for k, v in p.items()},
                     **{f"error_{k}": round(v, 4) for k, v in errors.items()},
                     "met": all(abs(errors[k]) <= GOALS[k] for k in GOALS)})
    elapsed = time.monotonic() - started
    if args.json:
        print(json.dumps({"tree": args.tree, "profile": PROFILE, "dataset": DATASET,
                          "time_scale": scale,
                          "fine_time_scale": args.fine_time_scale, "quick": args.quick,
                          "elapsed_s": round(elapsed, 1), "cells": rows}, indent=1))
        return
    print(f"tree ({args.tree}) vs no speculation, {PROFILE}/{DATASET}, noise off, time scale "
          f"{scale:g} ({args.fine_time_scale:g} for short closed loops), {elapsed:.0f} s; "
          "errors are predicted / measured - 1")
    print("+-: the measured speedup's standard error, from its spread over "
          f"{CHUNKS} consecutive parts of the cell")
    print(f"{'cell':28} {'speedup m/p':>15} {'err':>7} {'+-':>5} {'tok/s m/p':>17} {'err':>7} "
          f"{'p50 TPOT ms m/p':>17} {'err':>7}  goal")
    for cell, row in zip(cells, rows, strict=True):
        print(f"{cell.label:28} {row['measured_speedup']:7.3f}/{row['predicted_speedup']:<7.3f}"
              f" {row['error_speedup']:+7.1%} {row['measured_speedup_se']:5.1%}"
              f" {row['measured_tok_s']:8.0f}/"
              f"{row['predicted_tok_s']:<8.0f} {row['error_tok_s']:+7.1%} "
              f"{row['measured_tpot_p50'] * 1e3:8.3f}/{row['predicted_tpot_p50'] * 1e3:<8.3f} "
              f"{row['error_tpot_p50']:+7.1%}  {'met' if row['met'] else 'NOT met'}")


if __name__ == "__main__":
    # A terminated benchmark still stops its emulators (the `finally` in `emulator`).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
