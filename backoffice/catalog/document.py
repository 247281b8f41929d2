"""Reading a catalog file: YAML, each mapping with the line of each of its keys, so a refusal
names the line of every problem. YAML 1.1's surprises are switched off: `on`/`no` stay
words and `0x5e11...` stays a string (an address), never a number; duplicate keys are
problems, not a silent last-one-wins."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import yaml

from core.errors import DomainError, ErrorCode

FORMAT_KEY = "tollbooth_catalog"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Problem:
    line: int
    where: str
    message: str

    def __str__(self) -> str:
        place = f"line {self.line}: " if self.line else ""
        return f"{place}{self.where}: {self.message}" if self.where else place + self.message


class CatalogInvalid(DomainError):
    """The file is refused as a whole (ErrorCode.CATALOG_INVALID); `problems` names each."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = sorted(set(problems), key=lambda p: (p.line, p.where, p.message))
        super().__init__(
            ErrorCode.CATALOG_INVALID,
            f"{len(self.problems)} problem(s); nothing was applied",
            extra={"problems": [str(p) for p in self.problems]},
        )


class LinedMap(dict[str, Any]):
    """A YAML mapping that knows its own line and the line of each key."""

    line: int = 0
    key_lines: dict[str, int]

    def line_of(self, key: str) -> int:
        return getattr(self, "key_lines", {}).get(key, self.line)


class _Loader(yaml.SafeLoader):
    problems: list[Problem]


_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
# A date typed bare would be no JSON value for a schema: every timestamp stays a string.
_TIMESTAMP = "tag:yaml.org,2002:timestamp"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL, _INT, _TIMESTAMP)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$"), list("-+0123456789"))


def _construct_map(loader: _Loader, node: yaml.MappingNode) -> Any:
    data = LinedMap()
    data.line = node.start_mark.line + 1
    data.key_lines = {}
    yield data
    loader.flatten_mapping(node)
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, str):
            key = str(key)
        if key in data:
            loader.problems.append(Problem(line, key, "appears twice in the same mapping"))
            continue
        data[key] = loader.construct_object(value_node, deep=True)
        data.key_lines[key] = line


_Loader.add_constructor("tag:yaml.org,2002:map", _construct_map)


def yaml_read(text: str) -> tuple[Any, list[Problem]]:
    """The document and the problems found reading it (a syntax error is one, with its line)."""
    loader = _Loader(text)
    loader.problems = []
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 0
        return None, [Problem(line, "", f"not YAML: {exc.problem or exc}")]
    except yaml.YAMLError as exc:
        return None, [Problem(0, "", f"not YAML: {exc}")]
    finally:
        loader.dispose()
    return data, loader.problems


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
