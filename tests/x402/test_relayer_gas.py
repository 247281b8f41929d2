"""The relayer's gas, watched (issue 35, part 3): beat reads each direct-mode relayer's
balance on a real anvil node, keeps it in the database, exports it on /metrics, alerts once
per low spell below X402_<NET>_RELAYER_MIN_GAS, and /readyz says degraded (never failing)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from eth_account import Account
from prometheus_client.parser import text_string_to_metric_families

from payments.models import RelayerGas
from payments.rails.x402.direct import TRANSFER_WITH_AUTHORIZATION_GAS
from payments.rails.x402.gas import GAS_PER_SETTLEMENT, MIN_GAS_SETTLEMENTS
from purchases.notify import Alert
from purchases.services.jobs.reconcile import relayer_funds_watch
from tests.fixtures.anvil import closed_port_url
from tests.x402.chain_env import ChainEnv
from tests.x402.e2e import NETWORK, X402World

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
