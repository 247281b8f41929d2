"""Payment reads."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db.models import Case, F, OuterRef, Q, Subquery, Value, When
from django.db.models.functions import Coalesce, NullIf

from payments.models import (
    LIVE_ATTEMPT_STATES,
    PENDING_ATTEMPT_STATES,
    PaymentAttempt,
    PayoutWallet,
    Refund,
    RelayerAccount,
)
from payments.signers import refund_wallet_address, relayer_address


def payment_attempt_latest(*, purchase_id: int) -> PaymentAttempt | None:
    return PaymentAttempt.objects.filter(purchase_id=purchase_id).order_by("-pk").first()


def refunds_for_purchase(*, purchase_id: int) -> list[Refund]:
    return list(Refund.objects.filter(purchase_id=purchase_id).order_by("pk"))


def payment_attempt_for_key(*, idempotency_record_id: int) -> PaymentAttempt | None:
    """The attempt recorded under this payment id, if its request got that far."""
    return (
        PaymentAttempt.objects.select_related("purchase")
        .filter(idempotency_record_id=idempotency_record_id)
        .first()
    )


def payment_attempt_held(*, purchase_id: int) -> PaymentAttempt | None:
    """The purchase's held attempt (the authorization flow), if its work has not ended."""
    return PaymentAttempt.objects.filter(
        purchase_id=purchase_id, state=PaymentAttempt.State.HELD
    ).first()


def payment_evidence_of_purchase() -> dict[str, Subquery]:
    """For annotating a purchase query (`OuterRef("pk")`): the transaction reference and the
    network of its settled attempt (the first), else of its live one (the latest). One
    query, not two: `payment_reference`, `payment_network`, `payment_mined_at`."""
    is_settled = Q(state=PaymentAttempt.State.SUCCEEDED)
    attempts = PaymentAttempt.objects.filter(
        purchase_id=OuterRef("pk"), state__in=LIVE_ATTEMPT_STATES
    ).order_by(
        Case(When(is_settled, then=Value(0)), default=Value(1)),
        Case(When(is_settled, then=F("pk")), default=-F("pk")),
    )
    # A held authorization (the authorization flow) has no transaction yet: its nonce.
    reference = Coalesce(
        NullIf("tx_hash", Value("")),
        NullIf("settlement_reference", Value("")),
        "authorization_nonce",
    )
    final = attempts.filter(is_settled, final_at__isnull=False)
    return {
        "payment_reference": Subquery(attempts.values(reference=reference)[:1]),
        "payment_network": Subquery(attempts.values("network")[:1]),
        # A settlement already final with its block time known: its receipt is signed at once.
        "payment_mined_at": Subquery(final.values("block_at")[:1]),
    }


def payments_wallets(*, network: str | None = None) -> set[str]:
    """The seller's wallets this app knows of on `network` (None: on every network),
    lower-case: its relayers (the configured key's and every one it ever used) and those
    listed in settings (TOLLBOOTH_SELLER_WALLETS, and the refund Safe,
    TOLLBOOTH_REFUND_SAFE). The offerings' recipients are added by
    purchases.selectors.seller_wallets (purchases owns offerings)."""
    wallets = {str(a).lower() for a in settings.TOLLBOOTH.get("SELLER_WALLETS", []) if a}
    # The refund Safe is a refund wallet: its batches pay refunds back.
    if settings.TOLLBOOTH.get("REFUND_SAFE"):
        wallets.add(str(settings.TOLLBOOTH["REFUND_SAFE"]).lower())
    relayers = RelayerAccount.objects.all()
    if network is not None:
        relayers = relayers.filter(network=network)
    wallets |= {a.lower() for a in relayers.values_list("address", flat=True)}
    configs = settings.X402_NETWORKS
    for name in configs if network is None else [network]:
        relayer = relayer_address(network=name)
        if relayer:
            wallets.add(relayer.lower())
    # The refund wallet (payouts), configured now and every one that ever signed a payout.
    payout_wallets = PayoutWallet.objects.all()
    if network is not None:
        payout_wallets = payout_wallets.filter(network=network)
    wallets |= {a.lower() for a in payout_wallets.values_list("address", flat=True)}
    for name in configs if network is None else [network]:
        refund_wallet = refund_wallet_address(network=name)
        if refund_wallet:
            wallets.add(refund_wallet)
    return wallets


@dataclass(frozen=True)
class RelayerRetirement:
    """Whether a relayer address may be retired (its gas taken away, its key forgotten):
    only once every authorization naming it has passed its deadline. `blocking`: the
    attempts it signed whose money is not settled yet and whose authorization can still
    land (deadline not passed) or whose outcome is not known (still pending)."""

    network: str
    address: str
    blocking: list[PaymentAttempt]
    deadline: datetime | None  # the latest validBefore among them
    is_current: bool  # it is the relayer configured now

    @property
    def may_retire(self) -> bool:
        return not self.blocking and not self.is_current


def relayer_retirement(*, network: str, address: str, now: datetime) -> RelayerRetirement:
    """What keeps the relayer `address` on `network` from being retired at `now`: an attempt
    it signed that is still pending (recorded or settlement_pending, whatever its deadline:
    its outcome is unknown), or one not succeeded whose authorization's validBefore has not
    passed (its signed transaction may still land). A succeeded attempt's authorization is
    used on chain and can never land again."""
    named = PaymentAttempt.objects.filter(network=network, relayer_address__iexact=address)
    blocking = list(
        named.filter(
            Q(state__in=PENDING_ATTEMPT_STATES)
            | (~Q(state=PaymentAttempt.State.SUCCEEDED) & Q(valid_before_at__gt=now))
        ).order_by("pk")
    )
    deadlines = [a.valid_before_at for a in blocking if a.valid_before_at is not None]
    current = relayer_address(network=network)
    return RelayerRetirement(
        network=network,
        address=address,
        blocking=blocking,
        deadline=max(deadlines) if deadlines else None,
        is_current=current is not None and current.lower() == address.lower(),
    )
