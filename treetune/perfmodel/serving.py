"""Whole requests under load: what a serving benchmark measures, where
`PerfModel.throughput` is the decode round alone.

The model follows the emulator's scheduler (treetune/emulator/engine.py), which follows
SGLang's in outline:
- before a decode round, the waiting requests are admitted (up to max_running_requests) and
  prefilled in one extend pass (not chunked) that yields their first tokens and stalls every
  running request while it runs;
- a round gains each running request its accepted drafts plus the bonus token, capped at
  what it still needs, and a request leaves at the end of the round that completes it;
- a closed-loop client's next request reaches the server during the pass after that round
  (a client answers faster than a pass lasts), so the slot stays empty for one round,
  unless the requests that finished one round earlier are still to be prefilled: then both
  groups are prefilled back to back and no round runs short. When every running request has
  left, the first successor finds the server idle and is prefilled alone, the others during
  that prefill;
- an open loop's requests arrive on their own (Poisson); those arriving during a pass are
  prefilled together after it, and a server that cannot keep up queues them.

What is random enters as expectations: the rounds a request needs come from the exact
distribution of accepted drafts per round; how many requests finish in the same round
comes from their phases. A speculating server's requests need a varying number of rounds, so
their phases spread and they finish independently, each in a given round with chance one in
its expected rounds (the long-run state: a closed loop's requests start together and take
many requests to spread out). A baseline's requests of one length, started together,
finish together for ever: one cohort. An open loop's arrivals spread them for both.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from treetune.config import ServerConfig


class _Duration(Protocol):
    total_s: float


class ServingModel(Protocol):
    """What whole requests need of `treetune.perfmodel.predict.PerfModel` (a protocol, so
    that the model imports this module and not the other way round)."""

    def round_time(self, config: ServerConfig, batch: float, dataset: str) -> _Duration: ...

    def gains_distribution(self, config: ServerConfig, dataset: str) -> np.ndarray: ...

    def prefill_time(self, config: ServerConfig, requests: float, prompt_tokens: float,
                     dataset: str) -> float: ...

OPEN_LOOP_ITERATIONS = 200  # fixed-point steps for an open loop's mean running batch
PREFILL_CHAIN_DEPTH = 3  # prefills of the arrivals during prefills, followed this deep


@dataclass(frozen=True)
class Shape:
    """The request shape of a workload: prompt tokens and output tokens per request."""

    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def __str__(self) -> str:
        return f"{self.prompt_tokens} in / {self.output_tokens} out"


@dataclass(frozen=True)
class Serving:
    """What a benchmark cell measures of one server under one load, noise-free; seconds.

    `tpot_s`: time per output token after the first, (end-to-end - TTFT) / (output - 1),
    the same for every request in expectation and so also its median. `ttft_s`: median
    time to first token (closed loop), mean (open loop). `running`: mean batch of the
    decode rounds. `saturated`: an open loop whose requests arrive faster than the server
    completes them: it delivers what a full server does (`output_tok_s`, `tpot_s`) while
    its queue, and TTFT, grow for as long as the load lasts (infinite here).
    """

    output_tok_s: float
    request_rate: float
    tpot_s: float
    ttft_s: float
    running: float
    saturated: bool = False


def rounds_needed(gains: np.ndarray, tokens: int) -> float:
    """Expected decode rounds until a request has `tokens` more tokens, when a round gains
    it `k` tokens with probability gains[k] and its last round is cut at what it needs."""
    if tokens <= 0:
        return 0.0
    expected = np.zeros(tokens + 1)  # expected[t]: rounds to gain t more tokens
    ks = [int(k) for k in np.nonzero(gains)[0]]
    for t in range(1, tokens + 1):
        expected[t] = 1.0 + sum(gains[k] * expected[max(t - k, 0)] for k in ks)
    return float(expected[tokens])


class _Costs:
    """One server's pass durations for one dataset and shape, memoized by batch."""

    def __init__(self, model: ServingModel, config: ServerConfig, dataset: str,
                 shape: Shape) -> None:
        self._model, self._config, self._dataset, self._shape = model, config, dataset, shape
        self._rounds: dict[int, float] = {}
        self._prefills: dict[int, float] = {}

    def round(self, batch: int) -> float:
        """A decode round of `batch` requests; none (an idle server) takes no time."""
        if batch <= 0:
            return 0.0
        if batch not in self._rounds:
            self._rounds[batch] = self._model.round_time(
                self._config, batch, self._dataset).total_s
        return self._rounds[batch]

    def prefill(self, requests: int) -> float:
        if requests <= 0:
            return 0.0
        if requests not in self._prefills:
            self._prefills[requests] = self._model.prefill_time(
                self._config, requests, self._shape.prompt_tokens, self._dataset)
        return self._prefills[requests]

    def restart(self, requests: int) -> tuple[float, float]:
        """Prefilling `requests` successors that find the server idle: the first alone,
        the others (which arrive meanwhile) after it. Its duration, and the median TTFT."""
        first, rest = self.prefill(1), self.prefill(requests - 1)
        return first + rest, first + rest if requests > 2 else first


class _Server:
    """The costs and round counts of one config serving one dataset and shape."""

    def __init__(self, model: ServingModel, config: ServerConfig, dataset: str,
                 shape: Shape) -> None:
        gains = model.gains_distribution(config, dataset)
        self.shape = shape
        self.costs = _Costs(model, config, dataset, shape)
        self.rounds = rounds_needed(gains, shape.output_tokens - 1)
        ks = np.arange(len(gains))
        mean = float(np.dot(ks, gains))
        self.lockstep = float(np.dot((ks - mean) ** 2, gains)) == 0.0  # rounds never vary

    def per_token(self, decode_s: float) -> float:
        return decode_s / max(self.shape.output_tokens - 1, 1)

    def serving(self, requests_per_s: float, decode_s: float, ttft_s: float,
                running: float, saturated: bool = False) -> Serving:
        return Serving(float(requests_per_s * self.shape.output_tokens),
                       float(requests_per_s), float(self.per_token(decode_s)), float(ttft_s),
                       float(running), saturated)


def closed_loop(model: ServingModel, config: ServerConfig, dataset: str, shape: Shape,
                concurrency: int, max_running: int | None = None) -> Serving:
    """`concurrency` clients, each sending its next request when its last one ends; the
    server runs at most `max_running` of them (default: all)."""
    server = _Server(model, config, dataset, shape)
    slots = min(concurrency, max_running or concurrency)
    costs = server.costs
    if server.rounds == 0:  # one-token answers: prefills only
        rate = slots / costs.prefill(slots)
        serving = server.serving(rate, 0.0, costs.prefill(slots), 0.0)
    elif server.lockstep:
        serving = _one_cohort(server, slots)
    elif concurrency > slots:
        serving = _full(server, slots)
    else:
        serving = _independent(server, slots)
    if concurrency > slots:  # Little: the requests beyond the slots wait in the queue
        wait = (concurrency - slots) / serving.request_rate
        serving = dataclasses.replace(serving, ttft_s=serving.ttft_s + wait)
    return serving


def open_loop(model: ServingModel, config: ServerConfig, dataset: str, shape: Shape,
              rate: float, max_running: int) -> Serving:
    """Requests arriving at `rate` per second (Poisson), at most `max_running` at once."""
    if rate <= 0 or max_running < 1:
        raise ValueError(f"need rate > 0 and max_running >= 1, got {rate}, {max_running}")
    server = _Server(model, config, dataset, shape)
    costs = server.costs
    full = _full(server, max_running)
    if rate >= full.request_rate:
        return dataclasses.replace(full, ttft_s=math.inf, saturated=True)

    chained: dict[tuple[float, int], float] = {}

    def chain(seconds: float, depth: int = PREFILL_CHAIN_DEPTH) -> float:
        """Expected prefill time after a pass of `seconds`: the arrivals during it, then
        those during that prefill, and so on (memoized: the passes are few distinct ones)."""
        if depth == 0 or seconds <= 0:
            return 0.0
        if (seconds, depth) not in chained:
            counts, weights = _poisson(rate * seconds, max_running)
            chained[seconds, depth] = float(sum(
                w * (costs.prefill(g) + chain(costs.prefill(g), depth - 1))
                for g, w in zip(counts, weights, strict=True) if g > 0))
        return chained[seconds, depth]

    def step(others: float) -> tuple[float, float]:
        """A running request's mean round with the prefills after it, and its mean batch,
        when the others in their decode rounds number Poisson(`others`) (M/G/infinity)."""
        counts, weights = _poisson(others, max_running - 1)
        seconds = sum(w * (costs.round(b + 1) + chain(costs.round(b + 1)))
                      for b, w in zip(counts, weights, strict=True))
        return float(seconds), float(np.dot(counts + 1, weights))

    others, (seconds, batch) = 0.0, step(0.0)
    for _ in range(OPEN_LOOP_ITERATIONS):
        updated = rate * server.rounds * seconds  # Little: requests in their decode rounds
        converged = abs(updated - others) < 1e-9 * max(1.0, updated)
        others = updated
        seconds, batch = step(others)
        if converged:
            break
    # An arrival finds the server idle, or waits for the pass under way (half of it), then
    # its own prefill with the others that arrived meanwhile. When the others hold every
    # slot it also waits for one, which a full server frees at its completion rate.
    round_s = costs.round(max(1, round(batch)))
    busy = min(1.0, 1.0 - math.exp(-others) + rate * costs.prefill(1))
    counts, weights = _poisson(rate * round_s, max_running - 1)
    own = float(np.dot(weights, [costs.prefill(g + 1) for g in counts]))
    from scipy import stats  # see _binom_pmf

    queue = float(stats.poisson.sf(max_running - 1, others)) / (full.request_rate - rate)
    return server.serving(rate, server.rounds * seconds,
                          busy * round_s / 2 + own + queue, batch)


def _one_cohort(server: _Server, slots: int) -> Serving:
    """Requests that started together and need as many rounds leave together; their
    successors find the server idle, and the rounds between run full."""
    costs = server.costs
    decode = server.rounds * costs.round(slots)
    restart, ttft = costs.restart(slots)
    return server.serving(slots / (restart + decode), decode, ttft, float(slots))


def _full(server: _Server, slots: int) -> Serving:
    """Every slot busy and a queue behind them: each round runs full, then the requests
    that finished in it are replaced from the queue in one prefill. Requests in any phase
    (independent): each finishes in a round with chance one in its rounds."""
    costs = server.costs
    finish = _binom_pmf(slots, 1.0 / server.rounds)
    step = costs.round(slots) + sum(finish[g] * costs.prefill(g) for g in range(1, slots + 1))
    ttft = _median([(costs.prefill(g), finish[g] * g) for g in range(1, slots + 1)])
    return server.serving(slots / server.rounds / step, server.rounds * step, ttft,
                          float(slots))


def _independent(server: _Server, slots: int) -> Serving:
    """A closed loop of requests in independent phases, as a Markov chain over rounds:

        full round --g finish--> round short of g --> prefill(g) [+ prefill(f) if f
        finished in the short round] --> full round

    (a short round of none running is the idle server: `_Costs.restart`). Each running
    request finishes in a round with chance one in its rounds.
    """
    costs, hazard = server.costs, 1.0 / server.rounds
    finish = _binom_pmf(slots, hazard)
    full = 1.0 / (2.0 - finish[0])  # stationary share of full rounds
    seconds = full * costs.round(slots)  # per round, prefills included
    running = full * slots  # request-rounds per round
    seen = running * costs.round(slots)  # seconds per round as the running requests see it
    ttfts: list[tuple[float, float]] = []
    for g in range(1, slots + 1):
        short = full * finish[g]  # share of rounds short of g requests
        if g == slots:
            restart, ttft = costs.restart(g)
            seconds += short * restart
            ttfts.append((ttft, short * g))
            continue
        after = _binom_pmf(slots - g, hazard)
        chained = sum(after[f] * costs.prefill(f) for f in range(1, slots - g + 1))
        pass_s = costs.round(slots - g) + costs.prefill(g) + chained
        seconds += short * pass_s
        running += short * (slots - g)
        seen += short * (slots - g) * pass_s
        ttfts.append((costs.round(slots - g) + costs.prefill(g), short * g))
        ttfts += [(costs.prefill(g) + costs.prefill(f), short * after[f] * f)
                  for f in range(1, slots - g + 1)]
    # A request sees the rounds it runs in, each with the prefills after it.
    return server.serving(running * hazard / seconds, server.rounds * seen / running,
                          _median(ttfts), running)


def _binom_pmf(n: int, p: float) -> np.ndarray:
    """Binomial(n, p) probabilities of 0..n. scipy.stats is imported where it is used: it
    takes most of a second, and every emulated server imports this module (with the rest
    of the performance model) but never calls it, so each launch would pay for it."""
    from scipy import stats

    return stats.binom.pmf(np.arange(n + 1), n, p)


POISSON_REACH = 12  # standard deviations of a Poisson count kept (`_poisson`)
POISSON_MARGIN = 30  # counts kept beyond that, for small means


def _poisson(mean: float, most: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts 0..most and their Poisson(mean) probabilities, the tail folded into `most`.
    Counts beyond the mean by more than POISSON_REACH standard deviations (and a margin)
    are left out, their mass (under 1e-30) folded into the last kept: a server of
    thousands of slots (`--max-running-requests 4096`) costs what its load needs, not a
    sum over every slot for every state (minutes per config)."""
    from scipy import stats  # see _binom_pmf

    if mean > 0:
        most = min(most, int(mean + POISSON_REACH * math.sqrt(mean)) + POISSON_MARGIN)
    counts = np.arange(most + 1)
    weights = stats.poisson.pmf(counts, mean) if mean > 0 else (counts == 0).astype(float)
    weights[-1] += max(0.0, 1.0 - float(weights.sum()))
    return counts, weights


def _median(values: list[tuple[float, float]]) -> float:
    """The weighted median of (value, weight) pairs."""
    pairs = sorted((v, w) for v, w in values if w > 0)
    total = sum(w for _, w in pairs)
    seen = 0.0
    for value, weight in pairs:
        seen += weight
        if seen >= total / 2:
            return value
    return pairs[-1][0] if pairs else 0.0
