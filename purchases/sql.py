"""Every statement the purchases app writes by hand, each beside its SQLite twin.

The ORM first (docs/architecture.md, "Where the SQL lives"). What is here is what the ORM
cannot say in one statement: an INSERT ... ON CONFLICT, a data-modifying CTE that saves a
round trip, a LISTEN/NOTIFY. Table and column names come from the models' `_meta`; every
statement with a PostgreSQL-only form has its SQLite twin (the embedded default) in the same
function, doing the same in more statements, and tests/test_sql_twins.py runs both on the
same rows and compares what they write. The services call these functions by what they do
and never branch on the database themselves.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import connection, models, transaction
from django.db.models import F, Q
from django.utils import timezone

from core.actors import AGENT, Actor
from core.bulk import insert_after
from core.prepared import PreparedRaw
from core.prepared.inserts import insert_statement_of
from core.sql import column, on_postgresql, table
from fulfillment.models import Receipt, Result
from purchases import event_subjects as subjects
from purchases.events import event_note, events_pending, events_written
from purchases.models import (
    ApiKey,
    Buyer,
    DuplicateGuard,
    IdempotencyRecord,
    OutboxMessage,
    Purchase,
    PurchaseEvent,
)

# The timeline's insert columns, in the order the event INSERTs below select them.
_EVENT_FIELDS = (
    "purchase",
    "quote",
    "subject",
    "from_state",
    "to_state",
    "actor_type",
    "actor",
    "reason_code",
    "evidence",
    "created_at",
)


def event_columns() -> str:
    """The timeline's insert columns, quoted: `col, col, ...` in _EVENT_FIELDS' order."""
    return ", ".join(column(PurchaseEvent, name) for name in _EVENT_FIELDS)


# -- the timeline folded into another write -------------------------------------------------


def events_flush_with(
    sql: str, params: list[Any], *, returning: bool = False
) -> list[tuple[Any, ...]]:
    """Run `sql` (one write of the flow) with the events batched so far, in one statement (a
    data-modifying CTE): the batch is written now, not at the block's end (events recorded
    later still are). Inside `events_batched`, on PostgreSQL. Twin: `sql` runs alone and the
    batch waits for the block's end as usual. `returning`: `sql` has a RETURNING clause;
    its rows are returned."""
    batch = events_pending()
    with connection.cursor() as cursor:
        if not batch or not on_postgresql():
            cursor.execute(sql, params)
            return list(cursor.fetchall()) if returning else []
        # The batch's INSERT, its text written once per row count (core.prepared.inserts).
        insert_sql, insert_params = insert_statement_of(batch)
        result = "SELECT * FROM step" if returning else "SELECT 1"
        cursor.execute(
            f"WITH step AS ({sql}), noted AS ({insert_sql}) {result}",
            [*params, *insert_params],
        )
        written = list(cursor.fetchall()) if returning else []
    events_written(batch)
    batch.clear()
    return written


def event_after_insert(event: PurchaseEvent, *, about: str) -> tuple[str, list[Any]] | None:
    """`event` as the INSERT that follows the INSERT of the row it is about, in one statement
    (core.bulk.insert_unless_conflict's `also`): the new row's id goes into the event's
    `about` field ("quote" or "purchase"). Twin: None, and the caller records the event
    after the row, as usual."""
    if not on_postgresql():
        return None
    return insert_after(event, new_id_into=about)


# -- duplicate guards -----------------------------------------------------------------------


@functools.cache  # its text written once per database vendor
def _duplicate_guard_sql(vendor: str) -> str:
    insert = (
        f"INSERT INTO {table(DuplicateGuard)} ({column(DuplicateGuard, 'key')}, "  # noqa: S608 - names from the model
        f"{column(DuplicateGuard, 'created_at')}) VALUES (%s, %s) "
    )
    conflict = f"ON CONFLICT ({column(DuplicateGuard, 'key')}) "
    if vendor != "postgresql":
        return insert + conflict + "DO NOTHING RETURNING 1"
    # xmax is 0 on a row this statement inserted, the locker's id on one it updated.
    stamped = column(DuplicateGuard, "created_at")
    return insert + conflict + f"DO UPDATE SET {stamped} = EXCLUDED.{stamped} RETURNING (xmax = 0)"


def duplicate_guard_upsert(*, key: str, now: datetime) -> bool:
    """Take the guard's row lock and stamp its last use in one upsert (never a failing
    INSERT). True when the guard is new."""
    sql = _duplicate_guard_sql(connection.vendor)
    with connection.cursor() as cursor:
        if not on_postgresql():
            # SQLite has one writer at a time: no row lock to take.
            cursor.execute(sql, [key, now])
            if cursor.fetchone():
                return True
            DuplicateGuard.objects.filter(key=key).update(created_at=now)
            return False
        cursor.execute(sql, [key, now])
        row = cursor.fetchone()
    return bool(row and row[0])


# -- payment ids (idempotency keys) ---------------------------------------------------------

# Named fragments of the claim-or-known statement, so no statement is cut out of another.
# The key's rows (plain and compacted), each with its purchase's ref, and what the read
# notes on the key's purchase, decided from the row it reads: an answered key asked again is
# a replay (same principal and request), a conflict (another principal, or a changed
# request) or, for a key compacted to its hash, a request after retention. Keys still in
# flight are noted under their lock (purchases.services.checkout.idempotency._claim_recorded).
_KNOWN_CTE = """known AS (
    SELECT r.*, p.{ref} AS purchase_ref
    FROM {records} r LEFT JOIN {purchases} p ON p.{purchase_pk} = r.{purchase}
    WHERE r.{scope} = %(scope)s AND r.{key} IN (%(key)s, %(hashed)s)
)"""
_NOTED_CTE = """noted AS (
    INSERT INTO {events} ({event_columns})
    SELECT k.{purchase}, NULL,
        CASE
            WHEN k.{principal} <> %(principal)s
                OR (k.{key} = %(key)s
                    AND k.{fingerprint} NOT IN (%(fingerprint)s, %(fingerprint_alias)s))
                THEN %(conflict)s
            WHEN k.{key} = %(key)s THEN %(replayed)s
            ELSE %(expired)s
        END,
        '', '', %(actor_type)s, %(principal)s, '',
        jsonb_build_object(
            'scope', k.{scope},
            'record', k.{pk},
            'principal_matches', k.{principal} = %(principal)s,
            'request_matches', k.{fingerprint} IN (%(fingerprint)s, %(fingerprint_alias)s),
            'answered_at', k.{completed_at},
            'answer_status', k.{status}
        ),
        %(created_at)s
    FROM known k
    WHERE k.{purchase} IS NOT NULL AND (
        (k.{key} = %(key)s AND k.{state} = %(completed)s)
        OR (k.{key} = %(hashed)s AND NOT EXISTS (SELECT 1 FROM known o WHERE o.{key} = %(key)s))
    )
    RETURNING 1
)"""
# The known rows, then the claimed id on a row of NULL columns of the same shape (a join on
# false).
_CLAIM_OR_KNOWN_ROWS = (
    "SELECT k.*, NULL::bigint AS claimed_id FROM known k UNION ALL "
    "SELECT r.*, NULL AS purchase_ref, c.{pk} AS claimed_id FROM claimed c "
    "LEFT JOIN {records} r ON false"
)


def _record_column(name: str) -> str:
    return column(IdempotencyRecord, name)


@functools.cache
def _claim_sql(vendor: str) -> str:
    """INSERT ... SELECT ... WHERE NOT EXISTS (the compacted key) ON CONFLICT DO NOTHING
    RETURNING id, with named parameters (`v0`...: _claim_fields' values)."""
    records = table(IdempotencyRecord)
    names = ", ".join(connection.ops.quote_name(str(f.column)) for f in _claim_fields())
    values = ", ".join(f"%(v{i})s" for i in range(len(_claim_fields())))
    scope, key = _record_column("scope"), _record_column("key")
    return (
        f"INSERT INTO {records} ({names}) SELECT {values} "  # noqa: S608 - names from the model
        f"WHERE NOT EXISTS (SELECT 1 FROM {records} "
        f"WHERE {scope} = %(scope)s AND {key} = %(hashed)s) "
        f"ON CONFLICT ({scope}, {key}) DO NOTHING RETURNING {_record_column('id')}"
    )


@functools.cache
def _claim_fields() -> tuple[models.Field[Any, Any], ...]:
    return tuple(f for f in IdempotencyRecord._meta.concrete_fields if not f.primary_key)


@functools.cache
def _claim_or_known_sql(vendor: str) -> str:
    """The claim, the key's rows and their note, in one statement (PostgreSQL)."""
    names = {
        "records": table(IdempotencyRecord),
        "purchases": table(Purchase),
        "ref": column(Purchase, "ref"),
        "purchase_pk": column(Purchase, "id"),
        "pk": _record_column("id"),
        "purchase": _record_column("purchase"),
        "scope": _record_column("scope"),
        "key": _record_column("key"),
        "principal": _record_column("principal"),
        "fingerprint": _record_column("request_fingerprint"),
        "completed_at": _record_column("completed_at"),
        "status": _record_column("response_status"),
        "state": _record_column("state"),
        "events": table(PurchaseEvent),
        "event_columns": event_columns(),
    }
    return (
        f"WITH claimed AS ({_claim_sql(vendor)}), "
        f"{_KNOWN_CTE.format(**names)}, {_NOTED_CTE.format(**names)} "
        f"{_CLAIM_OR_KNOWN_ROWS.format(**names)}"
    )


# Its rows as records, the column mapping worked out once (raw() redoes it per call).
_CLAIM_OR_KNOWN = PreparedRaw(IdempotencyRecord, _claim_or_known_sql)


def payment_id_insert_or_known(
    *, record: IdempotencyRecord, hashed: str, fingerprint_alias: str
) -> tuple[int | None, list[IdempotencyRecord]]:
    """Claim the key by inserting `record` (unless the key or its compacted form `hashed`
    exists): `(new id, [])`; or `(None, the key's rows)`, each with `purchase_ref`, the
    request noted on the key's purchase (see _NOTED_CTE): the request is `record`'s scope,
    key, principal and fingerprint, `fingerprint_alias` another fingerprint it matches.
    `(None, [])`: a racing first claim the statement's snapshot cannot see yet. One
    statement on PostgreSQL; the twin claims, then reads and notes."""
    params = _claim_params(record, hashed)
    if on_postgresql():
        known = _known_params(record, hashed, fingerprint_alias)
        rows = _CLAIM_OR_KNOWN.fetch({**params, **known})
        claimed = next((row.claimed_id for row in rows if row.claimed_id is not None), None)  # type: ignore[attr-defined]
        return (int(claimed), []) if claimed is not None else (None, rows)
    with connection.cursor() as cursor:
        cursor.execute(_claim_sql(connection.vendor), params)
        row = cursor.fetchone()
    if row:
        return int(row[0]), []
    records = list(
        IdempotencyRecord.objects.filter(scope=record.scope, key__in=[record.key, hashed]).annotate(
            purchase_ref=F("purchase__ref")
        )
    )
    _note_known(records, record, hashed, fingerprint_alias)
    return None, records


def _claim_params(record: IdempotencyRecord, hashed: str) -> dict[str, Any]:
    params: dict[str, Any] = {
        f"v{i}": f.get_db_prep_save(getattr(record, f.attname), connection)
        for i, f in enumerate(_claim_fields())
    }
    params.update(scope=record.scope, hashed=hashed)
    return params


def _known_params(asked: IdempotencyRecord, hashed: str, fingerprint_alias: str) -> dict[str, Any]:
    return {
        "scope": asked.scope,
        "key": asked.key,
        "hashed": hashed,
        "principal": asked.principal,
        "fingerprint": asked.request_fingerprint,
        "fingerprint_alias": fingerprint_alias,
        "conflict": subjects.PAYMENT_ID_CONFLICT,
        "replayed": subjects.PAYMENT_ID_REPLAYED,
        "expired": subjects.PAYMENT_ID_RETENTION_EXPIRED,
        "actor_type": AGENT,
        "completed": IdempotencyRecord.State.COMPLETED,
        "created_at": timezone.now(),  # as every event: when written
    }


def _note_known(
    records: list[IdempotencyRecord],
    asked: IdempotencyRecord,
    hashed: str,
    fingerprint_alias: str,
) -> None:
    """_NOTED_CTE's twin: the same notes, one statement each."""
    fingerprints = (asked.request_fingerprint, fingerprint_alias)
    keys = {record.key for record in records}
    for record in records:
        if not record.purchase_id:
            continue
        if record.key == asked.key and record.state != IdempotencyRecord.State.COMPLETED:
            continue
        if record.key == hashed and asked.key in keys:
            continue
        if record.principal != asked.principal or (
            record.key == asked.key and record.request_fingerprint not in fingerprints
        ):
            subject = subjects.PAYMENT_ID_CONFLICT
        elif record.key == asked.key:
            subject = subjects.PAYMENT_ID_REPLAYED
        else:
            subject = subjects.PAYMENT_ID_RETENTION_EXPIRED
        event_note(
            subject=subject,
            purchase=Purchase(pk=record.purchase_id),
            actor=Actor.agent(asked.principal),
            evidence={
                "scope": record.scope,
                "record": record.pk,
                "principal_matches": record.principal == asked.principal,
                "request_matches": record.request_fingerprint in fingerprints,
                "answered_at": record.completed_at.isoformat() if record.completed_at else None,
                "answer_status": record.response_status,
            },
        )


def payment_id_mark_recorded(*, record_id: int, lease_token: str, purchase_id: int) -> None:
    """The key's recovery point is `payment_recorded` and it names its purchase, while our
    lease holds it; the flow's events so far in the same statement (events_flush_with)."""
    sql = _mark_recorded_sql(connection.vendor)
    params = [
        purchase_id,
        IdempotencyRecord.RecoveryPoint.PAYMENT_RECORDED,
        record_id,
        lease_token,
    ]
    events_flush_with(sql, params)


@functools.cache  # its text written once per database vendor
def _mark_recorded_sql(vendor: str) -> str:
    return (
        f"UPDATE {table(IdempotencyRecord)} SET {_record_column('purchase')} = %s, "  # noqa: S608 - names from the model
        f"{_record_column('recovery_point')} = %s "
        f"WHERE {_record_column('id')} = %s AND {_record_column('lease_token')} = %s"
    )


# -- the outbox -----------------------------------------------------------------------------

# A new message's columns; attempts and last_error start at their defaults (0, '').
_OUTBOX_FIELDS = (
    "job",
    "kwargs",
    "dedup_key",
    "created_at",
    "available_at",
    "attempts",
    "last_error",
)


@functools.cache
def _outbox_insert_sql(vendor: str, rows: int) -> str:
    row = "(%s, %s, %s, %s, %s, 0, '')"
    names = ", ".join(column(OutboxMessage, name) for name in _OUTBOX_FIELDS)
    return (
        f"INSERT INTO {table(OutboxMessage)} ({names}) VALUES {', '.join([row] * rows)} "  # noqa: S608 - names from the model
        f"ON CONFLICT DO NOTHING RETURNING {column(OutboxMessage, 'id')}"
    )


def outbox_insert(rows: Sequence[Sequence[Any]], *, with_events: bool = False) -> list[int]:
    """Insert new messages, each row (job, kwargs, dedup_key, created_at, available_at),
    skipping a dedup key already waiting (ON CONFLICT DO NOTHING,
    never a failing INSERT): the ids written. `with_events`: the flow's events so far go in
    the same statement (events_flush_with)."""
    sql = _outbox_insert_sql(connection.vendor, len(rows))
    fields = [OutboxMessage._meta.get_field(name) for name in _OUTBOX_FIELDS[:5]]
    params = [
        field.get_db_prep_save(value, connection)  # type: ignore[union-attr]
        for row in rows
        for field, value in zip(fields, row, strict=True)
    ]
    if with_events:
        return [int(row[0]) for row in events_flush_with(sql, params, returning=True)]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return [int(row[0]) for row in cursor.fetchall()]


# -- deliveries and receipt fetches ---------------------------------------------------------

# One statement per fetch: stamp the result's first delivery if it has none, and put the
# fetch on the timeline as a first delivery or a redelivery, whichever the stamp says.
_DELIVERY_SQL = """
WITH stamped AS (
    UPDATE {results} SET {first_delivered_at} = %(now)s
    WHERE {pk} = %(result)s AND {first_delivered_at} IS NULL
    RETURNING 1
)
INSERT INTO {events} ({event_columns})
SELECT %(purchase)s, NULL,
    CASE WHEN EXISTS (SELECT 1 FROM stamped) THEN %(first)s ELSE %(again)s END,
    '', '', %(actor_type)s, %(actor)s, '', %(evidence)s::jsonb, %(now)s
"""


@functools.cache  # its text written once per database vendor
def _delivery_sql(vendor: str) -> str:
    return _DELIVERY_SQL.format(
        results=table(Result),
        first_delivered_at=column(Result, "first_delivered_at"),
        pk=column(Result, "id"),
        events=table(PurchaseEvent),
        event_columns=event_columns(),
    )


def result_delivery_note(
    *, result: Result, purchase: Purchase, evidence: dict[str, Any], now: datetime
) -> None:
    """Stamp the result's first delivery if it has none and note the fetch as a first
    delivery or a redelivery, whichever the stamp says, by the purchase's payer."""
    if not on_postgresql():
        # No data-modifying CTE: the same in two statements.
        stamped = Result.objects.filter(pk=result.pk, first_delivered_at__isnull=True).update(
            first_delivered_at=now
        )
        event_note(
            subject=subjects.RESULT_DELIVERED if stamped else subjects.RESULT_REDELIVERED,
            purchase=purchase,
            actor=Actor.agent(purchase.payer),
            evidence=evidence,
        )
        return
    sql = _delivery_sql(connection.vendor)
    params: dict[str, Any] = {
        "now": now,
        "result": result.pk,
        "purchase": purchase.pk,
        "first": subjects.RESULT_DELIVERED,
        "again": subjects.RESULT_REDELIVERED,
        "actor_type": AGENT,
        "actor": purchase.payer,
        "evidence": json.dumps(evidence),
    }
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


# One statement: stamp the receipt if its last noted fetch is a window old (or none), and
# note the fetch only if it did. Race-safe under READ COMMITTED: a concurrent fetch waits on
# the row lock, then re-checks the WHERE against the stamped row and matches nothing. (An
# INSERT ... WHERE NOT EXISTS would not be: each statement's snapshot predates the others'
# commits, so concurrent fetches would all insert.)
_RECEIPT_FETCH_SQL = """
WITH stamped AS (
    UPDATE {receipts} SET {noted_at} = %(now)s
    WHERE {pk} = %(receipt)s AND ({noted_at} IS NULL OR {noted_at} <= %(due_from)s)
    RETURNING 1
)
INSERT INTO {events} ({event_columns})
SELECT %(purchase)s, NULL, %(subject)s, '', '', %(actor_type)s, %(actor)s, '',
    %(evidence)s::jsonb, %(now)s
FROM stamped
"""


def receipt_fetch_note(
    *,
    receipt: Receipt,
    actor: Actor,
    evidence: dict[str, Any],
    now: datetime,
    due_from: datetime,
) -> None:
    """Stamp the receipt's last noted fetch if it is older than `due_from` (or none) and note
    the fetch only if it did."""
    if not on_postgresql():
        # No data-modifying CTE: the same in two statements in one transaction, race-safe
        # too (SQLite begins IMMEDIATE: one writer at a time).
        with transaction.atomic():
            stamped = (
                Receipt.objects.filter(pk=receipt.pk)
                .filter(Q(last_fetch_noted_at__isnull=True) | Q(last_fetch_noted_at__lte=due_from))
                .update(last_fetch_noted_at=now)
            )
            if stamped:
                event_note(
                    subject=subjects.RECEIPT_FETCHED,
                    purchase=Purchase(pk=receipt.purchase_id),
                    actor=actor,
                    evidence=evidence,
                )
        return
    sql = _RECEIPT_FETCH_SQL.format(
        receipts=table(Receipt),
        noted_at=column(Receipt, "last_fetch_noted_at"),
        pk=column(Receipt, "id"),
        events=table(PurchaseEvent),
        event_columns=event_columns(),
    )
    params: dict[str, Any] = {
        "now": now,
        "receipt": receipt.pk,
        "due_from": due_from,
        "purchase": receipt.purchase_id,
        "subject": subjects.RECEIPT_FETCHED,
        "actor_type": actor.type,
        "actor": actor.name,
        "evidence": json.dumps(evidence),
    }
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


# -- settlement notes -----------------------------------------------------------------------

# Noted once per (attempt, submission): the look-ups that find the same drop while the next
# try waits its backoff write nothing. One statement, no lock: at a 10 000-row backlog a
# locked transaction per row would cost minutes (two racing look-ups may both note it).
_DROP_SQL = """
INSERT INTO {events} ({event_columns})
SELECT %(purchase)s, NULL, %(subject)s, '', '', %(actor_type)s, %(actor)s, %(reason)s,
    %(evidence)s::jsonb, %(created_at)s
WHERE NOT EXISTS (
    SELECT 1 FROM {events}
    WHERE {purchase} = %(purchase)s AND {subject} = %(subject)s
        AND {evidence} @> %(once)s::jsonb
)
"""


def payment_drop_note(
    *,
    purchase_id: int,
    actor: Actor,
    reason_code: str,
    evidence: dict[str, Any],
    attempt_id: int,
    submission: int,
) -> None:
    """Note `payment.dropped` on the purchase unless one is noted for this attempt's
    submission already. Its own statement: call with no transaction open."""
    if not on_postgresql():
        # No jsonb containment: the same in two statements.
        noted = PurchaseEvent.objects.filter(
            purchase_id=purchase_id,
            subject=subjects.PAYMENT_DROPPED,
            evidence__attempt=attempt_id,
            evidence__submission=submission,
        ).exists()
        if not noted:
            event_note(
                subject=subjects.PAYMENT_DROPPED,
                purchase=Purchase(pk=purchase_id),
                actor=actor,
                reason_code=reason_code,
                evidence=evidence,
            )
        return
    sql = _DROP_SQL.format(
        events=table(PurchaseEvent),
        event_columns=event_columns(),
        purchase=column(PurchaseEvent, "purchase"),
        subject=column(PurchaseEvent, "subject"),
        evidence=column(PurchaseEvent, "evidence"),
    )
    params: dict[str, Any] = {
        "purchase": purchase_id,
        "subject": subjects.PAYMENT_DROPPED,
        "actor_type": actor.type,
        "actor": actor.name,
        "reason": reason_code,
        "evidence": json.dumps(evidence),
        "once": json.dumps({"attempt": attempt_id, "submission": submission}),
        "created_at": timezone.now(),  # as every event: when written
    }
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


# -- reads written once ---------------------------------------------------------------------


@functools.cache
def _api_key_buyer_sql(vendor: str) -> str:
    """The key's buyer and hash by prefix: one fixed statement, written once per process,
    because every API request runs it and the ORM would compile it anew each time (about
    two thirds of its cost, docs/benchmarks.md). Revocation is read on every request."""
    buyer_columns = ", ".join(f"b.{column(Buyer, f.name)}" for f in Buyer._meta.concrete_fields)
    key_hash, prefix = column(ApiKey, "key_hash"), column(ApiKey, "prefix")
    joined = f"b.{column(Buyer, 'id')} = k.{column(ApiKey, 'buyer')}"
    return (
        f"SELECT {buyer_columns}, k.{key_hash} AS api_key_hash "  # noqa: S608 - names from the models
        f"FROM {table(ApiKey)} k JOIN {table(Buyer)} b ON {joined} "
        f"WHERE k.{prefix} = %s AND k.{column(ApiKey, 'revoked_at')} IS NULL"
    )


# Its rows as Buyers, each with `api_key_hash`, the column mapping worked out once.
API_KEY_BUYER = PreparedRaw(Buyer, _api_key_buyer_sql)


@functools.cache
def _fulfillment_state_sql(vendor: str) -> str:
    return (
        f"SELECT {column(Purchase, 'fulfillment_state')} FROM {table(Purchase)} "  # noqa: S608 - names from the model
        f"WHERE {column(Purchase, 'id')} = %s"
    )


def fulfillment_state_read(purchase_id: int) -> str | None:
    """The purchase's fulfilment state, one fixed statement (a waiter reads it often), or
    None for no such purchase."""
    with connection.cursor() as cursor:
        cursor.execute(_fulfillment_state_sql(connection.vendor), [purchase_id])
        row = cursor.fetchone()
    return None if row is None else str(row[0])


# -- notifications --------------------------------------------------------------------------

FULFILLMENT_CHANNEL = "tollbooth_fulfillment"


def fulfillment_notify_send(*, purchase_id: int) -> None:
    """NOTIFY the waiting requests' channel (PostgreSQL delivers it only if and when the
    caller's transaction commits). Twin: nothing (SQLite's waiters poll)."""
    if on_postgresql():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [FULFILLMENT_CHANNEL, str(purchase_id)])


LISTEN_FULFILLMENT = f"LISTEN {FULFILLMENT_CHANNEL}"
