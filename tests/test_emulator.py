"""The emulated SGLang server, tested for real as a subprocess over HTTP.

Each test states one property an SGLang client (the tuner, a benchmark harness) relies on.
All servers run with `--seed` and `--no-noise`, so timings and acceptance follow the
noise-free performance model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from studykit import wait_until

from treetune.config import BASELINE, TreeConfig
from treetune.emulator.args import EMULATED_SGLANG_VERSION, LaunchError, parse
from treetune.perfmodel import PerfModel, check_memory, load_profile

if TYPE_CHECKING:
    from conftest import Emulator, EmulatorFactory

CODER = "qwen3-coder-next-h200"
MOE_30B = "qwen3-30b-a3b-h100"
DATASET = "humaneval"
HEADERS = {"X-Treetune-Dataset": DATASET}
TREE = TreeConfig(3, 4, 8)


def tree_flags(steps: int, topk: int, draft_tokens: int) -> list[str]:
    return ["--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", "thoughtworks/Qwen3-Coder-Next-Eagle3",
            "--speculative-num-steps", str(steps),
            "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(draft_tokens)]


def server_args(*extra: str, profile: str = CODER, tp: int | None = 4) -> list[str]:
    args = ["--profile", profile, "--model-path", "Qwen/Qwen3-Coder-Next",
            "--seed", "1", "--no-noise"]
    if tp is not None:
        args += ["--tp-size", str(tp)]
    return [*args, *extra]


SPEC_ARGS = server_args(*tree_flags(TREE.steps, TREE.topk, TREE.draft_tokens),
                        "--enable-metrics", "--max-running-requests", "4",
                        "--time-scale", "50", "--load-time", "0")


# What a client sees while a request runs depends on the server's event loop getting a turn
# between the engine's rounds: a stream is sent in several chunks only if its handler runs
# between rounds, and /metrics answers only when the engine waits for its next deadline (an
# engine behind its clock catches up round after round without yielding). At time scale 50
# a round of (3,4,8) lasts 0.2 ms of wall time, a 48-token stream 4 ms, and a busy machine
# coalesces the stream into one chunk or starves /metrics for a whole batch. At time scale
# 0.5 a round lasts 23-30 ms and such a stream 0.4 s: a hundred times any scheduling delay.
SLOW_SCALE = 0.5
SLOW_ARGS = server_args(*tree_flags(TREE.steps, TREE.topk, TREE.draft_tokens),
                        "--enable-metrics", "--max-running-requests", "4",
                        "--time-scale", str(SLOW_SCALE), "--load-time", "0")


@pytest.fixture(scope="module")
def spec_server(module_emulators: EmulatorFactory) -> Emulator:
    """One speculative (3,4,8) server, at most 4 running requests, shared by the API tests."""
    return module_emulators.healthy(*SPEC_ARGS)


@pytest.fixture(scope="module")
def slow_server(module_emulators: EmulatorFactory) -> Emulator:
    """The same server on a slow clock, for the tests that watch requests while they run."""
    return module_emulators.healthy(*SLOW_ARGS)


# ---- helpers -----------------------------------------------------------------------------

def post(server: Emulator, path: str, body: dict, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=timeout)


def sse_events(server: Emulator, path: str, body: dict) -> list[str]:
    """The `data:` payloads of a streamed response, in order (including '[DONE]')."""
    events = []
    with httpx.stream("POST", server.url + path, json=body, headers=HEADERS,
                      timeout=30.0) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line:
                assert line.startswith("data: "), line
                events.append(line.removeprefix("data: "))
    return events


def json_events(events: list[str]) -> list[dict]:
    assert events[-1] == "[DONE]"
    assert "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def words(text: str) -> int:
    """The emulator's tokens are space-prefixed words."""
    return text.count(" ")


def server_info(server: Emulator, path: str = "/server_info") -> dict:
    resp = httpx.get(server.url + path, timeout=10)
    assert resp.status_code == 200
    return resp.json()


def metrics(server: Emulator) -> dict[str, float]:
    """Every sample of /metrics by sample name (labels dropped: one model per server)."""
    resp = httpx.get(server.url + "/metrics", timeout=10)
    assert resp.status_code == 200
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            if "le" not in sample.labels:
                samples[sample.name] = sample.value
    return samples


def flush(server: Emulator) -> None:
    resp = httpx.post(server.url + "/flush_cache", timeout=10)
    assert resp.status_code == 200, resp.text


async def concurrent_generate(server: Emulator, n: int, max_new_tokens: int) -> list[dict]:
    async with aiohttp.ClientSession(headers=HEADERS) as session:
        async def one(i: int) -> dict:
            body = {"text": f"request {i}",
                    "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
            async with session.post(server.url + "/generate", json=body) as resp:
                assert resp.status == 200
                return await resp.json()
        return await asyncio.gather(*(one(i) for i in range(n)))


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is `pid`, read from /proc."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state, ppid, ...
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry.name))
    return kids


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# ---- 1. loading --------------------------------------------------------------------------

def test_health_endpoints_answer_503_while_loading_and_200_once_loaded(emulators):
    server = emulators.start(*server_args("--load-time", "3", "--time-scale", "2"))
    server.wait_status(503)  # listening, still loading (1.5 s of wall time)
    assert server.health_status("/health_generate") == 503
    loading = httpx.post(server.url + "/generate", headers=HEADERS, timeout=5,
                         json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
    assert loading.status_code == 503
    server.wait_status(200, timeout=10)
    assert server.health_status("/health_generate") == 200


# ---- 2. /generate ------------------------------------------------------------------------

def test_generate_returns_exactly_max_new_tokens_with_ignore_eos_and_spec_meta_info(
        spec_server):
    body = {"text": "def fib(n):",
            "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    resp = post(spec_server, "/generate", body)
    assert resp.status_code == 200
    out = resp.json()
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 64
    assert words(out["text"]) == 64
    assert meta["finish_reason"]["type"] == "length"
    assert meta["prompt_tokens"] >= 1
    assert meta["spec_verify_ct"] >= 64 / (TREE.steps + 1)
    assert meta["spec_accept_length"] == pytest.approx(64 / meta["spec_verify_ct"])
    assert 1.0 < meta["spec_accept_length"] <= TREE.steps + 1


def test_generate_streams_sse_chunks_ending_with_done(slow_server):
    body = {"text": "def fib(n):", "stream": True,
            "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}
    chunks = json_events(sse_events(slow_server, "/generate", body))
    assert len(chunks) > 1
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts)
    # Each chunk's meta_info describes the text it carries.
    assert [words(c["text"]) for c in chunks] == counts
    reasons = [c["meta_info"]["finish_reason"] for c in chunks]
    assert reasons[:-1] == [None] * (len(chunks) - 1)  # only the last chunk is finished
    assert reasons[-1]["type"] == "length"
    final = chunks[-1]
    assert final["meta_info"]["completion_tokens"] == 48
    assert words(final["text"]) == 48  # /generate streams the cumulative text
    assert final["meta_info"]["spec_verify_ct"] >= 1
    assert final["meta_info"]["spec_accept_length"] > 1.0


# ---- 3. OpenAI routes --------------------------------------------------------------------

OPENAI_ROUTES = {
    "completions": ("/v1/completions", {"prompt": "def fib(n):"}),
    "chat": ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "Write fib in Python."}]}),
}


@pytest.mark.parametrize("route", OPENAI_ROUTES)
def test_openai_route_returns_openai_shaped_completion_stopped_by_length(spec_server, route):
    path, prompt = OPENAI_ROUTES[route]
    body = {**prompt, "model": "Qwen/Qwen3-Coder-Next", "max_tokens": 40, "ignore_eos": True}
    resp = post(spec_server, path, body)
    assert resp.status_code == 200
    out = resp.json()
    assert out["object"] == ("chat.completion" if route == "chat" else "text_completion")
    assert out["model"] == "Qwen/Qwen3-Coder-Next"
    assert out["id"]
    [choice] = out["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "length"
    if route == "chat":
        assert choice["message"]["role"] == "assistant"
        text = choice["message"]["content"]
    else:
        text = choice["text"]
    assert words(text) == 40
    usage = out["usage"]
    assert usage["completion_tokens"] == 40
    assert usage["prompt_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize(("path", "body", "fragment"), [
    ("/generate", {"text": "hi", "sampling_params": "x"}, "'sampling_params' must be a JSON "
     "object"),
    ("/generate", {"text": "hi", "sampling_params": [1]}, "'sampling_params' must be"),
    ("/generate", {"input_ids": "abc"}, "input_ids must be a list of token ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True,
                         "stream_options": "x"}, "'stream_options' must be a JSON object"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n=2 is not emulated"),
])
def test_a_field_of_the_wrong_type_or_n_above_one_is_a_400_not_a_crash(spec_server, path, body,
                                                                      fragment):
    resp = post(spec_server, path, body)
    assert resp.status_code == 400
    # In SGLang's shapes: /generate's {"error": {"message"}}, the OpenAI endpoints' error
    # object (OpenAIServingBase.create_error_response).
    if path == "/generate":
        assert fragment in resp.json()["error"]["message"]
    else:
        error = resp.json()
        assert fragment in error.pop("message")
        assert error == {"object": "error", "type": "BadRequestError", "param": None,
                         "code": 400}


def test_a_completion_takes_token_ids_as_one_prompt_and_max_tokens_zero(spec_server):
    out = post(spec_server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5,
                                                "ignore_eos": True}).json()
    assert out["usage"]["prompt_tokens"] == 3 and out["usage"]["completion_tokens"] == 5
    none = post(spec_server, "/v1/completions", {"prompt": "hi", "max_tokens": 0}).json()
    assert none["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("route", OPENAI_ROUTES)
def test_openai_route_streams_deltas_then_a_usage_chunk_when_include_usage(slow_server,
                                                                          route):
    path, prompt = OPENAI_ROUTES[route]
    body = {**prompt, "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = json_events(sse_events(slow_server, path, body))
    *deltas, usage_chunk = chunks
    assert len(deltas) > 1
    kind = "chat.completion.chunk" if route == "chat" else "text_completion"
    assert {c["object"] for c in chunks} == {kind}
    assert len({c["id"] for c in chunks}) == 1
    texts = [c["choices"][0]["delta"]["content"] if route == "chat" else c["choices"][0]["text"]
             for c in deltas]
    assert sum(words(t) for t in texts) == 40  # deltas, not cumulative text
    if route == "chat":  # the role once, in the first delta, as SGLang sends it
        assert [c["choices"][0]["delta"].get("role") for c in deltas] == [
            "assistant", *[None] * (len(deltas) - 1)]
    reasons = [c["choices"][0]["finish_reason"] for c in deltas]
    assert reasons[-1] == "length"
    assert set(reasons[:-1]) == {None}
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 40
    assert usage_chunk["usage"]["total_tokens"] == (
        usage_chunk["usage"]["prompt_tokens"] + 40)


@pytest.mark.parametrize("route", OPENAI_ROUTES)
def test_openai_stream_without_include_usage_has_no_usage_chunk(spec_server, route):
    path, prompt = OPENAI_ROUTES[route]
    body = {**prompt, "max_tokens": 8, "ignore_eos": True, "stream": True}
    chunks = json_events(sse_events(spec_server, path, body))
    assert all(c["choices"] for c in chunks)
    assert all("usage" not in c or c["usage"] is None for c in chunks)


# ---- 4. /server_info ---------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_reports_resolved_speculative_args_and_version(spec_server, path):
    info = server_info(spec_server, path)
    assert info["speculative_algorithm"] == "EAGLE3"
    assert info["speculative_draft_model_path"] == "thoughtworks/Qwen3-Coder-Next-Eagle3"
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"],
            info["speculative_num_draft_tokens"]) == (3, 4, 8)
    assert info["tp_size"] == 4
    assert info["max_running_requests"] == 4
    assert info["version"] == EMULATED_SGLANG_VERSION
    assert info["emulator"]["time_scale"] == 50
    assert "avg_spec_accept_length" in info["internal_states"][0]
    assert info["speculative_adaptive"] is False  # a static tree, as asked


def test_avg_spec_accept_length_is_completion_tokens_per_verify_call_since_flush(spec_server):
    flush(spec_server)
    before = server_info(spec_server)
    assert before["internal_states"][0]["avg_spec_accept_length"] == 0.0

    asyncio.run(concurrent_generate(spec_server, 4, max_new_tokens=1024))

    after = server_info(spec_server)
    avg = after["internal_states"][0]["avg_spec_accept_length"]
    tokens = after["emulator"]["completion_tokens"] - before["emulator"]["completion_tokens"]
    verify = after["emulator"]["verify_calls"] - before["emulator"]["verify_calls"]
    assert tokens == 4 * 1024
    assert avg == pytest.approx(tokens / verify)
    assert 1.0 < avg <= TREE.steps + 1  # long outputs: never above steps + 1
    # Both totals (since start) match the Prometheus counters.
    samples = metrics(spec_server)
    assert samples["sglang:generation_tokens_total"] == after["emulator"]["completion_tokens"]
    assert samples["sglang:spec_verify_calls_total"] == after["emulator"]["verify_calls"]


def test_flush_cache_on_an_idle_server_resets_the_average_accept_length(spec_server):
    asyncio.run(concurrent_generate(spec_server, 1, max_new_tokens=32))
    assert server_info(spec_server)["internal_states"][0]["avg_spec_accept_length"] > 1.0
    flush(spec_server)
    assert server_info(spec_server)["internal_states"][0]["avg_spec_accept_length"] == 0.0


def wait_idle(server: Emulator, seconds: float) -> bool:
    """Whether `server` has no running request within `seconds`."""
    return wait_until(lambda: metrics(server)["sglang:num_running_reqs"] == 0, seconds, 0.05)


def test_prometheus_counters_agree_with_server_info_after_clients_disconnect_mid_stream(
        spec_server):
    # A client hanging up mid-round cancels its request; that round must then count it as
    # verified either everywhere or nowhere.
    async def leave_early(i: int) -> None:
        body = {"prompt": f"p{i}", "max_tokens": 4096, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession(headers=HEADERS) as session, \
                session.post(spec_server.url + "/v1/completions", json=body) as resp:
            for _ in range(5):
                await resp.content.readline()
            resp.close()  # hang up mid-stream

    async def main() -> None:
        await asyncio.gather(*(leave_early(i) for i in range(4)))

    asyncio.run(main())
    assert wait_idle(spec_server, 5), "abandoned requests still count as running"
    info = server_info(spec_server)
    samples = metrics(spec_server)
    assert samples["sglang:num_running_reqs"] == 0
    assert samples["sglang:generation_tokens_total"] == info["emulator"]["completion_tokens"]
    assert samples["sglang:spec_verify_calls_total"] == info["emulator"]["verify_calls"]


def test_token_and_verify_counters_move_as_requests_end_as_sglang_counts_them(slow_server):
    """SGLang adds a request's tokens and verify calls to its Prometheus counters when the
    request ends (`observe_one_finished_request`), not round by round: mid-stream the
    counters stand while server_info's totals grow; once the client hangs up (the request
    ends aborted) they hold its tokens. On the slow clock: at the fast one a busy machine's
    client read its 20 lines after the whole 4096-token request had ended (the counters
    then rightly held its tokens mid-read)."""
    assert wait_idle(slow_server, 30), "the shared server never fell idle"
    start = metrics(slow_server)
    seen: dict[str, float] = {}

    async def long_request() -> None:
        body = {"prompt": "p", "max_tokens": 4096, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession(headers=HEADERS) as session, \
                session.post(slow_server.url + "/v1/completions", json=body) as resp:
            for _ in range(20):
                await resp.content.readline()
            seen.update(metrics(slow_server))
            assert seen["sglang:num_running_reqs"] == 1, "the request ended before the read"
            seen["info tokens"] = server_info(slow_server)["emulator"]["completion_tokens"]
            resp.close()

    asyncio.run(long_request())
    # On an idle server the counter and server_info's total agree: tokens were made.
    assert seen["info tokens"] > start["sglang:generation_tokens_total"]
    assert seen["sglang:generation_tokens_total"] == start["sglang:generation_tokens_total"]
    assert seen["sglang:spec_verify_calls_total"] == start["sglang:spec_verify_calls_total"]
    assert wait_idle(slow_server, 5), "the abandoned request still counts as running"
    end = metrics(slow_server)
    assert end["sglang:generation_tokens_total"] > start["sglang:generation_tokens_total"]
    assert end["sglang:spec_verify_calls_total"] > start["sglang:spec_verify_calls_total"]


# ---- 5. /metrics -------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 20000,
                                                     "ignore_eos": True}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 20000, "ignore_eos": True}),
])
def test_a_client_that_leaves_a_non_streaming_request_aborts_it(slow_server, path, body):
    # On the slow clock the request would run for minutes; its client waits 1 s.
    with pytest.raises(httpx.TimeoutException):
        post(slow_server, path, body, timeout=1.0)
    deadline = time.monotonic() + 20.0
    while metrics(slow_server)["sglang:num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metrics(slow_server)["sglang:num_running_reqs"] == 0


def test_an_idle_server_reports_no_running_request_and_no_kv_in_use(spec_server):
    asyncio.run(concurrent_generate(spec_server, 2, max_new_tokens=32))
    idle = metrics(spec_server)  # the requests have ended: nothing holds the KV cache
    assert idle["sglang:num_running_reqs"] == 0 and idle["sglang:token_usage"] == 0


def test_metrics_expose_sglang_gauges_counters_and_histograms(spec_server):
    asyncio.run(concurrent_generate(spec_server, 2, max_new_tokens=32))
    resp = httpx.get(spec_server.url + "/metrics", timeout=10)
    assert resp.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    gauges = ["spec_accept_length", "spec_accept_rate", "gen_throughput", "num_running_reqs",
              "num_queue_reqs", "token_usage"]
    counters = ["spec_verify_calls", "generation_tokens", "prompt_tokens"]
    histograms = ["time_to_first_token_seconds", "inter_token_latency_seconds",
                  "e2e_request_latency_seconds"]
    for name in gauges:
        assert families[f"sglang:{name}"].type == "gauge", name
    for name in counters:
        family = families[f"sglang:{name}"]
        assert family.type == "counter", name
        assert {s.name for s in family.samples} == {f"sglang:{name}_total"}
        assert family.samples[0].value > 0
        assert family.samples[0].labels["model_name"] == "Qwen/Qwen3-Coder-Next"
    for name in histograms:
        family = families[f"sglang:{name}"]
        assert family.type == "histogram", name
        count = next(s for s in family.samples if s.name.endswith("_count"))
        assert count.value > 0
    accept = families["sglang:spec_accept_length"].samples[0].value
    assert 1.0 <= accept <= TREE.steps + 1
    rate = families["sglang:spec_accept_rate"].samples[0].value
    assert rate == pytest.approx((accept - 1.0) / TREE.steps)


# ---- 9. batching limit -------------------------------------------------------------------

def test_running_requests_never_exceed_max_running_requests_and_all_complete(slow_server):
    samples: list[tuple[float, float]] = []

    async def sample_metrics(done: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            while not done.is_set():
                async with session.get(slow_server.url + "/metrics") as resp:
                    text = await resp.text()
                values = {s.name: s.value for f in text_string_to_metric_families(text)
                          for s in f.samples}
                samples.append((values["sglang:num_running_reqs"],
                                values["sglang:num_queue_reqs"]))
                await asyncio.sleep(0.01)

    async def main() -> list[dict]:
        done = asyncio.Event()
        sampler = asyncio.create_task(sample_metrics(done))
        try:
            # Two waves of four requests, each about 0.7 s on the slow clock.
            return await concurrent_generate(slow_server, 8, max_new_tokens=64)
        finally:
            done.set()
            await sampler

    results = asyncio.run(main())
    assert [r["meta_info"]["completion_tokens"] for r in results] == [64] * 8
    assert len(samples) >= 10
    assert max(running for running, _ in samples) == 4  # reached, never exceeded
    assert max(queued for _, queued in samples) > 0  # the other requests waited


# ---- 6. refusals -------------------------------------------------------------------------

REFUSALS = {
    "tree too large for its pool": (
        server_args(*tree_flags(2, 2, 20)), "selected index out of range"),
    "partial tree knobs": (
        server_args("--speculative-algorithm", "EAGLE3",
                    "--speculative-draft-model-path", "d", "--speculative-num-steps", "3"),
        "must be set together"),
    "tree knob without an algorithm": (
        server_args("--speculative-num-steps", "3"), "without --speculative-algorithm"),
    # The weights leave no KV pool in 38% of the H100 (SGLang's one memory refusal).
    "out of memory": (
        server_args(*tree_flags(3, 1, 4), "--max-running-requests", "8",
                    "--mem-fraction-static", "0.38", profile=MOE_30B, tp=None),
        "Not enough memory. Please try to increase --mem-fraction-static"),
    # 128 x 64 tokens in flight need 5.5 GB of workspace; 95% static leaves 4 GB.
    "workspace out of memory": (
        server_args(*tree_flags(8, 8, 64), "--max-running-requests", "128",
                    "--mem-fraction-static", "0.95", profile=MOE_30B, tp=None),
        "CUDA out of memory while capturing CUDA graphs: lower --mem-fraction-static"),
    "more tensor-parallel ranks than GPUs": (server_args(tp=8), "needs 8 GPUs"),
}


@pytest.mark.parametrize(("flag", "value"), [("--load-time", "-1"), ("--time-scale", "0")])
def test_an_emulator_switch_out_of_range_is_refused_before_anything_loads(flag, value):
    with pytest.raises(LaunchError, match=f"{flag} must be"):
        parse(["--profile", "qwen3-8b-h100", "--model-path", "m", flag, value])


def test_the_out_of_memory_refusal_cases_cannot_start_while_a_small_tree_fits():
    profile = load_profile(MOE_30B)
    assert not check_memory(profile, TreeConfig(3, 1, 4), 8, mem_fraction_static=0.38).starts
    assert not check_memory(profile, TreeConfig(8, 8, 64), 128,
                            mem_fraction_static=0.95).starts
    assert check_memory(profile, TreeConfig(3, 1, 4), 128).fits


# How long a refused launch may take to exit: the time a good one gets to become healthy
# (conftest.STARTUP_TIMEOUT_S). Its interpreter and imports alone take seconds on a busy
# machine, so what shows that the refusal comes first is the order: no server was made
# (no "emulating ..." line, which a launch that passes its checks logs at once).
REFUSED_WITHIN_S = 20.0


@pytest.mark.parametrize("case", REFUSALS)
def test_refused_launch_exits_nonzero_before_serving_with_the_reason_on_stderr(emulators, case):
    args, reason = REFUSALS[case]
    server = emulators.start(*args)
    assert server.wait_exit(timeout=REFUSED_WITHIN_S) != 0
    assert reason in server.stderr
    assert "emulating" not in server.stderr


def test_small_tree_at_the_same_memory_setting_launches(emulators):
    server = emulators.start(*server_args(*tree_flags(3, 1, 4), "--max-running-requests", "128",
                                          "--load-time", "0", profile=MOE_30B, tp=None))
    server.wait_healthy()


def test_a_kv_pool_smaller_than_the_requests_asked_runs_what_it_holds_and_says_so(
        emulators):
    """SGLang does not refuse a server whose pool cannot hold --max-running-requests'
    reserve: it admits requests while the pool has room and retracts them when it runs
    short. The emulator exited "Not enough memory" (a helper's audit against SGLang's
    source); it now serves, running as many at once as the pool holds (7 here).

    Twelve long streams are sent, and the gauges read once seven of them have their first
    tokens, while all seven still run: no clock is raced. (It polled the gauge while twelve
    400-token requests ran at time scale 50, about 0.1 s of wall time, and once saw none
    running: every poll fell before or after the run.)"""
    server = emulators.start(*server_args(*tree_flags(2, 8, 44), "--max-running-requests",
                                          "128", "--mem-fraction-static", "0.41",
                                          "--enable-metrics", "--load-time", "0",
                                          profile=MOE_30B, tp=None))
    server.wait_healthy()
    assert "the KV pool holds 7 of the 128 running requests asked for" in server.stderr

    async def load() -> dict[str, float]:
        # At time scale 1, 4000 tokens take the seven running requests tens of seconds.
        body = {"text": "hi", "stream": True,
                "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        started = asyncio.Semaphore(0)

        async def stream(client: httpx.AsyncClient) -> None:
            async with client.stream("POST", server.url + "/generate", json=body,
                                     headers=HEADERS) as resp:
                assert resp.status_code == 200
                first = True
                async for line in resp.aiter_lines():  # read on: a stream left goes away
                    if first and line.startswith("data:"):
                        first = False
                        started.release()

        async with httpx.AsyncClient(timeout=60) as client:
            tasks = [asyncio.ensure_future(stream(client)) for _ in range(12)]
            try:
                for _ in range(7):
                    await asyncio.wait_for(started.acquire(), 60)
                return await asyncio.to_thread(metrics, server)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    seen = asyncio.run(load())
    assert (seen["sglang:num_running_reqs"], seen["sglang:num_queue_reqs"]) == (7, 5)
    # What SGLang logs as its pool runs full (the study's launch warns of it).
    assert wait_until(lambda: "KV cache pool is full. Retract requests." in server.stderr, 10)


def test_without_max_running_requests_the_server_runs_what_its_kv_pool_holds(emulators):
    # SGLang's no-speculation default (1024) does not fit one H100 with the 8B's KV
    # reserve: SGLang then sizes the running batch to its pool instead of failing.
    assert not check_memory(load_profile("qwen3-8b-h100"), BASELINE, 1024).fits
    server = emulators.start(*server_args("--load-time", "0", profile="qwen3-8b-h100",
                                          tp=None))
    server.wait_healthy()
    info = httpx.get(server.url + "/get_server_info", timeout=10).json()
    assert 1 < info["max_running_requests"] < 1024
    assert check_memory(load_profile("qwen3-8b-h100"), BASELINE,
                        info["max_running_requests"]).fits


# ---- 7. unknown flags --------------------------------------------------------------------

def test_unknown_sglang_flags_are_ignored_with_a_warning_and_the_server_serves(emulators):
    server = emulators.healthy(*server_args("--enable-torch-compile",
                                            "--chunked-prefill-size", "4096",
                                            "--time-scale", "50", "--load-time", "0"))
    warning = next(line for line in server.stderr.splitlines() if "WARNING" in line)
    assert "--enable-torch-compile" in warning
    assert "--chunked-prefill-size" in warning
    resp = post(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 8,
                                                                        "ignore_eos": True}})
    assert resp.status_code == 200
    assert resp.json()["meta_info"]["completion_tokens"] == 8


@pytest.mark.parametrize(("flags", "groups", "running"), [
    (["--enable-dp-attention", "--dp-size", "4"], 4, 32),
    (["--attn-dp-size=2"], 2, 34),
    (["--dp-size", "2"], 1, 35),  # replicas, not attention groups: ignored here
    (["--attn-dp-size", "2", "--dp-size", "2"], 2, 34),  # and replicas beside the groups
])
def test_data_parallel_attention_flags_are_read_not_ignored(flags, groups, running):
    """The emulator runs a server's attention in the groups its flags ask for, each taking
    max_running_requests // groups (SGLang's tp_worker)."""
    settings = parse(["--profile", "qwen3-coder-next-h200", "--model-path", "m",
                      "--tp-size", "4", "--max-running-requests", "35", *flags])
    assert settings.attention_dp == groups and settings.max_running_requests == running
    assert settings.ignored_flags == (["--dp-size"] if "--dp-size" in flags
                                      and (groups == 1 or "--attn-dp-size" in flags) else [])
    with pytest.raises(LaunchError, match=r"tp_size \(4\) must be divisible by the "
                       r"data-parallel attention size \(3\)"):
        parse(["--profile", "qwen3-coder-next-h200", "--model-path", "m", "--tp-size", "4",
               "--attn-dp-size", "3"])


# ---- 8. fault switches -------------------------------------------------------------------

def test_crash_after_requests_kills_the_process_when_the_next_request_arrives(emulators):
    server = emulators.healthy(*server_args("--crash-after-requests", "2",
                                            "--time-scale", "50", "--load-time", "0"))
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    for _ in range(2):
        assert post(server, "/generate", body).status_code == 200
    assert server.proc.poll() is None
    with pytest.raises(httpx.TransportError):
        post(server, "/generate", body)
    assert server.wait_exit(timeout=5) != 0
    assert "crash" in server.stderr


def test_hang_on_startup_keeps_health_at_503(emulators):
    server = emulators.start(*server_args("--hang-on-startup", "--load-time", "0",
                                          "--time-scale", "50"))
    server.wait_status(503)
    # At least 10 probes over at least 1.5 s (a loaded server would be healthy at once):
    # counting probes inside a fixed window instead failed when a busy machine slowed them.
    end = time.monotonic() + 1.5
    probes = 0
    while probes < 10 or time.monotonic() < end:
        assert server.health_status() == 503
        probes += 1
        time.sleep(0.05)
    assert server.proc.poll() is None


# ---- 11. shutdown ------------------------------------------------------------------------

def test_sigterm_exits_promptly_leaving_no_child_process_and_a_free_port(emulators):
    server = emulators.healthy(*server_args("--time-scale", "50", "--load-time", "0"))
    kids = children_of(server.pid)
    server.proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    server.wait_exit(timeout=5)
    assert time.monotonic() - start < 3
    assert not [pid for pid in kids if pid_alive(pid)]
    assert port_is_free(server.port)


def test_sigterm_with_a_stream_in_flight_exits_within_seconds_and_frees_the_port_for_a_relaunch(
        emulators):
    args = server_args("--time-scale", "1", "--load-time", "0")
    server = emulators.healthy(*args)

    async def stream_then_terminate() -> float:
        body = {"prompt": "p", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession(headers=HEADERS) as session, \
                session.post(server.url + "/v1/completions", json=body) as resp:
            await resp.content.readline()  # the stream has started
            server.proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            with contextlib.suppress(aiohttp.ClientError):
                async for _ in resp.content:
                    pass
            await asyncio.to_thread(server.wait_exit, 10)
            return time.monotonic() - start

    # aiohttp waits shutdown_timeout (2 s) for the handler, then 2 s more after cancelling it.
    assert asyncio.run(stream_then_terminate()) < 6
    assert server.proc.returncode == 0
    # The server closed the streaming connection first, so that socket sits in TIME_WAIT;
    # a tuner relaunching on the same port must not have to wait a minute for it.
    emulators.healthy(*args, port=server.port)


def test_a_second_server_on_a_port_in_use_is_refused(emulators):
    args = server_args("--load-time", "0")
    first = emulators.healthy(*args)
    second = emulators.start(*args, port=first.port)
    assert second.wait_exit(timeout=REFUSED_WITHIN_S) != 0
    assert "address already in use" in second.stderr
    assert first.health_status() == 200


# ---- 10. throughput ----------------------------------------------------------------------

THROUGHPUT_SCALE = 10.0
WARMUP_S = 1.0
WINDOW_S = 4.0
# The model's throughput is the steady state: `concurrency` requests decoding through the
# whole window. Requests of 1024 tokens also turned over inside it, and each turnover leaves
# a slot idle for the client's round trip, stretched tenfold by the emulated clock: a busy
# machine makes that several percent. Requests this long outlast the window (they are
# cancelled when it closes), so there is no turnover to measure.
STEADY_TOKENS = 100_000


async def closed_loop_tokens_per_s(server: Emulator, concurrency: int) -> float:
    """Streamed tokens/s (wall) inside a steady-state window of a closed loop."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    window = (start + WARMUP_S, start + WARMUP_S + WINDOW_S)
    counted = 0
    body = {"prompt": "def fib(n):", "max_tokens": STEADY_TOKENS, "ignore_eos": True,
            "stream": True}

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal counted
        while True:
            async with session.post(server.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    choices = json.loads(line[6:])["choices"]
                    if choices and window[0] <= loop.time() < window[1]:
                        counted += words(choices[0]["text"])

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=HEADERS, connector=connector) as session:
        workers = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        await asyncio.sleep(window[1] - loop.time())
        for task in workers:
            task.cancel()
        results = await asyncio.gather(*workers, return_exceptions=True)
    failures = [r for r in results if not isinstance(r, asyncio.CancelledError)]
    assert not failures, failures
    return counted / WINDOW_S


@pytest.fixture(scope="module")
def throughput_server(module_emulators: EmulatorFactory
                      ) -> Callable[[object, float], Emulator]:
    """One server per config and time scale, shared by the concurrencies that use it: each
    test cancels its requests when its window closes, and the next one's warm-up lets them
    go."""
    started: dict[tuple[str, float], Emulator] = {}

    def server(config: object, scale: float) -> Emulator:
        if (str(config), scale) not in started:
            flags = (tree_flags(config.steps, config.topk, config.draft_tokens)
                     if isinstance(config, TreeConfig) else [])
            started[str(config), scale] = module_emulators.healthy(*server_args(
                *flags, "--time-scale", str(scale), "--max-running-requests", "64",
                "--load-time", "0"))
        return started[str(config), scale]
    return server


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 8, 32])
@pytest.mark.parametrize("config", [TREE, BASELINE], ids=str)
def test_closed_loop_throughput_matches_the_performance_model_within_5_percent(
        throughput_server, config, concurrency):
    # 32 streams on a fast clock outrun this test's own client (it parses every chunk) on a
    # busy 2-core machine, and a lagging client reads as a slow server: the clock slows
    # with the concurrency so that the client keeps up; the window still spans hundreds of
    # rounds.
    scale = THROUGHPUT_SCALE if concurrency <= 8 else THROUGHPUT_SCALE / 4
    server = throughput_server(config, scale)
    time_scale = server_info(server)["emulator"]["time_scale"]
    assert time_scale == scale

    measured = asyncio.run(closed_loop_tokens_per_s(server, concurrency)) / time_scale

    expected = PerfModel(load_profile(CODER), tp=4).throughput(config, concurrency, DATASET)
    assert measured == pytest.approx(expected, rel=0.05), (
        f"measured {measured:.1f} tok/s, model {expected:.1f} tok/s "
        f"({measured / expected - 1:+.1%})")


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_a_client_gone_before_the_stream_s_headers_ends_its_request_quietly(
        monkeypatch, capsys, path):
    """In-process: sending a stream's headers fails as it does once its client has hung up.
    The request is aborted (nothing runs on) and the handler returns quietly: before, the
    failure escaped the handler and aiohttp logged a traceback in the server's log (a
    helper's audit found one in a demo's server log)."""
    import logging

    from aiohttp import ClientConnectionResetError, web
    from aiohttp.test_utils import TestClient, TestServer

    from treetune.emulator.args import parse as parse_args
    from treetune.emulator.server import EmulatedServer
    from treetune.perfmodel import load_profile

    settings = parse_args(list(SPEC_ARGS))
    server = EmulatedServer(settings, load_profile(settings.profile))

    async def gone(self, request):
        raise ClientConnectionResetError("Cannot write to closing transport")

    body = ({"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 64}}
            if path == "/generate" else
            {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 64}
            if "chat" in path else {"prompt": "hi", "stream": True, "max_tokens": 64})
    errors: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            errors.append(record)

    keep = Keep(logging.ERROR)
    logging.getLogger("aiohttp").addHandler(keep)

    async def main() -> int:
        async with TestClient(TestServer(server.app)) as client:
            assert await wait_health(client)
            monkeypatch.setattr(web.StreamResponse, "prepare", gone)
            # The server closes the connection: the client's side of hanging up.
            with contextlib.suppress(aiohttp.ClientError):
                await client.post(path, json=body, headers=HEADERS)
            monkeypatch.undo()
            return len(server.engine.running) + len(server.engine.waiting)

    try:
        left = asyncio.run(main())
    finally:
        logging.getLogger("aiohttp").removeHandler(keep)
    assert left == 0
    assert not [r for r in errors if r.exc_info], [r.getMessage() for r in errors]


async def wait_health(client) -> bool:
    """Whether the in-process server answered /health within 10 s (it loads first)."""
    for _ in range(200):
        if (await client.get("/health")).status == 200:
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.parametrize(("version", "counts"), [("0.5.12", False), ("0.5.13", True)])
def test_an_sglang_before_0_5_13_shows_no_verify_counter_and_a_study_sees_it(version, counts):
    """SGLang's metrics have sglang:spec_verify_calls_total from 0.5.13 on. Before, a study
    measured every speculative cell twice in wait of a count that never comes (a helper's
    audit against the wheels); the worker now asks the server's metrics once."""
    from aiohttp.test_utils import TestClient, TestServer

    from treetune.backends.sglang import SGLANG_API
    from treetune.client import ServerClient
    from treetune.emulator.server import EmulatedServer
    from treetune.study.worker import counts_verify_calls

    settings = parse([*SPEC_ARGS, "--emulate-version", version])
    server = EmulatedServer(settings, load_profile(settings.profile))
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 16}}

    async def main() -> tuple[bool, bool, bool]:
        async with TestClient(TestServer(server.app)) as client:
            assert await wait_health(client)
            async with ServerClient(str(client.make_url("/")), api=SGLANG_API) as sglang:
                before = await counts_verify_calls(sglang)  # nothing counted yet
                answer = await client.post("/generate", json=body, headers=HEADERS)
                assert answer.status == 200, await answer.text()
                names = await sglang.metrics()
                return before, await counts_verify_calls(sglang), (
                    SGLANG_API.verify_calls in names)

    assert asyncio.run(main()) == (True, counts, counts)


def test_a_config_file_is_read_as_sglang_reads_it(tmp_path):
    """`--config FILE.yaml` (SGLang >= 0.5.3): each key a long flag, a store-true flag's
    `true` the bare flag and `false` nothing, a list its items; the command line wins."""
    config = tmp_path / "flags.yaml"
    config.write_text("api-key: 'true'\nenable-metrics: true\nspeculative-adaptive: false\n"
                      "max-running-requests: 8\nmem-fraction-static: 0.7\n"
                      "cuda-graph-max-bs-decode: [16]\n")
    settings = parse([*SPEC_ARGS, "--config", str(config), "--max-running-requests", "4"])
    assert settings.api_key == "true"  # quoted in YAML, a key stays text
    assert settings.enable_metrics and settings.adaptive is None
    assert settings.max_running_requests == 4 and settings.mem_fraction_static == 0.7
    assert settings.cuda_graph_max_bs == 16
    assert "config" not in settings.raw_args


@pytest.mark.parametrize(("name", "text", "extra", "message"), [
    ("flags.json", "{}", [], "must be YAML format, got: .json"),
    ("flags.yaml", "- a\n", [], "must contain a dictionary"),
    ("flags.yaml", "a: [\n", [], "cannot read config file"),
    ("missing.yaml", None, [], "cannot read config file"),
    ("flags.yaml", "api-key: k\n", ["--emulate-version", "0.5.2"], "unrecognized arguments"),
    ("flags.yaml", "api-key: k\n", ["--config", "other.yaml"], "Only one allowed"),
    # 0.5.23's reader takes plain store_true and one-value flags only.
    ("flags.yaml", "enable-dp-attention: true\n", [],
     "Unsupported config option 'enable_dp_attention'"),
    ("flags.yaml", "no-enable-tf32-matmul: true\n", [],
     "Unsupported config option 'no_enable_tf32_matmul'"),
])
def test_a_config_file_sglang_would_refuse_is_refused(tmp_path, name, text, extra, message):
    config = tmp_path / name
    if text is not None:
        config.write_text(text)
    with pytest.raises(LaunchError, match=message):
        parse([*SPEC_ARGS, *extra, "--config", str(config)])


def test_the_old_cuda_graph_flag_is_refused_where_sglang_no_longer_has_it():
    """0.5.20's and 0.5.23's parsers have no --cuda-graph-max-bs (argparse takes it for an
    ambiguous abbreviation of -decode and -prefill), which the emulator took at any
    version: a test could pass with a flag the real server refuses (a helper's audit)."""
    with pytest.raises(LaunchError, match="ambiguous option: --cuda-graph-max-bs"):
        parse([*SPEC_ARGS, "--cuda-graph-max-bs", "8"])
    old = parse([*SPEC_ARGS, "--cuda-graph-max-bs", "8", "--emulate-version", "0.5.13"])
    assert old.cuda_graph_max_bs == 8


@pytest.mark.parametrize(("extra", "version", "refused", "sizes"), [
    # 0.5.9's name of the decode sizes: 0.5.14's alias of them, ambiguous from 0.5.20.
    (["--cuda-graph-bs", "1", "4"], "0.5.14", None, [1, 4]),
    (["--cuda-graph-bs", "1", "4"], "0.5.23", "ambiguous option: --cuda-graph-bs could "
     "match --cuda-graph-bs-decode, --cuda-graph-bs-prefill", None),
    # Abbreviations read as SGLang's parser reads them, the prefill phase's flags known.
    (["--cuda-graph-bs-d", "1", "4"], "0.5.23", None, [1, 4]),
    (["--disable-decode-cuda"], "0.5.23", None, []),
    (["--cuda-graph-backend", "disabled"], "0.5.23", "error: ambiguous option: "
     "--cuda-graph-backend could match --cuda-graph-backend-decode, "
     "--cuda-graph-backend-prefill", None),  # argparse's own refusal, as SGLang's
    (["--disable-prefill-cuda-graph", "--cuda-graph-bs-prefill", "2"], "0.5.23", None,
     "default"),
    # Per-phase flags before SGLang had them.
    (["--cuda-graph-bs-decode", "1", "4"], "0.5.13", "unrecognized arguments: "
     "--cuda-graph-bs-decode", None),
    (["--disable-decode-cuda-graph"], "0.5.13", "unrecognized arguments", None),
    (["--cuda-graph-bs", "1", "4"], "0.5.13", None, [1, 4]),
    # The alias and the decode flag: the last given wins, as argparse stores both alike.
    (["--cuda-graph-bs-decode", "1", "8", "--cuda-graph-bs", "1", "4"], "0.5.14", None, [1, 4]),
    (["--cuda-graph-bs", "1", "4", "--cuda-graph-bs-decode", "1", "8"], "0.5.14", None, [1, 8]),
    # Flags of later releases than the one emulated.
    (["--cuda-graph-prefill-max-context", "4096"], "0.5.20", "unrecognized arguments: "
     "--cuda-graph-prefill-max-context (not flags of SGLang 0.5.20)", None),
    (["--debug-cuda-graph"], "0.5.9", "unrecognized arguments: --debug-cuda-graph", None),
    (["--debug-cuda-graph"], "0.5.14", None, "default"),
])
def test_the_cuda_graph_flags_read_as_the_emulated_releases_parser_reads_them(
        extra, version, refused, sizes, capsys):
    """The emulator knew only the decode phase's CUDA-graph flags, so it read
    `--cuda-graph-backend` as the decode one where SGLang refuses it as ambiguous, refused
    0.5.9's `--cuda-graph-bs` nowhere, and took the per-phase flags at releases that have
    none of them (0.5.9's and 0.5.14's wheels)."""
    argv = [*SPEC_ARGS, "--max-running-requests", "8", *extra, "--emulate-version", version]
    if refused is not None:
        with pytest.raises((LaunchError, SystemExit)) as info:
            parse(argv)
        said = str(info.value) if info.type is LaunchError else capsys.readouterr().err
        assert refused in said, said
        return
    settings = parse(argv)
    default = parse([*SPEC_ARGS, "--max-running-requests", "8"]).decode_graph_sizes
    assert settings.decode_graph_sizes == (default if sizes == "default" else sizes)
    if sizes == "default":  # known, and said to be ignored: the emulator serves as without
        assert settings.ignored_flags == [f for f in extra if f.startswith("--")]


@pytest.mark.parametrize(("algorithm", "tree", "extra", "message"), [
    ("EAGLE3", (3, 4, 8), ["--attention-backend", "trtllm_mha"],
     r"^ValueError: trtllm_mha backend only supports topk = 1 for speculative decoding\.$"),
    ("EAGLE3", (3, 1, 4), ["--attention-backend", "trtllm_mha"], None),
    ("EAGLE3", (3, 4, 8), ["--decode-attention-backend", "trtllm_mha"], "trtllm_mha backend"),
    ("EAGLE3", (3, 4, 8), ["--page-size", "64", "--attention-backend", "fa3"], None),
    ("EAGLE3", (3, 4, 8), ["--attention-backend", "flashmla"],
     r"page_size > 1 is only supported on \('flashinfer', 'fa3', 'triton'\); got "
     r"attention_backend='flashmla'"),
    ("EAGLE3", (3, 4, 8), ["--speculative-use-block-verification"],
     r"requires --speculative-eagle-topk=1"),
    ("EAGLE3", (3, 4, 8), ["--speculative-use-rejection"], "requires --speculative-eagle-topk"),
    ("EAGLE3", (3, 1, 4), ["--speculative-use-rejection-sampling"], None),
    ("EAGLE3", (3, 4, 8), ["--page-size=16", "--attention-backend", "hpc_ops"], "page_size > 1"),
    ("EAGLE3", (3, 4, 8), ["--page", "16", "--attention-backend", "fa3", "--page-size", "1"],
     None),  # the last one given
    ("EAGLE3", (3, 4, 8), ["--page-size", "many"],
     r"^error: argument --page-size: invalid int value: 'many'$"),
    ("EAGLE3", (3, 4, 8), ["--attention-backend", "aiter"], r"^NotImplementedError: "
     r"AiterAttnBackend SPEC_V2 path currently supports topk <= 1 only\. Got topk=4\.$"),
    ("NGRAM", (7, 4, 8), ["--page-size", "16", "--attention-backend", "fa3"],
     r"^ValueError: speculative_eagle_topk\(4\) > 1 with page_size\(16\) > 1 is unstable"),
    ("NGRAM", (7, 4, 8), ["--page-size", "16", "--attention-backend", "flashinfer"], None),
    ("STANDALONE", (3, 1, 4), ["--speculative-use-rejection-sampling"],
     r"^NotImplementedError: --speculative-use-rejection-sampling is only supported for "
     r"EAGLE / EAGLE3 / NEXTN, not speculative_algorithm=STANDALONE\.$"),
    ("STANDALONE", (3, 1, 4), ["--speculative-use-block-verification"],
     r"^ValueError: --speculative-use-block-verification only supports EAGLE"),
])
def test_drafting_sglang_refuses_as_it_starts_the_emulator_refuses(algorithm, tree, extra,
                                                                    message):
    """SGLang 0.5.23 refuses a tree (topk > 1) with trtllm_mha or aiter, with rejection
    sampling, or on pages of more than one token but with flashinfer, fa3 or triton
    (flashinfer for NGRAM), and rejection sampling or block verification by a STANDALONE
    draft; the emulator served them, so a study could pass on a shortcut the real server
    would not take. Flags as SGLang's parser reads them: abbreviated, `=value`, the last."""
    steps, topk, tokens = tree
    knobs = (["--speculative-num-draft-tokens", str(tokens), "--speculative-ngram-max-bfs-"
              "breadth", str(topk)] if algorithm == "NGRAM" else
             ["--speculative-draft-model-path", "d", "--speculative-num-steps", str(steps),
              "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens",
              str(tokens)])
    argv = ["--profile", "qwen3-8b-h100", "--model-path", "m", "--speculative-algorithm",
            algorithm, *knobs, *extra]
    if message is None:
        assert parse(argv).config == TreeConfig(steps, topk, tokens)
    else:
        with pytest.raises(LaunchError, match=message):
            parse(argv)


def test_the_emulator_serves_as_the_release_a_studys_commands_are_written_for():
    """A study written for 0.5.13 passes --cuda-graph-max-bs, which the emulator refuses as
    0.5.23: it is told the study's release."""
    from treetune.backends import LaunchSpec
    from treetune.backends.emulator import emulator_command

    launch = LaunchSpec("m", tp=4, engine_version="0.5.13", cuda_graph_max_bs=8,
                        draft_model_path="d")
    argv = emulator_command(TREE, launch, "qwen3-coder-next-h200")
    assert argv[argv.index("--emulate-version") + 1] == "0.5.13"
    settings = parse([*argv[3:], "--time-scale", "50", "--load-time", "0"])
    assert settings.cuda_graph_max_bs == 8 and settings.sglang_version == "0.5.13"


def test_an_engine_that_fails_takes_its_server_down_with_its_traceback(tmp_path):
    """The engine's loop ending on an error left the server up, answering no request for
    good: a study waited on each until its timeout (an audit, with a replay table that the
    loop could not read). It exits as SGLang does when its scheduler fails, and says why."""
    import subprocess
    import sys

    from treetune.server import free_port

    port = free_port()
    fail = ("import sys\nfrom treetune.emulator import engine, __main__ as emulator\n"
            "async def fail(self):\n    raise RuntimeError('a round that cannot be timed')\n"
            "engine.Engine._decode_round = fail\nsys.exit(emulator.main(sys.argv[1:]))\n")
    log = tmp_path / "stderr"
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", fail, *SPEC_ARGS, "--host", "127.0.0.1",
                                 "--port", str(port)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(url + "/health", timeout=2).status_code == 200
            return False

        assert wait_until(healthy, 60), log.read_text()
        with pytest.raises(httpx.TransportError) as info:
            httpx.post(url + "/generate", headers=HEADERS, timeout=60,
                       json={"text": "hi", "sampling_params": {"max_new_tokens": 8}})
        assert not isinstance(info.value, httpx.TimeoutException)  # not a wait to the timeout
        assert proc.wait(timeout=30) == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    said = log.read_text()
    assert "the engine failed: the server exits" in said
    assert "RuntimeError: a round that cannot be timed" in said
