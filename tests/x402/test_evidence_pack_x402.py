"""The dispute evidence pack of x402 purchases on a real anvil chain (issue 33, part 3): the
settlement's transaction, block, time and finality as the chain shows them, the
authorization's terms without its signature, the signed receipt; a refund paid back on
chain with its payback transaction and block; a facilitator's payment id, never its key."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import transaction
from django.utils import timezone
from rest_framework.test import APIClient

from core.actors import Actor
from fulfillment.receipt_signing import receipt_verify
from payments.models import PaymentAttempt
from purchases import event_subjects
from purchases.models import Purchase
from purchases.services.fulfil.execution import purchase_execute
from purchases.services.remedy.paybacks import purchase_refund_payback_close
from purchases.services.remedy.remedies import purchase_refund_create
from tests.reconciliation.test_refund_paybacks import fund_seller, send_transfer
from tests.x402.e2e import NETWORK, PRICE, X402World, ask, sign_payment
from tests.x402.test_facilitator_auth import KEY_ID
from tests.x402.test_x402_facilitator_auth import authenticate

pytestmark = [pytest.mark.django_db]
PAY_ID = "x402-evidence-id-000001"


def _published() -> list[str]:
    keys = APIClient().get("/.well-known/tollbooth-receipts").json()["keys"]
    return [key["address"] for key in keys]


def _paid_delivered_final(client: APIClient, world: X402World, settings) -> Purchase:
    settings.X402_NETWORKS = {
        **settings.X402_NETWORKS,
        NETWORK: {**world.network_settings, "finality": "depth", "finality_depth": 3},
    }
    required = ask(client, world)
    assert required.status_code == 402
    payment = sign_payment(str(required["PAYMENT-REQUIRED"]), world.payers[0], PAY_ID)
    ask(client, world, payment=payment)
    purchase = Purchase.objects.get()
    purchase_execute(purchase_id=purchase.pk, worker="test")
    world.node.mine(2)
    final = ask(client, world, payment=payment)  # the result, final: the receipt issued
    assert final.status_code == 200 and "Tollbooth-Receipt" in final
    return purchase


def _export(purchase: Purchase, tmp_path: Path) -> tuple[str, dict]:
    out = tmp_path / "pack.json"
    call_command("evidence_export", purchase.ref, "--out", str(out), "--by", "sam-support",
                 stderr=StringIO())  # fmt: skip
    verified = StringIO()
    call_command("evidence_verify", str(out), "--address", _published()[0], stdout=verified)
    assert "valid: signed by" in verified.getvalue()
    text = out.read_text()
    return text, json.loads(text)


def test_a_paid_and_delivered_x402_purchase_pack_holds_the_chain_evidence(
    make_x402_world, settings, tmp_path
):
    world = make_x402_world()
    purchase = _paid_delivered_final(APIClient(), world, settings)
    attempt = PaymentAttempt.objects.get()
    mined = world.w3.eth.get_transaction_receipt(attempt.tx_hash)
    block = world.w3.eth.get_block(mined["blockNumber"])

    text, pack = _export(purchase, tmp_path)

    content = pack["content"]
    [paid] = content["payment"]["attempts"]
    assert (paid["rail"], paid["state"], paid["txHash"]) == ("x402", "succeeded", attempt.tx_hash)
    assert paid["blockNumber"] == mined["blockNumber"]
    assert paid["blockAt"] == datetime.fromtimestamp(block["timestamp"], tz=UTC).isoformat()
    assert paid["finalAt"] is not None and paid["reorgedAt"] is None
    assert (paid["amount"], paid["asset"], paid["network"]) == (str(PRICE), world.token, NETWORK)
    terms = paid["authorization"]["terms"]
    assert terms["from"].lower() == world.payers[0].address.lower()
    assert terms["nonce"] == attempt.authorization_nonce
    assert terms["value"] == str(PRICE)
    assert attempt.authorization is not None
    signature = attempt.authorization["signature"]
    assert (
        paid["authorization"]["signatureSha256"] == hashlib.sha256(signature.encode()).hexdigest()
    )
    assert signature.removeprefix("0x") not in text
    assert PAY_ID not in text  # the buyer's payment id is never in clear, as on receipts
    assert content["paidBy"]["payer"].lower() == world.payers[0].address.lower()
    assert content["sold"]["quote"]["payTo"].lower() == world.offering.pay_to.lower()
    receipt = content["receipt"]["signed"]
    receipt_verify(receipt, addresses=_published())
    assert receipt["payload"]["transaction"] == attempt.tx_hash
    assert receipt["payload"]["settledAt"] == int(block["timestamp"])
    assert content["work"]["result"]["sha256"] == receipt["payload"]["resultSha256"]
    subjects = [row["subject"] for row in content["timeline"]]
    for subject in (
        event_subjects.PAYMENT_BROADCAST,
        event_subjects.PAYMENT_FINAL,
        event_subjects.RESULT_DELIVERED,
        event_subjects.RECEIPT_ISSUED,
    ):
        assert subject in subjects, subject


def test_a_refunded_x402_purchase_pack_holds_the_payback_on_chain(
    make_x402_world, settings, tmp_path
):
    world = make_x402_world()
    purchase = _paid_delivered_final(APIClient(), world, settings)
    attempt = PaymentAttempt.objects.get()
    with transaction.atomic():
        refund = purchase_refund_create(
            purchase=purchase,
            attempt=attempt,
            reason_code="goodwill",
            now=timezone.now(),
            actor=Actor.staff("fay-finance"),
        )
    fund_seller(world)
    payback = send_transfer(world, world.seller, world.payers[0].address, PRICE)
    world.node.mine(2)  # final at depth 3: closed at once, not pending
    purchase_refund_payback_close(
        refund_id=refund.pk, tx_hash=payback, now=None, actor=Actor.staff("fay-finance")
    )
    mined = world.w3.eth.get_transaction_receipt(payback)

    text, pack = _export(purchase, tmp_path)

    [refunded] = pack["content"]["refunds"]
    assert (refunded["method"], refunded["state"], refunded["amount"]) == (
        "pay_back",
        "paid",
        str(PRICE),
    )
    assert refunded["refundedTransaction"] == attempt.tx_hash
    assert refunded["payback"]["txHash"] == payback
    assert refunded["payback"]["blockNumber"] == mined["blockNumber"]
    assert refunded["paidReference"] == payback
    assert "fay-finance" not in text  # staff names stay with the seller
    paid_back = [
        row
        for row in pack["content"]["timeline"]
        if row["subject"] == event_subjects.REFUND and row["to"] == "paid"
    ]
    assert [row["evidence"]["tx_hash"] for row in paid_back] == [payback]


def test_a_facilitated_purchase_pack_names_the_facilitators_payment_not_its_credentials(
    make_facilitated_world, settings, tmp_path
):
    world, double = make_facilitated_world(mode="payment_id_202")
    secret = authenticate(world, double, settings)
    client = APIClient()
    payment = sign_payment(str(ask(client, world)["PAYMENT-REQUIRED"]), world.payers[0], PAY_ID)
    assert ask(client, world, payment=payment).status_code == 202  # pending, no hash yet
    ask(client, world, payment=payment)  # found on chain by (payer, nonce)
    attempt = PaymentAttempt.objects.get()
    assert attempt.state == "succeeded"

    text, pack = _export(attempt.purchase, tmp_path)

    [paid] = pack["content"]["payment"]["attempts"]
    assert paid["facilitatorPaymentId"] == double.payment_ids[0]
    assert paid["txHash"] == double.broadcasts[0].lower()
    assert secret not in text and KEY_ID not in text
