"""What the MCP door offers: every active offering as a tool (tools/list, doors.mcp),
and the same tools as bazaar MCP items in x402 discovery (`/.well-known/x402`).

Plain documents here; doors.mcp turns them into the MCP SDK's types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from payments.rails.x402.networks import UnknownNetwork, network_config
from payments.rails.x402.wire import requirements_wire
from purchases.models import Offering
from purchases.services.quote.top_ups import offering_input_schema
from purchases.services.x402.outcomes import x402_requirements_for_offering

# The two MCP transports a tool is served on, and where under the site each listens.
MCP_TRANSPORTS = (("streamable-http", "/mcp"), ("sse", "/mcp/sse"))
PRICE_META = "tollbooth/price"
ACCEPTS_META = "x402/accepts"


@dataclass(frozen=True)
class ToolOffer:
    """One offering as an MCP tool: `meta` carries its price (and x402 terms, if sold there)."""

    name: str
    title: str
    description: str
    input_schema: dict[str, Any]
    meta: dict[str, Any]
    accepts: list[dict[str, Any]]


def _accepts(offering: Offering) -> list[dict[str, Any]]:
    """The price-only x402 `accepts` entry; none for an offering sold on no x402 network."""
    try:
        network = network_config(offering.network)
    except UnknownNetwork:
        return []
    requirements = x402_requirements_for_offering(offering=offering)
    wire = requirements_wire(requirements, network)
    return [wire.model_dump(mode="json", by_alias=True, exclude_none=True)]


def mcp_tool_offers() -> list[ToolOffer]:
    """Every active offering as a tool, by slug."""
    tools = []
    for offering in Offering.objects.filter(is_active=True).order_by("slug"):
        accepts = _accepts(offering)
        price = {
            "amount": str(offering.price),
            "asset": offering.asset,
            "network": offering.network,
            "payTo": offering.pay_to,
            "duplicateWindowSeconds": int(offering.duplicate_window.total_seconds()),
        }
        tools.append(
            ToolOffer(
                name=offering.slug,
                title=offering.title,
                description=offering.description or offering.title,
                input_schema=offering_input_schema(offering) or {"type": "object"},
                meta={PRICE_META: price, **({ACCEPTS_META: accepts} if accepts else {})},
                accepts=accepts,
            )
        )
    return tools


def mcp_discovery_items(*, base_url: str) -> list[dict[str, Any]]:
    """The tools as bazaar MCP items, one per (endpoint URL, tool): `input.type` "mcp", the
    tool (`toolName` as the SDK's bazaar types validate it, and `tool`), its `inputSchema`
    and `transport`. Only tools sold over x402 are listed: discovery is for x402 buyers."""
    items = []
    for tool in mcp_tool_offers():
        if not tool.accepts:
            continue
        for transport, path in MCP_TRANSPORTS:
            mcp_input = {
                "type": "mcp",
                "toolName": tool.name,
                "tool": tool.name,
                "description": tool.description,
                "transport": transport,
                "inputSchema": tool.input_schema,
            }
            items.append(
                {
                    "resource": f"{base_url}{path}",
                    "type": "mcp",
                    "x402Version": 2,
                    "accepts": tool.accepts,
                    "metadata": {"title": tool.title, "description": tool.description},
                    "extensions": {
                        "bazaar": {
                            "info": {
                                "input": mcp_input,
                                "output": {"type": "json", "mimeType": "application/json"},
                            }
                        }
                    },
                }
            )
    return items
