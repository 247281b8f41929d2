"""A paid URL settled through an authenticated facilitator (issue 35, part 1), end to end:
the facilitator double requires a CDP key (both kinds), settles on anvil, and refuses a
revoked key. A refusal is the seller's outage: 503 + Retry-After with nothing recorded
before /settle, pending (reconciled on chain) after it, alerted and counted; never a failed
payment. A facilitator's own payment id (Circle) is kept beside the tx hash."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from payments.models import PaymentAttempt
from purchases.models import IdempotencyRecord, OutboxMessage, Purchase, PurchaseEvent
from purchases.services.shared.alerts import facilitator_refused_alert
from tests.x402.e2e import NETWORK, PRICE, ask, sign_payment
from tests.x402.test_facilitator_auth import KEY_ID, KEY_KINDS, refusals

PAY_ID = "x402-facilitator-auth-0001"


def assert_no_credential_anywhere(secret: str, double: Any, *texts: str) -> None:
    """Neither the key nor any token minted with it is on the timeline, in the outbox (the
    alert), in the logs or in an answer."""
    stored = [str(e.evidence) for e in PurchaseEvent.objects.all()]
    stored += [str(m.kwargs) for m in OutboxMessage.objects.all()]
    for text in [*stored, *texts]:
        key_parts = [line[:24] for line in secret.splitlines() if "-----" not in line]
        for needle in [*key_parts, *(t[-40:] for t in double.tokens)]:
            assert needle not in text


def authenticate(world: Any, double: Any, settings: Any, kind: str = "ed25519") -> str:
    """The network settles through the double under CDP's base path, with a CDP key (set as
    X402_LOCAL_FACILITATOR_URL / X402_LOCAL_CDP_API_KEY_ID / _SECRET would set it)."""
    make_key, _ = KEY_KINDS[kind]
    secret, public = make_key()
    double.require_cdp_key(KEY_ID, public)
    settings.X402_NETWORKS[NETWORK]["facilitator_url"] = double.cdp_url
    settings.X402_NETWORKS[NETWORK]["facilitator_auth"] = {
        "cdp_api_key_id": KEY_ID,
        "cdp_api_key_secret": secret,
    }
    return secret


@pytest.mark.parametrize("kind", KEY_KINDS)
def test_a_purchase_settles_through_a_cdp_authenticated_facilitator(
    make_facilitated_world, db, settings, kind, caplog
):
    world, double = make_facilitated_world()
    secret = authenticate(world, double, settings, kind)
    client = APIClient()

    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    with caplog.at_level("DEBUG"):
        answer = ask(client, world, payment=payment)

    assert answer.status_code in (200, 202), answer.content
    assert Purchase.objects.get().payment_state == "paid"
    assert world.seller_balance() == PRICE
    assert (double.calls["verify"], double.calls["settle"]) == (1, 1)  # /verify asked once
    assert len(double.tokens) == 2 and not double.refusals
    assert_no_credential_anywhere(secret, double, caplog.text, answer.content.decode())


def test_a_revoked_key_answers_503_with_nothing_recorded_then_the_same_payment_pays(
    make_facilitated_world, db, settings, caplog
):
    world, double = make_facilitated_world()
    secret = authenticate(world, double, settings)
    double.revoke(KEY_ID)
    counted = refusals(NETWORK, "verify", 401)
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)

    with caplog.at_level("DEBUG"):
        refused = ask(client, world, payment=payment)

    assert refused.status_code == 503, refused.content
    assert refused.json()["code"] == "facilitator_credentials_refused"
    assert refused["Retry-After"] == str(settings.TOLLBOOTH["UNAVAILABLE_RETRY_AFTER_SECONDS"])
    assert not Purchase.objects.exists() and not PaymentAttempt.objects.exists()
    # The payment id was given back, no answer stored under it: the retry starts afresh.
    assert not IdempotencyRecord.objects.exclude(
        recovery_point=IdempotencyRecord.RecoveryPoint.STARTED
    ).exists()
    assert not IdempotencyRecord.objects.exclude(response_status=None).exists()
    assert double.calls["settle"] == 0 and world.seller_balance() == 0
    assert refusals(NETWORK, "verify", 401) == counted + 1
    # An alert names the facilitator and the status (one per hour, however many refusals).
    alert = OutboxMessage.objects.get(job="facilitator_refused_alert")
    assert alert.kwargs["status"] == 401 and alert.kwargs["network"] == NETWORK
    assert alert.kwargs["facilitator"].endswith("/platform/v2/x402")
    assert ask(client, world, payment=payment).status_code == 503
    assert OutboxMessage.objects.filter(job="facilitator_refused_alert").count() == 1
    assert_no_credential_anywhere(secret, double, caplog.text, refused.content.decode())

    double.revoked.clear()  # the seller fixes its key: the buyer's retry pays
    paid = ask(client, world, payment=payment)
    assert paid.status_code in (200, 202), paid.content
    assert Purchase.objects.get().payment_state == "paid"
    assert world.seller_balance() == PRICE


def test_the_refusal_alert_names_the_facilitator_and_the_status(settings, caplog):
    settings.TOLLBOOTH_ALERT_BACKENDS = ["log"]
    with caplog.at_level("WARNING", logger="tollbooth.alerts"):
        assert facilitator_refused_alert(
            network=NETWORK, facilitator="api.cdp.example/platform/v2/x402", endpoint="verify",
            status=403,
        )  # fmt: skip
    record = caplog.records[-1]
    assert record.alert_kind == "facilitator_credentials_refused"
    assert "api.cdp.example/platform/v2/x402" in record.alert_title and "403" in record.alert_title


def test_a_key_refused_at_settle_leaves_the_purchase_pending_never_failed(
    make_facilitated_world, db, settings
):
    """The key is refused between /verify (before recording) and /settle: the payment is
    recorded, and stays unknown, reconciled on chain; fixed, the same authorization pays."""
    world, double = make_facilitated_world(mode="settle_401")
    authenticate(world, double, settings)
    counted = refusals(NETWORK, "settle", 401)
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)

    pending = ask(client, world, payment=payment)

    assert pending.status_code == 202, pending.content
    assert pending.json()["status"] == "settlement_pending"
    assert pending.json()["reason_code"] == "facilitator_refused_credentials"
    assert Purchase.objects.get().payment_state == "settlement_pending"  # never failed
    assert refusals(NETWORK, "settle", 401) == counted + 1
    assert OutboxMessage.objects.get(job="facilitator_refused_alert").kwargs["endpoint"] == "settle"

    double.mode = "ok"  # the key works again: the chain shows the nonce unused, resubmitted
    ask(client, world, payment=payment)
    assert Purchase.objects.get().payment_state == "paid"
    assert double.broadcast_count == 1 and world.seller_balance() == PRICE


def test_a_key_revoked_while_a_settlement_is_pending_does_not_stop_reconciliation(
    make_facilitated_world, db, settings
):
    """Reconciliation reads the chain, not the facilitator: a revoked key cannot make a
    pending payment that did land look unpaid."""
    world, double = make_facilitated_world(mode="settlement_pending")
    authenticate(world, double, settings)
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    pending = ask(client, world, payment=payment)
    assert pending.status_code == 202 and double.broadcast_count == 1
    double.revoke(KEY_ID)

    again = ask(client, world, payment=payment)

    assert again.status_code == 202
    assert Purchase.objects.get().payment_state == "paid"
    assert world.seller_balance() == PRICE


@pytest.mark.parametrize("mode", ["payment_id_202", "payment_id_200"])
def test_a_facilitators_payment_id_is_kept_beside_the_hash_and_reconciled(
    make_facilitated_world, db, settings, mode
):
    world, double = make_facilitated_world(mode=mode)
    authenticate(world, double, settings)
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)

    pending = ask(client, world, payment=payment)

    assert pending.status_code == 202, pending.content
    assert pending.json()["status"] == "settlement_pending"
    attempt = PaymentAttempt.objects.get()
    assert attempt.facilitator_payment_id == double.payment_ids[0]
    assert attempt.tx_hash is None  # the facilitator named no hash
    again = ask(client, world, payment=payment)  # found on chain by (payer, nonce)
    assert again.status_code == 202
    attempt.refresh_from_db()
    assert attempt.state == "succeeded" and attempt.tx_hash == double.broadcasts[0].lower()
    assert attempt.facilitator_payment_id == double.payment_ids[0]  # kept beside it
    # The reconciliation that found it on chain names the facilitator's payment.
    settled = PurchaseEvent.objects.get(subject="payment_attempt", to_state="succeeded")
    assert settled.evidence["facilitator_payment_id"] == double.payment_ids[0]
    assert double.calls["settle"] == 1 and world.seller_balance() == PRICE


def test_a_facilitator_refusing_us_at_verify_records_nothing(make_facilitated_world, db):
    """Before issue 35 any bad /verify answer fell into `facilitator_unavailable` and
    recorded a pending payment: a 401 must record nothing (here: no credentials configured
    for a facilitator that wants a bearer token)."""
    world, double = make_facilitated_world()
    double.require_header("Authorization", "Bearer seller-token")
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)

    refused = ask(client, world, payment=payment)

    assert refused.status_code == 503, refused.content
    assert "Retry-After" in refused
    assert not Purchase.objects.exists() and not PaymentAttempt.objects.exists()
    assert double.calls["settle"] == 0 and world.seller_balance() == 0
