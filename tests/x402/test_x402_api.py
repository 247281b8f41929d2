"""The x402 surface end to end on a real anvil chain: 402, pay, replay, verification."""

from __future__ import annotations

import base64
import json

import pytest
from rest_framework.test import APIClient
from x402.http.utils import decode_payment_required_header, decode_payment_response_header
from x402.schemas import PaymentRequired

from fulfillment.models import Result
from payments.models import PaymentAttempt
from purchases.models import IdempotencyRecord, Offering, Purchase
from purchases.services.fulfil.execution import purchase_execute
from tests.fixtures.anvil import closed_port_url
from tests.x402.e2e import NETWORK, PRICE, ask, sign_payment

# Also run on the embedded SQLite default (`make test`'s second pass): `make demo` serves this.
pytestmark = [pytest.mark.django_db, pytest.mark.embedded]
PAY_ID = "x402-payment-id-000001"


@pytest.fixture
def client() -> APIClient:
    return APIClient()


def required_header(client, world) -> str:
    response = ask(client, world)
    assert response.status_code == 402
    return response["PAYMENT-REQUIRED"]


def test_unpaid_request_gets_402_with_payment_required(client, x402_world):
    response = ask(client, x402_world)
    assert response.status_code == 402
    assert response.json()["code"] == "payment_required"
    required = decode_payment_required_header(response["PAYMENT-REQUIRED"])
    assert isinstance(required, PaymentRequired)
    assert required.x402_version == 2
    assert required.resource is not None
    assert required.resource.url.endswith(x402_world.paid_url)
    (accept,) = required.accepts
    assert (accept.scheme, accept.network, accept.amount) == ("exact", NETWORK, str(PRICE))
    assert accept.asset == x402_world.token
    assert accept.pay_to == x402_world.seller.address
    assert accept.max_timeout_seconds > 0
    assert accept.extra is not None
    assert accept.extra["name"] == "USDC" and accept.extra["version"] == "2"
    assert accept.extra["quote"] == response.json()["quote"]
    assert (required.extensions or {})["payment-identifier"]["info"] == {"required": False}
    assert accept.extra["duplicateWindowSeconds"] == 600


def test_anonymous_402s_hold_no_stock(client, x402_world):
    Offering.objects.filter(pk=x402_world.offering.pk).update(stock=1)
    quotes = {ask(client, x402_world).json()["quote"] for _ in range(5)}
    assert len(quotes) == 5  # fresh each time, and none of them took the one unit
    assert Offering.objects.get(pk=x402_world.offering.pk).stock == 1


def test_pay_settles_once_then_result_with_payment_response(client, x402_world):
    payer = x402_world.payers[0]
    payment = sign_payment(required_header(client, x402_world), payer, PAY_ID)
    first = ask(client, x402_world, payment=payment)
    # Settled on chain; the work is queued (no worker here), so: 202 with the payment proven.
    assert first.status_code == 202, first.content
    settle = decode_payment_response_header(first["PAYMENT-RESPONSE"])
    assert settle.success is True and settle.network == NETWORK
    assert (settle.payer or "").lower() == payer.address.lower()
    assert x402_world.seller_balance() == PRICE
    purchase = Purchase.objects.get()
    assert (purchase.payment_state, purchase.rail) == ("paid", "x402")
    attempt = PaymentAttempt.objects.get()
    assert attempt.tx_hash == settle.transaction.lower()
    # Log searches for this payment start at the block it was verified in, never at 0.
    assert attempt.search_from_block is not None
    assert 0 < attempt.search_from_block <= x402_world.w3.eth.block_number

    purchase_execute(purchase_id=purchase.pk, worker="test")
    again = ask(client, x402_world, payment=payment)  # the same signed payment, resent
    assert again.status_code == 200
    assert again.json()["title"] == "Sales"
    assert (
        decode_payment_response_header(again["PAYMENT-RESPONSE"]).transaction == settle.transaction
    )
    assert x402_world.seller_balance() == PRICE  # still exactly one transfer
    assert x402_world.relayer_sent() == 1
    assert Result.objects.count() == 1
    by_capability = APIClient().get(first["Location"])  # the status URL, no key
    assert by_capability.status_code == 200 and by_capability.content == again.content

    # On the timeline: the broadcast, the resend as a replay, each delivery and its channel.
    timeline = list(purchase.events.order_by("pk"))
    [broadcast] = [e for e in timeline if e.subject == "payment_attempt.broadcast"]
    assert (broadcast.evidence["mode"], broadcast.evidence["tx_hash"]) == (
        "direct",
        attempt.tx_hash,
    )
    assert broadcast.evidence["nonce"] == attempt.authorization_nonce
    assert broadcast.evidence["status"] == "confirmed"
    [replayed] = [e for e in timeline if e.subject == "payment_id.replayed"]
    assert replayed.actor == payer.address.lower()
    deliveries = [
        (e.subject, e.evidence["channel"]) for e in timeline if e.subject.startswith("result.")
    ]
    assert deliveries == [
        ("result.delivered", "x402_paid_url"),
        ("result.redelivered", "capability_url"),
    ]


def test_another_payment_id_on_a_paid_quote_is_refused_before_the_chain(client, x402_world):
    header = required_header(client, x402_world)
    assert (
        ask(
            client, x402_world, payment=sign_payment(header, x402_world.payers[0], PAY_ID)
        ).status_code
        == 202
    )
    refused = ask(
        client,
        x402_world,
        payment=sign_payment(header, x402_world.payers[1], "x402-other-id-0000002"),
    )
    assert refused.status_code == 402
    assert refused.json()["code"] == "quote_already_paid"
    assert refused.json()["purchase"] == Purchase.objects.get().ref
    assert x402_world.seller_balance() == PRICE
    assert x402_world.relayer_sent() == 1


def test_same_payment_id_from_another_payer_is_a_conflict(client, x402_world):
    # A re-signed retry by the same payer is the same request
    # (tests/x402/test_x402_payment_id_retry.py); another payer's is not.
    header = required_header(client, x402_world)
    payer, other = x402_world.payers[:2]
    assert ask(client, x402_world, payment=sign_payment(header, payer, PAY_ID)).status_code == 202
    conflict = ask(client, x402_world, payment=sign_payment(header, other, PAY_ID))
    assert conflict.status_code == 409
    assert conflict.json()["code"] == "payment_identifier_conflict"
    assert x402_world.relayer_sent() == 1


@pytest.mark.parametrize(
    ("tamper", "code"),
    [
        ({"value": PRICE - 1}, "amount_mismatch"),
        ({"value": PRICE + 1}, "amount_mismatch"),
        ({"to": "0x" + "12" * 20}, "recipient_mismatch"),
        ({"valid_before": 1}, "authorization_expired"),
        ({"valid_after": 4_000_000_000}, "authorization_not_yet_valid"),
        ({"signer": "other"}, "invalid_signature"),
        ({"accepted_overrides": {"network": "eip155:84532"}}, "network_mismatch"),
        ({"accepted_overrides": {"amount": "1"}}, "amount_mismatch"),
        ({"accepted_overrides": {"scheme": "upto"}}, "unsupported_scheme"),
    ],
)
def test_verification_failures_have_their_own_code_and_record_nothing(
    client, x402_world, tamper, code
):
    header = required_header(client, x402_world)
    if tamper.get("signer") == "other":
        tamper = {"signer": x402_world.payers[1]}
    response = ask(
        client, x402_world, payment=sign_payment(header, x402_world.payers[0], PAY_ID, **tamper)
    )
    assert response.status_code == 402, response.content
    body = response.json()
    assert body["code"] == code
    assert body["owner"] == "buyer"
    assert not Purchase.objects.exists()
    assert not PaymentAttempt.objects.exists()
    assert x402_world.relayer_sent() == 0
    # The failure is the payment id's stored answer.
    assert ask(
        client, x402_world, payment=sign_payment(header, x402_world.payers[0], PAY_ID, **tamper)
    ).status_code in (402, 409)


def test_a_chain_that_cannot_be_read_at_verification_is_503_with_retry_after(
    client, x402_world, settings
):
    """An outage degrades, it does not fail: the buyer is told when to come back, as for a
    database outage, and nothing is recorded (issue 33: there was no Retry-After)."""
    payment = sign_payment(required_header(client, x402_world), x402_world.payers[0], None)
    unreachable = {**settings.X402_NETWORKS[NETWORK], "rpc_url": closed_port_url()}
    settings.X402_NETWORKS = {**settings.X402_NETWORKS, NETWORK: unreachable}
    response = ask(client, x402_world, payment=payment)
    assert response.status_code == 503, response.content
    assert response.json()["code"] == "verification_unavailable"
    assert response["Retry-After"] == str(settings.TOLLBOOTH["UNAVAILABLE_RETRY_AFTER_SECONDS"])
    assert not PaymentAttempt.objects.exists() and not Purchase.objects.exists()


@pytest.mark.parametrize("payment_id", [None, "x402-payment-id-000042"])
def test_a_refusal_at_another_offering_never_answers_this_one(client, x402_world, payment_id):
    """Whoever sees a payment header must not be able to burn it: sent first to a paid URL
    it does not pay for, it is refused there, and its own offering still takes it (issue 33:
    the stored refusal answered there too, or a 409 conflict with a payment id)."""
    dearer = Offering.objects.get(pk=x402_world.offering.pk)
    dearer.pk, dearer.slug, dearer.price = None, "report-dearer", 2 * PRICE
    dearer.save()
    payment = sign_payment(required_header(client, x402_world), x402_world.payers[0], payment_id)
    body = {"title": "Sales", "csv": "region,units\nnorth,3\n"}
    wrong = client.post(f"/x402/{dearer.slug}", body, format="json", HTTP_PAYMENT_SIGNATURE=payment)
    assert wrong.status_code in (400, 402, 409), wrong.content
    assert not Purchase.objects.exists()
    right = ask(client, x402_world, payment=payment)
    assert right.status_code in (200, 202), right.content
    assert Purchase.objects.get().payment_state == "paid"
    assert x402_world.seller_balance() == PRICE


def test_insufficient_balance_and_used_nonce(client, x402_world):
    broke = x402_world.node.accounts[8]
    header = required_header(client, x402_world)
    payment = sign_payment(header, broke, PAY_ID)
    response = ask(client, x402_world, payment=payment)
    assert response.json()["code"] == "insufficient_balance"
    assert response["Content-Type"] == "application/problem+json"
    replay = ask(client, x402_world, payment=payment)  # the stored answer, byte for byte
    assert replay.status_code == 402 and replay.content == response.content
    assert x402_world.relayer_sent() == 0


def test_malformed_payment_signature_is_a_structured_400(client, x402_world):
    required_header(client, x402_world)
    for garbage in (
        "not base64 !!!",
        base64.b64encode(b"{not json").decode(),
        base64.b64encode(json.dumps({"x402Version": 2}).encode()).decode(),
        base64.b64encode(json.dumps({"x402Version": 1, "scheme": "exact"}).encode()).decode(),
    ):
        response = ask(client, x402_world, payment=garbage)
        assert response.status_code == 400, (garbage, response.content)
        assert response["Content-Type"] == "application/problem+json"
        assert response.json()["code"] == "payment_signature_malformed"
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize("junk", ["!!", ",", "@@"])
def test_valid_base64_with_junk_mixed_in_is_malformed_not_settled(client, x402_world, junk):
    payment = sign_payment(required_header(client, x402_world), x402_world.payers[0], PAY_ID)
    middle = len(payment) // 2
    response = ask(client, x402_world, payment=payment[:middle] + junk + payment[middle:])
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "payment_signature_malformed"
    assert not IdempotencyRecord.objects.exists() and not PaymentAttempt.objects.exists()
    assert x402_world.relayer_sent() == 0 and x402_world.seller_balance() == 0
    # The header as signed still pays.
    assert ask(client, x402_world, payment=payment).status_code == 202


def test_payment_without_identifier_is_accepted(client, x402_world):
    payment = sign_payment(required_header(client, x402_world), x402_world.payers[0], None)
    response = ask(client, x402_world, payment=payment)
    assert response.status_code == 202, response.content
    assert response.json()["payment"]["state"] == "paid"
    assert x402_world.relayer_sent() == 1


def test_api_key_caller_reenters_the_same_quote(x402_world, buyer, make_client):
    client = make_client(buyer)
    first, second = ask(client, x402_world), ask(client, x402_world)
    assert first.json()["quote"] == second.json()["quote"]


def test_authorization_already_used_on_chain_is_refused_before_broadcast(client, x402_world):
    from x402.http.utils import decode_payment_signature_header

    from devtools.test_token import send_transfer_with_authorization

    payer = x402_world.payers[0]
    payment = sign_payment(required_header(client, x402_world), payer, PAY_ID)
    decoded = decode_payment_signature_header(payment)
    # Someone else broadcasts this exact authorization first, and it is mined (automine
    # answers the send before the block exists).
    sent = send_transfer_with_authorization(
        x402_world.w3,
        x402_world.token,
        x402_world.deployer,
        decoded.payload["authorization"],
        decoded.payload["signature"],
    )
    assert x402_world.w3.eth.wait_for_transaction_receipt(sent, timeout=30)["status"] == 1
    response = ask(client, x402_world, payment=payment)
    assert response.status_code == 402
    assert response.json()["code"] == "authorization_used"
    assert response.json()["next_action"] == "look_up_purchase"
    assert not Purchase.objects.exists()
    assert x402_world.relayer_sent() == 0
