"""Load a DatasetSpec into a PromptSet: find the data, parse it, fit it to one API, cap it."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from pathlib import Path

from treetune.datasets._builtin import BUILTINS
from treetune.datasets._formats import DEFAULT_API, DEFAULT_MAX_NEW_TOKENS, PARSERS, detect
from treetune.datasets._records import read_records
from treetune.datasets._spec import (
    CHAT_MESSAGE_TOKENS,
    OUTPUT_FROM_DATASET,
    DatasetSpec,
    Prompt,
    PromptSet,
)
from treetune.errors import TreetuneError

_LABELS = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


def load_dataset(spec: DatasetSpec, base_dir: Path | None = None) -> PromptSet:
    """The prompts `spec` names; a relative path is taken from `base_dir` (e.g. the study's
    folder), or from the working directory when base_dir is None."""
    if spec.synthetic:
        return _fixed_length(spec)
    if spec.path is not None:
        path = Path(spec.path).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        records = read_records(path)
        fmt = detect(records) if spec.format == "auto" else spec.format
        max_new_tokens = DEFAULT_MAX_NEW_TOKENS[fmt]
        source = str(path)
    else:
        builtin = BUILTINS["humaneval" if spec.format == "human-eval" else spec.name]
        with builtin.open() as path:
            records = read_records(path)
        fmt, max_new_tokens, source = builtin.format, builtin.max_new_tokens, builtin.source
    prompts = _unique_ids(PARSERS[fmt](records, spec))
    api = spec.api or DEFAULT_API[fmt] or _common_api(prompts)
    prompts = [_for_api(p, api) for p in prompts]
    if spec.num_prompts is not None and spec.num_prompts < len(prompts):
        source += f", {spec.num_prompts} of {len(prompts)} prompts (seed {spec.seed})"
        prompts = _subset(prompts, spec.num_prompts, spec.seed)
    out = spec.output_tokens
    replies = out == OUTPUT_FROM_DATASET
    if replies and not any(p.reply_tokens for p in prompts):
        raise TreetuneError(
            f"{source}: output_tokens: {OUTPUT_FROM_DATASET} needs the replies a file records "
            "(ShareGPT conversations with a reply, MT-Bench questions with references); these "
            "prompts have none: give output_tokens as a number")
    if isinstance(out, int):
        max_new_tokens = out
    elif replies:
        source += ", answers as long as the recorded replies"
    return PromptSet(spec.name, prompts, spec.max_new_tokens or max_new_tokens, api, source,
                     ignore_eos=out is not None, reply_lengths=replies)


# Words a BPE tokenizer reads as one token each, a space and three letters: four characters,
# one token by the emulator's count as well.
_WORDS = ("the", "and", "for", "are", "but", "not", "you", "all", "any", "can", "had", "her",
          "was", "one", "our", "out", "day", "get", "has", "him", "his", "how", "man", "new",
          "now", "old", "see", "two", "way", "who", "boy", "did")
SYNTHETIC_PROMPTS = 64  # distinct prompts of a fixed-length cell (no prefix cache hits)


def _fixed_length(spec: DatasetSpec) -> PromptSet:
    """Synthetic prompts of exactly `spec.prompt_tokens` tokens, each asking for exactly
    `spec.output_tokens`; each starts differently, so that no server reuses a cached
    prefix."""
    assert spec.prompt_tokens is not None and isinstance(spec.output_tokens, int)
    api = spec.api or "completion"
    words = spec.prompt_tokens - (CHAT_MESSAGE_TOKENS if api == "chat" else 0)
    if words < 1:
        raise TreetuneError(f"dataset '{spec.name}': a chat prompt of {spec.prompt_tokens} "
                            f"tokens leaves none for its text (the chat template takes "
                            f"{CHAT_MESSAGE_TOKENS}): give more prompt_tokens or api: completion")
    count = spec.num_prompts or SYNTHETIC_PROMPTS
    n = len(_WORDS)
    prompts = []
    for i in range(count):
        ident = i + spec.seed * count
        text = "".join(" " + _WORDS[(ident // n ** (j % 3) + 7 * j) % n] for j in range(words))
        prompts.append(Prompt(f"fixed-{i}", text=text) if api == "completion"
                       else Prompt(f"fixed-{i}", messages=({"role": "user", "content": text},)))
    source = (f"synthetic: {count} prompts of {spec.prompt_tokens} tokens, "
              f"{spec.output_tokens} out")
    return PromptSet(spec.name, prompts, spec.output_tokens, api, source, ignore_eos=True)


def load_datasets(specs: Iterable[DatasetSpec], base_dir: Path | None = None
                  ) -> dict[str, PromptSet]:
    """Every dataset of a study, by name; an error names the dataset as well as its file.

    Meant to run before anything is launched, so that a missing or malformed file is
    reported at once, not by each launch worker."""
    loaded = {}
    for spec in specs:
        try:
            loaded[spec.name] = load_dataset(spec, base_dir)
        except TreetuneError as exc:
            raise TreetuneError(f"dataset '{spec.name}': {exc}") from None
    return loaded


def _unique_ids(prompts: list[Prompt]) -> list[Prompt]:
    """Real files repeat ids now and then; suffix repeats ("x#2") so reports can tell them apart."""
    seen: set[str] = set()
    unique = []
    for prompt in prompts:
        ident, n = prompt.id, 1
        while ident in seen:
            n += 1
            ident = f"{prompt.id}#{n}"
        seen.add(ident)
        unique.append(prompt if ident == prompt.id else dataclasses.replace(prompt, id=ident))
    return unique


def _common_api(prompts: list[Prompt]) -> str:
    """The API every prompt uses; chat when they are mixed (text wraps losslessly as chat)."""
    apis = {p.api for p in prompts}
    return apis.pop() if len(apis) == 1 else "chat"


def _for_api(prompt: Prompt, api: str) -> Prompt:
    """The prompt in the form `api` takes.

    Completion text becomes one user message. Chat messages become completion text: a lone
    user message is its content; a longer conversation is a plain "User: ... Assistant:"
    transcript, since the model's chat template is the server's business, not ours.
    """
    if prompt.api == api:
        return prompt
    if api == "chat":
        return Prompt(prompt.id, messages=({"role": "user", "content": prompt.text or ""},))
    messages = prompt.messages or ()
    if len(messages) == 1 and messages[0]["role"] == "user":
        return Prompt(prompt.id, text=messages[0]["content"])
    turns = [f"{_LABELS[m['role']]}: {m['content']}" for m in messages]
    return Prompt(prompt.id, text="\n\n".join([*turns, "Assistant:"]))


def _subset(prompts: list[Prompt], k: int, seed: int) -> list[Prompt]:
    """k prompts chosen by a seeded hash of their ids, kept in file order.

    Hashing ids (rather than shuffling positions) gives the same choice on every Python
    version, and a larger cap keeps every prompt a smaller one chose.
    """

    def rank(prompt: Prompt) -> bytes:
        return hashlib.blake2b(f"{seed}\0{prompt.id}".encode(), digest_size=8).digest()

    chosen = {p.id for p in sorted(prompts, key=rank)[:k]}
    return [p for p in prompts if p.id in chosen]
