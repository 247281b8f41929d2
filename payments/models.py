"""Payment attempts, the prepaid ledger and refunds. Hangs beneath purchases."""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Q
from django.db.models.functions import Lower
from django_fsm import ConcurrentTransitionMixin, transition

from core.fsm import FSMField

LIVE_ATTEMPT_STATES = ("held", "recorded", "settlement_pending", "succeeded")
# Money not yet proven moved or not: what settlement and reconciliation look after. A held
# attempt is not among them: nobody may broadcast it until its work's terminal move says so.
PENDING_ATTEMPT_STATES = ("recorded", "settlement_pending")


class Rail(models.TextChoices):
    """How a purchase is paid. A new rail is one more value and one module in payments.rails."""

    PREPAID = "prepaid"
    X402 = "x402"


class PaymentAttempt(ConcurrentTransitionMixin, models.Model):
    """One try to pay a purchase, under one payment id (its key, which holds the id)."""

    class State(models.TextChoices):
        # The authorization flow: verified and kept while the paid work runs; never broadcast
        # until the work's terminal move captures it (back to recorded) or releases it.
        HELD = "held", "Verified, held until the work ends"
        RECORDED = "recorded", "Recorded, not yet settled"
        SETTLEMENT_PENDING = "settlement_pending", "Broadcast, finality unknown"
        SUCCEEDED = "succeeded"
        FAILED = "failed"

    purchase = models.ForeignKey(
        "purchases.Purchase", on_delete=models.PROTECT, related_name="payment_attempts"
    )
    rail = models.CharField(max_length=16)
    # The payment id lives once, on its key; compaction of the key covers the attempt too.
    idempotency_record = models.ForeignKey(
        "purchases.IdempotencyRecord",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="payment_attempts",
    )
    payer = models.CharField(max_length=64)
    network = models.CharField(max_length=64)
    asset = models.CharField(max_length=64)
    amount = models.PositiveBigIntegerField()
    fingerprint = models.CharField(
        max_length=64, help_text="SHA-256 of quote, amount, recipient, asset, network."
    )
    authorization = models.JSONField(
        null=True, blank=True, help_text="The signed authorization, as received."
    )
    tx_hash = models.CharField(max_length=80, null=True, blank=True)
    # Facilitator mode: the facilitator's own id for the settlement when it names one
    # (Circle's `paymentId`, answered before any hash is known); "" otherwise.
    # A database default too: rows written by hand (the scale bench's seed) name none.
    facilitator_payment_id = models.CharField(max_length=128, blank=True, default="", db_default="")
    # EIP-3009 evidence for reconciling "by (payer, nonce)" without parsing JSON.
    authorization_nonce = models.CharField(max_length=66, blank=True)
    valid_before_at = models.DateTimeField(null=True, blank=True)
    # Direct mode signs the relayer transaction before broadcasting: hash and bytes are
    # committed first, so a crash after the send still names the transaction.
    relayer_nonce = models.PositiveBigIntegerField(null=True, blank=True)
    raw_transaction = models.TextField(blank=True)
    # The relayer key that signed it: a gap check reads only its own key's rows at those
    # nonce numbers (an earlier key's sit at the same numbers). Blank on rows from before.
    relayer_address = models.CharField(max_length=42, blank=True, default="")
    broadcast_started_at = models.DateTimeField(null=True, blank=True)
    block_number = models.PositiveBigIntegerField(null=True, blank=True)
    # The chain head when we verified the authorization: its transfer cannot be older, so
    # log searches start here (public RPCs refuse a search from block 0).
    search_from_block = models.PositiveBigIntegerField(null=True, blank=True)
    # Reconciliation schedule: when to look again, and how many look-ups found no answer
    # (drives the backoff and, past the deadline, the escalation).
    next_check_at = models.DateTimeField(null=True, blank=True, db_index=True)
    unanswered_checks = models.PositiveIntegerField(default=0)
    # Times the same signed authorization was submitted again after the chain showed its
    # nonce unused and no broadcast of it pending; bounded, with backoff from the last try.
    resubmissions = models.PositiveIntegerField(default=0)
    resubmitted_at = models.DateTimeField(null=True, blank=True)
    # Finality (the network's X402_<NET>_FINALITY policy): a succeeded x402 attempt stays
    # watched, its next look at `next_check_at`, until its block is final; then `final_at`.
    # `reorged_at`: when its transfer was found undone by a reorg (kept as evidence: the
    # attempt was reopened and its same authorization settled again, or it was reversed).
    final_at = models.DateTimeField(null=True, blank=True)
    reorged_at = models.DateTimeField(null=True, blank=True)
    # What the last finality look saw while not final yet (unix `checked_at`, `policy`,
    # `block_number`, `depth` and `finality_depth`, or `finalized_block`): the case file says
    # how far from final it is without asking the chain on every page view.
    finality_seen = models.JSONField(default=dict, blank=True)
    settlement_reference = models.CharField(max_length=120, blank=True)
    # The books (backoffice.books_export) and signed receipts: the settling block's
    # timestamp (UTC, the settlement time finance reports and a receipt's `settledAt`), and
    # the receipt's gas figures and sender. Gas is a
    # cost of sale only when our relayer sent the transaction (direct mode); a facilitator
    # pays its own. Filled at confirmation (gas, direct mode) and when the block is read
    # (payments.rails.x402.books_evidence: the finality watch, or lazily by an export).
    block_at = models.DateTimeField(null=True, blank=True)
    gas_used = models.PositiveBigIntegerField(null=True, blank=True)
    effective_gas_price = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Wei per gas, from the receipt."
    )
    # A database default too: rows written by hand (the scale bench's seed) name no sender.
    sent_by = models.CharField(
        max_length=64,
        blank=True,
        default="",
        db_default="",
        help_text="The settlement transaction's sender, lower-case.",
    )
    reason_code = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    state = FSMField(default=State.RECORDED, choices=State.choices, protected=True)
    # Not a column: the rail's context for this attempt (its network, settler, parsed
    # authorization: payments.rails.base.Charge.context), kept on the instance the paying
    # request recorded (or a job read) so each later step does not derive it again.
    rail_context: Any = None

    class Meta:
        indexes = [
            models.Index(fields=["payer", "authorization_nonce"]),
            # Support searches by tx hash on any network (the unique index leads with network).
            models.Index(fields=["tx_hash"], name="attempt_tx_hash_scale"),
            # Reconciliation's claim (and resume, and the relayer heal) read only the pending
            # attempts: a few among millions, found without scanning the table.
            models.Index(
                fields=["network", "id"],
                condition=Q(state__in=PENDING_ATTEMPT_STATES),
                name="attempt_pending_scale",
            ),
            # A settlement that finds a nonce gap below its own looks up which of our
            # transactions held those nonces (payments.rails.x402.relayer.relayer_gap_close); the
            # case file names such a gap below a pending settlement (purchases.selectors).
            models.Index(
                fields=["network", "relayer_nonce"],
                condition=Q(relayer_nonce__isnull=False),
                name="attempt_relayer_nonce",
            ),
            # The finality watch reads only settled attempts not yet final: a few among
            # millions (every older one is final), found without scanning the table.
            models.Index(
                fields=["network", "id"],
                condition=Q(rail="x402", state="succeeded", final_at__isnull=True),
                name="attempt_unfinal_scale",
            ),
            # A books period reads settlements by their block's time.
            models.Index(
                fields=["block_at"],
                condition=Q(block_at__isnull=False),
                name="attempt_books_period",
            ),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["purchase"],
                condition=Q(state__in=LIVE_ATTEMPT_STATES),
                name="one_live_payment_attempt_per_purchase",
            ),
            models.UniqueConstraint(
                fields=["idempotency_record"],
                condition=Q(idempotency_record__isnull=False),
                name="one_attempt_per_payment_id",
            ),
            models.UniqueConstraint(
                fields=["network", "tx_hash"],
                condition=Q(tx_hash__isnull=False),
                name="unique_network_tx_hash",
            ),
            # An EIP-3009 authorization pays for exactly one purchase: the first presentation
            # wins, whatever payment id or quote a second one comes with.
            models.UniqueConstraint(
                fields=["network", "payer", "authorization_nonce"],
                condition=Q(state__in=LIVE_ATTEMPT_STATES) & ~Q(authorization_nonce=""),
                name="one_live_attempt_per_authorization",
            ),
        ]

    @transition(field=state, source=State.RECORDED, target=State.HELD)
    def hold(self) -> None:
        """Recorded under the authorization flow: kept, not settled, while the work runs."""

    @transition(field=state, source=State.HELD, target=State.RECORDED)
    def capture(self) -> None:
        """The work ended (succeeded, or unknown at the margin): settle it now."""

    @transition(field=state, source=State.HELD, target=State.FAILED)
    def release(self) -> None:
        """The work provably failed: this authorization is never settled by us."""
        self.reason_code = "authorization_released"

    @transition(field=state, source=State.RECORDED, target=State.SETTLEMENT_PENDING)
    def pend(self, *, tx_hash: str | None) -> None:
        self.tx_hash = tx_hash

    @transition(
        field=state, source=[State.RECORDED, State.SETTLEMENT_PENDING], target=State.SUCCEEDED
    )
    def succeed(self, *, settlement_reference: str) -> None:
        self.settlement_reference = settlement_reference

    @transition(field=state, source=[State.RECORDED, State.SETTLEMENT_PENDING], target=State.FAILED)
    def fail(self, *, reason_code: str) -> None:
        self.reason_code = reason_code

    @transition(field=state, source=State.SUCCEEDED, target=State.SETTLEMENT_PENDING)
    def reopen(self, *, reason_code: str, at: Any) -> None:
        """A reorg undid the transfer before it was final: the money is unproven again."""
        self.reason_code = reason_code
        self.reorged_at = at
        self.block_number = None
        # The block and its receipt are gone: the books wait for the new settlement's.
        self.block_at = self.gas_used = self.effective_gas_price = None
        self.sent_by = ""
        self.final_at = None

    def __str__(self) -> str:
        return f"{self.rail} attempt {self.pk} ({self.state})"


class LedgerEntry(models.Model):
    """The prepaid ledger, append-only. The balance is the sum of these; LedgerBalance keeps
    that sum as a running total, written in the same transaction as each entry."""

    class Kind(models.TextChoices):
        TOP_UP = "top_up"
        PURCHASE_DEBIT = "purchase_debit"
        REFUND_CREDIT = "refund_credit"
        ADJUSTMENT = "adjustment"

    buyer = models.ForeignKey(
        "purchases.Buyer", on_delete=models.PROTECT, related_name="ledger_entries"
    )
    asset = models.CharField(max_length=64)
    amount = models.BigIntegerField(
        help_text="Signed atomic units: credits positive, debits negative."
    )
    kind = models.CharField(max_length=32, choices=Kind.choices)
    # Unique per entry so a retried write can never post twice.
    reference = models.CharField(max_length=120, unique=True)
    purchase = models.ForeignKey(
        "purchases.Purchase",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="ledger_entries",
    )
    memo = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name_plural = "ledger entries"
        indexes = [models.Index(fields=["buyer", "asset"])]

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.pk is not None:
            raise ValueError("ledger entries are append-only")
        super().save(*args, **kwargs)

    def __str__(self) -> str:
        return f"{self.reference}: {self.amount}"


class Refund(ConcurrentTransitionMixin, models.Model):
    """A remedy linked to the original purchase and payment; the original is never rewritten."""

    class Method(models.TextChoices):
        LEDGER_CREDIT = "ledger_credit", "Credited to the prepaid balance"
        PAY_BACK = "pay_back", "Owed back to the payer (finance pays it)"

    class State(models.TextChoices):
        # Proposed by support: not owed until finance approves it.
        PROPOSED = "proposed"
        OWED = "owed"
        PAID = "paid"
        DECLINED = "declined"

    purchase = models.ForeignKey(
        "purchases.Purchase", on_delete=models.PROTECT, related_name="refunds"
    )
    payment_attempt = models.ForeignKey(
        PaymentAttempt, on_delete=models.PROTECT, related_name="refunds"
    )
    method = models.CharField(max_length=16, choices=Method.choices)
    amount = models.PositiveBigIntegerField()
    asset = models.CharField(max_length=64)
    network = models.CharField(max_length=64)
    payer = models.CharField(max_length=64)
    reason_code = models.CharField(max_length=64)
    transaction = models.CharField(
        max_length=80, blank=True, help_text="The transfer being refunded, if on chain."
    )
    paid_reference = models.CharField(max_length=200, blank=True)
    paid_by = models.CharField(max_length=150, blank=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    # A staff proposal (refund or compensation) and finance's decision on it.
    note = models.TextField(blank=True)
    proposed_by = models.CharField(max_length=150, blank=True)
    decided_by = models.CharField(max_length=150, blank=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    # Set once people were told. A sender claims the alert first (so two never both send
    # it); a claim older than the alert lease is a crashed sender's, and is sent again.
    alert_claimed_at = models.DateTimeField(null=True, blank=True)
    alerted_at = models.DateTimeField(null=True, blank=True)
    # A chain payback, as the chain showed it (payments.paybacks): the transaction and its
    # Transfer log that pays this refund, once finance named it or confirmed a match. While
    # it is not final (or the node did not answer) the refund stays owed, the claim pending:
    # `payback_code` says why, `payback_next_check_at` when it is looked at again.
    payback_tx_hash = models.CharField(max_length=80, blank=True)
    payback_log_index = models.PositiveIntegerField(null=True, blank=True)
    payback_block_number = models.PositiveBigIntegerField(null=True, blank=True)
    payback_code = models.CharField(max_length=40, blank=True)
    payback_evidence = models.JSONField(default=dict, blank=True)
    payback_checked_at = models.DateTimeField(null=True, blank=True)
    payback_next_check_at = models.DateTimeField(null=True, blank=True)
    # A transfer seen on chain that would pay this refund back (the payback watch found it):
    # offered to finance, who confirms it with one click; it closes nothing by itself.
    match_tx_hash = models.CharField(max_length=80, blank=True)
    match_log_index = models.PositiveIntegerField(null=True, blank=True)
    match_block_number = models.PositiveBigIntegerField(null=True, blank=True)
    match_found_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    state = FSMField(default=State.OWED, choices=State.choices, protected=True)

    class Meta:
        constraints = [
            # What the system records (late or duplicate money, a failed execution) is owed
            # once per payment and reason; staff may propose several partial refunds, one
            # open proposal per kind at a time (a double submit is the same proposal).
            models.UniqueConstraint(
                fields=["payment_attempt", "reason_code"],
                condition=Q(proposed_by=""),
                name="one_refund_per_payment_reason",
            ),
            models.UniqueConstraint(
                fields=["payment_attempt", "reason_code"],
                condition=Q(state="proposed"),
                name="one_open_proposal_per_payment_reason",
            ),
            # One ledger credit pays back one prepaid refund, however many people close them.
            models.UniqueConstraint(
                fields=["paid_reference"],
                condition=Q(method="ledger_credit") & ~Q(paid_reference=""),
                name="one_refund_per_ledger_credit",
            ),
            # One Transfer log pays back one refund (claimed or closed), and is offered as a
            # match to one refund: a batch transaction may pay several, one log each.
            models.UniqueConstraint(
                fields=["network", "payback_tx_hash", "payback_log_index"],
                condition=Q(payback_log_index__isnull=False),
                name="one_refund_per_payback_log",
            ),
            models.UniqueConstraint(
                fields=["network", "match_tx_hash", "match_log_index"],
                condition=Q(match_log_index__isnull=False),
                name="one_refund_per_payback_match",
            ),
        ]
        indexes = [
            # The refund CSV's order: its first row streams at once instead of after a sort
            # of every refund (7.5 s at a million).
            models.Index(fields=["created_at", "id"], name="refund_export_order"),
            # Support searches purchases by what a complaint names: the transfer refunded,
            # the pay-back's hash (as finance typed it: matched lower-case) and the wallet
            # owed (purchases.selectors.purchase_search_ids).
            models.Index(fields=["transaction"], name="refund_transaction_scale"),
            models.Index(Lower("paid_reference"), name="refund_paid_reference_lower"),
            models.Index(fields=["payer"], name="refund_payer_scale"),
            # The payback watch reads the claims due for another look: a few among millions.
            models.Index(
                fields=["payback_next_check_at"],
                condition=Q(payback_next_check_at__isnull=False),
                name="refund_payback_due",
            ),
        ]

    @transition(field=state, source=State.PROPOSED, target=State.OWED)
    def approve(self, *, by: str, at: Any) -> None:
        self.decided_by = by
        self.decided_at = at

    @transition(field=state, source=State.PROPOSED, target=State.DECLINED)
    def decline(self, *, by: str, at: Any) -> None:
        self.decided_by = by
        self.decided_at = at

    @transition(field=state, source=State.OWED, target=State.PAID)
    def mark_paid(self, *, reference: str, by: str, at: Any) -> None:
        self.paid_reference = reference
        self.paid_by = by
        self.paid_at = at

    @transition(field=state, source=State.OWED, target=State.PAID)
    def close_on_chain(self, *, tx_hash: str, log_index: int, block: int, by: str, at: Any) -> None:
        """Paid back by a final Transfer log the chain showed (payments.paybacks)."""
        self.paid_reference, self.paid_by, self.paid_at = tx_hash, by, at
        self.payback_tx_hash, self.payback_log_index = tx_hash, log_index
        self.payback_block_number, self.payback_next_check_at = block, None

    def __str__(self) -> str:
        return f"refund {self.pk} {self.amount} ({self.state})"


class RelayerAccount(models.Model):
    """Our broadcasting account on one network, and the next account nonce to hand out.

    Nonces are allocated under this row's lock, so concurrent settlements pipeline with
    distinct nonces instead of racing the node's pending count.
    """

    network = models.CharField(max_length=64)
    address = models.CharField(max_length=64)
    next_nonce = models.PositiveBigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)
    # The nonces' leases (payments.rails.x402.relayer.NONCE_LEASE), kept without a row per nonce:
    # the node's pending count as last seen, since when it has stood there, and the counter
    # then. Every nonce below `handed_out_by_then` was handed out by `pending_seen_since`, so
    # once the count has stood still a lease past that, their holders are gone.
    pending_seen = models.PositiveBigIntegerField(null=True)
    pending_seen_since = models.DateTimeField(null=True)
    handed_out_by_then = models.PositiveBigIntegerField(null=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["network", "address"], name="one_relayer_row_per_network"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.address} on {self.network} (next {self.next_nonce})"


# Wei are uint256: up to 78 decimal digits, past what a bigint holds (9.2 ETH).
WEI_DIGITS = 78


class RelayerGas(models.Model):
    """Our relayer's gas balance on one network as the beat last read it (one row per
    network and address), so every process judges the relayer's funds without an RPC call.

    A row apart from RelayerAccount: the beat's write never waits on the nonce row's lock,
    which every direct settlement takes. All amounts are wei (integers).
    """

    network = models.CharField(max_length=64)
    address = models.CharField(max_length=64)
    balance = models.DecimalField(max_digits=WEI_DIGITS, decimal_places=0)
    gas_price = models.DecimalField(max_digits=WEI_DIGITS, decimal_places=0)
    # What the node asks the relayer to hold to take one settlement: its gas limit at the
    # fee per gas we would sign now. Below it a broadcast cannot be admitted, let alone mined.
    settle_cost = models.DecimalField(max_digits=WEI_DIGITS, decimal_places=0)
    # The alert threshold in force at the reading (X402_<NET>_RELAYER_MIN_GAS or its default).
    minimum = models.DecimalField(max_digits=WEI_DIGITS, decimal_places=0)
    read_at = models.DateTimeField()
    # Set once the low-gas alert was delivered; cleared when the balance is back up.
    alerted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["network", "address"], name="one_gas_row_per_relayer"),
        ]

    def __str__(self) -> str:
        return f"{self.address} on {self.network}: {self.balance} wei at {self.read_at}"


class LedgerBalance(models.Model):
    """Running total of one buyer's ledger in one asset: a debit is one conditional UPDATE
    (it locks, checks and debits at once) instead of a SUM over the whole history.
    Reconciliation checks it against the entries (`ledger_balances_check`)."""

    buyer = models.ForeignKey(
        "purchases.Buyer", on_delete=models.PROTECT, related_name="ledger_balances"
    )
    asset = models.CharField(max_length=64)
    amount = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["buyer", "asset"], name="one_balance_per_asset"),
            models.CheckConstraint(
                condition=models.Q(amount__gte=0), name="prepaid_balance_never_negative"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.buyer_id} {self.asset}: {self.amount}"


class ExportBatch(models.Model):
    """One finished export, so a re-export can be compared: who, what was asked for, how many
    rows, the SHA-256 of the exact bytes sent. Written when the stream ends; a download the
    client abandoned is not a file anyone holds, so it records nothing."""

    kind = models.CharField(max_length=32, help_text="What was exported, e.g. refunds.")
    created_by = models.CharField(max_length=150)
    filters = models.JSONField(
        default=dict, blank=True, help_text="The list's filters and search, and the selection."
    )
    row_count = models.PositiveBigIntegerField(help_text="Data rows, header not counted.")
    first_created_at = models.DateTimeField(
        null=True, blank=True, help_text="Creation time of the oldest row in the file."
    )
    last_created_at = models.DateTimeField(
        null=True, blank=True, help_text="Creation time of the newest row in the file."
    )
    sha256 = models.CharField(max_length=64, help_text="SHA-256 of the file, hex.")
    started_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True, help_text="When the stream ended.")

    class Meta:
        verbose_name_plural = "export batches"
        indexes = [models.Index(fields=["kind", "created_at"])]

    def __str__(self) -> str:
        return f"{self.kind} export {self.pk}: {self.row_count} rows, {self.sha256[:12]}"


# A payout that is not over: it holds its refund (one live payout per refund) and its
# amount counts against the day's cap.
LIVE_PAYOUT_STATES = ("awaiting_approval", "recorded", "broadcast", "confirmed")
# Failure is final only on proof that no money moved (payments.payouts says which).
PROVABLE_FAILURES = ("payout_reverted", "payout_nonce_taken")


class Payout(ConcurrentTransitionMixin, models.Model):
    """One transfer of a refund's money from the refund wallet, recorded (signed, its hash
    and nonce known) before its broadcast, like a settlement: the same signed bytes are the
    only ones ever sent for it, so it can be re-sent but never paid twice."""

    class State(models.TextChoices):
        AWAITING_APPROVAL = "awaiting_approval", "Awaiting a second approver"
        RECORDED = "recorded", "Signed and recorded, not yet broadcast"
        BROADCAST = "broadcast", "Broadcast, not yet confirmed final"
        CONFIRMED = "confirmed", "Confirmed final: the refund is paid"
        FAILED = "failed", "Failed, provably: no money moved"
        CANCELLED = "cancelled", "Cancelled before it was signed"

    refund = models.ForeignKey(Refund, on_delete=models.PROTECT, related_name="payouts")
    network = models.CharField(max_length=64)
    asset = models.CharField(max_length=64, help_text="The token contract paid in.")
    destination = models.CharField(max_length=64)
    amount = models.PositiveBigIntegerField(help_text="Atomic units.")
    from_address = models.CharField(max_length=64, blank=True, help_text="The refund wallet.")
    nonce = models.PositiveBigIntegerField(null=True, blank=True)
    raw_transaction = models.TextField(blank=True)
    tx_hash = models.CharField(max_length=80, null=True, blank=True)
    # Who approved: a destination other than the payer's needs a second, different person.
    approved_by = models.CharField(max_length=150)
    approved_at = models.DateTimeField()
    second_approved_by = models.CharField(max_length=150, blank=True)
    second_approved_at = models.DateTimeField(null=True, blank=True)
    # The UTC day whose cap this payout counts against (the day it was approved).
    cap_day = models.DateField()
    broadcast_started_at = models.DateTimeField(null=True, blank=True)
    broadcast_at = models.DateTimeField(null=True, blank=True)
    broadcasts = models.PositiveIntegerField(default=0, help_text="Sends of the same bytes.")
    # What a pending payout waits for (payments.payouts.Awaiting) and when it is looked at
    # next; what the last look saw.
    awaiting = models.CharField(max_length=40, blank=True)
    next_check_at = models.DateTimeField(null=True, blank=True)
    checked_at = models.DateTimeField(null=True, blank=True)
    evidence = models.JSONField(default=dict, blank=True)
    block_number = models.PositiveBigIntegerField(null=True, blank=True)
    confirmed_at = models.DateTimeField(null=True, blank=True)
    reason_code = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    state = FSMField(default=State.RECORDED, choices=State.choices, protected=True)

    class Meta:
        constraints = [
            # Never a second transfer for one refund while one may still land or has landed.
            models.UniqueConstraint(
                fields=["refund"],
                condition=Q(state__in=LIVE_PAYOUT_STATES),
                name="one_live_payout_per_refund",
            ),
            models.UniqueConstraint(
                fields=["network", "tx_hash"],
                condition=Q(tx_hash__isnull=False),
                name="unique_payout_tx_hash",
            ),
            # One signed transaction per nonce of the refund wallet.
            models.UniqueConstraint(
                fields=["network", "from_address", "nonce"],
                condition=Q(nonce__isnull=False),
                name="one_payout_per_wallet_nonce",
            ),
        ]
        indexes = [
            # The reconcile job reads the payouts due: a few among many.
            models.Index(
                fields=["next_check_at"],
                condition=Q(state__in=("recorded", "broadcast")),
                name="payout_due",
            ),
            models.Index(fields=["network", "asset", "cap_day"], name="payout_cap_day"),
        ]

    def has_proof(self) -> bool:
        return self.reason_code in PROVABLE_FAILURES

    @transition(field=state, source=State.AWAITING_APPROVAL, target=State.RECORDED)
    def approve_second(self, *, by: str, at: Any) -> None:
        self.second_approved_by, self.second_approved_at = by, at

    @transition(field=state, source=State.AWAITING_APPROVAL, target=State.CANCELLED)
    def cancel(self, *, reason_code: str) -> None:
        self.reason_code = reason_code

    @transition(field=state, source=State.RECORDED, target=State.BROADCAST)
    def mark_broadcast(self, *, at: Any) -> None:
        self.broadcast_at = at

    @transition(field=state, source=State.BROADCAST, target=State.CONFIRMED)
    def confirm(self, *, block: int, at: Any) -> None:
        self.block_number, self.confirmed_at = block, at
        self.awaiting, self.next_check_at = "", None

    @transition(
        field=state,
        source=[State.RECORDED, State.BROADCAST],
        target=State.FAILED,
        conditions=[has_proof],  # type: ignore[list-item]
    )
    def fail(self) -> None:
        self.awaiting, self.next_check_at = "", None

    def __str__(self) -> str:
        return f"payout {self.pk} {self.amount} to {self.destination} ({self.state})"


class PayoutWallet(models.Model):
    """The refund wallet on one network and its next nonce, handed out under this row's
    lock (as the relayer's), so concurrent approvals sign distinct nonces."""

    network = models.CharField(max_length=64)
    address = models.CharField(max_length=64)
    next_nonce = models.PositiveBigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["network", "address"], name="one_payout_wallet_row"),
        ]

    def __str__(self) -> str:
        return f"refund wallet {self.address} on {self.network} (next {self.next_nonce})"


class PayoutDay(models.Model):
    """The lock of one day's payout cap in one asset: approvals of that day and asset take
    it before they sum what the day already holds, so two cannot both pass the cap."""

    network = models.CharField(max_length=64)
    asset = models.CharField(max_length=64)
    day = models.DateField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["network", "asset", "day"], name="one_payout_day"),
        ]

    def __str__(self) -> str:
        return f"payouts of {self.day} in {self.asset} on {self.network}"
