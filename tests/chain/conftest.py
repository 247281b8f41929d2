"""A real anvil chain for the on-chain tests; no database needed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypedDict

import pytest
from eth_account.signers.local import LocalAccount
from eth_typing import ChecksumAddress
from web3 import Web3

from payments.chain.anvil import AnvilNode
from payments.chain.token import deploy_test_usdc, mint

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


@pytest.fixture(scope="session")
def anvil_node() -> Iterator[AnvilNode]:
    with AnvilNode() as node:
        yield node


def deploy_funded(node: AnvilNode) -> Usdc:
    w3 = node.w3()
    deployer, payer, other_payer, payee, relayer = node.accounts[:5]
    address = deploy_test_usdc(w3, deployer)
    for holder in (payer, other_payer):
        mint(w3, address, deployer, holder.address, FUNDED)
    return Usdc(w3, node, address, w3.eth.chain_id, "USDC", "2",
                deployer, payer, other_payer, payee, relayer)  # fmt: skip


@pytest.fixture
def usdc(anvil_node: AnvilNode) -> Usdc:
    return deploy_funded(anvil_node)
