"""Shared types of the x402 rail. Amounts are ints of atomic units, never floats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from payments.rails.base import Settling

if TYPE_CHECKING:
    from payments.rails.x402.facilitator_auth import FacilitatorAuth


@dataclass(frozen=True)
class NetworkConfig:
    """One EVM network as settings describe it (see X402_NETWORKS in config/settings/base.py)."""

    caip2: str  # "eip155:31337"
    chain_id: int
    rpc_url: str
    token_address: str  # the USDC (or test USDC) contract
    token_name: str  # EIP-712 domain name, e.g. "USDC"
    token_version: str  # EIP-712 domain version, e.g. "2"
    confirmations: int  # blocks (including the one holding the tx) before we call it settled
    # Seconds to wait for them before answering "pending": the longest a settlement waits (a
    # paying request may end its wait sooner: its budget, purchases.services.x402.outcomes).
    confirmation_timeout: float
    mode: str  # "direct" (our relayer broadcasts) or "facilitator"
    facilitator_url: str = ""
    facilitator_timeout: float = 10.0
    # The facilitator's credentials (None: it takes calls without); never in a repr.
    facilitator_auth: FacilitatorAuth | None = field(default=None, repr=False)
    relayer_private_key: str = field(default="", repr=False)
    max_timeout_seconds: int = 300  # advertised in PAYMENT-REQUIRED
    # Where a person looks a transaction up ("{tx_hash}" is replaced); "" for a local chain.
    explorer_tx_url: str = ""
    # When a settled payment is final (no reorg can undo it; watched until then):
    # "depth" (its block `finality_depth` deep) or "finalized" (at or below the node's
    # `finalized` block). See payments/rails/x402/finality.py.
    finality: str = "depth"
    finality_depth: int = 0  # 0: the confirmation depth
    # A second RPC URL, asked when the first fails (connection, timeout, 5xx); "" for none.
    # Repr'd never: hosted nodes keep their API key in the URL.
    rpc_url_fallback: str = field(default="", repr=False)


@dataclass(frozen=True)
class Requirements:
    """What the seller asked for: one `accepts` entry of our PAYMENT-REQUIRED."""

    network: str
    asset: str
    amount: int
    pay_to: str
    max_timeout_seconds: int
    quote_id: str | None  # None: a price-only offer (no input yet, nothing to pay against)
    # Seller terms the buyer may read (e.g. the duplicate window); not signed, not checked.
    terms: tuple[tuple[str, int | str], ...] = ()
    # A quote that was never written: its terms as signed by us (`extra.signedQuote`,
    # purchases.services.x402.quote_seal), carried back in the payment's `accepted`.
    signed_quote: tuple[tuple[str, int | str], ...] = ()


@dataclass(frozen=True)
class Authorization:
    """A signed EIP-3009 TransferWithAuthorization, as the buyer sent it."""

    payer: str  # `from`
    to: str
    value: int
    valid_after: int
    valid_before: int
    nonce: str  # 0x + 64 hex chars
    signature: str  # 0x hex

    def as_wire(self) -> dict[str, Any]:
        return {
            "signature": self.signature,
            "authorization": {
                "from": self.payer,
                "to": self.to,
                "value": str(self.value),
                "validAfter": str(self.valid_after),
                "validBefore": str(self.valid_before),
                "nonce": self.nonce,
            },
        }


class VerificationFailed(Exception):
    """The payment evidence does not satisfy the requirement. Nothing is recorded as paying."""

    def __init__(self, reason_code: str, detail: str = "") -> None:
        super().__init__(detail or reason_code)
        self.reason_code = reason_code
        self.detail = detail or reason_code


@dataclass(frozen=True)
class PreparedBroadcast:
    """What is written down before anything leaves the building.

    Direct mode signs the relayer transaction first, so its hash (and the raw bytes, for an
    identical rebroadcast) are committed before the broadcast. Facilitator mode knows none.
    """

    tx_hash: str | None = None
    raw_transaction: str | None = None
    relayer_nonce: int | None = None
    relayer_address: str | None = None  # the key that signed it (checksummed)
    # Direct mode: what was done to close a nonce gap below this transaction before it was
    # sent, as (relayer nonce, action, tx hash sent, ids of the attempts whose transaction
    # held that nonce); evidence only, never recorded on the attempt.
    gap_closed: tuple[tuple[int, str, str, tuple[int, ...]], ...] = ()


class Settler(Protocol):
    """One way to put an authorization on chain. Implementations never raise for network
    faults: they answer PENDING with whatever they know."""

    def prepare(
        self, *, authorization: Authorization, network: NetworkConfig
    ) -> PreparedBroadcast: ...

    def verify_before_record(
        self, *, authorization: Authorization, requirements: Requirements, network: NetworkConfig
    ) -> None:
        """Ask whoever settles (a facilitator) before anything is recorded; nothing to ask
        for our own relayer. Raises FacilitatorRefused (our credentials refused)."""
        ...

    def broadcast(
        self,
        *,
        authorization: Authorization,
        requirements: Requirements,
        network: NetworkConfig,
        prepared: PreparedBroadcast,
        wait_until: float | None = None,
    ) -> Settling:
        """Put `prepared` on chain and look for it; a wait for it, up to
        `network.confirmation_timeout` and never past `wait_until` (a time.monotonic()
        value; None: no earlier end), comes back as a value for the caller to sleep through."""
        ...


def is_final_at_depth(network: NetworkConfig, depth: int) -> bool:
    """A transfer `depth` blocks deep is final by the network's policy itself (`depth`, at its
    finality depth: a seller that confirms at that depth is final as it confirms)."""
    required = network.finality_depth or network.confirmations  # 0: the confirmation depth
    return network.finality == "depth" and depth >= required
