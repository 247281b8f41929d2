"""The relayer's gas, watched (issue 35, part 3): beat reads each direct-mode relayer's
balance on a real anvil node, keeps it in the database, exports it on /metrics, alerts once
per low spell below X402_<NET>_RELAYER_MIN_GAS, and /readyz says degraded (never failing)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db.models import Q
from django.test import Client
from django.utils import timezone
from eth_account import Account
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from payments.models import PaymentAttempt, RelayerGas
from payments.rails.x402.direct import TRANSFER_WITH_AUTHORIZATION_GAS
from payments.rails.x402.gas import GAS_PER_SETTLEMENT, MIN_GAS_SETTLEMENTS
from purchases.models import IdempotencyRecord, Purchase, Quote
from purchases.notify import Alert
from purchases.services.jobs.reconcile import relayer_funds_watch
from tests.fixtures.anvil import closed_port_url
from tests.x402.chain_env import ChainEnv
from tests.x402.e2e import NETWORK, PRICE, X402World, ask, sign_payment
from tests.x402.rpc_proxy import RpcProxy

pytestmark = pytest.mark.django_db


class RecordingBackend:
    sent: list[Alert] = []

    def send(self, alert: Alert) -> None:
        RecordingBackend.sent.append(alert)


class RefusingBackend:
    def send(self, alert: Alert) -> None:
        raise RuntimeError("the pager is down")


@pytest.fixture
def alerts(settings: Any) -> list[Alert]:
    RecordingBackend.sent = []
    settings.TOLLBOOTH_ALERT_BACKENDS = ["tests.x402.test_relayer_gas.RecordingBackend"]
    return RecordingBackend.sent


def set_balance(world: X402World, wei: int) -> None:
    world.node.rpc("anvil_setBalance", [world.relayer.address, hex(wei)])


def reading(world: X402World) -> RelayerGas:
    return RelayerGas.objects.get(network=NETWORK, address=world.relayer.address)


def test_gas_per_settlement_is_the_measured_figure(direct_env: ChainEnv):
    """The constant behind the default threshold, measured again: to a seller that holds
    the token already, and to one that does not yet (a new balance slot costs more)."""
    env = direct_env
    used = []
    for to in (env.seller.address, env.seller.address, Account.create().address):
        tx_hash = env.settle(env.authorization(env.sign(to=to)))
        used.append(env.w3.eth.get_transaction_receipt(tx_hash)["gasUsed"])
    first_to_new, again, to_another_new = used
    assert 73_000 <= again <= 73_300
    assert 90_000 <= max(first_to_new, to_another_new) <= GAS_PER_SETTLEMENT
    assert GAS_PER_SETTLEMENT < TRANSFER_WITH_AUTHORIZATION_GAS  # the limit we sign stays above


def test_beat_keeps_the_relayers_balance_and_the_threshold_at_the_current_gas_price(
    x402_world: X402World, alerts: list[Alert]
):
    set_balance(x402_world, 5 * 10**18)

    stats = relayer_funds_watch()

    row = reading(x402_world)
    gas_price = x402_world.w3.eth.gas_price
    assert int(row.balance) == x402_world.w3.eth.get_balance(x402_world.relayer.address)
    assert int(row.balance) == 5 * 10**18
    assert int(row.gas_price) == gas_price
    assert int(row.minimum) == MIN_GAS_SETTLEMENTS * GAS_PER_SETTLEMENT * gas_price
    base_fee = x402_world.w3.eth.get_block("latest")["baseFeePerGas"]
    tip = x402_world.w3.eth.max_priority_fee
    assert int(row.settle_cost) == TRANSFER_WITH_AUTHORIZATION_GAS * (2 * base_fee + tip)
    assert stats[f"{NETWORK}:ok"] == 1
    assert row.alerted_at is None and alerts == []


def test_below_the_minimum_one_alert_per_low_spell(x402_world: X402World, alerts, settings):
    settings.X402_NETWORKS[NETWORK]["relayer_min_gas"] = 10**18
    set_balance(x402_world, 10**18 - 1)

    relayer_funds_watch()
    relayer_funds_watch()  # still low: not alerted again

    assert len(alerts) == 1
    alert = alerts[0]
    assert alert.kind == "relayer_gas_low"
    assert alert.details["address"] == x402_world.relayer.address
    assert alert.details["balance_wei"] == str(10**18 - 1)
    assert alert.details["minimum_wei"] == str(10**18)
    assert alert.details["can_settle"] is True
    assert reading(x402_world).alerted_at is not None

    set_balance(x402_world, 10**18)  # funded: the spell ends
    relayer_funds_watch()
    assert reading(x402_world).alerted_at is None
    assert len(alerts) == 1

    set_balance(x402_world, 10**12)  # a new spell, and too little to settle at all
    relayer_funds_watch()
    assert len(alerts) == 2
    assert alerts[1].details["can_settle"] is False


def test_an_undelivered_alert_is_sent_again_at_the_next_run(x402_world: X402World, settings):
    settings.X402_NETWORKS[NETWORK]["relayer_min_gas"] = 10**18
    set_balance(x402_world, 1)
    settings.TOLLBOOTH_ALERT_BACKENDS = ["tests.x402.test_relayer_gas.RefusingBackend"]

    relayer_funds_watch()
    assert reading(x402_world).alerted_at is None

    RecordingBackend.sent = []
    settings.TOLLBOOTH_ALERT_BACKENDS = ["tests.x402.test_relayer_gas.RecordingBackend"]
    relayer_funds_watch()
    assert len(RecordingBackend.sent) == 1
    assert reading(x402_world).alerted_at is not None


def test_an_unreachable_node_keeps_no_reading_and_says_so(x402_world: X402World, settings):
    settings.X402_NETWORKS[NETWORK]["rpc_url"] = closed_port_url()

    stats = relayer_funds_watch()

    assert stats[f"{NETWORK}:unreachable"] == 1
    assert not RelayerGas.objects.filter(network=NETWORK).exists()


def test_metrics_export_the_balance_and_threshold_exactly(x402_world: X402World, client, settings):
    settings.X402_NETWORKS[NETWORK]["relayer_min_gas"] = 7_000_000
    set_balance(x402_world, 123_456_789)
    relayer_funds_watch()

    families = {
        family.name: family
        for family in text_string_to_metric_families(client.get("/metrics").content.decode())
    }
    labels = {"network": NETWORK, "address": x402_world.relayer.address}
    balance = families["tollbooth_relayer_gas_balance_wei"].samples
    minimum = families["tollbooth_relayer_gas_minimum_wei"].samples
    assert [s.value for s in balance if s.labels == labels] == [123_456_789]
    assert [s.value for s in minimum if s.labels == labels] == [7_000_000]


@pytest.mark.django_db(transaction=True)
def test_readyz_is_degraded_not_failing_for_a_low_relayer(make_x402_world, settings):
    world = make_x402_world()
    settings.TOLLBOOTH_READINESS_CACHE_SECONDS = 0
    check = f"relayer_gas:{NETWORK}"

    never_read = Client().get("/readyz").json()
    assert never_read["checks"][check]["ok"] is True
    assert never_read["checks"][check]["gas"] == "unknown"

    settings.X402_NETWORKS[NETWORK]["relayer_min_gas"] = 10**18
    set_balance(world, 10**17)
    relayer_funds_watch()
    low = Client().get("/readyz")
    assert low.status_code == 200
    assert low.json()["status"] == "degraded"
    assert low.json()["checks"][check]["ok"] is False
    assert low.json()["checks"][check]["error"] == "RelayerGasLow"

    set_balance(world, 1)
    relayer_funds_watch()
    empty = Client().get("/readyz")
    assert (empty.status_code, empty.json()["status"]) == (200, "degraded")
    assert empty.json()["checks"][check]["error"] == "RelayerGasEmpty"

    set_balance(world, 2 * 10**18)
    relayer_funds_watch()
    funded = Client().get("/readyz").json()
    assert funded["checks"][check] == {"ok": True, "gas": "ok", "ms": funded["checks"][check]["ms"]}


def test_a_reading_past_ten_beat_periods_is_unknown_again(x402_world: X402World, settings):
    from payments.rails.x402.gas import relayer_gas_status

    settings.X402_RELAYER_GAS_EVERY_SECONDS = 30.0
    set_balance(x402_world, 1)
    then = timezone.now()
    relayer_funds_watch(now=then)

    assert relayer_gas_status(NETWORK, now=then + timedelta(seconds=300)) == "empty"
    assert relayer_gas_status(NETWORK, now=then + timedelta(seconds=301)) == "unknown"


# --- with too little gas to settle, a paid request is refused before anything is recorded --


@pytest.fixture
def api() -> APIClient:
    return APIClient()


def required_header(client: Any, world: X402World) -> str:
    response = ask(client, world)
    assert response.status_code == 402
    return str(response["PAYMENT-REQUIRED"])


def nothing_recorded() -> None:
    assert not Purchase.objects.exists()
    assert not PaymentAttempt.objects.exists()
    assert not Quote.objects.exists()  # the 402's quote travels signed: written with a purchase
    stored = IdempotencyRecord.objects.filter(
        Q(response_status__isnull=False) | Q(purchase__isnull=False)
    )
    assert not stored.exists()


@pytest.mark.parametrize("payment_id", [None, "relayer-dry-payment-0001"])
def test_a_dry_relayer_refuses_before_anything_is_recorded_and_the_same_payment_pays_once_funded(
    api, x402_world: X402World, settings, payment_id
):
    settings.X402_RELAYER_GAS_EVERY_SECONDS = 30.0
    proxy = RpcProxy(x402_world.node.rpc_url)
    settings.X402_NETWORKS[NETWORK]["rpc_url"] = proxy.url
    try:
        payment = sign_payment(required_header(api, x402_world), x402_world.payers[0], payment_id)
        set_balance(x402_world, 10**9)  # far below one settlement's gas at any fee
        relayer_funds_watch()
        before = len(proxy.requests)

        refused = ask(api, x402_world, payment=payment)

        assert refused.status_code == 503, refused.content
        assert refused.json()["code"] == "settlement_unavailable"
        assert refused["Retry-After"] == "30"
        assert len(proxy.requests) == before  # judged from the reading: not one RPC call
        nothing_recorded()
        assert x402_world.relayer_sent() == 0
        assert x402_world.seller_balance() == 0

        again = ask(api, x402_world, payment=payment)  # not funded yet: refused again
        assert again.status_code == 503
        nothing_recorded()

        set_balance(x402_world, 10**18)
        relayer_funds_watch()
        paid = ask(api, x402_world, payment=payment)
    finally:
        proxy.close()

    assert paid.status_code in (200, 202), paid.content
    assert Purchase.objects.get().payment_state == "paid"
    assert PaymentAttempt.objects.count() == 1
    assert x402_world.seller_balance() == PRICE


def test_an_unknown_balance_refuses_nothing(api, x402_world: X402World, settings):
    """Beat never ran, or its last reading is past ten periods: the payment is taken (a
    broadcast the node refuses stays pending with its hash, never "failed")."""
    settings.X402_RELAYER_GAS_EVERY_SECONDS = 30.0
    payment = sign_payment(required_header(api, x402_world), x402_world.payers[0], None)
    set_balance(x402_world, 1)
    relayer_funds_watch(now=timezone.now() - timedelta(seconds=301))  # stale: unknown
    set_balance(x402_world, 10**18)

    paid = ask(api, x402_world, payment=payment)

    assert paid.status_code in (200, 202), paid.content
    assert Purchase.objects.get().payment_state == "paid"


def test_a_low_but_able_relayer_still_settles(api, x402_world: X402World, settings, alerts):
    """Below the alert threshold is a warning, not a refusal: only a relayer that cannot
    pay one settlement refuses payments."""
    settings.X402_NETWORKS[NETWORK]["relayer_min_gas"] = 10**21
    set_balance(x402_world, 10**18)
    relayer_funds_watch()
    assert len(alerts) == 1

    payment = sign_payment(required_header(api, x402_world), x402_world.payers[0], None)
    paid = ask(api, x402_world, payment=payment)

    assert paid.status_code in (200, 202), paid.content
    assert x402_world.seller_balance() == PRICE


def test_a_repeat_of_a_paid_payment_is_answered_even_when_the_relayer_is_dry(
    api, x402_world: X402World
):
    """A replay needs no gas: it is answered from what was stored, never refused."""
    payment = sign_payment(
        required_header(api, x402_world), x402_world.payers[0], "relayer-dry-replay-0001"
    )
    first = ask(api, x402_world, payment=payment)
    assert first.status_code in (200, 202), first.content
    set_balance(x402_world, 1)
    relayer_funds_watch()

    replay = ask(api, x402_world, payment=payment)

    assert replay.status_code == first.status_code
    assert PaymentAttempt.objects.count() == 1


def test_the_paid_request_reads_the_cache_and_a_miss_is_unknown(api, x402_world: X402World):
    """The paid request asks the shared cache, never the database (its SQL budget is a
    ceiling): an entry gone (Redis restarted, evicted, or no Redis in the demo) is unknown,
    and unknown refuses nothing, whatever the database row says."""
    from django.core.cache import cache

    from payments.rails.x402.gas import _cache_key

    payment = sign_payment(required_header(api, x402_world), x402_world.payers[0], None)
    set_balance(x402_world, 10**9)
    relayer_funds_watch()
    assert RelayerGas.objects.get(network=NETWORK).balance == 10**9
    set_balance(x402_world, 10**18)  # funded since; the row still says it cannot pay
    cache.delete(_cache_key(NETWORK, x402_world.relayer.address))

    paid = ask(api, x402_world, payment=payment)

    assert paid.status_code in (200, 202), paid.content
    assert x402_world.seller_balance() == PRICE
