"""A TestUSDC of the test's own on the session's anvil node (tests/fixtures/anvil.py), with
fresh keys for every role; no database needed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import pytest
from eth_account.signers.local import LocalAccount
from eth_typing import ChecksumAddress
from web3 import Web3

from devtools.anvil import AnvilNode
from tests.fixtures.anvil import deploy_funded_usdc, new_accounts

USDC = 10**6  # one USDC in atomic units
FUNDED = 100 * USDC


class TokenDomain(TypedDict):
    """The keyword arguments that name a token's EIP-712 domain in payments.chain.token."""

    token_address: str
    chain_id: int
    name: str
    version: str


@dataclass
class Usdc:
    """A freshly deployed TestUSDC with two funded payers."""

    w3: Web3
    node: AnvilNode
    address: ChecksumAddress
    chain_id: int
    name: str
    version: str
    deployer: LocalAccount
    payer: LocalAccount  # funded
    other_payer: LocalAccount  # funded
    payee: LocalAccount  # starts at zero
    relayer: LocalAccount  # broadcasts and pays the gas, holds no USDC

    def domain(self) -> TokenDomain:
        return {
            "token_address": self.address,
            "chain_id": self.chain_id,
            "name": self.name,
            "version": self.version,
        }


def deploy_funded(node: AnvilNode) -> Usdc:
    w3 = node.w3()
    deployer, payer, other_payer, payee, relayer = new_accounts(node, 5)
    address = deploy_funded_usdc(node, deployer, [payer.address, other_payer.address], FUNDED)
    return Usdc(w3, node, address, w3.eth.chain_id, "USDC", "2",
                deployer, payer, other_payer, payee, relayer)  # fmt: skip


@pytest.fixture
def usdc(anvil_node: AnvilNode) -> Usdc:
    return deploy_funded(anvil_node)


@pytest.fixture
def paused_usdc(paused_anvil: AnvilNode) -> Usdc:
    """On the node a test may pause and move the clock of (reverted afterwards); mining on."""
    return deploy_funded(paused_anvil)
