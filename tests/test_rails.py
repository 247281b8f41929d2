"""The rail registry: every rail a purchase can be on is implemented once, behind the one
interface the checkout and settlement orchestration use."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime, timedelta
from typing import ClassVar

import pytest
from django.conf import settings as django_settings
from django.test import override_settings
from django.utils import timezone

from payments.models import PaymentAttempt, Rail
from payments.rails import (
    BatchLookup,
    PaymentRail,
    RowGuard,
    SettlementOutcome,
    SettlementStatus,
    rail_for,
    rails,
    rails_settled_after_record,
)
from payments.rails.base import RAILS
from payments.rails.prepaid import PrepaidRail
from purchases.services.jobs import reconcile
from tests.factories import PaymentAttemptFactory, PurchaseFactory

INTERFACE = sorted(
    name
    for name, member in inspect.getmembers(PaymentRail)
    if not name.startswith("_")
    and (inspect.isfunction(member) or name in PaymentRail.__annotations__)
)


def test_every_rail_is_registered_once_under_its_own_name():
    assert sorted(RAILS) == sorted(Rail.values)
    for name in Rail.values:
        assert rail_for(name).name == name


@pytest.mark.parametrize("name", Rail.values)
def test_each_rail_implements_the_whole_interface_with_its_signatures(name):
    rail = rail_for(name)
    for member in INTERFACE:
        assert hasattr(rail, member), f"{name} lacks {member}"
        expected = getattr(PaymentRail, member)
        if inspect.isfunction(expected):
            wanted = list(inspect.signature(expected).parameters)
            assert list(inspect.signature(getattr(type(rail), member)).parameters) == wanted


def test_an_unknown_rail_is_refused_not_guessed():
    with pytest.raises(KeyError):
        rail_for("card")


def test_only_the_prepaid_rail_settles_when_recorded():
    assert {name for name in Rail.values if rail_for(name).settles_when_recorded} == {"prepaid"}


class StatementRail(PrepaidRail):
    """A second rail, settled after recording, whose money's keeper answers in batches: a
    statement read once per run. It keeps what it was asked, and refuses one-by-one look-ups,
    so a test sees that reconciliation went through `lookup_many` and nothing else."""

    name: ClassVar[str] = "statement"
    settles_when_recorded: ClassVar[bool] = False
    statement: ClassVar[dict[str, SettlementOutcome]] = {}  # what the keeper says, by tx hash
    asked: ClassVar[list[list[int]]] = []

    def look_up(self, *, attempt: PaymentAttempt, now: datetime) -> SettlementOutcome:
        raise AssertionError("reconciliation reads the statement in batches, not row by row")

    def lookup_many(
        self,
        *,
        attempts: Sequence[PaymentAttempt],
        now: datetime,
        guard: RowGuard,
        chunk_size: int | None = None,
    ) -> BatchLookup:
        self.asked.append([attempt.pk for attempt in attempts])
        found = BatchLookup(round_trips=1)
        for attempt in attempts:
            with guard(attempt):
                found.outcomes[attempt.pk] = self.statement[attempt.tx_hash or ""]
        return found


@pytest.fixture
def statement_rail(settings) -> Iterator[type[StatementRail]]:
    settings.RAILS = {**RAILS, StatementRail.name: f"{__name__}.StatementRail"}
    StatementRail.asked, StatementRail.statement = [], {}
    yield StatementRail
    StatementRail.asked, StatementRail.statement = [], {}


def _statement_attempt(tx: str, purchase_state: str, **attempt: object) -> PaymentAttempt:
    purchase = PurchaseFactory.create(rail=StatementRail.name, **{purchase_state: True})
    made: PaymentAttempt = PaymentAttemptFactory.create(
        purchase=purchase, rail=StatementRail.name, tx=tx, **attempt
    )
    return made


@pytest.mark.postgres
@pytest.mark.django_db
def test_reconciliation_asks_each_rail_for_its_attempts_at_once(statement_rail):
    now = timezone.now() + django_settings.TOLLBOOTH["SETTLEMENT_GRACE"] + timedelta(seconds=1)
    paid, refused, unknown = (
        _statement_attempt(f"0x{n:064x}", "settlement_pending", pending=True)
        for n in (0xA1, 0xA2, 0xA3)
    )
    statement_rail.statement = {
        paid.tx_hash: SettlementOutcome(SettlementStatus.CONFIRMED, paid.tx_hash, block_number=7),
        refused.tx_hash: SettlementOutcome(
            SettlementStatus.FAILED, refused.tx_hash, "payment_refused"
        ),
        unknown.tx_hash: SettlementOutcome(
            SettlementStatus.PENDING, unknown.tx_hash, "not_on_statement_yet"
        ),
    }

    stats = reconcile.reconcile_pending_settlements(now=now)

    assert statement_rail.asked == [sorted([paid.pk, refused.pk, unknown.pk])]
    for attempt in (paid, refused, unknown):
        attempt.refresh_from_db()
        attempt.purchase.refresh_from_db()
    assert (paid.state, paid.purchase.payment_state) == ("succeeded", "paid")
    assert (refused.state, refused.purchase.payment_state) == ("failed", "failed")
    assert refused.reason_code == "payment_refused"
    # Unknown is never failed: still pending, looked at again at the regular cadence.
    assert (unknown.state, unknown.purchase.payment_state) == (
        "settlement_pending",
        "settlement_pending",
    )
    assert unknown.reason_code == "not_on_statement_yet"
    assert unknown.next_check_at == now + reconcile.RECHECK
    assert (stats["confirmed"], stats["failed"], stats["still_pending"]) == (1, 1, 1)
    assert stats["rpc_round_trips"] == 1


@pytest.mark.postgres
@pytest.mark.django_db
def test_the_late_watch_asks_the_same_batch_look_up(statement_rail):
    """A failed attempt whose money turned up after all is found through the rail too."""
    now = timezone.now()
    late = _statement_attempt(
        "0x" + "b1" * 32,
        "failed",
        failed=True,
        tx_hash="0x" + "b1" * 32,
        valid_before_at=now + timedelta(minutes=5),
    )
    statement_rail.statement = {
        late.tx_hash: SettlementOutcome(SettlementStatus.CONFIRMED, late.tx_hash, block_number=9)
    }

    stats = reconcile.watch_failed_attempts(now=now)

    assert statement_rail.asked == [[late.pk]]
    assert (stats["watched"], stats["late_found"]) == (1, 1)


def _no_guard(attempt: PaymentAttempt) -> AbstractContextManager[None]:
    return nullcontext()


def test_rails_settled_at_recording_are_never_asked_to_look_up(statement_rail):
    assert rails_settled_after_record() == ["x402", "statement"]
    assert rail_for("prepaid").lookup_many(attempts=[], now=timezone.now(), guard=_no_guard) == (
        BatchLookup()
    )


def test_the_registry_follows_the_rails_setting_and_returns_to_the_default():
    assert [rail.name for rail in rails()] == list(RAILS)
    with override_settings(RAILS={**RAILS, StatementRail.name: f"{__name__}.StatementRail"}):
        assert rail_for(StatementRail.name).name == StatementRail.name
    assert [rail.name for rail in rails()] == list(RAILS)
    with pytest.raises(KeyError):
        rail_for(StatementRail.name)
