"""A catalog file's entries, validated as the admin validates an offering and its upstream
(the model's own field rules, `Upstream.clean`, the network's token) plus what a file can
get wrong that a form cannot (unknown keys, a float for money, a secret in a URL). Every
problem is collected with its line; one problem refuses the whole file."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import jsonschema
from django.core.exceptions import ValidationError

from backoffice.catalog.document import (
    FORMAT_KEY,
    FORMAT_VERSION,
    CatalogInvalid,
    LinedMap,
    Problem,
    text_sha256,
    yaml_read,
)
from backoffice.catalog.values import decimal_parse, duration_parse, money_parse
from fulfillment.executors import registered_names
from fulfillment.models import Upstream
from purchases.models import Offering
from purchases.services.quote.offerings import offering_asset_problem

REQUIRED = ("title", "price", "asset", "network", "pay_to")
# Money sent to anything else is lost: on an EVM network the recipient is an address.
EVM_ADDRESS = re.compile(r"0x[0-9a-fA-F]{40}")


@dataclass(frozen=True)
class CatalogEntry:
    slug: str
    line: int
    fields: dict[str, Any]  # every Offering field the file sets, model values
    upstream: dict[str, Any] | None  # every Upstream field, or None: no upstream


@dataclass(frozen=True)
class Catalog:
    name: str
    sha256: str
    entries: dict[str, CatalogEntry]


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("a string (quote it)")
    return value


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("true or false")
    return value


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("a whole number")
    return value


def _optional_integer(value: Any) -> int | None:
    return None if value is None else _integer(value)


def _mapping(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("a mapping")
    return dict(_plain(value))


def _strings(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("a list of strings")
    return list(value)


def _integers(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise ValueError("a list of whole numbers")
    return [_integer(v) for v in value]


# How the file writes each Offering field (price is read apart: it needs the asset's unit).
OFFERING_FIELDS: dict[str, Callable[[Any], Any]] = {
    "title": _text,
    "description": _text,
    "is_active": _boolean,
    "asset": _text,
    "asset_symbol": _text,
    "asset_decimals": _integer,
    "network": _text,
    "pay_to": _text,
    "stock": _optional_integer,
    "input_schema": _mapping,
    "volatile_fields": _strings,
    "max_input_bytes": _integer,
    "result_retention": duration_parse,
    "duplicate_window": duration_parse,
    "expected_run_time": duration_parse,
    "executor": _text,
    "refund_policy": _text,
    "delivery_condition": _text,
    "irreversible": _boolean,
    "late_payment_policy": _text,
}
UPSTREAM_FIELDS: dict[str, Callable[[Any], Any]] = {
    "kind": _text,
    "url": _text,
    "method": _text,
    "timeout_seconds": decimal_parse,
    "input_mode": _text,
    "secret_env": _text,
    "definitive_statuses": _integers,
    "max_result_bytes": _integer,
    "idempotent": _boolean,
    "entry_point": _text,
    "tool": _text,
    "dry_run": _mapping,
    "max_tries": _optional_integer,
    "deadline_seconds": _optional_integer,
}
ENTRY_KEYS = frozenset({*OFFERING_FIELDS, "price", "upstream"})


def _model_defaults(model: type[Any], names: Any) -> dict[str, Any]:
    return {name: model._meta.get_field(name).get_default() for name in names}


class _Reader:
    """Collects the problems of one file while turning its mappings into model values."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.defaults = LinedMap()

    def at(self, data: LinedMap, key: str, where: str) -> tuple[int, str]:
        """Where a value was written: the entry, else `defaults` (one problem there, not
        one per offering that inherits it)."""
        if key not in data and key in self.defaults:
            return self.defaults.line_of(key), f"defaults.{key}"
        return data.line_of(key), f"{where}.{key}"

    def problem(self, line: int, where: str, message: str) -> None:
        self.problems.append(Problem(line, where, message))

    def fields(
        self, data: LinedMap, parsers: dict[str, Callable[[Any], Any]], where: str, extra: Any
    ) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for key, raw in data.items():
            if key not in parsers:
                if key not in extra:
                    known = ", ".join(sorted({*parsers, *extra}))
                    self.problem(data.line_of(key), f"{where}.{key}", f"unknown key ({known})")
                continue
            try:
                values[key] = parsers[key](raw)
            except ValueError as exc:
                self.problem(data.line_of(key), f"{where}.{key}", str(exc))
        return values

    def model_errors(self, error: ValidationError, data: LinedMap, where: str, line: int) -> None:
        for field, messages in error.message_dict.items():
            key = "" if field == "__all__" else field
            # The slug is the entry's own key: its line is the entry's.
            at, place = self.at(data, key, where) if key not in ("", "slug") else (line, where)
            for message in messages:
                self.problem(at, place, message)

    def upstream(self, data: Any, where: str) -> dict[str, Any] | None:
        if data is None:
            return None
        if not isinstance(data, LinedMap):
            self.problem(0, where, "a mapping of the upstream's fields, or null")
            return None
        values = {
            **_model_defaults(Upstream, UPSTREAM_FIELDS),
            **self.fields(data, UPSTREAM_FIELDS, where, ()),
        }
        if "@" in urlsplit(str(values.get("url") or "")).netloc:
            self.problem(
                data.line_of("url"),
                f"{where}.url",
                "carries credentials: a catalog file never holds a secret (the upstream's "
                "secret is named by secret_env)",
            )
        try:
            Upstream(**values).full_clean(exclude=["offering"])
        except ValidationError as exc:
            self.model_errors(exc, data, where, data.line)
        return values

    def entry(self, slug: str, data: Any, line: int, defaults: dict[str, Any]) -> CatalogEntry:
        where = f"offerings.{slug}"
        if not isinstance(data, LinedMap):
            self.problem(line, where, "a mapping of the offering's fields")
            return CatalogEntry(slug=slug, line=line, fields={}, upstream=None)
        mark = len(self.problems)
        own = self.fields(data, OFFERING_FIELDS, where, ("price", "upstream"))
        values = {**_model_defaults(Offering, [*OFFERING_FIELDS, "price"]), **defaults, **own}
        for name in REQUIRED:
            if name not in data and name not in defaults:
                self.problem(line, f"{where}.{name}", "is required")
        if "price" in data:
            try:
                values["price"] = money_parse(
                    data["price"],
                    symbol=str(values["asset_symbol"]),
                    decimals=int(values["asset_decimals"]),
                )
            except ValueError as exc:
                self.problem(data.line_of("price"), f"{where}.price", str(exc))
        upstream = self.upstream(data.get("upstream"), f"{where}.upstream")
        self.executor(values, upstream, data, where, line)
        # A value already refused is not reported again by the model's own checks.
        refused = [p.where.removeprefix(f"{where}.") for p in self.problems[mark:]]
        self.offering(slug, values, data, where, line, refused)
        return CatalogEntry(slug=slug, line=line, fields=values, upstream=upstream)

    def executor(
        self,
        values: dict[str, Any],
        upstream: dict[str, Any] | None,
        data: LinedMap,
        where: str,
        line: int,
    ) -> None:
        if upstream is not None and not values.get("executor"):
            kind = str(upstream.get("kind") or "")
            values["executor"] = upstream.get("entry_point") if kind == "python" else kind
        elif upstream is None and values.get("executor") not in registered_names():
            names = ", ".join(registered_names())
            at = data.line_of("executor") if "executor" in data else line
            self.problem(at, f"{where}.executor", f"one of {names}, or give an upstream")

    def offering(
        self,
        slug: str,
        values: dict[str, Any],
        data: LinedMap,
        where: str,
        line: int,
        refused: list[str],
    ) -> None:
        try:
            Offering(slug=slug, **values).full_clean(
                validate_unique=False,
                exclude=["catalog_file", "catalog_sha256", "catalog_stock", *refused],
            )
        except ValidationError as exc:
            self.model_errors(exc, data, where, line)
        pay_to = str(values.get("pay_to") or "")
        if str(values.get("network")).startswith("eip155:") and not EVM_ADDRESS.fullmatch(pay_to):
            self.problem(*self.at(data, "pay_to", where), f"not an EVM address: {pay_to!r}")
        problem = offering_asset_problem(
            network=str(values.get("network") or ""), asset=str(values.get("asset") or "")
        )
        if problem:
            self.problem(*self.at(data, "asset", where), problem)
        try:
            jsonschema.Draft202012Validator.check_schema(values.get("input_schema") or {})
        except jsonschema.SchemaError as exc:
            self.problem(
                data.line_of("input_schema"),
                f"{where}.input_schema",
                f"not a JSON Schema: {exc.message}",
            )


def _top(reader: _Reader, data: Any) -> tuple[LinedMap, LinedMap]:
    if not isinstance(data, LinedMap):
        reader.problem(1, "", f"a mapping with `{FORMAT_KEY}: {FORMAT_VERSION}` and `offerings`")
        return LinedMap(), LinedMap()
    if data.get(FORMAT_KEY) != FORMAT_VERSION:
        reader.problem(data.line_of(FORMAT_KEY), FORMAT_KEY, f"must be {FORMAT_VERSION}")
    for key in sorted(set(data) - {FORMAT_KEY, "defaults", "offerings"}):
        reader.problem(
            data.line_of(key), key, "unknown key (tollbooth_catalog, defaults, offerings)"
        )
    defaults, offerings = data.get("defaults", LinedMap()), data.get("offerings")
    if not isinstance(defaults, LinedMap):
        reader.problem(data.line_of("defaults"), "defaults", "a mapping of offering fields")
        defaults = LinedMap()
    if not isinstance(offerings, LinedMap):
        reader.problem(data.line_of("offerings"), "offerings", "a mapping: slug -> offering")
        offerings = LinedMap()
    return defaults, offerings


def catalog_parse(
    text: str, *, name: str, defaults_override: dict[str, Any] | None = None
) -> Catalog:
    """Read and validate a whole catalog file. `defaults_override` replaces values of its
    `defaults` (the demo puts in each run's token and wallet).

    Raises CatalogInvalid naming every problem with its line (code catalog_invalid).
    """
    data, problems = yaml_read(text)
    reader = _Reader()
    reader.problems.extend(problems)
    if problems:
        raise CatalogInvalid(reader.problems)
    raw_defaults, offerings = _top(reader, data)
    reader.defaults = raw_defaults
    defaults = reader.fields(raw_defaults, OFFERING_FIELDS, "defaults", ())
    defaults.update(defaults_override or {})
    entries = {
        str(slug): reader.entry(str(slug), value, offerings.line_of(slug), defaults)
        for slug, value in offerings.items()
    }
    if reader.problems:
        raise CatalogInvalid(reader.problems)
    return Catalog(name=name, sha256=text_sha256(text), entries=entries)
