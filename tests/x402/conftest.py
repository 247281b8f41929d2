"""Fixtures of the x402 suite. The `x402_*world` fixtures live in tests/x402/e2e.py (the
reconciliation suite uses them too); the chain ones are built on tests/fixtures/anvil.py."""
