"""A whole x402 world for end-to-end tests: a fresh anvil chain, the test USDC, funded
payers, a relayer, an offering priced in that token, and a client that signs like any x402
client (our signer, the `x402` package's wire types and header codecs)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from eth_account.signers.local import LocalAccount
from rest_framework.test import APIClient
from web3 import Web3
from x402.http.utils import decode_payment_required_header, encode_payment_signature_header
from x402.schemas import PaymentPayload, PaymentRequired

from payments.chain.anvil import AnvilNode
from payments.chain.token import balance_of, deploy_test_usdc, mint, sign_transfer_authorization
from purchases.models import Offering
from tests.factories import OfferingFactory

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


def build_world(
    settings: Any,
    *,
    no_mining: bool = False,
    mode: str = "direct",
    facilitator_url: str = "",
    offering: dict[str, Any] | None = None,
) -> tuple[X402World, AnvilNode]:
    node = AnvilNode()
    w3 = node.w3()
    deployer, relayer, seller, *payers = node.accounts[:6]
    token = deploy_test_usdc(w3, deployer)
    for payer in payers:
        mint(w3, token, deployer, payer.address, FUNDED)
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
    world = X402World(node, w3, token, deployer, relayer, seller, payers, record, network_settings)
    return world, node


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
