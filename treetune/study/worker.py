"""A launch worker: owns one server at a time on its GPU group and measures every
(dataset, batch) cell on it. Runs as a Ray actor; knows nothing of the search."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from treetune.config import ServerConfig
from treetune.launch import emulator_command, sglang_command
from treetune.results import LaunchResult, config_from_key, config_key
from treetune.study.spec import StudySpec


def launch_command(spec: StudySpec, config: ServerConfig, flags: tuple[tuple[str, str], ...],
                   port: int, seed: int) -> list[str]:
    """The server command for this backend; SGLang and the emulator get the same flags."""
    launch = spec.launch_spec(port=port)
    if spec.backend.kind == "emulator":
        assert spec.backend.profile is not None
        extra = ["--time-scale", f"{spec.backend.time_scale:g}",
                 "--load-time", f"{spec.backend.load_time_s:g}", "--seed", str(seed)]
        if not spec.backend.noise:
            extra.append("--no-noise")
        return emulator_command(config, launch, spec.backend.profile, flags, extra)
    return sglang_command(config, launch, flags, python=spec.backend.python)


def launch_seed(spec: StudySpec, config: ServerConfig, attempt: int = 0) -> int:
    """Reproducible per-launch randomness (the emulator's launch noise)."""
    text = f"{spec.seed}:{config_key(config)}:{attempt}"
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


class LaunchWorker:
    def __init__(self, spec: StudySpec, index: int) -> None:
        from treetune.datasets import load_dataset

        self.spec = spec
        self.name = f"worker-{index}@{socket.gethostname()}"
        self.prompts = {d.name: load_dataset(d, base_dir=Path(spec.base_dir))
                        for d in spec.datasets}
        self.logs = spec.output_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def ready(self) -> str:
        return self.name

    def run(self, key: str, flags: list[list[str]], attempt: int = 0) -> dict:
        """Launch, measure every cell, stop. Never raises for a server's failure: the
        result says what happened, with the log tail."""
        from treetune.server import ServerStartError, start_server

        config = config_from_key(key)
        flag_pairs = tuple((str(k), str(v)) for k, v in flags)
        result = LaunchResult(config, flag_pairs, worker=self.name, started_at=time.time())
        log_path = self.logs / f"{key.replace(',', '-')}{'-' + str(attempt) if attempt else ''}.log"
        env = {**os.environ, **self.spec.env}
        seed = launch_seed(self.spec, config, attempt)
        try:
            server = start_server(
                lambda port: launch_command(self.spec, config, flag_pairs, port, seed),
                log_path=log_path, env=env, host=self.spec.host,
                timeout_s=self.spec.measurement.startup_timeout_s)
        except ServerStartError as exc:
            result.reason = exc.reason
            result.exit_code = exc.exit_code
            result.log_tail = exc.log_tail
            result.finished_at = time.time()
            return result.to_dict()
        try:
            _run_coroutine(self._measure(server.base_url, result))
            result.ok = True
        except Exception as exc:  # the server died or stopped answering mid-benchmark
            result.reason = f"benchmark failed: {exc}"
            result.log_tail = server.log_tail(40)
        finally:
            code = server.stop()
            if not result.ok:
                result.exit_code = code
        result.finished_at = time.time()
        return result.to_dict()

    async def _measure(self, base_url: str, result: LaunchResult) -> None:
        from treetune.client import ServerClient
        from treetune.loadgen import measure_cell

        m = self.spec.measurement
        api_key = os.environ.get(self.spec.api_key_env) if self.spec.api_key_env else None
        for batch in sorted(self.spec.batch):
            for name, prompts in self.prompts.items():
                async with ServerClient(base_url, api_key=api_key, dataset=name) as client:
                    if not result.server_info:
                        result.server_info = _public_info(await client.server_info())
                    cell = await measure_cell(client, prompts, batch, duration_s=m.duration_s,
                                              warmup_s=m.warmup_s, repeats=m.repeats)
                result.cells.append(cell)


def _run_coroutine(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run to completion on a fresh event loop in its own thread: Ray may already run a
    loop in the actor's thread, and the server must stay owned by this long-lived thread
    (its parent-death signal follows the thread that started it)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, coroutine).result()


def _public_info(info: dict) -> dict:
    """What to keep of /server_info: resolved args that matter, never secrets."""
    keep = ("version", "attention_backend", "max_running_requests", "speculative_algorithm",
            "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
            "tp_size", "emulator")
    return {k: info[k] for k in keep if k in info}


