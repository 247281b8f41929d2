"""A signed authorization that never reached the chain is submitted again, the same one,
a bounded number of times with backoff, each try on the timeline (issue 8 item 6).

Real anvil chain, real HTTP facilitator double. Time between polls is injected: the
request path reads the clock, so the attempt's timestamps are moved back instead.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db.models import F
from eth_account import Account
from rest_framework.test import APIClient

from devtools.facilitator_double import FacilitatorDouble
from payments.models import PaymentAttempt
from payments.rails.x402.relayer import relayer_fee_fields
from purchases.models import Escalation, Purchase, PurchaseEvent
from purchases.services.jobs.reconcile import reconcile_pending_settlements
from tests.x402.e2e import PRICE, X402World, ask, sign_payment

# Also run on the embedded SQLite default (`make test`'s second pass): `make demo` serves this.
pytestmark = pytest.mark.embedded

PAY_ID = "x402-resubmit-id-0000001"
RESUBMITTED = "payment_attempt.resubmitted"
REFUSED = "payment_attempt.resubmit_refused"
BROADCAST = "payment_attempt.broadcast"
DROPPED = "payment_attempt.dropped"
ANSWERED = "facilitator.answered"


def _pay(world: X402World, client: APIClient, **sign: Any) -> str:
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID, **sign)
    first = ask(client, world, payment=payment)
    assert first.status_code == 202, first.content
    assert first.json()["status"] == "settlement_pending"
    return payment


def _age(seconds: int) -> None:
    """As if the buyer came back `seconds` later: the last submission moves into the past."""
    delta = timedelta(seconds=seconds)
    PaymentAttempt.objects.update(
        broadcast_started_at=F("broadcast_started_at") - delta,
        resubmitted_at=F("resubmitted_at") - delta,
    )


def _events(subject: str) -> list[PurchaseEvent]:
    return list(PurchaseEvent.objects.filter(subject=subject).order_by("pk"))


def _authorizations_sent(double: FacilitatorDouble) -> set[tuple[str, str]]:
    """(signature, nonce) of every /settle body: one pair means the buyer signed once."""
    return {
        (body["paymentPayload"]["payload"]["signature"],
         body["paymentPayload"]["payload"]["authorization"]["nonce"])
        for body in double.bodies["settle"]
    }  # fmt: skip


def _first_broadcast_at() -> datetime:
    started = PaymentAttempt.objects.get().broadcast_started_at
    assert started is not None
    return started


@pytest.mark.parametrize("mode", ["invalid_transaction_state", "hang_unsent"])
def test_the_buyers_resend_resubmits_what_a_facilitator_never_broadcast(
    make_facilitated_world, db, mode
):
    world, double = make_facilitated_world(mode=mode, hang_seconds=3.0)
    client = APIClient()
    payment = _pay(world, client)
    assert double.calls["settle"] == 1 and double.broadcast_count == 0

    double.mode = "ok"  # the facilitator recovers
    # The SAME PAYMENT-SIGNATURE, at once: the first answer is on record, so the first
    # resubmission waits no backoff (issue 18 item 6).
    paid = ask(client, world, payment=payment)

    assert paid.status_code == 202 and paid.json()["payment"]["state"] == "paid"
    assert double.calls["settle"] == 2  # 1 + one resubmission
    assert double.broadcast_count == 1 and world.seller_balance() == PRICE
    assert len(_authorizations_sent(double)) == 1
    attempt = PaymentAttempt.objects.get()
    tx_hash = double.broadcasts[0]
    assert (attempt.state, attempt.resubmissions, attempt.tx_hash) == (
        "succeeded",
        1,
        tx_hash.lower(),
    )
    [event] = _events(RESUBMITTED)
    assert (event.actor, event.reason_code) == ("settlement", "")
    nonce = attempt.authorization_nonce
    assert event.evidence == {
        "attempt": attempt.pk,
        "try": 1,
        "limit": 5,
        "mode": "facilitator",
        "payer": attempt.payer,
        "nonce": nonce,
        "tx_hash": tx_hash,
        "answer": {
            "status": "confirmed",
            "reason_code": "",
            "http_status": 200,
            "success": True,
            "transaction": tx_hash,
        },
    }
    assert not _events(REFUSED) and not Escalation.objects.exists()
    # One authorization's way, step by step, each naming its nonce: the first broadcast,
    # the drop the resend's look-up found (once, though looked up twice), the resubmission.
    [broadcast] = _events(BROADCAST)
    assert broadcast.evidence["submission"] == 0
    assert (broadcast.evidence["mode"], broadcast.evidence["nonce"]) == ("facilitator", nonce)
    assert broadcast.evidence["status"] == "pending"
    [dropped] = _events(DROPPED)
    assert (dropped.evidence["submission"], dropped.evidence["nonce"]) == (0, nonce)
    assert (dropped.evidence["nonce_state"], dropped.reason_code) == ("unused", "not_on_chain_yet")
    assert [e.subject for e in PurchaseEvent.objects.filter(
        subject__in=[BROADCAST, DROPPED, RESUBMITTED]).order_by("pk")] == [
        BROADCAST, DROPPED, RESUBMITTED
    ]  # fmt: skip
    answers = [(e.evidence["submission"], e.reason_code, e.evidence) for e in _events(ANSWERED)]
    assert [(submission, stage) for submission, stage, _ in answers] == [
        (0, "verify"),
        (0, "settle"),
        (1, "verify"),
        (1, "settle"),
    ]
    assert answers[0][2]["http_status"] == 200 and answers[0][2]["is_valid"] is True
    first_settle = answers[1][2]
    if mode == "invalid_transaction_state":
        assert (first_settle["http_status"], first_settle["success"]) == (200, False)
        assert first_settle["error_reason"] == "invalid_transaction_state"
    else:  # hung up before answering: no status, the fault named
        assert first_settle["http_status"] is None and first_settle["transport_error"]
    assert (answers[3][2]["success"], answers[3][2]["transaction"]) == (True, tx_hash)
    assert all("body" not in key for _, _, evidence in answers for key in evidence)


def test_reconciliation_resubmits_without_any_buyer_request(make_facilitated_world, db):
    world, double = make_facilitated_world(mode="invalid_transaction_state", hang_seconds=3.0)
    _pay(world, APIClient())
    started = _first_broadcast_at()
    double.mode = "ok"

    reconcile_pending_settlements(now=started + timedelta(seconds=60))  # the request's grace
    assert double.calls["settle"] == 1
    stats = reconcile_pending_settlements(now=started + timedelta(minutes=3))

    assert (stats["resubmitted"], stats["confirmed"]) == (1, 1)
    assert double.calls["settle"] == 2 and double.broadcast_count == 1
    assert world.seller_balance() == PRICE
    assert Purchase.objects.get().payment_state == "paid"
    attempt = PaymentAttempt.objects.get()
    assert (attempt.state, attempt.resubmissions) == ("succeeded", 1)
    assert attempt.resubmitted_at == started + timedelta(minutes=3)
    [event] = _events(RESUBMITTED)
    assert (event.actor, event.evidence["try"], event.evidence["answer"]["status"]) == (
        "reconciliation",
        1,
        "confirmed",
    )


def test_resubmissions_stop_at_the_limit_with_backoff_and_escalate(
    settings, make_facilitated_world, db
):
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "SETTLEMENT_RESUBMIT_LIMIT": 3}
    world, double = make_facilitated_world(mode="invalid_transaction_state", hang_seconds=3.0)
    client = APIClient()
    payment = _pay(world, client, valid_before=int(time.time()) + 3 * 3600)
    started = _first_broadcast_at()

    tried_at = []
    for minute in range(2, 60):
        before = double.calls["settle"]
        reconcile_pending_settlements(now=started + timedelta(minutes=minute))
        if double.calls["settle"] > before:
            tried_at.append(minute)
    ask(client, world, payment=payment)  # the buyer's resend is refused too

    # 30 s, 2 min, 10 min after the previous try (runs every minute), then never again.
    assert tried_at == [2, 4, 14]
    assert double.calls["settle"] == 1 + 3 and double.broadcast_count == 0
    assert len(_authorizations_sent(double)) == 1  # never re-signed
    attempt = PaymentAttempt.objects.get()
    assert (attempt.state, attempt.resubmissions) == ("settlement_pending", 3)
    assert Purchase.objects.get().payment_state == "settlement_pending"
    assert [e.evidence["try"] for e in _events(RESUBMITTED)] == [1, 2, 3]
    assert {e.reason_code for e in _events(RESUBMITTED)} == {
        "facilitator_unresolved:invalid_transaction_state"
    }
    [refused] = _events(REFUSED)
    assert refused.reason_code == "resubmission_limit_reached"
    assert (refused.evidence["resubmissions"], refused.evidence["limit"]) == (3, 3)
    [escalation] = Escalation.objects.all()
    assert (escalation.owner, escalation.reason_code) == (
        "support",
        "settlement_resubmissions_exhausted",
    )
    assert PaymentAttempt.objects.count() == 1 and world.seller_balance() == 0


def test_a_dropped_relayer_transaction_is_resent_identically_counted_and_bounded(
    settings, x402_paused_world
):
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "SETTLEMENT_RESUBMIT_LIMIT": 2}
    world, client = x402_paused_world, APIClient()
    payment = _pay(world, client)
    attempt = PaymentAttempt.objects.get()
    raw, tx_hash = attempt.raw_transaction, attempt.tx_hash

    def pooled() -> int:
        return int(world.w3.eth.get_transaction_count(world.relayer.address, "pending"))

    world.node.drop_transaction(tx_hash)
    for step, wait in ((1, 0), (2, 121)):
        if step > 1:
            ask(client, world, payment=payment)  # inside the backoff after a try: nothing sent
            assert pooled() == 0
        _age(wait)  # the first resubmission is due at once: the first send has answered
        answer = ask(client, world, payment=payment)
        assert answer.json()["transaction"] == tx_hash
        assert pooled() == 1  # back in the pool: the same bytes, the same hash
        attempt.refresh_from_db()
        assert (attempt.resubmissions, attempt.raw_transaction, attempt.tx_hash) == (
            step,
            raw,
            tx_hash,
        )
        world.node.drop_transaction(tx_hash)

    _age(3600)
    ask(client, world, payment=payment)  # at the limit: refused, not sent
    assert pooled() == 0
    attempt.refresh_from_db()
    assert (attempt.resubmissions, attempt.state) == (2, "settlement_pending")
    tries = _events(RESUBMITTED)
    assert [(e.evidence["try"], e.evidence["mode"], e.evidence["tx_hash"]) for e in tries] == [
        (1, "direct", tx_hash),
        (2, "direct", tx_hash),
    ]
    assert {e.evidence["answer"]["status"] for e in tries} == {"pending"}
    nonce = attempt.authorization_nonce
    assert {e.evidence["nonce"] for e in tries} == {nonce}
    [broadcast] = _events(BROADCAST)
    assert (broadcast.evidence["mode"], broadcast.evidence["tx_hash"]) == ("direct", tx_hash)
    assert (broadcast.evidence["nonce"], broadcast.evidence["submission"]) == (nonce, 0)
    assert broadcast.evidence["relayer_nonce"] == attempt.relayer_nonce is not None
    # Each submission dropped is found once, whatever the number of look-ups meanwhile.
    drops = _events(DROPPED)
    assert [(e.evidence["submission"], e.evidence["tx_hash"]) for e in drops] == [
        (0, tx_hash),
        (1, tx_hash),
        (2, tx_hash),
    ]
    assert {(e.evidence["nonce"], e.evidence["nonce_state"]) for e in drops} == {(nonce, "unused")}
    assert not _events(ANSWERED)  # direct mode: no facilitator
    assert len(_events(REFUSED)) == 1
    assert Escalation.objects.get().reason_code == "settlement_resubmissions_exhausted"
    assert world.seller_balance() == 0


def test_a_tx_known_to_the_node_is_never_resubmitted_until_it_is_dropped(x402_paused_world):
    world, client = x402_paused_world, APIClient()
    payment = _pay(world, client)  # mined nowhere yet: the tx waits in the pool
    started = _first_broadcast_at()

    _age(3600)
    assert ask(client, world, payment=payment).status_code == 202
    stats = reconcile_pending_settlements(now=started + timedelta(minutes=5))

    assert stats["resubmitted"] == 0
    attempt = PaymentAttempt.objects.get()
    assert (attempt.resubmissions, attempt.resubmitted_at) == (0, None)
    assert not _events(RESUBMITTED) and not _events(REFUSED)

    world.node.drop_transaction(attempt.tx_hash)  # only once the node has lost it...
    ask(client, world, payment=payment)
    attempt.refresh_from_db()
    assert attempt.resubmissions == 1  # ...is it sent again, and counted
    assert [e.evidence["tx_hash"] for e in _events(RESUBMITTED)] == [attempt.tx_hash]
    world.node.mine()
    assert ask(client, world, payment=payment).json()["payment"]["state"] == "paid"
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1


def test_a_resubmission_whose_relayer_nonce_was_taken_goes_out_on_a_fresh_one(x402_paused_world):
    """The identical bytes can never land once another relayer transaction took their nonce
    (a gap closer's filler after the lease lapsed): the resubmission signs the same
    authorization into a new relayer transaction on a fresh nonce, records it in place of
    the old one, and the timeline names both. The buyer signed once; paid once. (An
    attempt left this way before the fix is healed by this path, too.)"""
    world, client = x402_paused_world, APIClient()
    payment = _pay(world, client)
    attempt = PaymentAttempt.objects.get()
    stale_hash, stale_nonce = attempt.tx_hash, attempt.relayer_nonce
    assert stale_nonce is not None
    world.node.drop_transaction(stale_hash)
    filler = Account.sign_transaction(
        {"to": world.relayer.address, "value": 0, "gas": 21_000, "nonce": stale_nonce,
         "chainId": world.w3.eth.chain_id, **relayer_fee_fields(world.w3)},
        world.relayer.key,
    )  # fmt: skip
    world.w3.eth.send_raw_transaction(filler.raw_transaction)
    world.node.mine()  # the nonce is taken for good

    ask(client, world, payment=payment)  # the buyer's resend: the resubmission is due

    attempt.refresh_from_db()
    assert attempt.resubmissions == 1 and attempt.relayer_nonce == stale_nonce + 1
    assert attempt.tx_hash != stale_hash and attempt.state == "settlement_pending"
    [again] = _events(RESUBMITTED)
    assert again.reason_code == "relayer_nonce_taken"
    assert (again.evidence["try"], again.evidence["replaced_tx_hash"],
            again.evidence["replaced_relayer_nonce"], again.evidence["tx_hash"],
            again.evidence["nonce"]) == (1, stale_hash, stale_nonce, attempt.tx_hash,
                                         attempt.authorization_nonce)  # fmt: skip
    [broadcast] = _events(BROADCAST)
    assert broadcast.evidence["tx_hash"] == stale_hash  # what was first sent stays told
    world.node.mine()
    assert ask(client, world, payment=payment).json()["payment"]["state"] == "paid"
    # The filler and the new transaction hold the two nonces: the refused one never mined.
    assert world.seller_balance() == PRICE and world.relayer_sent() == stale_nonce + 2
