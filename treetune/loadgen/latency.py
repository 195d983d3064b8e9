"""Per-request latencies from a streamed response, and a cell's percentiles and goodput.

A stream is its send time and, per chunk that brought tokens, the chunk's arrival and the
completion tokens so far. With speculative decoding one chunk carries every token a round
accepted, so the gap between chunks (the inter-token latency a reader sees, as SGLang's
bench_serving measures it) differs from the time per output token (the mean spacing).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from treetune.results import Latency, Slo


@dataclass(frozen=True)
class RequestLatency:
    """One completed request, in server seconds."""

    ttft_s: float  # send to first chunk
    e2e_s: float  # send to last chunk
    tpot_s: float | None  # (e2e - ttft) / (tokens - 1); None for a one-token response
    itl_s: tuple[float, ...]  # between consecutive chunks


def request_latency(start: float, chunks: Sequence[tuple[float, int]],
                    scale: float = 1.0) -> RequestLatency:
    """The latencies of a completed stream sent at `start` whose `chunks` are (arrival,
    completion tokens so far); times in wall seconds of a server `scale` times faster
    than real time (1 for SGLang)."""
    if not chunks:
        raise ValueError("a completed stream has at least one chunk")
    first, tokens = chunks[0][0], chunks[-1][1]
    ttft = (first - start) * scale
    e2e = (chunks[-1][0] - start) * scale
    return RequestLatency(
        ttft_s=ttft,
        e2e_s=e2e,
        tpot_s=(e2e - ttft) / (tokens - 1) if tokens > 1 else None,
        itl_s=tuple((b - a) * scale for (a, _), (b, _) in pairwise(chunks)),
    )


@dataclass(frozen=True)
class LatencySummary:
    """A cell's latency percentiles, and its goodput against an SLO."""

    ttft: Latency | None
    tpot: Latency | None
    itl: Latency | None
    e2e: Latency | None
    goodput: float | None  # requests/s meeting the SLO; None without a bounded SLO


def summarize(requests: Sequence[RequestLatency], window_s: float,
              slo: Slo | None = None) -> LatencySummary:
    """Percentiles over the requests completed in a window of `window_s` server seconds
    (inter-token latencies pooled over every chunk gap), and how many of them per second
    met `slo`."""
    goodput = None
    if slo is not None and slo.bounded:
        goodput = sum(slo.met(r.ttft_s, r.tpot_s) for r in requests) / window_s
    return LatencySummary(
        ttft=percentiles(r.ttft_s for r in requests),
        tpot=percentiles(r.tpot_s for r in requests if r.tpot_s is not None),
        itl=percentiles(gap for r in requests for gap in r.itl_s),
        e2e=percentiles(r.e2e_s for r in requests),
        goodput=goodput,
    )


def percentiles(values: Iterable[float]) -> Latency | None:
    """p50, p90 and p99 (numpy's linear interpolation); None for no values."""
    data = np.fromiter(values, dtype=float)
    if not data.size:
        return None
    p50, p90, p99 = np.percentile(data, [50, 90, 99])
    return Latency(p50=float(p50), p90=float(p90), p99=float(p99))
