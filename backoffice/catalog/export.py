"""The whole catalog written as a catalog file (offerings, their upstreams, every term), so
a seller can keep it in git, review a price change, or move a staging catalog to mainnet.
Secrets are only ever named (an upstream's `secret_env`); a URL carrying credentials is
refused rather than written."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

import yaml
from django.utils import timezone

from backoffice.catalog.checks import OFFERING_FIELDS, UPSTREAM_FIELDS
from backoffice.catalog.document import (
    FORMAT_KEY,
    FORMAT_VERSION,
    CatalogInvalid,
    Problem,
)
from backoffice.catalog.values import duration_text, money_text
from fulfillment.models import Upstream
from purchases.models import Offering

# Shared by every offering, they go once under `defaults` (one place to change per network).
SHARED = ("network", "asset", "asset_symbol", "asset_decimals", "pay_to")
HEADER = """\
# Tollbooth catalog: every offering, as `manage.py offerings apply FILE` makes it.
# Money is an integer of the asset's smallest unit or "<amount> <symbol>", never a float.
# Durations: "7d", "1h30m", "10s". Secrets are named by environment variable, never written.
# docs/offerings-as-code.md
"""


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None  # a description reads as it was typed
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _value(name: str, value: Any, offering: Offering) -> Any:
    if name == "price":
        return money_text(value, symbol=offering.asset_symbol, decimals=offering.asset_decimals)
    if isinstance(value, timedelta):
        return duration_text(value)
    if isinstance(value, Decimal):
        return format(value.normalize(), "f")
    return value


def _upstream(upstream: Upstream) -> dict[str, Any]:
    if "@" in urlsplit(upstream.url or "").netloc:
        raise CatalogInvalid(
            [
                Problem(
                    0,
                    f"offerings.{upstream.offering.slug}.upstream.url",
                    "carries credentials: a catalog file never holds a secret; take them "
                    "out of the URL in the admin, then export again",
                )
            ]
        )
    values = {name: getattr(upstream, name) for name in UPSTREAM_FIELDS}
    values["timeout_seconds"] = format(Decimal(values["timeout_seconds"]).normalize(), "f")
    return values


def _entry(offering: Offering, shared: set[str]) -> dict[str, Any]:
    entry: dict[str, Any] = {}
    for name in ("title", "description", "is_active", "price", *OFFERING_FIELDS):
        if name in entry or name in shared:
            continue
        entry[name] = _value(name, getattr(offering, name), offering)
    upstream = getattr(offering, "upstream", None)  # the reverse one-to-one, or None
    entry["upstream"] = _upstream(upstream) if upstream is not None else None
    return entry


def catalog_export() -> str:
    """The catalog as a catalog file's text: applied to this database it changes nothing
    (but who owns the offerings); applied to another it makes the same catalog.

    Raises CatalogInvalid when an upstream URL carries credentials (never written)."""
    offerings = list(Offering.objects.select_related("upstream").order_by("slug"))
    shared = {
        name
        for name in SHARED
        if len(offerings) > 1 and len({getattr(o, name) for o in offerings}) == 1
    }
    document: dict[str, Any] = {FORMAT_KEY: FORMAT_VERSION}
    if shared:
        document["defaults"] = {
            name: getattr(offerings[0], name) for name in SHARED if name in shared
        }
    document["offerings"] = {o.slug: _entry(o, shared) for o in offerings}
    stamp = f"# Exported {timezone.now():%Y-%m-%d %H:%M UTC} ({len(offerings)} offerings).\n"
    body = yaml.dump(
        document, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=96, indent=2
    )
    return HEADER + stamp + body
