"""Signatures (the relayer's transactions, recovering an authorization's signer) run on
libsecp256k1 through coincurve, not eth-keys' pure-Python fallback: a paid x402 request
spent about 12 ms of CPU in that fallback's point arithmetic."""

from __future__ import annotations

from eth_keys.backends import CoinCurveECCBackend, get_backend


def test_eth_keys_uses_the_native_backend():
    assert isinstance(get_backend(), CoinCurveECCBackend)
