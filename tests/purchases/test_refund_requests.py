"""Refund requests from buyers (issue 33, part 2): asked with an API key or signed by the
paying wallet, polled by the buyer, decided by staff on the existing refund path."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone
from eth_account import Account
from rest_framework.test import APIClient

from core.errors import DomainError
from fulfillment.refund_receipt_signing import refund_receipt_signer
from payments.models import PaymentAttempt, Refund
from payments.refund_request_signing import TYPES, signed_request_sign, typed_data
from payments.services import refund_decide, refund_refundable
from purchases.models import Buyer, OutboxMessage, Purchase, PurchaseEvent, RefundRequest
from purchases.services.remedy.refund_requests import (
    BUYER_REFUND_REQUEST,
    RefundRequestRefused,
    refund_request_approve,
    refund_request_deny,
    refund_request_open,
    refund_requests_assign_to_me,
)
from tests.factories import BuyerFactory, PaymentAttemptFactory, PurchaseFactory
from tests.webhooks.receiver import dead_url
from webhooks import events as webhook_events
from webhooks.models import WebhookEndpoint, WebhookEvent
from webhooks.services import webhook_event_publish

pytestmark = pytest.mark.django_db
PAID = 1_000_000
WALLET = Account.from_key("0x" + "5a" * 32)
OTHER_WALLET = Account.from_key("0x" + "6b" * 32)
KEY = "refund-request-key-0001"


def settled_purchase(*, buyer: Buyer | None = None, payer: str = WALLET.address) -> Purchase:
    purchase = PurchaseFactory.create(executed=True, buyer=buyer, amount=PAID, payer=payer)
    PaymentAttemptFactory.create(purchase=purchase, succeeded=True, payer=payer, amount=PAID)
    return purchase


def url(purchase: Purchase) -> str:
    return f"/api/v1/purchases/{purchase.ref}/refund-requests"


def ask(client: APIClient, purchase: Purchase, amount: int | str, *, key: str = KEY) -> Any:
    body = {"amount": str(amount), "reason": "the report was empty"}
    return client.post(url(purchase), body, format="json", HTTP_IDEMPOTENCY_KEY=key)


def signed_body(purchase: Purchase, *, amount: int = 400_000, signer: Any = WALLET, **fields):
    message = {
        "purchase": purchase.ref,
        "amount": amount,
        "reason": "paid twice for one report",
        "idempotencyKey": "wallet-refund-key-0001",
        "expiry": int(time.time()) + 600,
        **fields,
    }
    return signed_request_sign(message=message, network=purchase.network, private_key=signer.key)


# -- the API key path ------------------------------------------------------------------------


def test_the_payer_opens_a_request_and_polls_it_and_a_replay_is_the_same_request(
    buyer: Buyer, client_for_buyer: APIClient
):
    purchase = settled_purchase(buyer=buyer)
    first = ask(client_for_buyer, purchase, 400_000)
    assert first.status_code == 201, first.content
    body = first.json()
    assert body["id"].startswith("rfr_")
    assert (body["status"], body["decision"], body["amount"], body["channel"]) == (
        "pending",
        None,
        "400000",
        "api_key",
    )
    assert first["Location"] == body["links"]["self"]

    again = ask(client_for_buyer, purchase, 400_000)
    assert again.status_code == 200
    assert again["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == body["id"]
    assert RefundRequest.objects.count() == 1

    polled = client_for_buyer.get(body["links"]["self"])
    assert polled.status_code == 200
    assert polled.json()["status"] == "pending"
    opened = PurchaseEvent.objects.get(purchase=purchase, subject="refund_request")
    assert (opened.to_state, opened.actor_type, opened.actor) == ("open", "agent", buyer.ref)


def test_the_same_key_for_another_request_is_422_and_changes_nothing(
    buyer: Buyer, client_for_buyer: APIClient
):
    purchase = settled_purchase(buyer=buyer)
    assert ask(client_for_buyer, purchase, 400_000).status_code == 201
    changed = ask(client_for_buyer, purchase, 500_000)
    assert changed.status_code == 422
    assert changed.json()["code"] == "idempotency_key_reused"
    assert list(RefundRequest.objects.values_list("amount", flat=True)) == [400_000]


def test_a_second_open_request_is_refused_and_names_the_open_one(
    buyer: Buyer, client_for_buyer: APIClient
):
    purchase = settled_purchase(buyer=buyer)
    first = ask(client_for_buyer, purchase, 100_000).json()
    second = ask(client_for_buyer, purchase, 100_000, key="refund-request-key-0002")
    assert second.status_code == 409
    assert second.json()["code"] == "refund_request_open"
    assert second.json()["refund_request"] == first["id"]
    assert RefundRequest.objects.count() == 1


def test_more_than_charged_less_refunded_is_a_clear_422(buyer: Buyer, client_for_buyer: APIClient):
    purchase = settled_purchase(buyer=buyer)
    attempt = PaymentAttempt.objects.get(purchase=purchase)
    Refund.objects.create(
        purchase=purchase,
        payment_attempt=attempt,
        method=Refund.Method.PAY_BACK,
        amount=300_000,
        asset=attempt.asset,
        network=attempt.network,
        payer=attempt.payer,
        reason_code="support_compensation",
        proposed_by="sam",
    )
    above = ask(client_for_buyer, purchase, 700_001)
    assert above.status_code == 422
    assert (above.json()["code"], above.json()["refundable"]) == (
        "refund_amount_exceeds_refundable",
        "700000",
    )
    assert not RefundRequest.objects.exists()
    assert ask(client_for_buyer, purchase, 700_000).status_code == 201


@pytest.mark.parametrize(
    ("amount", "key", "code", "status"),
    [
        ("-5", KEY, "invalid_request", 400),
        ("1.5", KEY, "invalid_request", 400),
        ("0", KEY, "invalid_request", 400),
        ("9" * 40, KEY, "invalid_request", 400),
        ("100", "short", "idempotency_key_invalid", 400),
    ],
)
def test_hostile_input_is_a_clear_4xx(
    buyer: Buyer, client_for_buyer: APIClient, amount: str, key: str, code: str, status: int
):
    purchase = settled_purchase(buyer=buyer)
    answer = ask(client_for_buyer, purchase, amount, key=key)
    assert (answer.status_code, answer.json()["code"]) == (status, code)
    assert not RefundRequest.objects.exists()


def test_without_an_idempotency_key_it_is_400(buyer: Buyer, client_for_buyer: APIClient):
    purchase = settled_purchase(buyer=buyer)
    answer = client_for_buyer.post(url(purchase), {"amount": "1"}, format="json")
    assert (answer.status_code, answer.json()["code"]) == (400, "idempotency_key_missing")


def test_another_buyer_can_neither_ask_nor_read(
    buyer: Buyer, client_for_buyer: APIClient, make_client: Callable[[Buyer], APIClient]
):
    purchase = settled_purchase(buyer=buyer)
    mine = ask(client_for_buyer, purchase, 100_000).json()
    stranger = make_client(BuyerFactory.create())
    refused = ask(stranger, purchase, 100_000, key="refund-request-key-0003")
    assert (refused.status_code, refused.json()["code"]) == (404, "purchase_not_found")
    read = stranger.get(mine["links"]["self"])
    assert (read.status_code, read.json()["code"]) == (404, "refund_request_not_found")
    assert RefundRequest.objects.count() == 1


def test_an_unpaid_purchase_has_nothing_to_refund(buyer: Buyer, client_for_buyer: APIClient):
    purchase = PurchaseFactory.create(buyer=buyer, settlement_pending=True)
    answer = ask(client_for_buyer, purchase, 1)
    assert (answer.status_code, answer.json()["code"]) == (409, "refund_not_available")


def test_requests_about_one_purchase_are_throttled(
    buyer: Buyer, client_for_buyer: APIClient, settings: Any
):
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "REFUND_REQUEST_RATE": "3/hour"}
    purchase = settled_purchase(buyer=buyer)
    codes = [
        ask(client_for_buyer, purchase, 10**12, key=f"refund-request-key-{n:04d}").status_code
        for n in range(4)
    ]
    assert codes == [422, 422, 422, 429]


# -- the wallet path -------------------------------------------------------------------------


def test_a_request_signed_by_the_payer_is_accepted_without_a_key_and_replays():
    purchase = settled_purchase()
    client = APIClient()
    body = signed_body(purchase)
    answer = client.post(url(purchase), body, format="json")
    assert answer.status_code == 201, answer.content
    document = answer.json()
    assert (document["channel"], document["requested_by"], document["amount"]) == (
        "wallet_signature",
        WALLET.address,
        "400000",
    )
    request = RefundRequest.objects.get()
    assert request.signature == body["signature"]
    assert request.signed_message["idempotencyKey"] == "wallet-refund-key-0001"

    again = client.post(url(purchase), body, format="json")
    assert (again.status_code, again.json()["id"]) == (200, document["id"])
    # Polled without a key: the unguessable request id is the capability.
    assert client.get(document["links"]["self"]).json()["status"] == "pending"


def test_a_signature_by_another_wallet_is_refused():
    purchase = settled_purchase()
    answer = APIClient().post(
        url(purchase), signed_body(purchase, signer=OTHER_WALLET), format="json"
    )
    assert (answer.status_code, answer.json()["code"]) == (403, "refund_request_signature_invalid")
    assert not RefundRequest.objects.exists()


def test_a_tampered_message_is_refused():
    purchase = settled_purchase()
    body = signed_body(purchase, amount=100)
    body["payload"]["amount"] = str(PAID)  # signed for 100, sent for all of it
    answer = APIClient().post(url(purchase), body, format="json")
    assert (answer.status_code, answer.json()["code"]) == (403, "refund_request_signature_invalid")
    assert not RefundRequest.objects.exists()


def test_an_expired_or_far_future_signed_request_is_refused():
    purchase = settled_purchase()
    client = APIClient()
    past = signed_body(purchase, expiry=int(time.time()) - 1)
    answer = client.post(url(purchase), past, format="json")
    assert (answer.status_code, answer.json()["code"]) == (400, "refund_request_expired")
    far = signed_body(purchase, expiry=int(time.time()) + 30 * 24 * 3600)
    answer = client.post(url(purchase), far, format="json")
    assert (answer.status_code, answer.json()["code"]) == (400, "refund_request_expired")
    assert not RefundRequest.objects.exists()


def test_a_request_signed_for_another_purchase_is_refused():
    purchase, other = settled_purchase(), settled_purchase()
    answer = APIClient().post(url(purchase), signed_body(other), format="json")
    assert (answer.status_code, answer.json()["code"]) == (400, "invalid_request")
    assert not RefundRequest.objects.exists()


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"payload": "x", "signature": "0x00"},
        {"payload": {"purchase": "p"}, "signature": "0x" + "00" * 65},
        [1, 2],
    ],
)
def test_a_malformed_signed_body_is_400(body: Any):
    purchase = settled_purchase()
    answer = APIClient().post(url(purchase), body, format="json")
    assert (answer.status_code, answer.json()["code"]) == (400, "invalid_request")


def test_the_documented_typed_data_is_what_a_wallet_signs():
    """eth-account's own encoder over docs/api.md's typed data recovers the same signer as
    our verifier: a wallet's eth_signTypedData_v4 of it is accepted."""
    purchase = settled_purchase()
    message = {
        "purchase": purchase.ref,
        "amount": 5,
        "reason": "",
        "idempotencyKey": "wallet-refund-key-0009",
        "expiry": int(time.time()) + 60,
    }
    signed = Account.sign_typed_data(
        WALLET.key, full_message=typed_data(network=purchase.network, message=message)
    )
    body = {
        "payload": {**message, "amount": "5"},
        "signature": "0x" + bytes(signed.signature).hex(),
    }
    assert APIClient().post(url(purchase), body, format="json").status_code == 201


def test_docs_api_md_prints_the_typed_data_the_code_verifies():
    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    blocks = [b for b in re.findall(r"```json\n(.*?)```", text, re.S) if "RefundRequest" in b]
    assert len(blocks) == 1
    printed = json.loads(blocks[0])
    assert printed["types"] == TYPES
    assert printed["primaryType"] == "RefundRequest"
    assert {k: printed["domain"][k] for k in ("name", "version")} == {
        "name": "Tollbooth refund request",
        "version": "1",
    }
    assert (
        printed["domain"]["chainId"]
        == typed_data(network="eip155:84532", message={})["domain"]["chainId"]
    )


# -- staff decide --------------------------------------------------------------------------


def open_request(buyer: Buyer, client: APIClient, amount: int = 400_000) -> RefundRequest:
    purchase = settled_purchase(buyer=buyer)
    assert ask(client, purchase, amount).status_code == 201
    return RefundRequest.objects.get(purchase=purchase)


def test_approving_feeds_the_refund_proposal_that_finance_approves_to_the_payer(
    buyer: Buyer, client_for_buyer: APIClient
):
    request = open_request(buyer, client_for_buyer)
    refund_request_approve(request_id=request.pk, staff="sam-support", note="empty report")
    request.refresh_from_db()
    refund = Refund.objects.get()
    assert request.state == RefundRequest.State.APPROVED
    assert request.refund_id == refund.pk
    assert (refund.state, refund.amount, refund.reason_code, refund.payer) == (
        Refund.State.PROPOSED,
        400_000,
        BUYER_REFUND_REQUEST,
        WALLET.address,
    )
    polled = client_for_buyer.get(f"{url(request.purchase)}/{request.public_id}").json()
    assert (polled["status"], polled["decision"]) == ("pending", "approved")

    refund_decide(refund_id=refund.pk, approve=True, by="fay", buyer_id=None, now=timezone.now())
    polled = client_for_buyer.get(f"{url(request.purchase)}/{request.public_id}").json()
    assert (polled["status"], polled["refund"]["state"], polled["refund"]["destination"]) == (
        "pending",
        "owed",
        WALLET.address,
    )
    subjects = list(
        PurchaseEvent.objects.filter(purchase=request.purchase, subject__startswith="refund")
        .order_by("pk")
        .values_list("subject", "to_state", "actor")
    )
    assert subjects == [
        ("refund_request", "open", buyer.ref),
        ("refund", "proposed", "sam-support"),
        ("refund_request", "approved", "sam-support"),
    ]


def test_a_paid_refund_is_executed_for_the_buyer(buyer: Buyer, client_for_buyer: APIClient):
    request = open_request(buyer, client_for_buyer)
    refund_request_approve(request_id=request.pk, staff="sam-support")
    refund = Refund.objects.get()
    # A prepaid-like close by reference: the chain path is tested with payouts.
    Refund.objects.filter(pk=refund.pk).update(
        state=Refund.State.PAID, paid_reference="0x" + "ab" * 32, paid_at=timezone.now()
    )
    polled = client_for_buyer.get(f"{url(request.purchase)}/{request.public_id}").json()
    assert polled["status"] == "executed"
    assert polled["refund"]["reference"] == "0x" + "ab" * 32
    # The signed refund receipt: by the published receipt key, the same bytes at every read,
    # and any changed field no longer recovers to it.
    receipt = polled["refund_receipt"]
    published = APIClient().get("/.well-known/tollbooth-receipts").json()
    assert refund_receipt_signer(receipt) in {k["address"] for k in published["keys"]}
    assert published["refundReceipt"]["primaryType"] == "RefundReceipt"
    assert receipt["payload"]["amount"] == "400000"
    assert receipt["payload"]["payer"] == WALLET.address
    assert receipt["payload"]["refundRequest"] == request.public_id
    again = client_for_buyer.get(f"{url(request.purchase)}/{request.public_id}").json()
    assert again["refund_receipt"] == receipt
    forged = {**receipt, "payload": {**receipt["payload"], "amount": "900000"}}
    assert refund_receipt_signer(forged) not in {k["address"] for k in published["keys"]}


def test_a_pending_request_has_no_refund_receipt(buyer: Buyer, client_for_buyer: APIClient):
    request = open_request(buyer, client_for_buyer)
    refund_request_approve(request_id=request.pk, staff="sam-support")
    polled = client_for_buyer.get(f"{url(request.purchase)}/{request.public_id}").json()
    assert (polled["status"], polled["refund_receipt"]) == ("pending", None)


def test_denying_gives_the_buyer_the_reason_code(buyer: Buyer, client_for_buyer: APIClient):
    request = open_request(buyer, client_for_buyer)
    refund_request_deny(
        request_id=request.pk, staff="sam-support", code="delivered_as_described", note="ok"
    )
    polled = client_for_buyer.get(f"{url(request.purchase)}/{request.public_id}").json()
    assert (polled["status"], polled["reason_code"]) == ("denied", "delivered_as_described")
    assert polled["reason_message"] == RefundRequest.DENIAL_CODES["delivered_as_described"]
    assert not Refund.objects.exists()
    # Decided: a new request may be opened, and a second decision is refused.
    assert (
        ask(client_for_buyer, request.purchase, 1, key="refund-request-key-0005").status_code == 201
    )
    with pytest.raises(RefundRequestRefused, match="already denied"):
        refund_request_approve(request_id=request.pk, staff="sam-support")


def test_an_unknown_denial_code_is_refused(buyer: Buyer, client_for_buyer: APIClient):
    request = open_request(buyer, client_for_buyer)
    with pytest.raises(RefundRequestRefused, match="not a denial code"):
        refund_request_deny(request_id=request.pk, staff="sam", code="because")
    request.refresh_from_db()
    assert request.state == RefundRequest.State.OPEN


def test_finance_declining_the_proposal_is_denied_for_the_buyer(
    buyer: Buyer, client_for_buyer: APIClient
):
    request = open_request(buyer, client_for_buyer)
    refund_request_approve(request_id=request.pk, staff="sam-support")
    refund = Refund.objects.get()
    refund_decide(refund_id=refund.pk, approve=False, by="fay", buyer_id=None, now=timezone.now())
    polled = client_for_buyer.get(f"{url(request.purchase)}/{request.public_id}").json()
    assert (polled["status"], polled["reason_code"]) == ("denied", "refund_declined")
    assert refund_refundable(attempt_id=refund.payment_attempt_id) == (PAID, PAID)


def test_approval_rechecks_what_is_left_to_refund(buyer: Buyer, client_for_buyer: APIClient):
    request = open_request(buyer, client_for_buyer, amount=PAID)
    attempt = PaymentAttempt.objects.get(purchase=request.purchase)
    Refund.objects.create(
        purchase=request.purchase,
        payment_attempt=attempt,
        method=Refund.Method.PAY_BACK,
        amount=1,
        asset=attempt.asset,
        network=attempt.network,
        payer=attempt.payer,
        reason_code="duplicate_settlement",
    )
    with pytest.raises(RefundRequestRefused, match="still refundable"):
        refund_request_approve(request_id=request.pk, staff="sam-support")
    request.refresh_from_db()
    assert request.state == RefundRequest.State.OPEN
    assert Refund.objects.count() == 1


def test_assign_to_me_is_on_the_timeline(buyer: Buyer, client_for_buyer: APIClient):
    request = open_request(buyer, client_for_buyer)
    assert refund_requests_assign_to_me(request_ids=[request.pk], staff="sam") == 1
    assert refund_requests_assign_to_me(request_ids=[request.pk], staff="sam") == 0
    request.refresh_from_db()
    assert request.assignee == "sam"
    assert PurchaseEvent.objects.filter(subject="refund_request.assigned").count() == 1
    assert request.deadline_at - request.created_at == pytest.approx(
        timedelta(hours=48), abs=timedelta(seconds=5)
    )


# -- webhooks --------------------------------------------------------------------------------


@pytest.fixture
def subscribed(monkeypatch: pytest.MonkeyPatch) -> WebhookEndpoint:
    monkeypatch.setenv("TOLLBOOTH_TEST_WEBHOOK_SECRET", "whsec-test-current-0123456789")
    made = WebhookEndpoint(
        url=dead_url(),
        secret_env="TOLLBOOTH_TEST_WEBHOOK_SECRET",
        key_id="k1",
        event_types=["refund_request.opened", "refund_request.decided"],
    )
    made.full_clean()
    made.save()
    webhook_events.subscriptions_forget()
    return made


def test_opened_and_decided_are_webhook_events_written_with_the_change(
    buyer: Buyer, client_for_buyer: APIClient, subscribed: WebhookEndpoint
):
    request = open_request(buyer, client_for_buyer)
    opened = WebhookEvent.objects.get(purchase=request.purchase)
    assert (opened.type, opened.sequence) == ("refund_request.opened", 1)
    assert OutboxMessage.objects.filter(
        job="webhook_event_publish", kwargs={"event_id": opened.pk}
    ).exists()

    refund_request_deny(request_id=request.pk, staff="sam", code="not_eligible")
    decided = WebhookEvent.objects.get(purchase=request.purchase, type="refund_request.decided")
    assert (decided.sequence, decided.reason_code) == (2, "not_eligible")
    webhook_event_publish(event_id=decided.pk)
    decided.refresh_from_db()
    assert decided.body is not None
    assert decided.body["purchase"] == request.purchase.ref
    assert decided.body["refund_request"]["id"] == request.public_id
    assert decided.body["refund_request"]["reason_code"] == "not_eligible"


def test_a_request_rolled_back_writes_no_event(
    buyer: Buyer, client_for_buyer: APIClient, subscribed: WebhookEndpoint
):
    purchase = settled_purchase(buyer=buyer)
    with pytest.raises(RuntimeError), transaction.atomic():
        refund_request_open(
            purchase_id=purchase.pk,
            channel=RefundRequest.Channel.API_KEY,
            requested_by=buyer.ref,
            amount=5,
            reason="",
            idempotency_key=KEY,
        )
        raise RuntimeError("the caller's transaction fails after the request")
    assert not RefundRequest.objects.exists()
    assert not WebhookEvent.objects.exists()
    assert not OutboxMessage.objects.filter(job="webhook_event_publish").exists()


# -- races (PostgreSQL only: two transactions queued on the purchase's row lock) -------------


def _waiting_on_locks() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()"
        )
        return int(cursor.fetchone()[0])


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("keys", "outcomes"),
    [
        (("race-refund-key-000001", "race-refund-key-000002"), ["created", "refund_request_open"]),
        (("race-refund-key-000001", "race-refund-key-000001"), ["created", "replayed"]),
    ],
)
def test_two_requests_racing_open_one(keys: tuple[str, str], outcomes: list[str]) -> None:
    """Both reach the check while the test holds the purchase's row: with the service's lock
    the second sees the first's request (refused, or replayed for the same key); without
    it both would find none open and both be written."""
    buyer = BuyerFactory.create()
    purchase = settled_purchase(buyer=buyer)
    seen: list[str] = []
    connected = threading.Barrier(3)

    def open_one(key: str) -> None:
        try:
            connection.ensure_connection()
            connected.wait(timeout=60)
            opened = refund_request_open(
                purchase_id=purchase.pk,
                channel=RefundRequest.Channel.API_KEY,
                requested_by=buyer.ref,
                amount=100,
                reason="",
                idempotency_key=key,
            )
            seen.append("created" if opened.created else "replayed")
        except DomainError as refused:
            seen.append(refused.code.value)
        finally:
            connection.close()

    threads = [threading.Thread(target=open_one, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    with transaction.atomic():
        Purchase.objects.select_for_update().get(pk=purchase.pk)
        connected.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _waiting_on_locks() < 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # polling the database for both to queue, not timing them
        queued = _waiting_on_locks()
    for thread in threads:
        thread.join(timeout=30)
    assert queued == 2
    assert sorted(seen) == outcomes
    assert RefundRequest.objects.filter(purchase=purchase).count() == 1


def test_the_evidence_pack_carries_the_request_without_staff_names():
    from backoffice.evidence_pack import evidence_content
    from core.canonical import sha256_hex

    purchase = settled_purchase()
    body = signed_body(purchase)
    assert APIClient().post(url(purchase), body, format="json").status_code == 201
    request = RefundRequest.objects.get()
    refund_request_deny(
        request_id=request.pk, staff="sam-support", code="not_eligible", note="internal-note"
    )
    content = evidence_content(purchase=purchase, now=timezone.now())
    (carried,) = content["refundRequests"]
    assert (carried["id"], carried["status"], carried["reasonCode"]) == (
        request.public_id,
        "denied",
        "not_eligible",
    )
    assert carried["signedMessage"]["idempotencyKey"] == "wallet-refund-key-0001"
    assert carried["signatureSha256"] == sha256_hex(body["signature"])
    assert "internal-note" not in json.dumps(carried)
    text = json.dumps(content)
    assert "sam-support" not in text  # staff names stay with the seller
    assert body["signature"] not in text  # its SHA-256 stands for it, here and on the timeline
