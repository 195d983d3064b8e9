"""An open loop: requests are sent on a schedule drawn beforehand (`arrival_times`),
whether or not the server keeps up, as users of a shared service send them. A server that
falls behind shows it in its latencies and in a completed-request rate below the asked
one, where a closed loop would only slow its own arrivals down."""

from __future__ import annotations

import asyncio
import time

from treetune.client import ServerClient
from treetune.loadgen._common import (
    Counters,
    MeasurementError,
    PromptSetLike,
    Record,
    cell_result,
    drain,
    heartbeat,
    metrics_or_none,
    send,
    stop,
    until,
)
from treetune.loadgen.arrivals import arrival_times
from treetune.results import CellResult, Slo


async def measure_open_cell(
    client: ServerClient,
    prompts: PromptSetLike,
    rate: float,
    *,
    duration_s: float,
    max_requests: int,
    arrival: str = "poisson",
    seed: int = 0,
    drain_s: float | None = None,
    repeats: int = 3,
    ignore_eos: bool = False,
    slo: Slo | None = None,
) -> CellResult:
    """Latencies, goodput (against `slo`), throughput and accept length of `prompts` sent
    at `rate` requests per server second, cycling over the prompts.

    Requests are sent for `duration_s` server seconds, at most `max_requests` of them, at
    the times `arrival_times(rate, ..., arrival, seed)` gives; those still running
    `drain_s` (default `duration_s`) after that are aborted and counted as `unfinished`.
    The window runs from the schedule's start until the last request ended, so the
    request rate achieved is the completed requests over that span. Goodput counts the
    requests meeting `slo` per second of the schedule (its requests over `rate`), the same
    span for every server: over the window, a server whose last request ended later
    would have less goodput for the same requests. Every request is measured: the
    schedule starts on an idle server, as a burst of traffic does.
    """
    if repeats < 1 or (drain_s is not None and drain_s < 0):
        raise ValueError(f"need repeats >= 1 and drain_s >= 0; got repeats={repeats}, "
                         f"drain_s={drain_s}")
    if not prompts.prompts:
        raise MeasurementError(f"dataset '{prompts.name}' has no prompts")
    times = arrival_times(rate, duration_s=duration_s, max_requests=max_requests,
                          arrival=arrival, seed=seed)
    scale = await client.time_scale()
    record = Record(workers=1)
    n = len(prompts.prompts)
    tasks: list[asyncio.Task[bool]] = []
    before = await client.metrics()
    start = time.monotonic()
    watch = asyncio.create_task(heartbeat(record))
    try:
        for i, at in enumerate(times):
            await until(asyncio.sleep(max(0.0, start + at / scale - time.monotonic())),
                        record, [])
            prompt = prompts.prompts[i % n]
            tasks.append(asyncio.create_task(send(client, prompt, prompts.new_tokens(prompt),
                                                  record, 0, ignore_eos or prompts.ignore_eos)))
        deadline = start + (duration_s + (duration_s if drain_s is None else drain_s)) / scale
        pending = {t for t in tasks if not t.done()}
        if pending:
            await until(asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic())),
                        record, [])
        end = time.monotonic()
        for task in tasks:
            if task.done():
                task.result()  # a sender only raises for a bug, not a server failure
        unfinished = sum(not t.done() for t in tasks)
        after = await client.metrics()
    finally:
        await stop([*tasks, watch])  # type: ignore[list-item]
    await drain(client)
    closed = await metrics_or_none(client)
    return cell_result(prompts.name, record, (start, end), scale, repeats, client.api,
                       Counters(before, after), rate=rate, arrival=arrival, slo=slo,
                       unfinished=unfinished,
                       whole=Counters(before, closed) if closed is not None else None)
