"""factory_boy factories: one per model, a trait per interesting state.

FSM state fields are protected (no assignment after load), but a new instance may be
constructed in any state: the traits pass the state to `Model.objects.create(...)`, which is
what `DjangoModelFactory._create` does. Rows are built through their fields, not the services,
so a test can place a row in the state it needs without walking the path to it.
"""

from __future__ import annotations

from datetime import timedelta

import factory
from django.utils import timezone

from fulfillment.executors.report import REPORT_INPUT_SCHEMA
from payments.models import LedgerEntry, PaymentAttempt, Payout, Rail, Refund
from payments.services import ledger_credit
from purchases.models import Buyer, Escalation, IdempotencyRecord, Offering, Purchase, Quote

USDC_LOCAL = "0x" + "a0" * 20
SELLER = "0x" + "5e" * 20
PAYER = "0x" + "0c" * 20
# Agents may tag requests with an id of their own; it is volatile, so it never splits quotes.
REPORT_SCHEMA_WITH_REQUEST_ID = {
    **REPORT_INPUT_SCHEMA,
    "properties": {**REPORT_INPUT_SCHEMA["properties"], "request_id": {"type": "string"}},
}


class OfferingFactory(factory.django.DjangoModelFactory[Offering]):
    class Meta:
        model = Offering
        django_get_or_create = ("slug",)

    slug = factory.Sequence(lambda n: f"csv-report-{n}")
    title = "CSV statistics report"
    price = 250_000  # 0.25 USDC
    asset = USDC_LOCAL
    network = "eip155:31337"
    pay_to = SELLER
    executor = "report"
    input_schema = REPORT_SCHEMA_WITH_REQUEST_ID
    volatile_fields = ["request_id"]
    result_retention = timedelta(days=7)

    class Params:
        with_stock = factory.Trait(stock=2)
        http_job = factory.Trait(
            executor="http_job",
            input_schema={
                "type": "object",
                "required": ["text"],
                "properties": {
                    "text": {"type": "string"},
                    "duration_ms": {"type": "integer"},
                    "fail": {"type": "boolean"},
                    "request_id": {"type": "string"},
                },
            },
        )
        escalating = factory.Trait(refund_policy=Offering.RefundPolicy.ESCALATE)
        # The built-in top-up kind (docs/x402.md#top-ups): the price is the amount asked for.
        top_up = factory.Trait(
            executor="top_up",
            title="Prepaid top-up",
            price=100_000,
            input_schema={},
            volatile_fields=[],
            late_payment_policy=Offering.LatePaymentPolicy.FULFIL,
        )


class BuyerFactory(factory.django.DjangoModelFactory[Buyer]):
    class Meta:
        model = Buyer

    name = factory.Sequence(lambda n: f"agent-{n}")


def fund(buyer: Buyer, amount: int, asset: str = USDC_LOCAL) -> LedgerEntry:
    """A top-up through the ledger service, so the running balance moves with it."""
    return ledger_credit(
        buyer_id=buyer.pk,
        asset=asset,
        amount=amount,
        kind=LedgerEntry.Kind.TOP_UP,
        reference=f"topup:{buyer.ref}:{timezone.now().timestamp()}:{LedgerEntry.objects.count()}",
    )


class QuoteFactory(factory.django.DjangoModelFactory[Quote]):
    class Meta:
        model = Quote

    offering = factory.SubFactory(OfferingFactory)
    quote_key = factory.Sequence(lambda n: f"quote-key-{n}")
    canonical_input = factory.LazyFunction(dict)
    input_hash = factory.Sequence(lambda n: f"{n:064x}")
    price = factory.LazyAttribute(lambda o: o.offering.price)
    asset = factory.LazyAttribute(lambda o: o.offering.asset)
    network = factory.LazyAttribute(lambda o: o.offering.network)
    pay_to = factory.LazyAttribute(lambda o: o.offering.pay_to)
    offering_version = factory.LazyAttribute(lambda o: o.offering.version)
    expires_at = factory.LazyFunction(lambda: timezone.now() + timedelta(minutes=15))
    state = Quote.State.OPEN

    class Params:
        expired = factory.Trait(
            state=Quote.State.EXPIRED,
            expires_at=factory.LazyFunction(lambda: timezone.now() - timedelta(minutes=1)),
        )
        accepted = factory.Trait(state=Quote.State.ACCEPTED)


class PurchaseFactory(factory.django.DjangoModelFactory[Purchase]):
    """An x402 purchase of an accepted quote; unpaid unless a trait says otherwise."""

    class Meta:
        model = Purchase

    quote = factory.SubFactory(QuoteFactory, accepted=True)
    offering = factory.LazyAttribute(lambda o: o.quote.offering)
    amount = factory.LazyAttribute(lambda o: o.quote.price)
    asset = factory.LazyAttribute(lambda o: o.quote.asset)
    network = factory.LazyAttribute(lambda o: o.quote.network)
    rail = Rail.X402
    payment_state = Purchase.PaymentState.UNPAID
    fulfillment_state = Purchase.FulfillmentState.NOT_STARTED

    class Params:
        prepaid = factory.Trait(rail=Rail.PREPAID)
        settlement_pending = factory.Trait(payment_state=Purchase.PaymentState.SETTLEMENT_PENDING)
        paid = factory.Trait(
            payment_state=Purchase.PaymentState.PAID,
            fulfillment_state=Purchase.FulfillmentState.QUEUED,
            paid_at=factory.LazyFunction(timezone.now),
        )
        failed = factory.Trait(
            payment_state=Purchase.PaymentState.FAILED, reason_code="settlement_failed"
        )
        executed = factory.Trait(paid=True, fulfillment_state=Purchase.FulfillmentState.SUCCEEDED)


class IdempotencyRecordFactory(factory.django.DjangoModelFactory[IdempotencyRecord]):
    """A payment id's key, claimed and in flight; the same (scope, key) is one row."""

    class Meta:
        model = IdempotencyRecord
        django_get_or_create = ("scope", "key")

    scope = "x402"
    key = factory.Sequence(lambda n: f"pay-{n:016d}")
    principal = PAYER
    request_fingerprint = "f" * 64
    created_at = factory.LazyFunction(timezone.now)


class PaymentAttemptFactory(factory.django.DjangoModelFactory[PaymentAttempt]):
    """An x402 attempt paying its purchase in full; `recorded` unless a trait says otherwise.

    `payment_id` names its key (the id lives once, on the key)."""

    class Meta:
        model = PaymentAttempt

    class Params:
        payment_id = factory.Sequence(lambda n: f"pay-{n:016d}")
        tx = factory.Sequence(lambda n: f"0x{n:064x}")
        pending = factory.Trait(
            state=PaymentAttempt.State.SETTLEMENT_PENDING,
            tx_hash=factory.SelfAttribute("tx"),
            broadcast_started_at=factory.LazyFunction(timezone.now),
        )
        # Settled and final, as "paid" means in most tests; `final_at=None` for a payment
        # the finality watch still looks at (purchases.services.settle.finality).
        succeeded = factory.Trait(
            state=PaymentAttempt.State.SUCCEEDED,
            tx_hash=factory.SelfAttribute("tx"),
            final_at=factory.LazyFunction(timezone.now),
        )
        failed = factory.Trait(state=PaymentAttempt.State.FAILED, reason_code="settlement_failed")

    purchase = factory.SubFactory(PurchaseFactory)
    rail = "x402"
    idempotency_record = factory.SubFactory(
        IdempotencyRecordFactory, key=factory.SelfAttribute("..payment_id")
    )
    payer = PAYER
    network = factory.LazyAttribute(lambda o: o.purchase.network)
    asset = factory.LazyAttribute(lambda o: o.purchase.asset)
    amount = factory.LazyAttribute(lambda o: o.purchase.amount)
    fingerprint = factory.Sequence(lambda n: f"{n:064x}")
    state = PaymentAttempt.State.RECORDED


class RefundFactory(factory.django.DjangoModelFactory[Refund]):
    """Owed back to the payer of a transfer that landed late; `owed` unless `paid`."""

    class Meta:
        model = Refund

    payment_attempt = factory.SubFactory(PaymentAttemptFactory, succeeded=True)
    purchase = factory.LazyAttribute(lambda o: o.payment_attempt.purchase)
    method = Refund.Method.PAY_BACK
    amount = factory.LazyAttribute(lambda o: o.payment_attempt.amount)
    asset = factory.LazyAttribute(lambda o: o.payment_attempt.asset)
    network = factory.LazyAttribute(lambda o: o.payment_attempt.network)
    payer = factory.LazyAttribute(lambda o: o.payment_attempt.payer)
    reason_code = "late_settlement"
    state = Refund.State.OWED

    class Params:
        paid = factory.Trait(
            state=Refund.State.PAID,
            paid_reference="bank-transfer-1",
            paid_by="finance",
            paid_at=factory.LazyFunction(timezone.now),
        )


class PayoutFactory(factory.django.DjangoModelFactory[Payout]):
    """A payout of an owed chain refund, signed and recorded (not broadcast) unless a trait
    says otherwise. The bytes are placeholders: chain tests approve through the service."""

    class Meta:
        model = Payout

    refund = factory.SubFactory(RefundFactory)
    network = factory.LazyAttribute(lambda o: o.refund.network)
    asset = factory.LazyAttribute(lambda o: o.refund.asset)
    destination = factory.LazyAttribute(lambda o: o.refund.payer)
    amount = factory.LazyAttribute(lambda o: o.refund.amount)
    from_address = "0x" + "5" * 40
    nonce = factory.Sequence(int)
    tx_hash = factory.Sequence(lambda n: "0x" + f"{n:064x}")
    raw_transaction = "0x02"
    approved_by = "fay-finance"
    approved_at = factory.LazyFunction(timezone.now)
    cap_day = factory.LazyFunction(lambda: timezone.now().date())
    awaiting = "broadcast"
    state = Payout.State.RECORDED

    class Params:
        awaiting_approval = factory.Trait(
            state=Payout.State.AWAITING_APPROVAL,
            awaiting="second_approval",
            nonce=None,
            tx_hash=None,
            raw_transaction="",
        )


class EscalationFactory(factory.django.DjangoModelFactory[Escalation]):
    """Owned by support, due in four hours; `open` unless `resolved`."""

    class Meta:
        model = Escalation

    purchase = factory.SubFactory(PurchaseFactory)
    owner = Escalation.OwnerRole.SUPPORT
    reason_code = factory.Sequence(lambda n: f"reason_{n}")
    deadline_at = factory.LazyFunction(lambda: timezone.now() + timedelta(hours=4))
    state = Escalation.State.OPEN

    class Params:
        resolved = factory.Trait(
            state=Escalation.State.RESOLVED,
            resolved_by="support",
            resolution="Resolved by hand.",
            resolved_at=factory.LazyFunction(timezone.now),
        )


def refund_paid_back(refund: Refund, reference: str, *, by: str = "fay-finance") -> None:
    """A refund finance already closed, for tests of what pages show afterwards. Closing a
    chain refund needs the chain's proof (tests/reconciliation/test_refund_paybacks.py);
    these rows stand for one that passed, as the `paid` trait does."""
    Refund.objects.filter(pk=refund.pk).update(
        state=Refund.State.PAID, paid_reference=reference, paid_by=by, paid_at=timezone.now()
    )
