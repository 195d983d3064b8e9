"""Measure one cell on a running server: a dataset under a closed loop at a fixed
concurrency (`measure_cell`) or an open loop at a request rate (`measure_open_cell`).

Every time and rate is in server time: the emulator runs `time_scale` times faster than
the GPU it emulates, so wall seconds are multiplied by it (it is 1 on SGLang). Each cell
reads the server's counters around its window: the accept length, and on a server that
keeps an emulated clock, how late that clock ran (`CellResult.clock_lag_s`).
"""

from treetune.loadgen._common import MeasurementError, PromptSetLike
from treetune.loadgen.arrivals import ARRIVALS, arrival_times
from treetune.loadgen.closedloop import measure_cell
from treetune.loadgen.latency import (
    LatencySummary,
    RequestLatency,
    percentiles,
    request_latency,
    summarize,
)
from treetune.loadgen.openloop import measure_open_cell

__all__ = ["ARRIVALS", "LatencySummary", "MeasurementError", "PromptSetLike",
           "RequestLatency", "arrival_times", "measure_cell", "measure_open_cell",
           "percentiles", "request_latency", "summarize"]
