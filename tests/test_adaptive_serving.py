"""The emulator serves SGLang 0.5.23's adaptive steps (`--speculative-adaptive`), and
treetune notices when a server asked for them serves static trees instead.

The engine is driven in-process with a scripted acceptance (every draft accepted on one
dataset, none on the other), so each slot's decisions can be computed by hand from the
controller's rules (domain.md section 7); the HTTP tests use configs whose hysteresis makes
every decision certain whatever the sampled acceptance.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from studykit import server_processes, small_study, unlagged, wait_until

from treetune.backends.sglang import SGLANG_API, adaptive_state, launch_warnings
from treetune.backends.sglang_adaptive import Schedule, fallback_warning, graph_batch_sizes
from treetune.client import ServerClient
from treetune.config import BASELINE, ServerConfig, TreeConfig
from treetune.emulator.args import AdaptiveLaunch, LaunchError, parse
from treetune.emulator.engine import Engine, Request
from treetune.emulator.metrics import ServerMetrics
from treetune.perfmodel import NoiseModel, PerfModel, load_profile

PROFILE = "qwen3-coder-next-h200"
EASY, HARD = "humaneval", "terminal-bench"  # scripted: every draft accepted / none
DRAFT = "thoughtworks/Qwen3-Coder-Next-Eagle3"
ADAPTIVE = ("--speculative-adaptive",)


# ---- the engine, round by round ----------------------------------------------------------

class Scripted(PerfModel):
    """The profile's costs; every draft accepted on EASY, none on HARD. Records the chain
    of every decode round."""

    def __init__(self) -> None:
        super().__init__(load_profile(PROFILE), tp=4)
        self.rounds: list[ServerConfig] = []

    def round_time(self, config, batch, dataset):
        self.rounds.append(config)
        return super().round_time(config, batch, dataset)

    def sample_accepted(self, config, dataset, rng, count):
        steps = config.steps if isinstance(config, TreeConfig) else 0
        return np.full(count, steps if dataset == EASY else 0, dtype=np.int64)


def engine(config: dict | None = None, steps: int = 3, *, static: TreeConfig | None = None,
           model: PerfModel | None = None, seed: int = 0, log: list[str] | None = None,
           max_running: int = 16) -> Engine:
    """An emulated engine, noise off, on a clock so fast that its sleeps vanish: adaptive
    with `config` starting at `steps` (CUDA graphs up to the running cap), or serving the
    `static` tree."""
    profile = load_profile(PROFILE)
    adaptive = None if static else AdaptiveLaunch(config or {}, None, steps)
    return Engine(profile, static or adaptive.longest, tp=4, max_running_requests=max_running,
                  time_scale=1e9, noise=NoiseModel.from_profile(profile.noise, False),
                  rng=np.random.default_rng(seed), metrics=ServerMetrics("m"),
                  model=model or PerfModel(profile, 4),
                  schedule=(adaptive.schedule(graph_batch_sizes(max_running)) if adaptive
                            else None),
                  log=None if log is None else log.append)


@contextlib.asynccontextmanager
async def running(eng: Engine) -> AsyncIterator[None]:
    task = asyncio.create_task(eng.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def finish(eng: Engine, wave: list[tuple[str, int]]) -> list[Request]:
    """Requests (dataset, tokens) that arrive together, once all are done."""
    requests = [eng.new_request(dataset, 100, tokens, ignore_eos=True)
                for dataset, tokens in wave]
    for req in requests:
        while await req.updates.get() >= 0:
            pass
    return requests


async def serve(eng: Engine, waves: list[list[tuple[str, int]]]) -> list[Request]:
    """Each wave arrives once the previous one is done."""
    async with running(eng):
        return [req for wave in waves for req in await finish(eng, wave)]


def steps_of(rounds: list[ServerConfig]) -> list[int]:
    return [c.steps if isinstance(c, TreeConfig) else 0 for c in rounds]


def test_each_slot_moves_its_own_steps_from_the_accepted_drafts_of_the_batches_it_serves():
    # Alpha 1: the average is the last verify's; two warm-up verifies, then an update
    # after every verify. Slot 1 from 3: all 3 drafts accepted, 3 > 3 - 0.5, not above
    # 5 - 0.5: up to 5 after verify 3. A 30-token request: 1 from the prefill, then
    # rounds of 4, 4, 4, 6, 6 and the last 5.
    # Nine requests pad to the CUDA graph of 10 and run in slot 10: no draft accepted,
    # 0 <= 1 - 0.5 - 0.25: down to 1 after verify 3; 10 tokens: 1 + nine rounds of one.
    config = {"1": {"candidate_steps": [1, 3, 5]}, "10": {"candidate_steps": [1, 3]},
              "warmup_batches": 2, "update_interval": 1, "ema_alpha": 1.0}
    model, log = Scripted(), []
    eng = engine(config, 3, model=model, log=log)
    assert eng.schedule.current() == {"1": 3, "10": 3}

    async def main() -> None:
        async with running(eng):
            easy, = await finish(eng, [(EASY, 30)])
            assert steps_of(model.rounds) == [3, 3, 3, 5, 5, 5]
            assert easy.generated == 30 and easy.verify_ct == 6
            assert eng.schedule.current() == {"1": 5, "10": 3}

            model.rounds.clear()
            await finish(eng, [(HARD, 10)] * 9)
            assert steps_of(model.rounds) == [3, 3, 3] + [1] * 6
            assert eng.schedule.current() == {"1": 5, "10": 1}  # slot 1 kept its steps

    asyncio.run(main())
    assert log == ["Adaptive spec params updated: steps 3 -> 5 (ema_accept_len=3.00)",
                   "Adaptive spec params updated: steps 3 -> 1 (ema_accept_len=0.00)"]


def test_steps_zero_serves_plain_decode_rounds_then_probes_the_next_candidate():
    # [0, 2] from 2, nothing accepted: one warm-up verify, then an update every second
    # verify. Verify 3: 0 <= 0 + 0.5 + 0: no drafting. Verify 5 probes 2 again; verify 7,
    # with still nothing accepted, stops drafting again.
    config = {"1": {"candidate_steps": [0, 2], "down_hysteresis": 0.0},
              "warmup_batches": 1, "update_interval": 2, "ema_alpha": 1.0}
    model = Scripted()
    eng = engine(config, 2, model=model)
    req, = asyncio.run(serve(eng, [[(HARD, 8)]]))
    assert steps_of(model.rounds) == [2, 2, 2, 0, 0, 2, 2]
    # Steps 0 is SGLang's plain decode step (no draft passes), one token per round.
    assert [c for c in model.rounds if not isinstance(c, TreeConfig)] == [BASELINE] * 2
    assert req.generated == 8 and req.verify_ct == 7
    assert eng.schedule.current() == {"1": 0}


def test_an_adaptive_server_held_at_one_candidate_measures_exactly_as_the_static_chain():
    # Same seed, noise off: the adaptive round asks the same cost model for the same
    # chain and draws the same acceptance from the same generator as the static server,
    # so the emulated time and every token agree exactly (no noise to tolerate). One wave:
    # the clock then holds modelled time only. Requests end one after another, so the
    # batch runs from 11 down to 1 on two datasets.
    wave = [(EASY, 64 * i) for i in range(1, 9)] + [(HARD, 100)] * 3
    # A slot no batch reaches sizes the server for 7 steps: rounds still cost what 3 does.
    config = {"1": {"candidate_steps": [3]}, "64": {"candidate_steps": [7]}}
    adaptive = engine(config, 3, seed=7)
    assert adaptive.config == TreeConfig(7, 1, 8)
    static = engine(static=TreeConfig(3, 1, 4), seed=7)
    held = asyncio.run(serve(adaptive, [wave]))
    chain = asyncio.run(serve(static, [wave]))
    assert adaptive.schedule.current() == {"1": 3, "64": 7}
    assert adaptive.verify_calls == static.verify_calls
    assert adaptive.completion_tokens == static.completion_tokens == 64 * 36 + 300
    assert adaptive.clock == pytest.approx(static.clock, rel=1e-12)
    assert [r.finished_at for r in held] == pytest.approx([r.finished_at for r in chain],
                                                          rel=1e-12)


# ---- launch flags ------------------------------------------------------------------------

def flags(*extra: str) -> list[str]:
    return ["--profile", PROFILE, "--model-path", "m", "--tp-size", "4", *extra]


def spec_flags(*extra: str) -> list[str]:
    return flags("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                 DRAFT, *extra)


def test_adaptive_mode_fills_in_topk_1_the_middle_candidate_and_steps_plus_one_tokens():
    settings = parse(spec_flags(*ADAPTIVE))  # SGLang's default config: [0, 1, 3, 5, 7]
    assert settings.adaptive is not None and settings.adaptive.steps == 3
    assert settings.adaptive_fallback is None
    assert settings.config == TreeConfig(7, 1, 8)  # sized for the longest candidate chain
    # Partial knobs are fine: SGLang fills the rest before its all-or-none rule.
    assert parse(spec_flags(*ADAPTIVE, "--speculative-num-steps", "5")).adaptive.steps == 5
    nextn = parse(flags("--speculative-algorithm", "NEXTN", *ADAPTIVE))
    assert nextn.adaptive is not None  # SGLang resolves NEXTN to EAGLE first


@pytest.mark.parametrize(("args", "reason"), [
    (spec_flags("--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
                "--speculative-num-draft-tokens", "8"),
     "speculative_eagle_topk=4 (only topk=1 is supported)"),
    (flags("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d"),
     "speculative_algorithm=STANDALONE (only EAGLE/EAGLE3 are supported)"),
    # SGLang 0.5.23's words (speculative/adaptive_spec_params.py).
    (spec_flags("--attn-dp-size", "2"), "attention DP is not supported "
     "(adaptive tier decisions are not synchronized across DP ranks)"),
    (spec_flags("--enable-dp-attention", "--dp-size", "4"), "attention DP is "
     "not supported (adaptive tier decisions are not synchronized across DP ranks)"),
    (spec_flags("--enable-two-batch-overlap"), "enable_two_batch_overlap=True is not "
     "supported (adaptive state swap would discard the TboAttnBackend wrapper)"),
], ids=["topk 4", "standalone draft", "attention dp", "attention dp, 0.5.23's old flags",
        "two-batch overlap"])
def test_where_adaptive_mode_cannot_run_the_flags_give_a_static_server(args, reason):
    settings = parse([*args, *ADAPTIVE])
    assert settings.adaptive is None and settings.adaptive_fallback == reason


@pytest.mark.parametrize(("extra", "padded"), [
    ((), 40),  # SGLang's sizes up to the running cap: 33 runs as 40
    (("--max-running-requests", "36"), 36),
    (("--cuda-graph-max-bs-decode", "36"), 36),
    (("--cuda-graph-bs-decode", "1", "34", "48"), 34),
    (("--disable-cuda-graph",), 33),
    (("--disable-decode-cuda-graph",), 33),
    (("--disable-cuda-graph-padding",), 33),
    (("--cuda-graph-backend-decode", "disabled"), 33),
    (("--disable-decode-cuda-graph", "--cuda-graph-backend-decode", "full"), 40),
    (("--cuda-graph-config", '{"decode": {"backend": "disabled"}}'), 33),
    (("--cuda-graph-bs-decode", "1", "34", "48", "--cuda-graph-config",
      '{"decode": {"bs": [1, 48]}}'), 48),
    (("--cuda-graph-config", '{"decode": {"max_bs": 36}}'), 36),
], ids=["default", "running cap", "max bs", "sizes", "graphs off, deprecated",
        "decode graphs off", "no padding", "decode backend off", "backend wins",
        "json backend", "json wins", "json max bs"])
def test_an_adaptive_server_routes_a_batch_padded_as_its_graph_flags_say(extra, padded):
    """SGLang pads a running decode batch up to the next CUDA-graph size it captured, then
    picks the slot; with decode graphs or padding off the batch runs as it is. The
    emulator resolves the flags as 0.5.23 does: --cuda-graph-config over the backend flag
    over the switches (it padded by the default sizes whatever the flags said)."""
    config = {key: {"candidate_steps": [1, 3]} for key in ("1", "34", "36", "40", "48")}
    settings = parse([*spec_flags("--max-running-requests", "64"), *extra, *ADAPTIVE])
    schedule = Schedule(config, 3, settings.decode_graph_sizes)
    slot = {33: 1, 34: 34, 36: 36, 40: 40, 48: 48}[padded]
    assert schedule.slot_key(33) == slot


@pytest.mark.parametrize(("args", "words"), [
    (("--cuda-graph-config", "{decode"), "--cuda-graph-config must be JSON"),
    (("--cuda-graph-config", '["decode"]'), "must be a JSON object, got list"),
    (("--cuda-graph-config", '{"prefil": {}}'), "unknown phase 'prefil'"),
    (("--cuda-graph-config", '{"decode": null}'), r"\['decode'\] must be a JSON object"),
    (("--cuda-graph-config", '{"decode": {"max-bs": 8}}'), "unknown key 'max-bs'"),
    (("--cuda-graph-config", '{"decode": {"backend": "eager"}}'), "invalid choice: 'eager'"),
    (("--cuda-graph-config", '{"decode": {"bs": [1, "eight"]}}'),
     r"--cuda-graph-config\['decode'\] bs must be a list of positive integers"),
    (("--cuda-graph-config", '{"decode": {"max_bs": 0}}'),
     r"--cuda-graph-config\['decode'\] max_bs must be a positive integer"),
    (("--cuda-graph-bs-decode", "0", "8"),
     "--cuda-graph-bs-decode must be a list of positive integers"),
    # Sizes asked for that none is a multiple SGLang captures (two-batch overlap: of 2).
    (("--enable-two-batch-overlap", "--cuda-graph-bs-decode", "1", "3"), "capture_bs=\\[\\]"),
    (("--enable-two-batch-overlap", "--cuda-graph-max-bs-decode", "8", "--cuda-graph-config",
      '{"decode": {"max_bs": 1}}'), "capture_bs=\\[\\]"),
], ids=["not json", "a list", "unknown phase", "phase not an object", "unknown key",
        "unknown backend", "bs not integers", "max_bs zero", "flag sizes", "no multiple",
        "json max_bs below the multiple"])
def test_cuda_graph_settings_sglang_cannot_take_are_refused_at_parse_time(args, words):
    with pytest.raises(LaunchError, match=words):
        parse([*spec_flags(), *args])


def test_cuda_graph_sizes_the_json_makes_capturable_start():
    # The study's own max of 1 under two-batch overlap captures nothing, the JSON's 8 does.
    settings = parse([*spec_flags("--enable-two-batch-overlap"), "--cuda-graph-max-bs-decode",
                      "1", "--cuda-graph-config", '{"decode": {"max_bs": 8}}'])
    assert settings.decode_graph_sizes == [2, 4, 6, 8]


def test_enable_dp_attention_alone_leaves_adaptive_mode_on():
    # --enable-dp-attention with --dp-size 1 runs no data-parallel attention in 0.5.23.
    settings = parse(spec_flags("--enable-dp-attention", *ADAPTIVE))
    assert settings.adaptive is not None and settings.adaptive_fallback is None


def test_an_adaptive_config_sglang_refuses_is_refused_at_parse_time(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"ema_alpha": 0.3}))
    with pytest.raises(LaunchError, match="at least one integer-string BS key"):
        parse(spec_flags(*ADAPTIVE, "--speculative-adaptive-config", str(empty)))
    with pytest.raises(LaunchError, match="cannot read"):
        parse(spec_flags(*ADAPTIVE, "--speculative-adaptive-config",
                         str(tmp_path / "missing.json")))


def write_config(tmp_path: Path, config: object, name: str = "adaptive.json") -> str:
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


REFUSED_WITHIN_S = 20.0  # as test_emulator.py: the interpreter's start on a busy machine


@pytest.mark.parametrize("case", ["steps not a candidate", "not JSON"])
def test_a_refused_adaptive_config_exits_nonzero_with_sglangs_message(emulators, tmp_path,
                                                                     case):
    if case == "not JSON":
        extra = ("--speculative-adaptive-config", write_config(tmp_path, "{1: [2]}"))
        message = "adaptive.json is not JSON"
    else:
        extra = ("--speculative-adaptive-config",
                 write_config(tmp_path, {"1": {"candidate_steps": [1, 3]}}),
                 "--speculative-num-steps", "2")
        message = ("ValueError: --speculative-num-steps=2 is not in the adaptive config "
                   "candidate_steps [1, 3]. Pass one of those values.")
    server = emulators.start(*spec_flags(*ADAPTIVE, *extra))
    assert server.wait_exit(timeout=REFUSED_WITHIN_S) != 0
    assert message in server.stderr and "emulating" not in server.stderr


# ---- over HTTP ---------------------------------------------------------------------------

# Hysteresis that makes each decision certain: slot 1 always rises (up -3) and never
# falls (down -10), slot 8 always falls (down 10) and never rises (up 10).
CERTAIN = {"1": {"candidate_steps": [1, 3, 7], "up_hysteresis": -3, "down_hysteresis": -10},
           "8": {"candidate_steps": [1, 3], "up_hysteresis": 10, "down_hysteresis": 10},
           "warmup_batches": 2, "update_interval": 1}
SERVE = ("--seed", "1", "--no-noise", "--load-time", "0", "--max-running-requests", "16")


def server_info(url: str) -> dict:
    resp = httpx.get(url + "/server_info", timeout=10)
    assert resp.status_code == 200
    return resp.json()


async def generate(url: str, n: int, tokens: int) -> None:
    async with httpx.AsyncClient(headers={"X-Treetune-Dataset": EASY}, timeout=60) as client:
        async def one(i: int) -> None:
            body = {"text": f"request {i}",
                    "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
            resp = await client.post(url + "/generate", json=body)
            assert resp.status_code == 200
        await asyncio.gather(*(one(i) for i in range(n)))


async def client_state(url: str):
    async with ServerClient(url) as client:
        return await client.adaptive_state()


def test_server_info_shows_each_slots_steps_moving_as_its_controller_decides(emulators,
                                                                           tmp_path):
    # The clock runs at twice real time: eight requests arriving a few ms apart still
    # share dozens of rounds at batch 8, and each slot decides after its third.
    server = emulators.healthy(*spec_flags(
        *ADAPTIVE, "--speculative-adaptive-config", write_config(tmp_path, CERTAIN),
        "--time-scale", "2", *SERVE))
    info = server_info(server.url)
    assert info["speculative_adaptive"] is True
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"],
            info["speculative_num_draft_tokens"]) == (3, 1, 4)  # the middle of [1, 3, 7]
    assert adaptive_state(info) == (True, {1: 3, 8: 3})

    asyncio.run(generate(server.url, 1, 64))  # batch 1: slot 1 rises to 7
    assert adaptive_state(server_info(server.url)) == (True, {1: 7, 8: 3})

    asyncio.run(generate(server.url, 8, 256))  # batch 8: slot 8 falls to 1
    assert asyncio.run(client_state(server.url)) == (True, {1: 7, 8: 1})
    assert "Adaptive spec params updated: steps 3 -> 7" in server.stderr
    assert "Adaptive spec params updated: steps 3 -> 1" in server.stderr


def test_with_topk_4_the_server_warns_serves_the_static_tree_and_treetune_says_so(emulators):
    server = emulators.healthy(*spec_flags(
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
        "--speculative-num-draft-tokens", "8", *ADAPTIVE, "--time-scale", "20", *SERVE))
    reason = "speculative_eagle_topk=4 (only topk=1 is supported)"
    warned = [line for line in server.stderr.splitlines() if "disabled" in line]
    assert len(warned) == 1 and warned[0].endswith("] " + fallback_warning(reason))
    info = server_info(server.url)
    assert info["speculative_adaptive"] is False
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"],
            info["speculative_num_draft_tokens"]) == (3, 4, 8)
    assert "adaptive_steps_per_slot" not in info["internal_states"][0]
    assert asyncio.run(client_state(server.url)) == (False, {})

    asked = [("--speculative-adaptive", None)]
    assert launch_warnings(asked, info, server.stderr) == [
        "--speculative-adaptive was asked for but the server serves static trees "
        f"(SGLang logged: {reason})"]
    # Without the log line, the server's info alone still tells.
    assert launch_warnings(asked, info, "") == [
        "--speculative-adaptive was asked for but the server serves static trees "
        "(its /server_info says speculative_adaptive=False)"]
    assert launch_warnings([], info, server.stderr) == []  # not asked for: nothing to say


def test_the_sglang_api_reads_adaptive_state_and_keeps_the_flag_in_server_facts():
    assert SGLANG_API.adaptive_state is adaptive_state
    assert "speculative_adaptive" in SGLANG_API.info_keys
    # A server that does not report slots (SGLang 0.5.23 itself): active, steps unknown.
    assert adaptive_state({"speculative_adaptive": True,
                           "internal_states": [{"last_gen_throughput": 1.0}]}) == (True, {})
    assert adaptive_state({}) == (False, {})


# ---- a study's launch --------------------------------------------------------------------

def test_a_launch_asking_for_adaptive_steps_records_when_its_server_fell_back(tmp_path):
    from treetune.results import LaunchResult
    from treetune.study.spec import load_study
    from treetune.study.worker import LaunchWorker

    spec = load_study(None, small_study(tmp_path, batch=[1], datasets=["humaneval"],
                                        compare=[],
                                        server_flags={"--speculative-adaptive": None}))
    worker = LaunchWorker(spec, 0)
    wide = LaunchResult.from_dict(worker.run("3,4,8", []))  # through storage's format
    chain = LaunchResult.from_dict(worker.run("3,1,4", []))
    assert wide.ok and chain.ok, (wide.reason, chain.reason)
    assert wide.server_info["speculative_adaptive"] is False
    assert unlagged(wide.warnings) == [
        "--speculative-adaptive was asked for but the server serves static trees (SGLang "
        "logged: speculative_eagle_topk=4 (only topk=1 is supported))"]
    assert chain.server_info["speculative_adaptive"] is True and unlagged(chain.warnings) == []
    assert wait_until(lambda: not server_processes(str(tmp_path)), 5)


def test_requests_a_server_refuses_are_told_with_its_reason(tmp_path):
    """SGLang refuses a prompt whose tokens and max_new_tokens exceed its context length
    (HTTP 400, `_validate_one_request`); the cell measures the others, and the study
    says so instead of measuring a workload that is not the dataset's (a helper's audit:
    the emulator served every prompt)."""
    from treetune.results import LaunchResult
    from treetune.study.spec import load_study
    from treetune.study.worker import LaunchWorker

    # Of humaneval's first 16 requests the 2nd and the 11th ask for more than 370 tokens in
    # all (prompt and answer), as the emulator counts them: a short cell sends both.
    spec = load_study(None, small_study(tmp_path, batch=[1], datasets=["humaneval"],
                                        compare=[], server_flags={"--context-length": "370"}))
    result = LaunchResult.from_dict(LaunchWorker(spec, 0).run("3,1,4", []))
    assert result.ok, result.reason
    (cell,) = result.cells
    assert cell.errors > 0 and cell.requests > 0
    assert "exceeds the model's maximum context length of 370 tokens" in cell.error
    (told,) = [w for w in result.warnings if "failed" in w]
    many = "s failed and the cell measured the others; the last said: "
    one = " failed and the cell measured the others; it said: "
    assert told.startswith(f"humaneval at batch 1: {cell.errors} request"
                           f"{many if cell.errors > 1 else one}")
    assert told.endswith(cell.error)
    assert wait_until(lambda: not server_processes(str(tmp_path)), 5)
