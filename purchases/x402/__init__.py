"""The x402 door, in one home: the paid URL (HTTP) and the MCP door, with their services.

Two layers, as in the rest of purchases. The interface speaks HTTP and MCP and stays thin:
`views` (the paid URL and its discovery), `answers` (a domain result as an x402 response) and
`mcp/` (the MCP server, its two transports and tool results). The services speak only the
domain and never import the interface: `checkout` (pay over x402), `outcomes` (where a paid
purchase stands, as the paid URL answers it), `offers` (what is sold over x402 and
discovery), `sign_in` (wallet sign-in), `tool_offers` and `tool_checkout` (the offerings as MCP
tools; a tool call paid from a prepaid balance). The x402 rail itself is payments.x402.
"""
