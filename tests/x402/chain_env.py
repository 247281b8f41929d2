"""A TestUSDC of the test's own on a real anvil node, for the x402 verification, lookup,
batch reader, direct settler and facilitator settler tests (fixtures in conftest.py).

Every role is a fresh key (tests/fixtures/anvil.py), so balances, EIP-3009 nonces and the
relayer's transaction count start from zero in every test. No database is touched.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Any

from eth_account import Account
from eth_account.signers.local import LocalAccount
from eth_typing import ChecksumAddress, HexStr
from hexbytes import HexBytes
from web3 import Web3

from devtools.anvil import AnvilNode
from devtools.test_token import (
    SignedAuthorization,
    send_transfer_with_authorization,
    sign_transfer_authorization,
)
from payments.chain.token import balance_of
from payments.rails.x402.chain import ChainReader
from payments.rails.x402.types import Authorization, NetworkConfig, Requirements
from payments.rails.x402.verify import parse_authorization
from tests.fixtures.anvil import deploy_funded_usdc, new_accounts

USDC = 10**6
FUNDED = 100 * USDC
PRICE = 10_000  # 0.01 USDC
CAIP2 = "eip155:31337"


@dataclass
class ChainEnv:
    """A deployed TestUSDC on one node, its accounts, and the network config naming it."""

    node: AnvilNode
    w3: Web3
    token: ChecksumAddress
    network: NetworkConfig
    deployer: LocalAccount
    payer: LocalAccount  # funded
    seller: LocalAccount  # payTo
    relayer: LocalAccount  # broadcasts, pays gas
    stranger: LocalAccount  # holds no USDC

    def now(self) -> int:
        """The chain's clock: the latest block's timestamp."""
        return int(self.w3.eth.get_block("latest")["timestamp"])

    def reader(self, **changes: Any) -> ChainReader:
        return ChainReader(dataclasses.replace(self.network, **changes))

    def requirements(self, **changes: Any) -> Requirements:
        base = Requirements(
            network=self.network.caip2,
            asset=self.token,
            amount=PRICE,
            pay_to=self.seller.address,
            max_timeout_seconds=300,
            quote_id="quo_test",
        )
        return dataclasses.replace(base, **changes)

    def sign(
        self,
        signer: LocalAccount | None = None,
        *,
        to: str | None = None,
        value: int = PRICE,
        valid_after: int | None = None,
        valid_before: int | None = None,
        nonce: bytes | None = None,
        version: str | None = None,
    ) -> SignedAuthorization:
        now = self.now()
        return sign_transfer_authorization(
            signer or self.payer,
            token_address=self.token,
            chain_id=self.network.chain_id,
            name=self.network.token_name,
            version=version or self.network.token_version,
            to=to or self.seller.address,
            value=value,
            valid_after=now - 60 if valid_after is None else valid_after,
            valid_before=now + 600 if valid_before is None else valid_before,
            nonce=nonce,
        )

    def authorization(self, signed: SignedAuthorization | None = None) -> Authorization:
        return parse_authorization(signed or self.sign())

    def authorize(self, value: int = PRICE) -> Authorization:
        """A fresh authorization (random EIP-3009 nonce) from the payer to the seller."""
        return self.authorization(self.sign(value=value))

    def balance(self, account: LocalAccount) -> int:
        return balance_of(self.w3, self.token, account.address)

    def broadcast(self, authorization: Authorization, *, gas: int | None = None) -> HexStr:
        """Send transferWithAuthorization from the relayer; returns at once with the hash.

        A fixed `gas` skips estimation, so an authorization that must revert still gets mined.
        """
        wire = authorization.as_wire()
        return send_transfer_with_authorization(
            self.w3, self.token, self.relayer, wire["authorization"], wire["signature"], gas=gas
        )

    def settle(self, authorization: Authorization, *, gas: int | None = None) -> HexStr:
        """Broadcast and wait for the receipt (automine nodes only)."""
        tx_hash = self.broadcast(authorization, gas=gas)
        self.w3.eth.wait_for_transaction_receipt(tx_hash, timeout=30)
        return tx_hash


def make_env(
    node: AnvilNode, *, confirmations: int = 1, confirmation_timeout: float = 5.0
) -> ChainEnv:
    """Deploy a TestUSDC on `node` (which must be mining) and fund the payer; all keys new."""
    deployer, payer, seller, relayer, stranger = new_accounts(node, 5)
    token = deploy_funded_usdc(node, deployer, [payer.address], FUNDED)
    network = NetworkConfig(
        caip2=CAIP2,
        chain_id=node.chain_id,
        rpc_url=node.rpc_url,
        token_address=token,
        token_name="USDC",
        token_version="2",
        confirmations=confirmations,
        confirmation_timeout=confirmation_timeout,
        mode="direct",
        relayer_private_key=HexBytes(relayer.key).to_0x_hex(),
    )
    return ChainEnv(node, node.w3(), token, network, deployer, payer, seller, relayer, stranger)


# --- for the facilitator settler tests -------------------------------------------------

FACILITATOR_TIMEOUT = 1.5  # seconds; the double's `hang` stays silent longer than this
TOKEN_NAME = "USDC"
TOKEN_VERSION = "2"


@dataclass(frozen=True)
class FacilitatorChain:
    node: AnvilNode
    w3: Web3
    token: ChecksumAddress
    payer: LocalAccount  # holds FUNDED
    relayer: LocalAccount  # the double's gas payer
    seller: ChecksumAddress  # fresh, starts at zero

    @property
    def rpc_url(self) -> str:
        return self.node.rpc_url

    @property
    def chain_id(self) -> int:
        return self.node.chain_id

    @property
    def caip2(self) -> str:
        return f"eip155:{self.chain_id}"

    def network_config(
        self, facilitator_url: str, *, timeout: float = FACILITATOR_TIMEOUT
    ) -> NetworkConfig:
        return NetworkConfig(
            caip2=self.caip2,
            chain_id=self.chain_id,
            rpc_url=self.rpc_url,
            token_address=self.token,
            token_name=TOKEN_NAME,
            token_version=TOKEN_VERSION,
            confirmations=1,
            confirmation_timeout=5.0,
            mode="facilitator",
            facilitator_url=facilitator_url,
            facilitator_timeout=timeout,
        )

    def requirements(self, value: int) -> Requirements:
        return Requirements(
            network=self.caip2,
            asset=self.token,
            amount=value,
            pay_to=self.seller,
            max_timeout_seconds=300,
            quote_id=f"q_{secrets.token_hex(8)}",
        )

    def sign(self, value: int) -> Authorization:
        """The payer's EIP-3009 authorization paying `value` to the seller."""
        now = int(self.w3.eth.get_block("latest")["timestamp"])
        signed = sign_transfer_authorization(
            self.payer, token_address=self.token, chain_id=self.chain_id, name=TOKEN_NAME,
            version=TOKEN_VERSION, to=self.seller, value=value, valid_after=0,
            valid_before=now + 600,
        )  # fmt: skip
        auth = signed["authorization"]
        return Authorization(
            payer=auth["from"],
            to=auth["to"],
            value=int(auth["value"]),
            valid_after=int(auth["validAfter"]),
            valid_before=int(auth["validBefore"]),
            nonce=auth["nonce"],
            signature=signed["signature"],
        )

    def balance(self, holder: str) -> int:
        return balance_of(self.w3, self.token, holder)


def make_facilitator_chain(node: AnvilNode) -> FacilitatorChain:
    """A TestUSDC with a funded payer, the double's gas payer, and a seller at zero."""
    deployer, payer, relayer = new_accounts(node, 3)
    token = deploy_funded_usdc(
        node, deployer, [payer.address], FUNDED, name=TOKEN_NAME, version=TOKEN_VERSION
    )
    seller = Account.create().address
    return FacilitatorChain(node, node.w3(), token, payer, relayer, seller)
