"""Who signs our own transactions: a small interface, so a KMS or a hardware signer can
replace a key held in the environment without touching the payout or settlement code.

Two wallets sign: the refund wallet (payouts) and, in direct mode, the relayer (it pays the
gas of every settlement). Each has its setting naming the class (a dotted path), built with
the network's CAIP-2 id (`cls(network="eip155:8453")`); it must give `address` and
`sign_transaction(tx) -> SignedTransaction`, and must not send:

- `TOLLBOOTH_REFUND_SIGNER`, default `EnvKeySigner`: the key from the environment only
  (`X402_<NET>_REFUND_WALLET_KEY`, else `TOLLBOOTH_REFUND_WALLET_KEY`).
- `TOLLBOOTH_RELAYER_SIGNER`, default `EnvRelayerKeySigner`: `X402_<NET>_RELAYER_KEY`.

Keys come from the environment only: never from the repository nor the database. How a KMS
or hardware signer plugs in: docs/deployment.md, "Signers".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

from django.conf import settings
from django.utils.module_loading import import_string
from eth_account import Account
from eth_account.signers.local import LocalAccount
from eth_keys.datatypes import PrivateKey
from hexbytes import HexBytes


class SignerUnconfigured(LookupError):
    """No refund wallet is configured for the network (no key, or no signer class)."""


@dataclass(frozen=True)
class SignedTransaction:
    raw: str  # 0x-hex of the signed encoding: the exact bytes ever sent
    tx_hash: str  # 0x-hex, lower-case


@runtime_checkable
class TransactionSigner(Protocol):
    """Signs EVM transactions for one address on one network. Signing must not send."""

    @property
    def address(self) -> str: ...

    def sign_transaction(self, tx: dict[str, Any]) -> SignedTransaction: ...


class EnvKeySigner:
    """The refund wallet's key from the environment (settings read it once, at start)."""

    def __init__(self, *, network: str) -> None:
        raw = settings.X402_NETWORKS.get(network, {})
        key = raw.get("refund_wallet_key") or settings.TOLLBOOTH.get("REFUND_WALLET_KEY", "")
        if not key:
            raise SignerUnconfigured(f"no refund wallet key for {network}")
        self._account: LocalAccount = Account.from_key(key)

    @property
    def address(self) -> str:
        return str(self._account.address)

    def sign_transaction(self, tx: dict[str, Any]) -> SignedTransaction:
        signed = self._account.sign_transaction(tx)
        return SignedTransaction(signed.raw_transaction.to_0x_hex(), signed.hash.to_0x_hex())

    def __repr__(self) -> str:  # never the key
        return f"EnvKeySigner({self.address})"


def refund_signer(*, network: str) -> TransactionSigner:
    """The configured signer of the refund wallet on `network`. Raises SignerUnconfigured."""
    path = settings.TOLLBOOTH.get("REFUND_SIGNER") or "payments.signers.EnvKeySigner"
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise SignerUnconfigured(f"TOLLBOOTH_REFUND_SIGNER {path!r}: {exc}") from exc
    signer = cls(network=network)
    if not isinstance(signer, TransactionSigner):
        raise SignerUnconfigured(f"{path} gives no address and sign_transaction")
    return signer


def refund_wallet_address(*, network: str) -> str | None:
    """The refund wallet's address on `network`, lower-case, or None when none is set."""
    try:
        return refund_signer(network=network).address.lower()
    except SignerUnconfigured:
        return None


DEFAULT_RELAYER_SIGNER = "payments.signers.EnvRelayerKeySigner"


class EnvRelayerKeySigner:
    """The relayer's key from the environment (`X402_<NET>_RELAYER_KEY`, read once by the
    settings). `key`: the key a network configuration carries, when it carries one."""

    def __init__(self, *, network: str, key: str = "") -> None:
        key = key or settings.X402_NETWORKS.get(network, {}).get("relayer_private_key", "")
        if not key:
            raise SignerUnconfigured(f"no relayer key for {network}")
        # The parsed key signs: LocalAccount.sign_transaction would derive its public key
        # (an elliptic-curve multiplication) again for every settlement.
        self._key = PrivateKey(HexBytes(key))
        self._address = str(self._key.public_key.to_checksum_address())

    @property
    def address(self) -> str:
        return self._address

    def sign_transaction(self, tx: dict[str, Any]) -> SignedTransaction:
        signed = Account.sign_transaction(tx, self._key)
        return SignedTransaction(signed.raw_transaction.to_0x_hex(), signed.hash.to_0x_hex())

    def __repr__(self) -> str:  # never the key
        return f"EnvRelayerKeySigner({self.address})"


def relayer_signer(*, network: str, key: str = "") -> TransactionSigner:
    """The configured signer of our relayer on `network` (TOLLBOOTH_RELAYER_SIGNER). The
    default takes `key` (a network configuration's key), else the environment's. Built once
    per process, class, network and key (a rotated key is a new signer). Raises
    SignerUnconfigured."""
    path = settings.TOLLBOOTH.get("RELAYER_SIGNER") or DEFAULT_RELAYER_SIGNER
    if path != DEFAULT_RELAYER_SIGNER:
        return _relayer_signer(path, network, "")
    # Resolved before the cache: a key set anew (a rotation, a test) is a new signer.
    key = key or settings.X402_NETWORKS.get(network, {}).get("relayer_private_key", "")
    if not key:
        raise SignerUnconfigured(f"no relayer key for {network}")
    return _relayer_signer(path, network, key)


@lru_cache(maxsize=32)
def _relayer_signer(path: str, network: str, key: str) -> TransactionSigner:
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise SignerUnconfigured(f"TOLLBOOTH_RELAYER_SIGNER {path!r}: {exc}") from exc
    signer = cls(network=network, key=key) if key else cls(network=network)
    if not isinstance(signer, TransactionSigner):
        raise SignerUnconfigured(f"{path} gives no address and sign_transaction")
    return signer


def relayer_address(*, network: str) -> str | None:
    """Our relayer's address on `network` as configured now (checksummed), or None when no
    relayer signer is configured for it."""
    try:
        return relayer_signer(network=network).address
    except SignerUnconfigured:
        return None
