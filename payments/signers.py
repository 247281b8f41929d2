"""Who signs the refund wallet's transactions: a small interface, so a KMS or a hardware
signer can replace the key held in the environment without touching the payout code.

`TOLLBOOTH_REFUND_SIGNER` names the class (a dotted path); it is built with the network's
CAIP-2 id and must give `address` and `sign_transaction`. The default, `EnvKeySigner`, reads
the key from the environment only (`X402_<NET>_REFUND_WALLET_KEY`, else
`TOLLBOOTH_REFUND_WALLET_KEY`): never from the repository nor the database.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from django.conf import settings
from django.utils.module_loading import import_string
from eth_account import Account
from eth_account.signers.local import LocalAccount


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
