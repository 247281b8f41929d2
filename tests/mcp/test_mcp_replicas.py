"""Two MCP replicas as production runs them (config/gunicorn_asgi.py: uvicorn workers under
gunicorn, the production settings, two worker processes each) on one database, one chain
and two Celery workers: one buyer's calls spread over both are charged once."""

from __future__ import annotations

import json

import pytest

from payments.models import LedgerEntry, PaymentAttempt
from purchases.models import Purchase
from purchases.services.shared.buyers import api_key_issue
from tests.factories import BuyerFactory, fund
from tests.mcp.test_mcp_stock_client import buy
from tests.x402.e2e import PRICE, build_world

pytestmark = [pytest.mark.postgres, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def test_one_buyer_on_two_replicas_is_charged_once(
    settings, start_replica, start_worker, anvil_node
):
    world = build_world(settings, anvil_node)
    chain_env = {
        "X402_LOCAL_RPC_URL": anvil_node.rpc_url,
        "X402_LOCAL_TOKEN": world.token,
        "X402_LOCAL_RELAYER_KEY": world.relayer.key.hex(),
        "X402_LOCAL_MODE": "direct",
        "X402_LOCAL_CONFIRMATION_TIMEOUT": "5",
        "X402_RESULT_WAIT_SECONDS": "20",
    }
    one, two = start_replica(chain_env, asgi=True), start_replica(chain_env, asgi=True)
    from tests.integration.test_scale_out import _worker_env

    start_worker("w1", extra_env=_worker_env([one, two], chain_env))
    slug = world.offering.slug

    first = buy(one.url, slug, world, "sse")
    assert first["is_error"] is False, first
    purchase = Purchase.objects.get()
    # The stock client calls again on the other replica: re-signed, answered, not charged.
    again = buy(two.url, slug, world, "streamable-http")
    assert again["is_error"] is False, again
    assert again["meta"]["tollbooth/duplicate-of"] == purchase.ref
    assert json.loads(again["content"][0]["text"]) == json.loads(first["content"][0]["text"])
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
    assert PaymentAttempt.objects.count() == 1 and purchase.channel == "mcp"

    buyer = BuyerFactory.create()
    fund(buyer, 10 * PRICE, asset=world.token)
    key = api_key_issue(buyer=buyer)
    for replica in (one, two, one):
        got = buy(replica.url, slug, None, "streamable-http", API_KEY=key)
        assert got["is_error"] is False, got
    debits = LedgerEntry.objects.filter(buyer=buyer, kind=LedgerEntry.Kind.PURCHASE_DEBIT)
    assert [entry.amount for entry in debits] == [-PRICE]
