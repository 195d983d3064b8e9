"""SGLang 0.5.23's adaptive speculative steps (`--speculative-adaptive`), as a model of
what the server does: its JSON config and validation, routing of a running batch to a
batch-size slot, and each slot's step controller (domain.md section 7).

The emulator serves adaptive mode with it (treetune/emulator/engine.py routes every decode
round through a `Schedule`); treetune can check the configs it writes by the same rules.

A slot keeps an exponential moving average of accepted draft tokens per request. After
`warmup_batches` verifies, every `update_interval` verifies it steps down while the average
is at or below (next lower candidate - 0.5 + down_hysteresis; 0.5 + down_hysteresis when
the lower candidate is 0, no drafting), else up while it is above (current - 0.5 +
up_hysteresis); from 0 it probes the next positive candidate. `ceiling_coeff` > 0 caps a
step that did not rise at ceil(average x coeff).
"""

from __future__ import annotations

import bisect
import copy
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The per-batch-size config file this module writes and reads, read by SGLang from 0.5.13
# (the wheels' speculative/adaptive_spec_params.py: 0.5.13 takes digit keys as slots; 0.5.11
# and 0.5.12 read one flat config and ignore the slots, serving candidate steps [1, 3, 7];
# 0.5.10 has no --speculative-adaptive).
SLOT_CONFIG_SINCE = (0, 5, 13)

# SGLang's default config (domain.md section 7): a guess, which a tuned config replaces.
DEFAULT_CONFIG: dict[str, Any] = {
    "1": {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25,
          "ceiling_coeff": 0},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0,
          "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0,
           "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0,
           "ceiling_coeff": 0},
}
# Per-slot settings and SGLang's defaults when neither the slot nor the top level sets them.
SLOT_DEFAULTS: dict[str, float] = {"ema_alpha": 0.2, "update_interval": 5,
                                   "warmup_batches": 10, "up_hysteresis": 0.0,
                                   "down_hysteresis": -0.25, "ceiling_coeff": 0}
ALGORITHMS = ("EAGLE", "EAGLE3")  # the only ones adaptive mode runs with
# SGLang resolves NEXTN (MTP heads) to EAGLE before it asks whether adaptive mode can run.
ALIASES = {"NEXTN": "EAGLE"}


class AdaptiveConfigError(ValueError):
    """SGLang would refuse this adaptive config at start-up; the message imitates it."""


def _steps_valid(steps: object) -> bool:
    # SGLang's own test: a non-empty list of ints >= 0 (so it takes what Python calls int).
    return (isinstance(steps, list) and bool(steps)
            and all(isinstance(s, int) and s >= 0 for s in steps))


def validate(config: object) -> dict[int, dict[str, Any]]:
    """The config's batch-size slots, checked as SGLang checks them: keys made of digits
    are slots (other keys are top-level settings), each with a non-empty list of
    non-negative ints as `candidate_steps`, and at least one slot."""
    if not isinstance(config, Mapping):
        raise AdaptiveConfigError(
            f"speculative_adaptive_config must be a JSON object, got {type(config).__name__}")
    slots: dict[int, dict[str, Any]] = {}
    for key, entry in config.items():
        if not isinstance(key, str) or not key.isdigit():
            continue
        steps = entry.get("candidate_steps") if isinstance(entry, Mapping) else None
        if not _steps_valid(steps):
            raise AdaptiveConfigError(
                f"BS {key}: candidate_steps must be a list of non-negative ints, got {steps!r}")
        slots[int(key)] = dict(entry)
    if not slots:
        raise AdaptiveConfigError(
            "speculative_adaptive_config must contain at least one integer-string BS key, "
            f'e.g. {{"1": {{"candidate_steps": [1,3,7]}}}}. Got keys: {list(config)}')
    return slots


def load(path: str | Path | None) -> dict[str, Any]:
    """The config in a JSON file (SGLang's default without one), validated."""
    if path is None:
        return copy.deepcopy(DEFAULT_CONFIG)
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise AdaptiveConfigError(f"cannot read speculative_adaptive_config {path}: "
                                  f"{e.strerror}") from e
    except UnicodeDecodeError as e:
        raise AdaptiveConfigError(f"speculative_adaptive_config {path} is not UTF-8 text "
                                  f"(byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise AdaptiveConfigError(f"speculative_adaptive_config {path} is not JSON: {e}") from e
    validate(config)
    return config


def candidate_steps(config: Mapping[str, Any]) -> list[int]:
    """Every slot's candidate steps together, sorted: `--speculative-num-steps` must be one
    of them, and SGLang starts at the middle one when it is not given."""
    return sorted({s for entry in validate(config).values() for s in entry["candidate_steps"]})


def initial_steps(config: Mapping[str, Any], given: int | None) -> int:
    """The `--speculative-num-steps` an adaptive server starts from; refused, as SGLang
    refuses it, when it is not a candidate."""
    steps = candidate_steps(config)
    if given is None:
        return steps[len(steps) // 2]
    if given not in steps:
        raise AdaptiveConfigError(
            f"--speculative-num-steps={given} is not in the adaptive config candidate_steps "
            f"{steps}. Pass one of those values.")
    return given


# Targets whose EAGLE SGLang 0.5.23 runs as multi-layer EAGLE by itself (model overrides in
# srt/arg_groups: overrides.py for Step-3.5/3.7, model_overrides/mimo_v2.py and
# gigachat35.py, each when the algorithm is EAGLE): adaptive steps then fall back to static
# trees with no flag to show it. (Whether NEXTN, which SGLang resolves to EAGLE, meets the
# same override first is not settled here: such a launch is seen after it, by its
# /server_info.)
MULTI_LAYER_EAGLE_ARCHITECTURES = frozenset({
    "Step3p5ForCausalLM", "Step3p7ForConditionalGeneration",
    "MiMoV2ForCausalLM", "MiMoV2FlashForCausalLM",
    "GigaChat35ForCausalLM", "GigaChat35ForCausalLMNextN"})


def multi_layer_problem(algorithm: str, architecture: str) -> str | None:
    """Why adaptive steps of `algorithm` would not run on a target of `architecture` (its
    SGLang override makes its EAGLE multi-layer EAGLE), or None. Not NEXTN's: 0.5.23 runs
    the model overrides (`handle_model_specific_adjustments`, arg_groups/pipeline.py)
    before `handle_speculative_decoding` resolves NEXTN to EAGLE, and the overrides ask for
    "EAGLE" as given (IQuest's asks for either, its algorithm not resolved yet)."""
    if algorithm != "EAGLE" or architecture not in MULTI_LAYER_EAGLE_ARCHITECTURES:
        return None
    return (f"adaptive: SGLang runs EAGLE on {architecture} as multi-layer EAGLE, which does "
            "not run adaptive steps (it serves static trees and only logs why): give "
            "adaptive: false")


DP_ATTENTION_REASON = ("attention DP is not supported (adaptive tier decisions are not "
                       "synchronized across DP ranks)")
# Switches with which SGLang serves static trees though adaptive steps were asked for, and
# its reason (adaptive_unsupported_reason, in its order after data-parallel attention;
# SGLang's parser takes a prefix of each too: `sglang.adaptive_blocker`).
STATIC_WITH = {
    "--enable-multi-layer-eagle": "enable_multi_layer_eagle=True is not supported "
                                  "(MultiLayerEagleWorkerV2 does not implement adaptive)",
    "--enable-two-batch-overlap": "enable_two_batch_overlap=True is not supported (adaptive "
                                  "state swap would discard the TboAttnBackend wrapper)",
    "--enable-pdmux": "enable_pdmux=True is not supported (adaptive state swap does not "
                      "update decode_attn_backend_group)",
}


def unsupported_reason(algorithm: str | None, topk: int | None) -> str | None:
    """Why SGLang would not run adaptive mode with this algorithm and topk (it then logs a
    warning and serves static trees), or None: SGLang's first two reasons; the server
    flags' come after them (`sglang.adaptive_blocker`)."""
    if algorithm is not None:
        algorithm = ALIASES.get(algorithm.upper(), algorithm.upper())
    if algorithm is None or algorithm not in ALGORITHMS:
        return f"speculative_algorithm={algorithm} (only EAGLE/EAGLE3 are supported)"
    if topk is not None and topk != 1:
        return f"speculative_eagle_topk={topk} (only topk=1 is supported)"
    return None


def fallback_warning(reason: str) -> str:
    """The line SGLang logs when it falls back to static trees."""
    return (f"speculative_adaptive disabled: {reason}. "
            "Falling back to static speculative params.")


# That line in a server's log, with its reason as the group.
FALLBACK_LINE = re.compile(
    r"speculative_adaptive disabled: (.+)\. Falling back to static speculative params\.")


def fallback_reason(log: str) -> str | None:
    """The reason of the last fall-back warning in a server's log, or None."""
    found = FALLBACK_LINE.findall(log)
    return found[-1] if found else None


def switch_line(old: int, new: int, ema: float) -> str:
    """The line SGLang logs when a slot changes its steps."""
    return f"Adaptive spec params updated: steps {old} -> {new} (ema_accept_len={ema:.2f})"


def initialized_line(schedule: Schedule) -> str:
    """The line SGLang logs once its controllers are built (the smallest slot's view)."""
    first = schedule.slots[schedule.keys[0]]
    return (f"AdaptiveSpeculativeParams initialized: steps={first.steps}, "
            f"candidate_steps={first.candidates}")


def graph_batch_sizes(max_bs: int) -> list[int]:
    """SGLang's CUDA-graph decode batch sizes with speculation on, up to `max_bs`
    (ServerArgs._generate_decode_cuda_graph_batch_sizes, 0.5.14 to 0.5.23)."""
    sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8),
             *range(272, max_bs + 1, 16)]
    sizes = [b for b in sizes if b <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


def padded_batch(batch: int, graph_sizes: Sequence[int]) -> int:
    """The batch size SGLang serves a running batch as: padded up to the next CUDA-graph
    batch size (sorted `graph_sizes`), itself above them all (or without graphs)."""
    i = bisect.bisect_left(graph_sizes, batch)
    return graph_sizes[i] if i < len(graph_sizes) else batch


# Server flags that turn decode CUDA graphs off (0.5.23's cuda_graph_hook.py: the
# deprecated `--disable-cuda-graph` first, then `--disable-decode-cuda-graph`, both below
# `--cuda-graph-backend-decode`, all below `--cuda-graph-config`'s decode phase), and the one
# that captures graphs only where no padding is needed.
GRAPHS_OFF_FLAGS = ("--disable-cuda-graph", "--disable-decode-cuda-graph")
NO_PADDING_FLAG = "--disable-cuda-graph-padding"
GRAPH_SIZES_FLAG = "--cuda-graph-bs-decode"  # an explicit list of decode graph sizes
GRAPH_SIZES_ALIAS = "--cuda-graph-bs"  # its name before 0.5.14, an alias of it in 0.5.14
GRAPH_BACKEND_FLAG = "--cuda-graph-backend-decode"
GRAPH_CONFIG_FLAG = "--cuda-graph-config"  # JSON per phase; wins over the flags above
# The CUDA-graph flags per phase, new in 0.5.14 (0.5.9's and 0.5.13's parsers have none of
# them; 0.5.20's lacks the last two, 0.5.23's has them).
PHASE_GRAPH_FLAGS = (
    "--disable-decode-cuda-graph", GRAPH_SIZES_FLAG, GRAPH_BACKEND_FLAG, GRAPH_CONFIG_FLAG,
    "--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill", "--cuda-graph-bs-prefill",
    "--cuda-graph-backend-prefill", "--disable-prefill-cuda-graph",
    "--cuda-graph-max-seq-len-prefill", "--cuda-graph-prefill-max-context")
PHASE_GRAPH_SINCE = (0, 5, 14)
# CUDA-graph flags by the newest wheel seen without them (the per-phase ones came in
# 0.5.14, two prefill ones after 0.5.20, --debug-cuda-graph after 0.5.9): SGLang's parser
# of that release or an earlier one refuses them.
GRAPH_FLAGS_ABSENT_IN = {
    **{flag: (0, 5, 13) for flag in PHASE_GRAPH_FLAGS},
    "--cuda-graph-max-seq-len-prefill": (0, 5, 20), "--cuda-graph-prefill-max-context": (0, 5, 20),
    "--debug-cuda-graph": (0, 5, 9)}
# Every CUDA-graph flag of SGLang 0.5.9 to 0.5.23 (their parsers: 0.5.9's server_args.py,
# 0.5.14's with its deprecated aliases, 0.5.20's and 0.5.23's arg_groups): what an
# abbreviation of one of them is told apart from. argparse reads a flag as the option it
# names, or else as the one option it is a prefix of; a prefix of several is refused. No
# other flag of 0.5.23 is a prefix of one of them.
GRAPH_FLAG_NAMES = (
    *PHASE_GRAPH_FLAGS, *GRAPHS_OFF_FLAGS[:1], NO_PADDING_FLAG, GRAPH_SIZES_ALIAS,
    "--cuda-graph-max-bs", "--cuda-graph-tc-compiler", "--debug-cuda-graph",
    "--enable-profile-cuda-graph", "--enable-piecewise-cuda-graph",
    "--disable-piecewise-cuda-graph", "--enforce-piecewise-cuda-graph",
    "--enable-breakable-cuda-graph", "--piecewise-cuda-graph-compiler",
    "--piecewise-cuda-graph-max-tokens", "--piecewise-cuda-graph-tokens",
)


def graph_flag_named(flag: str) -> list[str]:
    """The CUDA-graph flags (GRAPH_FLAG_NAMES) SGLang's parser may read `flag` as: itself,
    or every one it is a prefix of ([] for another flag)."""
    if flag in GRAPH_FLAG_NAMES:
        return [flag]
    return [n for n in GRAPH_FLAG_NAMES if n.startswith(flag)] if len(flag) > 2 else []


def graph_flags(server_flags: Mapping[str, Any]) -> dict[str, Any]:
    """The CUDA-graph flags among `server_flags` by the names SGLang's parser reads them
    as: a flag's own name, or the one name it abbreviates (`graph_flag_named`; an
    abbreviation of several is left out: SGLang refuses it as it starts, and a study
    refuses it as it loads), 0.5.9's `--cuda-graph-bs` as the decode sizes (0.5.14's
    alias of them). The last flag given wins, as on the command line."""
    read: dict[str, Any] = {}
    for flag, value in server_flags.items():
        if len(names := graph_flag_named(flag)) == 1:
            # Given again under another spelling: the later one counts, as the last.
            read[GRAPH_SIZES_FLAG if names[0] == GRAPH_SIZES_ALIAS else names[0]] = value
    return read


def decode_graph_config(value: Any) -> dict[str, Any]:
    """The decode phase of a `--cuda-graph-config` value (a JSON text, or the mapping a
    study file gave), or {} when there is none or it is not such JSON (SGLang's parser
    refuses that at the launch, which says so)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    decode = value.get("decode") if isinstance(value, Mapping) else None
    return dict(decode) if isinstance(decode, Mapping) else {}


def _sizes(given: Any) -> list[int] | None:
    """A list of graph batch sizes as a flag or the JSON gives it, or None when it is not
    all integers (SGLang's parser refuses it at the launch)."""
    values = given if isinstance(given, (list, tuple)) else str(given).split()
    if values and all(str(v).strip().isdigit() for v in values):
        return sorted(int(v) for v in values)
    return None


def graph_sizes_for(batches: Iterable[int],
                    server_flags: Mapping[str, Any] | None = None) -> list[int]:
    """The CUDA-graph batch sizes a study's servers pad a running decode batch to: up to
    its largest batch size (`--cuda-graph-max-bs`, `StudySpec.launch_spec`), the list or
    the largest size its `server_flags` give, or none (no padding) where they turn decode
    graphs or padding off; `--cuda-graph-config`'s decode phase first, as SGLang reads it,
    each flag by its name or an abbreviation (`graph_flags`)."""
    flags = graph_flags(server_flags or {})
    decode = decode_graph_config(_single(flags.get(GRAPH_CONFIG_FLAG)))
    backend = "disabled" if any(flag in flags for flag in GRAPHS_OFF_FLAGS) else None
    if (chosen := _single(flags.get(GRAPH_BACKEND_FLAG))) is not None:
        backend = str(chosen)
    if str(decode.get("backend", backend)) == "disabled" or NO_PADDING_FLAG in flags:
        return []
    if (given := decode.get("bs", flags.get(GRAPH_SIZES_FLAG))) is not None \
            and (sizes := _sizes(given)) is not None:
        return sizes
    largest = max(batches)  # the servers run no more at once (`running_requests_for`)
    top = decode.get("max_bs")
    given_top = isinstance(top, int) and not isinstance(top, bool) and top > 0
    return graph_batch_sizes(min(top, largest) if given_top else largest)


def _single(value: Any) -> Any:
    """A flag's one value, also when given as a list of one (the command line takes it
    alike)."""
    return value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value


def shared_graph_size(batches: Iterable[int], server_flags: Mapping[str, Any] | None = None
                      ) -> tuple[int, int, int] | None:
    """Two study batch sizes SGLang serves as one CUDA-graph batch size, and that size
    (one adaptive slot then serves both), or None."""
    ordered = sorted(set(batches))
    graphs = graph_sizes_for(ordered, server_flags)
    return next(((a, b, padded_batch(a, graphs)) for a, b in itertools.pairwise(ordered)
                 if padded_batch(a, graphs) >= b), None)


@dataclass
class Slot:
    """One batch-size slot's step controller."""

    candidates: list[int]
    steps: int
    ema_alpha: float = 0.2
    update_interval: int = 5
    warmup_batches: int = 10
    up_hysteresis: float = 0.0
    down_hysteresis: float = -0.25
    ceiling_coeff: float = 0.0
    ema: float = field(init=False)
    verifies: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.candidates = sorted(set(self.candidates))
        if self.steps not in self.candidates:
            self.steps = self.candidates[len(self.candidates) // 2]
        self.ema = float(self.steps - 1)  # neutral: one draft short of the current steps

    @classmethod
    def of(cls, entry: Mapping[str, Any], top: Mapping[str, Any], steps: int) -> Slot:
        settings = {k: entry.get(k, top.get(k, default)) for k, default in SLOT_DEFAULTS.items()}
        return cls(list(entry["candidate_steps"]), steps, **settings)

    def verified(self, accepted_drafts: list[int]) -> bool:
        """Feed one verify's accepted draft tokens per request (the bonus token not
        counted); returns whether the steps changed."""
        if not accepted_drafts:
            return False
        if self.steps > 0:
            mean = sum(accepted_drafts) / len(accepted_drafts)
            self.ema = (1 - self.ema_alpha) * self.ema + self.ema_alpha * mean
        self.verifies += 1
        if (self.verifies <= self.warmup_batches
                or (self.verifies - self.warmup_batches) % self.update_interval):
            return False
        old = self.steps
        self.steps = self._target()
        return self.steps != old

    def _target(self) -> int:
        index = self.candidates.index(self.steps)
        if self.steps == 0:  # no drafting: probe the next positive candidate
            target = self.candidates[min(index + 1, len(self.candidates) - 1)]
            if target > 0 and self.ema < 0:
                self.ema = float(target - 1)
            return target
        start = index
        while index > 0:
            lower = self.candidates[index - 1]
            threshold = (0.5 if lower == 0 else lower - 0.5) + self.down_hysteresis
            if self.ema > threshold:
                break
            index -= 1
        if index == start:
            while (index < len(self.candidates) - 1
                   and self.ema > self.candidates[index] - 0.5 + self.up_hysteresis):
                index += 1
        target = self.candidates[index]
        if self.ceiling_coeff > 0 and target <= self.steps:
            ceiling = max(1, math.ceil(self.ema * self.ceiling_coeff))
            while index > 0 and self.candidates[index] > ceiling:
                index -= 1
            target = self.candidates[index]
        return target


class Schedule:
    """An adaptive server's controllers: the running batch size is padded to the next
    CUDA-graph batch size, then served by the slot with the largest key not above it (the
    smallest slot below every key)."""

    def __init__(self, config: Mapping[str, Any], steps: int,
                 graph_sizes: list[int] | None = None) -> None:
        entries = validate(config)
        top = {k: v for k, v in config.items() if not k.isdigit()}
        self.keys = sorted(entries)
        self.slots = {key: Slot.of(entries[key], top, steps) for key in self.keys}
        self.graph_sizes = sorted(graph_sizes) if graph_sizes else None

    def slot_key(self, batch: int) -> int:
        padded = padded_batch(batch, self.graph_sizes or ())
        return self.keys[max(0, bisect.bisect_right(self.keys, padded) - 1)]

    def steps_for(self, batch: int) -> int:
        return self.slots[self.slot_key(batch)].steps

    def verified(self, batch: int, accepted_drafts: list[int]) -> bool:
        return self.slots[self.slot_key(batch)].verified(accepted_drafts)

    def current(self) -> dict[str, int]:
        """The current steps per slot, keyed as in the config."""
        return {str(key): slot.steps for key, slot in self.slots.items()}


def settled_steps(schedule: Schedule, batch: int, accepted: Callable[[int], float],
                  verifies: int = 400) -> list[int]:
    """The steps of the slot serving `batch` over the second half of `verifies` verifies,
    each accepting `accepted(steps)` drafts per request (the mean a steady workload gives):
    the chain the controller settles on, or the cycle it keeps going round."""
    slot = schedule.slots[schedule.slot_key(batch)]
    seen = []
    for _ in range(verifies):
        seen.append(slot.steps)
        slot.verified([accepted(slot.steps)])  # type: ignore[list-item]
    return seen[verifies // 2:]
