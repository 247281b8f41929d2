"""Relayer nonce allocation is one upsert on the relayer's row: racing allocators (separate
database sessions, as separate replicas and workers are) get distinct consecutive nonces, on
PostgreSQL and, in `make test`'s second pass, on the embedded SQLite."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from payments.models import RelayerAccount
from payments.rails.x402.relayer import relayer_nonce_allocate
from payments.rails.x402.types import NetworkConfig

pytestmark = [pytest.mark.sqlite_concurrency, pytest.mark.django_db(transaction=True)]
RELAYER = "0x" + "ab" * 20
NETWORK = NetworkConfig(
    caip2="eip155:31337",
    chain_id=31337,
    rpc_url="http://127.0.0.1:1",  # never called: allocation reads no chain
    token_address="0x" + "0" * 40,
    token_name="USDC",
    token_version="2",
    confirmations=1,
    confirmation_timeout=1.0,
    mode="direct",
)


def test_racing_allocators_get_distinct_consecutive_nonces_from_the_chain_count() -> None:
    count, chain_pending = 16, 7
    barrier = threading.Barrier(count)
    got: list[int] = []
    errors: list[BaseException] = []

    def allocate() -> None:
        try:
            barrier.wait(timeout=10)
            nonce = relayer_nonce_allocate(
                network=NETWORK, address=RELAYER, chain_pending_nonce=chain_pending
            )
            got.append(nonce)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=allocate) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert errors == []
    assert sorted(got) == list(range(chain_pending, chain_pending + count))
    row = RelayerAccount.objects.get()
    assert row.next_nonce == chain_pending + count
