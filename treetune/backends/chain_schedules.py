"""Chain schedules for engines treetune does not launch yet: the draft length per running
batch size that an adaptive SGLang server's slots amount to, as vLLM and TensorRT-LLM take
it. Written as advice next to an adaptive recommendation; each is checked here by the rules
its engine's own validator applies (cited in the README).

- vLLM (dynamic speculative decoding, docs/features/speculative_decoding/
  dynamic_speculative_decoding.md; vllm/v1/spec_decode/dynamic/utils.py):
  `speculative_config.num_speculative_tokens_per_batch_size`, a list of
  [first batch size, last batch size, K] with inclusive, sorted, non-overlapping ranges, the
  first starting at 1, K >= 0 and at most `num_speculative_tokens` (> 0); batch sizes past
  the last range keep its K.
- TensorRT-LLM (DecodingBaseConfig.draft_len_schedule, tensorrt_llm/llmapi/llm_args.py):
  `speculative_config.draft_len_schedule`, {largest batch size of a range: draft length},
  each range starting after the previous key; batch sizes above the largest key do not
  speculate; keys >= 1, lengths >= 0 and at most `max_draft_len`, which the smallest key's
  length must equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The draft method of an SGLang --speculative-algorithm in each engine's own words.
VLLM_METHODS = {"EAGLE3": "eagle3", "EAGLE": "eagle", "NEXTN": "mtp",
                "STANDALONE": "draft_model"}
TRTLLM_DECODING_TYPES = {"EAGLE3": "Eagle3", "EAGLE": "Eagle", "NEXTN": "MTP",
                         "STANDALONE": "DraftTarget"}


class ScheduleError(ValueError):
    """The engine's validator would refuse this schedule; the message says which rule."""


@dataclass(frozen=True)
class ChainSchedule:
    """Draft length (chain steps, 0: no speculation) from each running batch size up to
    the next entry's; the last entry's up to `max_batch`, the largest batch measured."""

    entries: tuple[tuple[int, int], ...]  # (smallest batch size, steps), increasing
    max_batch: int

    def ranges(self) -> list[tuple[int, int, int]]:
        """(first, last, steps) per entry, inclusive and contiguous from 1."""
        firsts = [b for b, _ in self.entries]
        lasts = [b - 1 for b in firsts[1:]] + [max(self.max_batch, firsts[-1])]
        return [(first, last, steps)
                for (first, steps), last in zip(self.entries, lasts, strict=True)]


def vllm_schedule(schedule: ChainSchedule, algorithm: str,
                  draft: str | None) -> dict[str, Any]:
    """vLLM's `--speculative-config` JSON for this schedule."""
    ranges = [list(r) for r in schedule.ranges()]
    config: dict[str, Any] = {"method": VLLM_METHODS.get(algorithm, algorithm.lower())}
    if draft is not None and algorithm != "NEXTN":
        config["model"] = draft
    config["num_speculative_tokens"] = max(k for _, _, k in ranges)
    config["num_speculative_tokens_per_batch_size"] = ranges
    check_vllm(config)
    return config


def check_vllm(config: dict[str, Any]) -> None:
    """vLLM's checks of a dynamic speculative decoding schedule (3-item form)."""
    entries = config.get("num_speculative_tokens_per_batch_size")
    tokens = config.get("num_speculative_tokens")
    if not isinstance(entries, list) or not entries:
        raise ScheduleError("num_speculative_tokens_per_batch_size must be a non-empty list")
    if not isinstance(tokens, int) or tokens <= 0:
        raise ScheduleError("num_speculative_tokens must be > 0")
    previous_end = 0
    for entry in entries:
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise ScheduleError(f"entry {entry!r} is not [bs_lo, bs_hi, K]")
        lo, hi, k = entry
        if lo <= 0 or hi <= 0 or lo > hi:
            raise ScheduleError(f"batch-size range ({lo}, {hi}) must be positive, start <= end")
        if lo <= previous_end:
            raise ScheduleError("batch-size ranges must be non-overlapping and sorted")
        if not 0 <= k <= tokens:
            raise ScheduleError(f"K {k} must be in [0, num_speculative_tokens {tokens}]")
        previous_end = hi
    if entries[0][0] != 1:
        raise ScheduleError("the first batch-size range must start at 1")


def trtllm_schedule(schedule: ChainSchedule, algorithm: str,
                    draft: str | None) -> tuple[dict[str, Any], list[str]]:
    """TensorRT-LLM's `speculative_config` for this schedule (in the LLM API's YAML or
    JSON options), and what it could not express. Its first range must have the longest
    draft: later ones are capped at it."""
    ranges = schedule.ranges()
    first = ranges[0][2]
    if first == 0:
        raise ScheduleError("TensorRT-LLM takes the smallest batch sizes' draft length as "
                            "max_draft_len: a schedule that does not draft there cannot be "
                            "written")
    notes = [f"batch {lo}-{hi}: {k} capped at {first} (TensorRT-LLM's max_draft_len is the "
             "smallest batch sizes' draft length)" for lo, hi, k in ranges if k > first]
    lengths = {str(hi): min(k, first) for _, hi, k in ranges}
    last = ranges[-1][1]
    where = ("the largest measured" if last == schedule.max_batch else
             f"the schedule's last slot; the study measured up to batch {schedule.max_batch}")
    notes.append(f"above batch {last} ({where}) TensorRT-LLM does not speculate")
    config: dict[str, Any] = {
        "decoding_type": TRTLLM_DECODING_TYPES.get(algorithm, algorithm),
        "max_draft_len": first}
    if draft is not None and algorithm != "NEXTN":
        config["speculative_model"] = draft
    config["draft_len_schedule"] = lengths
    check_trtllm(config)
    return {"speculative_config": config}, notes


def check_trtllm(config: dict[str, Any]) -> None:
    """TensorRT-LLM's checks of `draft_len_schedule` (keys as JSON strings, as its
    configuration files hold them and pydantic reads them)."""
    schedule = {int(k): v for k, v in config["draft_len_schedule"].items()}
    longest = config["max_draft_len"]
    if not schedule:
        raise ScheduleError("draft_len_schedule is empty")
    for batch, length in schedule.items():
        if batch < 1:
            raise ScheduleError(f"batch size threshold must be >= 1, got {batch}")
        if not 0 <= length <= longest:
            raise ScheduleError(f"draft length {length} must be in [0, max_draft_len "
                                f"{longest}]")
    if schedule[min(schedule)] != longest:
        raise ScheduleError(f"draft_len_schedule[{min(schedule)}] must equal max_draft_len")
