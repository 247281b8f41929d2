"""A first catalog file drafted from a seller's OpenAPI 3 document: one offering per
operation, its input schema from the operation's parameters and JSON request body, an
`http` upstream pointed at the operation. A draft for review, never applied: its price is a
placeholder and its `pay_to` cannot pass the checks until a person writes a wallet in."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import yaml

from backoffice.catalog.document import (
    FORMAT_KEY,
    FORMAT_VERSION,
    CatalogInvalid,
    Problem,
    yaml_read,
)

METHODS = ("get", "post", "put", "patch", "delete")
PLACEHOLDER_PAY_TO = "REVIEW: your wallet address (0x...)"
DEFAULT_PRICE = "0.01 USDC"
MAX_REF_DEPTH = 32  # a recursive schema is cut there (left open) rather than looping


class _Dumper(yaml.SafeDumper):
    pass


def _refuse(message: str) -> CatalogInvalid:
    return CatalogInvalid([Problem(0, "openapi", message)])


def _resolve(node: Any, document: dict[str, Any], depth: int = 0) -> Any:
    """Local `$ref`s inlined (a catalog's input schema stands alone), OpenAPI 3.0's
    `nullable` made JSON Schema."""
    if depth > MAX_REF_DEPTH:
        return {}
    if isinstance(node, list):
        return [_resolve(item, document, depth) for item in node]
    if not isinstance(node, dict):
        return node
    if isinstance(node.get("$ref"), str):
        target: Any = document
        ref = node["$ref"]
        if not ref.startswith("#/"):
            raise _refuse(f"only local references are inlined: {ref}")
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise _refuse(f"{ref} points at nothing")
            target = target[part]
        return _resolve(target, document, depth + 1)
    resolved = {str(k): _resolve(v, document, depth) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") is True and isinstance(resolved.get("type"), str):
        resolved["type"] = [resolved["type"], "null"]
    return resolved


def _slug(operation: dict[str, Any], method: str, path: str, taken: set[str]) -> str:
    base = str(operation.get("operationId") or f"{method}-{path}")
    base = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "-", base).lower()  # createJob -> create-job
    base = re.sub(r"[^a-z0-9_]+", "-", base).strip("-_")[:60] or method
    slug, n = base, 2
    while slug in taken:
        slug, n = f"{base}-{n}", n + 1
    taken.add(slug)
    return slug


def _input_schema(
    operation: dict[str, Any], path_item: dict[str, Any], document: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """The operation's input as one JSON object: its path and query parameters and its JSON
    body's properties side by side (a body that is not an object is the `body` property)."""
    notes: list[str] = []
    properties: dict[str, Any] = {}
    required: list[str] = []
    parameters = [*path_item.get("parameters", []), *operation.get("parameters", [])]
    for parameter in _resolve(parameters, document):
        name, where = str(parameter.get("name")), parameter.get("in")
        if where not in ("path", "query"):
            notes.append(f"{where} parameter {name!r} left out (Tollbooth sends its own headers)")
            continue
        schema = dict(parameter.get("schema") or {})
        if parameter.get("description"):
            schema.setdefault("description", parameter["description"])
        properties[name] = schema
        if parameter.get("required") or where == "path":
            required.append(name)
    body = _resolve(operation.get("requestBody") or {}, document)
    content = body.get("content") or {}
    if content and "application/json" not in content:
        notes.append(f"request body {sorted(content)} is not JSON: left out")
    body_schema = (content.get("application/json") or {}).get("schema")
    if (
        isinstance(body_schema, dict)
        and body_schema.get("type") == "object"
        and "properties" in body_schema
    ):
        for name, value in body_schema["properties"].items():
            if name in properties:
                notes.append(f"body property {name!r} has a parameter's name: the parameter kept")
                continue
            properties[name] = value
        required += [n for n in body_schema.get("required", []) if n not in required]
    elif isinstance(body_schema, dict):
        properties["body"] = body_schema
        if body.get("required"):
            required.append("body")
    result: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        result["required"] = required
    return result, notes


def _offering(
    method: str, path: str, operation: dict[str, Any], input_schema: dict[str, Any], **how: Any
) -> dict[str, Any]:
    title = str(operation.get("summary") or operation.get("operationId") or f"{method} {path}")
    entry: dict[str, Any] = {"title": title[:200]}
    if operation.get("description"):
        entry["description"] = str(operation["description"]).strip()
    entry["is_active"] = not operation.get("deprecated", False) and "{" not in path
    entry["price"] = how["price"]
    entry["input_schema"] = input_schema
    entry["upstream"] = {
        "kind": "http",
        "url": how["base_url"].rstrip("/") + path,
        "method": method.upper(),
        "input_mode": "query" if method in ("get", "delete") else "json",
        "secret_env": how["secret_env"],
        "timeout_seconds": 10,
    }
    return entry


def _dump(value: Any, indent: int) -> str:
    text = yaml.dump(value, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=96)
    pad = " " * indent
    return "".join(pad + line if line.strip() else line for line in text.splitlines(True))


def catalog_draft_from_openapi(
    text: str,
    *,
    base_url: str,
    name: str,
    network: str = "eip155:8453",
    asset: str = "0x833589fCD6eDb6E08f4c7C32D4f71b54bdA02913",
    price: str = DEFAULT_PRICE,
    secret_env: str = "TOLLBOOTH_UPSTREAM_SECRET",  # noqa: S107  (a variable's name)
) -> str:
    """A catalog file's text with one offering per operation of the OpenAPI 3 document.

    Raises CatalogInvalid when the document is not OpenAPI 3 or a reference is broken."""
    document, problems = yaml_read(text)
    if problems:
        raise CatalogInvalid(problems)
    if not isinstance(document, dict) or not str(document.get("openapi", "")).startswith("3."):
        raise _refuse("not an OpenAPI 3 document (no `openapi: 3.x`)")
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
        raise _refuse(
            f"--base-url must be an http(s) URL with a host and no credentials: {base_url}"
        )
    out = [
        f"# Drafted by `manage.py offerings import-openapi` from {name}: REVIEW before applying.",
        "# Every price is a placeholder; pay_to must be your wallet (the draft cannot apply",
        "# until it is). Operations with path parameters are drafted inactive: an http upstream",
        "# calls one fixed URL (docs/offerings-as-code.md).",
        f"{FORMAT_KEY}: {FORMAT_VERSION}",
        "defaults:",
        _dump({"network": network, "asset": asset, "pay_to": PLACEHOLDER_PAY_TO}, 2).rstrip("\n"),
        "offerings:",
    ]
    taken: set[str] = set()
    drafted = 0
    for path, path_item in (document.get("paths") or {}).items():
        if not isinstance(path_item, dict):
            continue
        for method in METHODS:
            operation = path_item.get(method)
            if not isinstance(operation, dict):
                continue
            schema, notes = _input_schema(operation, path_item, document)
            slug = _slug(operation, method, str(path), taken)
            entry = _offering(
                method, str(path), operation, schema,
                price=price, base_url=base_url, secret_env=secret_env,
            )  # fmt: skip
            out.append(f"  # {method.upper()} {path}")
            if "{" in str(path):
                notes.append("path parameters: put the operation behind a fixed URL first")
            out.extend(f"  # REVIEW: {note}" for note in notes)
            out.append(_dump({slug: entry}, 2).rstrip("\n"))
            drafted += 1
    if not drafted:
        raise _refuse("the document has no operations under `paths`")
    return "\n".join(out) + "\n"
