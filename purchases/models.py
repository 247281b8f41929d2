"""The aggregate root: what is sold, who buys it, quotes, purchases and their timeline."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import models
from django.db.models import Q
from django.db.models.functions import Lower
from django_fsm import ConcurrentTransitionMixin, transition

from core.fsm import FSMField
from core.refs import new_ref
from fulfillment.executors.top_up import TOP_UP_EXECUTOR
from payments.models import Rail


class Offering(models.Model):
    class RefundPolicy(models.TextChoices):
        REFUND = "refund", "Refund automatically"
        ESCALATE = "escalate", "Escalate to support"

    class LatePaymentPolicy(models.TextChoices):
        REFUND = "refund", "Refund it (never resurrect released stock)"
        FULFIL = "fulfil", "Fulfil it if stock is still free, else refund"

    class DeliveryCondition(models.TextChoices):
        SETTLED = "settled", "After confirmed settlement"
        VERIFIED = "verified", "After payment verification"
        # Verify and hold the authorization, run the work, settle only if it did not provably
        # fail; the result is released once settled (docs/x402.md, "Payment flows").
        AUTHORIZATION = "authorization", "Run first, settle after (authorization flow)"

    slug = models.SlugField(max_length=64, unique=True, help_text="Operation name agents ask for.")
    title = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    price = models.PositiveBigIntegerField(
        help_text="Atomic units of the asset (USDC: 6 decimals)."
    )
    asset = models.CharField(
        max_length=64, help_text="Token contract address, or a symbol for the ledger."
    )
    asset_symbol = models.CharField(max_length=16, default="USDC")
    asset_decimals = models.PositiveSmallIntegerField(default=6)
    network = models.CharField(max_length=64, help_text="CAIP-2 id, e.g. eip155:84532.")
    pay_to = models.CharField(max_length=64, help_text="Recipient wallet.")
    stock = models.PositiveIntegerField(
        null=True, blank=True, help_text="Units still free to quote; empty for unlimited."
    )
    input_schema = models.JSONField(default=dict, blank=True)
    # Anonymous 402s store their input on a quote: without a cap, anyone can park up to the
    # request body limit in our database per request.
    max_input_bytes = models.PositiveIntegerField(
        default=64 * 1024,
        help_text="Largest input (bytes of canonical JSON) a quote for this offering accepts.",
    )
    volatile_fields = models.JSONField(
        default=list,
        blank=True,
        help_text="Input fields ignored when deciding two requests are the same.",
    )
    result_retention = models.DurationField(default=timedelta(days=7))
    executor = models.CharField(max_length=64)
    refund_policy = models.CharField(
        max_length=16, choices=RefundPolicy.choices, default=RefundPolicy.REFUND
    )
    delivery_condition = models.CharField(
        max_length=16, choices=DeliveryCondition.choices, default=DeliveryCondition.SETTLED
    )
    irreversible = models.BooleanField(default=False)
    late_payment_policy = models.CharField(
        max_length=16,
        choices=LatePaymentPolicy.choices,
        default=LatePaymentPolicy.REFUND,
        help_text="What to do with money that lands after the purchase failed.",
    )
    duplicate_window = models.DurationField(
        default=timedelta(minutes=10),
        help_text="A new payment by the same payer for the same input inside this window is "
        "answered with the existing purchase and never charged (0 turns it off).",
    )
    expected_run_time = models.DurationField(
        default=timedelta(seconds=10),
        help_text="How long a paid request waits for the result before answering 202.",
    )
    version = models.PositiveIntegerField(default=1, help_text="Bumped whenever the terms change.")
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Offerings as code (docs/offerings-as-code.md): the catalog file that last applied this
    # offering. Its next apply puts the file's values back over any edit made in the admin.
    catalog_file = models.CharField(
        max_length=200,
        blank=True,
        editable=False,
        help_text="Catalog file that owns it; empty: the admin.",
    )
    catalog_sha256 = models.CharField(max_length=64, blank=True, editable=False)
    # The stock the file said when last applied: sales take stock down, so a file's stock is
    # written again only when the file's own number changes (a restock), never on each apply.
    catalog_stock = models.PositiveIntegerField(null=True, blank=True, editable=False)

    @property
    def settles_after_work(self) -> bool:
        """The authorization flow: verify and hold, run the work, settle only what it earned.
        Never for a top-up, whose credit can be spent at once: settled first, whatever the
        offering says (docs/x402.md#top-ups)."""
        return (
            self.delivery_condition == self.DeliveryCondition.AUTHORIZATION
            and self.executor != TOP_UP_EXECUTOR
        )

    def __str__(self) -> str:
        return self.slug


class Buyer(models.Model):
    """An agent account. Authenticates with API keys; never a Django user."""

    ref = models.CharField(max_length=40, unique=True, editable=False)
    name = models.CharField(max_length=200)
    spend_cap = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="Most this buyer may spend per rolling window, atomic units.",
    )
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    # DRF treats the authenticated principal as a user.
    is_authenticated = True
    is_anonymous = False

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.ref:
            self.ref = new_ref("buy")
        super().save(*args, **kwargs)

    def __str__(self) -> str:
        return f"{self.name} ({self.ref})"


class ApiKey(models.Model):
    buyer = models.ForeignKey(Buyer, on_delete=models.CASCADE, related_name="api_keys")
    prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(
        max_length=64, help_text="SHA-256 of the secret; the key is shown once."
    )
    label = models.CharField(max_length=100, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.buyer.name})"


class BuyerWallet(models.Model):
    buyer = models.ForeignKey(Buyer, on_delete=models.CASCADE, related_name="wallets")
    address = models.CharField(max_length=64, unique=True, help_text="Lower-case 0x address.")

    def __str__(self) -> str:
        return self.address


class Quote(ConcurrentTransitionMixin, models.Model):
    class State(models.TextChoices):
        OPEN = "open"
        ACCEPTED = "accepted"
        EXPIRED = "expired"

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    offering = models.ForeignKey(Offering, on_delete=models.PROTECT, related_name="quotes")
    buyer = models.ForeignKey(
        Buyer, on_delete=models.PROTECT, null=True, blank=True, related_name="quotes"
    )
    quote_key = models.CharField(
        max_length=64, help_text="Deterministic: buyer, offering, version, input."
    )
    canonical_input = models.JSONField()
    input_hash = models.CharField(max_length=64)
    price = models.PositiveBigIntegerField()
    asset = models.CharField(max_length=64)
    network = models.CharField(max_length=64)
    pay_to = models.CharField(max_length=64)
    offering_version = models.PositiveIntegerField()
    holds_stock = models.BooleanField(default=False)
    expires_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    state = FSMField(default=State.OPEN, choices=State.choices, protected=True)

    class Meta:
        constraints = [
            # The deterministic quote key: two racing requests cannot both open a quote.
            models.UniqueConstraint(
                fields=["quote_key"], condition=Q(state="open"), name="one_open_quote_per_key"
            ),
        ]

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = new_ref("qt")
        super().save(*args, **kwargs)

    @transition(field=state, source=State.OPEN, target=State.ACCEPTED)
    def accept(self) -> None:
        pass

    @transition(field=state, source=State.OPEN, target=State.EXPIRED)
    def expire(self) -> None:
        self.holds_stock = False

    def __str__(self) -> str:
        return self.public_id


class Purchase(ConcurrentTransitionMixin, models.Model):
    """The durable identity of a sale. Payment and fulfilment are tracked separately."""

    class PaymentState(models.TextChoices):
        UNPAID = "unpaid"
        PAYING = "paying"
        SETTLEMENT_PENDING = "settlement_pending"
        PAID = "paid"
        FAILED = "failed"
        # Failed for good: every authorization it received is provably unusable.
        VOID = "void"
        # The result was delivered, then a reorg undid the payment and its authorization
        # could no longer be settled again (window closed, or nonce spent elsewhere).
        REVERSED = "reversed"
        # The authorization flow: verified and held while the work runs (never broadcast).
        AUTHORIZED = "authorized"
        # The work provably failed under the authorization flow: we never settle it. Not
        # failed (which reopens the quote) nor void: a landing by anyone holding the
        # authorization before its validBefore is late money, owed back.
        RELEASED = "released"

    class FulfillmentState(models.TextChoices):
        NOT_STARTED = "not_started"
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        UNKNOWN = "unknown"

    class Channel(models.TextChoices):
        """The door the purchase came in by; the rail says how it was paid."""

        HTTP = "http", "x402 paid URL"
        API = "api", "REST API"
        MCP = "mcp", "MCP tool call"

    ref = models.CharField(max_length=40, unique=True, editable=False)
    # OneToOne is the database constraint "one purchase per quote".
    quote = models.OneToOneField(Quote, on_delete=models.PROTECT, related_name="purchase")
    offering = models.ForeignKey(Offering, on_delete=models.PROTECT, related_name="purchases")
    buyer = models.ForeignKey(
        Buyer, on_delete=models.PROTECT, null=True, blank=True, related_name="purchases"
    )
    amount = models.PositiveBigIntegerField()
    asset = models.CharField(max_length=64)
    network = models.CharField(max_length=64)
    rail = models.CharField(max_length=16, choices=Rail.choices)
    channel = models.CharField(max_length=8, choices=Channel.choices, default=Channel.HTTP)
    payer = models.CharField(max_length=64, blank=True, help_text="Buyer ref or wallet address.")
    reason_code = models.CharField(max_length=64, blank=True)
    # Same payer, buyer, offering, canonical input and copy label: a re-signed retry of this
    # purchase inside the offering's duplicate window is answered with it, never charged.
    duplicate_key = models.CharField(max_length=64, blank=True, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    payment_state = FSMField(
        default=PaymentState.UNPAID, choices=PaymentState.choices, protected=True
    )
    fulfillment_state = FSMField(
        default=FulfillmentState.NOT_STARTED, choices=FulfillmentState.choices, protected=True
    )

    class Meta:
        indexes = [
            models.Index(fields=["payment_state", "updated_at"]),
            models.Index(fields=["fulfillment_state", "updated_at"]),
            # The admin at a million rows: newest first, and search by payer wallet (stored
            # checksummed or lower-case, matched lower-case).
            models.Index(fields=["created_at"], name="purchase_created_at_scale"),
            models.Index(Lower("payer"), name="purchase_payer_lower_scale"),
        ]

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.ref:
            self.ref = new_ref("pur")
        super().save(*args, **kwargs)

    def __str__(self) -> str:
        return self.ref

    # --- payment boundary -------------------------------------------------------
    @transition(
        field=payment_state,
        source=[PaymentState.UNPAID, PaymentState.FAILED],
        target=PaymentState.PAYING,
    )
    def payment_begin(self) -> None:
        self.reason_code = ""

    @transition(
        field=payment_state,
        source=[PaymentState.UNPAID, PaymentState.FAILED],
        target=PaymentState.AUTHORIZED,
    )
    def payment_authorize(self) -> None:
        self.reason_code = ""

    @transition(field=payment_state, source=PaymentState.AUTHORIZED, target=PaymentState.PAYING)
    def payment_capture(self) -> None:
        pass

    @transition(field=payment_state, source=PaymentState.AUTHORIZED, target=PaymentState.RELEASED)
    def payment_release(self, reason_code: str) -> None:
        self.reason_code = reason_code

    @transition(
        field=payment_state, source=PaymentState.PAYING, target=PaymentState.SETTLEMENT_PENDING
    )
    def payment_pend(self, reason_code: str = "settlement_pending") -> None:
        self.reason_code = reason_code

    @transition(
        field=payment_state,
        source=[PaymentState.UNPAID, PaymentState.PAYING, PaymentState.SETTLEMENT_PENDING],
        target=PaymentState.PAID,
    )
    def payment_complete(self, paid_at: Any) -> None:
        self.paid_at = paid_at
        self.reason_code = ""

    @transition(
        field=payment_state,
        source=[PaymentState.PAYING, PaymentState.SETTLEMENT_PENDING],
        target=PaymentState.FAILED,
    )
    def payment_fail(self, reason_code: str) -> None:
        self.reason_code = reason_code

    @transition(
        field=payment_state,
        source=[PaymentState.FAILED, PaymentState.VOID],
        target=PaymentState.PAID,
    )
    def payment_recover(self, paid_at: Any) -> None:
        """Money landed after we recorded a failure and the offering fulfils late payments."""
        self.paid_at = paid_at
        self.reason_code = "late_settlement_fulfilled"

    @transition(
        field=payment_state, source=PaymentState.PAID, target=PaymentState.SETTLEMENT_PENDING
    )
    def payment_reopen(self, reason_code: str) -> None:
        """A reorg undid the settled transfer before it was final: pending again, while the
        same authorization is settled again."""
        self.reason_code = reason_code

    @transition(
        field=payment_state, source=PaymentState.SETTLEMENT_PENDING, target=PaymentState.REVERSED
    )
    def payment_reverse(self, reason_code: str) -> None:
        self.reason_code = reason_code

    @transition(field=payment_state, source=PaymentState.FAILED, target=PaymentState.VOID)
    def payment_void(self, reason_code: str) -> None:
        self.reason_code = reason_code

    # --- execute boundary -------------------------------------------------------
    def is_payment_sufficient_for_execution(self) -> bool:
        """Settled; verified and broadcast when the offering delivers on verification; or
        verified and held under the authorization flow (its work runs before the money)."""
        state = str(self.payment_state)
        if state == self.PaymentState.PAID:
            return True
        # A top-up's work is a credit that can be spent at once: only a settled payment, never
        # one merely verified or held, whatever the offering says (docs/x402.md#top-ups).
        if self.offering.executor == TOP_UP_EXECUTOR:
            return False
        if self.offering.settles_after_work:
            return state == self.PaymentState.AUTHORIZED
        return (
            self.offering.delivery_condition == Offering.DeliveryCondition.VERIFIED
            and state
            in (
                self.PaymentState.PAYING,
                self.PaymentState.SETTLEMENT_PENDING,
            )
        )

    def is_payment_sufficient_for_delivery(self) -> bool:
        """The result may be released: as for execution, except that under the
        authorization flow only a settled payment releases it."""
        if self.offering.settles_after_work:
            return str(self.payment_state) == self.PaymentState.PAID
        return self.is_payment_sufficient_for_execution()

    @transition(
        field=fulfillment_state,
        source=FulfillmentState.NOT_STARTED,
        target=FulfillmentState.QUEUED,
        conditions=[is_payment_sufficient_for_execution],  # type: ignore[list-item]
    )
    def fulfillment_queue(self) -> None:
        pass

    @transition(
        field=fulfillment_state, source=FulfillmentState.QUEUED, target=FulfillmentState.RUNNING
    )
    def fulfillment_start(self) -> None:
        pass

    @transition(
        field=fulfillment_state,
        source=[FulfillmentState.RUNNING, FulfillmentState.UNKNOWN],
        target=FulfillmentState.SUCCEEDED,
    )
    def fulfillment_succeed(self) -> None:
        self.reason_code = ""

    @transition(
        field=fulfillment_state,
        source=[FulfillmentState.RUNNING, FulfillmentState.UNKNOWN],
        target=FulfillmentState.FAILED,
    )
    def fulfillment_fail(self, reason_code: str) -> None:
        self.reason_code = reason_code

    @transition(
        field=fulfillment_state, source=FulfillmentState.RUNNING, target=FulfillmentState.UNKNOWN
    )
    def fulfillment_lose_track(self, reason_code: str) -> None:
        self.reason_code = reason_code


class DuplicateGuard(models.Model):
    """One row per duplicate key, locked while a payment for that key is decided, so racing
    re-signed payments for one (payer, offering, input) serialize and only one is charged."""

    key = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.key


class WalletSignIn(models.Model):
    """A sign-in-with-x proof that was honoured: its nonce, used once (the unique index), kept
    until the challenge expires (then pruned; the purchase's timeline keeps the evidence)."""

    nonce = models.CharField(max_length=64, unique=True)
    address = models.CharField(max_length=64)
    purchase = models.ForeignKey(Purchase, on_delete=models.CASCADE, related_name="sign_ins")
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(db_index=True)

    def __str__(self) -> str:
        return f"sign-in {self.nonce} by {self.address}"


class Escalation(ConcurrentTransitionMixin, models.Model):
    """A purchase whose state could not be established safely, with an owner and a deadline."""

    class State(models.TextChoices):
        OPEN = "open"
        RESOLVED = "resolved"

    class OwnerRole(models.TextChoices):
        BUYER = "buyer"
        RECONCILIATION = "reconciliation"
        SUPPORT = "support"
        FINANCE = "finance"

    purchase = models.ForeignKey(Purchase, on_delete=models.PROTECT, related_name="escalations")
    owner = models.CharField(max_length=16, choices=OwnerRole.choices)
    reason_code = models.CharField(max_length=64)
    details = models.JSONField(default=dict, blank=True)
    deadline_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.CharField(max_length=150, blank=True)
    resolution = models.TextField(blank=True)
    # Why it was closed, from a fixed list (purchases.case_file.RESOLUTION_CODES), so closed
    # cases can be counted; `resolution` keeps the words.
    resolution_code = models.CharField(max_length=64, blank=True)
    # The last staff hand-over: who assigned the current owner and deadline, and why.
    note = models.TextField(blank=True)
    assigned_by = models.CharField(max_length=150, blank=True)
    assigned_at = models.DateTimeField(null=True, blank=True)
    # The person (a staff username) working it now, besides the owning role: "assign to me".
    assignee = models.CharField(max_length=150, blank=True, db_index=True)
    # Told to a person once (see purchases/services/shared/alerts.py): claimed, then delivered.
    alert_claimed_at = models.DateTimeField(null=True, blank=True)
    alerted_at = models.DateTimeField(null=True, blank=True)
    state = FSMField(default=State.OPEN, choices=State.choices, protected=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["purchase", "reason_code"],
                condition=Q(state="open"),
                name="one_open_escalation_per_reason",
            ),
        ]

    @transition(field=state, source=State.OPEN, target=State.RESOLVED)
    def resolve(self, *, by: str, resolution: str, at: Any, code: str = "") -> None:
        self.resolved_by = by
        self.resolution = resolution
        self.resolved_at = at
        self.resolution_code = code

    def __str__(self) -> str:
        return f"{self.purchase.ref}: {self.reason_code} -> {self.owner}"


def new_refund_request_ref() -> str:
    return new_ref("rfr")


class RefundRequest(ConcurrentTransitionMixin, models.Model):
    """A buyer asking for its money back (docs/api.md, "Refund requests"). Staff decide it:
    approved, it becomes a refund proposal on the existing path (finance approves, then the
    payout or the balance credit); denied, with a reason code the buyer reads. The refund it
    fed, not this row, says whether money moved."""

    class State(models.TextChoices):
        OPEN = "open"
        APPROVED = "approved"
        DENIED = "denied"

    class Channel(models.TextChoices):
        API_KEY = "api_key", "API key"
        WALLET_SIGNATURE = "wallet_signature", "Signed by the paying wallet"

    # Why a request was denied, for the buyer (an API contract: never rename one).
    DENIAL_CODES: dict[str, str] = {
        "delivered_as_described": "The result was delivered as the offering describes.",
        "not_eligible": "This purchase is not eligible for a refund under the seller's terms.",
        "insufficient_evidence": "The request does not show what went wrong.",
        "already_refunded": "The money was already returned another way.",
        "duplicate_request": "Another request covers the same money.",
    }

    public_id = models.CharField(
        max_length=40, unique=True, default=new_refund_request_ref, editable=False
    )
    purchase = models.ForeignKey(Purchase, on_delete=models.PROTECT, related_name="refund_requests")
    channel = models.CharField(max_length=16, choices=Channel.choices)
    # Who asked: the API key's buyer ref, or the wallet that signed.
    requested_by = models.CharField(max_length=64)
    amount = models.PositiveBigIntegerField()
    asset = models.CharField(max_length=64)
    reason = models.TextField(blank=True)
    # The buyer's key for this request, scoped to the purchase; with the request's
    # fingerprint, a replay answers the same request and a changed one is refused.
    idempotency_key = models.CharField(max_length=128)
    request_fingerprint = models.CharField(max_length=64)
    # The wallet path's proof: the signed message and its signature, kept as evidence.
    signed_message = models.JSONField(default=dict, blank=True)
    signature = models.CharField(max_length=200, blank=True)
    # The queue: the staff member working it and when it is due (REFUND_REQUEST_DEADLINE).
    assignee = models.CharField(max_length=150, blank=True, db_index=True)
    deadline_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    decided_by = models.CharField(max_length=150, blank=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    denial_code = models.CharField(max_length=64, blank=True)
    decision_note = models.TextField(blank=True)
    # The proposal an approval fed (payments.Refund): its state is the money's.
    refund = models.OneToOneField(
        "payments.Refund",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="refund_request",
    )
    state = FSMField(default=State.OPEN, choices=State.choices, protected=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["purchase"], condition=Q(state="open"), name="one_open_refund_request"
            ),
            models.UniqueConstraint(
                fields=["purchase", "idempotency_key"], name="one_refund_request_per_key"
            ),
        ]
        indexes = [
            # The queue: open ones by deadline.
            models.Index(
                fields=["deadline_at"], condition=Q(state="open"), name="refund_request_queue"
            ),
        ]

    @transition(field=state, source=State.OPEN, target=State.APPROVED)
    def approve(self, *, by: str, at: Any, refund_id: int, note: str) -> None:
        self.decided_by, self.decided_at = by, at
        self.refund_id, self.decision_note = refund_id, note

    @transition(field=state, source=State.OPEN, target=State.DENIED)
    def deny(self, *, by: str, at: Any, code: str, note: str) -> None:
        self.decided_by, self.decided_at = by, at
        self.denial_code, self.decision_note = code, note

    def __str__(self) -> str:
        return f"{self.public_id} ({self.state})"


class PurchaseEvent(models.Model):
    """Append-only timeline, written in the same transaction as every transition."""

    class ActorType(models.TextChoices):
        AGENT = "agent"
        STAFF = "staff"
        SYSTEM = "system"

    purchase = models.ForeignKey(
        Purchase, on_delete=models.PROTECT, null=True, blank=True, related_name="events"
    )
    quote = models.ForeignKey(
        Quote, on_delete=models.PROTECT, null=True, blank=True, related_name="events"
    )
    subject = models.CharField(max_length=64, help_text="What changed, e.g. purchase.payment.")
    from_state = models.CharField(max_length=32, blank=True)
    to_state = models.CharField(max_length=32, blank=True)
    actor_type = models.CharField(max_length=16, choices=ActorType.choices)
    actor = models.CharField(max_length=150, blank=True)
    reason_code = models.CharField(max_length=64, blank=True)
    evidence = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["created_at", "pk"]

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.pk is not None:
            raise ValueError("purchase events are append-only")
        super().save(*args, **kwargs)

    def __str__(self) -> str:
        return f"{self.subject}: {self.from_state} -> {self.to_state} ({self.reason_code})"


class IdempotencyRecord(ConcurrentTransitionMixin, models.Model):
    """One payment id in one scope: who used it, for what request, and the answer given."""

    class State(models.TextChoices):
        IN_FLIGHT = "in_flight"
        COMPLETED = "completed"

    class RecoveryPoint(models.TextChoices):
        """The last phase committed under this key: a retry resumes exactly after it."""

        STARTED = "started", "Claimed; nothing recorded yet"
        PAYMENT_RECORDED = "payment_recorded", "Purchase and payment attempt committed"
        FINISHED = "finished", "Answer stored"

    scope = models.CharField(max_length=32, help_text="Endpoint family the key belongs to.")
    key = models.CharField(max_length=128)
    principal = models.CharField(max_length=64, help_text="Buyer ref or payer wallet that sent it.")
    request_fingerprint = models.CharField(max_length=64)
    purchase = models.ForeignKey(
        Purchase,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="idempotency_records",
    )
    lease_token = models.CharField(max_length=32, blank=True)
    locked_until = models.DateTimeField(null=True, blank=True)
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_body = models.JSONField(null=True, blank=True)
    # The body's exact bytes (jsonb reorders keys): what a replay sends, byte for byte.
    response_text = models.TextField(blank=True)
    response_headers = models.JSONField(default=dict, blank=True)
    # x402 success and pending answers follow the purchase as it moves (pending -> paid ->
    # result), so a replay is answered from the purchase's current state, not a snapshot.
    answer_is_live = models.BooleanField(default=False)
    recovery_point = models.CharField(
        max_length=24, choices=RecoveryPoint.choices, default=RecoveryPoint.STARTED
    )
    # After retention the key is kept only as its hash (and the purchase, for the receipt).
    compacted_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    completed_at = models.DateTimeField(null=True, blank=True)
    state = FSMField(default=State.IN_FLIGHT, choices=State.choices, protected=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["scope", "key"], name="unique_payment_id_per_scope"),
        ]
        # Support searches by payment id whatever its scope.
        indexes = [models.Index(fields=["key"], name="idempotency_key_scale")]

    @transition(field=state, source=State.IN_FLIGHT, target=State.COMPLETED)
    def complete(self, *, status: int, body: Any, headers: dict[str, str], at: Any) -> None:
        self.response_status = status
        self.response_body = body
        self.response_headers = headers
        self.completed_at = at
        self.locked_until = None

    def __str__(self) -> str:
        return f"{self.scope}:{self.key[:6]}…"


class JobRun(models.Model):
    """One run of a reconciliation job: what it did, for the timeline, metrics and lag."""

    job = models.CharField(max_length=64, db_index=True)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    stats = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-started_at"]

    def __str__(self) -> str:
        return f"{self.job} at {self.started_at:%Y-%m-%d %H:%M:%S}"


# Still owed to the broker: neither handed to it nor retired. The relay loop's due index,
# the one-per-dedup-key constraint and the backlog metric all mean this.
OUTBOX_WAITING = Q(relayed_at__isnull=True, retired_at__isnull=True)


class OutboxMessage(models.Model):
    """A job staged in the same transaction as the change that calls for it.

    The relay (`purchases.services.shared.outbox`) hands it to Celery after the commit, at least
    once; a rolled-back change leaves no message. `kwargs` holds ids only: the task re-reads
    and re-checks the rows it names. A message leaves the outbox relayed (handed to the
    broker) or retired (its job was done by the request that staged it, which held it back
    from the broker to run the job itself: never sent).
    """

    job = models.CharField(max_length=64, help_text="Job name, a key of settings.OUTBOX_JOBS.")
    kwargs = models.JSONField(default=dict, blank=True)
    dedup_key = models.CharField(max_length=200, null=True, blank=True)
    created_at = models.DateTimeField()
    available_at = models.DateTimeField(help_text="The relay loop leaves it alone until then.")
    attempts = models.PositiveIntegerField(default=0)
    relayed_at = models.DateTimeField(
        null=True, blank=True, help_text="When it was handed to the broker."
    )
    retired_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text=(
            "When the request that staged it finished its job itself (a paid request running "
            "fast work inline): never sent to the broker."
        ),
    )
    last_error = models.TextField(blank=True)

    class Meta:
        constraints = [
            # Unique among the waiting messages only: staging the same job for the same row
            # twice in one flow stages it once, while a job relayed or retired earlier (the
            # sweeper re-staging an execution nobody ran) can be staged again.
            models.UniqueConstraint(
                fields=["dedup_key"],
                condition=OUTBOX_WAITING,
                name="one_waiting_outbox_message_per_key",
            ),
        ]
        indexes = [
            models.Index(
                fields=["available_at"], condition=OUTBOX_WAITING, name="outbox_waiting_by_due"
            ),
            models.Index(
                fields=["relayed_at"],
                condition=Q(relayed_at__isnull=False),
                name="outbox_relayed_by_age",
            ),
            models.Index(
                fields=["retired_at"],
                condition=Q(retired_at__isnull=False),
                name="outbox_retired_by_age",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.job} {self.kwargs} ({self.status})"

    @property
    def status(self) -> str:
        if self.relayed_at:
            return "relayed"
        return "retired" if self.retired_at else "waiting"
