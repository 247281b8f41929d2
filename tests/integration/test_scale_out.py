"""Scale-out proof (docs/deployment.md): two gunicorn replicas on the production settings and
two Celery workers, one PostgreSQL, one Redis, one anvil chain. Every race is sent to both
replicas in turn, and each purchase is charged once and executed once.

One test walks the races in order on one chain and one set of processes (starting them is
most of the cost); each race buys a different input, so no race answers another's purchase
inside the duplicate window.
"""

from __future__ import annotations

from typing import Any

import pytest
import requests
from x402.http.utils import decode_payment_signature_header, encode_payment_signature_header
from x402.schemas import PaymentPayload

from fulfillment.models import ExecutionAttempt, Result
from payments.models import LedgerEntry, PaymentAttempt
from purchases.models import Purchase
from purchases.services.shared.buyers import api_key_issue
from tests.factories import BuyerFactory, fund
from tests.integration.helpers import race, wait_for
from tests.x402.e2e import PRICE, X402World, build_world, sign_payment

pytestmark = [pytest.mark.postgres, pytest.mark.worker, pytest.mark.django_db(transaction=True)]
RACERS = 8
CSV = "region,units\nnorth,3\n"


class Shop:
    """The two replicas, the chain and one funded prepaid buyer."""

    def __init__(self, urls: list[str], world: X402World, api_key: str) -> None:
        self.urls, self.world = urls, world
        self.auth = {"Authorization": f"Bearer {api_key}"}

    def url(self, i: int) -> str:
        return self.urls[i % len(self.urls)]

    def quote(self, title: str) -> str:
        answer = requests.post(
            f"{self.url(0)}/api/v1/quotes",
            json={"offering": self.world.offering.slug, "input": {"title": title, "csv": CSV}},
            headers=self.auth,
            timeout=30,
        )
        assert answer.status_code == 201, answer.text
        return str(answer.json()["id"])

    def pay_prepaid(self, i: int, quote_id: str, key: str) -> requests.Response:
        return requests.post(
            f"{self.url(i)}/api/v1/quotes/{quote_id}/purchase",
            json={"rail": "prepaid"},
            headers={**self.auth, "Idempotency-Key": key},
            timeout=60,
        )

    def offer(self, i: int, title: str) -> str:
        answer = requests.post(self.paid(i), json={"title": title, "csv": CSV}, timeout=30)
        assert answer.status_code == 402, answer.text
        return str(answer.headers["PAYMENT-REQUIRED"])

    def pay_x402(self, i: int, title: str, payment: str) -> requests.Response:
        return requests.post(
            self.paid(i),
            json={"title": title, "csv": CSV},
            headers={"PAYMENT-SIGNATURE": payment},
            timeout=60,
        )

    def paid(self, i: int) -> str:
        return f"{self.url(i)}{self.world.paid_url}"


def _named(answer: requests.Response) -> str | None:
    """The purchase an answer names: in its body, or (a 200 carrying the result, once the
    work is done before the answer) in Tollbooth-Duplicate-Of."""
    if answer.status_code == 200:
        return answer.headers.get("Tollbooth-Duplicate-Of")
    return answer.json().get("purchase")


def one_purchase(answers: list[requests.Response], *refusals: str) -> str:
    """Every answer names the one purchase, or (a 409) is in flight or a named refusal."""
    assert {a.status_code for a in answers} <= {200, 202, 409}, [a.text for a in answers]
    refs = {ref for ref in map(_named, answers) if ref}
    assert len(refs) == 1, [a.text for a in answers]
    codes = {a.json()["code"] for a in answers if a.status_code == 409}
    assert codes <= {"payment_in_flight", *refusals}, codes
    return str(refs.pop())


def _with_id(payment: str, payment_id: str) -> str:
    """The very same signed authorization, presented under another payment id."""
    document = decode_payment_signature_header(payment)
    assert isinstance(document, PaymentPayload)
    document.extensions = {"payment-identifier": {"info": {"required": False, "id": payment_id}}}
    return encode_payment_signature_header(document)


def race_prepaid_same_id(shop: Shop) -> str:
    quote_id = shop.quote("prepaid same id")
    answers = race(RACERS, lambda i: shop.pay_prepaid(i, quote_id, "scale-out-same-key-0001"))
    assert {a.status_code for a in answers} <= {201, 409}, [a.text for a in answers]
    refs = {a.json()["purchase"] for a in answers if a.status_code == 201}
    assert len(refs) == 1, [a.text for a in answers]
    assert all(a.json()["code"] == "payment_in_flight" for a in answers if a.status_code == 409)
    return refs.pop()


def race_prepaid_one_quote_many_keys(shop: Shop) -> str:
    quote_id = shop.quote("prepaid many keys")
    answers = race(RACERS, lambda i: shop.pay_prepaid(i, quote_id, f"scale-out-key-{i:04d}-xxxx"))
    created = [a.json() for a in answers if a.status_code == 201]
    duplicates = [a.json() for a in answers if a.status_code == 200]
    assert len(created) == 1 and len(duplicates) == RACERS - 1, [a.text for a in answers]
    assert {body["duplicate_of"] for body in duplicates} == {created[0]["purchase"]}
    return str(created[0]["purchase"])


def race_x402_same_id(shop: Shop) -> str:
    title = "x402 same id"
    payment = sign_payment(shop.offer(0, title), shop.world.payers[0], "scale-out-x402-id-0001")
    answers = race(RACERS, lambda i: shop.pay_x402(i, title, payment))
    return one_purchase(answers)


def race_x402_one_authorization_two_ids(shop: Shop) -> str:
    title = "x402 one authorization"
    payment = sign_payment(shop.offer(0, title), shop.world.payers[1], "scale-out-auth-id-000a")
    other = _with_id(payment, "scale-out-auth-id-000b")
    answers = race(RACERS, lambda i: shop.pay_x402(i, title, payment if i % 4 < 2 else other))
    return one_purchase(answers, "authorization_in_use")


def race_x402_resigned_retries(shop: Shop) -> str:
    title = "x402 re-signed"
    payer = shop.world.payers[2]
    # Each a stock client's retry: its own 402, its own authorization, no payment id.
    payments = [sign_payment(shop.offer(i, title), payer, None) for i in range(RACERS)]
    answers = race(RACERS, lambda i: shop.pay_x402(i, title, payments[i]))
    ref = one_purchase(answers)
    duplicates = [a for a in answers if a.headers.get("Tollbooth-Duplicate-Of")]
    assert {a.headers["Tollbooth-Duplicate-Of"] for a in duplicates} <= {ref}
    return ref


def test_two_replicas_and_two_workers_charge_once_and_execute_once(
    settings, start_replica, start_worker, anvil_node
):
    world = build_world(settings, anvil_node)
    node = anvil_node
    chain_env = {
        "X402_LOCAL_RPC_URL": node.rpc_url,
        "X402_LOCAL_TOKEN": world.token,
        "X402_LOCAL_RELAYER_KEY": world.relayer.key.hex(),
        "X402_LOCAL_MODE": "direct",
        "X402_LOCAL_CONFIRMATION_TIMEOUT": "5",
        "X402_RESULT_WAIT_SECONDS": "0",
    }
    replicas = [start_replica(chain_env), start_replica(chain_env)]
    for name in ("w1", "w2"):
        start_worker(name, extra_env=_worker_env(replicas, chain_env))
    buyer = BuyerFactory.create()
    fund(buyer, 100 * PRICE, asset=world.token)
    shop = Shop([r.url for r in replicas], world, api_key_issue(buyer=buyer))

    prepaid = [race_prepaid_same_id(shop), race_prepaid_one_quote_many_keys(shop)]
    x402 = [
        race_x402_same_id(shop),
        race_x402_one_authorization_two_ids(shop),
        race_x402_resigned_retries(shop),
    ]

    refs = prepaid + x402
    assert len(set(refs)) == len(refs) == Purchase.objects.count()
    # One charge per purchase: one ledger debit each, one transfer on chain each.
    debits = LedgerEntry.objects.filter(buyer=buyer, kind="purchase_debit")
    assert sorted(debits.values_list("purchase__ref", flat=True)) == sorted(prepaid)
    assert PaymentAttempt.objects.count() == len(refs)
    assert world.relayer_sent() == len(x402)
    assert world.seller_balance() == len(x402) * PRICE
    # One execution per purchase, on whichever worker claimed it.
    wait_for(
        lambda: set(Purchase.objects.values_list("fulfillment_state", flat=True)) == {"succeeded"},
        timeout=90,
        interval=0.2,
        message="every purchase to be executed",
    )
    for ref in refs:
        assert ExecutionAttempt.objects.filter(purchase__ref=ref).count() == 1, ref
    assert Result.objects.count() == len(refs)
    for replica in replicas:  # both replicas really took part in the races
        assert replica.log().count('"POST ') >= RACERS, replica.log()


def _worker_env(replicas: list[Any], chain_env: dict[str, str]) -> dict[str, str]:
    from tests.fixtures.replicas import production_env

    # The workers run the production settings too; each keeps the var dir start_worker gives.
    env = production_env(replicas[0].log_path.parent)
    env.pop("TOLLBOOTH_VAR_DIR")
    return {**env, **chain_env}
