"""The MCP door: every active offering as an MCP tool, paid over x402 (the MCP transport,
`_meta["x402/payment"]`) or from a prepaid balance (an API key on the connection).

Beside the x402 paid URL (doors.x402.views) and answered by the same purchase flow:
`calls` makes the one domain call per tool call, `results` renders what it returns as an MCP
tool result, `server` is the MCP server and its two transports (docs/mcp.md).
"""
