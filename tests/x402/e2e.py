"""A whole x402 world for end-to-end tests: a fresh test USDC on the session's anvil node,
funded payers, a relayer of its own, an offering priced in that token, and a client that
signs like any x402 client (our signer, the `x402` package's wire types and header codecs).

Registered as a pytest plugin in tests/conftest.py: the `x402_*world` fixtures are shared by
the x402 and reconciliation suites."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest
from eth_account.signers.local import LocalAccount
from rest_framework.test import APIClient
from web3 import Web3
from x402.http.utils import decode_payment_required_header, encode_payment_signature_header
from x402.schemas import PaymentPayload, PaymentRequired

from devtools.anvil import AnvilNode
from devtools.facilitator_double import FacilitatorDouble
from devtools.test_token import sign_transfer_authorization
from payments.chain.token import balance_of
from purchases.models import Offering
from tests.factories import OfferingFactory
from tests.fixtures.anvil import deploy_funded_usdc, new_account, new_accounts, prepare_upto

NETWORK = "eip155:31337"
PRICE = 250_000
FUNDED = 100 * 10**6


@dataclass
class X402World:
    node: AnvilNode
    w3: Web3
    token: str
    deployer: LocalAccount
    relayer: LocalAccount
    seller: LocalAccount
    payers: list[LocalAccount]
    offering: Offering
    network_settings: dict[str, Any] = field(default_factory=dict)

    @property
    def paid_url(self) -> str:
        return f"/x402/{self.offering.slug}"

    def seller_balance(self) -> int:
        return balance_of(self.w3, self.token, self.seller.address)

    def relayer_sent(self) -> int:
        """Transactions the relayer ever signed and got mined or pending: broadcasts made."""
        return int(self.w3.eth.get_transaction_count(self.relayer.address, "pending"))

    def new_account(self) -> LocalAccount:
        """Another key of this world's own, with ETH for gas (a facilitator's, say)."""
        return new_account(self.node)

    def worker_env(self) -> dict[str, str]:
        """What a worker process needs to read this world's chain as the test's settings do
        (start_worker's `extra_env`): a worker checks a held payment before its work runs."""
        return {
            "X402_LOCAL_RPC_URL": self.node.rpc_url,
            "X402_LOCAL_TOKEN": self.token,
            "X402_LOCAL_RELAYER_KEY": self.relayer.key.hex(),
            "X402_LOCAL_MODE": "direct",
        }


def build_world(
    settings: Any,
    node: AnvilNode,
    *,
    no_mining: bool = False,
    mode: str = "direct",
    facilitator_url: str = "",
    offering: dict[str, Any] | None = None,
    upto: bool = False,
) -> X402World:
    """Deploy and fund on `node` (mining), then pause it if asked; point settings at it.
    `upto`: Permit2 and the upto proxy placed, and every payer's Permit2 approval sent."""
    w3 = node.w3()
    deployer, relayer, seller, *payers = new_accounts(node, 6)
    token = deploy_funded_usdc(node, deployer, [payer.address for payer in payers], FUNDED)
    if upto:
        prepare_upto(node, token, payers)
    if no_mining:
        node.set_automine(False)
    network_settings = {
        "chain_id": 31337,
        "rpc_url": node.rpc_url,
        "token_address": token,
        "token_name": "USDC",
        "token_version": "2",
        "confirmations": 1,
        "confirmation_timeout": 2.0,
        "mode": mode,
        "relayer_private_key": relayer.key.hex(),
        "facilitator_url": facilitator_url,
        "facilitator_timeout": 1.5,
    }
    settings.X402_NETWORKS = {**settings.X402_NETWORKS, NETWORK: network_settings}
    settings.X402_RESULT_WAIT_SECONDS = 0
    record = OfferingFactory.create(
        asset=token, network=NETWORK, pay_to=seller.address, price=PRICE, **(offering or {})
    )
    return X402World(node, w3, token, deployer, relayer, seller, payers, record, network_settings)


class MakeWorld(Protocol):
    def __call__(
        self,
        *,
        no_mining: bool = False,
        mode: str = "direct",
        facilitator_url: str = "",
        offering: dict[str, Any] | None = None,
        upto: bool = False,
    ) -> X402World: ...


@pytest.fixture
def make_x402_world(request: pytest.FixtureRequest, settings: Any) -> MakeWorld:
    """Build a world on the shared node, or with `no_mining` on the paused (reverted) one."""

    def make(*, no_mining: bool = False, **options: Any) -> X402World:
        node = request.getfixturevalue("paused_anvil" if no_mining else "anvil_node")
        return build_world(settings, node, no_mining=no_mining, **options)

    return make


MakeFacilitatedWorld = Callable[..., tuple[X402World, FacilitatorDouble]]


@pytest.fixture
def make_facilitated_world(
    make_x402_world: MakeWorld, settings: Any
) -> Iterator[MakeFacilitatedWorld]:
    """A facilitator-mode world and the facilitator double it settles through (own gas key)."""
    with contextlib.ExitStack() as stack:

        def make(
            *, mode: str = "ok", hang_seconds: float = 6.0
        ) -> tuple[X402World, FacilitatorDouble]:
            world = make_x402_world(mode="facilitator")
            double = FacilitatorDouble(
                world.node.rpc_url, world.new_account(), hang_seconds=hang_seconds
            )
            stack.enter_context(double)
            settings.X402_NETWORKS[NETWORK]["facilitator_url"] = double.url
            double.mode = mode
            return world, double

        yield make


@pytest.fixture
def x402_world(make_x402_world: MakeWorld, db: None) -> X402World:
    return make_x402_world()


@pytest.fixture
def x402_live_world(make_x402_world: MakeWorld, transactional_db: None) -> X402World:
    """The same world with committed data, for tests that race real threads or processes."""
    return make_x402_world()


@pytest.fixture
def x402_paused_world(make_x402_world: MakeWorld, db: None) -> X402World:
    """Mining paused after set-up: broadcasts wait in the mempool until `node.mine()`."""
    return make_x402_world(no_mining=True)


def sign_payment(
    required_header: str,
    payer: LocalAccount,
    payment_id: str | None,
    *,
    value: int | None = None,
    to: str | None = None,
    valid_after: int = 0,
    valid_before: int | None = None,
    accepted_overrides: dict[str, Any] | None = None,
    signer: LocalAccount | None = None,
) -> str:
    """What an x402 client does with a 402: sign the first `accepts` entry, echo extensions."""
    required = decode_payment_required_header(required_header)
    assert isinstance(required, PaymentRequired)
    requirement = required.accepts[0]
    signed = sign_transfer_authorization(
        signer or payer,
        token_address=requirement.asset,
        chain_id=31337,
        name=requirement.extra["name"],
        version=requirement.extra["version"],
        to=to or requirement.pay_to,
        value=value if value is not None else int(requirement.amount),
        valid_after=valid_after,
        valid_before=valid_before or int(time.time()) + 600,
    )
    payload: dict[str, Any] = dict(signed)
    if signer is not None:  # signed by someone else, claiming to be `payer`
        payload["authorization"] = {**payload["authorization"], "from": payer.address}
    accepted = requirement.model_copy(update=accepted_overrides or {})
    extensions = {
        "payment-identifier": {
            "info": {"required": True, **({"id": payment_id} if payment_id else {})}
        }
    }
    document = PaymentPayload(
        x402_version=2,
        payload=payload,
        accepted=accepted,
        resource=required.resource,
        extensions=extensions,
    )
    return encode_payment_signature_header(document)


def ask(
    client: APIClient,
    world: X402World,
    data: dict[str, Any] | None = None,
    *,
    payment: str | None = None,
) -> Any:
    body = data or {"title": "Sales", "csv": "region,units\nnorth,3\n"}
    if payment:
        return client.post(world.paid_url, body, format="json", HTTP_PAYMENT_SIGNATURE=payment)
    return client.post(world.paid_url, body, format="json")
