"""An open loop's schedule and what a cell makes of streamed responses: arrival times,
per-request latencies, percentiles and goodput, the results' schema for rate cells, and
rate cells in a study spec. No server here: test_loadgen.py measures cells on one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from studykit import small_study

from treetune.errors import TreetuneError
from treetune.loadgen import arrival_times, percentiles, request_latency, summarize
from treetune.results import CellResult, Latency, LaunchResult, Slo
from treetune.study.spec import load_study
from treetune.yamlio import dump_yaml

# ---- the arrival schedule ---------------------------------------------------------------

def test_poisson_arrivals_come_at_the_asked_rate_within_3_percent_over_a_long_run():
    times = arrival_times(5.0, duration_s=40_000.0, max_requests=1_000_000, seed=7)
    assert len(times) / 40_000.0 == pytest.approx(5.0, rel=0.03)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.03)
    # Exponential gaps: as spread as they are long (fixed intervals would have none).
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)
    # Counts per second are Poisson: variance equal to the mean.
    counts = np.bincount(times.astype(int))
    assert counts.var() / counts.mean() == pytest.approx(1.0, rel=0.05)


def test_poisson_arrivals_are_the_same_for_the_same_seed_and_differ_for_another():
    one = arrival_times(3.0, duration_s=100.0, max_requests=1000, seed=1)
    assert np.array_equal(one, arrival_times(3.0, duration_s=100.0, max_requests=1000, seed=1))
    assert not np.array_equal(one, arrival_times(3.0, duration_s=100.0, max_requests=1000,
                                                 seed=2))
    assert np.all(np.diff(one) > 0) and one[0] > 0


def test_fixed_interval_arrivals_are_exactly_one_every_1_over_rate_from_zero():
    times = arrival_times(4.0, duration_s=10.0, max_requests=1000, arrival="fixed")
    assert np.array_equal(times, np.arange(40) / 4.0)


@pytest.mark.parametrize("arrival", ["poisson", "fixed"])
def test_arrivals_stop_at_max_requests_or_before_duration_s_whichever_comes_first(arrival):
    by_count = arrival_times(10.0, duration_s=1000.0, max_requests=25, arrival=arrival)
    assert len(by_count) == 25 and by_count[-1] < 1000.0
    by_time = arrival_times(10.0, duration_s=3.0, max_requests=10_000, arrival=arrival)
    assert by_time[-1] < 3.0 and 20 < len(by_time) < 45
    # A long schedule is drawn in several chunks without leaving a gap or stopping short.
    long = arrival_times(50.0, duration_s=200.0, max_requests=100_000, arrival=arrival)
    assert 200.0 - long[-1] < 1.0 and np.all(np.diff(long) > 0)


@pytest.mark.parametrize("bad", [dict(rate=0.0), dict(duration_s=0.0), dict(max_requests=0),
                                 dict(arrival="bursty")])
def test_an_impossible_schedule_is_refused(bad):
    args = {"rate": 1.0, "duration_s": 1.0, "max_requests": 1, **bad}
    with pytest.raises(ValueError):
        arrival_times(args.pop("rate"), **args)


# ---- latencies from a stream ------------------------------------------------------------

def test_a_streams_ttft_tpot_itl_and_e2e_come_from_its_chunk_times():
    # Sent at 10.0 s; chunks of 1, 3, 2 and 4 tokens (a speculative round brings several).
    chunks = [(10.2, 1), (10.3, 4), (10.45, 6), (10.5, 10)]
    r = request_latency(10.0, chunks)
    assert r.ttft_s == pytest.approx(0.2)
    assert r.e2e_s == pytest.approx(0.5)
    assert r.tpot_s == pytest.approx((0.5 - 0.2) / (10 - 1))
    assert r.itl_s == pytest.approx((0.1, 0.15, 0.05))


def test_latencies_are_in_server_time_on_a_server_faster_than_real_time():
    r = request_latency(0.0, [(0.01, 1), (0.03, 5)], scale=10.0)
    assert (r.ttft_s, r.e2e_s, r.tpot_s) == pytest.approx((0.1, 0.3, 0.05))
    assert r.itl_s == pytest.approx((0.2,))


def test_a_one_token_response_has_a_ttft_but_no_tpot_or_itl():
    r = request_latency(1.0, [(1.25, 1)])
    assert (r.ttft_s, r.e2e_s, r.tpot_s, r.itl_s) == (pytest.approx(0.25), pytest.approx(0.25),
                                                      None, ())


def test_percentiles_are_numpys_p50_p90_p99_and_none_without_values():
    assert percentiles(range(1, 101)) == Latency(p50=50.5, p90=pytest.approx(90.1),
                                                 p99=pytest.approx(99.01))
    assert percentiles([]) is None


def test_a_cells_summary_pools_every_chunk_gap_and_counts_goodput_per_second_of_window():
    fast = request_latency(0.0, [(0.1, 1), (0.2, 3), (0.3, 5)])  # ttft 0.1, tpot 0.05
    slow = request_latency(0.0, [(0.5, 1), (1.3, 5)])  # ttft 0.5, tpot 0.2
    single = request_latency(0.0, [(0.2, 1)])  # ttft 0.2, no tpot
    summary = summarize([fast, slow, single], window_s=2.0,
                        slo=Slo(ttft_ms=300, tpot_ms=100))
    assert summary.ttft == percentiles([0.1, 0.5, 0.2])
    assert summary.tpot == percentiles([0.05, 0.2])
    assert summary.itl == percentiles([0.1, 0.1, 0.8])
    assert summary.e2e == percentiles([0.3, 1.3, 0.2])
    assert summary.goodput == pytest.approx(2 / 2.0)  # fast and single meet it, slow does not


@pytest.mark.parametrize("slo,met", [
    (Slo(ttft_ms=100), 1), (Slo(tpot_ms=60), 2), (Slo(ttft_ms=1000, tpot_ms=1000), 3),
    (Slo(ttft_ms=50), 0)])
def test_goodput_counts_requests_within_every_bound_the_slo_sets(slo, met):
    requests = [request_latency(0.0, [(0.1, 1), (0.3, 5)]),  # ttft 0.1, tpot 0.05
                request_latency(0.0, [(0.2, 1), (0.4, 5)]),  # ttft 0.2, tpot 0.05
                request_latency(0.0, [(0.3, 1), (1.1, 5)])]  # ttft 0.3, tpot 0.2
    assert summarize(requests, 1.0, slo).goodput == pytest.approx(met)


def test_no_slo_or_an_empty_one_gives_no_goodput():
    requests = [request_latency(0.0, [(0.1, 1)])]
    assert summarize(requests, 1.0).goodput is None
    assert summarize(requests, 1.0, Slo()).goodput is None


def test_an_slo_bound_must_be_positive():
    with pytest.raises(ValueError, match=r"slo\.tpot_ms must be > 0"):
        Slo(tpot_ms=0)


# ---- results ----------------------------------------------------------------------------

OLD_CELL = {  # a cell as stored before open loops existed
    "dataset": "humaneval", "batch": 8, "output_tok_s": 900.0, "accept_length": 3.1,
    "requests": 12, "output_tokens": 5400, "duration_s": 6.0,
    "ttft": {"p50": 0.1, "p90": 0.2, "p99": 0.3}, "tpot": None, "errors": 0,
    "repeats": [880.0, 920.0], "launch_tok_s": []}


def test_a_cell_stored_before_open_loops_still_loads_as_a_closed_loop_cell():
    cell = CellResult.from_dict(OLD_CELL)
    assert (cell.batch, cell.rate, cell.arrival, cell.itl, cell.e2e, cell.goodput) == (
        8, None, "", None, None, None)
    assert (cell.clock_lag_s, cell.client_lag_s, cell.lagged, cell.unfinished) == (
        None, None, False, 0)
    assert cell.label == "humaneval at batch 8"
    launch = LaunchResult.from_dict({"config": "3,4,8", "ok": True, "cells": [OLD_CELL]})
    assert launch.rate_cells == [] and launch.cell("humaneval", 8) == cell


def test_a_rate_cell_round_trips_and_is_never_found_as_a_batch_cell():
    base = CellResult.from_dict(OLD_CELL)
    rate_cell = dataclasses.replace(
        base, batch=0, rate=2.0, arrival="poisson", request_rate=1.9,
        itl=Latency(0.02, 0.03, 0.05), e2e=Latency(1.0, 2.0, 3.0), slo=Slo(tpot_ms=50),
        goodput=1.5, unfinished=1, clock_lag_s=0.004, lagged=True, client_lag_s=0.002)
    launch = LaunchResult.from_dict({"config": "3,4,8", "ok": True, "cells": [OLD_CELL]})
    launch.rate_cells.append(rate_cell)
    again = LaunchResult.from_dict(launch.to_dict())
    assert again.rate_cells == [rate_cell] and again.cells == [base]
    assert again.rate_cell("humaneval", 2.0) == rate_cell
    assert again.cell("humaneval", 0) is None and again.rate_cell("humaneval", 8.0) is None
    assert rate_cell.label == "humaneval at 2 req/s (poisson)"


# ---- rate cells in a study --------------------------------------------------------------

def test_a_study_takes_rates_an_slo_and_an_arrival_process(tmp_path):
    spec = load_study(None, small_study(
        tmp_path, rates=[2, 8.5], slo={"tpot_ms": 50, "ttft_ms": 2000},
        measurement={"duration_s": 6.0, "arrival": "fixed", "max_requests": 40}))
    assert spec.rates == (2.0, 8.5)
    assert spec.slo == Slo(ttft_ms=2000, tpot_ms=50)
    assert (spec.measurement.arrival, spec.measurement.max_requests) == ("fixed", 40)
    spec.save(tmp_path / "copy.yaml")
    again = load_study(tmp_path / "copy.yaml")
    assert again.rates == spec.rates and again.slo == spec.slo
    assert again.fingerprint() == spec.fingerprint()


def test_a_study_without_rate_cells_keeps_the_fingerprint_it_had_before_them(tmp_path):
    plain = load_study(None, small_study(tmp_path, measurement={"duration_s": 6.0}))
    assert plain.fingerprint() == load_study(None, small_study(
        tmp_path, rates=[], slo={}, measurement={"duration_s": 6.0, "arrival": "poisson",
                                                 "max_requests": 1000,
                                                 "max_clock_lag_s": 0.05})).fingerprint()
    assert plain.fingerprint() != load_study(None, small_study(
        tmp_path, rates=[2], measurement={"duration_s": 6.0})).fingerprint()


@pytest.mark.parametrize("over,key", [
    (dict(rates=[0]), "rates"), (dict(rates=[2, 2]), "rates"),
    # 0.05 req/s for 10 s: an empty schedule, no latency, every tree vetoed (an audit)
    (dict(rates=[0.05], measurement={"duration_s": 10.0}), "rates"),
    (dict(slo={"tpot_ms": -1}), "slo.tpot_ms"), (dict(slo={"tpot": 5}), "slo.tpot"),
    (dict(measurement={"arrival": "bursty"}), "measurement.arrival"),
    (dict(measurement={"max_clock_lag_s": 0}), "measurement.max_clock_lag_s")])
def test_a_bad_rate_slo_or_arrival_in_a_study_file_is_refused_naming_its_key(tmp_path, over,
                                                                            key):
    path = tmp_path / "study.yaml"
    dump_yaml(small_study(tmp_path, **over), path)
    with pytest.raises(TreetuneError, match=rf"study\.yaml.*{key.replace('.', '[.]')}"):
        load_study(path)


def test_a_rate_too_low_to_send_a_request_in_the_window_is_refused_saying_why(tmp_path):
    """0.05 req/s for 10 s sent no request: no latency, and every tree was vetoed there."""
    with pytest.raises(TreetuneError, match=r"rate 0.05 req/s sends about 0.5 requests in "
                                            r"measurement.duration_s \(10 s\): too few"):
        load_study(None, small_study(tmp_path, rates=[0.05], measurement={"duration_s": 10.0}))
