"""Search spaces: ranges or choices per tree knob.

A space file is YAML:

    steps: {min: 1, max: 8}          # or a list: [1, 3, 5, 7]
    topk: [1, 2, 3, 4, 6, 8]
    draft_tokens: {min: 2, max: 64}
    draft_tokens_rule: sglang        # or steps_times_topk_plus_one (bench_speculative.py)

NGRAM has no steps knob: its space gives draft_tokens and `breadth` (SGLang's
--speculative-ngram-max-bfs-breadth) instead of steps and topk, and holds the trees
(N-1, K, N) that name an NGRAM server (backends/sglang.py, `ngram_tree`).

Enumeration yields each valid canonical TreeConfig once, however many raw triples map to it.
The baseline is not part of a space: every study measures it.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treetune.backends.sglang import NGRAM, method_tree_problem
from treetune.config import TreeConfig, tree_problem
from treetune.errors import ConfigFileError, TreetuneError
from treetune.yamlio import build, closest, load_yaml

RULES = ("sglang", "steps_times_topk_plus_one")
NGRAM_RULE = "ngram"  # an NGRAM space's: steps is draft_tokens - 1 (no steps knob)


@dataclass(frozen=True)
class _SpaceFile:
    draft_tokens: Any
    steps: Any = None  # required, unless the space is NGRAM's (breadth)
    topk: Any = None
    breadth: Any = None  # NGRAM's --speculative-ngram-max-bfs-breadth, instead of steps, topk
    draft_tokens_rule: str = "sglang"
    # Keys older space files hold, kept known so that load_space answers them with a
    # reason instead of ignoring them: `flags` is refused, `include_baseline: true` only
    # says what every study does anyway.
    include_baseline: bool = True
    flags: Any = None
    description: str = ""


@dataclass(frozen=True)
class SearchSpace:
    name: str
    steps: tuple[int, ...]
    topk: tuple[int, ...]
    draft_tokens: tuple[int, ...]
    draft_tokens_rule: str = "sglang"
    description: str = ""
    # The draft method its configs carry (TreeConfig.method; "": the study's own).
    method: str = ""

    @property
    def is_ngram(self) -> bool:
        """An NGRAM space: draft tokens and breadth, no steps knob."""
        return self.draft_tokens_rule == NGRAM_RULE

    def for_method(self, method: str) -> SearchSpace:
        """The same space, its configs those of draft method `method` ("": the study's
        own)."""
        return dataclasses.replace(self, method=method)

    def allows(self, steps: int, topk: int, draft_tokens: int) -> bool:
        return self.problem(steps, topk, draft_tokens) is None

    def problem(self, steps: int, topk: int, draft_tokens: int) -> str | None:
        """Why the space leaves this triple out (SGLang would refuse it, or the space's
        draft_tokens_rule does), or None when it is in."""
        problem = tree_problem(steps, topk, draft_tokens)
        if problem is None and self.draft_tokens_rule == "steps_times_topk_plus_one" and (
                draft_tokens > steps * topk + 1):
            problem = (f"draft_tokens {draft_tokens} is above steps*topk+1 = "
                       f"{steps * topk + 1} (draft_tokens_rule steps_times_topk_plus_one)")
        if problem is None and self.is_ngram:
            problem = method_tree_problem(NGRAM, TreeConfig.of(steps, topk, draft_tokens))
        return problem

    def configs(self) -> list[TreeConfig]:
        """Every valid canonical tree in the space, sorted, each once."""
        found = {
            TreeConfig.of(s, k, n, self.method)
            for s, k, n in itertools.product(self.steps, self.topk, self.draft_tokens)
            if self.allows(s, k, n)
        }
        return sorted(found)

    def contains(self, config: TreeConfig) -> bool:
        return config in set(self.configs())


# Combinations of a space's knob values enumerated at most: the widest shipped space holds
# 3,024 (default); a range up to 100000 steps took `predict --space` minutes, silently.
MAX_COMBINATIONS = 100_000


def shipped_spaces() -> dict[str, Path]:
    """Spaces in the checkout's search_spaces/ folder, by name."""
    folder = Path(__file__).resolve().parent.parent / "search_spaces"
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def resolve_space_path(name_or_path: str | Path) -> Path:
    """The file of a space: a path as given, or a shipped space's by its name."""
    text = str(name_or_path)
    path = Path(text)
    if path.exists() or path.suffix in (".yaml", ".yml") or "/" in text:
        return path
    shipped = shipped_spaces()
    if text not in shipped:
        raise TreetuneError(
            f"unknown search space '{text}'{closest(text, shipped)}: give a YAML file path "
            f"or one of: {', '.join(shipped) or '(none found)'}"
        )
    return shipped[text]


def load_space(name_or_path: str | Path) -> SearchSpace:
    """A space file path, or the name of a space in search_spaces/ (e.g. 'default')."""
    path = resolve_space_path(name_or_path)
    data = load_yaml(path)
    raw = build(_SpaceFile, data, path)
    # The search varies the tree only; a space's flags used to be accepted and then ignored,
    # so a user who set them thought they were searched.
    if "flags" in data:
        raise ConfigFileError(path, "SGLang flags are not searched: pin them in the study's "
                              "server_flags instead, and remove flags from the space", "flags")
    if not raw.include_baseline:
        raise ConfigFileError(path, "the baseline is always measured: remove include_baseline",
                              "include_baseline")
    if raw.draft_tokens_rule not in RULES:
        raise ConfigFileError(
            path, f"must be one of {', '.join(RULES)}, got '{raw.draft_tokens_rule}'",
            "draft_tokens_rule",
        )
    draft_tokens = _knob(raw.draft_tokens, path, "draft_tokens", minimum=2)
    if raw.breadth is not None:
        return _ngram_space(raw, data, path, draft_tokens)
    for key in ("steps", "topk"):
        if getattr(raw, key) is None:
            raise ConfigFileError(path, "missing required key (or give breadth instead of "
                                  "steps and topk for an NGRAM space)", key)
    steps = _knob(raw.steps, path, "steps", minimum=1)
    topk = _knob(raw.topk, path, "topk", minimum=1)
    knobs = {"steps": steps, "topk": topk, "draft_tokens": draft_tokens}
    combinations = len(steps) * len(topk) * len(draft_tokens)
    if combinations > MAX_COMBINATIONS:  # each is checked, then every tree predicted
        raise ConfigFileError(path, (
            f"{len(steps)} steps x {len(topk)} topk x {len(draft_tokens)} draft_tokens are "
            f"{combinations:,} combinations, more than treetune enumerates "
            f"({MAX_COMBINATIONS:,}): narrow the ranges"),
            max(knobs, key=lambda k: len(knobs[k])))
    space = SearchSpace(path.stem, steps, topk, draft_tokens, raw.draft_tokens_rule,
                        raw.description)
    if not space.configs():
        raise ConfigFileError(path, _impossible(space), "draft_tokens")
    return space


def _ngram_space(raw: _SpaceFile, data: dict[str, Any], path: Path,
                 draft_tokens: tuple[int, ...]) -> SearchSpace:
    """NGRAM's space: every verify size with every breadth, as (N-1, K, N) trees."""
    for key in ("steps", "topk", "draft_tokens_rule"):
        if key in data:
            raise ConfigFileError(path, f"an NGRAM space (breadth) has no {key}: NGRAM "
                                  "drafts from a suffix trie, shaped by draft_tokens and "
                                  "breadth only", key)
    breadth = _knob(raw.breadth, path, "breadth", minimum=1)
    return SearchSpace(path.stem, tuple(n - 1 for n in draft_tokens), breadth, draft_tokens,
                       NGRAM_RULE, raw.description)


def _impossible(space: SearchSpace) -> str:
    """Why a space with values for every knob holds no tree. The example is its most
    permissive triple (deepest, widest, fewest draft tokens): if it fails, all do."""
    s, k, n = max(space.steps), max(space.topk), min(space.draft_tokens)
    count = len(space.steps) * len(space.topk) * len(space.draft_tokens)
    return (f"the space is empty: none of its {count} (steps, topk, draft_tokens) "
            f"combinations is a valid tree, not even ({s}, {k}, {n}): {space.problem(s, k, n)};"
            " lower draft_tokens or raise steps or topk")


def _knob(value: Any, path: Path, key: str, minimum: int) -> tuple[int, ...]:
    if isinstance(value, dict):
        unknown = set(value) - {"min", "max", "step"}
        if unknown:
            bad = sorted(map(str, unknown))[0]
            raise ConfigFileError(path, f"unknown key{closest(bad, ['min', 'max', 'step'])}",
                                  f"{key}.{bad}")
        if "min" not in value or "max" not in value:
            raise ConfigFileError(path, "a range needs both min and max", key)
        bounds = [value["min"], value["max"], value.get("step", 1)]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in bounds):
            raise ConfigFileError(path, "min, max and step must be integers", key)
        lo, hi, step = bounds
        if step < 1 or hi < lo:
            raise ConfigFileError(path, f"empty range min {lo} max {hi} step {step}, so the "
                                  "space is empty: give min <= max and step >= 1", key)
        values = list(range(lo, hi + 1, step))
    elif isinstance(value, list):
        values = value
    elif isinstance(value, int) and not isinstance(value, bool):
        values = [value]
    else:
        raise ConfigFileError(path, "expected a list of integers or {min, max}", key)
    if not values:
        raise ConfigFileError(path, "no values given, so the space is empty: list at least "
                              "one integer, or give {min, max}", key)
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigFileError(path, f"expected integers, got {v!r}", key)
        if v < minimum:
            raise ConfigFileError(path, f"values must be >= {minimum}, got {v}", key)
    return tuple(sorted(set(values)))
