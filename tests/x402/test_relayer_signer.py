"""The relayer signs through the same signer interface as payouts (issue 35, part 3): a class
named by TOLLBOOTH_RELAYER_SIGNER (a KMS or hardware signer in production; here one holding
its key outside the settings, as a KMS would) replaces the environment's key, and every
direct-mode path uses it: settlement, the gas watch, /readyz and the books."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from eth_account import Account
from eth_account.signers.local import LocalAccount
from rest_framework.test import APIClient

from payments.models import PaymentAttempt
from payments.selectors import payments_wallets
from payments.signers import SignedTransaction, TransactionSigner, _relayer_signer, relayer_signer
from purchases.services.jobs.reconcile import relayer_funds_watch
from tests.x402.e2e import NETWORK, PRICE, X402World, ask, sign_payment

pytestmark = pytest.mark.django_db


class RemoteSigner:
    """Stands for a KMS: the key never enters the settings; only signatures come back."""

    held: LocalAccount | None = None  # what the "KMS" holds
    signed: list[dict[str, Any]] = []

    def __init__(self, *, network: str) -> None:
        assert RemoteSigner.held is not None
        self._account = RemoteSigner.held
        self.network = network

    @property
    def address(self) -> str:
        return str(self._account.address)

    def sign_transaction(self, tx: dict[str, Any]) -> SignedTransaction:
        RemoteSigner.signed.append(dict(tx))
        signed = self._account.sign_transaction(tx)
        return SignedTransaction(signed.raw_transaction.to_0x_hex(), signed.hash.to_0x_hex())


@pytest.fixture
def remote_signer(x402_world: X402World, settings: Any) -> Iterator[X402World]:
    """The world's relayer key held by the remote signer only; none in the environment."""
    RemoteSigner.held = Account.from_key(x402_world.relayer.key)
    RemoteSigner.signed = []
    settings.TOLLBOOTH = {
        **settings.TOLLBOOTH,
        "RELAYER_SIGNER": "tests.x402.test_relayer_signer.RemoteSigner",
    }
    settings.X402_NETWORKS[NETWORK]["relayer_private_key"] = ""
    _relayer_signer.cache_clear()
    yield x402_world
    _relayer_signer.cache_clear()


def test_a_signer_class_replaces_the_environment_key_for_settlement(remote_signer: X402World):
    world = remote_signer
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], None)

    paid = ask(client, world, payment=payment)

    assert paid.status_code in (200, 202), paid.content
    attempt = PaymentAttempt.objects.get()
    assert attempt.relayer_address == world.relayer.address
    assert len(RemoteSigner.signed) == 1
    assert RemoteSigner.signed[0]["nonce"] == attempt.relayer_nonce
    assert world.w3.eth.get_transaction(attempt.tx_hash)["from"] == world.relayer.address
    assert world.seller_balance() == PRICE


def test_the_gas_watch_and_the_books_know_the_signers_relayer(remote_signer: X402World):
    from payments.models import RelayerGas

    stats = relayer_funds_watch()

    assert stats[f"{NETWORK}:ok"] == 1
    assert RelayerGas.objects.get(network=NETWORK).address == remote_signer.relayer.address
    assert remote_signer.relayer.address.lower() in payments_wallets(network=NETWORK)


def test_the_default_signer_is_the_environment_key(x402_world: X402World):
    signer = relayer_signer(network=NETWORK)
    assert isinstance(signer, TransactionSigner)
    assert signer.address == x402_world.relayer.address
    assert x402_world.relayer.key.hex() not in repr(signer)
