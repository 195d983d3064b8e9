"""Turn the records of each supported file format into prompts.

- ``mt-bench`` (FastChat's ``question.jsonl``: ``question_id``, ``category``, ``turns``,
  optional ``reference``): the first turn of every question is one chat prompt, id
  ``<question_id>``. Turn k > 1 becomes one more prompt, id ``<question_id>-turn<k>``, only
  when the record has a ``reference`` list with answers for turns 1..k-1: its messages are
  the earlier user turns, each followed by the reference answer for that turn, then turn k.
  Without references there is no answer to put between the turns (the benchmarked model's
  own answer would vary from server to server), so only the first turn is used. A turn's
  own reference answer, when given, is its recorded reply length.
- ``sharegpt`` (a JSON array, or JSON lines, of ``{"id", "conversations": [{"from",
  "value"}]}``): the conversation up to, not including, the first reply; "human"/"user"
  turns are user messages, "system" is a system message, any other speaker ("gpt",
  "chatgpt", "bing", ...) is a reply. Conversations with no human turn before the first
  reply are skipped; a file where every conversation is skipped is an error. The first
  reply is the prompt's recorded reply length.
- ``jsonl``: a record with a ``messages`` list (OpenAI role/content) is a chat prompt;
  otherwise its ``prompt_field`` (default "prompt") is a completion prompt. Id: ``id``.
- ``swebench`` (``instance_id``, ``problem_statement``, optional ``repo`` and
  ``hints_text``): one chat message asking for a patch that resolves the issue.
- ``human-eval`` (``task_id``, ``prompt``): the function stub as a completion prompt.

Records without an id field get their position ("line-3", "record-3") as id.
"""

from __future__ import annotations

from collections.abc import Callable

from treetune.datasets._records import Record
from treetune.datasets._spec import DatasetSpec, Prompt, text_tokens
from treetune.errors import ConfigFileError

# Typical answer lengths, used when the spec gives no max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = {
    "mt-bench": 512,
    "sharegpt": 400,
    "jsonl": 256,
    "swebench": 512,
    "human-eval": 256,
}
# None: the records decide (plain JSONL may hold chat or completion prompts).
DEFAULT_API: dict[str, str | None] = {
    "mt-bench": "chat",
    "sharegpt": "chat",
    "jsonl": None,
    "swebench": "chat",
    "human-eval": "completion",
}

_SHAREGPT_ROLES = {"human": "user", "user": "user", "system": "system"}


def detect(records: list[Record]) -> str:
    """The format of a file, from its first record's fields."""
    fields = records[0].data
    if "conversations" in fields:
        return "sharegpt"
    if "turns" in fields:
        return "mt-bench"
    if "problem_statement" in fields:
        return "swebench"
    if {"task_id", "prompt", "entry_point"} <= fields.keys():
        return "human-eval"
    return "jsonl"


def mt_bench(records: list[Record], spec: DatasetSpec) -> list[Prompt]:
    prompts = []
    for record in records:
        turns = record.texts("turns")
        qid = record.ident("question_id")
        history = [_user(turns[0])]
        references = record.data.get("reference")
        if references is None:
            prompts.append(Prompt(qid, messages=tuple(history)))
            continue
        if not isinstance(references, list):
            raise record.error("'reference' must be a list of answers, one per turn")
        answers = [record.check_text(a, f"reference[{i}]") for i, a in enumerate(references)]
        # Turn k's recorded reply: its reference answer (answers[k - 1]), if given.
        replies = [text_tokens(a) for a in answers] + [None] * len(turns)
        prompts.append(Prompt(qid, messages=tuple(history), reply_tokens=replies[0]))
        for k, turn in enumerate(turns[1:], 2):
            if k - 2 >= len(answers):
                break
            history += [{"role": "assistant", "content": answers[k - 2]}, _user(turn)]
            prompts.append(Prompt(f"{qid}-turn{k}", messages=tuple(history),
                                  reply_tokens=replies[k - 1]))
    return prompts


def sharegpt(records: list[Record], spec: DatasetSpec) -> list[Prompt]:
    prompts = []
    for record in records:
        messages = []
        reply = None
        for i, turn in enumerate(record.items("conversations", allow_empty=True)):
            key = f"conversations[{i}]"
            if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
                raise record.error(f"'{key}' must be an object with 'from' and 'value'")
            speaker = record.check_text(turn["from"], f"{key}.from")
            role = _SHAREGPT_ROLES.get(speaker.strip().lower())
            value = turn["value"]
            if not isinstance(value, str):
                raise record.error(f"'{key}.value' must be text")
            if role is None:
                reply = text_tokens(value) if value.strip() else None
                break
            if value.strip():
                messages.append({"role": role, "content": value})
        if any(m["role"] == "user" for m in messages):
            prompts.append(Prompt(record.ident("id"), messages=tuple(messages),
                                  reply_tokens=reply))
    if not prompts:
        raise ConfigFileError(
            records[0].path, "no conversation has a human turn before the first reply"
        )
    return prompts


def plain_jsonl(records: list[Record], spec: DatasetSpec) -> list[Prompt]:
    prompts = []
    for record in records:
        ident = record.ident("id")
        if isinstance(record.data.get("messages"), list):
            prompts.append(Prompt(ident, messages=record.messages("messages")))
            continue
        field = spec.prompt_field
        fields = ", ".join(record.data) or "none"
        advice = (
            f" and no 'messages' list; its fields: {fields} (prompt_field names the field "
            "that holds the prompt)"
        )
        prompts.append(Prompt(ident, text=record.text(field, advice)))
    return prompts


def swebench(records: list[Record], spec: DatasetSpec) -> list[Prompt]:
    prompts = []
    for record in records:
        issue = record.text("problem_statement")
        repo = record.optional_text("repo")
        hints = record.optional_text("hints_text")
        where = f"the {repo} repository" if repo else "this repository"
        parts = [
            f"You are working in {where}. A user reported the issue below.",
            f"<issue>\n{issue.strip()}\n</issue>",
        ]
        if hints:
            parts.append(
                f"Comments from the issue's discussion:\n<hints>\n{hints.strip()}\n</hints>"
            )
        parts.append(
            "Find the cause and write a patch that fixes it. Reply with a unified diff that "
            "applies with `git apply` from the repository root, then explain the change in a "
            "few sentences."
        )
        prompts.append(Prompt(record.ident("instance_id"), messages=(_user("\n\n".join(parts)),)))
    return prompts


def human_eval(records: list[Record], spec: DatasetSpec) -> list[Prompt]:
    return [Prompt(r.ident("task_id"), text=r.text("prompt")) for r in records]


PARSERS: dict[str, Callable[[list[Record], DatasetSpec], list[Prompt]]] = {
    "mt-bench": mt_bench,
    "sharegpt": sharegpt,
    "jsonl": plain_jsonl,
    "swebench": swebench,
    "human-eval": human_eval,
}


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}
