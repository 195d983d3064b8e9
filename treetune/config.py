"""SGLang's tree-config rules, in one place.

A speculative server is described by `TreeConfig(steps, topk, draft_tokens)`; the
no-speculation server by `BASELINE`; a server whose chain length SGLang's runtime
controller switches per running batch size (`--speculative-adaptive`) by `AdaptiveConfig`.
Everything that knows how SGLang validates, canonicalizes or reserves memory for a tree
lives here (the adaptive config's JSON rules live with SGLang's controller,
treetune/backends/sglang_adaptive.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from treetune.errors import InvalidTreeError

# A draft method's name as configs and storage keys carry it (SGLang's algorithm names).
METHOD_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


@dataclass(frozen=True, order=True)
class TreeConfig:
    """An EAGLE draft tree as SGLang's three launch knobs.

    Instances are always valid and canonical: SGLang-equivalent configs compare equal.
    Use `TreeConfig.of(...)` to canonicalize user input; the constructor refuses
    non-canonical triples so that nothing downstream can hold one by accident.

    `method` is the draft method (SGLang's --speculative-algorithm) when a study searches
    several: empty for the study's own `algorithm`, so that a study of one method keeps
    its keys and labels; another method's name ("NEXTN") otherwise. Which names exist and
    which trees each takes is SGLang's business (backends/sglang.py).
    """

    steps: int
    topk: int
    draft_tokens: int
    method: str = ""

    def __post_init__(self) -> None:
        problem = tree_problem(self.steps, self.topk, self.draft_tokens)
        if problem:
            raise InvalidTreeError(problem)
        if self.method and not METHOD_NAME.fullmatch(self.method):
            raise InvalidTreeError(f"draft method '{self.method}' must be an algorithm name "
                                   "in capitals, e.g. NEXTN")
        if self.topk == 1 and self.draft_tokens != self.steps + 1:
            raise InvalidTreeError(
                f"({self.steps}, 1, {self.draft_tokens}) is not canonical: with topk 1 SGLang "
                f"forces draft_tokens = steps + 1 = {self.steps + 1}; use TreeConfig.of()"
            )

    @classmethod
    def of(cls, steps: int, topk: int, draft_tokens: int, method: str = "") -> TreeConfig:
        """Validate a triple as SGLang would and return its canonical form."""
        problem = tree_problem(steps, topk, draft_tokens)
        if problem:
            raise InvalidTreeError(problem)
        if topk == 1:
            # A chain: SGLang overrides draft_tokens with steps + 1 whatever was asked.
            draft_tokens = steps + 1
        return cls(steps, topk, draft_tokens, method)

    @classmethod
    def parse(cls, text: str) -> TreeConfig:
        """Parse 'S,K,N' (as typed on a command line), or 'METHOD:S,K,N' for a tree of
        another draft method of the study ('NEXTN:3,1,4')."""
        method, steps, topk, draft_tokens = cls.typed(text)
        return cls.of(steps, topk, draft_tokens, method)

    @staticmethod
    def typed(text: str) -> tuple[str, int, int, int]:
        """The method ("" for none) and the three knobs as typed in 'METHOD:S,K,N', before
        SGLang's chain rule changes any."""
        method, colon, knobs = text.strip().rpartition(":")
        method = method.strip().upper()  # any case, as --method and methods: take it
        if colon and not METHOD_NAME.fullmatch(method):
            raise InvalidTreeError(f"tree '{text}': '{method}' before the colon must be a "
                                   "draft method's name, e.g. NEXTN:3,1,4")
        parts = [p.strip() for p in knobs.replace("x", ",").split(",")]
        if len(parts) != 3 or not all(p.lstrip("-").isdigit() for p in parts):
            raise InvalidTreeError(
                f"tree '{text}' must be three integers steps,topk,draft_tokens, e.g. 3,4,8"
                " (or METHOD:S,K,N, e.g. NEXTN:3,1,4)"
            )
        steps, topk, draft_tokens = (int(p) for p in parts)
        return method, steps, topk, draft_tokens

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def pool_size(self) -> int:
        """Candidate nodes the draft proposes: K from step 1, then K² per later step."""
        return candidate_pool_size(self.steps, self.topk)

    @property
    def kv_slots_per_round(self) -> int:
        """KV-cache slots SGLang reserves per running request and speculative round."""
        return max(self.steps * self.topk, self.draft_tokens)

    @property
    def max_accept_length(self) -> int:
        """Accepted drafts plus the bonus token can never exceed the tree depth + 1."""
        return self.steps + 1

    def label(self) -> str:
        tree = f"({self.steps},{self.topk},{self.draft_tokens})"
        return f"{self.method} {tree}" if self.method else tree

    def __str__(self) -> str:
        return self.label()


@dataclass(frozen=True)
class Baseline:
    """The no-speculation server: every cell's speedup is measured against it."""

    def label(self) -> str:
        return "baseline"

    def __str__(self) -> str:
        return "baseline"


BASELINE: Final = Baseline()


@dataclass(frozen=True)
class AdaptiveSlot:
    """One batch-size slot of an adaptive server: it serves running batch sizes from
    `batch` up to the next slot's, switching among `steps` (chains (S, 1, S+1); 0 is no
    drafting) by accept length."""

    batch: int
    steps: tuple[int, ...]
    up_hysteresis: float = 0.0
    down_hysteresis: float = 0.0
    ceiling_coeff: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.batch, int) or self.batch < 1:
            raise InvalidTreeError(f"an adaptive slot's batch size must be >= 1, got "
                                   f"{self.batch!r}")
        if (not self.steps or any(not isinstance(s, int) or isinstance(s, bool) or s < 0
                                  for s in self.steps)):
            raise InvalidTreeError(f"adaptive slot {self.batch}: candidate steps must be a "
                                   f"non-empty list of non-negative ints, got {self.steps!r}")
        if tuple(sorted(set(self.steps))) != tuple(self.steps):
            raise InvalidTreeError(f"adaptive slot {self.batch}: candidate steps must be "
                                   f"sorted and distinct, got {self.steps!r}")


# A storage key: "adaptive:" then slots joined by "|", each "BATCH=S.S.S" with its
# non-zero settings after commas ("1=1.3.5.7,down=-0.25").
ADAPTIVE_PREFIX = "adaptive:"
_SETTINGS = (("up", "up_hysteresis"), ("down", "down_hysteresis"), ("ceil", "ceiling_coeff"))
_SLOT_KEY = re.compile(r"^(\d+)=(\d+(?:\.\d+)*)((?:,(?:up|down|ceil)=-?[\d.]+(?:e-?\d+)?)*)$")


@dataclass(frozen=True)
class AdaptiveConfig:
    """SGLang's adaptive steps (`--speculative-adaptive`): chains only (topk 1), the steps
    chosen at run time per batch-size slot among each slot's candidates. The controller's
    top-level settings (EMA weight, update interval, warm-up) stay at SGLang's defaults."""

    slots: tuple[AdaptiveSlot, ...]

    def __post_init__(self) -> None:
        if not self.slots:
            raise InvalidTreeError("an adaptive config needs at least one batch-size slot")
        batches = [slot.batch for slot in self.slots]
        if batches != sorted(set(batches)):
            raise InvalidTreeError(f"adaptive slots must have distinct batch sizes in "
                                   f"increasing order, got {batches}")
        if not any(s > 0 for s in self.candidate_steps):
            raise InvalidTreeError("an adaptive config that never drafts is the baseline: "
                                   "give some slot a positive step")

    @classmethod
    def from_json(cls, config: Mapping[str, Any]) -> AdaptiveConfig:
        """From SGLang's JSON, checked as SGLang checks it; a slot's unset settings take
        SGLang's defaults (top level first)."""
        from treetune.backends.sglang_adaptive import SLOT_DEFAULTS, validate

        entries = validate(config)
        top = {k: v for k, v in config.items() if not k.isdigit()}
        for name in ("ema_alpha", "update_interval", "warmup_batches"):
            values = {top.get(name, SLOT_DEFAULTS[name]),
                      *(e[name] for e in entries.values() if name in e)}
            if values != {SLOT_DEFAULTS[name]}:
                raise InvalidTreeError(f"adaptive config: {name} other than SGLang's default "
                                       f"{SLOT_DEFAULTS[name]} is not supported")

        def setting(entry: Mapping[str, Any], name: str) -> float:
            return float(entry.get(name, top.get(name, SLOT_DEFAULTS[name])))

        return cls(tuple(
            AdaptiveSlot(key, tuple(sorted(set(entry["candidate_steps"]))),
                         *(setting(entry, name) for _, name in _SETTINGS))
            for key, entry in sorted(entries.items())))

    @classmethod
    def sglang_default(cls) -> AdaptiveConfig:
        """What SGLang runs with `--speculative-adaptive` and no config file."""
        from treetune.backends.sglang_adaptive import DEFAULT_CONFIG

        return cls.from_json(DEFAULT_CONFIG)

    def to_json(self) -> dict[str, Any]:
        """SGLang's JSON (`--speculative-adaptive-config`), every slot setting explicit."""
        from treetune.backends.sglang_adaptive import validate

        config = {str(slot.batch): {"candidate_steps": list(slot.steps),
                                    **{name: getattr(slot, name) for _, name in _SETTINGS}}
                  for slot in self.slots}
        validate(config)
        return config

    @property
    def candidate_steps(self) -> tuple[int, ...]:
        """Every slot's candidates together, sorted."""
        return tuple(sorted({s for slot in self.slots for s in slot.steps}))

    @property
    def initial_steps(self) -> int:
        """The steps it launches with: SGLang's own default, the middle candidate (never
        0: a config always holds a positive step)."""
        steps = self.candidate_steps
        return steps[len(steps) // 2]

    @property
    def longest(self) -> TreeConfig:
        """The chain SGLang sizes its buffers for: the largest candidate."""
        steps = max(self.candidate_steps)
        return TreeConfig.of(steps, 1, steps + 1)

    def slot_for(self, batch: int, graph_sizes: Sequence[int] = ()) -> AdaptiveSlot:
        """The slot that serves a running batch of this size: SGLang pads it up to the
        next of the CUDA-graph batch sizes (`graph_sizes`, sorted; none: no padding),
        then takes the slot with the largest batch not above that, else the smallest."""
        from treetune.backends.sglang_adaptive import padded_batch

        padded = padded_batch(batch, graph_sizes)
        return next((s for s in reversed(self.slots) if s.batch <= padded), self.slots[0])

    @property
    def is_sglang_default(self) -> bool:
        return self == AdaptiveConfig.sglang_default()

    def key(self) -> str:
        def slot_key(slot: AdaptiveSlot) -> str:
            extra = "".join(f",{short}={getattr(slot, name):g}" for short, name in _SETTINGS
                            if getattr(slot, name))
            return f"{slot.batch}={'.'.join(map(str, slot.steps))}{extra}"

        return ADAPTIVE_PREFIX + "|".join(slot_key(s) for s in self.slots)

    @classmethod
    def parse(cls, key: str) -> AdaptiveConfig:
        """Back from `key()`."""
        if not key.startswith(ADAPTIVE_PREFIX):
            raise InvalidTreeError(f"'{key}' is not an adaptive config key (adaptive:...)")
        slots = []
        for part in key.removeprefix(ADAPTIVE_PREFIX).split("|"):
            match = _SLOT_KEY.match(part)
            if not match:
                raise InvalidTreeError(f"adaptive config key '{key}': cannot read slot "
                                       f"'{part}' (expected BATCH=S.S.S[,down=X])")
            settings = dict(item.split("=") for item in match.group(3).split(",")[1:])
            slots.append(AdaptiveSlot(
                int(match.group(1)), tuple(int(s) for s in match.group(2).split(".")),
                *(float(settings.get(short, 0.0)) for short, _ in _SETTINGS)))
        return cls(tuple(slots))

    def label(self) -> str:
        if self.is_sglang_default:
            return "adaptive (SGLang default)"
        return "adaptive " + " ".join(
            f"{slot.batch}:{{{','.join(map(str, slot.steps))}}}" for slot in self.slots)

    def __str__(self) -> str:
        return self.label()


ServerConfig = TreeConfig | Baseline | AdaptiveConfig


def tree_fields(config: ServerConfig) -> dict[str, int | None]:
    """A record's `steps`, `topk` and `draft_tokens`: null for no speculation and for an
    adaptive server, which have no one tree."""
    tree = config if isinstance(config, TreeConfig) else None
    return {"steps": tree.steps if tree else None, "topk": tree.topk if tree else None,
            "draft_tokens": tree.draft_tokens if tree else None}


def chain(steps: int) -> TreeConfig | Baseline:
    """The static server an adaptive server runs at `steps`: the chain (S, 1, S+1), or
    no drafting at 0."""
    return TreeConfig.of(steps, 1, steps + 1) if steps else BASELINE


def candidate_pool_size(steps: int, topk: int) -> int:
    return topk + (steps - 1) * topk * topk


def tree_problem(steps: int, topk: int, draft_tokens: int) -> str | None:
    """Why SGLang would refuse this triple, or None if it would run it."""
    for name, value in (("steps", steps), ("topk", topk), ("draft_tokens", draft_tokens)):
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name} must be an integer, got {value!r}"
        if value < 1:
            return f"{name} must be >= 1, got {value}"
    if draft_tokens < 2:
        return f"draft_tokens must be >= 2 (the root plus at least one draft), got {draft_tokens}"
    if topk == 1:
        return None  # SGLang resets draft_tokens to steps + 1 for chains
    pool = candidate_pool_size(steps, topk)
    if draft_tokens - 1 > pool:
        return (
            f"draft_tokens {draft_tokens} is too large for steps {steps}, topk {topk}: the "
            f"draft proposes only {pool} candidates (topk + (steps-1)*topk^2), so at most "
            f"{pool + 1} tokens can be verified (SGLang fails with 'selected index out of range')"
        )
    return None


def is_valid(steps: int, topk: int, draft_tokens: int) -> bool:
    return tree_problem(steps, topk, draft_tokens) is None
