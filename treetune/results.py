"""What a launch measures: one `CellResult` per (dataset, batch), one per (dataset, rate) for
open-loop cells, and a `LaunchResult` per server launch. Plain dataclasses that round-trip
through JSON, so results can cross Ray process boundaries and live in study storage
unchanged; fields added later have defaults, so older records still load."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from treetune.config import ADAPTIVE_PREFIX, BASELINE, AdaptiveConfig, ServerConfig, TreeConfig
from treetune.errors import FieldError


@dataclass(frozen=True)
class Latency:
    """Percentiles in (emulated or real) server seconds."""

    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class Slo:
    """A latency target: a request meets it when its time to first token and its time per
    output token are within these bounds (None: unbounded). Goodput counts such requests."""

    # Metadata: `treetune search` options (study/spec.py `meta`, written out here since
    # this module comes before the study's).
    ttft_ms: float | None = field(default=None, metadata={
        "in_file": True, "option": "--slo-ttft-ms", "short": None,
        "help": "SLO: time to first token, ms (goodput counts the requests within it)."})
    tpot_ms: float | None = field(default=None, metadata={
        "in_file": True, "option": "--slo-tpot-ms", "short": None,
        "help": "SLO: time per output token, ms (goodput counts the requests within it)."})

    def __post_init__(self) -> None:
        for key in ("ttft_ms", "tpot_ms"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise FieldError(key, f"slo.{key} must be > 0, got {value}")
            if value is not None:
                object.__setattr__(self, key, float(value))  # 50 and 50.0: the same study

    @property
    def bounded(self) -> bool:
        """Whether it bounds anything (an empty SLO gives no goodput)."""
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, ttft_s: float, tpot_s: float | None) -> bool:
        """Whether a request with these latencies (server seconds) meets the target; a
        one-token request has no time per output token and meets any bound on it."""
        if self.ttft_ms is not None and ttft_s * 1e3 > self.ttft_ms:
            return False
        return self.tpot_ms is None or tpot_s is None or tpot_s * 1e3 <= self.tpot_ms


@dataclass(frozen=True)
class CellResult:
    """One cell measured on one server: a dataset under a closed loop at concurrency
    `batch` (`rate` None), or an open loop of requests arriving at `rate` per second
    (`batch` 0). Every time and rate is in server time."""

    dataset: str
    batch: int  # closed loop: requests kept in flight; 0 for an open-loop cell
    output_tok_s: float  # output tokens/s over all requests, in server time
    accept_length: float | None  # for this cell only; None without speculation
    requests: int  # requests completed inside the measurement window
    output_tokens: int  # tokens streamed inside the window
    duration_s: float  # window length in server time
    ttft: Latency | None  # time to first token, from the request's send
    tpot: Latency | None  # time per output token after the first: (e2e - ttft) / (tokens - 1)
    errors: int = 0
    repeats: tuple[float, ...] = ()  # throughput of sub-windows, for confidence intervals
    launch_tok_s: tuple[float, ...] = ()  # per launch, when several launches are merged
    # Open loop: requests/s asked for, and how they arrive ("poisson" or "fixed").
    rate: float | None = None
    arrival: str = ""
    request_rate: float | None = None  # requests completed per second of the window
    itl: Latency | None = None  # inter-token latency: between a stream's consecutive chunks
    e2e: Latency | None = None  # end-to-end latency, from send to last chunk
    slo: Slo | None = None  # the target goodput counts against
    goodput: float | None = None  # requests/s completed within `slo` (None: no SLO)
    unfinished: int = 0  # open loop: requests still running when the cell ended, aborted
    # How late the server's clock ran behind its schedule, mean over the cell, server
    # seconds (the emulator's; None for a server on a real clock); `lagged`: above the
    # study's measurement.max_clock_lag_s even when measured again (this or `client_lag_s`).
    clock_lag_s: float | None = None
    lagged: bool = False
    # How late the load generator ran its own timers, mean over the cell, or the stall its
    # median completed request's latencies may hold if later, server seconds (None: not
    # watched): a starved client measures late on any server.
    client_lag_s: float | None = None
    # Per launch, when several launches are merged: each launch's value of every
    # non-throughput objective (study/evidence.py `merge`; ms for latencies, None where a
    # launch could not tell), from which the study learns those objectives' launch noise.
    launch_metrics: tuple[dict[str, float | None], ...] = field(default=(), hash=False)
    # The last failed request's error, one line ("" when none failed): a real server refuses
    # what the emulator might not (a prompt over its context length: HTTP 400).
    error: str = ""

    @property
    def label(self) -> str:
        """The cell in words: 'humaneval at batch 8', 'humaneval at 2 req/s (poisson)'."""
        if self.rate is None:
            return f"{self.dataset} at batch {self.batch}"
        return f"{self.dataset} at {self.rate:g} req/s ({self.arrival})"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellResult:
        data = dict(data)
        for key in ("ttft", "tpot", "itl", "e2e"):
            if data.get(key) is not None:
                data[key] = Latency(**data[key])
        if data.get("slo") is not None:
            data["slo"] = Slo(**data["slo"])
        data["repeats"] = tuple(data.get("repeats", ()))
        data["launch_tok_s"] = tuple(data.get("launch_tok_s", ()))
        data["launch_metrics"] = tuple(dict(m) for m in data.get("launch_metrics", ()))
        return cls(**data)


def launches_of(result: LaunchResult) -> int:
    """How many successful launches a (merged) result holds."""
    cell = result.cells[0] if result.cells else None
    return max(1, len(cell.launch_tok_s)) if cell else 1


def config_key(config: ServerConfig) -> str:
    """A stable text key: 'baseline', 'S,K,N' ('METHOD:S,K,N' for a tree of another
    draft method than the study's own, see TreeConfig.method), or 'adaptive:1=1.2|32=1.2'
    (AdaptiveConfig)."""
    if config is BASELINE:
        return "baseline"
    if isinstance(config, AdaptiveConfig):
        return config.key()
    assert isinstance(config, TreeConfig)
    method = f"{config.method}:" if config.method else ""
    return f"{method}{config.steps},{config.topk},{config.draft_tokens}"


def config_from_key(key: str) -> ServerConfig:
    if key == "baseline":
        return BASELINE
    if key.startswith(ADAPTIVE_PREFIX):
        return AdaptiveConfig.parse(key)
    return TreeConfig.parse(key)


@dataclass
class LaunchResult:
    """One server launch: the config, how it went, and every cell it measured."""

    config: ServerConfig
    flags: tuple[tuple[str, str], ...] = ()
    ok: bool = False
    reason: str = ""  # why it failed, empty when ok
    exit_code: int | None = None
    log_tail: str = ""
    cells: list[CellResult] = field(default_factory=list)
    server_info: dict[str, Any] = field(default_factory=dict)
    worker: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0
    attempts: int = 1  # servers started for this launch (a mid-benchmark crash is retried)
    retried_because: str = ""  # why the first server was replaced, if it was
    # Where the server did not serve what its flags asked for (the backend reads it from
    # the server's info and log): its measurements are of another server than intended.
    warnings: list[str] = field(default_factory=list)
    # Open-loop cells, one per (dataset, rate), kept apart from `cells` (closed loop, one
    # per (dataset, batch)): what reads throughput at a batch size never meets them.
    rate_cells: list[CellResult] = field(default_factory=list)
    # Derived, never stored: where the study leveled this result's throughputs to one
    # speed for every node (`evidence.level_nodes`), per node: (node, share of the
    # result's launches that ran there, the baseline's launches there).
    leveled: tuple[tuple[str, float, float], ...] = ()
    # Derived, never stored: where the study leveled a time trend out of the launches
    # (`evidence.level_trend`), the standard error (log) that the trend's slope adds to
    # this result's speedups, signed by its launches' mean time against the baseline's.
    trend: float = 0.0

    def cell(self, dataset: str, batch: int) -> CellResult | None:
        return next((c for c in self.cells if c.dataset == dataset and c.batch == batch), None)

    def rate_cell(self, dataset: str, rate: float) -> CellResult | None:
        return next((c for c in self.rate_cells if c.dataset == dataset and c.rate == rate),
                    None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": config_key(self.config),
            "flags": [list(f) for f in self.flags],
            "ok": self.ok,
            "reason": self.reason,
            "exit_code": self.exit_code,
            "log_tail": self.log_tail,
            "cells": [c.to_dict() for c in self.cells],
            "server_info": self.server_info,
            "worker": self.worker,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "attempts": self.attempts,
            "retried_because": self.retried_because,
            "warnings": list(self.warnings),
            "rate_cells": [c.to_dict() for c in self.rate_cells],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchResult:
        return cls(
            config=config_from_key(data["config"]),
            flags=tuple((str(k), str(v)) for k, v in data.get("flags", [])),
            ok=bool(data["ok"]),
            reason=data.get("reason", ""),
            exit_code=data.get("exit_code"),
            log_tail=data.get("log_tail", ""),
            cells=[CellResult.from_dict(c) for c in data.get("cells", [])],
            server_info=data.get("server_info", {}),
            worker=data.get("worker", ""),
            started_at=data.get("started_at", 0.0),
            finished_at=data.get("finished_at", 0.0),
            attempts=data.get("attempts", 1),
            retried_because=data.get("retried_because", ""),
            warnings=list(data.get("warnings", [])),
            rate_cells=[CellResult.from_dict(c) for c in data.get("rate_cells", [])],
        )
