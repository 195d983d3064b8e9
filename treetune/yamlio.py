"""Load YAML safely and turn mappings into typed dataclasses, validated once at the edge.

Every error names the file, the dotted key that is wrong and the line it is on (see
`keylines.key_line`), and suggests the closest valid key for misspellings.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from treetune.errors import ConfigFileError, FieldError

T = TypeVar("T")


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing a mapping that holds a key twice (PyYAML keeps the last
    silently: a study's second `tolerance:` overrode its first without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice in one mapping",
                    key_node.start_mark)
            if isinstance(key, str | int | float | bool):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _exponent_hint(value: Any) -> str:
    """How to write a number in exponent notation that YAML 1.1, which PyYAML reads, takes
    for text: `1e3` needs a dot and a signed exponent (`1.0e+3`). Not read as a number
    here: `name: 7e2` and `HF_REVISION: 1234e56` stay the text they were, as YAML 1.1
    tools write them."""
    found = isinstance(value, str) and re.fullmatch(
        r"([-+]?[0-9]+)(?:\.([0-9]*))?[eE]([-+]?)([0-9]+)", value.strip())
    if not found:
        return ""
    mantissa, fraction, sign, exponent = found.groups()
    return (f" (YAML reads {value.strip()} as text: write {mantissa}.{fraction or 0}e"
            f"{sign or '+'}{exponent}, or the number in full)")


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML file with the safe loader; errors name the file and the line."""
    path = Path(path)
    text = read_text(path)
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigFileError(path, f"not valid YAML{where}: {problem}") from None


def read_text(path: str | Path) -> str:
    """A user's text file (YAML, CSV, JSON) as UTF-8, a byte-order mark dropped; a file that
    is missing, a folder or not UTF-8 is an error naming it, never a traceback."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigFileError(path, "file not found") from None
    except IsADirectoryError:
        raise ConfigFileError(path, "is a folder, not a file") from None
    except OSError as exc:
        raise ConfigFileError(path, f"cannot read: {exc.strerror}") from None
    return decode_utf8(path, raw)


def decode_utf8(path: str | Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigFileError(path, f"not UTF-8 text (byte {exc.start})") from None


def dump_yaml(data: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def closest(name: str, options: typing.Iterable[str]) -> str:
    """' (did you mean 'x'?)' for a misspelt name, or ''."""
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def build(cls: type[T], data: Any, path: str | Path, key: str = "") -> T:
    """Build dataclass `cls` from a mapping, checking keys and value types."""
    if not isinstance(data, dict):
        raise ConfigFileError(path, f"expected a mapping, got {_kind(data)}", key or None)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    for name in data:
        if name not in fields:
            raise ConfigFileError(
                path, f"unknown key{closest(str(name), fields)}", _join(key, str(name))
            )
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = convert(hints[name], data[name], path, _join(key, name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigFileError(path, "missing required key", _join(key, name))
    try:
        return cls(**kwargs)
    except ConfigFileError:
        raise
    except FieldError as exc:
        raise ConfigFileError(path, str(exc), _join(key, exc.key)) from None
    except (ValueError, TypeError) as exc:
        raise ConfigFileError(path, str(exc), key or None) from None


def convert(hint: Any, value: Any, path: str | Path, key: str) -> Any:
    """Check and convert one value against a type hint."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return convert(arg, value, path, key)
            except ConfigFileError as exc:
                errors.append(exc)
        raise errors[-1]
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path, key)  # type: ignore[arg-type]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigFileError(path, f"expected a mapping, got {_kind(value)}", key)
        kt, vt = args or (Any, Any)
        return {
            convert(kt, k, path, key): convert(vt, v, path, _join(key, str(k)))
            for k, v in value.items()
        }
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigFileError(path, f"expected a list, got {_kind(value)}", key)
        item = args[0] if args else Any
        items = [convert(item, v, path, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigFileError(path, f"expected a number, got {_kind(value)}"
                                  f"{_exponent_hint(value)}", key)
        return float(finite(value, path, key))
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigFileError(path, f"expected an integer, got {_kind(value)}", key)
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigFileError(path, f"expected true or false, got {_kind(value)}", key)
        return value
    if hint is str:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ConfigFileError(path, f"expected a string, got {_kind(value)}", key)
        if isinstance(value, float):  # its text is lost: 0.10 reads as 0.1
            raise ConfigFileError(path, f"expected a string, got the number {value!r}: quote "
                                  "it as written (\"0.10\", not 0.10)", key)
        return str(value)
    return value


def finite(value: float, path: Any, key: str) -> float:
    """`value`, refused unless finite: YAML's .nan and .inf, and "nan" and "inf" on a
    command line, parse as numbers, but no duration, rate or limit is one."""
    if not math.isfinite(value):
        raise ConfigFileError(path, f"expected a finite number, got {value!r}", key)
    return value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"
