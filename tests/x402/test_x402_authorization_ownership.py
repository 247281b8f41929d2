"""One authorization pays one purchase, a keyed quote is paid only by its buyer, and a
reconciliation batch survives a row it cannot process. Real anvil chain, real PostgreSQL."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import requests
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient
from x402.http.utils import (
    decode_payment_required_header,
    decode_payment_signature_header,
    encode_payment_signature_header,
)
from x402.schemas import PaymentPayload, PaymentRequired

from core.errors import DomainError, ErrorCode
from payments.models import PaymentAttempt
from payments.rails import QuoteTerms
from payments.rails.x402.rail import X402Rail, x402_presentation
from purchases.models import BuyerWallet, Escalation, JobRun, Purchase
from purchases.services.jobs import reconcile
from tests.x402.e2e import PRICE, sign_payment

INPUT_A = {"title": "A", "csv": "region,units\nnorth,3\n"}
INPUT_B = {"title": "B", "csv": "region,units\nsouth,5\n"}


def _same_authorization_for(payment: str, other_required: str, payment_id: str) -> str:
    """The very same signed authorization, presented for another quote under another id."""
    document = decode_payment_signature_header(payment)
    required = decode_payment_required_header(other_required)
    assert isinstance(document, PaymentPayload) and isinstance(required, PaymentRequired)
    document.accepted = required.accepts[0]
    document.extensions = {"payment-identifier": {"info": {"required": False, "id": payment_id}}}
    return encode_payment_signature_header(document)


@pytest.mark.django_db
def test_a_second_presentation_is_refused_naming_the_first_purchase(x402_world):
    world, client = x402_world, APIClient()
    first_required = client.post(world.paid_url, INPUT_A, format="json")["PAYMENT-REQUIRED"]
    other_required = client.post(world.paid_url, INPUT_B, format="json")["PAYMENT-REQUIRED"]
    payment = sign_payment(first_required, world.payers[0], "first-presentation-000001")
    paid = client.post(world.paid_url, INPUT_A, format="json", HTTP_PAYMENT_SIGNATURE=payment)
    assert paid.status_code == 202

    again = _same_authorization_for(payment, other_required, "second-presentation-00002")
    for _ in range(2):  # every resend gets the same clear answer, never a 500
        refused = client.post(world.paid_url, INPUT_B, format="json", HTTP_PAYMENT_SIGNATURE=again)
        assert refused.status_code == 409, refused.content
        assert refused.json()["code"] == "authorization_in_use"
        assert refused.json()["purchase"] == paid.json()["purchase"]
    assert PaymentAttempt.objects.count() == 1 and Purchase.objects.count() == 1
    assert world.relayer_sent() == 1 and world.seller_balance() == PRICE


@pytest.mark.django_db
def test_a_presentation_that_passed_verify_before_the_first_landed_is_refused_naming_it(
    x402_world,
):
    """The window two replicas hit: the second presentation passed `verify` (no attempt
    held the authorization yet), then the first one's transfer landed before the second
    read the chain. The spent nonce is ours: in flight, naming the purchase, never a stored
    402 authorization_used."""
    world, client = x402_world, APIClient()
    first_required = client.post(world.paid_url, INPUT_A, format="json")["PAYMENT-REQUIRED"]
    other_required = client.post(world.paid_url, INPUT_B, format="json")["PAYMENT-REQUIRED"]
    payment = sign_payment(first_required, world.payers[0], "first-presentation-000001")
    paid = client.post(world.paid_url, INPUT_A, format="json", HTTP_PAYMENT_SIGNATURE=payment)
    assert paid.status_code == 202 and world.relayer_sent() == 1
    again = x402_presentation(
        header=_same_authorization_for(payment, other_required, "second-presentation-00002")
    )
    # The other quote is anonymous and unwritten (its terms are in its 402): the same terms.
    offering = world.offering
    terms = QuoteTerms(
        quote_id=str(again.quote_id),
        network=offering.network,
        asset=offering.asset,
        amount=offering.price,
        pay_to=offering.pay_to,
        duplicate_window_seconds=int(offering.duplicate_window.total_seconds()),
    )

    with pytest.raises(DomainError) as refused:
        X402Rail().verify_funds(presentation=again, terms=terms)

    assert refused.value.code == ErrorCode.AUTHORIZATION_IN_USE
    assert refused.value.purchase == paid.json()["purchase"]
    # A nonce spent by nobody we know stays what it was: the buyer must sign anew.
    PaymentAttempt.objects.all().delete()
    with pytest.raises(DomainError) as used:
        X402Rail().verify_funds(presentation=again, terms=terms)
    assert used.value.code == ErrorCode.AUTHORIZATION_USED


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_one_authorization_under_two_ids_for_two_quotes_at_once(x402_live_world, http_server):
    world = x402_live_world
    url = f"{http_server}{world.paid_url}"
    first_required = requests.post(url, json=INPUT_A, timeout=10).headers["PAYMENT-REQUIRED"]
    other_required = requests.post(url, json=INPUT_B, timeout=10).headers["PAYMENT-REQUIRED"]
    payment_a = sign_payment(first_required, world.payers[0], "race-presentation-00000a")
    payment_b = _same_authorization_for(payment_a, other_required, "race-presentation-00000b")
    barrier = threading.Barrier(2)
    answers: dict[str, requests.Response] = {}

    def send(name: str, payment: str, body: dict) -> None:
        barrier.wait()
        try:
            answers[name] = requests.post(
                url, json=body, headers={"PAYMENT-SIGNATURE": payment}, timeout=60
            )
        finally:
            connection.close()

    threads = [
        threading.Thread(target=send, args=("a", payment_a, INPUT_A)),
        threading.Thread(target=send, args=("b", payment_b, INPUT_B)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    statuses = sorted(answer.status_code for answer in answers.values())
    assert statuses == [202, 409], {k: v.text for k, v in answers.items()}
    (purchase,) = Purchase.objects.all()
    for name, payment, body in (("a", payment_a, INPUT_A), ("b", payment_b, INPUT_B)):
        resent = requests.post(url, json=body, headers={"PAYMENT-SIGNATURE": payment}, timeout=60)
        assert resent.status_code in (202, 409) and resent.json()["purchase"] == purchase.ref
        assert resent.status_code == answers[name].status_code
    assert PaymentAttempt.objects.count() == 1
    assert world.relayer_sent() == 1 and world.seller_balance() == PRICE


@pytest.mark.django_db
def test_a_keyed_quote_is_paid_only_by_its_buyer(x402_world, buyer, make_client):
    from tests.factories import BuyerFactory

    world = x402_world
    owner = make_client(buyer)
    required = owner.post(world.paid_url, INPUT_A, format="json")["PAYMENT-REQUIRED"]
    stranger_key = make_client(BuyerFactory.create())

    for client, payer in ((APIClient(), world.payers[1]), (stranger_key, world.payers[2])):
        payment = sign_payment(required, payer, None)
        refused = client.post(
            world.paid_url, INPUT_A, format="json", HTTP_PAYMENT_SIGNATURE=payment
        )
        assert refused.status_code == 404 and refused.json()["code"] == "quote_not_found"
    assert world.relayer_sent() == 0 and not Purchase.objects.exists()

    # Without a key, a wallet registered to the quote's buyer may pay it: the purchase is theirs.
    BuyerWallet.objects.create(buyer=buyer, address=world.payers[0].address.lower())
    payment = sign_payment(required, world.payers[0], None)
    paid = APIClient().post(world.paid_url, INPUT_A, format="json", HTTP_PAYMENT_SIGNATURE=payment)
    assert paid.status_code == 202 and Purchase.objects.get().buyer == buyer


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_row_the_job_cannot_read_never_stalls_the_batch(make_x402_world):
    world = make_x402_world(no_mining=True)
    node = world.node
    client = APIClient()
    refs = []
    for payer, body in ((world.payers[0], INPUT_A), (world.payers[1], INPUT_B)):
        payment = sign_payment(
            client.post(world.paid_url, body, format="json")["PAYMENT-REQUIRED"], payer, None
        )
        pending = client.post(world.paid_url, body, format="json", HTTP_PAYMENT_SIGNATURE=payment)
        assert pending.status_code == 202
        refs.append(pending.json()["purchase"])
    node.mine()
    broken = PaymentAttempt.objects.get(purchase__ref=refs[0])
    PaymentAttempt.objects.filter(pk=broken.pk).update(authorization={"garbled": True})

    start = timezone.now() + timedelta(minutes=9)
    for later in (start, start + timedelta(minutes=6)):  # each pass: recorded, batch goes on
        stats = reconcile.reconcile_pending_settlements(now=later)
    assert Purchase.objects.get(ref=refs[1]).payment_state == "paid"
    assert stats["row_errors"] == 1 and stats[f"failed:attempt:{broken.pk}"] == 1
    escalation = Escalation.objects.get(purchase__ref=refs[0])
    assert (escalation.owner, escalation.reason_code) == (
        "support",
        "reconciliation_row_failed",
    )
    assert not JobRun.objects.exclude(error="").exists()
