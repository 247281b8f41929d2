"""The timeline writer. Called inside the transaction that makes the change it records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import transaction

from purchases.models import Purchase, PurchaseEvent, Quote


@dataclass(frozen=True)
class Actor:
    type: str
    name: str = ""

    @classmethod
    def system(cls, name: str = "tollbooth") -> Actor:
        return cls(PurchaseEvent.ActorType.SYSTEM, name)

    @classmethod
    def agent(cls, name: str) -> Actor:
        return cls(PurchaseEvent.ActorType.AGENT, name)

    @classmethod
    def staff(cls, name: str) -> Actor:
        return cls(PurchaseEvent.ActorType.STAFF, name)


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
