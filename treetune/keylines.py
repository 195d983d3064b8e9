"""Where a dotted key ("backend.profile", "datasets[1].path") sits in a YAML file, so that
errors can name its line. Below every other module: errors are built from it."""

from __future__ import annotations

import re
from pathlib import Path

import yaml


def key_line(path: str | Path, key: str) -> int | None:
    """The 1-based line of dotted `key` ("backend.profile", "datasets[1].path") in the YAML
    file at `path`; for a key the file lacks, the line of its nearest enclosing key that it
    has ("backend" for a missing "backend.profile"). None when the file cannot be read or
    holds none of the key's path.

    Composes the node tree (the safe loader's, no objects built) because parsed mappings
    forget where their keys were.
    """
    try:
        node = yaml.compose(Path(path).read_text(), Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError):
        return None
    parts = _key_parts(key)
    mark = _find(node, parts) if node is not None and parts else None
    return None if mark is None else mark.line + 1


def _key_parts(key: str) -> list[str | int]:
    """'datasets[1].path' -> ['datasets', 1, 'path']."""
    parts: list[str | int] = []
    for piece in key.split("."):
        match = re.fullmatch(r"(.*?)((?:\[\d+\])*)", piece)
        assert match is not None  # the pattern matches any text
        if match[1]:
            parts.append(match[1])
        parts += [int(i) for i in re.findall(r"\d+", match[2])]
    return parts


def _find(node: yaml.Node, parts: list[str | int]) -> yaml.Mark | None:
    """Where the key (or sequence item) that `parts` leads to under `node` starts, or
    the deepest of its enclosing keys that exists; None when not even the first does."""
    part = parts[0]
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int):
        if part >= len(node.value):
            return None
        item = node.value[part]
        return (_find(item, parts[1:]) or item.start_mark) if parts[1:] else item.start_mark
    if not isinstance(node, yaml.MappingNode):
        return None
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue
        # A key holding dots ("a.b: 1") spans several parts of the dotted path.
        for size in range(1, len(parts) + 1):
            if not all(isinstance(p, str) for p in parts[:size]):
                break
            if key_node.value == ".".join(map(str, parts[:size])):
                rest = parts[size:]
                return (_find(value_node, rest) or key_node.start_mark) if rest else (
                    key_node.start_mark)
    return None
