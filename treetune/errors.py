"""User-facing errors: each names the thing the user got wrong and where."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from treetune.keylines import key_line


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, its end marked "..." when cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(exc: BaseException) -> str:
    """An exception's first non-blank line (a database's own words, not the SQL and the
    link SQLAlchemy adds below them), or its type's name when it says nothing. Optuna's
    StorageInternalError says only that a commit failed: its cause's words instead."""
    while type(exc).__name__ == "StorageInternalError" and (
            cause := exc.__cause__ or exc.__context__) is not None:
        exc = cause
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


class TreetuneError(Exception):
    """An error caused by user input or environment, shown without a traceback."""


class ConfigNotFoundError(TreetuneError):
    """A model's config.json is not on this machine, or (`fetchable`: the model is a hub
    name) not yet: a server started with it downloads it into the local cache."""

    def __init__(self, message: str, fetchable: bool = False) -> None:
        super().__init__(message)
        self.fetchable = fetchable


class InvalidTreeError(TreetuneError, ValueError):
    """A (steps, topk, draft_tokens) triple that SGLang would refuse."""


class FieldError(ValueError):
    """A value a dataclass validator refuses, naming its (dotted) field, so that the file
    it came from can be pointed at: `yamlio.build` turns it into a ConfigFileError for
    that key, with its line."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@contextmanager
def for_field(key: str) -> Iterator[None]:
    """A TreetuneError raised inside (an unknown shipped name, say) as a FieldError of
    `key`, so that the file and line it was written on are named with it."""
    try:
        yield
    except FieldError:
        raise
    except TreetuneError as exc:
        raise FieldError(key, str(exc)) from None


class ConfigFileError(TreetuneError):
    """A YAML/CSV input file (space, profile, measurements, study) that cannot be used.

    With a key, the message gives the key's line when the file is YAML that holds it:
    "study.yaml, line 7: key 'backend.profle': unknown key (did you mean 'profile'?)".
    """

    def __init__(self, path: object, message: str, key: str | None = None, *,
                 line_of: str | None = None) -> None:
        """`line_of`: the key whose line to give when `key` names something the file does
        not spell out (a point of a bare YAML list is "points[3]", found at "[3]")."""
        self.path = path
        self.key = key
        self.message = message
        where_key = line_of or key
        self.line = (key_line(str(path), where_key)
                     if where_key is not None and _may_be_yaml(path) else None)
        where = f"{path}" if self.line is None else f"{path}, line {self.line}"
        if key is not None:
            where += f": key '{key}'"
        super().__init__(f"{where}: {message}")

    def __reduce__(self) -> tuple:
        # Rebuilt from its fields where it was raised in another process (a process pool):
        # the default would call __init__ with the formatted message alone.
        return (_rebuild_config_error, (type(self), self.path, self.message, self.key,
                                        self.line, str(self)))


def _rebuild_config_error(cls: type[ConfigFileError], path: object, message: str,
                          key: str | None, line: int | None, text: str) -> ConfigFileError:
    error = cls.__new__(cls)
    Exception.__init__(error, text)
    error.path, error.message, error.key, error.line = path, message, key, line
    return error


def _may_be_yaml(path: object) -> bool:
    """Whether `path` may be a YAML (or JSON) file worth parsing for a key's line."""
    return not str(path).lower().endswith((".csv", ".tsv", ".jsonl", ".gz"))
