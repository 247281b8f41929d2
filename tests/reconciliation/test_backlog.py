"""A 10 000-row pending backlog is reconciled in batches: count round trips, not seconds."""

from __future__ import annotations

import math
import secrets
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from payments.models import PaymentAttempt
from payments.rails.x402.types import Authorization
from purchases.models import Purchase, Quote
from purchases.services.jobs import reconcile
from tests.x402.e2e import PRICE

pytestmark = [pytest.mark.django_db]
BACKLOG = 10_000
CHUNK = 500


def _backlog(world, count: int) -> None:
    """Broadcast long ago with nothing on chain yet, each just resubmitted once (so none is
    due for another submission: this is about looking up, not about resending)."""
    valid_before = int(time.time()) + 3600
    now = timezone.now()
    offering = world.offering
    quotes = Quote.objects.bulk_create(
        Quote(
            offering=offering,
            quote_key=f"k{i}",
            canonical_input={},
            input_hash="h",
            price=PRICE,
            asset=world.token,
            network=offering.network,
            pay_to=offering.pay_to,
            offering_version=1,
            expires_at=now + timedelta(minutes=15),
            public_id=f"qt_backlog{i}",
        )
        for i in range(count)
    )
    purchases = Purchase.objects.bulk_create(
        Purchase(
            quote=q,
            offering=offering,
            amount=PRICE,
            asset=world.token,
            network=offering.network,
            rail="x402",
            ref=f"pur_backlog{i}",
        )
        for i, q in enumerate(quotes)
    )
    Purchase.objects.filter(pk__in=[p.pk for p in purchases]).update(
        payment_state="settlement_pending"
    )
    payer = world.payers[0].address
    attempts = []
    for purchase in purchases:
        auth = Authorization(
            payer=payer,
            to=offering.pay_to,
            value=PRICE,
            valid_after=0,
            valid_before=valid_before,
            nonce="0x" + secrets.token_hex(32),
            signature="0x" + "11" * 65,
        )
        attempts.append(
            PaymentAttempt(
                purchase=purchase,
                rail="x402",
                payer=payer.lower(),
                network=offering.network,
                asset=world.token,
                amount=PRICE,
                fingerprint="f",
                authorization=auth.as_wire(),
                authorization_nonce=auth.nonce,
                valid_before_at=datetime.fromtimestamp(valid_before, tz=UTC),
                broadcast_started_at=now - timedelta(hours=1),
                resubmissions=1,
                resubmitted_at=now,
            )
        )
    PaymentAttempt.objects.bulk_create(attempts, batch_size=2000)
    PaymentAttempt.objects.update(state="settlement_pending")


def test_ten_thousand_pending_rows_cost_a_few_dozen_round_trips(make_x402_world):
    world = make_x402_world(mode="facilitator", facilitator_url="http://127.0.0.1:9")
    _backlog(world, BACKLOG)
    now = timezone.now()
    stats = reconcile.reconcile_pending_settlements(now=now, chunk_size=CHUNK)
    assert stats["claimed"] == BACKLOG
    assert stats["still_pending"] == BACKLOG
    # One head read, one JSON-RPC batch per 2 chunks (one call per row: none has a hash);
    # no per-row calls, no log query needed.
    assert stats["rpc_round_trips"] == 1 + math.ceil(BACKLOG / (2 * CHUNK))
    assert not PaymentAttempt.objects.filter(next_check_at__isnull=True).exists()
    # Rows not yet due again are not looked up again.
    assert reconcile.reconcile_pending_settlements(now=now + timedelta(seconds=1))["claimed"] == 0
