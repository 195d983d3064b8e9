"""What the closed and the open loop share: recording streams, failing fast when nothing
works, reading the server's counters around a cell, and turning what was seen into a
`CellResult`. Every time in a result is in server time: wall seconds times the server's
time scale (the emulator's `--time-scale`, 1 on SGLang)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from treetune.backends import ServerApi
from treetune.client import ServerClient, ServerRequestError
from treetune.errors import TreetuneError, clip
from treetune.loadgen.latency import request_latency, summarize
from treetune.results import CellResult, Slo

if TYPE_CHECKING:
    from treetune.datasets import Prompt

log = logging.getLogger(__name__)

MIN_FAILURES = 5  # failed requests in a row that end a cell, at least
DRAIN_TIMEOUT_S = 30.0  # wall seconds to wait for the server to finish aborted requests
# Wall seconds of unmoving gauges and counters that count as drained: longer than SGLang
# takes between two reports of its running gauge while it decodes (every 40 decode steps).
DRAIN_QUIET_S = 5.0
HEARTBEAT_S = 0.01  # wall seconds between the load generator's checks of its own timers
# Wall seconds: a token stamped just after a late heartbeat, in the same pass of the event
# loop, was stamped at the end of the stall that beat saw.
STAMP_SLACK_S = 0.002


class PromptSetLike(Protocol):
    """What a cell needs of `treetune.datasets.PromptSet`."""

    name: str
    prompts: list[Prompt]
    max_new_tokens: int
    ignore_eos: bool  # every answer runs to the tokens asked for (a fixed-length workload)

    def new_tokens(self, prompt: Prompt) -> int:
        """How many tokens to ask for `prompt`."""


class MeasurementError(TreetuneError):
    """A cell that could not be measured: every request failed, or the server is gone."""


@dataclass
class Stream:
    """One request's arrivals: start and (time, cumulative tokens) per chunk, wall clock."""

    start: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    finished: bool = False


@dataclass
class Record:
    """What the senders saw; read once the cell has ended. `workers`: how many senders
    keep a request in flight (1 for an open loop, whose requests are not kept)."""

    workers: int
    streams: list[Stream] = field(default_factory=list)
    # Failed requests: the wall time of each, and its error.
    errors: list[tuple[float, BaseException]] = field(default_factory=list)
    failures_in_a_row: int = 0
    started: set[int] = field(default_factory=set)  # workers that received a token
    all_started: asyncio.Event = field(default_factory=asyncio.Event)
    hopeless: asyncio.Event = field(default_factory=asyncio.Event)
    beats: list[tuple[float, float]] = field(default_factory=list)  # (wall time, lateness)

    def first_token(self, worker: int) -> None:
        self.failures_in_a_row = 0
        if worker not in self.started:
            self.started.add(worker)
            if len(self.started) == self.workers:
                self.all_started.set()

    @property
    def last_error(self) -> BaseException | None:
        return self.errors[-1][1] if self.errors else None

    def failure(self, exc: BaseException) -> None:
        self.errors.append((time.monotonic(), exc))
        self.failures_in_a_row += 1
        # Every worker's last requests failed with no token in between: nothing works.
        if self.failures_in_a_row >= max(2 * self.workers, MIN_FAILURES):
            self.hopeless.set()


async def send(client: ServerClient, prompt: Prompt, max_new_tokens: int, record: Record,
               worker: int, ignore_eos: bool) -> bool:
    """Stream one request into `record`; False if it failed (recorded as a failure)."""
    stream = Stream(start=time.monotonic())
    record.streams.append(stream)
    try:
        chunks = client.stream(prompt, max_new_tokens, ignore_eos=ignore_eos)
        async with contextlib.aclosing(chunks):  # type: ignore[type-var]
            async for arrival, tokens in chunks:
                if not stream.chunks:
                    record.first_token(worker)
                stream.chunks.append((arrival, tokens))
        stream.finished = True
        return True
    except (ServerRequestError, OSError, ValueError) as exc:
        record.failure(exc)
        return False


async def heartbeat(record: Record) -> None:
    """Note, until cancelled, how late this event loop runs its own timers
    (`Record.beats`). A starved load generator sends late and stamps arrivals late, and
    its sub-windows then count tokens in bursts, whatever the server's own clock did."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + HEARTBEAT_S
        await asyncio.sleep(HEARTBEAT_S)
        now = loop.time()
        record.beats.append((now, max(0.0, now - due)))


async def until(waiting: Awaitable[object], record: Record,
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


async def stop(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the senders (closing a stream aborts its request server-side)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def drain(client: ServerClient, quiet_s: float = DRAIN_QUIET_S) -> None:
    """Wait (bounded) until the server has no running or queued requests, or until its
    gauges and counters have not moved for `quiet_s`: SGLang may hold the running gauge at
    the last batch's size for up to 30 s after its scheduler went idle (its idle-time
    report is rate-limited), and waiting that out after every cell wasted minutes a
    launch."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    values: dict[str, float] = {}
    api = client.api
    watched = (api.running, api.queued, api.generated_tokens, api.verify_calls,
               *([api.prompt_tokens] if api.prompt_tokens else []))
    seen: tuple[float | None, ...] | None = None
    still_since = time.monotonic()
    while time.monotonic() < deadline:
        with contextlib.suppress(ServerRequestError):
            values = await client.metrics()
            if values.get(api.running, 0.0) == 0 and values.get(api.queued, 0.0) == 0:
                return
            now = tuple(values.get(name) for name in watched)  # None: not reported
            if now != seen:
                seen, still_since = now, time.monotonic()
            elif values.get(api.queued, 0.0) == 0 and time.monotonic() - still_since >= quiet_s:
                return  # a queue still standing is never taken for a frozen gauge
        await asyncio.sleep(0.05)
    log.warning("%s still reports %g running and %g queued requests %g s after the cell",
                client.base_url, values.get(api.running, float("nan")),
                values.get(api.queued, float("nan")), DRAIN_TIMEOUT_S)


async def metrics_or_none(client: ServerClient) -> dict[str, float] | None:
    """The server's metrics, None if it does not answer: the whole cell's counters are
    read before its first request and after it drained, and a server that died then
    leaves the window's to stand in (or the cell's own failure to say what went wrong)."""
    try:
        return await client.metrics()
    except ServerRequestError:
        return None


@dataclass(frozen=True)
class Counters:
    """The server's metrics when the window opened and when it closed."""

    before: dict[str, float]
    after: dict[str, float]

    def delta(self, name: str) -> float:
        return self.after.get(name, 0.0) - self.before.get(name, 0.0)


def cell_result(dataset: str, record: Record, window: tuple[float, float], scale: float,
                repeats: int, api: ServerApi, counters: Counters, *, batch: int = 0,
                rate: float | None = None, arrival: str = "", slo: Slo | None = None,
                unfinished: int = 0, whole: Counters | None = None) -> CellResult:
    """The cell's throughput (whole window and `repeats` sub-windows), latencies and
    goodput of the requests completed inside the window, and clock lag (`counters`: the
    window's); its accept length from `whole` (from before its first request until it
    drained), else the window's. Goodput counts per second of the window, a rate cell's
    per second of its schedule (its requests sent over its rate), the same for every
    server (its window ends with its last request, later on a slower one). SGLang counts
    a request's tokens and verify calls when it ends: a window's counters hold only the
    requests that ended in it, none at all in a window shorter than one answer, while the
    whole cell's hold every request it sent that ended."""
    start, end = window
    bounds = np.linspace(start, end, repeats + 1)
    per_repeat = np.zeros(repeats)
    for stream in record.streams:
        previous = 0
        for arrival_time, tokens in stream.chunks:
            if start <= arrival_time < end:
                slot = min(int(np.searchsorted(bounds, arrival_time, side="right")) - 1,
                           repeats - 1)
                per_repeat[slot] += tokens - previous
            previous = tokens
    length = (end - start) * scale  # server seconds
    output_tokens = int(per_repeat.sum())
    ended = [s for s in record.streams
             if s.finished and s.chunks and start <= s.chunks[-1][0] < end]
    schedule = len(record.streams) / rate if rate and record.streams else length
    latency = summarize([request_latency(s.start, s.chunks, scale) for s in ended],
                        schedule, slo)
    return CellResult(
        dataset=dataset,
        batch=batch,
        output_tok_s=output_tokens / length,
        accept_length=accept_length(api, whole or counters),
        requests=len(ended),
        output_tokens=output_tokens,
        duration_s=length,
        ttft=latency.ttft,
        tpot=latency.tpot,
        errors=len(failed := [exc for t, exc in record.errors if t < end]),
        error=first_line(failed[-1]) if failed else "",
        repeats=tuple(float(x) for x in per_repeat / (length / repeats)),
        rate=rate,
        arrival=arrival,
        request_rate=len(ended) / length,
        itl=latency.itl,
        e2e=latency.e2e,
        slo=slo if slo is not None and slo.bounded else None,
        goodput=latency.goodput,
        unfinished=unfinished,
        clock_lag_s=clock_lag(api, counters),
        client_lag_s=client_lag(record, window, scale, ended),
    )


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An error's message on one line, at most `limit` characters."""
    return clip(" ".join(str(exc).split()) or type(exc).__name__, limit)


def accept_length(api: ServerApi, counters: Counters) -> float | None:
    """Tokens per verify call over the window (bonus token included); None without
    speculation."""
    verify = counters.delta(api.verify_calls)
    if verify <= 0:
        return None
    return counters.delta(api.generated_tokens) / verify


def clock_lag(api: ServerApi, counters: Counters) -> float | None:
    """How late the server met its clock's deadlines during the window, on average, in
    server seconds: None for a server on a real clock, 0 if it met none."""
    if api.clock_lag is None:
        return None
    deadlines = counters.delta(f"{api.clock_lag}_count")
    return counters.delta(f"{api.clock_lag}_sum") / deadlines if deadlines > 0 else 0.0


def client_lag(record: Record, window: tuple[float, float], scale: float,
               ended: Sequence[Stream] = ()) -> float | None:
    """How late the load generator ran during the window, in server seconds: its own
    timers on average, or, if later, the stall its median request of `ended` (those
    completed in the window) may hold in its latencies (`stamp_stall`). One stall as many
    requests end (a closed loop's requests of one length end together) moves their median
    latency, yet hardly the mean over the window's timers: 80 ms of wall time in 1.5 s
    moved a cell's median TPOT 6.5% and its mean lateness 0.7 ms. None when it kept no
    heartbeat."""
    start, end = window
    late = [lateness for at, lateness in record.beats if start <= at < end]
    if not late:
        return None
    ats = [at for at, _ in record.beats]
    stalls = [stamp_stall(record.beats, ats, stream) for stream in ended]
    return max(float(np.mean(late)), float(np.median(stalls)) if stalls else 0.0) * scale


def stamp_stall(beats: Sequence[tuple[float, float]], ats: Sequence[float],
                stream: Stream) -> float:
    """The longest stall of the load generator's event loop that a completed request's
    latencies may hold, wall seconds. A heartbeat L late shows that the loop ran nothing
    for the L before it fired: a token that arrived then was stamped when it ended. So a
    stall counts when it began as the request was being sent (delaying it), or ended at
    its first or its last token's stamp; one in between only delays what came between
    (a queue's wait, tokens in the middle), and neither its TTFT's stamps nor its TPOT's.
    `ats`: the beats' times."""

    def worst(lo: float, hi: float, slack: float) -> float:
        """The longest stall seen by a beat whose stalled span [at - L, at] meets
        [lo, hi], or ended within `slack` before lo (spans follow one another: each beat
        is due HEARTBEAT_S after the last fired)."""
        longest = 0.0
        for i in range(bisect.bisect_left(ats, lo - slack), len(beats)):
            at, lateness = beats[i]
            if at - lateness > hi:
                break
            longest = max(longest, lateness)
        return longest

    first, last = stream.chunks[0][0], stream.chunks[-1][0]
    # Sent in the pass that stamped its start (a stall that ended before it did not
    # delay it); its first and last tokens stamped when a stall ended, maybe just after.
    return max(worst(stream.start, min(stream.start + HEARTBEAT_S, first), 0.0),
               worst(first, first, STAMP_SLACK_S), worst(last, last, STAMP_SLACK_S))
