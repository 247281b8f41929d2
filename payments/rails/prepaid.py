"""The prepaid rail: the buyer's running balance is the money, debited as the attempt is
recorded, in the orchestration's transaction. Nothing to broadcast, nothing to look up."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, ClassVar

from django.db import transaction

from core.changes import Change
from core.errors import DomainError, ErrorCode
from payments.models import PaymentAttempt, Rail, Refund
from payments.rails.base import (
    BatchLookup,
    Charge,
    FundsLow,
    Presentation,
    QuoteTerms,
    RowGuard,
    SettlementOutcome,
    SettlementStatus,
)
from payments.services import ledger_debit, refund_pay_by_ledger_credit, refund_record

PREPAID_NETWORK = "prepaid"


class PrepaidRail:
    name: ClassVar[str] = Rail.PREPAID
    settles_when_recorded: ClassVar[bool] = True

    def requirements(self, *, terms: QuoteTerms) -> None:
        return None  # the quote id and an authenticated buyer are the whole presentation

    def verify(self, *, presentation: Presentation, terms: QuoteTerms, now: datetime) -> None:
        return None  # the API key proved the buyer; the balance is judged by the debit

    def refuse_if_taken(self, *, presentation: Presentation, terms: QuoteTerms) -> None:
        return None  # a debit is its own payment: nothing else can already hold it

    def verify_funds(
        self, *, presentation: Presentation, terms: QuoteTerms, context: Any = None
    ) -> None:
        return None  # checked atomically by the debit itself, never read ahead of it

    def record(self, *, charge: Charge) -> tuple[PaymentAttempt, Change]:
        """Debit the balance and record a succeeded attempt, atomically.

        One conditional UPDATE of the running balance locks, checks and debits at once (with
        its ledger entry, payments.services.ledger_debit): two debits of one buyer never
        interleave and never overdraw. Raises DomainError:
        insufficient_funds.
        """
        assert transaction.get_connection().in_atomic_block
        assert charge.buyer_id is not None
        terms = charge.terms
        # One debit per payment id: the reference is known before anything is written, so
        # the attempt is settled in memory and written once.
        reference = f"debit:{charge.purchase_ref}:{charge.idempotency_record_id}"
        entry = ledger_debit(
            buyer_id=charge.buyer_id,
            asset=terms.asset,
            amount=terms.amount,
            reference=reference,
            purchase_id=charge.purchase_id,
        )
        if entry is None:
            raise DomainError(ErrorCode.INSUFFICIENT_FUNDS)
        attempt = PaymentAttempt(
            purchase_id=charge.purchase_id,
            rail=Rail.PREPAID,
            idempotency_record_id=charge.idempotency_record_id,
            payer=charge.presentation.payer,
            network=PREPAID_NETWORK,
            asset=terms.asset,
            amount=terms.amount,
            fingerprint=charge.presentation.fingerprint,
        )
        attempt.succeed(settlement_reference=reference)
        attempt.save()
        change = Change(
            subject="payment_attempt",
            from_state=PaymentAttempt.State.RECORDED,
            to_state=attempt.state,
            evidence={
                "attempt": attempt.pk,
                "rail": attempt.rail,
                "ledger_entry": entry.reference,
                "amount": str(attempt.amount),
            },
        )
        return attempt, change

    def settle(
        self,
        *,
        attempt: PaymentAttempt,
        terms: QuoteTerms,
        now: datetime,
        wait_until: float | None = None,
    ) -> SettlementOutcome:
        return self.look_up(attempt=attempt, now=now)  # settled when recorded: no wait

    def look_up(self, *, attempt: PaymentAttempt, now: datetime) -> SettlementOutcome:
        if attempt.state == PaymentAttempt.State.SUCCEEDED:
            return SettlementOutcome(SettlementStatus.CONFIRMED)
        return SettlementOutcome(SettlementStatus.FAILED, reason_code=attempt.reason_code)

    def lookup_many(
        self,
        *,
        attempts: Sequence[PaymentAttempt],
        now: datetime,
        guard: RowGuard,
        chunk_size: int | None = None,
    ) -> BatchLookup:
        return BatchLookup()  # settled when recorded: reconciliation has nothing to ask

    def heal(self, *, now: datetime, stats: Counter[str]) -> None:
        return None  # no relayer, no queue: nothing can stall

    def funds_watch(
        self, *, now: datetime, alert: Callable[[FundsLow], bool], stats: Counter[str]
    ) -> None:
        return None  # a ledger entry costs no gas

    def resend(
        self, *, attempt: PaymentAttempt, terms: QuoteTerms, now: datetime
    ) -> SettlementOutcome:
        return self.look_up(attempt=attempt, now=now)

    def never_reached(
        self, *, attempt: PaymentAttempt, outcome: SettlementOutcome, now: datetime
    ) -> bool:
        return False  # the debit and the attempt commit together: nothing is ever in transit

    def describe(self, *, attempt: PaymentAttempt) -> dict[str, Any]:
        return {"ledger_entry": attempt.settlement_reference}

    def held_can_land(self, *, attempt: PaymentAttempt, now: datetime) -> str:
        return ""  # debited as recorded: never held

    def refund(
        self,
        *,
        attempt: PaymentAttempt,
        buyer_id: int | None,
        reason_code: str,
        paid_by: str,
        now: datetime,
        tx_hash: str | None = None,
    ) -> tuple[Refund, list[Change]]:
        """Straight back to the balance: the refund is paid at once, by a ledger credit."""
        refund, changes = refund_record(
            attempt=attempt, method=Refund.Method.LEDGER_CREDIT, reason_code=reason_code
        )
        if not changes or buyer_id is None:
            return refund, changes
        refund, paid = refund_pay_by_ledger_credit(
            refund=refund, buyer_id=buyer_id, by=paid_by, now=now
        )
        return refund, [*changes, *([paid] if paid else [])]
