"""The x402 door's domain: what the paid URL and the MCP door sell and how a purchase over
x402 stands, in domain terms only (the door itself, HTTP and MCP, is `doors/`).

`checkout` (pay over x402), `outcomes` (where a paid purchase stands, as the paid URL answers
it), `offers` (what is sold over x402 and discovery), `quote_seal` (an anonymous quote's
terms signed into its 402), `sign_in` (wallet sign-in), `tool_offers` and `tool_checkout` (the
offerings as MCP tools; a tool call paid from a prepaid balance). The x402 rail itself is
payments.rails.x402.
"""
