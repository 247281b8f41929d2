"""Our relayers' gas: read by beat, kept in the database, judged without an RPC call.

A relayer that runs dry cannot settle: its broadcasts are refused by the node, or sit
unmined, and payments would show up as pending for no fault of the buyer. So beat
(`watch-relayer-gas`, every X402_RELAYER_GAS_EVERY_SECONDS) reads each direct-mode
relayer's balance and fees in one JSON-RPC batch and writes them to `RelayerGas`, the one
value every web process, worker, `/metrics` scrape and `/readyz` probe reads alike (the
database: the metrics are all read from it at scrape time, the demo runs without Redis, and
the alert's once-per-spell mark must survive a Redis restart). The paid request alone reads
a mirror of it in the shared cache (Redis), one GET and no SQL: its SQL budget is a ceiling
that only goes down (tests/x402/test_x402_sql_budget.py). A cache miss is unknown.

- Below `minimum` (X402_<NET>_RELAYER_MIN_GAS wei, default: MIN_GAS_SETTLEMENTS settlements
  of GAS_PER_SETTLEMENT gas at the node's current gas price), the relayer is low: one alert
  per low spell, `/readyz` degraded.
- Below `settle_cost` (the gas limit of one settlement at the fee per gas we would sign), it
  cannot settle: a paid request is answered 503 with Retry-After before anything is recorded
  (payments.rails.x402.rail.X402Rail.verify_funds).
- No reading, or one older than STALE_AFTER_RUNS runs (beat stopped, the node unreachable
  since), or no cache entry (Redis restarted or down, or no Redis: a per-process cache the
  beat's process alone writes) is unknown: unknown refuses nothing. A payment is refused
  only on a reading that says the relayer cannot pay.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.core.cache import cache
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from payments.models import RelayerGas
from payments.rails.base import FundsLow
from payments.rails.x402.direct import (
    FEE_CALLS,
    TRANSFER_WITH_AUTHORIZATION_GAS,
    fee_fields,
    relayer_address,
)
from payments.rails.x402.networks import network_config, relayer_networks
from payments.rails.x402.rpc import TRANSPORT_FAULTS, RpcCall, RpcError, quantity, rpc_client_for
from payments.rails.x402.types import NetworkConfig

logger = logging.getLogger(__name__)
_READ_FAULTS: tuple[type[Exception], ...] = (RpcError, *TRANSPORT_FAULTS)

# Gas one settlement uses, measured: transferWithAuthorization of our TestUSDC on anvil
# (2026-12-07, tests/x402/test_relayer_gas.py measures it again): 73,168 to 73,180 to a
# seller that already holds the token, 90,345 to 90,369 to one that does not yet (since the
# token has cancelAuthorization, as USDC does). Above the larger: an alert that fires a
# little early costs less than one that fires late.
GAS_PER_SETTLEMENT = 90_400
# The default alert threshold holds this many settlements' gas at the current gas price.
MIN_GAS_SETTLEMENTS = 100
# Per JSON-RPC request of a reading: a beat run waits on no node for long.
READ_TIMEOUT_SECONDS = 5.0
# A reading older than this many beat periods is unknown again.
STALE_AFTER_RUNS = 10


@dataclass(frozen=True)
class RelayerGasReading:
    """One reading of a relayer's funds, in wei."""

    network: str
    address: str
    balance: int
    gas_price: int
    settle_cost: int
    minimum: int
    read_at: datetime

    @property
    def low(self) -> bool:
        return self.balance < self.minimum

    @property
    def can_settle(self) -> bool:
        return self.balance >= self.settle_cost


def relayer_min_gas(network: NetworkConfig, *, gas_price: int) -> int:
    """The low-gas threshold in wei: X402_<NET>_RELAYER_MIN_GAS when set, else
    MIN_GAS_SETTLEMENTS settlements of GAS_PER_SETTLEMENT gas at `gas_price`."""
    configured = settings.X402_NETWORKS.get(network.caip2, {}).get("relayer_min_gas")
    if configured is not None:
        return int(configured)
    return MIN_GAS_SETTLEMENTS * GAS_PER_SETTLEMENT * gas_price


def relayer_gas_read(network: NetworkConfig, *, now: datetime) -> RelayerGasReading:
    """The relayer's balance and the fees now, in one round trip. Raises RpcError or a
    TRANSPORT_FAULTS exception; ImproperlyConfigured without a relayer."""
    address = relayer_address(network)
    rpc = rpc_client_for(
        network.rpc_url, timeout=READ_TIMEOUT_SECONDS, fallback=network.rpc_url_fallback
    )
    block, tip, gas_price, balance = rpc.batch(
        [*FEE_CALLS, RpcCall("eth_getBalance", (address, "latest"))]
    )
    fees = fee_fields(rpc, block, tip, gas_price)
    price = quantity(gas_price.value())
    per_gas = fees.get("maxFeePerGas", fees.get("gasPrice", price))
    return RelayerGasReading(
        network=network.caip2,
        address=address,
        balance=quantity(balance.value()),
        gas_price=price,
        settle_cost=TRANSFER_WITH_AUTHORIZATION_GAS * per_gas,
        minimum=relayer_min_gas(network, gas_price=price),
        read_at=now,
    )


def relayer_gas_record(reading: RelayerGasReading) -> RelayerGas:
    """Keep the reading (one row per network and address). A balance back at or above the
    minimum ends the low spell, so the next one is alerted again."""
    values = {
        "balance": Decimal(reading.balance),
        "gas_price": Decimal(reading.gas_price),
        "settle_cost": Decimal(reading.settle_cost),
        "minimum": Decimal(reading.minimum),
        "read_at": reading.read_at,
    }
    if not reading.low:
        values["alerted_at"] = None
    row, _ = RelayerGas.objects.update_or_create(
        network=reading.network, address=reading.address, defaults=values
    )
    _mirror(reading)
    return row


def _cache_key(network: str, address: str) -> str:
    return f"relayer-gas:{network}:{address.lower()}"


def _mirror(reading: RelayerGasReading) -> None:
    """The paid request reads the reading from the shared cache (Redis), not the database:
    its SQL budget is a ceiling (tests/x402/test_x402_sql_budget.py). The entry expires with
    the reading's freshness, so a stopped beat turns it unknown by itself."""
    entry = {"balance": reading.balance, "settle_cost": reading.settle_cost,
             "read_at": reading.read_at.timestamp()}  # fmt: skip
    try:
        cache.set(
            _cache_key(reading.network, reading.address),
            entry,
            timeout=relayer_gas_stale_after().total_seconds(),
        )
    except Exception as exc:  # Redis down: the paid request sees unknown, which refuses nothing
        logger.warning("relayer gas on %s not mirrored to the cache: %r", reading.network, exc)


def relayer_gas_watch(
    *, now: datetime, alert: Callable[[FundsLow], bool], stats: Counter[str]
) -> None:
    """Read and keep every direct-mode relayer's gas; `alert` each one found low whose low
    spell was not alerted yet (marked alerted only when `alert` returns True, so a failed
    delivery is tried again at the next run). A node that does not answer leaves the last
    reading to age into unknown."""
    for caip2 in relayer_networks():
        network = network_config(caip2)
        try:
            reading = relayer_gas_read(network, now=now)
        except _READ_FAULTS as exc:
            logger.warning("relayer gas on %s not read: %r", caip2, exc)
            stats[f"{caip2}:unreachable"] += 1
            continue
        row = relayer_gas_record(reading)
        stats[f"{caip2}:{'low' if reading.low else 'ok'}"] += 1
        if reading.low and row.alerted_at is None and alert(_funds_low(reading)):
            with transaction.atomic():
                RelayerGas.objects.filter(pk=row.pk, alerted_at__isnull=True).update(alerted_at=now)
            stats[f"{caip2}:alerted"] += 1


def _funds_low(reading: RelayerGasReading) -> FundsLow:
    return FundsLow(
        network=reading.network,
        address=reading.address,
        balance=reading.balance,
        minimum=reading.minimum,
        can_settle=reading.can_settle,
        read_at=reading.read_at,
    )


def relayer_gas_stale_after() -> timedelta:
    return timedelta(seconds=STALE_AFTER_RUNS * float(settings.X402_RELAYER_GAS_EVERY_SECONDS))


def relayer_gas_known(network: NetworkConfig, *, now: datetime) -> RelayerGasReading | None:
    """The relayer's last reading on `network`, or None when unknown (never read, read too
    long ago, or no relayer configured). One indexed query; no RPC."""
    try:
        address = relayer_address(network)
    except ImproperlyConfigured:  # no relayer: nothing to judge, the settler says so itself
        return None
    row = (
        RelayerGas.objects.filter(
            network=network.caip2, address=address, read_at__gte=now - relayer_gas_stale_after()
        )
        .only("balance", "gas_price", "settle_cost", "minimum", "read_at")
        .first()
    )
    if row is None:
        return None
    return RelayerGasReading(
        network=network.caip2,
        address=address,
        balance=int(row.balance),
        gas_price=int(row.gas_price),
        settle_cost=int(row.settle_cost),
        minimum=int(row.minimum),
        read_at=row.read_at,
    )


def relayer_gas_unable(network: NetworkConfig, *, now: datetime) -> RelayerGasReading | None:
    """The paid request's question, from the shared cache only (no SQL, no RPC): the last
    reading when it is fresh and says the relayer cannot pay one settlement; None when it
    can, or when unknown (no reading, a stale one, no relayer, the cache unreachable, or
    without Redis a process-local cache the beat's process never wrote to)."""
    try:
        address = relayer_address(network)
        entry = cache.get(_cache_key(network.caip2, address))
    except ImproperlyConfigured:
        return None
    except Exception as exc:  # the cache unreachable: unknown
        logger.warning("relayer gas on %s not read from the cache: %r", network.caip2, exc)
        return None
    if not isinstance(entry, dict):
        return None
    read_at = datetime.fromtimestamp(float(entry["read_at"]), tz=UTC)
    balance, settle_cost = int(entry["balance"]), int(entry["settle_cost"])
    if now - read_at > relayer_gas_stale_after() or balance >= settle_cost:
        return None
    return RelayerGasReading(
        network=network.caip2, address=address, balance=balance, gas_price=0,
        settle_cost=settle_cost, minimum=0, read_at=read_at,
    )  # fmt: skip


def relayer_gas_status(caip2: str, *, now: datetime) -> str:
    """ "ok", "low" (below the alert threshold), "empty" (cannot pay for one settlement) or
    "unknown", for `/readyz`."""
    known = relayer_gas_known(network_config(caip2), now=now)
    if known is None:
        return "unknown"
    if not known.can_settle:
        return "empty"
    return "low" if known.low else "ok"
