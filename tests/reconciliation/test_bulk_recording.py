"""Reconciling N pending settlements whose outcomes are on the local chain: the RPC round
trips do not grow with N, and every settlement is recorded as the one-row path would."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from django.utils import timezone

from devtools.settlement_backlog import settlement_backlog_create
from payments.models import PaymentAttempt
from purchases.events import COPY_FROM
from purchases.models import OutboxMessage, Purchase, PurchaseEvent
from purchases.services.jobs import reconcile

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]


class _CountingProxy:
    """An HTTP proxy in front of the node that counts every request reaching it: the round
    trips as the node sees them, whoever in our code made them."""

    def __init__(self, upstream: str) -> None:
        self.requests = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                proxy.requests += 1
                body = self.rfile.read(int(self.headers["Content-Length"]))
                reply = requests.post(
                    upstream, data=body, headers={"Content-Type": "application/json"}, timeout=60
                )
                self.send_response(reply.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply.content)))
                self.end_headers()
                self.wfile.write(reply.content)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def counted_world(make_x402_world, settings) -> Iterator[tuple[object, _CountingProxy]]:
    world = make_x402_world()
    proxy = _CountingProxy(world.node.rpc_url)
    settings.X402_NETWORKS["eip155:31337"]["rpc_url"] = proxy.url
    yield world, proxy
    proxy.close()


def _reconcile_backlog(world, proxy: _CountingProxy, landed: int, expired: int):
    backlog = settlement_backlog_create(
        offering=world.offering,
        rpc_url=world.node.rpc_url,  # set-up goes straight to the node: not counted
        chain_id=31337,
        payer=world.payers[0],
        relayer=world.relayer,
        landed=landed,
        expired=expired,
    )
    before = proxy.requests
    stats = reconcile.reconcile_pending_settlements(now=timezone.now())
    return backlog, stats, proxy.requests - before


def test_round_trips_do_not_grow_with_the_backlog(counted_world):
    world, proxy = counted_world
    _, small_stats, small = _reconcile_backlog(world, proxy, landed=3, expired=2)
    _, large_stats, large = _reconcile_backlog(world, proxy, landed=60, expired=20)
    assert (small_stats["confirmed"], small_stats["failed"]) == (3, 2)
    assert (large_stats["confirmed"], large_stats["failed"]) == (60, 20)
    # The head, one batch for the chunk; nothing per settlement.
    assert small == large == 2
    assert small_stats["rpc_round_trips"] == large_stats["rpc_round_trips"] == 2
    assert small_stats["recorded_one_by_one"] == large_stats["recorded_one_by_one"] == 0


# 25 + 10 write their 95 events with one INSERT; 80 + 40 write 320, past COPY_FROM, by COPY.
@pytest.mark.parametrize(("landed_count", "expired_count"), [(25, 10), (80, 40)])
def test_every_settlement_is_recorded_with_its_evidence(counted_world, landed_count, expired_count):
    assert 3 * 80 + 2 * 40 >= COPY_FROM > 3 * 25 + 2 * 10
    world, proxy = counted_world
    backlog, stats, _ = _reconcile_backlog(world, proxy, landed_count, expired_count)
    assert stats["recorded_one_by_one"] == 0  # all of it through the bulk writer
    attempts = PaymentAttempt.objects.filter(pk__in=backlog.attempt_ids).select_related("purchase")
    landed = [a for a in attempts if a.tx_hash]
    expired = [a for a in attempts if not a.tx_hash]
    assert len(landed) == landed_count and len(expired) == expired_count
    for attempt in landed:
        assert attempt.state == "succeeded"
        assert attempt.block_number and attempt.settlement_reference == attempt.tx_hash
        purchase = attempt.purchase
        assert (purchase.payment_state, purchase.fulfillment_state) == ("paid", "queued")
        assert purchase.paid_at is not None
        subjects = list(
            PurchaseEvent.objects.filter(purchase=purchase)
            .order_by("pk")
            .values_list("subject", "from_state", "to_state")
        )
        assert subjects == [
            ("payment_attempt", "settlement_pending", "succeeded"),
            ("purchase.payment", "settlement_pending", "paid"),
            ("purchase.fulfillment", "not_started", "queued"),
        ]
        event = PurchaseEvent.objects.get(purchase=purchase, subject="payment_attempt")
        assert event.evidence["tx_hash"] == attempt.tx_hash
    for attempt in expired:
        assert (attempt.state, attempt.reason_code) == ("failed", "authorization_expired_unused")
        purchase = attempt.purchase
        assert (purchase.payment_state, purchase.reason_code) == (
            "failed",
            "authorization_expired_unused",
        )
        assert purchase.fulfillment_state == "not_started"
        timeline = list(PurchaseEvent.objects.filter(purchase=purchase).order_by("pk"))
        assert [(e.subject, e.to_state, e.actor) for e in timeline] == [
            ("payment_attempt", "failed", "settlement"),
            ("purchase.payment", "failed", "settlement"),
        ]
        assert timeline[0].evidence["attempt"] == attempt.pk and timeline[0].created_at
    # One staged execution per paid purchase, none for a failed one.
    staged = OutboxMessage.objects.filter(job="purchase_execute")
    assert sorted(m.kwargs["purchase_id"] for m in staged) == sorted(a.purchase_id for a in landed)
    assert Purchase.objects.filter(payment_state="paid").count() == landed_count
    assert world.seller_balance() == landed_count * world.offering.price
    # A second run finds nothing due and writes nothing twice.
    events = PurchaseEvent.objects.count()
    assert reconcile.reconcile_pending_settlements(now=timezone.now())["claimed"] == 0
    assert PurchaseEvent.objects.count() == events
