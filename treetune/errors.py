"""User-facing errors: each names the thing the user got wrong and where."""

from __future__ import annotations


class TreetuneError(Exception):
    """An error caused by user input or environment, shown without a traceback."""


class InvalidTreeError(TreetuneError, ValueError):
    """A (steps, topk, draft_tokens) triple that SGLang would refuse."""


class ConfigFileError(TreetuneError):
    """A YAML/CSV input file (space, profile, measurements) that cannot be used."""

    def __init__(self, path: object, message: str, key: str | None = None) -> None:
        where = f"{path}" if key is None else f"{path}: key '{key}'"
        super().__init__(f"{where}: {message}")
        self.path = path
        self.key = key
