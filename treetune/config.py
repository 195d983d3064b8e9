"""SGLang's tree-config rules, in one place.

A speculative server is described by `TreeConfig(steps, topk, draft_tokens)`; the
no-speculation server by `BASELINE`. Everything that knows how SGLang validates,
canonicalizes or reserves memory for a tree lives here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

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
        method, colon, knobs = text.strip().rpartition(":")
        if colon and not METHOD_NAME.fullmatch(method.strip()):
            raise InvalidTreeError(f"tree '{text}': '{method}' before the colon must be a "
                                   "draft method in capitals, e.g. NEXTN:3,1,4")
        parts = [p.strip() for p in knobs.replace("x", ",").split(",")]
        if len(parts) != 3 or not all(p.lstrip("-").isdigit() for p in parts):
            raise InvalidTreeError(
                f"tree '{text}' must be three integers steps,topk,draft_tokens, e.g. 3,4,8"
                " (or METHOD:S,K,N, e.g. NEXTN:3,1,4)"
            )
        steps, topk, draft_tokens = (int(p) for p in parts)
        return cls.of(steps, topk, draft_tokens, method.strip())

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

ServerConfig = TreeConfig | Baseline


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
