"""A real anvil chain with TestUSDC for the x402 verification and lookup tests.

Not a conftest.py (another suite shares tests/x402/): import the fixtures a test module uses,
and the ones they depend on, into it (`# noqa: F401`). No database is touched.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from eth_account.signers.local import LocalAccount
from eth_typing import ChecksumAddress, HexStr
from hexbytes import HexBytes
from web3 import Web3

from payments.chain.anvil import AnvilNode
from payments.chain.token import (
    SignedAuthorization,
    deploy_test_usdc,
    mint,
    send_transfer_with_authorization,
    sign_transfer_authorization,
)
from payments.x402.chain import ChainReader
from payments.x402.types import Authorization, NetworkConfig, Requirements
from payments.x402.verify import parse_authorization

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


def make_env(node: AnvilNode, *, confirmations: int = 1) -> ChainEnv:
    """Deploy TestUSDC on `node` (which must be mining) and fund the payer."""
    w3 = node.w3()
    deployer, payer, seller, relayer, stranger = node.accounts[:5]
    token = deploy_test_usdc(w3, deployer)
    mint(w3, token, deployer, payer.address, FUNDED)
    network = NetworkConfig(
        caip2=CAIP2,
        chain_id=node.chain_id,
        rpc_url=node.rpc_url,
        token_address=token,
        token_name="USDC",
        token_version="2",
        confirmations=confirmations,
        confirmation_timeout=5.0,
        mode="direct",
        relayer_private_key=HexBytes(relayer.key).to_0x_hex(),
    )
    return ChainEnv(node, w3, token, network, deployer, payer, seller, relayer, stranger)


def closed_port_url() -> str:
    """An http URL on which nothing listens (the port was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def x402_node() -> Iterator[AnvilNode]:
    with AnvilNode() as node:
        yield node


@pytest.fixture(scope="session")
def chain(x402_node: AnvilNode) -> ChainEnv:
    # One deployment for the session: every test signs a fresh random nonce, and none
    # asserts absolute balances, so tests do not see each other.
    return make_env(x402_node)


@pytest.fixture
def network(chain: ChainEnv) -> NetworkConfig:
    return chain.network


@pytest.fixture
def requirements(chain: ChainEnv) -> Requirements:
    return chain.requirements()


@pytest.fixture
def reader(chain: ChainEnv) -> ChainReader:
    return chain.reader()


@pytest.fixture
def no_mining_chain() -> Iterator[ChainEnv]:
    """An own node that holds transactions in its pool until mined by hand."""
    with AnvilNode(no_mining=True) as node:
        node.set_automine(True)  # deployment only
        env = make_env(node)
        node.set_automine(False)
        yield env
