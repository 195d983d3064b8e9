"""Parse SGLang launch flags as the emulator's command line, and refuse what SGLang refuses."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from treetune.backends import sglang_adaptive
from treetune.backends._base import parse_version
from treetune.backends.sglang import (
    CHAIN_BACKENDS,
    CONFIG_FILE_SINCE,
    DEFAULT_SGLANG_VERSION,
    KNOWN_ALGORITHMS,
    NGRAM,
    NGRAM_BREADTH_FLAG,
    NGRAM_DEFAULT_DRAFT_TOKENS,
    NGRAM_FLAGS,
    NGRAM_MATCH_TYPES,
    PAGED_NGRAM_BACKENDS,
    PAGED_TREE_BACKENDS,
    REJECTION_SAMPLING_FLAGS,
    SPEC_DEFAULT_MAX_RUNNING,
    ServerFlags,
    adaptive_blocker,
    capture_multiple,
    command_line_only,
    needs_draft_model,
    ngram_tree,
    profile_method,
    resolved_algorithm,
)
from treetune.config import BASELINE, ServerConfig, TreeConfig, tree_problem
from treetune.errors import TreetuneError

NO_SPEC_DEFAULT_MAX_RUNNING = 1024
DEFAULT_TREE = (3, 1, 4)  # SGLang's automatic choice for non-Llama targets
EMULATED_SGLANG_VERSION = DEFAULT_SGLANG_VERSION


EMULATOR_KEYS = frozenset({"profile", "world", "time_scale", "load_time", "seed", "noise",
                           "crash_after_requests", "hang_on_startup", "fail_on_startup",
                           "emulate_version", "config"})


CUDA_GRAPH_ALIAS_GONE = (0, 5, 20)  # the first wheel seen without --cuda-graph-max-bs
GRAPH_BACKENDS = ("full", "breakable", "disabled")  # a phase's CUDA-graph backend (0.5.23)
# --cuda-graph-config's phases and each one's keys (0.5.23's ALLOWED_KEYS_PER_PHASE).
GRAPH_PHASE_KEYS = {
    "decode": ("backend", "max_bs", "bs"),
    "prefill": ("backend", "max_bs", "bs", "max_context_size", "full_prefill_max_req",
                "full_prefill_prefix_chunk_tokens", "max_seq_len"),
}
# Flags the emulator knows only to read abbreviations as SGLang does: it serves as without.
UNMODELLED_GRAPH_FLAGS = ("--disable-prefill-cuda-graph", "--cuda-graph-backend-prefill",
                          "--cuda-graph-bs-prefill", "--cuda-graph-max-bs-prefill",
                          "--cuda-graph-max-seq-len-prefill", "--cuda-graph-prefill-max-context",
                          "--debug-cuda-graph", "--enable-profile-cuda-graph")


def _given(ns: argparse.Namespace, flag: str) -> bool:
    """Whether the parsed flags hold `flag` (a value, or a store-true switch set)."""
    return getattr(ns, flag[2:].replace("-", "_")) not in (None, False)


class _DecodeSizesAlias(argparse.Action):
    """0.5.9's --cuda-graph-bs: the decode sizes under 0.5.14's alias (the last of the two
    given wins), its use kept for the releases that have no such flag."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.cuda_graph_bs_alias = True


class LaunchError(Exception):
    """SGLang would refuse to start with these flags; the message imitates SGLang's."""


@dataclass(frozen=True)
class AdaptiveLaunch:
    """`--speculative-adaptive` as SGLang resolves it: the checked JSON config and the
    steps every slot starts from (its `--speculative-num-steps`)."""

    config: dict[str, Any]
    config_path: str | None
    steps: int

    @property
    def longest(self) -> TreeConfig:
        """The chain SGLang sizes its buffers for: the largest candidate steps."""
        steps = max(1, max(sglang_adaptive.candidate_steps(self.config)))
        return TreeConfig.of(steps, 1, steps + 1)

    def schedule(self, graph_sizes: list[int]) -> sglang_adaptive.Schedule:
        """The per-slot controllers, routing a running batch padded up to the next of the
        CUDA-graph batch sizes SGLang captured for decode (`decode_graph_sizes`; none: as
        it is)."""
        return sglang_adaptive.Schedule(self.config, self.steps, graph_sizes)


@dataclass
class EmulatorSettings:
    profile: str | None
    model_path: str
    config: ServerConfig
    algorithm: str | None
    draft_model_path: str | None
    tp: int
    host: str
    port: int
    enable_metrics: bool
    max_running_requests: int
    max_running_requests_set: bool
    attention_backend: str
    mem_fraction_static: float | None
    cuda_graph_max_bs: int | None
    # The decode CUDA-graph batch sizes a running batch is padded up to ([]: not padded).
    decode_graph_sizes: list[int]
    served_model_name: str
    api_key: str | None
    time_scale: float
    load_time: float
    seed: int | None
    noise: bool
    crash_after_requests: int | None
    hang_on_startup: bool
    fail_on_startup: bool
    sglang_version: str
    world: str | None = None
    adaptive: AdaptiveLaunch | None = None  # adaptive steps, when asked for and they can run
    adaptive_fallback: str | None = None  # why asked-for adaptive steps cannot run
    ignored_flags: list[str] = field(default_factory=list)
    raw_args: dict[str, object] = field(default_factory=dict)
    # The profile method that times this server (None: no speculation), and the
    # speculative arguments as SGLang resolves them (what /server_info reports).
    method: str | None = None
    speculative: dict[str, object] = field(default_factory=dict)
    # --context-length: a request whose prompt and max_new_tokens exceed it is refused
    # (None: no limit, the emulator knows no model's); --allow-auto-truncate cuts it instead.
    context_length: int | None = None
    allow_auto_truncate: bool = False
    # Data-parallel attention groups (--attn-dp-size, or --dp-size with
    # --enable-dp-attention; 1: none), each taking max_running_requests // groups requests.
    attention_dp: int = 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m treetune.emulator",
        description="An SGLang-compatible server whose timing and acceptance come from a "
        "treetune performance profile. Takes SGLang's launch_server flags; unknown SGLang "
        "flags are ignored with a warning.",
    )
    emu = p.add_argument_group("emulator")
    emu.add_argument("--profile", default=None, help="shipped profile name or YAML path")
    emu.add_argument("--world", default=None,
                     help="a world (shipped name or YAML path) to serve instead of a profile: "
                     "a profile plus effects its model cannot express, or replayed cells")
    emu.add_argument("--time-scale", type=float, default=1.0,
                     help="run this many times faster than the emulated GPU (default 1)")
    emu.add_argument("--load-time", type=float, default=2.0,
                     help="emulated seconds of model loading before /health turns 200")
    emu.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    emu.add_argument("--no-noise", dest="noise", action="store_false",
                     help="turn the profile's launch and measurement noise off")
    emu.add_argument("--crash-after-requests", type=int, default=None,
                     help="fault switch: take this many requests, then exit abruptly (code 70) "
                          "when the next arrives")
    emu.add_argument("--hang-on-startup", action="store_true",
                     help="fault switch: never become healthy")
    emu.add_argument("--fail-on-startup", action="store_true",
                     help="fault switch: exit with an error halfway through loading")
    emu.add_argument("--emulate-version", default=EMULATED_SGLANG_VERSION,
                     help="the SGLang release to serve as: /server_info's version, "
                     "--config from 0.5.3, the verify counter from 0.5.13, no "
                     "--cuda-graph-max-bs from 0.5.20")

    sg = p.add_argument_group("SGLang flags")
    sg.add_argument("--model-path", "--model", required=True)
    sg.add_argument("--served-model-name", default=None)
    sg.add_argument("--speculative-algorithm", default=None)
    sg.add_argument("--speculative-draft-model-path", "--speculative-draft-model", default=None)
    sg.add_argument("--speculative-num-steps", type=int, default=None)
    sg.add_argument("--speculative-eagle-topk", type=int, default=None)
    sg.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    sg.add_argument("--speculative-adaptive", action="store_true")
    sg.add_argument("--speculative-adaptive-config", default=None)
    for flag, (kind, default) in NGRAM_FLAGS.items():
        extra = {"choices": NGRAM_MATCH_TYPES} if flag.endswith("match-type") else {}
        sg.add_argument(flag, type=kind, default=default, **extra)
    sg.add_argument("--tp-size", "--tp", type=int, default=1)
    sg.add_argument("--host", default="127.0.0.1")
    sg.add_argument("--port", type=int, default=30000)
    sg.add_argument("--enable-metrics", action="store_true")
    sg.add_argument("--max-running-requests", type=int, default=None)
    sg.add_argument("--attention-backend", default=None)
    sg.add_argument("--mem-fraction-static", type=float, default=None)
    sg.add_argument("--cuda-graph-max-bs", type=int, default=None)
    sg.add_argument("--cuda-graph-max-bs-decode", type=int, default=None)
    sg.add_argument("--cuda-graph-max-bs-prefill", type=int, default=None)
    # Decode CUDA graphs as 0.5.23 resolves them (`decode_graph_sizes`).
    sg.add_argument("--disable-cuda-graph", action="store_true")  # the deprecated switch
    sg.add_argument("--disable-decode-cuda-graph", action="store_true")
    sg.add_argument("--disable-cuda-graph-padding", action="store_true")
    sg.add_argument("--cuda-graph-backend-decode", choices=GRAPH_BACKENDS, default=None)
    sg.add_argument("--cuda-graph-bs-decode", type=int, nargs="+", default=None)
    sg.add_argument("--cuda-graph-bs", type=int, nargs="+", dest="cuda_graph_bs_decode",
                    action=_DecodeSizesAlias)  # before 0.5.20
    sg.set_defaults(cuda_graph_bs_alias=False)
    sg.add_argument("--cuda-graph-config", default=None)
    # The prefill phase's and the other CUDA-graph flags of 0.5.23, taken and not modelled:
    # known, so that an abbreviation reads (or is refused as ambiguous) as SGLang's does.
    sg.add_argument("--disable-prefill-cuda-graph", action="store_true")
    sg.add_argument("--cuda-graph-backend-prefill", choices=GRAPH_BACKENDS, default=None)
    sg.add_argument("--cuda-graph-bs-prefill", type=int, nargs="+", default=None)
    sg.add_argument("--cuda-graph-max-seq-len-prefill", type=int, default=None)
    sg.add_argument("--cuda-graph-prefill-max-context", type=int, default=None)
    sg.add_argument("--debug-cuda-graph", action="store_true")
    sg.add_argument("--enable-profile-cuda-graph", action="store_true")
    sg.add_argument("--api-key", default=None)
    sg.add_argument("--context-length", type=int, default=None)
    sg.add_argument("--allow-auto-truncate", action="store_true")
    sg.add_argument("--trust-remote-code", action="store_true")
    # The emulator keeps no prefix cache: every prompt is prefilled whole, as with this.
    sg.add_argument("--disable-radix-cache", action="store_true")
    sg.add_argument("--config", default=None,
                    help="a YAML file of flags, read before the command line's (SGLang >= "
                    "0.5.3); a study's servers get their API key this way")
    return p


def with_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--config FILE` as SGLang (0.5.3-0.5.23) reads it: a YAML mapping whose every key
    becomes `--KEY`, a store-true flag's `true` the bare flag (`false`: left out), another
    boolean `true`/`false`, a list its items, a mapping its JSON, anything else its str();
    the file's flags go before the command line's, so the command line wins."""
    if "--config" not in argv:
        return argv
    at = argv.index("--config")
    if argv.count("--config") > 1:
        raise LaunchError("ValueError: Multiple config files specified! Only one allowed.")
    if at == len(argv) - 1:
        raise LaunchError("ValueError: No config file specified after --config flag!")
    path = Path(argv[at + 1])
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise LaunchError(f"ValueError: Config file must be YAML format, got: {path.suffix}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise LaunchError(f"ValueError: cannot read config file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise LaunchError("ValueError: Config file must contain a dictionary at root level")
    store_true = {a.dest for a in parser._actions if isinstance(a, argparse._StoreTrueAction)}
    flags: list[str] = []
    for key, value in data.items():
        flag = f"--{key}"
        if command_line_only(flag):
            # 0.5.23 takes plain store_true and one-value flags only (its deprecated
            # switches and --X/--no-X pairs are refused, as here).
            raise LaunchError(f"ValueError: Unsupported config option "
                              f"'{str(key).replace('-', '_')}'")
        if isinstance(value, bool):
            if str(key).replace("-", "_") not in store_true:
                flags += [flag, str(value).lower()]
            elif value:
                flags.append(flag)
        elif isinstance(value, list):
            flags += [flag, *map(str, value)] if value else []
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return [*flags, *argv[:at], *argv[at + 2:]]


def parse(argv: list[str]) -> EmulatorSettings:
    """Parse and validate; raises LaunchError with an SGLang-like message."""
    parser = build_parser()
    read_config = "--config" in argv
    argv = with_config_file(argv, parser)
    ns, unknown = parser.parse_known_args(argv)
    ignored = [a for a in unknown if a.startswith("--")]
    ignored += [flag for flag in UNMODELLED_GRAPH_FLAGS if _given(ns, flag)]
    if (ns.profile is None) == (ns.world is None):
        raise LaunchError("give exactly one of --profile and --world")
    if ns.time_scale <= 0:
        raise LaunchError(f"--time-scale must be > 0, got {ns.time_scale}")
    if ns.load_time < 0:
        raise LaunchError(f"--load-time must be >= 0, got {ns.load_time}")
    if ns.tp_size < 1:
        raise LaunchError(f"--tp-size must be >= 1, got {ns.tp_size}")
    try:
        emulated = parse_version(ns.emulate_version)
    except TreetuneError as exc:
        raise LaunchError(f"--emulate-version: {exc}") from None
    if read_config and emulated < CONFIG_FILE_SINCE:
        raise LaunchError("error: unrecognized arguments: --config (SGLang reads config files "
                          "from 0.5.3)")
    for old, given in (("max-bs", ns.cuda_graph_max_bs is not None),
                       ("bs", ns.cuda_graph_bs_alias)):
        if given and emulated >= CUDA_GRAPH_ALIAS_GONE:
            # 0.5.14 kept it as an alias of the -decode flag; 0.5.20's and 0.5.23's parsers
            # have no such flag, and argparse takes it for an ambiguous abbreviation.
            raise LaunchError(f"error: ambiguous option: --cuda-graph-{old} could match "
                              f"--cuda-graph-{old}-decode, --cuda-graph-{old}-prefill")
    if absent := [flag for flag, release in sglang_adaptive.GRAPH_FLAGS_ABSENT_IN.items()
                  if emulated <= release and _given(ns, flag)
                  and not (flag == sglang_adaptive.GRAPH_SIZES_FLAG and ns.cuda_graph_bs_alias)]:
        raise LaunchError(f"error: unrecognized arguments: {' '.join(absent)} (not flags of "
                          f"SGLang {ns.emulate_version})")
    if ns.context_length is not None and ns.context_length < 1:
        raise LaunchError(f"--context-length must be >= 1, got {ns.context_length}")
    if ns.max_running_requests is not None and ns.max_running_requests < 1:
        raise LaunchError(f"--max-running-requests must be >= 1, got {ns.max_running_requests}")
    parallel = ServerFlags(_flags_of(unknown))
    adaptive, fallback = _adaptive(ns, parallel)
    config = _tree(ns, adaptive)
    algorithm = ns.speculative_algorithm.upper() if config is not BASELINE else None
    attention = ns.attention_backend or (
        # Hopper default: fa3 only for chains (and no speculation), else flashinfer.
        "fa3" if config is BASELINE or config.topk == 1 else "flashinfer"
    )
    max_running = ns.max_running_requests or (
        NO_SPEC_DEFAULT_MAX_RUNNING if config is BASELINE else SPEC_DEFAULT_MAX_RUNNING
    )
    if isinstance(config, TreeConfig) and algorithm:
        _check_drafting(algorithm, attention, config.topk, unknown)
    groups = parallel.attention_dp_size
    if groups > 1:
        if ns.tp_size % groups:
            raise LaunchError(f"AssertionError: tp_size ({ns.tp_size}) must be divisible by "
                              f"the data-parallel attention size ({groups})")
        # --dp-size beside an --attn-dp-size above 1 starts replicas: not modelled.
        sources = (("--attn-dp-size",) if parallel.above("--attn-dp-size", 1)
                   else ("--enable-dp-attention", "--dp-size"))
        used = {parallel.given(f) for f in sources}
        ignored = [a for a in ignored if a.partition("=")[0] not in used]
        # Each group runs max_running_requests // groups requests at most (tp_worker.py
        # asserts that is one or more).
        if max_running < groups:
            raise LaunchError("AssertionError: max_running_request is zero (each of the "
                              f"{groups} data-parallel attention groups takes "
                              f"max_running_requests // {groups} = 0 requests)")
        max_running = max_running // groups * groups
    multiple = capture_multiple(parallel.flags, ns.tp_size)
    graph_sizes = decode_graph_sizes(_decode_graphs(ns), ns.disable_cuda_graph_padding,
                                     max_running, multiple)
    return EmulatorSettings(
        profile=ns.profile,
        world=ns.world,
        model_path=ns.model_path,
        config=config,
        algorithm=ns.speculative_algorithm,
        draft_model_path=ns.speculative_draft_model_path,
        tp=ns.tp_size,
        host=ns.host,
        port=ns.port,
        enable_metrics=ns.enable_metrics,
        max_running_requests=max_running,
        max_running_requests_set=ns.max_running_requests is not None,
        attention_backend=attention,
        mem_fraction_static=ns.mem_fraction_static,
        cuda_graph_max_bs=ns.cuda_graph_max_bs_decode or ns.cuda_graph_max_bs,
        decode_graph_sizes=graph_sizes,
        served_model_name=ns.served_model_name or ns.model_path,
        api_key=ns.api_key,
        context_length=ns.context_length,
        allow_auto_truncate=ns.allow_auto_truncate,
        time_scale=ns.time_scale,
        load_time=ns.load_time,
        seed=ns.seed,
        noise=ns.noise,
        crash_after_requests=ns.crash_after_requests,
        hang_on_startup=ns.hang_on_startup,
        fail_on_startup=ns.fail_on_startup,
        sglang_version=ns.emulate_version,
        ignored_flags=ignored,
        attention_dp=groups,
        raw_args={k: v for k, v in vars(ns).items() if k not in EMULATOR_KEYS},
        adaptive=adaptive,
        adaptive_fallback=fallback,
        method=profile_method(algorithm) if algorithm else None,
        speculative=_resolved(ns, algorithm, config, adaptive),
    )


def _decode_graphs(ns: argparse.Namespace) -> dict[str, Any]:
    """The decode phase's CUDA-graph settings as SGLang 0.5.23 resolves them
    (`parse_cuda_graph_config`): the deprecated --disable-cuda-graph, then
    --disable-decode-cuda-graph, then --cuda-graph-backend-decode and the size flags, and
    over them all --cuda-graph-config's "decode" JSON (checked as SGLang's parser checks
    it: `parse_cuda_graph_config_arg`)."""
    decode: dict[str, Any] = {"backend": "full"}
    if ns.disable_cuda_graph or ns.disable_decode_cuda_graph:
        decode["backend"] = "disabled"
    if ns.cuda_graph_backend_decode is not None:
        decode["backend"] = ns.cuda_graph_backend_decode
    if (top := ns.cuda_graph_max_bs_decode or ns.cuda_graph_max_bs) is not None:
        decode["max_bs"] = top
    if ns.cuda_graph_bs_decode is not None:
        decode["bs"] = ns.cuda_graph_bs_decode
    _check_sizes(decode, "--cuda-graph-bs-decode", "--cuda-graph-max-bs-decode")
    if ns.cuda_graph_config is not None:
        phases = _graph_config(ns.cuda_graph_config)
        decode.update(phases.get("decode", {}))
        _check_sizes(decode, "--cuda-graph-config['decode'] bs",
                     "--cuda-graph-config['decode'] max_bs")
    return decode


def _graph_config(raw: str) -> dict[str, dict[str, Any]]:
    """--cuda-graph-config's phases, refused in SGLang's words where its parser refuses
    them: not a JSON object, an unknown phase or key, a backend it does not know."""
    def refuse(words: str) -> LaunchError:
        return LaunchError(f"error: argument --cuda-graph-config: {words}")

    try:
        parsed = json.loads(raw)
    except ValueError as exc:
        raise refuse(f"--cuda-graph-config must be JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise refuse(f"--cuda-graph-config must be a JSON object, got "
                     f"{type(parsed).__name__}")
    for phase, settings in parsed.items():
        if phase not in GRAPH_PHASE_KEYS:
            raise refuse(f"--cuda-graph-config: unknown phase '{phase}', expected one of "
                         f"{tuple(GRAPH_PHASE_KEYS)}")
        if not isinstance(settings, dict):
            raise refuse(f"--cuda-graph-config['{phase}'] must be a JSON object, got "
                         f"{type(settings).__name__}")
        if "backend" in settings and settings["backend"] not in GRAPH_BACKENDS:
            raise refuse(f"invalid choice: {settings['backend']!r} (choose from "
                         f"{', '.join(GRAPH_BACKENDS)})")
        for key in settings:
            if key not in GRAPH_PHASE_KEYS[phase]:
                raise refuse(f"--cuda-graph-config['{phase}']: unknown key '{key}', "
                             f"expected one of {GRAPH_PHASE_KEYS[phase]}")
    return parsed


def _check_sizes(decode: dict[str, Any], sizes_from: str, top_from: str) -> None:
    """The decode graph sizes are positive integers (`sizes_from`, `top_from`: where they
    were given, for the message)."""
    def positive(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    sizes, top = decode.get("bs"), decode.get("max_bs")
    if sizes is not None and not (isinstance(sizes, list) and sizes
                                  and all(positive(b) for b in sizes)):
        raise LaunchError(f"{sizes_from} must be a list of positive integers, got {sizes!r}")
    if top is not None and not positive(top):
        raise LaunchError(f"{top_from} must be a positive integer, got {top!r}")


def decode_graph_sizes(decode: dict[str, Any], no_padding: bool, max_running: int,
                       multiple: int) -> list[int]:
    """The batch sizes a running decode batch is padded up to: those SGLang captures (the
    explicit list, or its sizes up to the decode max and never above the running cap;
    only multiples of `multiple`, `capture_multiple`), none with decode graphs off or
    --disable-cuda-graph-padding (graphs then run only where no padding is needed).
    Raises LaunchError, as SGLang's capture asserts, when sizes were asked for and none of
    them can be captured."""
    if decode["backend"] == "disabled":
        return []
    asked = decode.get("bs") or sglang_adaptive.graph_batch_sizes(
        min(decode.get("max_bs") or max_running, max_running))
    captured = sorted(b for b in asked if b % multiple == 0)
    if not captured and ("bs" in decode or "max_bs" in decode):
        given = decode.get("bs") or f"up to {decode.get('max_bs')}"
        raise LaunchError(f"AssertionError: capture_bs=[] (SGLang captures only multiples of "
                          f"{multiple} here, and the decode graph sizes asked for are "
                          f"{given})")
    return [] if no_padding else captured


def _check_drafting(algorithm: str, attention: str, topk: int, unknown: list[str]) -> None:
    """What SGLang 0.5.23 refuses as it starts (`handle_speculative_decoding`,
    `_handle_eagle_family`, `_handle_ngram`; aiter's once loaded), with its messages: block
    verification or rejection sampling by another draft than EAGLE's, and a branching tree
    (topk > 1) with trtllm_mha or aiter (chains only), with rejection sampling (chains
    only), or on pages of more than one token but with the few backends that hold a tree.
    The emulator takes these flags (as SGLang's parser reads them: abbreviated, `=value`,
    the last one given) only to refuse as SGLang does."""
    parallel = ServerFlags(_flags_of(unknown))
    page_flag = parallel.given("--page-size")
    if page_flag and parallel.number("--page-size") is None:
        raise LaunchError(f"error: argument --page-size: invalid int value: "
                          f"{parallel.value('--page-size')!r}")
    if parallel.given("--speculative-use-block-verification") and algorithm in (
            "STANDALONE", NGRAM):
        raise LaunchError("ValueError: --speculative-use-block-verification only supports "
                          "EAGLE / EAGLE3 / NEXTN / DFLASH / DSPARK.")
    sampled = parallel.first_given(REJECTION_SAMPLING_FLAGS)
    if sampled and algorithm == "STANDALONE":
        raise LaunchError("NotImplementedError: --speculative-use-rejection-sampling is only "
                          "supported for EAGLE / EAGLE3 / NEXTN, not "
                          "speculative_algorithm=STANDALONE.")
    if topk <= 1:
        return
    backends = parallel.attention_backends(attention)
    if algorithm != NGRAM:
        if "aiter" in backends[:1]:
            raise LaunchError(f"NotImplementedError: AiterAttnBackend SPEC_V2 path currently "
                              f"supports topk <= 1 only. Got topk={topk}.")
        if any(b in CHAIN_BACKENDS and b != "aiter" for b in backends):
            raise LaunchError("ValueError: trtllm_mha backend only supports topk = 1 for "
                              "speculative decoding.")
        if sampled:
            raise LaunchError("ValueError: --speculative-use-rejection-sampling requires "
                              "--speculative-eagle-topk=1.")
    backend = backends[0]
    page = parallel.page_size(backend)
    if page <= 1:
        return
    if algorithm == NGRAM and backend not in PAGED_NGRAM_BACKENDS:
        raise LaunchError(f"ValueError: speculative_eagle_topk({topk}) > 1 with page_size("
                          f"{page}) > 1 is unstable and produces incorrect results for paged "
                          "attention backends. This combination is only supported for the "
                          "'flashinfer' backend.")
    if algorithm != NGRAM and backend not in PAGED_TREE_BACKENDS:
        raise LaunchError(f"ValueError: speculative_eagle_topk > 1 with page_size > 1 is only "
                          f"supported on {PAGED_TREE_BACKENDS}; got attention_backend="
                          f"{backend!r}. Use page_size == 1 or one of those backends.")


def _flags_of(args: list[str]) -> dict[str, str | None]:
    """`--flag value`, `--flag=value` and bare `--flag` among `args`, the last of each."""
    flags: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg.partition("=")
        if not eq:
            following = args[i + 1] if i + 1 < len(args) else None
            value = None if following is None or following.startswith("--") else following
        flags.pop(name, None)
        flags[name] = value
    return flags


def _adaptive(ns: argparse.Namespace, parallel: ServerFlags
              ) -> tuple[AdaptiveLaunch | None, str | None]:
    """`--speculative-adaptive` as SGLang takes it: dropped, with only a warning, when it
    cannot run (`parallel`: the flags beside the ones the emulator parses, data-parallel
    attention and two-batch overlap among them); else its config is loaded and checked,
    and the starting steps must be one of its candidates (the middle one when not
    given)."""
    if not ns.speculative_adaptive:
        return None, None
    blocker = adaptive_blocker(parallel.flags)
    reason = sglang_adaptive.unsupported_reason(
        ns.speculative_algorithm, ns.speculative_eagle_topk) or (blocker and blocker[1])
    if reason is not None:
        return None, reason
    try:
        config = sglang_adaptive.load(ns.speculative_adaptive_config)
        steps = sglang_adaptive.initial_steps(config, ns.speculative_num_steps)
    except sglang_adaptive.AdaptiveConfigError as exc:
        raise LaunchError(f"ValueError: {exc}") from None
    return AdaptiveLaunch(config, ns.speculative_adaptive_config, steps), None


def _resolved(ns: argparse.Namespace, algorithm: str | None, config: ServerConfig,
              adaptive: AdaptiveLaunch | None = None) -> dict[str, object]:
    """The speculative server args as SGLang resolves them: NEXTN runs as EAGLE; an NGRAM
    server's topk is its breadth and its steps, unused, default to draft_tokens // topk."""
    if algorithm is None or not isinstance(config, TreeConfig):
        return {"speculative_algorithm": None, "speculative_num_steps": None,
                "speculative_eagle_topk": None, "speculative_num_draft_tokens": None}
    if adaptive is not None:  # SGLang reports the chain an adaptive server starts from
        return {"speculative_algorithm": resolved_algorithm(algorithm),
                "speculative_num_steps": adaptive.steps, "speculative_eagle_topk": 1,
                "speculative_num_draft_tokens": adaptive.steps + 1}
    steps = config.steps
    if algorithm == NGRAM:
        steps = ns.speculative_num_steps or config.draft_tokens // config.topk
    return {"speculative_algorithm": resolved_algorithm(algorithm),
            "speculative_num_steps": steps, "speculative_eagle_topk": config.topk,
            "speculative_num_draft_tokens": config.draft_tokens}


def _tree(ns: argparse.Namespace, adaptive: AdaptiveLaunch | None = None) -> ServerConfig:
    knobs = {
        "--speculative-num-steps": ns.speculative_num_steps,
        "--speculative-eagle-topk": ns.speculative_eagle_topk,
        "--speculative-num-draft-tokens": ns.speculative_num_draft_tokens,
    }
    given = [k for k, v in knobs.items() if v is not None]
    if ns.speculative_algorithm is None:
        if given:
            raise LaunchError(
                f"{', '.join(given)} given without --speculative-algorithm; "
                "set --speculative-algorithm EAGLE3 to enable speculative decoding"
            )
        return BASELINE
    algorithm = ns.speculative_algorithm.upper()
    if algorithm not in KNOWN_ALGORITHMS:
        raise LaunchError(f"Unsupported speculative algorithm: {ns.speculative_algorithm}")
    if needs_draft_model(algorithm) and ns.speculative_draft_model_path is None:
        raise LaunchError(f"{algorithm} requires --speculative-draft-model-path")
    if adaptive is not None:
        # SGLang sets topk 1, the starting steps and steps + 1 draft tokens before its
        # all-or-none rule, so any of the three may be left out.
        return adaptive.longest
    if algorithm == NGRAM:
        return _ngram_tree(ns)
    if given and len(given) < 3:
        missing = [k for k in knobs if k not in given]
        raise LaunchError(
            "AssertionError: --speculative-num-steps, --speculative-eagle-topk and "
            "--speculative-num-draft-tokens must be set together or not at all "
            f"(missing {', '.join(missing)})"
        )
    steps, topk, draft = (
        (ns.speculative_num_steps, ns.speculative_eagle_topk, ns.speculative_num_draft_tokens)
        if given else DEFAULT_TREE
    )
    problem = tree_problem(steps, topk, draft)
    if problem is not None:
        if "too large" in problem:
            raise LaunchError(f"RuntimeError: selected index out of range ({problem})")
        raise LaunchError(f"ValueError: invalid speculative config: {problem}")
    return TreeConfig.of(steps, topk, draft)


def _ngram_tree(ns: argparse.Namespace) -> TreeConfig:
    """NGRAM's tree: --speculative-num-draft-tokens (12 when unset) verified tokens, at
    most the max BFS breadth of continuations per trie node. SGLang overwrites
    --speculative-eagle-topk with that breadth and drafts without --speculative-num-steps,
    so neither shapes the tree."""
    draft_tokens = ns.speculative_num_draft_tokens or NGRAM_DEFAULT_DRAFT_TOKENS
    breadth = getattr(ns, NGRAM_BREADTH_FLAG.lstrip("-").replace("-", "_"))
    # SGLang takes both as given; a tree with no draft or no branch fails once it runs.
    if draft_tokens < 2:
        raise LaunchError(f"ValueError: invalid speculative config: draft_tokens must be >= 2 "
                          f"(the root plus at least one draft), got {draft_tokens}")
    if breadth < 1:
        raise LaunchError(f"ValueError: invalid speculative config: {NGRAM_BREADTH_FLAG} "
                          f"must be >= 1, got {breadth}")
    return ngram_tree(draft_tokens, breadth)


def warn_ignored(settings: EmulatorSettings) -> None:
    if settings.ignored_flags:
        print(f"[emulator] WARNING: ignoring SGLang flags the emulator does not model: "
              f"{' '.join(settings.ignored_flags)}", file=sys.stderr, flush=True)
