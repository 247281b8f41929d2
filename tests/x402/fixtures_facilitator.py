"""Chain context for the facilitator settler tests: anvil, a fresh test USDC per test, a
funded payer, a relayer account for the facilitator double and a seller with no balance.

Import the `*_fixture` functions you use into the test module (`# noqa: F401`), together
with `tests.fixtures.facilitator.facilitator_double_fixture`. Each is registered under the
name without the suffix (`facilitator_chain`, ...), so a test's parameters shadow nothing.
No database is touched.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from eth_account import Account
from eth_account.signers.local import LocalAccount
from eth_typing import ChecksumAddress
from web3 import Web3

from payments.chain.anvil import AnvilNode
from payments.chain.token import balance_of, deploy_test_usdc, mint, sign_transfer_authorization
from payments.x402.types import Authorization, NetworkConfig, Requirements
from tests.fixtures.facilitator import FacilitatorDouble

USDC = 10**6  # one USDC in atomic units
FUNDED = 100 * USDC
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


def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (the port was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session", name="facilitator_anvil")
def facilitator_anvil_fixture() -> Iterator[AnvilNode]:
    with AnvilNode() as node:
        yield node


@pytest.fixture(name="facilitator_chain")
def facilitator_chain_fixture(facilitator_anvil: AnvilNode) -> FacilitatorChain:
    node = facilitator_anvil
    w3 = node.w3()
    deployer, payer, relayer = node.accounts[:3]
    token = deploy_test_usdc(w3, deployer, TOKEN_NAME, TOKEN_VERSION)
    mint(w3, token, deployer, payer.address, FUNDED)
    seller = Account.create().address
    return FacilitatorChain(node, w3, token, payer, relayer, seller)


@pytest.fixture(name="facilitator_network")
def facilitator_network_fixture(
    facilitator_chain: FacilitatorChain, facilitator_double: FacilitatorDouble
) -> NetworkConfig:
    """mode "facilitator", pointing at the double, facilitator_timeout = 1.5 s."""
    return facilitator_chain.network_config(facilitator_double.url)
