"""The buyers' ways in, above purchases: each door parses a request, makes one domain call
and renders what it returns (status, headers, bytes), and nothing else.

- `x402/`: the paid URL (`POST /x402/<offering>`), its discovery and its answers;
- `mcp/`: every active offering as an MCP tool;
- `rest/`: the REST API (quotes, prepaid purchases, purchase documents, receipts), its
  authentication, throttles, parsers and problem+json errors.

The answers are shared where the documents are: the x402 door renders with `rest.answers`,
and a paid MCP tool call is answered with the x402 and prepaid answers. No door imports the
back office, nor the back office a door (an import-linter contract).
"""
