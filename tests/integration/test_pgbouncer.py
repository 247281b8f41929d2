"""Issue 18 item 5 behind a transaction-pooling PgBouncer: a payment-id lease whose holder
died is recognised at once, and a database outage answers 503 and lets the retry through.

A session-level lock (an advisory lock, a LISTEN) would not survive transaction pooling:
each transaction may run on another server connection, and a dead client's server session
lives on in the pool. The live servers here reach PostgreSQL only through a private
PgBouncer (`pool_mode = transaction`, tests/fixtures/outages.py), which these tests check
they really went through. The chain, the PgBouncer and one server are shared by the module;
only the worker a test kills is its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import requests
from eth_account.signers.local import LocalAccount
from x402.http.utils import decode_payment_response_header

from devtools.anvil import AnvilNode
from payments.chain.token import balance_of
from payments.models import PaymentAttempt
from purchases.models import IdempotencyRecord, Offering
from tests.factories import OfferingFactory
from tests.fixtures.anvil import deploy_funded_usdc, new_accounts
from tests.fixtures.outages import PgBouncer
from tests.fixtures.server import ROOT, ServerProcess, server_process_start
from tests.fixtures.worker import _database_url
from tests.integration.helpers import wait_for
from tests.x402.e2e import FUNDED, NETWORK, PRICE, sign_payment

INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\n"}


@dataclass
class Chain:
    """This module's own chain: a node mined by hand, a test USDC, a relayer, payers."""

    node: AnvilNode
    token: str
    relayer: LocalAccount
    seller: LocalAccount
    payers: list[LocalAccount]

    def env(self, pgbouncer: PgBouncer, confirmation_timeout: float) -> dict[str, str]:
        """A live server's settings: this chain, and the database through `pgbouncer`. The
        paying request waits for its block up to `confirmation_timeout`: its wait budget
        (the offering's expected run time, capped by X402_RESULT_WAIT_SECONDS) is as long."""
        return {
            "DATABASE_URL": pgbouncer.url(_database_url()),
            "X402_LOCAL_RPC_URL": self.node.rpc_url,
            "X402_LOCAL_TOKEN": self.token,
            "X402_LOCAL_RELAYER_KEY": self.relayer.key.hex(),
            "X402_LOCAL_MODE": "direct",
            "X402_LOCAL_CONFIRMATION_TIMEOUT": str(confirmation_timeout),
            "X402_RESULT_WAIT_SECONDS": str(confirmation_timeout),
        }

    def balance(self, account: LocalAccount) -> int:
        return balance_of(self.node.w3(), self.token, account.address)

    def relayer_sent(self) -> int:
        return int(self.node.w3().eth.get_transaction_count(self.relayer.address, "pending"))


@pytest.fixture(scope="module")
def chain() -> Iterator[Chain]:
    with AnvilNode() as node:
        deployer, relayer, seller, *payers = new_accounts(node, 5)
        token = deploy_funded_usdc(node, deployer, [p.address for p in payers], FUNDED)
        node.set_automine(False)  # a broadcast waits in the pool until the test mines
        yield Chain(node, token, relayer, seller, payers)


@pytest.fixture(scope="module")
def shared_server(
    chain: Chain, pgbouncer: PgBouncer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The web worker every test's buyer retries on (its confirmation wait is short)."""
    log = tmp_path_factory.mktemp("pgbouncer-server") / "shared.log"
    server = server_process_start(chain.env(pgbouncer, 4.0), log)
    yield server
    server.stop()


@pytest.fixture
def offering(chain: Chain) -> Offering:
    return OfferingFactory.create(
        asset=chain.token,
        network=NETWORK,
        pay_to=chain.seller.address,
        price=PRICE,
        expected_run_time=timedelta(seconds=120),  # each server's cap decides the budget
    )


Buy = Callable[..., requests.Response]


def _buyer(server: ServerProcess, offering: Offering, payer: LocalAccount, pay_id: str) -> Buy:
    """One signed payment, sent again on each call (what an x402 client's retry does)."""
    url = f"{server.url}/x402/{offering.slug}"
    required = requests.post(url, json=INPUT, timeout=10)
    headers = {
        "PAYMENT-SIGNATURE": sign_payment(required.headers["PAYMENT-REQUIRED"], payer, pay_id)
    }

    def buy(base_url: str, timeout: float = 30) -> requests.Response:
        return requests.post(
            f"{base_url}/x402/{offering.slug}", json=INPUT, headers=headers, timeout=timeout
        )

    return buy


def _broadcast(chain: Chain) -> PaymentAttempt:
    """The paying request has recorded and broadcast its transaction (it waits for a block)."""
    attempt = wait_for(
        lambda: PaymentAttempt.objects.filter(tx_hash__isnull=False).first(),
        message="the prepared transaction to be committed",
    )
    w3 = chain.node.w3()
    wait_for(lambda: w3.eth.get_transaction(attempt.tx_hash), message="the broadcast")
    return attempt


def _assert_paid_once(answer: requests.Response, attempt: PaymentAttempt) -> None:
    # Settled from the recorded broadcast, then the report run in the request: its result.
    assert answer.status_code == 200, answer.text
    paid = decode_payment_response_header(answer.headers["PAYMENT-RESPONSE"])
    assert paid.success and paid.transaction == attempt.tx_hash
    assert PaymentAttempt.objects.count() == 1
    assert IdempotencyRecord.objects.get().recovery_point == "finished"


def _assert_pooled(pgbouncer: PgBouncer, database: str) -> None:
    """The servers' transactions really ran through PgBouncer, in transaction pooling."""
    config = {row["key"]: row["value"] for row in pgbouncer.show("CONFIG")}
    assert config["pool_mode"] == "transaction"
    stats = {row["database"]: row for row in pgbouncer.show("STATS")}
    assert stats[database]["total_xact_count"] > 0


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_killed_worker_holding_a_payment_id_frees_it_at_once_through_pgbouncer(
    chain: Chain, pgbouncer: PgBouncer, shared_server: ServerProcess, offering: Offering,
    tmp_path: Path,
) -> None:  # fmt: skip
    payer = chain.payers[0]
    holder = server_process_start(chain.env(pgbouncer, 120.0), tmp_path / "holder.log")
    buy = _buyer(holder, offering, payer, "x402-pgbouncer-killed-0001")
    paid_before, seller_before = chain.balance(payer), chain.balance(chain.seller)
    sent_before = chain.relayer_sent()
    with pytest.raises(requests.ReadTimeout):  # the holder waits for a block, holding the id
        buy(holder.url, timeout=3)
    attempt = _broadcast(chain)
    holder.kill()
    killed_at = time.monotonic()
    chain.node.mine()  # the transfer lands while nobody is there to answer
    in_flight: list[float] = []

    def retry() -> requests.Response | None:
        answer = buy(shared_server.url)
        if answer.status_code == 409:
            assert answer.json()["code"] == "payment_in_flight"
            in_flight.append(time.monotonic() - killed_at)
            return None
        return answer

    resumed = wait_for(retry, timeout=30, interval=0.5, message="the dead holder's lease")
    # 4 missed heartbeats of 2 s, as on a direct connection: not the 120 s lease.
    assert time.monotonic() - killed_at < 15, in_flight
    _assert_paid_once(resumed, attempt)
    # Charged once, broadcast once: the retry resumed the dead request's broadcast.
    assert chain.balance(payer) == paid_before - PRICE
    assert chain.balance(chain.seller) == seller_before + PRICE
    assert chain.relayer_sent() == sent_before + 1
    _assert_pooled(pgbouncer, _database_url().rsplit("/", 1)[1])


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_database_cut_behind_pgbouncer_is_503_then_the_retry_goes_through_at_once(
    chain: Chain, pgbouncer: PgBouncer, shared_server: ServerProcess, offering: Offering
) -> None:
    payer = chain.payers[1]
    buy = _buyer(shared_server, offering, payer, "x402-pgbouncer-outage-0001")
    paid_before, sent_before = chain.balance(payer), chain.relayer_sent()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(buy, shared_server.url, 60)
        attempt = _broadcast(chain)
        pgbouncer.cut()  # PostgreSQL goes away behind PgBouncer, which stays up
        try:
            _assert_unavailable(first.result())
            for _ in range(2):  # kept away across the buyer's retries: told so each time
                _assert_unavailable(buy(shared_server.url))
            chain.node.mine()  # the transfer lands meanwhile
        finally:
            pgbouncer.restore()
    # PgBouncer answers "server login has been failing" (503 to the buyer, retryable) for up
    # to server_login_retry after PostgreSQL is back; then nothing may stand in the way.
    pgbouncer.wait_serving(_database_url())
    started = time.monotonic()
    retried = buy(shared_server.url)
    assert retried.json().get("code") != "payment_in_flight"  # nobody holds the id
    assert time.monotonic() - started < 10
    _assert_paid_once(retried, attempt)
    assert chain.balance(payer) == paid_before - PRICE
    assert chain.relayer_sent() == sent_before + 1  # resumed, never sent again


def _assert_unavailable(answer: requests.Response) -> None:
    assert answer.status_code == 503, answer.text
    body = answer.json()
    assert (body["code"], body["retryable"]) == ("service_unavailable", True)
    assert int(answer.headers["Retry-After"]) >= 1


@pytest.mark.parametrize(
    ("env", "disabled"),
    [
        ({"DATABASE_DISABLE_SERVER_SIDE_CURSORS": "true"}, True),
        ({"DATABASE_URL_QUERY": "?disable_server_side_cursors=true"}, True),
        ({"DATABASE_URL_QUERY": "?disable_server_side_cursors=false"}, False),
    ],
)
def test_server_side_cursors_can_be_disabled_for_transaction_pooling(
    env: dict[str, str], disabled: bool
) -> None:
    """Django's advice for transaction pooling, from the environment or DATABASE_URL."""
    query = env.pop("DATABASE_URL_QUERY", "")
    run = subprocess.run(
        [sys.executable, "-c", "from django.conf import settings; print("
         "settings.DATABASES['default']['DISABLE_SERVER_SIDE_CURSORS'])"],
        cwd=ROOT,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("DATABASE_")},
            "DJANGO_SETTINGS_MODULE": "config.settings.test",
            "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/tollbooth{query}",
            **env,
        },
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )  # fmt: skip
    assert run.stdout.strip() == str(disabled)
