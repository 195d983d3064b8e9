"""What a study's `datasets:` entry holds, and the prompts a dataset turns into."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from treetune.datasets._builtin import BUILTINS, builtin_names
from treetune.errors import TreetuneError
from treetune.yamlio import closest

APIS = ("chat", "completion")
FORMATS = ("auto", "mt-bench", "sharegpt", "jsonl", "swebench", "human-eval", "builtin")
ROLES = ("system", "user", "assistant", "tool")
# Formats that make sense without a path: a shipped set, or HumanEval from its package.
_FILELESS = ("auto", "builtin", "human-eval")
OUTPUT_FROM_DATASET = "dataset"  # output_tokens: each answer as long as the recorded reply
CHAT_MESSAGE_TOKENS = 4  # role markers a chat template adds per message (the emulator's rule)


def text_tokens(text: str) -> int:
    """About four characters a token, as BPE tokenizers give on English and code (and as
    the emulator counts)."""
    return max(1, (len(text) + 3) // 4)


def prompt_tokens(prompt: Prompt) -> int:
    """A prompt's length in tokens, as the emulator counts it."""
    if prompt.messages is None:
        return text_tokens(prompt.text or "")
    text = "".join(m["content"] for m in prompt.messages)
    return text_tokens(text) + CHAT_MESSAGE_TOKENS * len(prompt.messages)


class DatasetSpecError(TreetuneError, ValueError):
    """A dataset entry that cannot work, found before any file is read.

    Also a ValueError so that `yamlio.build` reports it with the study file and key.
    """


@dataclass(frozen=True)
class Prompt:
    """One request to send: chat `messages` (OpenAI role/content) or completion `text`."""

    id: str
    messages: tuple[dict[str, str], ...] | None = None
    text: str | None = None
    # The length of the answer the file records for it (about four characters a token),
    # when it has one: a ShareGPT conversation's reply, an MT-Bench reference answer.
    reply_tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None):
            raise ValueError(f"prompt '{self.id}': give exactly one of messages or text")
        for message in self.messages or ():
            if message.get("role") not in ROLES or not isinstance(message.get("content"), str):
                raise ValueError(f"prompt '{self.id}': bad message {message!r}")
        if self.messages == ():
            raise ValueError(f"prompt '{self.id}': messages is empty")
        if self.reply_tokens is not None and self.reply_tokens < 1:
            raise ValueError(f"prompt '{self.id}': reply_tokens must be >= 1")

    @property
    def api(self) -> str:
        """'chat' (POST /v1/chat/completions) or 'completion' (POST /v1/completions)."""
        return "chat" if self.messages is not None else "completion"

    def request_body(self) -> dict[str, Any]:
        """The prompt's part of an OpenAI-style request body (a fresh copy, safe to extend)."""
        if self.messages is not None:
            return {"messages": [dict(m) for m in self.messages]}
        return {"prompt": self.text}


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset to benchmark with: a built-in set by name, or a local file and its format."""

    name: str  # what users type and performance profiles use, e.g. "mt-bench"
    path: str | None = None  # local file; None: the built-in set `name` (human-eval: its package)
    format: str = "auto"  # one of FORMATS; auto: from the first record's fields
    prompt_field: str = "prompt"  # the field holding the prompt in plain JSONL
    num_prompts: int | None = None  # cap; None: all
    max_new_tokens: int | None = None  # None: the dataset's default
    api: str | None = None  # chat | completion; None: the format's default
    seed: int = 0  # picks the subset when capping
    # Fixed-length cells: with no path, `prompt_tokens` and `output_tokens` make synthetic
    # prompts of exactly that many tokens, each answered with exactly `output_tokens`.
    # With a file (or a built-in), `output_tokens` alone fixes the answers' length, or
    # "dataset" makes each answer as long as the reply the file records for its prompt.
    prompt_tokens: int | None = None
    output_tokens: int | str | None = None

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise DatasetSpecError("a dataset needs a name")
        what = f"dataset '{self.name}'"
        if self.format not in FORMATS:
            raise DatasetSpecError(
                f"{what}: unknown format '{self.format}'{closest(self.format, FORMATS)}; "
                f"formats: {', '.join(FORMATS)}"
            )
        if self.api is not None and self.api not in APIS:
            raise DatasetSpecError(
                f"{what}: api must be chat or completion, got '{self.api}'"
                f"{closest(self.api, APIS)}"
            )
        if self.num_prompts is not None and self.num_prompts < 1:
            raise DatasetSpecError(
                f"{what}: num_prompts must be at least 1, got {self.num_prompts}"
            )
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise DatasetSpecError(
                f"{what}: max_new_tokens must be at least 1, got {self.max_new_tokens}"
            )
        if not self.prompt_field.strip():
            raise DatasetSpecError(f"{what}: prompt_field is empty")
        self._check_lengths(what)
        if self.synthetic:
            return
        if self.path is not None:
            if not self.path.strip():
                raise DatasetSpecError(f"{what}: path is empty")
            if self.format == "builtin":
                raise DatasetSpecError(
                    f"{what}: format 'builtin' takes no path; drop the path, or give the "
                    "file's format"
                )
        elif self.format not in _FILELESS:
            raise DatasetSpecError(f"{what}: format '{self.format}' reads a file; give a path")
        elif self.format != "human-eval" and self.name not in BUILTINS:
            names = builtin_names()
            raise DatasetSpecError(
                f"unknown built-in dataset '{self.name}'{closest(self.name, names)}; give a "
                f"file's path (ending .json or .jsonl, or with a '/'), or one of the "
                f"built-ins: {', '.join(names)}"
            )


    @property
    def synthetic(self) -> bool:
        """A fixed-length cell of synthetic prompts (no file)."""
        return self.prompt_tokens is not None

    def _check_lengths(self, what: str) -> None:
        out = self.output_tokens
        if isinstance(out, str) and out != OUTPUT_FROM_DATASET:
            raise DatasetSpecError(f"{what}: output_tokens must be a number of tokens or "
                                   f"'{OUTPUT_FROM_DATASET}', got '{out}'")
        for field, value in (("prompt_tokens", self.prompt_tokens), ("output_tokens", out)):
            if isinstance(value, int) and (isinstance(value, bool) or value < 1):
                raise DatasetSpecError(f"{what}: {field} must be at least 1, got {value}")
        if out is not None and self.max_new_tokens is not None:
            raise DatasetSpecError(f"{what}: give output_tokens (every answer exactly that "
                                   "long) or max_new_tokens (a cap), not both")
        if not self.synthetic:
            return
        if self.path is not None:
            raise DatasetSpecError(f"{what}: prompt_tokens makes synthetic prompts; a file's "
                                   "prompts keep their lengths: drop the path or prompt_tokens")
        if not isinstance(out, int):
            raise DatasetSpecError(f"{what}: a fixed-length cell needs output_tokens as well "
                                   f"as prompt_tokens, e.g. {{name: {self.name}, prompt_tokens: "
                                   f"{self.prompt_tokens}, output_tokens: 256}}")
        if self.format != "auto":
            raise DatasetSpecError(f"{what}: a fixed-length cell has no format (got "
                                   f"'{self.format}')")


@dataclass
class PromptSet:
    """The prompts of one dataset, all for one API, and how many tokens to ask for."""

    name: str
    prompts: list[Prompt]
    max_new_tokens: int
    api: str  # chat | completion; every prompt uses it
    source: str  # where the prompts came from, for reports
    # Every answer runs to its length, whatever the model says: max_new_tokens, or with
    # `reply_lengths` each prompt's recorded reply (the answer lengths are the workload's).
    ignore_eos: bool = False
    reply_lengths: bool = False

    def new_tokens(self, prompt: Prompt) -> int:
        """How many tokens to ask for `prompt`."""
        if self.reply_lengths and prompt.reply_tokens is not None:
            return prompt.reply_tokens
        return self.max_new_tokens

    def lengths(self) -> tuple[list[int], list[int]]:
        """The workload's prompt and output lengths, one pair per prompt: prompt tokens
        as the emulator counts them (about four characters a token, and four more a chat
        message), and the tokens asked for (the recorded reply's where the set sends
        those; with natural EOS, the answers may end earlier)."""
        return ([prompt_tokens(p) for p in self.prompts],
                [self.new_tokens(p) for p in self.prompts])

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.prompts)
