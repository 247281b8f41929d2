"""The interface a payment rail implements, and the registry that finds one by name.

A rail knows how its money moves: what a quote asks of the payer (requirements), whether a
presentation of payment is good (verify, then verify_funds for what only the ledger or the
chain can say), how an attempt is written down (record), how it reaches the money
(settle, look_up, resend; lookup_many for reconciliation's batches) and how money goes back
(refund). It knows nothing of purchases:
it takes ids and small value objects and returns attempts, outcomes and `Change`s for the
orchestration to put on the timeline.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from core.changes import Change
from core.waits import Awaiting

if TYPE_CHECKING:
    from payments.models import PaymentAttempt, Refund

# One line per rail: its name (payments.models.Rail) and the class implementing it. The
# setting `RAILS`, when a deployment (or a test) sets it, replaces this default.
RAILS: dict[str, str] = {
    "prepaid": "payments.rails.prepaid.PrepaidRail",
    "x402": "payments.rails.x402.rail.X402Rail",
}


# What a rail answers about an attempt's money: settle, look_up and resend return one.
class SettlementStatus(StrEnum):
    CONFIRMED = "confirmed"  # proven: the transfer is on chain with enough confirmations
    FAILED = "failed"  # proven: it did not and cannot happen with this broadcast
    PENDING = "pending"  # anything else: unknown is not failed


@dataclass(frozen=True)
class SettlementOutcome:
    status: SettlementStatus
    tx_hash: str | None = None
    reason_code: str = ""
    block_number: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


# What sending a payment gives: its outcome, or, when the money was not proven at the first
# look, the wait for it (core.waits) for the caller to sleep through, on its thread or on an
# event loop. Every value the wait gives is an outcome as the first look's is.
Settling = SettlementOutcome | Awaiting[SettlementOutcome]


# Evidence keys the caller takes off an outcome for the timeline: True on the outcome of the
# broadcast that claimed an attempt's first send; the list of what a settler's counterpart
# (a facilitator) answered on the way, one short summary per HTTP exchange.
FIRST_BROADCAST = "first_broadcast"
SETTLER_ANSWERS = "settler_answers"
# A facilitator's own id for a settlement it took (Circle's `paymentId`): kept on the attempt
# beside the tx hash (`PaymentAttempt.facilitator_payment_id`), so reconciliation and support
# can name it to the facilitator while no hash is known.
FACILITATOR_PAYMENT_ID = "facilitator_payment_id"
# Set when the rail itself replaced a submission that could never land by a new one of the
# same signed payment (x402 direct: another transaction took the relayer nonce): the try
# number it was counted as, the replaced and the new references (tx hash, relayer nonce)
# and why. The timeline names both (purchases.services.settle.settlement_events).
REPLACED_SUBMISSION = "replaced_submission"


@dataclass
class BatchLookup:
    """What a rail's batch look-up found: an outcome per attempt it could read, the attempts
    whose money's keeper did not answer at all (the whole batch: reconciliation backs them
    off together), and how many round trips it took."""

    outcomes: dict[int, SettlementOutcome] = field(default_factory=dict)
    unreachable: list[PaymentAttempt] = field(default_factory=list)
    round_trips: int = 0


# The context each attempt's own part of a batch look-up runs in (reconciliation's row
# isolation): one row that cannot be read never stops the others.
RowGuard = Callable[["PaymentAttempt"], AbstractContextManager[None]]


@dataclass(frozen=True)
class FundsLow:
    """A rail's own funds for moving money ran low (x402 direct: the relayer's gas), in the
    smallest unit of what it pays with (wei). `can_settle` False: payments are refused."""

    network: str
    address: str
    balance: int
    minimum: int
    can_settle: bool
    read_at: datetime


@dataclass(frozen=True)
class QuoteTerms:
    """What a quote asks for, as a rail needs it (payments never reads purchases' models)."""

    quote_id: str
    network: str
    asset: str
    amount: int
    pay_to: str
    duplicate_window_seconds: int
    # x402 #3053: "upfront" (settled before the work runs) is written in the 402's
    # `extra.paymentFlow`; "authorization" (settled after) is the wire default, never written.
    payment_flow: str = "upfront"
    # The window the buyer is asked to sign (maxTimeoutSeconds); None: the network's default.
    max_timeout_seconds: int | None = None


@dataclass(frozen=True)
class Presentation:
    """One presentation of payment, as its rail parsed it from the request.

    `key` is the payment id the request runs under (the client's, or one the rail derives
    from what makes the payment unique); `payer` is who pays (a wallet, or the buyer's ref
    for prepaid); `evidence` is the rail's own proof (an EIP-3009 authorization; None for
    prepaid, whose proof is the authenticated buyer).
    """

    rail: str
    key: str
    payer: str
    fingerprint: str
    quote_id: str | None
    evidence: Any = None
    accepted: dict[str, Any] | None = None  # x402: the requirements the client signed against
    summary: dict[str, Any] = field(default_factory=dict)  # what the timeline may show of it


@dataclass(frozen=True)
class Charge:
    """An attempt to write down, inside the orchestration's transaction."""

    purchase_id: int
    purchase_ref: str
    buyer_id: int | None
    presentation: Presentation
    terms: QuoteTerms
    idempotency_record_id: int
    search_from_block: int | None = None
    # What the rail's `verify` returned for this presentation (None: nothing, or not asked).
    context: Any = None


class PaymentRail(Protocol):
    name: ClassVar[str]
    # True: money moves when the attempt is recorded (one transaction, answer stored with it).
    # False: the attempt is recorded first, and settled after commit over the network.
    settles_when_recorded: ClassVar[bool]

    def requirements(self, *, terms: QuoteTerms) -> Any:
        """What the payer must present for this quote (None: nothing beyond the quote id)."""

    def verify(self, *, presentation: Presentation, terms: QuoteTerms, now: datetime) -> Any:
        """Cheap checks with no network I/O. Raises DomainError with the payer's fix.

        Returns the rail's context for this payment (what it derived to judge it; x402: the
        network, its settler, the parsed authorization), or None. The orchestration passes it
        on to `verify_funds` and `record` (`Charge.context`), which keeps it on the attempt,
        so no later step of the request derives it again."""

    def refuse_if_taken(self, *, presentation: Presentation, terms: QuoteTerms) -> None:
        """Raises DomainError naming the purchase the presentation's payment already pays, if
        any (verify may skip this where the payment id already proves it; the database's
        refusal of a second attempt brings the orchestration here)."""

    def verify_funds(
        self, *, presentation: Presentation, terms: QuoteTerms, context: Any = None
    ) -> int | None:
        """What only the money's keeper can say (the chain). Returns where a later look-up
        may start (a block number), or None. Raises DomainError. `context`: what `verify`
        returned (None: derive it)."""

    def record(self, *, charge: Charge) -> tuple[PaymentAttempt, Change]:
        """Write the attempt (and, for a rail that settles when recorded, move the money)."""

    def settle(
        self,
        *,
        attempt: PaymentAttempt,
        terms: QuoteTerms,
        now: datetime,
        wait_until: float | None = None,
    ) -> Settling:
        """The first broadcast of a recorded attempt (or, if another caller made it, a
        look-up). Never raises for network faults: unknown is PENDING. A wait for the money
        comes back as a value (`Settling`): the caller sleeps through it.

        `wait_until`: a time.monotonic() value the wait for the money must end by (the
        paying request's budget: what it has not proven by then is PENDING); never past the
        rail's own limit. None: the rail's own limit (a network's confirmation timeout)."""

    def look_up(self, *, attempt: PaymentAttempt, now: datetime) -> SettlementOutcome:
        """Where the attempt's money stands now."""

    def lookup_many(
        self,
        *,
        attempts: Sequence[PaymentAttempt],
        now: datetime,
        guard: RowGuard,
        chunk_size: int | None = None,
    ) -> BatchLookup:
        """Where many attempts' money stands, in as few round trips as the rail can (chunks
        of `chunk_size` where it batches). Each attempt's own part runs inside `guard(attempt)`;
        one that raises there is left out of the answer. A rail that settles when recorded
        has nothing to look up: an empty answer."""

    def heal(self, *, now: datetime, stats: Counter[str]) -> None:
        """Housekeeping that keeps later settlements from stalling (x402: our relayers'
        nonce gaps), counted into `stats`. Nothing for a rail with no such machinery."""

    def funds_watch(
        self, *, now: datetime, alert: Callable[[FundsLow], bool], stats: Counter[str]
    ) -> None:
        """Read the funds the rail itself pays with (x402 direct: each relayer's gas) and keep
        the reading where every process sees it; `alert` each one newly low (it returns
        whether the alert was delivered). Counted into `stats`. Nothing for a rail that
        spends nothing of ours."""

    def resend(
        self, *, attempt: PaymentAttempt, terms: QuoteTerms, now: datetime
    ) -> SettlementOutcome:
        """The same signed payment again (never a new signature from the payer)."""

    def never_reached(
        self, *, attempt: PaymentAttempt, outcome: SettlementOutcome, now: datetime
    ) -> bool:
        """True when `outcome` proves the payment never reached the money and sending the
        same one again is safe (see purchases.services.settle.resubmit)."""

    def describe(self, *, attempt: PaymentAttempt) -> dict[str, Any]:
        """What the timeline says about how this attempt reaches the money."""

    def held_can_land(self, *, attempt: PaymentAttempt, now: datetime) -> str:
        """A held attempt (the authorization flow), just before its work runs: "" while it
        can still be settled (or nobody can say now), else the reason it cannot (its
        authorization used, the payer's balance below it, its window closing). No
        transaction may be open."""

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
        """Give the attempt's money back the rail's way. Idempotent per (attempt, reason)."""


@cache  # read once per process: rail_for sits on every paid request's path
def _registry() -> dict[str, str]:
    registry: dict[str, str] = getattr(settings, "RAILS", RAILS)
    return registry


@receiver(setting_changed)
def _registry_changed(*, setting: str, **kwargs: Any) -> None:
    if setting == "RAILS":  # a test registering a rail through settings
        _registry.cache_clear()


def rail_for(name: str) -> PaymentRail:
    """Raises KeyError for a rail nobody registered."""
    return _rail_at(_registry()[name])


def rails() -> list[PaymentRail]:
    """Every configured rail, in the registry's order."""
    return [_rail_at(path) for path in _registry().values()]


def rails_settled_after_record() -> list[str]:
    """The rails whose attempts are settled over the network after they are recorded: the
    ones reconciliation looks up, resumes and watches."""
    return [rail.name for rail in rails() if not rail.settles_when_recorded]


@cache
def _rail_at(path: str) -> PaymentRail:
    module_name, _, attribute = path.rpartition(".")
    rail: PaymentRail = getattr(importlib.import_module(module_name), attribute)()
    return rail
