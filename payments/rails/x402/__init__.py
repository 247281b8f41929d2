"""The x402 rail on EVM: wire format, our own verification, and two ways to settle."""
