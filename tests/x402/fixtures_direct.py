"""Real anvil nodes with TestUSDC for the direct-mode settler and relayer tests.

Import the fixtures you use into the test module (`# noqa: F401`).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from eth_account.signers.local import LocalAccount
from eth_typing import ChecksumAddress
from hexbytes import HexBytes
from web3 import Web3

from payments.chain.anvil import AnvilNode
from payments.chain.token import balance_of, deploy_test_usdc, mint, sign_transfer_authorization
from payments.x402.types import Authorization, NetworkConfig, Requirements

USDC = 10**6
FUNDED = 100 * USDC
PRICE = 10_000  # 0.01 USDC
CAIP2 = "eip155:31337"


@dataclass
class DirectEnv:
    """A deployed TestUSDC, its accounts, and the direct-mode network config naming it."""

    node: AnvilNode
    w3: Web3
    token: ChecksumAddress
    network: NetworkConfig
    deployer: LocalAccount
    payer: LocalAccount  # funded
    seller: LocalAccount  # payTo, starts at zero
    relayer: LocalAccount  # broadcasts and pays gas, holds no USDC

    def authorize(self, value: int = PRICE) -> Authorization:
        """A fresh authorization (random EIP-3009 nonce) from the payer to the seller."""
        now: int = self.w3.eth.get_block("latest")["timestamp"]
        signed = sign_transfer_authorization(
            self.payer, token_address=self.token, chain_id=self.network.chain_id,
            name=self.network.token_name, version=self.network.token_version,
            to=self.seller.address, value=value, valid_after=now - 60, valid_before=now + 600,
        )  # fmt: skip
        a = signed["authorization"]
        return Authorization(
            payer=a["from"], to=a["to"], value=int(a["value"]),
            valid_after=int(a["validAfter"]), valid_before=int(a["validBefore"]),
            nonce=a["nonce"], signature=signed["signature"],
        )  # fmt: skip

    def requirements(self, value: int = PRICE) -> Requirements:
        return Requirements(
            network=CAIP2, asset=self.token, amount=value, pay_to=self.seller.address,
            max_timeout_seconds=300, quote_id="quo_test",
        )  # fmt: skip

    def balance(self, account: LocalAccount) -> int:
        return balance_of(self.w3, self.token, account.address)


def make_direct_env(node: AnvilNode, *, confirmation_timeout: float = 3.0) -> DirectEnv:
    """Deploy and fund on `node`; a node started with no_mining mines just for the setup."""
    node.set_automine(True)
    w3 = node.w3()
    deployer, payer, seller, relayer = node.accounts[:4]
    token = deploy_test_usdc(w3, deployer)
    mint(w3, token, deployer, payer.address, FUNDED)
    network = NetworkConfig(
        caip2=CAIP2, chain_id=31337, rpc_url=node.rpc_url, token_address=token,
        token_name="USDC", token_version="2", confirmations=1,
        confirmation_timeout=confirmation_timeout, mode="direct",
        relayer_private_key=HexBytes(relayer.key).to_0x_hex(),
    )  # fmt: skip
    return DirectEnv(node, w3, token, network, deployer, payer, seller, relayer)


@pytest.fixture(scope="session")
def direct_node() -> Iterator[AnvilNode]:
    with AnvilNode() as node:
        yield node


@pytest.fixture
def direct_env(direct_node: AnvilNode) -> DirectEnv:
    """Automining node shared by the session; a fresh token per test keeps balances exact."""
    return make_direct_env(direct_node)


@pytest.fixture
def paused_env() -> Iterator[DirectEnv]:
    """A node of its own with mining paused after setup: nothing mines until `mine()`."""
    with AnvilNode(no_mining=True) as node:
        env = make_direct_env(node, confirmation_timeout=0.5)
        node.set_automine(False)
        yield env


@pytest.fixture
def gap_env() -> Iterator[DirectEnv]:
    """An automining node of its own, for tests that leave the relayer's nonces gapped."""
    with AnvilNode() as node:
        yield make_direct_env(node, confirmation_timeout=0.5)


@pytest.fixture
def closed_rpc_url() -> str:
    """A local URL where nothing listens (the port was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
