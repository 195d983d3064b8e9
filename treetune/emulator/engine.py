"""Continuous batching on an emulated GPU clock.

Requests join a running batch (up to --max-running-requests) after a prefill pass and
leave when done. Each decode round lasts the performance model's round time for the
current batch, scaled by the launch's speed factor and a slow drift; in a speculative
round every request gains a sampled number of accepted drafts plus the bonus token.
An adaptive server (SGLang's `--speculative-adaptive`) asks its schedule which chain to
draft for the running batch, round by round: the round costs and accepts what the static
chain of that length would, steps 0 is a plain decode round, and the accepted drafts go
back to the slot's controller.
The emulated clock runs `time_scale` times faster than the wall clock, on absolute
deadlines so that sleep granularity never accumulates. How late the event loop meets those
deadlines is the clock lag (`ClockLag`): the emulator reports it rather than pretend that a
busy CPU keeps its schedule.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from treetune.backends.sglang_adaptive import Schedule, switch_line
from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.emulator.metrics import ServerMetrics
from treetune.perfmodel import NoiseModel, PerfModel, Profile


class ClockLag:
    """How late the engine meets its emulated deadlines (a prefill's or a decode round's
    end), in emulated seconds: (wall time the loop got there - wall time it was due) x
    time_scale, 0 when on time. A late deadline delays every token of that round for the
    clients; it does not stretch the run (the next deadline is absolute), until the loop is
    late by more than rounds last. epoll waits in whole milliseconds, so even an idle
    machine shows 0.5-1 ms of wall time, times time_scale."""

    def __init__(self, metrics: ServerMetrics, window: int = 256) -> None:
        self._metrics = metrics
        self.recent: deque[float] = deque(maxlen=window)  # the last `window` deadlines
        self.worst = 0.0
        self.deadlines = 0

    def observe(self, late_s: float) -> None:
        self.recent.append(late_s)
        self.worst = max(self.worst, late_s)
        self.deadlines += 1
        self._metrics.clock_lag(late_s)

    def summary(self) -> dict[str, float]:
        """For /server_info: the last deadline's lag, the mean and max of the recent ones,
        the max since start, and how many deadlines were met."""
        recent = list(self.recent)
        return {
            "last_s": recent[-1] if recent else 0.0,
            "recent_mean_s": float(np.mean(recent)) if recent else 0.0,
            "recent_max_s": max(recent, default=0.0),
            "max_s": self.worst,
            "deadlines": self.deadlines,
        }


@dataclass
class Request:
    rid: str
    dataset: str
    prompt_tokens: int
    max_new_tokens: int
    stop_after: int  # tokens until the emulated EOS (or max_new_tokens)
    arrival: float  # emulated seconds
    generated: int = 0
    verify_ct: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    updates: asyncio.Queue[int] = field(default_factory=asyncio.Queue)

    @property
    def done(self) -> bool:
        return self.generated >= self.stop_after


class Engine:
    """The scheduler and clock of one emulated server."""

    def __init__(
        self,
        profile: Profile,
        config: TreeConfig | object,
        *,
        tp: int,
        max_running_requests: int,
        time_scale: float,
        noise: NoiseModel,
        rng: np.random.Generator,
        metrics: ServerMetrics,
        model: PerfModel | None = None,
        schedule: Schedule | None = None,
        log: Callable[[str], None] | None = None,
        pool_limited: bool = False,
    ) -> None:
        """`model`: the truth's timing and acceptance (a world's); the profile's own
        performance model by default. `schedule`: an adaptive server's controllers, which
        choose each round's chain (`config` is then the longest, for the prefill's draft
        pass). `log`: where the server's log lines go. `pool_limited`: the KV pool, not
        --max-running-requests, sets `max_running_requests` (SGLang then logs that its
        pool is full when requests wait)."""
        self.profile = profile
        self.config = config
        self.schedule = schedule
        self._log = log or (lambda line: None)
        self.model = model or PerfModel(profile, tp)
        self.max_running = max_running_requests
        self.pool_limited = pool_limited
        self._pool_full = False  # requests wait on a full pool (said once until they do not)
        self.time_scale = time_scale
        self.rng = rng
        self.metrics = metrics
        # Of step time: the launch noise, and a world's slow launch (of speed).
        self.launch_factor = noise.launch_factor(rng) / self.model.launch_speed(rng)
        self.drift = noise.drift(rng)
        self.speculative = isinstance(config, TreeConfig)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._wake = asyncio.Event()
        self._ids = itertools.count()
        self._wall0: float | None = None
        self.clock = 0.0  # emulated seconds since start
        self.lag = ClockLag(metrics)
        # Totals since start, and since the last /flush_cache (for the cumulative average).
        self.completion_tokens = 0
        self.verify_calls = 0
        self.flushed_tokens = 0
        self.flushed_verify = 0
        self.last_gen_throughput = 0.0
        self.rounds = 0

    # ---- time -------------------------------------------------------------------------
    def _loop_time(self) -> float:
        return asyncio.get_running_loop().time()

    def now(self) -> float:
        """Emulated seconds since the engine started."""
        if self._wall0 is None:
            return 0.0
        return (self._loop_time() - self._wall0) * self.time_scale

    async def _sleep_until(self, emulated: float) -> None:
        assert self._wall0 is not None
        due = self._wall0 + emulated / self.time_scale
        delay = due - self._loop_time()
        if delay > 0:
            await asyncio.sleep(delay)
        self.lag.observe(max(0.0, self._loop_time() - due) * self.time_scale)

    def _arrival(self) -> float:
        """When a request arriving now arrives on the emulated clock. While requests run,
        the clock is the end of the pass the engine waits on; an engine running late is
        behind the wall clock and sees the request no sooner than that pass ends, so the
        request arrives then. Stamping the wall's time would put the arrival after its
        first token (a negative TTFT in /metrics). Otherwise the clock is stale (idle time
        passes on the next wake-up) and the wall's time is the arrival."""
        return min(self.now(), self.clock) if self.running else self.now()

    # ---- requests ---------------------------------------------------------------------
    def new_request(
        self, dataset: str, prompt_tokens: int, max_new_tokens: int, ignore_eos: bool
    ) -> Request:
        data = self.profile.dataset(dataset)
        if ignore_eos:
            stop = max_new_tokens
        else:
            # Natural lengths vary around the workload's mean output length.
            sigma = 0.5
            length = data.output_tokens * math.exp(self.rng.normal(-sigma * sigma / 2, sigma))
            stop = max(1, min(max_new_tokens, round(length)))
        req = Request(f"{next(self._ids):08x}", dataset, max(prompt_tokens, 1),
                      max_new_tokens, max(stop, 1), self._arrival())
        if max_new_tokens <= 0:
            req.stop_after = 0
        self.waiting.append(req)
        self.metrics.queue(len(self.waiting))
        self._wake.set()
        return req

    def cancel(self, req: Request) -> None:
        """A client went away: drop its request wherever it is (it ends as aborted, and is
        counted as it stands)."""
        if req in self.waiting:
            self.waiting.remove(req)
            self.metrics.queue(len(self.waiting))
            self._count(req)
        if req in self.running:
            self.running.remove(req)
            self.metrics.running(len(self.running), self._token_usage())
            self._count(req)

    def _count(self, req: Request) -> None:
        """A request's tokens and verify calls, added to the Prometheus counters as it
        ends: SGLang counts them per finished request (`observe_one_finished_request`),
        not per round, so a window's counters hold only the requests that ended in it."""
        self.metrics.finished(req.prompt_tokens, req.generated,
                              req.verify_ct if self.speculative else 0)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def flush(self) -> None:
        self.flushed_tokens = self.completion_tokens
        self.flushed_verify = self.verify_calls

    @property
    def avg_accept_length(self) -> float:
        verify = self.verify_calls - self.flushed_verify
        if verify == 0:
            return 0.0
        return (self.completion_tokens - self.flushed_tokens) / verify

    # ---- the loop ---------------------------------------------------------------------
    async def run(self) -> None:
        self._wall0 = self._loop_time()
        while True:
            if self.idle:
                self._wake.clear()
                await self._wake.wait()
                self.clock = max(self.clock, self.now())  # idle time passes
                continue
            # While busy the clock advances only by modelled time, so a late wake-up is
            # caught up on the next deadline instead of stretching the run.
            admitted = self._admit()
            if admitted:
                await self._prefill(admitted)
            elif self.running:
                await self._decode_round()
            else:
                await asyncio.sleep(0)

    def _admit(self) -> list[Request]:
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting.popleft()
            self.running.append(req)
            admitted.append(req)
        self.metrics.queue(len(self.waiting))
        full = self.pool_limited and bool(self.waiting)
        if full and not self._pool_full:  # SGLang's words as its pool runs full
            self._log(f"KV cache pool is full. Retract requests. (emulated: the pool holds "
                      f"{self.max_running} running requests, {len(self.waiting)} wait)")
        self._pool_full = full
        return admitted

    def _speed(self, seconds: float) -> float:
        return seconds * self.launch_factor * self.drift.advance(seconds)

    async def _prefill(self, batch: list[Request]) -> None:
        """One extend pass over the new prompts; it yields each request's first token."""
        seconds = 0.0
        for dataset, group in _by_dataset(batch).items():
            prompt = float(np.mean([r.prompt_tokens for r in group]))
            seconds += self.model.prefill_time(self.config, len(group), prompt, dataset)
        self.clock += self._speed(seconds)
        await self._sleep_until(self.clock)
        for req in batch:
            if req.stop_after > 0:
                self._emit(req, 1)
            req.first_token_at = self.clock
            self.metrics.ttft(self.clock - req.arrival)
        self._retire()

    def round_config(self, size: int) -> ServerConfig:
        """What a decode round of `size` running requests drafts: the static tree, or the
        chain its adaptive slot runs now (steps 0: no drafting)."""
        if self.schedule is None:
            return self.config
        steps = self.schedule.steps_for(size)
        return TreeConfig.of(steps, 1, steps + 1) if steps else BASELINE

    async def _decode_round(self) -> None:
        batch = list(self.running)
        size = len(batch)
        config = self.round_config(size)
        groups = _by_dataset(batch)
        seconds = sum(
            len(group) / size * self.model.round_time(config, size, dataset).total_s
            for dataset, group in groups.items()
        )
        seconds = self._speed(seconds)
        drafts: dict[str, int] = {}
        for dataset, group in groups.items():
            accepted = self.model.sample_accepted(config, dataset, self.rng, len(group))
            for req, acc in zip(group, accepted, strict=True):
                drafts[req.rid] = int(acc)
        self.clock += seconds
        await self._sleep_until(self.clock)
        produced = 0
        verified = 0  # requests still running when the round ends
        for req in batch:
            if req not in self.running:
                continue  # cancelled while the round ran
            gained = min(drafts[req.rid] + 1, req.stop_after - req.generated)
            verified += 1
            if self.speculative:
                req.verify_ct += 1
                self.verify_calls += 1
            self._emit(req, gained)
            produced += gained
            self.metrics.itl(seconds / max(gained, 1))
        self.rounds += 1
        self.last_gen_throughput = produced / seconds if seconds > 0 else 0.0
        self.metrics.round(
            running=len(self.running),
            gen_throughput=self.last_gen_throughput,
            accept_length=produced / verified if self.speculative and verified else None,
            steps=config.steps if isinstance(config, TreeConfig) else None,
            token_usage=self._token_usage(),
        )
        if self.schedule is not None:
            self._adapt(size, [drafts[r.rid] for r in batch if r in self.running])
        self._retire()

    def _adapt(self, size: int, drafts: list[int]) -> None:
        """Feed one verify's accepted drafts per request to the slot that served it."""
        assert self.schedule is not None
        slot = self.schedule.slots[self.schedule.slot_key(size)]
        old = slot.steps
        if self.schedule.verified(size, drafts):
            self._log(switch_line(old, slot.steps, slot.ema))

    def _emit(self, req: Request, tokens: int) -> None:
        req.generated += tokens
        self.completion_tokens += tokens
        req.updates.put_nowait(req.generated)

    def _retire(self) -> None:
        for req in [r for r in self.running if r.done]:
            self.running.remove(req)
            req.finished_at = self.clock
            self.metrics.e2e(self.clock - req.arrival)
            self._count(req)
            req.updates.put_nowait(-1)  # end of stream
        self.metrics.running(len(self.running), self._token_usage())

    def _token_usage(self) -> float:
        pool = self.profile.server.reserve_context_tokens * self.max_running
        used = sum(r.prompt_tokens + r.generated for r in self.running)
        return min(1.0, used / pool) if pool else 0.0


def _by_dataset(requests: list[Request]) -> dict[str, list[Request]]:
    groups: dict[str, list[Request]] = {}
    for req in requests:
        groups.setdefault(req.dataset, []).append(req)
    return groups
