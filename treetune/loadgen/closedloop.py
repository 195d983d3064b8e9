"""Measure one cell (a dataset at a batch size) on a running server with a closed loop.

`batch` workers each keep one streaming request in flight, so the server runs `batch`
requests at all times, as a benchmark at fixed concurrency does. Every time and throughput
is in server time: the emulator runs `time_scale` times faster than the GPU it emulates,
so wall seconds are divided by it (it is 1 on SGLang).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from treetune.backends import ServerApi
from treetune.client import ServerClient, ServerRequestError
from treetune.errors import TreetuneError
from treetune.results import CellResult, Latency

if TYPE_CHECKING:
    from treetune.datasets import Prompt

log = logging.getLogger(__name__)

SETTLE_S = 1.0  # server seconds after every worker's first token before the window opens
MIN_FAILURES = 5  # failed requests in a row that end a cell, at least
ERROR_BACKOFF_S = 0.05  # wall seconds a worker waits after a failed request
DRAIN_TIMEOUT_S = 30.0  # wall seconds to wait for the server to finish aborted requests


class PromptSetLike(Protocol):
    """What a cell needs of `treetune.datasets.PromptSet`."""

    name: str
    prompts: list[Prompt]
    max_new_tokens: int


class MeasurementError(TreetuneError):
    """A cell that could not be measured: every request failed, or the server is gone."""


@dataclass
class _Stream:
    """One request's arrivals: start and (time, cumulative tokens) per chunk, wall clock."""

    start: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    finished: bool = False


@dataclass
class _Record:
    """What the workers saw; read once the window has closed."""

    workers: int
    streams: list[_Stream] = field(default_factory=list)
    errors: list[float] = field(default_factory=list)  # wall times of failed requests
    last_error: BaseException | None = None
    failures_in_a_row: int = 0
    started: set[int] = field(default_factory=set)  # workers that received a token
    all_started: asyncio.Event = field(default_factory=asyncio.Event)
    hopeless: asyncio.Event = field(default_factory=asyncio.Event)

    def first_token(self, worker: int) -> None:
        self.failures_in_a_row = 0
        if worker not in self.started:
            self.started.add(worker)
            if len(self.started) == self.workers:
                self.all_started.set()

    def failure(self, exc: BaseException) -> None:
        self.errors.append(time.monotonic())
        self.last_error = exc
        self.failures_in_a_row += 1
        # Every worker's last requests failed with no token in between: nothing works.
        if self.failures_in_a_row >= max(2 * self.workers, MIN_FAILURES):
            self.hopeless.set()


async def measure_cell(
    client: ServerClient,
    prompts: PromptSetLike,
    batch: int,
    *,
    duration_s: float,
    warmup_s: float | None = None,
    repeats: int = 3,
    ignore_eos: bool = False,
) -> CellResult:
    """Throughput, accept length and latencies of `prompts` at concurrency `batch`.

    `duration_s` and `warmup_s` are server seconds. Without `warmup_s`, the window opens
    once every worker has received a token, plus SETTLE_S. The window is split into
    `repeats` equal sub-windows whose throughputs give a spread. `errors` counts requests
    that failed before the window closed; if every request keeps failing, or the server
    has no `/metrics`, raises instead. `ignore_eos` makes every request generate exactly
    `prompts.max_new_tokens`.
    """
    if batch < 1 or repeats < 1 or duration_s <= 0:
        raise ValueError(f"need batch >= 1, repeats >= 1 and duration_s > 0; got batch={batch}, "
                         f"repeats={repeats}, duration_s={duration_s}")
    if not prompts.prompts:
        raise MeasurementError(f"dataset '{prompts.name}' has no prompts")
    scale = await client.time_scale()
    record = _Record(workers=batch)
    offsets = [i * len(prompts.prompts) // batch for i in range(batch)]
    tasks = [
        asyncio.create_task(_worker(client, prompts, i, offsets[i], record, ignore_eos))
        for i in range(batch)
    ]
    try:
        if warmup_s is None:
            await _until(record.all_started.wait(), record, tasks)
            await _until(asyncio.sleep(SETTLE_S / scale), record, tasks)
        else:
            await _until(asyncio.sleep(warmup_s / scale), record, tasks)
        before = await client.metrics()
        start = time.monotonic()
        await _until(asyncio.sleep(duration_s / scale), record, tasks)
        end = time.monotonic()
        after = await client.metrics()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await _drain(client)
    return _cell(prompts.name, batch, record, (start, end), scale, repeats, client.api, before,
                 after)


async def _worker(client: ServerClient, prompts: PromptSetLike, index: int, offset: int,
                  record: _Record, ignore_eos: bool) -> None:
    """Send one request at a time, cycling over the prompts from `offset`."""
    n = len(prompts.prompts)
    i = offset
    while True:
        prompt = prompts.prompts[i % n]
        i += 1
        stream = _Stream(start=time.monotonic())
        record.streams.append(stream)
        try:
            chunks = client.stream(prompt, prompts.max_new_tokens, ignore_eos=ignore_eos)
            async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                async for arrival, tokens in chunks:
                    if not stream.chunks:
                        record.first_token(index)
                    stream.chunks.append((arrival, tokens))
            stream.finished = True
        except (ServerRequestError, OSError, ValueError) as exc:
            record.failure(exc)
            await asyncio.sleep(ERROR_BACKOFF_S)


async def _until(waiting: Awaitable[object], record: _Record,
                 workers: list[asyncio.Task[None]]) -> None:
    """Await `waiting` unless a worker crashed or every request keeps failing; then raise."""
    task = asyncio.ensure_future(waiting)
    hopeless = asyncio.ensure_future(record.hopeless.wait())
    try:
        await asyncio.wait({task, hopeless, *workers}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hopeless.cancel()
        if not task.done():
            task.cancel()
    for worker in workers:
        if worker.done():
            worker.result()  # workers only end by raising: a bug, not a server failure
    if record.hopeless.is_set():
        raise MeasurementError(
            f"every request failed ({record.failures_in_a_row} in a row, no token in between); "
            f"last: {record.last_error}"
        ) from record.last_error


async def _drain(client: ServerClient) -> None:
    """Wait (bounded) until the server has no running or queued requests."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    values: dict[str, float] = {}
    running, queued = client.api.running, client.api.queued
    while time.monotonic() < deadline:
        with contextlib.suppress(ServerRequestError):
            values = await client.metrics()
            if values.get(running, 0.0) == 0 and values.get(queued, 0.0) == 0:
                return
        await asyncio.sleep(0.05)
    log.warning("%s still reports %g running and %g queued requests %g s after the cell",
                client.base_url, values.get(running, float("nan")),
                values.get(queued, float("nan")), DRAIN_TIMEOUT_S)


def _cell(dataset: str, batch: int, record: _Record, window: tuple[float, float], scale: float,
          repeats: int, api: ServerApi, before: dict[str, float],
          after: dict[str, float]) -> CellResult:
    start, end = window
    bounds = np.linspace(start, end, repeats + 1)
    per_repeat = np.zeros(repeats)
    for stream in record.streams:
        previous = 0
        for arrival, tokens in stream.chunks:
            if start <= arrival < end:
                slot = min(int(np.searchsorted(bounds, arrival, side="right")) - 1, repeats - 1)
                per_repeat[slot] += tokens - previous
            previous = tokens
    length = (end - start) * scale  # server seconds
    output_tokens = int(per_repeat.sum())
    completed = [s for s in record.streams
                 if s.finished and s.chunks and start <= s.chunks[-1][0] < end]
    ttft = [(s.chunks[0][0] - s.start) * scale for s in completed]
    tpot = [(s.chunks[-1][0] - s.chunks[0][0]) * scale / (s.chunks[-1][1] - 1)
            for s in completed if s.chunks[-1][1] > 1]
    return CellResult(
        dataset=dataset,
        batch=batch,
        output_tok_s=output_tokens / length,
        accept_length=_accept_length(api, before, after),
        requests=len(completed),
        output_tokens=output_tokens,
        duration_s=length,
        ttft=_percentiles(ttft),
        tpot=_percentiles(tpot),
        errors=sum(1 for t in record.errors if t < end),
        repeats=tuple(float(x) for x in per_repeat / (length / repeats)),
    )


def _accept_length(api: ServerApi, before: dict[str, float],
                   after: dict[str, float]) -> float | None:
    """Tokens per verify call over the window (bonus token included); None without
    speculation."""
    verify = after.get(api.verify_calls, 0.0) - before.get(api.verify_calls, 0.0)
    if verify <= 0:
        return None
    return (after.get(api.generated_tokens, 0.0) - before.get(api.generated_tokens, 0.0)) / verify


def _percentiles(values: Sequence[float]) -> Latency | None:
    if not values:
        return None
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return Latency(p50=float(p50), p90=float(p90), p99=float(p99))
