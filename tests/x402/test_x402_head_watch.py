"""Payments waiting on the event loop look for their receipts once per block (core.waits
Pacing, payments/rails/x402/receipts.py `chain_head_pacing`), not each on its own timer.

The paid URL is served by the ASGI app (config/asgi.py) on a chain that mines only when told,
with its node behind a recording JSON-RPC proxy (tests/x402/rpc_proxy.py: every request goes
to the real anvil node; the proxy counts what goes over the wire). A receipt look is the batch
`eth_getTransactionReceipt` + `eth_blockNumber`; the head watcher's look is a lone
`eth_blockNumber`. Each payment's own fallback look (PACED_CEILING_SECONDS) is pushed past the
test, so every receipt look counted here was woken by the head watcher.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import requests

from core.waits import pacing_watched
from purchases.models import Purchase
from tests.integration.helpers import wait_for
from tests.x402.e2e import NETWORK, PRICE, X402World, sign_payment
from tests.x402.rpc_proxy import RpcProxy

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
INPUT = {"title": "Paced", "csv": "region,units\nnorth,3\n"}
# While nothing is mined: enough head looks that a payment on the old schedule (5 ms doubling
# to 0.25 s) would have looked for its receipt a dozen times.
QUIET_HEAD_LOOKS = 40


class Paying:
    """Every payer of `world` pays once, each in a thread of its own, through `url`."""

    def __init__(self, world: X402World, url: str, tag: str) -> None:
        self.answers: list[requests.Response | None] = [None] * len(world.payers)
        self.threads = [
            threading.Thread(target=self._pay, args=(url, payer, i, tag), daemon=True)
            for i, payer in enumerate(world.payers)
        ]
        for thread in self.threads:
            thread.start()

    def _pay(self, url: str, payer: Any, index: int, tag: str) -> None:
        body = {**INPUT, "title": f"Paced {index}"}
        required = requests.post(url, json=body, timeout=30)
        if required.status_code != 402:
            self.answers[index] = required
            return
        payment = sign_payment(
            required.headers["PAYMENT-REQUIRED"], payer, f"{tag}-{index:04d}-pay-id"
        )
        self.answers[index] = requests.post(
            url, json=body, headers={"PAYMENT-SIGNATURE": payment}, timeout=90
        )

    def answered(self) -> list[tuple[int, str]]:
        return [(a.status_code, a.text) for a in self.answers if a is not None]

    def join(self) -> list[int | None]:
        for thread in self.threads:
            thread.join(timeout=90)
        return [answer.status_code if answer else None for answer in self.answers]


def receipt_looks(proxy: RpcProxy, start: int = 0) -> dict[str, int]:
    """Receipt looks per transaction hash among the proxy's requests from `start` on."""
    looks: dict[str, int] = {}
    for body in proxy.requests[start:]:
        if isinstance(body, list):
            for call in body:
                if call["method"] == "eth_getTransactionReceipt":
                    looks[call["params"][0]] = looks.get(call["params"][0], 0) + 1
    return looks


def head_looks(proxy: RpcProxy) -> int:
    return sum(
        1
        for body in list(proxy.requests)
        if isinstance(body, dict) and body["method"] == "eth_blockNumber"
    )


def head_unavailable(body: Any, reply: Any) -> Any:
    """A node that cannot say its head (a JSON-RPC error) but answers everything else."""
    if isinstance(body, dict) and body["method"] == "eth_blockNumber":
        error = {"code": -32000, "message": "header not found"}
        return {"jsonrpc": "2.0", "id": body["id"], "error": error}
    return reply


@pytest.fixture
def paced_world(make_x402_world, settings, start_asgi_server, monkeypatch):  # type: ignore[no-untyped-def]
    """A paused chain behind a recording proxy, the paid URL on the ASGI app."""
    world = make_x402_world(no_mining=True)
    proxy = RpcProxy(world.node.rpc_url)
    settings.X402_NETWORKS[NETWORK]["rpc_url"] = proxy.url
    # Long enough that no wait ends by timing out: only a block ends them.
    settings.X402_NETWORKS[NETWORK]["confirmation_timeout"] = 60.0
    settings.X402_RESULT_WAIT_SECONDS = 10  # `report` runs in the request: 200 with the result
    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    monkeypatch.setattr("payments.rails.x402.receipts.PACED_CEILING_SECONDS", 60.0)
    url = f"{start_asgi_server()}{world.paid_url}"
    yield world, proxy, url
    proxy.close()


def all_broadcast_and_looked(world: X402World, proxy: RpcProxy) -> bool:
    return world.relayer_sent() == len(world.payers) and len(receipt_looks(proxy)) == len(
        world.payers
    )


def test_waiting_payments_look_once_per_block_and_the_watcher_ends_with_them(paced_world):  # type: ignore[no-untyped-def]
    world, proxy, url = paced_world
    paying = Paying(world, url, "x402-paced")
    wait_for(lambda: all_broadcast_and_looked(world, proxy), message="every payment broadcast")
    assert ("chain head", proxy.url) in pacing_watched()

    # No block: the watcher keeps looking at the head, the payments do not look again (at
    # most once, when the watcher first saw the head: what came before it is unknown).
    heads = head_looks(proxy)
    wait_for(lambda: head_looks(proxy) >= heads + QUIET_HEAD_LOOKS, message="head looks")
    before_block = receipt_looks(proxy)
    assert set(before_block.values()) <= {1, 2}, before_block
    assert paying.answered() == []  # all still waiting
    assert world.w3.eth.get_transaction_count(world.relayer.address, "latest") == 0

    mined_at = len(proxy.requests)
    world.node.mine()
    assert paying.join() == [200] * len(world.payers)
    # One look each after the block, and it found the receipt.
    assert receipt_looks(proxy, mined_at) == dict.fromkeys(before_block, 1)
    assert world.seller_balance() == len(world.payers) * PRICE
    assert sorted(Purchase.objects.values_list("payment_state", flat=True)) == ["paid"] * len(
        world.payers
    )

    # Nothing waits: the watcher has ended, no task is left looking at the head.
    wait_for(
        lambda: ("chain head", proxy.url) not in pacing_watched(), message="the watcher to end"
    )


def test_a_head_look_that_fails_wakes_no_wait_and_fails_none(paced_world, caplog):  # type: ignore[no-untyped-def]
    world, proxy, url = paced_world
    proxy.tamper = head_unavailable
    paying = Paying(world, url, "x402-paced-fail")
    wait_for(lambda: all_broadcast_and_looked(world, proxy), message="every payment broadcast")

    # A block comes while the head cannot be read: an error is no new block, so no payment
    # is woken (each looked once, before it was handed off) and none is answered as failed.
    world.node.mine()
    heads = head_looks(proxy)
    wait_for(lambda: head_looks(proxy) >= heads + QUIET_HEAD_LOOKS, message="failed head looks")
    assert receipt_looks(proxy) == dict.fromkeys(receipt_looks(proxy), 1)
    assert paying.answered() == []
    warnings = [r for r in caplog.records if r.name == "core.waits"]
    assert len(warnings) == 1, warnings  # once while it fails, not once per look
    assert "header not found" in warnings[0].getMessage()

    # The head answers again: the watcher sees it, the payments look, find their block.
    proxy.tamper = None
    assert paying.join() == [200] * len(world.payers)
    assert sorted(receipt_looks(proxy).values()) == [2] * len(world.payers)
    assert world.seller_balance() == len(world.payers) * PRICE
