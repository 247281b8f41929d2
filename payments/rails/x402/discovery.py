"""The bazaar discovery extension (`extensions.bazaar`), through the x402 SDK's own builder.

A paid URL is described the way facilitators catalogue it: how to call it (method, body
type) with an example input, not a JSON schema where the example goes, plus the schema that
validates that description. The SDK builds both (`declare_discovery_extension`) and puts the
method in (`bazaar_resource_server_extension`), so what we send is what its validators
accept (tests/x402/test_x402_discovery.py checks it with them).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from x402.extensions.bazaar import BAZAAR, declare_discovery_extension
from x402.extensions.bazaar.server import bazaar_resource_server_extension

__all__ = ["BAZAAR_KEY", "bazaar_declaration", "input_example"]

BAZAAR_KEY = BAZAAR.key
# Placeholder values by JSON-schema type, for inputs whose schema gives no example.
_PLACEHOLDERS: dict[str, Any] = {
    "string": "example",
    "integer": 1,
    "number": 1,
    "boolean": False,
    "object": {},
    "array": [],
}


@dataclass(frozen=True)
class _Method:
    """What the SDK's enricher reads off an HTTP request: its method."""

    method: str


def input_example(schema: dict[str, Any]) -> dict[str, Any]:
    """An example input for `schema`: its own `examples[0]` if it has one, else every
    required property's example, default, const or first enum value (a typed placeholder
    when none is given)."""
    examples = schema.get("examples")
    if isinstance(examples, list) and examples and isinstance(examples[0], dict):
        return dict(examples[0])
    properties = schema.get("properties") or {}
    required = [name for name in schema.get("required") or [] if name in properties]
    return {name: _value_example(properties[name] or {}) for name in required}


def _value_example(prop: dict[str, Any]) -> Any:
    if isinstance(prop.get("examples"), list) and prop["examples"]:
        return prop["examples"][0]
    for keyword in ("default", "const"):
        if keyword in prop:
            return prop[keyword]
    if isinstance(prop.get("enum"), list) and prop["enum"]:
        return prop["enum"][0]
    kind = prop.get("type")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    if kind == "integer" or kind == "number":
        return prop.get("minimum", _PLACEHOLDERS[kind])
    return _PLACEHOLDERS.get(str(kind), "example")


def bazaar_declaration(*, input_schema: dict[str, Any], method: str = "POST") -> dict[str, Any]:
    """`extensions.bazaar` for a paid URL bought by `method` (POST: a JSON body; GET: query
    parameters), with an example input and the schema validating the description."""
    return json.loads(_declaration(json.dumps(input_schema, sort_keys=True), method))


@functools.lru_cache(maxsize=256)
def _declaration(schema_json: str, method: str) -> str:
    """Built once per (schema, method): every 402 carries it. JSON text, so callers get a
    fresh copy they may change."""
    schema = json.loads(schema_json)
    # The body's schema sits inside the description's schema: its own dialect marker and
    # ids would be nested resources there, which the validator need not follow.
    body_schema = {k: v for k, v in schema.items() if k not in ("$schema", "$id")}
    declared = declare_discovery_extension(
        input=input_example(schema) or None,
        input_schema=body_schema,
        body_type="json" if method == "POST" else None,
    )[BAZAAR_KEY]
    enriched = bazaar_resource_server_extension.enrich_declaration(declared, _Method(method))
    return json.dumps(enriched, sort_keys=True)
