"""The emulator serves each draft method with its own acceptance and cost from the profile,
launched with SGLang's flags for it, and refuses a method its profile does not describe.

Servers run as subprocesses with `--seed` and `--no-noise` on their own free ports; the
fixtures kill every one."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

import aiohttp
import httpx
import pytest
import yaml

from treetune.backends.sglang import NGRAM_BREADTH_FLAG
from treetune.config import TreeConfig
from treetune.perfmodel import PerfModel, load_profile
from treetune.perfmodel.profile import resolve_profile_path

if TYPE_CHECKING:
    from conftest import EmulatorFactory

QWEN35 = "qwen3.5-397b-a17b-h200"
MODEL = "Qwen/Qwen3.5-397B-A17B"
DATASET = "gsm8k"
HEADERS = {"X-Treetune-Dataset": DATASET}
CHAIN = TreeConfig(3, 1, 4)
# As tests/test_emulator.py's closed-loop throughput check: a clock 10x faster than the
# emulated GPUs, one second of warm-up, a four-second window inside one long stream.
SCALE, WARMUP_S, WINDOW_S = 10.0, 1.0, 4.0
REFUSED_WITHIN_S = 20.0  # as test_emulator.py: a refused launch exits before serving


def args(*flags: str, profile: str = QWEN35, scale: float = 50.0) -> list[str]:
    return ["--profile", profile, "--model-path", MODEL, "--tp-size", "8", "--seed", "1",
            "--no-noise", "--time-scale", str(scale), "--load-time", "0", *flags]


NEXTN_FLAGS = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
               "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4")


def server_info(server) -> dict:
    return httpx.get(server.url + "/server_info", timeout=10).json()


def generate(server, tokens: int) -> dict:
    body = {"text": "Natalia sold clips", "sampling_params": {"max_new_tokens": tokens,
                                                              "ignore_eos": True}}
    resp = httpx.post(server.url + "/generate", json=body, headers=HEADERS, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_nextn_serves_without_a_draft_model_and_reports_what_sglang_resolves(emulators):
    server = emulators.healthy(*args(*NEXTN_FLAGS))
    info = server_info(server)
    assert info["speculative_algorithm"] == "EAGLE"  # SGLang runs NEXTN as EAGLE
    assert info["speculative_draft_model_path"] is None
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"],
            info["speculative_num_draft_tokens"]) == (3, 1, 4)
    assert info["emulator"]["method"] == "NEXTN"


def test_nextn_accept_length_is_the_mtp_layers_not_the_eagle3_heads(emulators):
    server = emulators.healthy(*args(*NEXTN_FLAGS))
    meta = generate(server, 3000)["meta_info"]
    measured = meta["completion_tokens"] / meta["spec_verify_ct"]
    profile = load_profile(QWEN35)
    mtp = PerfModel(profile, 8, method="NEXTN").accept_length(CHAIN, DATASET)
    head = PerfModel(profile, 8).accept_length(CHAIN, DATASET)
    assert measured == pytest.approx(mtp, abs=0.08)  # ~850 rounds: sampling error ~0.03
    assert abs(measured - mtp) < abs(measured - head)


async def closed_loop_tokens_per_s(url: str) -> float:
    """Streamed tokens/s (wall) of one endless stream inside a steady-state window."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    window = (start + WARMUP_S, start + WARMUP_S + WINDOW_S)
    counted = 0
    body = {"prompt": "Natalia sold clips", "max_tokens": 100_000, "ignore_eos": True,
            "stream": True}

    async def stream(session: aiohttp.ClientSession) -> None:
        nonlocal counted
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    choices = json.loads(line[6:])["choices"]
                    if choices and window[0] <= loop.time() < window[1]:
                        counted += len(choices[0]["text"].split())

    async with aiohttp.ClientSession(headers=HEADERS) as session:
        task = asyncio.create_task(stream(session))
        await asyncio.sleep(window[1] - loop.time())
        task.cancel()
        results = await asyncio.gather(task, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    return counted / WINDOW_S


@pytest.mark.slow
def test_nextn_decodes_at_the_throughput_predict_gives_for_the_mtp_layer(emulators):
    server = emulators.healthy(*args(*NEXTN_FLAGS, scale=SCALE))
    measured = asyncio.run(closed_loop_tokens_per_s(server.url)) / SCALE
    expected = PerfModel(load_profile(QWEN35), 8, method="NEXTN").throughput(CHAIN, 1, DATASET)
    assert measured == pytest.approx(expected, rel=0.05), (
        f"measured {measured:.1f} tok/s, model {expected:.1f} tok/s")


def test_ngram_serves_with_its_own_knobs_and_no_draft_model(emulators):
    server = emulators.healthy(*args("--speculative-algorithm", "NGRAM",
                                     "--speculative-num-draft-tokens", "8",
                                     NGRAM_BREADTH_FLAG, "4",
                                     "--speculative-eagle-topk", "1"))
    info = server_info(server)
    # SGLang overwrites topk with the breadth and defaults the unused steps to N // topk.
    assert (info["speculative_algorithm"], info["speculative_eagle_topk"],
            info["speculative_num_draft_tokens"], info["speculative_num_steps"]) == (
        "NGRAM", 4, 8, 2)
    assert info["emulator"]["method"] == "NGRAM"
    meta = generate(server, 64)["meta_info"]
    assert meta["completion_tokens"] == 64 and meta["spec_verify_ct"] > 0


def standalone_profile(tmp_path) -> str:
    """The Qwen3.5 profile plus a STANDALONE method (a 28-layer 0.8B dense draft model)."""
    data = yaml.safe_load(resolve_profile_path(QWEN35).read_text())
    data["methods"]["STANDALONE"] = {
        "drafter": "standalone",
        "draft": {"name": "small-dense", "params_m": 800, "kv_bytes_per_token": 28672,
                  "layers": 28},
        "acceptance": {d: {"top1": 0.6, "top1_decay": 0.08} for d in data["datasets"]}}
    path = tmp_path / "with-standalone.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


STANDALONE_FLAGS = ("--speculative-algorithm", "STANDALONE",
                    "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                    "--speculative-num-draft-tokens", "4")


def test_standalone_serves_its_profile_entry_given_a_draft_model_path(emulators, tmp_path):
    server = emulators.healthy(*args(*STANDALONE_FLAGS, "--speculative-draft-model-path",
                                     "Qwen/Qwen3.5-0.8B", profile=standalone_profile(tmp_path)))
    info = server_info(server)
    assert info["speculative_algorithm"] == "STANDALONE"
    assert info["emulator"]["method"] == "STANDALONE"
    assert generate(server, 16)["meta_info"]["completion_tokens"] == 16


REFUSALS = {
    "a method the profile has no entry for": (
        args("--speculative-algorithm", "NGRAM", profile="qwen3-coder-next-h200"),
        "has no draft method 'NGRAM'"),
    "standalone without a draft model": (
        args(*STANDALONE_FLAGS), "STANDALONE requires --speculative-draft-model-path"),
    "standalone on a profile without it": (
        args(*STANDALONE_FLAGS, "--speculative-draft-model-path", "Qwen/Qwen3.5-0.8B"),
        "has no draft method 'STANDALONE'"),
    "ngram with a breadth below one": (
        args("--speculative-algorithm", "NGRAM", NGRAM_BREADTH_FLAG, "0"),
        f"{NGRAM_BREADTH_FLAG} must be >= 1"),
    "an algorithm SGLang does not have": (
        args("--speculative-algorithm", "MEDUSA"), "Unsupported speculative algorithm"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_launch_the_profile_or_sglang_cannot_serve_exits_with_the_reason(
        emulators: EmulatorFactory, case):
    flags, reason = REFUSALS[case]
    server = emulators.start(*flags)
    assert server.wait_exit(timeout=REFUSED_WITHIN_S) != 0
    assert reason in server.stderr
    assert "emulating" not in server.stderr
