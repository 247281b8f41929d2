"""Each hand-written statement and its SQLite twin write the same rows and the same events.

Every app's `sql.py` keeps a statement's PostgreSQL form and its SQLite twin in one function
(docs/architecture.md, "Where the SQL lives"). Each scenario below runs that function on the
same rows twice: on PostgreSQL (the default database) and on a file SQLite (the `twin`
database of config/settings/test.py), made the default for the run, so the twin really
runs. What they wrote (the rows, the events on the timeline, what the function returned) is
compared with the databases' own keys and the write times left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import DEFAULT_DB_ALIAS, connections, transaction

from core.actors import Actor
from core.errors import DomainError
from core.refs import payment_id_hash
from fulfillment.models import ExecutionAttempt, Receipt, Result
from fulfillment.sql import result_insert_with_receipt
from payments import sql as payments_sql
from payments.models import LedgerBalance, LedgerEntry, PaymentAttempt, RelayerAccount
from purchases import sql
from purchases.events import event_record, events_batched
from purchases.models import (
    DuplicateGuard,
    IdempotencyRecord,
    OutboxMessage,
    Purchase,
    PurchaseEvent,
)
from purchases.services.checkout.idempotency import (
    KeyClaim,
    KeyedRequest,
    StoredAnswer,
    payment_id_store_answer,
)
from tests.factories import BuyerFactory, PaymentAttemptFactory, PurchaseFactory

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(databases=["default", "twin"])]

AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
ACTOR = Actor.agent("0x" + "0c" * 20)


@contextmanager
def default_is(alias: str) -> Iterator[None]:
    """Make `alias` the default database for the block (this thread): the ORM, the
    `connection` proxy and transaction.atomic() all reach it."""
    saved = connections[DEFAULT_DB_ALIAS]
    setattr(connections._connections, DEFAULT_DB_ALIAS, connections[alias])  # type: ignore[attr-defined]
    try:
        yield
    finally:
        setattr(connections._connections, DEFAULT_DB_ALIAS, saved)  # type: ignore[attr-defined]


class Keys:
    """The databases' own keys, named in the order met, so two databases compare."""

    def __init__(self) -> None:
        self.names: dict[tuple[str, Any], str] = {}

    def name(self, kind: str, pk: Any) -> str | None:
        if pk is None:
            return None
        return self.names.setdefault((kind, pk), f"{kind}{len(self.names)}")


def _events(purchase_id: int, keys: Keys) -> list[tuple[Any, ...]]:
    """The purchase's timeline, as written (keys named, the write time left out)."""
    rows = PurchaseEvent.objects.filter(purchase_id=purchase_id).order_by("pk")
    named = []
    for event in rows:
        evidence = {
            name: keys.name(name, value)
            if name in ("record", "attempt", "result") and isinstance(value, int)
            else value
            for name, value in event.evidence.items()
        }
        named.append(
            (
                keys.name("purchase", event.purchase_id),
                event.subject,
                event.from_state,
                event.to_state,
                event.actor_type,
                event.actor,
                event.reason_code,
                evidence,
            )
        )
    return named


def duplicate_guard() -> dict[str, Any]:
    first = sql.duplicate_guard_upsert(key="guard-1", now=AT)
    again = sql.duplicate_guard_upsert(key="guard-1", now=AT + timedelta(seconds=5))
    other = sql.duplicate_guard_upsert(key="guard-2", now=AT)
    stamped = DuplicateGuard.objects.get(key="guard-1").created_at
    return {"first": first, "again": again, "other": other, "stamped": stamped}


def payment_id_claims() -> dict[str, Any]:
    keys = Keys()
    purchase = PurchaseFactory.create()
    asked = KeyedRequest(
        scope="x402", key="pay-twin-0001", principal="0xpayer", fingerprint="f" * 64, now=AT
    )

    def claim(request: KeyedRequest) -> tuple[str | None, list[tuple[Any, ...]]]:
        record = IdempotencyRecord(
            scope=request.scope,
            key=request.key,
            principal=request.principal,
            request_fingerprint=request.fingerprint,
            lease_token="lease",
            locked_until=AT + timedelta(seconds=8),
            created_at=AT,
        )
        hashed = payment_id_hash(request.key)
        claimed, rows = sql.payment_id_insert_or_known(
            record=record, hashed=hashed, fingerprint_alias=request.fingerprint
        )
        return keys.name("record", claimed), sorted(
            (row.key, row.state, keys.name("ref", row.purchase_ref), keys.name("record", row.pk))  # type: ignore[attr-defined]
            for row in rows
        )

    first = claim(asked)
    in_flight = claim(asked)  # the key exists, unanswered: read, noted by nobody here
    IdempotencyRecord.objects.filter(key=asked.key).update(
        state=IdempotencyRecord.State.COMPLETED, purchase=purchase, response_status=201
    )
    replayed = claim(asked)
    conflict = claim(replace(asked, principal="0xother"))
    changed = claim(replace(asked, fingerprint="e" * 64))
    # A key compacted to its hash after retention, asked again by its plain id.
    expired = replace(asked, key="pay-twin-0002")
    IdempotencyRecord.objects.create(
        scope="x402",
        key=payment_id_hash(expired.key),
        principal="0xpayer",
        request_fingerprint="f" * 64,
        state=IdempotencyRecord.State.COMPLETED,
        purchase=purchase,
        created_at=AT,
    )
    after_retention = claim(expired)
    return {
        "claims": [first, in_flight, replayed, conflict, changed, after_retention],
        "events": _events(purchase.pk, keys),
    }


def payment_id_recorded_and_answered() -> dict[str, Any]:
    keys = Keys()
    purchase = PurchaseFactory.create()
    record = IdempotencyRecord.objects.create(
        scope="x402",
        key="pay-twin-0003",
        principal="0xpayer",
        request_fingerprint="f" * 64,
        lease_token="lease",
        created_at=AT,
    )
    with transaction.atomic(), events_batched():
        event_record(subject="purchase.test", purchase=purchase, actor=ACTOR, evidence={"n": 1})
        sql.payment_id_mark_recorded(
            record_id=record.pk, lease_token="lease", purchase_id=purchase.pk
        )
        sql.payment_id_mark_recorded(  # not our lease: writes nothing
            record_id=record.pk, lease_token="another", purchase_id=0
        )
        # The answer, stored through the ORM's conditional UPDATE: once, while the lease
        # holds the key in flight; a second answer finds it answered and is refused.
        claim = KeyClaim(record.pk, "lease")
        payment_id_store_answer(
            claim=claim, answer=StoredAnswer(201, {"n": 1}), purchase=None, now=AT
        )
        with pytest.raises(DomainError) as again:
            payment_id_store_answer(
                claim=claim, answer=StoredAnswer(500, {}), purchase=None, now=AT
            )
    record.refresh_from_db()
    return {
        "refused": again.value.code,
        "record": (
            keys.name("purchase", record.purchase_id),
            record.recovery_point,
            record.state,
            record.response_status,
            record.completed_at,
        ),
        "events": _events(purchase.pk, keys),
    }


def outbox() -> dict[str, Any]:
    keys = Keys()
    purchase = PurchaseFactory.create()
    row = ["purchase_execute", {"purchase_id": 1}, "execute:1", AT, AT]
    with transaction.atomic(), events_batched():
        event_record(subject="purchase.test", purchase=purchase, actor=ACTOR, evidence={"n": 2})
        first = sql.outbox_insert([row], with_events=True)
        duplicate = sql.outbox_insert([row], with_events=True)
        many = sql.outbox_insert(
            [["purchase_execute", {"purchase_id": n}, f"execute:{n}", AT, AT] for n in (1, 2, 3)]
        )
    messages = [
        (m.job, m.kwargs, m.dedup_key, m.created_at, m.available_at, m.attempts, m.last_error)
        for m in OutboxMessage.objects.order_by("dedup_key")
    ]
    return {
        "counts": (len(first), len(duplicate), len(many)),
        "messages": messages,
        "events": _events(purchase.pk, keys),
    }


def _result_and_receipt(purchase: Purchase, public_id: str) -> tuple[Result, Receipt]:
    attempt = ExecutionAttempt.objects.create(
        purchase=purchase,
        executor="report",
        worker="w",
        lease_token="lease",
        lease_expires_at=AT,
        job_idempotency_key=f"exec:{purchase.pk}",
        started_at=AT,
    )
    result = Result(
        purchase=purchase,
        execution=attempt,
        content_type="application/json",
        body=b"{}",
        sha256="0" * 64,
        size=2,
        created_at=AT,
        expires_at=AT + timedelta(days=1),
    )
    receipt = Receipt(
        public_id=public_id,
        purchase=purchase,
        payer="0xpayer",
        amount=100,
        asset="0xasset",
        network="eip155:31337",
        transaction="0xtx",
        body_sha256="0" * 64,
        delivered_at=AT,
    )
    return result, receipt


def result_with_receipt_and_its_fetches() -> dict[str, Any]:
    keys = Keys()
    purchase = PurchaseFactory.create(paid=True)
    result, receipt = _result_and_receipt(purchase, "rcp_twin1")
    with transaction.atomic():
        inserted = result_insert_with_receipt(result=result, receipt=receipt)
    again, _receipt = _result_and_receipt(PurchaseFactory.create(paid=True), "rcp_twin2")
    again.purchase = purchase
    with transaction.atomic():
        refused = result_insert_with_receipt(result=again, receipt=_receipt)
    stored_receipt = Receipt.objects.get(purchase=purchase)
    for n, now in enumerate((AT, AT + timedelta(seconds=1))):
        sql.result_delivery_note(result=result, purchase=purchase, evidence={"n": n}, now=now)
    window = timedelta(hours=1)
    for n, now in enumerate((AT, AT + timedelta(minutes=5), AT + window + timedelta(seconds=1))):
        sql.receipt_fetch_note(
            receipt=stored_receipt,
            actor=Actor.agent("public"),
            evidence={"n": n},
            now=now,
            due_from=now - window,
        )
    stored_receipt.refresh_from_db()
    return {
        "written": (inserted, refused),
        "receipt": (stored_receipt.public_id, stored_receipt.last_fetch_noted_at),
        "first_delivered_at": Result.objects.get(purchase=purchase).first_delivered_at,
        "events": _events(purchase.pk, keys),
    }


def payment_drops() -> dict[str, Any]:
    keys = Keys()
    attempt = PaymentAttemptFactory.create()
    for submission in (0, 0, 1):
        sql.payment_drop_note(
            purchase_id=attempt.purchase_id,
            actor=ACTOR,
            reason_code="not_on_chain",
            evidence={"attempt": attempt.pk, "submission": submission, "tx_known": False},
            attempt_id=attempt.pk,
            submission=submission,
        )
    return {"events": _events(attempt.purchase_id, keys)}


def ledger_debits() -> dict[str, Any]:
    buyer = BuyerFactory.create()
    purchase = PurchaseFactory.create(prepaid=True)
    LedgerBalance.objects.create(buyer=buyer, asset="0xasset", amount=150)

    def debit(amount: int, reference: str) -> bool:
        entry = LedgerEntry(
            buyer_id=buyer.pk,
            asset="0xasset",
            amount=-amount,
            kind=LedgerEntry.Kind.PURCHASE_DEBIT,
            reference=reference,
            purchase_id=purchase.pk,
            created_at=AT,
        )
        with transaction.atomic():
            return payments_sql.ledger_debit_post(entry=entry, amount=amount)

    posted = (debit(100, "debit-1"), debit(100, "debit-2"), debit(50, "debit-3"))
    # created_at left out: the twin's save() stamps it (auto_now_add) as the statement does
    # with the time the entry was made, both the time of the write.
    entries = [
        (e.asset, e.amount, e.kind, e.reference, e.memo, e.purchase_id is not None)
        for e in LedgerEntry.objects.filter(buyer=buyer).order_by("reference")
    ]
    balance = LedgerBalance.objects.get(buyer=buyer, asset="0xasset").amount
    return {"posted": posted, "entries": entries, "balance": balance}


def attempt_marks_and_relayer_nonces() -> dict[str, Any]:
    attempt = PaymentAttemptFactory.create()
    payments_sql.attempt_mark_prepared(attempt_id=attempt.pk, now=AT, signed=None)
    later = AT + timedelta(seconds=3)
    payments_sql.attempt_mark_prepared(
        attempt_id=attempt.pk, now=later, signed=("0xa", "0x01", 7, "0xr1")
    )
    payments_sql.attempt_mark_prepared(
        attempt_id=attempt.pk, now=later, signed=("0xb", "0x02", 8, "0xr2")
    )
    stored = PaymentAttempt.objects.get(pk=attempt.pk)
    # The lease clock restarts only when the chain's count (floor - 1) moved.
    nonces = [
        payments_sql.relayer_nonce_next(
            network="eip155:1", address="0xr", floor=floor, now=AT + timedelta(seconds=i)
        )
        for i, floor in enumerate((5, 5, 3, 10))
    ]
    assert nonces == [
        (5, AT, 5),
        (6, AT, 5),
        (7, AT + timedelta(seconds=2), 7),
        (10, AT + timedelta(seconds=3), 10),
    ]
    account = RelayerAccount.objects.get(network="eip155:1", address="0xr")
    return {
        "attempt": (
            stored.broadcast_started_at,
            stored.updated_at,
            stored.tx_hash,
            stored.raw_transaction,
            stored.relayer_nonce,
            stored.relayer_address,
        ),
        "nonces": nonces,
        "account": (
            account.next_nonce,
            account.pending_seen,
            account.pending_seen_since,
            account.handed_out_by_then,
        ),
    }


SCENARIOS: list[Callable[[], dict[str, Any]]] = [
    duplicate_guard,
    payment_id_claims,
    payment_id_recorded_and_answered,
    outbox,
    result_with_receipt_and_its_fetches,
    payment_drops,
    ledger_debits,
    attempt_marks_and_relayer_nonces,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_a_statement_and_its_sqlite_twin_write_the_same(
    scenario: Callable[[], dict[str, Any]],
) -> None:
    assert sql.on_postgresql()
    on_postgresql = scenario()
    with default_is("twin"):
        assert not sql.on_postgresql() and not payments_sql.on_postgresql()
        on_sqlite = scenario()
    assert on_sqlite == on_postgresql
