"""A launch worker: owns one server at a time on its GPU group and measures every
(dataset, batch) cell on it. Runs as a Ray actor; knows nothing of the search."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treetune.backends import (
    BackendFacts,
    LaunchContext,
    ServerApi,
    gather_facts,
    server_facts,
)
from treetune.config import AdaptiveConfig, Baseline, ServerConfig
from treetune.errors import TreetuneError
from treetune.results import CellResult, LaunchResult, config_from_key, config_key
from treetune.study.keys import key_handoff, own_dir, sweep_stale
from treetune.study.spec import StudySpec

if TYPE_CHECKING:
    from treetune.client import ServerClient
    from treetune.datasets import PromptSet

# How long a server that stopped answering mid-benchmark gets to finish exiting, so that
# the launch's reason says how it ended (a crash closes its sockets before its process is
# gone; on a busy machine the gap was enough to lose the exit code from the reason).
EXIT_GRACE_S = 5.0
MAX_ATTEMPTS = 2  # a server that crashes mid-benchmark is retried once on a fresh server
START_LOG_LINES = 2000  # enough of a server's log to hold its whole start-up
RAY_TOKEN = "RAY_AUTH_TOKEN"
# A worker on another host than the driver hands its launch's logs back under this key of
# the result (the driver stores them: `store_logs`), each at most this long (its end).
SHIPPED_LOGS = "shipped_logs"
LOGS_PREFIX = "treetune-logs-"  # then the worker's pid and host (`keys.own_dir`)
MAX_SHIPPED_BYTES = 32 * 1024 * 1024


def launch_command(spec: StudySpec, config: ServerConfig,
                   flags: tuple[tuple[str, str | None], ...], port: int, attempt: int = 0,
                   key_flags: tuple[tuple[str, str], ...] = (), launch_index: int = 0,
                   adaptive_config_path: str | None = None) -> list[str]:
    """The server command of the study's backend for one launch attempt (`key_flags`: how
    the server gets its API key, `keys.key_handoff`'s; `launch_index`: how many launches of this
    config came before; `adaptive_config_path`: an adaptive server's JSON config file,
    already written)."""
    # A study's servers keep no prefix cache (LaunchSpec.prefix_cache).
    launch = dataclasses.replace(spec.launch_spec(port=port), prefix_cache=False)
    flags = (*flags, *key_flags)
    launch = dataclasses.replace(launch, extra_flags=(*launch.extra_flags, *flags),
                                 adaptive_config_path=adaptive_config_path)
    # Every cell sends at least `batch` requests: a crash fault is drawn within that.
    context = LaunchContext(study_seed=spec.seed, attempt=attempt, launch_index=launch_index,
                            min_requests=sum(spec.batch) * len(spec.datasets))
    return spec.backend.command(launch, config, context)


def store_logs(folder: Path, shipped: dict[str, str]) -> None:
    """Write the logs a worker on another host handed back into the driver's `folder`,
    keeping one already there under its name (`keep_earlier`)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in shipped.items():
        path = folder / Path(name).name  # a name, never a path out of the folder
        if path.suffix == ".log":  # a config file written again is the same config
            keep_earlier(path)
        path.write_text(text)


def _tail(path: Path, limit: int) -> str:
    """A file's text, its last `limit` bytes when longer (saying what was left out)."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        handle.seek(max(0, size - limit))
        text = handle.read().decode(errors="replace")
    return text if size <= limit else (
        f"[treetune: the first {size - limit} bytes of this log were left out]\n{text}")


def slow_start(ready_after_s: float | None, timeout_s: float) -> str:
    """What to tell of a server that became healthy only past its start-up timeout, waited
    for while its log showed it starting ('' when it was in time)."""
    from treetune.server import STARTUP_STRETCH

    if ready_after_s is None or ready_after_s <= timeout_s:
        return ""
    return (f"the server became healthy only after measurement.startup_timeout_s "
            f"({timeout_s:g} s), waited for while its log showed it still starting (up to "
            f"{STARTUP_STRETCH:g} times that): set startup_timeout_s above the start-up time "
            "its log shows")


def log_name(key: str, launch_index: int = 0, attempt: int = 0) -> str:
    """One log per server: `3-4-8.log`, a re-measurement `3-4-8.launch2.log`, a crashed
    launch's replacement server `3-4-8-1.log` (or `3-4-8.launch2-1.log`). An adaptive
    config's key keeps its digits: `adaptive_1_1.2_32_2.log`."""
    name = re.sub(r"[^A-Za-z0-9.-]+", "_", key.replace(",", "-"))
    name += f".launch{launch_index + 1}" if launch_index else ""
    return f"{name}{'-' + str(attempt) if attempt else ''}.log"


def keep_earlier(log_path: Path) -> Path | None:
    """Move aside a log already at `log_path` (a launch interrupted, or lost with its
    worker, and now done again under its name) to `NAME.earlier.log` (`.earlier2.log`, ...):
    one log per server started, none overwritten. Returns where it went (None when there
    was none, or another worker moved it first)."""
    stem = log_path.name.removesuffix(".log")
    for n in itertools.count(1):
        aside = log_path.with_name(f"{stem}.earlier{n if n > 1 else ''}.log")
        try:  # a link fails where a name is taken (a rename would replace it)
            os.link(log_path, aside)
        except FileExistsError:
            continue
        except FileNotFoundError:
            return None
        log_path.unlink(missing_ok=True)
        return aside
    return None  # unreachable: count() never ends


def set_aside(folder: Path, key: str, launch_index: int) -> None:
    """The logs of a launch that will never be stored (its search was killed while it
    ran), each server's kept as `NAME.earlier.log` at once rather than when the launch is
    done again: a log under a launch's own name is then always a stored launch's (or one
    under way), though the search may never redo this one."""
    for attempt in itertools.count():
        if keep_earlier(folder / log_name(key, launch_index, attempt)) is None:
            return


class LaunchWorker:
    """`prompts`: the study's prompt sets as the driver loaded them (None: loaded here from
    the study's files); `driver_host`: the host the study runs on. A worker on another host
    keeps its servers' logs in a temp dir of its own and hands them back with each result
    (`SHIPPED_LOGS`): a cluster's nodes need not share a filesystem with the driver, whose
    output folder holds every log."""

    def __init__(self, spec: StudySpec, index: int, prompts: dict[str, PromptSet] | None = None,
                 driver_host: str | None = None) -> None:
        from treetune.datasets import load_dataset

        self.spec = spec
        self.name = f"worker-{index}@{socket.gethostname()}"
        self.prompts = prompts if prompts is not None else {
            d.name: load_dataset(d, base_dir=Path(spec.base_dir)) for d in spec.datasets}
        self.remote = driver_host is not None and driver_host != socket.gethostname()
        self.logs = spec.output_dir / "logs"  # remote: a temp dir per launch (`run`)
        self.doing = ""  # what the launch under way does now (`stage`)
        if self.remote:
            sweep_stale(prefix=LOGS_PREFIX)  # those of workers killed mid-launch
        else:
            self.logs.mkdir(parents=True, exist_ok=True)

    def ready(self) -> tuple[str, str | None]:
        """The worker's name and the model of the GPUs it was given (None: no GPU tool
        tells, or the backend's GPUs are emulated), once it can launch: its node must hold
        the API key too, and on a cluster pass the backend's checks and refuse trees SGLang
        would fail on its GPUs (the driver leaves to the nodes what only they can tell: the
        engine installed there, the model files they hold, their GPUs)."""
        from treetune.facts import seen_model
        from treetune.study.placement import RAY_GPU
        from treetune.study.preflight import check_branching, study_spaces

        self.api_key()
        env = {**os.environ, **self.spec.env}
        real = self.spec.backend.gpu_resource == RAY_GPU
        gpu = seen_model(env) if real else None
        if not self.spec.local_ray:
            try:
                # Trees SGLang would fail on this node's GPUs, for the model files here.
                check_branching(self.spec, study_spaces(self.spec), env, node_gpu=gpu)
                self.spec.backend.check(self.spec.launch_spec(), self.spec.dataset_names,
                                        env, local=True)
            except TreetuneError as exc:
                raise TreetuneError(f"on {socket.gethostname()}: {exc}") from None
        return self.name, gpu

    def stage(self) -> str:
        """What the launch under way does now, for the driver's progress line ("" between
        launches): its server starting, or the cell it measures. Asked while `run` runs: the
        actor takes two calls at once (`runner._Pool`)."""
        return self.doing

    def facts(self) -> BackendFacts:
        """The backend's hardware and model facts, gathered here: this actor holds the GPUs
        a server runs on, and its node has the model files a server loads."""
        return gather_facts(self.spec.backend, self.spec.launch_spec(),
                            {**os.environ, **self.spec.env})

    def run(self, key: str, flags: list[list[str]], launch_index: int = 0) -> dict:
        """Launch, measure every cell, stop. A server that crashes mid-benchmark is
        replaced once by a fresh one, which measures only the cells still missing. Never
        raises for a server's failure: the result says what happened, with the log tail."""
        try:
            return self._run_here(key, flags, launch_index)
        finally:
            self.doing = ""

    def _run_here(self, key: str, flags: list[list[str]], launch_index: int) -> dict:
        if not self.remote:
            return self._run(key, flags, launch_index)
        self.logs = Path(tempfile.mkdtemp(prefix=own_dir(LOGS_PREFIX)))
        try:
            data = self._run(key, flags, launch_index)
            # This launch's files (server logs, adaptive configs), for the driver's logs/.
            data[SHIPPED_LOGS] = {path.name: _tail(path, MAX_SHIPPED_BYTES)
                                  for path in sorted(self.logs.iterdir())}
            return data
        finally:
            shutil.rmtree(self.logs, ignore_errors=True)

    def _run(self, key: str, flags: list[list[str]], launch_index: int) -> dict:
        config = config_from_key(key)
        flag_pairs = tuple((str(k), str(v)) for k, v in flags)
        result = LaunchResult(config, flag_pairs, worker=self.name, started_at=time.time())
        for attempt in range(MAX_ATTEMPTS):
            result.attempts = attempt + 1
            if not self._attempt(result, attempt, launch_index) or result.ok:
                break  # a failed start is not retried: it would fail the same way
            if attempt + 1 < MAX_ATTEMPTS:
                result.retried_because = result.reason
                result.reason = ""
        result.finished_at = time.time()
        return result.to_dict()

    def _attempt(self, result: LaunchResult, attempt: int, launch_index: int) -> bool:
        """One server: start it, measure the missing cells, stop it. False if it never
        became healthy."""
        from treetune.server import ServerStartError, start_server

        config, key = result.config, config_key(result.config)
        log_path = self.logs / log_name(key, launch_index, attempt)
        keep_earlier(log_path)  # a launch interrupted or lost before, now redone
        # Ray's token stays with Ray: the server needs none of it.
        env = {k: v for k, v in os.environ.items() if k != RAY_TOKEN} | self.spec.env
        api_key = self.api_key()
        adaptive = None
        if isinstance(config, AdaptiveConfig):  # the server reads it on this node
            path = log_path.with_suffix(".adaptive.json")
            path.write_text(json.dumps(config.to_json(), indent=1) + "\n")
            adaptive = str(path.resolve())
        started: list[list[str]] = []  # the command, as the server was started
        niced = normal_priority()
        if niced and niced not in result.warnings:
            result.warnings.append(niced)

        self.doing = "starting server" + (f" (attempt {attempt + 1})" if attempt else "")
        try:
            with key_handoff(self.spec, api_key) as keyed:
                def command(port: int) -> list[str]:
                    keyed.arm()  # for the server about to start with these flags
                    started.append(launch_command(self.spec, config, result.flags, port,
                                                  attempt, keyed.flags, launch_index,
                                                  adaptive))
                    return started[-1]

                server = start_server(
                    command,
                    log_path=log_path, env=env, host=self.spec.host,
                    timeout_s=self.spec.measurement.startup_timeout_s,
                    secrets=(api_key,) if api_key else (), api=self.spec.backend.api)
        except ServerStartError as exc:
            result.reason = exc.reason
            result.exit_code = exc.exit_code
            result.log_tail = exc.log_tail
            return False
        late = slow_start(server.ready_after_s, self.spec.measurement.startup_timeout_s)
        if late and late not in result.warnings:
            result.warnings.append(late)
        try:
            _run_coroutine(self._measure(server.base_url, result, api_key,
                                         lambda: server.log_tail(START_LOG_LINES),
                                         started[-1]))
            result.ok = True
            result.reason = ""
        except Exception as exc:  # the server died or stopped answering mid-benchmark
            result.reason = f"benchmark failed: {_first_line(exc)}"
            crashed = server.exit_code_within(EXIT_GRACE_S)
            result.log_tail = server.log_tail(40)
            if crashed is not None:
                result.reason += f" (the server exited with code {crashed})"
        finally:
            code = server.stop()
            if not result.ok:
                result.exit_code = code
        if result.ok:  # the cells of every server of this launch, an earlier one's too
            full = pool_full_warning(self.spec.backend.api.pool_full_log, [
                self.logs / log_name(key, launch_index, a) for a in range(attempt + 1)])
            if full and full not in result.warnings:
                result.warnings.append(full)
        return True

    def api_key(self) -> str | None:
        """SGLang's --api-key, from the environment variable the study names."""
        name = self.spec.api_key_env
        if not name:
            return None
        value = os.environ.get(name)
        if not value:
            raise RuntimeError(f"api_key_env: the environment variable {name} is not set on "
                               f"{socket.gethostname()}")
        if value.startswith("-"):  # --api-key -x: argparse takes -x for an option
            raise RuntimeError(f"api_key_env: the key in {name} starts with '-', which SGLang "
                               "reads as a flag and so refuses to start: use a key that "
                               "does not")
        return value

    def _measure(self, base_url: str, result: LaunchResult, api_key: str | None,
                 log: Callable[[], str], command: list[str]) -> Coroutine[Any, Any, None]:
        """Measure every cell the result does not hold yet, adding each as it is done:
        the batch sizes' closed-loop cells, then the rates' open-loop cells. Before the
        first, the server's info is kept, and the backend says whether the server serves
        what its `command` asked for (from that info and the start-up `log`). The coroutine
        is made here, not by a coroutine method: a class with one is an async actor to Ray,
        whose calls wait on each other, and `stage` must answer while `run` runs."""

        async def measure_all() -> None:
            from treetune.client import ServerClient
            from treetune.loadgen import measure_cell, measure_open_cell

            m, spec = self.spec.measurement, self.spec
            slo = spec.slo if spec.slo.bounded else None
            cells = [*((name, batch, False) for batch in sorted(spec.batch)
                       for name in self.prompts),
                     *((name, rate, True) for rate in sorted(spec.rates)
                       for name in self.prompts)]
            for number, (name, size, is_rate) in enumerate(cells, 1):
                done = result.rate_cell(name, size) if is_rate else result.cell(name, int(size))
                if done is not None:
                    continue  # measured by an earlier server of this launch
                self.doing = (f"cell {number}/{len(cells)}: {name} "
                              + (f"at {size:g} req/s" if is_rate else f"b{int(size)}"))
                prompts = self.prompts[name]
                async with ServerClient(base_url, api_key=api_key, dataset=name,
                                        api=spec.backend.api) as client:
                    if not result.server_info:
                        info = await client.server_info()
                        result.server_info = server_facts(spec.backend.api, info)
                        result.warnings += self._launch_warnings(info, log, command)
                    if is_rate:
                        measure = functools.partial(
                            measure_open_cell, client, prompts, size, duration_s=m.duration_s,
                            max_requests=m.max_requests, arrival=m.arrival, seed=spec.seed,
                            repeats=m.repeats, slo=slo)
                    else:
                        measure = functools.partial(
                            measure_cell, client, prompts, int(size), duration_s=m.duration_s,
                            warmup_s=m.warmup_s, repeats=m.repeats, slo=slo)
                    cell, warning = await measure_watched(
                        measure, m.max_clock_lag_s, spec.backend.api.clock_lag_hint,
                        await client.time_scale(), closed_loop=not is_rate,
                        speculative=not isinstance(result.config, Baseline),
                        counts_verify=functools.partial(counts_verify_calls, client),
                        api=spec.backend.api)
                for note in (warning, failed_requests(cell)):
                    if note and note not in result.warnings:
                        result.warnings.append(note)
                (result.rate_cells if is_rate else result.cells).append(cell)

        return measure_all()

    def _launch_warnings(self, info: dict[str, Any], log: Callable[[], str],
                         command: list[str]) -> list[str]:
        check = self.spec.backend.api.launch_warnings
        if check is None:
            return []
        return check(command_flags(command), info, log())


def pool_full_warning(said: str, logs: list[Path]) -> str:
    """What to tell of a launch whose servers logged their KV cache pool full (`said`,
    the backend's words) while they served ('' when none did, or no log can be read)."""
    times = 0
    for path in logs if said else []:
        try:
            with path.open(errors="replace") as log:
                times += sum(said in line for line in log)
        except OSError:
            continue  # a log gone is no word on the pool
    if not times:
        return ""
    return (f"its KV cache pool ran full while it served (the server logged \"{said}\" "
            f"{times} time{'s' if times > 1 else ''}): then fewer requests ran at once than "
            "the batch, the others waiting. SGLang calls an occasional retraction harmless; "
            "often, it means the largest batches measured fewer requests at once. A larger "
            "--mem-fraction-static in server_flags, or smaller batch sizes, lets them all "
            "run")


def failed_requests(cell: CellResult) -> str:
    """What to tell of a cell some of whose requests failed ('' when none did): it
    measured the others, so its prompts are not the dataset's."""
    if not cell.errors:
        return ""
    many = cell.errors > 1
    return (f"{cell.label}: {cell.errors} request{'s' if many else ''} failed and the cell "
            f"measured the others; {'the last' if many else 'it'} said: "
            f"{cell.error or 'nothing'}")


def command_flags(argv: list[str]) -> list[tuple[str, str | None]]:
    """A server command's `--flag value` pairs (None for a bare flag): the study's own
    flags and those the backend derives from the config alike."""
    flags: list[tuple[str, str | None]] = []
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            value = argv[i + 1] if i + 1 < len(argv) else None
            flags.append((arg, None if value is None or value.startswith("--") else value))
    return flags


async def measure_watched(measure: Callable[[], Awaitable[CellResult]], max_lag_s: float,
                          hint: str, time_scale: float = 1.0, *, speculative: bool = False,
                          closed_loop: bool = False,
                          counts_verify: Callable[[], Awaitable[bool]] | None = None,
                          api: ServerApi | None = None) -> tuple[CellResult, str | None]:
    """A cell measured by `measure`, and measured once more if its server's clock, or the
    load generator's own timers, lagged more than `max_lag_s` behind schedule, or if a
    `speculative` server delivered tokens in the window without one verify call counted
    for the cell (no request of it ended: its accept length is missing) unless
    `counts_verify` says the server counts none at all, or if a `closed_loop` cell's window
    saw no token at all; if the second is no better, it is kept (marked `lagged` if it
    lagged), with a warning for the study that says what to do (`hint`). A closed-loop
    cell empty twice raises MeasurementError: requests were in flight all along, so the
    server stalled, and 0 tok/s is not its throughput (the worker's retry on a fresh
    server measures the cell again)."""
    cell = await measure()
    lags, empty = _lags(cell, max_lag_s), _empty(cell, closed_loop)
    if not lags and not empty and _no_accept(cell, speculative) and counts_verify is not None \
            and api is not None and not await counts_verify():
        return cell, no_verify_counter(api)  # measuring again would count none either
    if not lags and not _no_accept(cell, speculative) and not empty:
        return cell, None
    first = cell
    cell = await measure()
    if _empty(cell, closed_loop):
        from treetune.loadgen import MeasurementError

        raise MeasurementError(
            f"{cell.label}: no token arrived in two windows of {cell.duration_s:g} s, with "
            f"{cell.batch} requests in flight: the server stalled "
            f"({_lagging(first)[0]} ran {_lagging(first)[1] * 1e3:.0f} ms, then "
            f"{_lagging(cell)[1] * 1e3:.0f} ms behind its schedule). To fix: {hint}")
    if _lags(cell, max_lag_s):
        return dataclasses.replace(cell, lagged=True), _lag_warning(first, cell, max_lag_s,
                                                                    hint, time_scale)
    if _no_accept(cell, speculative):
        return cell, (f"{cell.label}: the server counted no speculative verify call for "
                      f"the cell, measured twice, though {cell.output_tokens} tokens arrived: "
                      "no accept length (the search fits its throughput alone). SGLang "
                      "counts a request's verify calls when it ends: a longer "
                      "measurement.duration_s lets requests end in the cell; check too that "
                      "the server counts verify calls in its metrics and was not stalled.")
    return cell, None


def no_verify_counter(api: ServerApi) -> str:
    """The warning for a server whose metrics count no verify calls."""
    hint = f" ({api.verify_calls_hint})" if api.verify_calls_hint else ""
    return (f"the server's metrics have no {api.verify_calls}{hint}: no accept length was "
            "measured, and the search fits throughput alone")


def _lag_warning(first: CellResult, second: CellResult, max_lag_s: float, hint: str,
                 time_scale: float) -> str:
    """Why a cell measured twice is kept marked lagged, and what to do."""
    before, after = _lagging(first), _lagging(second)
    if not _lags(first, max_lag_s):  # measured again for its missing accept length
        why = (f"its first window counted no verify call; measured again, {after[0]} ran "
               f"{after[1] * 1e3:.0f} ms")
    else:
        again = ("measured again" if after[0] == before[0]
                 else f"measured again, {after[0]}")
        why = f"{before[0]} ran {before[1] * 1e3:.0f} ms, then {again} {after[1] * 1e3:.0f} ms"
    return (f"{second.label}: {why} behind its schedule on average (server time, "
            f"over measurement.max_clock_lag_s = {max_lag_s * 1e3:g} ms): its latencies "
            f"are off by that much, its throughput too if the lag outgrew a round; kept, "
            f"marked lagged. To fix: {hint}"
            f"{f' (time scale now {time_scale:g})' if time_scale != 1 else ''}.")


def _empty(cell: CellResult, closed_loop: bool) -> bool:
    """A closed-loop cell whose window saw no token."""
    return closed_loop and cell.output_tokens == 0


async def counts_verify_calls(client: ServerClient) -> bool:
    """Whether the server counts speculative verify calls: a server that has counted
    generated tokens and shows no verify counter has none (SGLang before 0.5.13). SGLang's
    labeled counters show no sample before their first count, so one that has counted no
    token yet is taken to count them."""
    api = client.api
    names = await client.metrics()
    return api.verify_calls in names or names.get(api.generated_tokens, 0.0) <= 0


def _no_accept(cell: CellResult, speculative: bool) -> bool:
    """A speculative server's cell that delivered tokens with no verify call counted."""
    return speculative and cell.output_tokens > 0 and cell.accept_length is None


def _lagging(cell: CellResult) -> tuple[str, float]:
    """Which lagged more, the server or the load generator, in words, and by how much
    (server seconds; 0 when neither keeps a lag)."""
    if (cell.clock_lag_s or 0.0) >= (cell.client_lag_s or 0.0):
        return "the server's clock", cell.clock_lag_s or 0.0
    return "the load generator's own timers", cell.client_lag_s or 0.0


def _lags(cell: CellResult, max_lag_s: float) -> bool:
    return _lagging(cell)[1] > max_lag_s


def normal_priority() -> str | None:
    """Run this thread (the load generator, and the server it starts: both inherit it) at
    the niceness of the process that started this worker (the node's Ray), not above.
    Ray starts its workers niced (15 above its own, unless the cluster was started with
    RAY_worker_niceness=0): on a node with anything else to run, they would get the CPU
    last, and the cells would measure that. A study run under `nice` on purpose keeps its
    niceness. A line for the study when it cannot be undone (lowering niceness needs
    CAP_SYS_NICE); None when there is nothing to undo."""
    niceness = os.getpriority(os.PRIO_PROCESS, 0)  # on Linux, this thread's
    node = os.getpriority(os.PRIO_PROCESS, os.getppid())
    if niceness <= node:
        return None
    try:
        os.setpriority(os.PRIO_PROCESS, 0, node)
    except PermissionError:
        return (f"this launch ran at niceness {niceness}, above the {node} of the Ray node "
                "that started its worker, which may not lower it: its server and load "
                "generator get the CPU after everything else on the node. Start the Ray "
                "cluster with RAY_worker_niceness=0 (`RAY_worker_niceness=0 ray start ...`).")
    return None


def _run_coroutine(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run to completion on a fresh event loop in its own thread: Ray may already run a
    loop in the actor's thread, and the server must stay owned by this long-lived thread
    (its parent-death signal follows the thread that started it)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, coroutine).result()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
