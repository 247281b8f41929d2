"""Demo and test tooling: the local anvil chain, the EIP-3009 test USDC, a scripted x402
signer and the demo seed. A Django app installed by the local and test settings only;
production code never imports it (an import-linter contract in `make lint`)."""
