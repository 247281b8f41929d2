"""Limits on hostile input, shared by every entry point that decodes JSON or takes text.

One place decides what the web process agrees to decode, so a body or header can never
cost more than these bounds, whoever sends it:

- JSON is scanned for nesting depth on the raw bytes *before* it is decoded. The C JSON
  decoder recurses once per level; with the recursion limit that py_ecc sets on import
  (100,000) a body of nested `[` overflows the C stack and kills the process (SIGSEGV)
  instead of raising. The scan is a single regex pass, linear in the input.
- Strings must not hold NUL or unpaired surrogates: PostgreSQL refuses NUL in text and
  jsonb, and a lone surrogate cannot be encoded as UTF-8 at all. Refusing them here turns
  what would be a database error (a 500) into a stable 400.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

# Agent inputs are flat records; the x402 payment payload nests 4 levels. 32 leaves room
# for any honest document and is far below what the stack can take.
MAX_JSON_DEPTH = 32

# CPython's default recursion limit: deep enough for any library we run, shallow enough that
# the C stack of a worker thread (8 MiB) never overflows before RecursionError is raised.
SAFE_RECURSION_LIMIT = 1000

# A JSON string, consumed whole so brackets inside it never count; a string never closed
# runs to the end (the document is invalid and the decoder will say so). Possessive, and
# every match consumes its text: one linear pass whatever the input.
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*+(?:"|\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
# NUL, or any surrogate code point (a well-formed pair never survives decoding as two).
_REFUSED_CHARS = re.compile("[\x00\ud800-\udfff]")


class JsonTooDeep(ValueError):
    """The document nests deeper than the limit."""


class RefusedText(ValueError):
    """A string holds NUL or an unpaired surrogate."""


def json_depth_check(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raises JsonTooDeep when `raw` opens more than `max_depth` nested arrays or objects."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return
    if max(accumulate(map(_DEPTH_STEP.__getitem__, brackets))) > max_depth:
        raise JsonTooDeep(f"JSON nests deeper than {max_depth} levels.")


def text_check(value: str) -> None:
    """Raises RefusedText when `value` holds NUL or an unpaired surrogate."""
    if _REFUSED_CHARS.search(value):
        raise RefusedText("Text must not contain NUL or unpaired surrogate characters.")


def json_strings_check(document: Any) -> None:
    """Raises RefusedText for any key or string value in a decoded (depth-checked) document."""
    stack = [document]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            text_check(item)
        elif isinstance(item, dict):
            for key, value in item.items():
                text_check(key)
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)


def _refuse_constant(name: str) -> Any:
    # NaN and Infinity are not JSON (RFC 8259) and no amount may ever be one.
    raise ValueError(f"{name} is not valid JSON")


def json_loads_bounded(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode JSON only after its depth is checked; refuse NUL and unpaired surrogates.

    Raises JsonTooDeep, RefusedText, or ValueError (json.JSONDecodeError, UnicodeDecodeError)
    for anything that is not a JSON document.
    """
    json_depth_check(raw, max_depth=max_depth)
    document = json.loads(raw, parse_constant=_refuse_constant)
    json_strings_check(document)
    return document
