"""A back office whose rows carry the longest values the admin pages show (admin_pages.py):
42-character wallets, 66-character tx hashes, 128-character payment ids, facilitator reason
codes, job refs and worker names at their column's length, prose notes, a stored answer with
a base64 header. Written and committed (a live server reads them) through the factories, the
ledger service and plain rows where no factory exists.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth.models import Group, User
from django.db import transaction
from django.utils import timezone

from backoffice.roles import FINANCE, SUPPORT, roles_ensure
from fulfillment.models import ExecutionAttempt, Receipt, Result
from payments.models import LedgerBalance, LedgerEntry, PaymentAttempt, Refund
from payments.services import export_batch_record, ledger_credit, ledger_debit
from purchases.case_file import Action
from purchases.models import (
    Buyer,
    BuyerWallet,
    IdempotencyRecord,
    JobRun,
    Offering,
    Purchase,
    PurchaseEvent,
)
from purchases.services.remedy.case_actions import purchase_case_now
from purchases.services.remedy.refund_requests import refund_request_open
from purchases.services.shared.buyers import api_key_issue
from tests.factories import (
    BuyerFactory,
    EscalationFactory,
    IdempotencyRecordFactory,
    OfferingFactory,
    PaymentAttemptFactory,
    PayoutFactory,
    PurchaseFactory,
    QuoteFactory,
    RefundFactory,
)

NETWORK = "eip155:84532"
USDC = "0x036CbD53842c5426634e7929541eC2318f3dCF7e"
SELLER = "0x9F8b2C4e1A7d3E6f5B0c9D8e7F6a5B4c3D2e1F0a"
PAYER = "0x7a16ff8270133f063aab6c9977183d9e72835428"
OTHER_PAYER = "0x4bbeeb066ed09b7aed07bf39eee0460dfa261520"
PAYBACK_TX = "0x" + "ab" * 32
# A payment id an agent chose (123 of the 128 characters one may have).
PAYMENT_ID = "agent-7f3c9e1a-" + "4d2b8f6e0a1c3e5d7b9f" * 5 + "-retry-2"
# As payments.rails.x402.facilitator writes it: prefixed, cut to the column's 64 characters.
FACILITATOR_SAID = "invalid_exact_evm_payload_authorization_valid_before"
FACILITATOR_REASON = f"facilitator_rejected:{FACILITATOR_SAID}"[:64]
WORKER = "celery@tollbooth-worker-7f9c8d6b5-x2k4p:0b1e9f5c-3f0a-4c4e-9f61-7d2f2f0a8b11"
JOB_REF = "job_" + "01JD3K7Q8M2N4P6R8T0V2X4Z6B" * 3
PROSE = (
    "The buyer's agent says the report never arrived although the transfer shows on the "
    "explorer; their operator asked twice by mail (ticket 48213) and wants the money back "
    "today, before their month closes. Checked the relayer: one broadcast, no drop."
)
# 300 characters and not one break opportunity: a pasted explorer link.
UNBROKEN_NOTE = ("https://explorer.example/tx/0x" + "9f2c4e6a8b0d1f3e5a7c" * 14)[:300]
# The PAYMENT-RESPONSE header an x402 answer stores: base64 with no break opportunity.
PAYMENT_RESPONSE = (
    "eyJzdWNjZXNzIjp0cnVlLCJ0cmFuc2FjdGlvbiI6IjB4" + "YWJjZGVmMDEyMzQ1Njc4OWFiY2RlZjAx" * 8 + "In0="
)


def _tx(n: int) -> str:
    return f"0x{n:064x}"


def _staff() -> None:
    roles_ensure()
    for role in (SUPPORT, FINANCE):
        user = User.objects.create_user(username=role, is_staff=True)
        user.groups.add(Group.objects.get(name=role))


def _catalog() -> tuple[Offering, Buyer]:
    offering = OfferingFactory.create(
        slug="csv-statistics-report-with-regional-breakdown-and-outlier-notes",
        title="CSV statistics report with a regional breakdown, outliers and a short summary",
        description=PROSE,
        asset=USDC,
        network=NETWORK,
        pay_to=SELLER,
        stock=1_000_000,
    )
    buyer = BuyerFactory.create(
        name="Acme Research procurement agent (EU west, nightly batch pipeline number 7)",
        spend_cap=1_000_000_000,
    )
    for wallet in (PAYER, OTHER_PAYER):
        BuyerWallet.objects.create(buyer=buyer, address=wallet)
    api_key_issue(buyer=buyer, label="nightly batch pipeline, rotated by ops on 2026-11-30")
    return offering, buyer


def _event(purchase: Purchase, subject: str, **fields: Any) -> None:
    PurchaseEvent.objects.create(purchase=purchase, quote=purchase.quote, subject=subject, **fields)


def _x402_purchase(offering: Offering, buyer: Buyer, **traits: Any) -> Purchase:
    return PurchaseFactory.create(
        quote__offering=offering,
        quote__buyer=buyer,
        quote__canonical_input={"title": "Sales by region", "csv": "region,units\n" * 40},
        buyer=buyer,
        payer=PAYER,
        **traits,
    )


def _late_transfer(offering: Offering, buyer: Buyer, pks: dict[str, int]) -> None:
    """Failed by the facilitator, then its transfer landed: a refund owed, support's
    escalation open, a timeline with every kind of long evidence."""
    purchase = _x402_purchase(offering, buyer, failed=True, reason_code=FACILITATOR_REASON)
    PaymentAttemptFactory.create(
        purchase=purchase,
        payer=PAYER,
        failed=True,
        reason_code=FACILITATOR_REASON,
        settlement_reference="fac_settle_" + "9f2c4e6a8b0d1f3e5a7c" * 5,
    )
    late = PaymentAttemptFactory.create(
        purchase=purchase,
        payment_id=PAYMENT_ID,
        payer=PAYER,
        succeeded=True,
        tx=_tx(0xFEED),
        block_number=18_446_744,
        authorization_nonce=_tx(0xA11CE),
        settlement_reference=_tx(0xFEED),
    )
    refund = RefundFactory.create(payment_attempt=late, transaction=late.tx_hash, note=PROSE)
    # Paid out to another wallet than the payer's, broadcast and awaiting finality.
    pks["payout"] = PayoutFactory.create(
        refund=refund,
        destination=OTHER_PAYER,
        tx_hash=_tx(0xB0B),
        from_address=SELLER.lower(),
        state="broadcast",
        awaiting="finality",
        approved_by="finance.lead@tollbooth.example",
        second_approved_by="finance.second@tollbooth.example",
        second_approved_at=timezone.now(),
        evidence={
            "code": "payback_awaiting_finality",
            "depth": 17,
            "finality_depth": 64,
            "node_said": PROSE,
        },
        next_check_at=timezone.now(),
    ).pk
    escalation = EscalationFactory.create(
        purchase=purchase,
        reason_code="late_settlement_after_facilitator_rejection_needs_a_person",
        details={"tx_hash": late.tx_hash, "payer": PAYER, "facilitator": FACILITATOR_REASON},
        note=PROSE,
        assigned_by="support.lead@tollbooth.example",
        assigned_at=timezone.now(),
    )
    # A note with no break in it (a pasted explorer link): wraps, never widens a table.
    EscalationFactory.create(
        purchase=purchase,
        reason_code="staff_escalated",
        note=UNBROKEN_NOTE,
        assignee="support.lead@tollbooth.example",
    )
    for subject, reason, evidence in (
        ("payment_attempt.broadcast", "", {"tx_hash": late.tx_hash, "nonce": _tx(0xA11CE)}),
        (
            "facilitator.answered",
            FACILITATOR_REASON,
            {"status": 400, "reason": FACILITATOR_REASON, "payer": PAYER, "body": PAYMENT_RESPONSE},
        ),
        ("purchase.payment", FACILITATOR_REASON, {"attempt": late.pk, "payment_id": PAYMENT_ID}),
        ("refund", "late_settlement", {"tx_hash": late.tx_hash, "payer": PAYER}),
    ):
        _event(
            purchase,
            subject,
            actor_type="system",
            actor=WORKER,
            reason_code=reason,
            from_state="settlement_pending",
            to_state="failed",
            evidence=evidence,
        )
    record_id = late.idempotency_record_id
    assert record_id is not None  # the factory claims the payment id's key
    pks.update(
        {
            "late transfer": purchase.pk,
            "late attempt": late.pk,
            "open": escalation.pk,
            "payment id": record_id,
            "quote": purchase.quote_id,
        }
    )
    IdempotencyRecord.objects.filter(pk=record_id).update(
        principal=PAYER,
        purchase=purchase,
        response_status=402,
        response_headers={"PAYMENT-RESPONSE": PAYMENT_RESPONSE, "Retry-After": "2"},
        response_body={
            "error": FACILITATOR_REASON,
            "payer": PAYER,
            "accepts": [
                {
                    "scheme": "exact",
                    "network": NETWORK,
                    "asset": USDC,
                    "payTo": SELLER,
                    "maxAmountRequired": "250000",
                    "resource": f"https://tollbooth.example/x402/{offering.slug}",
                }
            ],
        },
    )


def _settled(offering: Offering, buyer: Buyer, pks: dict[str, int]) -> None:
    """Paid on chain and done, after a worker died once: two executions, a result, a receipt."""
    purchase = _x402_purchase(offering, buyer, executed=True)
    attempt = PaymentAttemptFactory.create(
        purchase=purchase,
        payer=PAYER,
        succeeded=True,
        tx=_tx(0xBEEF),
        block_number=18_446_900,
        settlement_reference=_tx(0xBEEF),
        authorization_nonce=_tx(0xB0B),
    )
    now = timezone.now()
    executions = [
        ExecutionAttempt.objects.create(
            purchase=purchase,
            executor="http_job",
            worker=f"{WORKER}:{n}",
            lease_token=f"{n:032x}",
            lease_expires_at=now,
            takeovers=n,
            tries=n + 1,
            job_ref=JOB_REF,
            job_idempotency_key=f"exec:{purchase.ref}:{attempt.idempotency_record_id}:{'k' * 60}",
            reason_code="worker_lease_expired_taken_over_by_another_worker" if n == 0 else "",
            started_at=now,
            finished_at=now,
            state=state,
        )
        for n, state in enumerate(("failed", "succeeded"))
    ]
    result = Result.objects.create(
        purchase=purchase,
        execution=executions[1],
        content_type="text/csv; charset=utf-8",
        body=b"region,units\n",
        sha256="e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        size=1_048_576,
        created_at=now,
        expires_at=now + timedelta(days=7),
        first_delivered_at=now,
    )
    receipt = Receipt.objects.create(
        purchase=purchase,
        payer=PAYER,
        amount=purchase.amount,
        asset=USDC,
        network=NETWORK,
        transaction=_tx(0xBEEF),
        body_sha256=result.sha256,
        delivered_at=now,
    )
    pks.update(
        settled=purchase.pk, execution=executions[0].pk, result=result.pk, receipt=receipt.pk
    )


def _duplicate(offering: Offering, buyer: Buyer, pks: dict[str, int]) -> None:
    """Two authorizations settled for one quote: one refund paid back, a compensation
    support proposed waiting for finance, a resolved escalation."""
    purchase = _x402_purchase(offering, buyer, executed=True)
    first = PaymentAttemptFactory.create(
        purchase=purchase, payer=PAYER, succeeded=True, tx=_tx(0xD00D), block_number=18_447_000
    )
    # The second transfer landed too; the attempt is not the purchase's live one.
    second = PaymentAttemptFactory.create(
        purchase=purchase,
        payer=OTHER_PAYER,
        state=PaymentAttempt.State.FAILED,
        reason_code="duplicate_settlement",
        tx_hash=_tx(0xD00E),
        settlement_reference=_tx(0xD00E),
        block_number=18_447_001,
    )
    paid = RefundFactory.create(
        payment_attempt=second,
        transaction=second.tx_hash,
        reason_code="duplicate_settlement",
        state=Refund.State.PAID,
        paid_reference=PAYBACK_TX,
        paid_by="finance.lead@tollbooth.example",
        paid_at=timezone.now(),
        note=PROSE,
    )
    RefundFactory.create(
        payment_attempt=first,
        method=Refund.Method.PAY_BACK,
        amount=50_000,
        reason_code="goodwill_compensation_for_a_late_report",
        state=Refund.State.PROPOSED,
        note=PROSE,
        proposed_by="support.lead@tollbooth.example",
    )
    EscalationFactory.create(
        purchase=purchase,
        resolved=True,
        reason_code="duplicate_settlement_two_authorizations",
        resolution=PROSE,
        resolution_code="refund_proposed",
        note=PROSE,
    )
    pks.update({"duplicate transfer": purchase.pk, "paid back": paid.pk})


def _prepaid(offering: Offering, buyer: Buyer, pks: dict[str, int]) -> None:
    """A prepaid purchase refunded to the balance, and the ledger around it."""
    top_up = ledger_credit(
        buyer_id=buyer.pk,
        asset=USDC,
        amount=25_000_000,
        kind=LedgerEntry.Kind.TOP_UP,
        reference="top_up:SEPA-DE89370400440532013000-INV-2026-11-000482-" + "x" * 60,
        memo="top-up by finance.lead@tollbooth.example: " + PROSE[:150],
    )
    purchase = PurchaseFactory.create(
        quote__offering=offering,
        quote__buyer=buyer,
        buyer=buyer,
        payer=buyer.ref,
        prepaid=True,
        executed=True,
    )
    record = IdempotencyRecordFactory.create(scope="prepaid", key=PAYMENT_ID, principal=buyer.ref)
    attempt = PaymentAttemptFactory.create(
        purchase=purchase,
        rail="prepaid",
        idempotency_record=record,
        payer=buyer.ref,
        network="prepaid",
        succeeded=True,
        tx=None,
        settlement_reference=f"debit:{purchase.ref}:{record.pk}",
    )
    with transaction.atomic():  # as the prepaid rail debits, inside the payment's transaction
        ledger_debit(
            buyer_id=buyer.pk,
            asset=USDC,
            amount=purchase.amount,
            reference=attempt.settlement_reference,
            purchase_id=purchase.pk,
        )
    credit = ledger_credit(
        buyer_id=buyer.pk,
        asset=USDC,
        amount=purchase.amount,
        kind=LedgerEntry.Kind.REFUND_CREDIT,
        reference=f"refund:{purchase.ref}:{attempt.pk}",
        purchase_id=purchase.pk,
    )
    RefundFactory.create(
        payment_attempt=attempt,
        method=Refund.Method.LEDGER_CREDIT,
        network="prepaid",
        payer=buyer.ref,
        state=Refund.State.PAID,
        paid_reference=credit.reference,
        paid_by="system",
        paid_at=timezone.now(),
        reason_code="execution_failed_refunded",
    )
    pks.update(prepaid=purchase.pk, buyer=buyer.pk, offering=offering.pk, **{"top-up": top_up.pk})
    pks["balance"] = LedgerBalance.objects.get(buyer=buyer, asset=USDC).pk


def _records(pks: dict[str, int]) -> None:
    now = timezone.now()
    run = JobRun.objects.create(
        job="pending_settlements_reconciliation",
        started_at=now,
        finished_at=now,
        stats={
            "claimed": 120,
            "confirmed": 97,
            "still_pending": 21,
            "dropped": 1,
            "resubmitted": 1,
            "escalated": 0,
            "last_tx_hash": _tx(0xFEED),
        },
        error="RPCError('eth_getTransactionReceipt timed out after 10.0s against "
        "https://base-sepolia.g.alchemy.com/v2/" + "k" * 60 + "')",
    )
    batch = export_batch_record(
        kind="refunds",
        created_by="finance.lead@tollbooth.example",
        filters={
            "query": {"state": ["all"], "q": [PAYBACK_TX], "network": [NETWORK]},
            "selection": "all matching",
        },
        started_at=now,
        row_count=1_000_000,
        sha256="9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        first_created_at=now,
        last_created_at=now,
    )
    pks.update({"job run": run.pk, "export": batch.pk})


def layout_world_build() -> dict[str, int]:
    """The staff ("support", "finance") and the rows, written and committed; answers the
    rows' primary keys by the names admin_pages.PAGES uses. The case file pages each offer the
    action their case-action page opens (asserted, so a change of the case table that takes
    one away fails here, not as a 403 in the browser)."""
    _staff()
    offering, buyer = _catalog()
    QuoteFactory.create(offering=offering, buyer=buyer, expired=True)
    pks: dict[str, int] = {}
    _late_transfer(offering, buyer, pks)
    _settled(offering, buyer, pks)
    _duplicate(offering, buyer, pks)
    # The buyer of the settled purchase asked for part of its money back, signed by its wallet.
    pks["refund request"] = refund_request_open(
        purchase_id=pks["settled"],
        channel="wallet_signature",
        requested_by=PAYER,
        amount=1,
        reason=PROSE,
        idempotency_key="layout-refund-request-0001",
    ).request.pk
    _prepaid(offering, buyer, pks)
    _records(pks)
    for name, action in (
        ("late transfer", Action.RESOLVE),
        ("settled", Action.PROPOSE_REFUND),
        ("duplicate transfer", Action.APPROVE_REFUND),
    ):
        case = purchase_case_now(purchase=Purchase.objects.get(pk=pks[name]))
        assert action in case.actions, (name, action, case.actions)
    return pks
