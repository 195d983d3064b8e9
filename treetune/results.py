"""What a launch measures: one `CellResult` per (dataset, batch) and a `LaunchResult` per
server launch. Plain dataclasses that round-trip through JSON, so results can cross Ray
process boundaries and live in study storage unchanged."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from treetune.config import ADAPTIVE_PREFIX, BASELINE, AdaptiveConfig, ServerConfig, TreeConfig


@dataclass(frozen=True)
class Latency:
    """Percentiles in (emulated or real) server seconds."""

    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class CellResult:
    """One (dataset, batch) measurement on one server."""

    dataset: str
    batch: int
    output_tok_s: float  # output tokens/s over the whole batch, in server time
    accept_length: float | None  # for this cell only; None without speculation
    requests: int  # requests completed inside the measurement window
    output_tokens: int  # tokens streamed inside the window
    duration_s: float  # window length in server time
    ttft: Latency | None
    tpot: Latency | None
    errors: int = 0
    repeats: tuple[float, ...] = ()  # throughput of sub-windows, for confidence intervals
    launch_tok_s: tuple[float, ...] = ()  # per launch, when several launches are merged

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellResult:
        data = dict(data)
        for key in ("ttft", "tpot"):
            if data.get(key) is not None:
                data[key] = Latency(**data[key])
        data["repeats"] = tuple(data.get("repeats", ()))
        data["launch_tok_s"] = tuple(data.get("launch_tok_s", ()))
        return cls(**data)


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

    def cell(self, dataset: str, batch: int) -> CellResult | None:
        return next((c for c in self.cells if c.dataset == dataset and c.batch == batch), None)

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
        )
