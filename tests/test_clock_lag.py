"""The emulator is honest about its clock: it reports how late it meets its emulated
deadlines, a cell records that lag, and a study re-measures a cell that lagged, then keeps
it marked with a warning that says what to do. Lag itself depends on the machine, so the
tests provoke it (a blocked loop, CPU hogs at a high time scale) or stub it; none asserts
that an unprovoked run has none."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from studykit import server_processes, small_study, wait_until

from treetune.backends.emulator import (
    CLOCK_LAG_HINT,
    CLOCK_LAG_INFO_KEY,
    CLOCK_LAG_METRIC,
    EMULATOR_API,
    EMULATOR_INFO_KEY,
)
from treetune.backends.sglang import SGLANG_API
from treetune.config import TreeConfig
from treetune.emulator.engine import Engine
from treetune.emulator.metrics import ServerMetrics
from treetune.loadgen import MeasurementError
from treetune.loadgen._common import (
    HEARTBEAT_S,
    Counters,
    Record,
    Stream,
    cell_result,
    client_lag,
    clock_lag,
    heartbeat,
)
from treetune.perfmodel import NoiseModel, load_profile
from treetune.results import CellResult, LaunchResult
from treetune.study.worker import measure_watched, normal_priority

PROFILE = "qwen3-coder-next-h200"
PRINT_NICENESS = "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"
DATASET = "humaneval"
TREE = TreeConfig(3, 4, 8)
LAG = f"{CLOCK_LAG_METRIC}_count"


def metric_samples(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


# ---- the emulator reports it -------------------------------------------------------------

def test_the_emulator_reports_its_clock_lag_in_server_info_and_as_a_histogram(emulators):
    server = emulators.healthy(
        "--profile", PROFILE, "--model-path", "Qwen/Qwen3-Coder-Next", "--tp-size", "4",
        "--seed", "1", "--no-noise", "--enable-metrics", "--time-scale", "20",
        "--load-time", "0")
    idle = httpx.get(f"{server.url}/server_info").json()[EMULATOR_INFO_KEY][CLOCK_LAG_INFO_KEY]
    assert idle == {"last_s": 0.0, "recent_mean_s": 0.0, "recent_max_s": 0.0, "max_s": 0.0,
                    "deadlines": 0}
    response = httpx.post(f"{server.url}/generate", timeout=30, headers={
        "X-Treetune-Dataset": DATASET}, json={"text": "def fib(n):", "sampling_params": {
            "max_new_tokens": 64, "ignore_eos": True}})
    assert response.status_code == 200
    lag = httpx.get(f"{server.url}/server_info").json()[EMULATOR_INFO_KEY][CLOCK_LAG_INFO_KEY]
    metrics = metric_samples(httpx.get(f"{server.url}/metrics").text)
    assert lag["deadlines"] >= 2  # the prefill and at least one decode round
    assert 0 <= lag["recent_mean_s"] <= lag["recent_max_s"] <= lag["max_s"]
    assert metrics[LAG] == lag["deadlines"]
    assert metrics[f"{CLOCK_LAG_METRIC}_sum"] == pytest.approx(
        lag["recent_mean_s"] * lag["deadlines"])


SCALE, BLOCK_S = 2.0, 0.3  # an engine's time scale, and how long a test blocks its loop


def quiet_engine() -> tuple[Engine, ServerMetrics]:
    """An in-process engine of TREE without noise, at time scale SCALE, and its metrics."""
    profile = load_profile(PROFILE)
    metrics = ServerMetrics("m")
    return Engine(profile, TREE, tp=4, max_running_requests=4, time_scale=SCALE,
                  noise=NoiseModel.from_profile(profile.noise, False),
                  rng=np.random.default_rng(0), metrics=metrics), metrics


def run_blocked(engine: Engine, tokens: int, then: int | None = None) -> list:
    """Run `engine` on a request of `tokens`; once it is admitted (the engine waits for its
    prefill's end), block the loop for BLOCK_S, a CPU hog in miniature: the loop cannot
    run at all. Then send a request of `then` tokens, if given, and wait until every
    request finished. Returns the requests."""
    async def run() -> list:
        task = asyncio.create_task(engine.run())
        requests = [engine.new_request(DATASET, 100, tokens, ignore_eos=True)]
        while not engine.running:
            await asyncio.sleep(0)
        time.sleep(BLOCK_S)
        if then is not None:
            requests.append(engine.new_request(DATASET, 100, then, ignore_eos=True))
        while any(r.finished_at is None for r in requests):
            await asyncio.sleep(0.001)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return requests

    return asyncio.run(run())


def test_a_blocked_event_loop_shows_as_clock_lag_in_emulated_seconds():
    engine, metrics = quiet_engine()
    prefill_s = engine.model.prefill_time(TREE, 1, 100, DATASET)  # emulated seconds
    run_blocked(engine, 16)
    summary = engine.lag.summary()
    # The prefill was due prefill_s / SCALE wall seconds in; it was met after the block.
    assert summary["max_s"] >= (BLOCK_S - prefill_s / SCALE) * SCALE
    assert summary["deadlines"] >= 2 and min(engine.lag.recent) >= 0
    samples = metric_samples(metrics.render().decode())
    assert samples[LAG] == summary["deadlines"]


def test_a_request_arriving_while_the_engine_runs_late_has_a_positive_time_to_first_token():
    # Beside a CPU hog, a server's histogram once read a negative mean TTFT over a cell: a
    # request stamped with the wall's time arrived after the late clock gave its first token.
    engine, metrics = quiet_engine()
    prefill_s = engine.model.prefill_time(TREE, 1, 100, DATASET)  # emulated seconds
    requests = run_blocked(engine, 64, then=16)  # the second sent while the engine is late
    # The mechanism under test: the engine ran late, as in the test above.
    assert engine.lag.worst >= (BLOCK_S - prefill_s / SCALE) * SCALE
    for request in requests:
        assert request.first_token_at > request.arrival
        assert request.finished_at > request.first_token_at
    samples = metric_samples(metrics.render().decode())
    ttft = "sglang:time_to_first_token_seconds"
    assert samples[f"{ttft}_count"] == 2 and samples[f"{ttft}_sum"] > 0


# ---- a cell records it --------------------------------------------------------------------

def test_a_cells_clock_lag_is_the_mean_over_the_deadlines_met_in_its_window():
    counters = Counters({f"{CLOCK_LAG_METRIC}_sum": 1.0, LAG: 10.0},
                        {f"{CLOCK_LAG_METRIC}_sum": 4.0, LAG: 40.0})
    assert clock_lag(EMULATOR_API, counters) == pytest.approx(0.1)
    assert clock_lag(EMULATOR_API, Counters({}, {})) == 0.0  # no deadline in the window
    assert clock_lag(SGLANG_API, counters) is None  # a real clock does not lag


# ---- the worker re-measures and marks it ------------------------------------------------

def cell(lag: float | None, client_lag: float | None = None) -> CellResult:
    return CellResult(dataset=DATASET, batch=8, output_tok_s=900.0, accept_length=3.0,
                      requests=10, output_tokens=5400, duration_s=6.0, ttft=None, tpot=None,
                      clock_lag_s=lag, client_lag_s=client_lag)


class Measured:
    """A stand-in for a cell's measurement that returns cells with these lags in turn
    (the server's; the load generator's with `client`)."""

    def __init__(self, *lags: float | None, client: bool = False) -> None:
        self.lags = list(lags)
        self.client = client
        self.calls = 0

    async def __call__(self) -> CellResult:
        self.calls += 1
        lag = self.lags.pop(0)
        return cell(0.001, lag) if self.client else cell(lag)


def watched(measure: Measured, time_scale: float = 20.0) -> tuple[CellResult, str | None]:
    return asyncio.run(measure_watched(measure, 0.05, CLOCK_LAG_HINT, time_scale))


def watched_in_turn(cells: list[CellResult], speculative: bool = False,
                    closed_loop: bool = False) -> tuple[CellResult, str | None]:
    """`measure_watched` over a measurement that returns `cells` in turn (taken from the
    list, so what is left shows how often it measured)."""
    async def measure() -> CellResult:
        return cells.pop(0)

    return asyncio.run(measure_watched(measure, 0.05, CLOCK_LAG_HINT, 20.0,
                                       speculative=speculative, closed_loop=closed_loop))


@pytest.mark.parametrize("lag", [None, 0.0, 0.05])
def test_a_cell_within_the_lag_threshold_or_on_a_real_clock_is_measured_once(lag):
    measure = Measured(lag)
    result, warning = watched(measure)
    assert (measure.calls, result.lagged, warning) == (1, False, None)


def test_a_cell_that_lagged_once_is_measured_again_and_the_second_kept_unmarked():
    measure = Measured(0.2, 0.01)
    result, warning = watched(measure)
    assert (measure.calls, result.clock_lag_s, result.lagged, warning) == (2, 0.01, False, None)


def test_a_cell_that_lagged_twice_is_kept_marked_lagged_with_a_warning_saying_what_to_do():
    measure = Measured(0.2, 0.12)
    result, warning = watched(measure)
    assert (measure.calls, result.clock_lag_s, result.lagged) == (2, 0.12, True)
    assert warning is not None
    assert warning.startswith("humaneval at batch 8: the server's clock ran 200 ms, then "
                              "measured again 120 ms behind its schedule")
    assert "measurement.max_clock_lag_s = 50 ms" in warning
    assert warning.endswith(f"kept, marked lagged. To fix: {CLOCK_LAG_HINT} (time scale now "
                            "20).")
    assert "run fewer workers at once (--workers), or lower backend.time_scale" in \
        CLOCK_LAG_HINT


def test_a_load_generator_that_lagged_twice_is_named_in_the_warning():
    # The server kept its clock; the client measuring it did not.
    measure = Measured(0.3, 0.09, client=True)
    result, warning = watched(measure)
    assert (measure.calls, result.client_lag_s, result.lagged) == (2, 0.09, True)
    assert warning is not None and warning.startswith(
        "humaneval at batch 8: the load generator's own timers ran 300 ms, then measured "
        "again 90 ms behind its schedule")
    once = Measured(0.3, 0.01, client=True)
    assert watched(once)[0].lagged is False and once.calls == 2


def test_a_lag_that_moved_from_the_server_to_the_client_names_each():
    _, warning = watched_in_turn([cell(0.3, 0.001), cell(0.001, 0.09)])
    assert warning is not None and warning.startswith(
        "humaneval at batch 8: the server's clock ran 300 ms, then measured again, the load "
        "generator's own timers 90 ms behind its schedule")


def without_accept(c: CellResult) -> CellResult:
    """The cell as a window in which the server counted no verify call."""
    return dataclasses.replace(c, accept_length=None)


def test_a_speculative_cell_without_an_accept_length_is_measured_again():
    # A window in which tokens arrived but the server made no round (stalled, or its
    # metrics missed it): the second measurement, with its accept length, is kept.
    cells = [without_accept(cell(0.0)), cell(0.0)]
    result, warning = watched_in_turn(cells, speculative=True)
    assert (cells, result.accept_length, warning) == ([], 3.0, None)


def test_a_speculative_cell_twice_without_an_accept_length_is_kept_with_a_warning():
    cells = [without_accept(cell(0.0)), without_accept(cell(0.01))]
    result, warning = watched_in_turn(cells, speculative=True)
    assert (result.accept_length, result.clock_lag_s, result.lagged) == (None, 0.01, False)
    assert warning is not None and warning.startswith(
        "humaneval at batch 8: the server counted no speculative verify call for the cell, "
        "measured twice, though 5400 tokens arrived: no accept length")


def test_a_cell_measured_again_for_its_accept_length_that_then_lags_says_both():
    cells = [without_accept(cell(0.0)), cell(0.2)]
    result, warning = watched_in_turn(cells, speculative=True)
    assert (result.accept_length, result.lagged) == (3.0, True)
    assert warning is not None and warning.startswith(
        "humaneval at batch 8: its first window counted no verify call; measured again, the "
        "server's clock ran 200 ms behind its schedule on average")


def test_a_baseline_cell_has_no_accept_length_and_is_measured_once():
    measure = Measured(0.0)

    async def baseline() -> CellResult:
        return without_accept(await measure())

    result, warning = asyncio.run(measure_watched(baseline, 0.05, CLOCK_LAG_HINT, 20.0))
    assert (measure.calls, result.accept_length, warning) == (1, None, None)


def empty(c: CellResult) -> CellResult:
    """The cell as a window in which no token arrived (a stalled server)."""
    return dataclasses.replace(c, output_tok_s=0.0, output_tokens=0, requests=0,
                               accept_length=None)


def test_a_closed_loop_window_without_a_token_is_measured_again_and_the_second_kept():
    # Requests were in flight all along: 0 tok/s is a stall, not the tree's throughput.
    cells = [empty(cell(1.2)), cell(0.01)]
    result, warning = watched_in_turn(cells, closed_loop=True)
    assert (cells, result.output_tokens, result.lagged, warning) == ([], 5400, False, None)
    # Not only a lagging one: an empty window on a clock that kept time too.
    cells = [empty(cell(0.0)), cell(0.0)]
    watched_in_turn(cells, speculative=True, closed_loop=True)
    assert cells == []


def test_a_closed_loop_cell_empty_twice_fails_the_server_instead_of_reading_zero():
    cells = [empty(cell(1.2)), empty(cell(0.8))]
    with pytest.raises(MeasurementError) as raised:
        watched_in_turn(cells, closed_loop=True)
    assert str(raised.value).startswith(
        "humaneval at batch 8: no token arrived in two windows of 6 s, with 8 requests in "
        "flight: the server stalled (the server's clock ran 1200 ms, then 800 ms behind")
    assert CLOCK_LAG_HINT in str(raised.value)


def test_an_open_loop_window_without_a_token_is_a_measurement():
    # At a low request rate a window may see no token: that is what the rate serves.
    cells = [empty(cell(0.0))]
    result, warning = watched_in_turn(cells)
    assert (cells, result.output_tokens, warning) == ([], 0, None)


# ---- the load generator watches its own loop -----------------------------------------------

def test_a_blocked_load_generator_shows_as_client_lag_in_server_seconds():
    record = Record(workers=1)

    async def run() -> None:
        beat = asyncio.create_task(heartbeat(record))
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # a starved client in miniature: its loop cannot run at all
        await asyncio.sleep(0.05)
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat

    asyncio.run(run())
    late = [lateness for _, lateness in record.beats]
    assert max(late) >= 0.25 and min(late) >= 0  # the beat due during the block, met after
    everything = (record.beats[0][0], record.beats[-1][0] + 1.0)
    assert client_lag(record, everything, 10.0) == pytest.approx(10.0 * float(np.mean(late)))
    before = (record.beats[0][0] - 1.0, record.beats[0][0])
    assert client_lag(record, before, 10.0) is None  # no beat in that window



def beats_with_a_stall(stall_at: float, stall_s: float, until: float = 2.0) -> list:
    """A heartbeat's (time, lateness) every HEARTBEAT_S from 0, each 1 ms late, but the
    one due at `stall_at`, which fired `stall_s` late (the loop ran nothing meanwhile)."""
    beats, due = [], 0.0
    while due < until:
        late = stall_s if abs(due - stall_at) < HEARTBEAT_S / 2 else 0.001
        beats.append((due + late, late))
        due += late + HEARTBEAT_S
    return beats


def ending(at: float, start: float = 0.1) -> Stream:
    """A request sent at `start`, first token 20 ms later, last token stamped at `at`."""
    return Stream(start=start, chunks=[(start + 0.02, 1), (at, 100)], finished=True)


@pytest.mark.parametrize(("stalled", "calm", "lag"), [
    (5, 4, 0.08),  # the stall ended at most requests' last stamps: their median holds it
    (4, 5, None),  # at fewer than half: the median TPOT is not its, nor the lag
])
def test_a_stall_as_most_requests_end_is_client_lag_though_the_mean_hardly_moves(
        stalled, calm, lag):
    """A closed loop's requests of one length end together; one 80 ms stall of the load
    generator's loop then, on a busy 2-core machine, moved a cell's median TPOT 6.5-11%
    while its timers' mean lateness stayed 2.6 ms (under the 5 ms of wall time that a
    study's 50 ms of server time is at time scale 10)."""
    record = Record(workers=stalled + calm)
    record.beats = beats_with_a_stall(stall_at=0.92, stall_s=0.08)
    stall_end = next(at for at, late in record.beats if late == 0.08)
    # Stamped inside the stall's pass: just before its beat, and just after it.
    record.streams = ([ending(stall_end - 0.0001)] * (stalled - 1) + [ending(stall_end + 0.001)]
                      + [ending(1.5)] * calm)
    window = (0.0, 2.0)
    mean = float(np.mean([late for _, late in record.beats]))
    assert mean < 0.002
    measured = client_lag(record, window, 10.0, record.streams)
    assert measured == pytest.approx(10.0 * (lag if lag is not None else mean))
    # As a cell reports it: its completed requests are those it read its latencies of.
    cell = cell_result(DATASET, record, window, 10.0, 1, EMULATOR_API, Counters({}, {}),
                       batch=stalled + calm)
    assert cell.client_lag_s == pytest.approx(measured)
    assert client_lag(record, window, 10.0) == pytest.approx(10.0 * mean)  # timers alone


@pytest.mark.parametrize(("start", "first", "counts"), [
    (0.92, 0.95, True),  # sent as the stall began: sent late
    (0.9, 0.93, True),  # its first token stamped when the stall ended
    (0.5, 0.52, False),  # between its first and last tokens: its TPOT and e2e hold
    (0.5, 1.2, False),  # in its wait for a first token (a queue's): its stamps hold
    (1.0045, 1.03, False),  # sent just after the stall ended: nothing delayed
])
def test_a_stall_counts_where_it_can_move_a_requests_latencies(start, first, counts):
    """The stall: due at 0.924 s, its beat fired at 1.004 s (a review's cases)."""
    record = Record(workers=1)
    record.beats = beats_with_a_stall(stall_at=0.92, stall_s=0.08)
    assert [late for at, late in record.beats if 1.0 < at < 1.01] == [0.08]
    record.streams = [Stream(start=start, chunks=[(first, 1), (1.5, 100)], finished=True)]
    lag = client_lag(record, (0.0, 2.0), 1.0, record.streams)
    assert (lag == pytest.approx(0.08)) is counts


# ---- the load generator and its server get the CPU -----------------------------------------
# Ray starts its workers niced (15 above its own): beside CPU hogs at niceness 0 the load
# generator then ran its timers 0.2-0.4 s late at batch 8, and measured 0.36-0.48 of the
# throughput it measures alone (benchmarks/busy_machine.py).

def node_niceness() -> int:
    """What `normal_priority` brings a thread back to: its process's parent's niceness
    (for a Ray worker, the raylet's; here, whatever started pytest)."""
    return os.getpriority(os.PRIO_PROCESS, os.getppid())


def in_niced_thread(work: Callable[[], object], above: int = 7) -> object:
    """`work()` in a fresh thread `above` the node's niceness (on Linux niceness is per
    thread), as Ray runs its workers; returns what it returned."""
    out: list[object] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, node_niceness() + above)
            out.append(work())
        except BaseException as exc:  # raised again in the test's thread
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    if failed:
        raise failed[0]
    return out[0]


def this_niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


def test_a_niced_worker_measures_and_starts_its_server_at_the_nodes_niceness():
    if os.geteuid() != 0:
        pytest.skip("lowering niceness needs CAP_SYS_NICE (root here)")

    def work() -> tuple[str | None, int, int]:
        warning = normal_priority()
        child = subprocess.run([sys.executable, "-c", PRINT_NICENESS], capture_output=True,
                               text=True, check=True, timeout=60).stdout
        return warning, this_niceness(), int(child)

    node = node_niceness()
    assert in_niced_thread(work) == (None, node, node)


def refused(*args: int) -> None:
    raise PermissionError(1, "Operation not permitted")


def test_a_worker_that_may_not_lower_its_niceness_says_what_to_do(monkeypatch):
    def work() -> str | None:
        monkeypatch.setattr(os, "setpriority", refused)
        return normal_priority()

    node = node_niceness()
    warning = in_niced_thread(work)
    assert isinstance(warning, str) and warning.startswith(
        f"this launch ran at niceness {node + 7}, above the {node} of the Ray node")
    assert "RAY_worker_niceness=0" in warning


def test_a_worker_at_its_nodes_niceness_is_left_alone(monkeypatch):
    # A study run under `nice` on purpose keeps it: nothing above the node's to undo.
    def work() -> str | None:
        monkeypatch.setattr(os, "setpriority", refused)  # any attempt would say so
        return normal_priority()

    assert in_niced_thread(work, above=0) is None


@pytest.mark.ray_no_server  # one Ray task, no server: beside the heavy tests
@pytest.mark.usefixtures("ray_tmpdir")
def test_a_local_ray_starts_its_workers_at_the_niceness_of_what_started_it(tmp_path):
    # worker_niceness 0 is an increment: a worker runs at the niceness of what started the
    # study (0 in a plain run; a suite under `nice -n 5` has its workers at 5), not Ray's
    # default 15 above it.
    import ray

    from treetune.study.runner import _Ray
    from treetune.study.spec import load_study

    session = _Ray(load_study(None, small_study(tmp_path)))
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # not importable there
    try:
        niceness = ray.get(ray.remote(num_cpus=1)(this_niceness).remote(), timeout=120)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        session.shutdown()
    assert niceness == this_niceness()


NICED = "this launch ran at niceness 15 (a stand-in for a worker that may not lower it)"


def niced_workers() -> None:
    """A Ray worker setup hook: every launch reports the niceness it could not undo."""
    import treetune.study.worker

    treetune.study.worker.normal_priority = lambda: NICED


@pytest.mark.usefixtures("ray_tmpdir")
def test_a_warning_every_launch_carries_is_kept_with_each_and_printed_in_full_once(
        tmp_path):
    import ray

    from treetune.study.runner import run_study
    from treetune.study.spec import load_study

    spec = load_study(None, small_study(
        tmp_path, batch=[1], datasets=[DATASET], budget={"launches": 2}, workers=1,
        measurement={"duration_s": 2.0, "repeats": 2, "startup_timeout_s": 30.0,
                     "max_clock_lag_s": 0.25}))
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # not importable there
    ray.init(num_cpus=2, resources={spec.backend.gpu_resource: float(spec.tp)},
             include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"worker_process_setup_hook": niced_workers})
    notes: list[str] = []
    try:
        outcome = run_study(spec, lambda p: notes.extend(n for n in p.notes if n not in notes))
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert [r.ok and NICED in r.warnings for r in outcome.results] == [True, True], [
        (r.ok, r.reason, r.warnings) for r in outcome.results]
    assert [n for n in notes if NICED in n or "same warning" in n] == [
        f"baseline: {NICED}", "(3,4,8): the same warning as baseline"]


# ---- a CPU hog makes it happen ------------------------------------------------------------

@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[int]:
    """This process and whatever it starts pinned to one CPU, shared with `count` busy
    loops; yields the CPU. The hogs are killed and the affinity restored afterwards."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    os.sched_setaffinity(0, {cpu})
    hogs = []
    try:
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                 stdin=subprocess.DEVNULL) for _ in range(count)]
        yield cpu
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=10)
        os.sched_setaffinity(0, before)


@pytest.mark.slow
def test_cells_measured_while_cpu_hogs_share_the_emulators_cpu_are_flagged_not_kept_silently(
        tmp_path):
    from treetune.study.spec import load_study
    from treetune.study.worker import LaunchWorker

    # 100 times faster than the GPU, on a third of one CPU: a round of 20 ms lasts 0.2 ms of
    # wall time, far below the scheduler's time slice, so the clock cannot keep up.
    spec = load_study(None, small_study(
        tmp_path, batch=[4], rates=[20.0], datasets=[DATASET], compare=[],
        backend={"kind": "emulator", "profile": PROFILE, "time_scale": 100.0,
                 "load_time_s": 1.0, "noise": False},
        measurement={"duration_s": 20.0, "repeats": 2, "startup_timeout_s": 60.0,
                     "max_clock_lag_s": 0.02, "max_requests": 200}))
    with cpu_hogs(2):
        result = LaunchResult.from_dict(LaunchWorker(spec, 0).run("3,4,8", []))
    assert result.ok, (result.reason, result.log_tail)
    cells = [result.cell(DATASET, 4), result.rate_cell(DATASET, 20.0)]
    assert all(c is not None and c.lagged and c.clock_lag_s > 0.02 for c in cells), cells
    lag_warnings = [w for w in result.warnings if "behind its schedule" in w]
    assert [w.split(":")[0] for w in lag_warnings] == [
        "humaneval at batch 4", "humaneval at 20 req/s (poisson)"]
    assert all(w.endswith(f"To fix: {CLOCK_LAG_HINT} (time scale now 100).")
               for w in lag_warnings)
    assert wait_until(lambda: not server_processes(str(tmp_path)), 5)


@pytest.mark.parametrize(("counts", "measured"), [(False, 1), (True, 2)])
def test_a_server_that_counts_no_verify_calls_is_not_measured_again_for_them(counts, measured):
    cells = [without_accept(cell(0.0)), without_accept(cell(0.0))]

    async def counts_verify() -> bool:
        return counts

    async def measure() -> CellResult:
        return cells.pop(0)

    from treetune.backends.sglang import SGLANG_API

    result, warning = asyncio.run(measure_watched(measure, 0.05, CLOCK_LAG_HINT, 20.0,
                                                  speculative=True,
                                                  counts_verify=counts_verify,
                                                  api=SGLANG_API))
    assert 2 - len(cells) == measured and result.accept_length is None
    assert warning is not None
    assert warning.startswith("the server's metrics have no sglang:spec_verify_calls_total "
                              "(SGLang counts them from 0.5.13 on): no accept length") \
        is not counts


def test_a_remedy_many_warnings_share_is_said_in_full_once():
    """A busy machine lags cell after cell, each warning with its own numbers and the same
    long remedy: 11 notes of 600 characters in a 3-launch study (a helper's audit). The
    remedy is said once; a warning said before is named by reference."""
    from treetune.study.runner import warning_notes

    def lag(cell: str, ms: int) -> str:
        return f"{cell}: the clock ran {ms} ms behind. To fix: run fewer workers (time scale 50)."

    warned: dict[str, str] = {}
    remedies: set[str] = set()
    first = warning_notes("baseline", [lag("a", 53), lag("b", 90), "no accept length"],
                          warned, remedies)
    assert first == ["baseline: a: the clock ran 53 ms behind. To fix: run fewer workers "
                     "(time scale 50).",
                     "baseline: b: the clock ran 90 ms behind. To fix: as said above.",
                     "baseline: no accept length"]
    assert warning_notes("(3,1,4)", [lag("a", 53), lag("a", 7)], warned, remedies) == [
        "(3,1,4): the same warning as baseline",
        "(3,1,4): a: the clock ran 7 ms behind. To fix: as said above."]
