"""On-chain side of x402 payments: the test USDC token, EIP-3009 helpers, a local anvil node."""
