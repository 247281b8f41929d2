"""A second RPC URL per network (issue 35, part 3): the one JSON-RPC client asks it when the
first URL refuses the connection, times out or answers 5xx, and never for a node's JSON-RPC
error or a 4xx. Real anvil behind a closed port and a failing proxy; /readyz reports both."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from payments.models import PaymentAttempt
from payments.rails.x402 import rpc as rpc_module
from payments.rails.x402.rpc import (
    FailoverTransport,
    JsonRpcClient,
    RpcConnectionError,
    RpcError,
    RpcHttpError,
    RpcTransportError,
    transport_for,
)
from purchases.models import Purchase
from tests.fixtures.anvil import closed_port_url
from tests.x402.chain_env import ChainEnv
from tests.x402.e2e import NETWORK, PRICE, X402World, ask, sign_payment
from tests.x402.rpc_proxy import RawReply, RpcProxy


@pytest.fixture
def primary(chain: ChainEnv) -> Iterator[RpcProxy]:
    proxy = RpcProxy(chain.node.rpc_url)
    yield proxy
    proxy.close()


@pytest.fixture
def fallback(chain: ChainEnv) -> Iterator[RpcProxy]:
    proxy = RpcProxy(chain.node.rpc_url)
    yield proxy
    proxy.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def client_over(primary_url: str, fallback_url: str, clock: Clock, timeout: float = 2.0):
    transport = transport_for(primary_url, fallback_url)
    assert isinstance(transport, FailoverTransport)
    transport._clock = clock
    return JsonRpcClient(transport, timeout=timeout)


def test_a_refused_connection_goes_to_the_second_url(chain: ChainEnv, fallback: RpcProxy):
    rpc = client_over(closed_port_url(), fallback.url, Clock())

    assert int(rpc.call("eth_chainId"), 16) == chain.node.chain_id
    assert fallback.methods() == ["eth_chainId"]


@pytest.mark.parametrize("status", [500, 502, 503])
def test_a_5xx_goes_to_the_second_url_and_it_is_asked_first_for_a_while(
    chain: ChainEnv, primary: RpcProxy, fallback: RpcProxy, status: int
):
    primary.tamper = lambda body, reply: RawReply(status, b"<html>bad gateway</html>")
    clock = Clock()
    rpc = client_over(primary.url, fallback.url, clock)

    assert int(rpc.call("eth_blockNumber"), 16) == chain.w3.eth.block_number
    assert (len(primary.requests), len(fallback.requests)) == (1, 1)

    clock.now += rpc_module.FAILOVER_COOLDOWN_SECONDS - 1  # still cooling: straight to two
    rpc.call("eth_blockNumber")
    assert (len(primary.requests), len(fallback.requests)) == (1, 2)

    primary.tamper = None  # back; after the cool-down the first URL is asked first again
    clock.now += 2
    rpc.call("eth_blockNumber")
    assert (len(primary.requests), len(fallback.requests)) == (2, 2)


def test_a_timeout_goes_to_the_second_url(chain: ChainEnv, primary: RpcProxy, fallback: RpcProxy):
    def slow(body: Any, reply: Any) -> Any:
        time.sleep(1.0)
        return reply

    primary.tamper = slow
    rpc = client_over(primary.url, fallback.url, Clock(), timeout=0.3)

    answers = rpc.batch([rpc_module.RpcCall("eth_chainId"), rpc_module.RpcCall("eth_blockNumber")])

    assert int(answers[0].value(), 16) == chain.node.chain_id
    assert fallback.methods() == [["eth_chainId", "eth_blockNumber"]]


def test_a_node_error_or_a_4xx_is_that_nodes_answer_never_a_failover(
    chain: ChainEnv, primary: RpcProxy, fallback: RpcProxy
):
    rpc = client_over(primary.url, fallback.url, Clock())
    with pytest.raises(RpcError):
        rpc.call("eth_noSuchMethod")
    primary.tamper = lambda body, reply: RawReply(429, b"rate limited")
    with pytest.raises(RpcHttpError) as refused:
        rpc.call("eth_blockNumber")
    assert refused.value.status == 429
    assert fallback.requests == []


def test_both_down_raises_the_second_urls_fault(primary: RpcProxy):
    primary.tamper = lambda body, reply: RawReply(503, b"")
    rpc = client_over(primary.url, closed_port_url(), Clock())
    with pytest.raises(RpcConnectionError):
        rpc.call("eth_blockNumber")


def test_without_a_fallback_the_transport_is_the_plain_one(chain: ChainEnv):
    transport = transport_for(chain.node.rpc_url)
    assert not isinstance(transport, FailoverTransport)
    with pytest.raises(RpcTransportError):  # no second URL to ask
        JsonRpcClient(transport_for(closed_port_url()), timeout=0.5).call("eth_chainId")


@pytest.mark.django_db
def test_a_paid_request_settles_over_the_fallback_while_the_first_url_is_down(
    x402_world: X402World, settings: Any
):
    settings.X402_NETWORKS[NETWORK]["rpc_url"] = closed_port_url()
    settings.X402_NETWORKS[NETWORK]["rpc_url_fallback"] = x402_world.node.rpc_url
    client = APIClient()
    payment = sign_payment(ask(client, x402_world)["PAYMENT-REQUIRED"], x402_world.payers[0], None)

    paid = ask(client, x402_world, payment=payment)

    assert paid.status_code in (200, 202), paid.content
    assert Purchase.objects.get().payment_state == "paid"
    assert PaymentAttempt.objects.get().tx_hash
    assert x402_world.seller_balance() == PRICE


@pytest.mark.django_db(transaction=True)
def test_readyz_reports_both_urls_and_fails_only_when_both_do(make_x402_world, settings):
    world = make_x402_world()
    settings.TOLLBOOTH_READINESS_CACHE_SECONDS = 0
    secret_path = "/v2/secret-provider-key"
    settings.X402_NETWORKS[NETWORK]["rpc_url_fallback"] = closed_port_url() + secret_path

    one_down = Client().get("/readyz")
    checks = one_down.json()["checks"]
    assert one_down.status_code == 200
    assert one_down.json()["status"] == "degraded"
    assert checks[f"rpc:{NETWORK}"]["ok"] is True
    assert checks[f"rpc_fallback:{NETWORK}"]["ok"] is False
    assert "secret-provider-key" not in one_down.content.decode()

    settings.X402_NETWORKS[NETWORK]["rpc_url"] = closed_port_url()
    both_down = Client().get("/readyz")
    assert both_down.status_code == 503
    assert both_down.json()["status"] == "unavailable"

    settings.X402_NETWORKS[NETWORK]["rpc_url_fallback"] = world.node.rpc_url
    first_down = Client().get("/readyz")
    assert first_down.status_code == 200
    assert first_down.json()["checks"][f"rpc_fallback:{NETWORK}"]["ok"] is True
