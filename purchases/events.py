"""The timeline writer. Called inside the transaction that makes the change it records."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from core.actors import Actor
from core.changes import Change
from purchases.models import Purchase, PurchaseEvent, Quote


def event_record(
    *,
    subject: str,
    actor: Actor,
    purchase: Purchase | None = None,
    quote: Quote | None = None,
    from_state: str = "",
    to_state: str = "",
    reason_code: str = "",
    evidence: dict[str, Any] | None = None,
) -> PurchaseEvent:
    """Append one event. Must run inside the caller's transaction, never on its own."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("events are written in the transaction of the change they record")
    return PurchaseEvent.objects.create(
        purchase=purchase,
        quote=quote,
        subject=subject,
        from_state=str(from_state),
        to_state=str(to_state),
        actor_type=actor.type,
        actor=actor.name,
        reason_code=reason_code,
        evidence=evidence or {},
    )


def event_record_change(*, purchase: Purchase, actor: Actor, change: Change | None) -> None:
    """Put what a lower service changed on the purchase's timeline (None: nothing changed)."""
    if change is None:
        return
    event_record(
        subject=change.subject,
        purchase=purchase,
        actor=actor,
        from_state=change.from_state,
        to_state=change.to_state,
        reason_code=change.reason_code,
        evidence=change.evidence,
    )
