"""Signed receipts on the x402 door (issue 21 §4), on a real anvil chain: none while the
settlement is not final, then the same signed bytes on every answer about the purchase (a
resent payment, a re-signed retry, an authorization seen again after its record was
compacted), with the settlement time from the block and the result's SHA-256."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from fulfillment.models import Receipt
from fulfillment.receipt_signing import receipt_verify
from payments.models import PaymentAttempt
from payments.rails.x402.books_evidence import settlements_awaiting_block_time
from purchases import event_subjects
from purchases.models import Purchase
from purchases.services.fulfil.execution import purchase_execute
from purchases.services.fulfil.receipts import settlement_mined_at
from purchases.services.jobs import housekeeping
from purchases.services.settle.finality import watch_unfinal_settlements
from tests.x402.e2e import NETWORK, PRICE, X402World, ask, sign_payment

pytestmark = [pytest.mark.django_db]
PAY_ID = "x402-receipt-id-000001"
RECEIPT = "Tollbooth-Receipt"


@pytest.fixture
def client() -> APIClient:
    return APIClient()


def _required(client: APIClient, world: X402World) -> str:
    response = ask(client, world)
    assert response.status_code == 402
    return str(response["PAYMENT-REQUIRED"])


def _receipt(response) -> dict:
    return json.loads(base64.b64decode(response[RECEIPT]))


def _published() -> list[str]:
    keys = APIClient().get("/.well-known/tollbooth-receipts").json()["keys"]
    return [key["address"] for key in keys]


def _final_at_depth(settings, world: X402World, depth: int) -> None:
    settings.X402_NETWORKS = {
        **settings.X402_NETWORKS,
        NETWORK: {**world.network_settings, "finality": "depth", "finality_depth": depth},
    }


def _check(receipt: dict, world: X402World, attempt: PaymentAttempt, body: bytes) -> None:
    """The receipt verifies and says what the chain and the delivered bytes say."""
    receipt_verify(receipt, addresses=_published())
    purchase = attempt.purchase
    assert attempt.block_number is not None
    block = world.w3.eth.get_block(attempt.block_number)
    payload = receipt["payload"]
    assert payload["transaction"] == attempt.tx_hash
    assert payload["settledAt"] == int(block["timestamp"])
    assert payload["resultSha256"] == hashlib.sha256(body).hexdigest()
    assert (payload["purchase"], payload["offering"]) == (purchase.ref, world.offering.slug)
    assert (payload["amount"], payload["asset"], payload["network"]) == (
        str(PRICE),
        world.token,
        NETWORK,
    )
    assert payload["payer"].lower() == world.payers[0].address.lower()


def test_no_receipt_until_the_settlement_is_final_then_it_verifies(
    client, make_x402_world, settings
):
    world = make_x402_world()
    _final_at_depth(settings, world, 3)
    payment = sign_payment(_required(client, world), world.payers[0], PAY_ID)

    first = ask(client, world, payment=payment)  # settled, work queued: 202
    purchase = Purchase.objects.get()
    purchase_execute(purchase_id=purchase.pk, worker="test")
    confirmed = ask(client, world, payment=payment)  # the result, 1 block deep of 3

    assert first.status_code == 202 and RECEIPT not in first
    assert confirmed.status_code == 200 and RECEIPT not in confirmed
    assert Receipt.objects.get().signed == ""
    world.node.mine(2)

    final = ask(client, world, payment=payment)  # the resend looks again: final now

    assert final.status_code == 200 and final.content == confirmed.content
    attempt = PaymentAttempt.objects.get()
    assert attempt.final_at is not None and attempt.block_at is not None
    _check(_receipt(final), world, attempt, final.content)
    assert purchase.events.filter(subject=event_subjects.RECEIPT_ISSUED).count() == 1
    again = ask(client, world, payment=payment)
    assert again[RECEIPT] == final[RECEIPT]  # issued once, the same bytes after


def test_a_settlement_pending_answer_carries_no_receipt(client, x402_paused_world):
    world = x402_paused_world
    payment = sign_payment(_required(client, world), world.payers[0], PAY_ID)

    pending = ask(client, world, payment=payment)

    assert pending.status_code == 202 and pending.json()["status"] == "settlement_pending"
    assert RECEIPT not in pending


def test_the_finality_watch_issues_the_receipt_without_the_buyer_asking(
    client, make_x402_world, settings
):
    world = make_x402_world()
    _final_at_depth(settings, world, 3)
    payment = sign_payment(_required(client, world), world.payers[0], PAY_ID)
    ask(client, world, payment=payment)
    purchase = Purchase.objects.get()
    purchase_execute(purchase_id=purchase.pk, worker="test")
    assert watch_unfinal_settlements()["receipts_issued"] == 0  # 1 deep of 3: watched
    world.node.mine(2)

    stats = watch_unfinal_settlements(now=timezone.now() + timedelta(minutes=1))

    assert (stats["final"], stats["receipts_issued"]) == (1, 1)
    stored = Receipt.objects.get()
    answer = ask(client, world, payment=payment)
    assert base64.b64decode(answer[RECEIPT]).decode() == stored.signed
    _check(_receipt(answer), world, PaymentAttempt.objects.get(), answer.content)


def test_a_re_signed_retry_is_answered_with_the_same_receipt(client, x402_world):
    world = x402_world  # confirmed at its finality depth: final as it settles
    payer = world.payers[0]
    first = ask(client, world, payment=sign_payment(_required(client, world), payer, None))
    purchase = Purchase.objects.get()
    purchase_execute(purchase_id=purchase.pk, worker="test")
    paid = ask(client, world, payment=sign_payment(_required(client, world), payer, None))
    assert first.status_code == 202 and paid.status_code == 200

    retry = ask(client, world, payment=sign_payment(_required(client, world), payer, None))

    assert retry.status_code == 200 and retry["Tollbooth-Duplicate-Of"] == purchase.ref
    assert retry[RECEIPT] == paid[RECEIPT]
    _check(_receipt(retry), world, PaymentAttempt.objects.get(), retry.content)
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1


def test_an_authorization_seen_after_its_record_was_compacted_is_answered_from_the_receipt(
    client, x402_world
):
    world = x402_world
    payment = sign_payment(_required(client, world), world.payers[0], None)  # no payment id
    ask(client, world, payment=payment)
    purchase = Purchase.objects.get()
    purchase_execute(purchase_id=purchase.pk, worker="test")
    paid = ask(client, world, payment=payment)
    assert paid.status_code == 200 and RECEIPT in paid
    compacted = housekeeping.compact_payment_ids(now=timezone.now() + timedelta(hours=25))
    assert compacted["compacted"] == 1

    again = ask(client, world, payment=payment)  # the same authorization: (network, payer, nonce)

    assert again.status_code == 410 and again.json()["code"] == "retention_expired"
    assert again[RECEIPT] == paid[RECEIPT]
    assert again.json()["signed_receipt"] == _receipt(paid)
    assert again.json()["purchase"] == purchase.ref
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1


def test_a_receipt_that_reads_the_block_first_records_what_the_books_need_with_it(
    client, x402_world
):
    """One reader of the settling block (payments.rails.x402.books_evidence): when a receipt needs
    the settlement time first (a facilitator's settlement, a row settled before the books),
    the sender and gas come with it, and the books have nothing left to read."""
    world = x402_world
    ask(client, world, payment=sign_payment(_required(client, world), world.payers[0], PAY_ID))
    PaymentAttempt.objects.update(
        block_at=None, gas_used=None, effective_gas_price=None, sent_by=""
    )
    attempt = PaymentAttempt.objects.get()
    assert attempt.final_at is not None and attempt.tx_hash

    settled_at = settlement_mined_at(attempt=attempt)

    receipt = world.w3.eth.get_transaction_receipt(attempt.tx_hash)
    block = world.w3.eth.get_block(receipt["blockNumber"])
    assert settled_at is not None and int(settled_at.timestamp()) == block["timestamp"]
    stored = PaymentAttempt.objects.get()
    assert (stored.block_at, stored.block_number) == (settled_at, receipt["blockNumber"])
    assert (stored.gas_used, stored.effective_gas_price, stored.sent_by) == (
        receipt["gasUsed"],
        receipt["effectiveGasPrice"],
        world.relayer.address.lower(),
    )
    later = timezone.now() + timedelta(minutes=1)
    assert list(settlements_awaiting_block_time(created_before=later)) == []
