"""A payout survives its Celery worker killed (SIGKILL) between its record and its
broadcast: another worker sends the same recorded bytes and exactly one transfer lands.

The first worker talks to the node through a JSON-RPC relay that holds its
eth_sendRawTransaction: either before it reaches the node (killed before the send) or after
the node took it (killed before the send's answer was recorded). Balances are read from the
token on the local anvil chain.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import requests
from celery import current_app
from eth_typing import HexStr
from web3.exceptions import TransactionNotFound

from core.actors import Actor
from payments.models import Payout
from purchases.models import PurchaseEvent
from purchases.services.remedy.payouts import refund_payout_approve
from tests.integration.helpers import wait_for
from tests.reconciliation.payout_world import FINALITY_DEPTH, add_refund_wallet, worker_env
from tests.x402.e2e import PRICE, X402World

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
]


class HeldSend:
    """A JSON-RPC relay to `upstream` that never answers eth_sendRawTransaction: with
    `forward` the node gets the transaction first, without it the node never sees it."""

    def __init__(self, upstream: str, *, forward: bool) -> None:
        self.release = threading.Event()
        relay = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                call = json.loads(body)
                sending = isinstance(call, dict) and call["method"] == "eth_sendRawTransaction"
                if sending and not forward:
                    relay.release.wait(60)
                    return
                answer = requests.post(
                    upstream, data=body, headers={"Content-Type": "application/json"}, timeout=10
                ).content
                if sending:
                    relay.release.wait(60)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def node_holds(world: X402World, tx_hash: str | None) -> bool:
    try:
        return bool(world.w3.eth.get_transaction(HexStr(str(tx_hash))))
    except TransactionNotFound:
        return False


@pytest.fixture
def held_sends() -> Iterator[list[HeldSend]]:
    relays: list[HeldSend] = []
    yield relays
    for relay in relays:
        relay.close()


@pytest.mark.parametrize("node_got_it", [False, True], ids=["before-send", "after-send"])
def test_a_payout_survives_its_worker_killed_between_record_and_broadcast(
    x402_live_world: X402World,
    settings: Any,
    start_worker: Any,
    held_sends: list[HeldSend],
    node_got_it: bool,
) -> None:
    world = x402_live_world
    payouts = add_refund_wallet(world, settings)
    settings.TOLLBOOTH = {
        **settings.TOLLBOOTH,
        "PAYOUT_BROADCAST_GRACE": timedelta(seconds=1),
        "PAYOUT_RECHECK": timedelta(seconds=1),
    }
    payer = world.payers[0]
    before = payouts.balance(payer.address)
    relay = HeldSend(world.node.rpc_url, forward=node_got_it)
    held_sends.append(relay)
    first = start_worker("w1", extra_env=worker_env(payouts, rpc_url=relay.url))

    refund = payouts.owed_refund(payer)
    payout = refund_payout_approve(refund_id=refund.pk, actor=Actor.staff("fay-finance"))
    # The outbox handed the broadcast to w1 after the commit; w1 is now inside its send.
    wait_for(
        lambda: Payout.objects.filter(pk=payout.pk, broadcast_started_at__isnull=False).exists(),
        message="w1 to start the broadcast",
    )
    if node_got_it:
        wait_for(lambda: node_holds(world, payout.tx_hash), message="the node to hold it")
    first.kill()
    payout.refresh_from_db()
    assert (payout.state, payout.broadcasts) == ("recorded", 0)  # its send never answered
    assert payouts.wallet_sent() == int(node_got_it)

    start_worker("w2", extra_env=worker_env(payouts))

    def reconciled_to(state: str) -> bool:
        # The beat's job, sent as beat sends it; w2 runs it (the test only reads the rows).
        current_app.send_task("purchases.tasks.payouts_reconcile_task")
        return Payout.objects.get(pk=payout.pk).state == state

    wait_for(lambda: reconciled_to("broadcast"), timeout=60, interval=1.0, message="broadcast")
    world.node.mine(FINALITY_DEPTH)
    wait_for(lambda: reconciled_to("confirmed"), timeout=60, interval=1.0, message="confirmed")

    refund.refresh_from_db()
    payout.refresh_from_db()
    assert (refund.state, refund.paid_reference) == ("paid", payout.tx_hash)
    # Exactly one transfer: the payer got the refund once, the wallet paid it once.
    assert payouts.balance(payer.address) - before == PRICE
    assert payouts.balance(payouts.wallet.address) == 100 * PRICE - PRICE
    assert payouts.wallet_sent() == 1
    sends = PurchaseEvent.objects.filter(subject="payout.broadcast").values_list(
        "reason_code", flat=True
    )
    assert list(sends) == ["payout_send_known" if node_got_it else "payout_send_sent"]
