"""The timeline writer. Called inside the transaction that makes the change it records."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django_fsm import TransitionNotAllowed, can_proceed

from core.actors import Actor
from core.bulk import bulk_insert_rows
from core.changes import Change
from purchases.models import Purchase, PurchaseEvent, Quote

# The timeline subject of a move of each FSM field of Purchase (labels: backoffice.timeline).
PURCHASE_TRANSITION_SUBJECTS = {
    "payment_state": "purchase.payment",
    "fulfillment_state": "purchase.fulfillment",
}
# Plain fields a Purchase transition may assign besides its state.
_TRANSITION_FIELDS = ("reason_code", "paid_at")

# Events of one flow, written in one INSERT when the flow ends (inside its transaction).
_batch: ContextVar[list[PurchaseEvent] | None] = ContextVar("purchase_events_batch", default=None)


# Called with every event written, inside its transaction (webhooks.events publishes some):
# an app above purchases registers here, so purchases never imports it. A batched event is
# told when its batch is written, so an event dropped with its row (events_of_one_row) never
# reaches a listener.
_listeners: list[Callable[[PurchaseEvent], None]] = []


def event_listener_add(listener: Callable[[PurchaseEvent], None]) -> None:
    """Call `listener(event)` for every event written from now on, in the transaction of
    the change it records (once per listener, however often it is added)."""
    if listener not in _listeners:
        _listeners.append(listener)


def events_written(events: Sequence[PurchaseEvent]) -> None:
    """Tell the listeners of `events`, written (or being written) in this transaction: by
    event_record, at a batch's end, and by a statement of ours that writes a batch itself
    (purchases.sql.events_flush_with)."""
    for event in events:
        for listener in _listeners:
            listener(event)


# A batch this large (a bulk recorder's) is written with COPY; a request's few events with
# an INSERT, which query counts see.
COPY_FROM = 200


@contextmanager
def events_batched() -> Iterator[None]:
    """Collect the events recorded inside the block and write them in one INSERT at its end.

    Use it inside the flow's transaction, so the events still commit (or roll back) with the
    change they record. A nested block joins the outer one.
    """
    if _batch.get() is not None:
        yield
        return
    token = _batch.set([])
    try:
        yield
        batch = _batch.get() or []
        bulk_insert_rows(batch, copy_from=COPY_FROM)
        events_written(batch)
    finally:
        _batch.reset(token)


@contextmanager
def events_of_one_row() -> Iterator[None]:
    """Inside `events_batched`: if the block raises, drop the events it added.

    A bulk recorder works row by row in memory and writes the rows it could process at the
    end; a row that raised is left to the one-row path, so its events must not be written.
    """
    batch = _batch.get()
    mark = len(batch) if batch is not None else 0
    try:
        yield
    except BaseException:
        if batch is not None:
            del batch[mark:]
        raise


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
    event = PurchaseEvent(
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
    batch = _batch.get()
    if batch is None:
        event.save()
        events_written([event])
    else:
        batch.append(event)
    return event


def events_pending() -> list[PurchaseEvent] | None:
    """The events batched so far and not yet written (None outside `events_batched`): a
    statement of ours that writes them itself (purchases.sql.events_flush_with) clears it."""
    return _batch.get()


def event_note(**event: Any) -> PurchaseEvent:
    """Append one event about something observed outside any flow (a fetch, a refused
    request, an alert): in its own short transaction, or the caller's if one is open."""
    with transaction.atomic():
        return event_record(**event)


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


@dataclass(frozen=True)
class PurchaseMove:
    """One FSM move of a Purchase, made in memory (`purchase_move`) and not yet on the
    timeline: the field it moved and the fields to save with it."""

    field: str
    from_state: str
    to_state: str
    fields: list[str]


def purchase_move(
    *,
    purchase: Purchase,
    transition: Callable[..., None],
    arguments: dict[str, Any] | None = None,
    update_fields: Sequence[str] = (),
) -> PurchaseMove:
    """The transition recipe's first half: check `can_proceed` and transition (with
    `arguments`), in memory. The caller saves `fields` and then writes the move on the
    timeline with `purchase_move_record` (purchase_transition does both at once; a flow that
    writes a new purchase in one INSERT makes its moves first). Raises
    TransitionNotAllowed."""
    field = transition._django_fsm.field  # type: ignore[attr-defined]
    if not can_proceed(transition):
        raise TransitionNotAllowed(
            f"{purchase.ref}: {transition.__name__} not allowed from "
            f"{getattr(purchase, field.name)}"
        )
    previous = getattr(purchase, field.name)
    before = {name: getattr(purchase, name) for name in _TRANSITION_FIELDS}
    transition(**(arguments or {}))
    # Whatever the transition assigned is saved, asked for or not: a reason code set (or
    # cleared) in memory and not written would leave the old state's reason on the row.
    changed = [name for name in _TRANSITION_FIELDS if getattr(purchase, name) != before[name]]
    return PurchaseMove(
        field=field.name,
        from_state=previous,
        to_state=getattr(purchase, field.name),
        fields=list(dict.fromkeys([field.name, *update_fields, *changed])),
    )


def purchase_move_record(
    *,
    purchase: Purchase,
    move: PurchaseMove,
    actor: Actor,
    evidence: dict[str, Any] | None = None,
) -> None:
    """The recipe's second half: the move on the timeline (with the purchase's reason code
    when the move set one), in the caller's transaction, after its row is written."""
    event_record(
        subject=PURCHASE_TRANSITION_SUBJECTS[move.field],
        purchase=purchase,
        actor=actor,
        from_state=move.from_state,
        to_state=move.to_state,
        reason_code=purchase.reason_code if "reason_code" in move.fields else "",
        evidence=evidence,
    )


def purchase_transition(
    *,
    purchase: Purchase,
    transition: Callable[..., None],
    actor: Actor,
    arguments: dict[str, Any] | None = None,
    update_fields: Sequence[str] = (),
    evidence: dict[str, Any] | None = None,
    save: bool = True,
) -> list[str]:
    """The transition recipe, written once: check `can_proceed`, transition (with
    `arguments`), save the moved field and `update_fields`, and put the move on the timeline
    (with the purchase's reason code when the transition sets one). Caller holds the lock
    on the purchase inside its transaction. Returns the fields it moved; with `save=False`
    the caller saves them (several moves, one UPDATE). Raises TransitionNotAllowed."""
    move = purchase_move(
        purchase=purchase, transition=transition, arguments=arguments, update_fields=update_fields
    )
    if save:
        purchase.save(update_fields=[*move.fields, "updated_at"])
    purchase_move_record(purchase=purchase, move=move, actor=actor, evidence=evidence)
    return move.fields
