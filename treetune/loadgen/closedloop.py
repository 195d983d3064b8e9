"""A closed loop: `batch` workers each keep one streaming request in flight, so the server
runs `batch` requests at all times, as a benchmark at fixed concurrency does."""

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
from treetune.results import CellResult, Slo

SETTLE_S = 1.0  # server seconds after every worker's first token before the window opens
ERROR_BACKOFF_S = 0.05  # wall seconds a worker waits after a failed request


async def measure_cell(
    client: ServerClient,
    prompts: PromptSetLike,
    batch: int,
    *,
    duration_s: float,
    warmup_s: float | None = None,
    repeats: int = 3,
    ignore_eos: bool = False,
    slo: Slo | None = None,
) -> CellResult:
    """Throughput, accept length and latencies of `prompts` at concurrency `batch`.

    `duration_s` and `warmup_s` are server seconds. Without `warmup_s`, the window opens
    once every worker has received a token, plus SETTLE_S. The window is split into
    `repeats` equal sub-windows whose throughputs give a spread. Latencies and goodput
    (against `slo`) are those of the requests completed inside the window. `errors` counts
    requests that failed before the window closed; if every request keeps failing, or the
    server has no `/metrics`, raises instead. `ignore_eos` (or the set's own) makes every
    request generate exactly what it asks for (`prompts.new_tokens`).
    """
    if batch < 1 or repeats < 1 or duration_s <= 0:
        raise ValueError(f"need batch >= 1, repeats >= 1 and duration_s > 0; got batch={batch}, "
                         f"repeats={repeats}, duration_s={duration_s}")
    if not prompts.prompts:
        raise MeasurementError(f"dataset '{prompts.name}' has no prompts")
    scale = await client.time_scale()
    opened = await metrics_or_none(client)  # the accept length's span: the whole cell
    record = Record(workers=batch)
    offsets = [i * len(prompts.prompts) // batch for i in range(batch)]
    tasks = [
        asyncio.create_task(_worker(client, prompts, i, offsets[i], record,
                                    ignore_eos or prompts.ignore_eos))
        for i in range(batch)
    ]
    tasks.append(asyncio.create_task(heartbeat(record)))
    try:
        if warmup_s is None:
            await until(record.all_started.wait(), record, tasks)
            await until(asyncio.sleep(SETTLE_S / scale), record, tasks)
        else:
            await until(asyncio.sleep(warmup_s / scale), record, tasks)
        before = await client.metrics()
        start = time.monotonic()
        await until(asyncio.sleep(duration_s / scale), record, tasks)
        end = time.monotonic()
        after = await client.metrics()
    finally:
        await stop(tasks)
    await drain(client)
    closed = await metrics_or_none(client)
    return cell_result(prompts.name, record, (start, end), scale, repeats, client.api,
                       Counters(before, after), batch=batch, slo=slo,
                       whole=Counters(opened, closed)
                       if opened is not None and closed is not None else None)


async def _worker(client: ServerClient, prompts: PromptSetLike, index: int, offset: int,
                  record: Record, ignore_eos: bool) -> None:
    """Send one request at a time, cycling over the prompts from `offset`."""
    n = len(prompts.prompts)
    i = offset
    while True:
        prompt = prompts.prompts[i % n]
        i += 1
        if not await send(client, prompt, prompts.new_tokens(prompt), record, index,
                          ignore_eos):
            await asyncio.sleep(ERROR_BACKOFF_S)
