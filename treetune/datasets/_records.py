"""Read a dataset file into records: a JSON array or JSON lines, optionally gzipped.

Records are JSON objects. Errors name the file and the record: "line N" (1-based) in
JSON lines, "record N" (1-based) in a JSON array.
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treetune.datasets._spec import ROLES
from treetune.errors import ConfigFileError, clip
from treetune.yamlio import closest, decode_utf8


@dataclass(frozen=True)
class Record:
    """One JSON object of a dataset file, with where it is for error messages."""

    path: Path
    where: str  # "line 3" or "record 3"
    data: dict[str, Any]

    def error(self, message: str) -> ConfigFileError:
        return ConfigFileError(self.path, f"{self.where}: {message}")

    def missing(self, field: str, advice: str = "") -> ConfigFileError:
        """The error for a record without `field`, suggesting a misspelt field it has."""
        return self.error(f"no '{field}' field{closest(field, self.data)}{advice}")

    def text(self, field: str, advice: str = "") -> str:
        """A required field holding non-empty text, returned as is (whitespace matters)."""
        if field not in self.data:
            raise self.missing(field, advice)
        return self.check_text(self.data[field], field)

    def optional_text(self, field: str) -> str | None:
        """An optional text field; None when absent, null or blank."""
        value = self.data.get(field)
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        return self.check_text(value, field)

    def items(self, field: str, *, allow_empty: bool = False) -> list[Any]:
        """A required field holding a list (non-empty unless `allow_empty`)."""
        if field not in self.data:
            raise self.missing(field)
        value = self.data[field]
        if not isinstance(value, list) or not (value or allow_empty):
            raise self.error(f"'{field}' must be a non-empty list, got {describe(value)}")
        return value

    def texts(self, field: str) -> list[str]:
        """A required field holding a non-empty list of non-empty texts."""
        return [self.check_text(v, f"{field}[{i}]") for i, v in enumerate(self.items(field))]

    def messages(self, field: str) -> tuple[dict[str, str], ...]:
        """A required list of OpenAI-style chat messages; only role and content are kept."""
        messages = []
        for i, message in enumerate(self.items(field)):
            key = f"{field}[{i}]"
            if not isinstance(message, dict):
                raise self.error(f"'{key}' must be an object with role and content")
            role = message.get("role")
            if role not in ROLES:
                raise self.error(
                    f"'{key}.role' must be one of {', '.join(ROLES)}, got {describe(role)}"
                    f"{closest(str(role), ROLES)}"
                )
            if "content" not in message:
                raise self.error(f"'{key}' has no 'content' field")
            messages.append({"role": role, "content": self.check_text(message["content"], key)})
        return tuple(messages)

    def ident(self, field: str) -> str:
        """The record's id from `field`, or its position ("line-3") when it has none."""
        value = self.data.get(field)
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value).strip():
            return str(value)
        return self.where.replace(" ", "-")

    def check_text(self, value: Any, field: str) -> str:
        """`value` (found at `field`) if it is non-empty text; otherwise an error naming it."""
        if not isinstance(value, str) or not value.strip():
            raise self.error(f"'{field}' must be non-empty text, got {describe(value)}")
        return value


def read_records(path: Path) -> list[Record]:
    """Every record of a .json array or a JSON-lines file (.jsonl, or any other name)."""
    text = _read_text(path)
    if not text.strip():
        raise ConfigFileError(path, "file is empty: a dataset needs at least one record")
    name = path.name.removesuffix(".gz")
    if name.endswith(".json") or text.lstrip().startswith("["):
        return _json_array(path, text)
    return _json_lines(path, text)


def describe(value: Any) -> str:
    """A value's kind in JSON words, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    if isinstance(value, str):
        return "blank text" if not value.strip() else f"text {clip(value, 40)!r}"
    return f"{type(value).__name__} {value!r}"


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigFileError(path, "dataset file not found: fix the dataset's path (a "
                              "relative path is taken from the study file's folder, or on "
                              "the command line from the current folder)") from None
    except IsADirectoryError:
        raise ConfigFileError(path, "is a folder, not a dataset file") from None
    except OSError as exc:
        raise ConfigFileError(path, f"cannot read: {exc.strerror}") from None
    if path.name.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error):
            raise ConfigFileError(path, "not a valid gzip file") from None
    return decode_utf8(path, raw)


def _json_array(path: Path, text: str) -> list[Record]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        advice = " (one JSON object per line belongs in a .jsonl file)" if exc.msg == (
            "Extra data") else ""
        raise ConfigFileError(
            path, f"not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}{advice}"
        ) from None
    if not isinstance(data, list):
        raise ConfigFileError(path, f"expected a JSON array of records, got {describe(data)}")
    if not data:
        raise ConfigFileError(path, "holds no records (an empty JSON array)")
    records = []
    for i, item in enumerate(data, 1):
        if not isinstance(item, dict):
            raise ConfigFileError(path, f"record {i}: expected a JSON object, got {describe(item)}")
        records.append(Record(path, f"record {i}", item))
    return records


def _json_lines(path: Path, text: str) -> list[Record]:
    records = []
    # split("\n"), not splitlines(): JSON strings may hold U+2028 and other line breaks.
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigFileError(
                path, f"line {number} is not valid JSON: {exc.msg} (column {exc.colno})"
            ) from None
        if not isinstance(item, dict):
            raise ConfigFileError(
                path, f"line {number}: expected a JSON object, got {describe(item)}"
            )
        records.append(Record(path, f"line {number}", item))
    return records

