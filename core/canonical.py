"""Canonical JSON and hashes: the same request always hashes the same."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_hex(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def fingerprint(value: Any) -> str:
    return sha256_hex(canonical_json(value))


def strip_volatile(data: dict[str, Any], volatile_fields: list[str]) -> dict[str, Any]:
    """Drop fields that must not make two requests differ (dotted paths reach nested keys)."""
    result = json.loads(json.dumps(data))  # deep copy of plain JSON
    for path in volatile_fields:
        *parents, leaf = path.split(".")
        node: Any = result
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return result
