"""When an open loop sends its requests: a seeded schedule in server seconds, bounded in
count and in time, drawn before the first request so that every server of a study meets
the same traffic."""

from __future__ import annotations

import math

import numpy as np

ARRIVALS = ("poisson", "fixed")  # independent exponential gaps, or one every 1/rate


def arrival_times(rate: float, *, duration_s: float, max_requests: int,
                  arrival: str = "poisson", seed: int = 0) -> np.ndarray:
    """Send times in server seconds from the cell's start, ascending: those before
    `duration_s`, at most `max_requests`. Poisson: a Poisson process of `rate` per second
    (gaps drawn from `seed`); fixed: 0, 1/rate, 2/rate, ..."""
    if rate <= 0 or duration_s <= 0 or max_requests < 1:
        raise ValueError(f"need rate > 0, duration_s > 0 and max_requests >= 1; got rate={rate}, "
                         f"duration_s={duration_s}, max_requests={max_requests}")
    if arrival == "fixed":
        times = np.arange(min(max_requests, math.ceil(duration_s * rate) + 1)) / rate
    elif arrival == "poisson":
        rng = np.random.default_rng(seed)
        expected = rate * duration_s
        # Enough gaps to pass duration_s but in rare draws; more are drawn while short.
        chunk = int(expected + 6 * math.sqrt(expected) + 16)
        times = np.cumsum(rng.exponential(1 / rate, min(chunk, max_requests)))
        while times[-1] < duration_s and len(times) < max_requests:
            more = rng.exponential(1 / rate, min(chunk, max_requests - len(times)))
            times = np.concatenate([times, times[-1] + np.cumsum(more)])
    else:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got '{arrival}'")
    return times[times < duration_s][:max_requests]
