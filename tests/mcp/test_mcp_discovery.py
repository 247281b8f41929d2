"""`/.well-known/x402` lists every offering sold over x402 as bazaar MCP items too, one per
transport, valid by the x402 SDK's own bazaar rules."""

from __future__ import annotations

import pytest
from x402.extensions.bazaar import McpDiscoveryInfo
from x402.extensions.bazaar.facilitator import validate_discovery_extension_spec

from tests.x402.e2e import PRICE

pytestmark = pytest.mark.django_db


def test_discovery_lists_each_tool_as_a_bazaar_mcp_item_per_transport(client, x402_world):
    document = client.get("/.well-known/x402").json()
    slug = x402_world.offering.slug
    items = {
        (item["resource"], item["extensions"]["bazaar"]["info"]["input"]["transport"]): item
        for item in document["items"]
        if item["type"] == "mcp" and item["extensions"]["bazaar"]["info"]["input"]["tool"] == slug
    }
    assert set(items) == {
        ("http://testserver/mcp", "streamable-http"),
        ("http://testserver/mcp/sse", "sse"),
    }
    for item in items.values():
        bazaar = item["extensions"]["bazaar"]
        mcp_input = bazaar["info"]["input"]
        assert mcp_input["type"] == "mcp" and mcp_input["toolName"] == slug
        assert mcp_input["inputSchema"] == x402_world.offering.input_schema
        assert validate_discovery_extension_spec(bazaar).valid, bazaar
        assert McpDiscoveryInfo.model_validate(bazaar["info"]).input.tool_name == slug
        (accept,) = item["accepts"]
        assert (accept["amount"], accept["asset"]) == (str(PRICE), x402_world.token)
