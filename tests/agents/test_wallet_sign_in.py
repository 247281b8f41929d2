"""Re-access by wallet sign-in (x402 sign-in-with-x), with the official x402 Python client's
own hooks running from their own environment (tests/agents/conftest.py), against a live
server on anvil.

A payer that bought a result signs in with its wallet and gets it again: no payment, no new
purchase, the re-access on the timeline. Another wallet, a forged, expired, replayed or
misdirected proof, or one for a result no longer kept gets the ordinary 402, saying why.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from django.utils import timezone
from eth_account.signers.local import LocalAccount
from prometheus_client import REGISTRY

from fulfillment.models import Result
from payments.models import PaymentAttempt
from purchases.models import Offering, Purchase, PurchaseEvent, WalletSignIn
from purchases.services.x402.offers import x402_offer
from tests.factories import OfferingFactory
from tests.x402.e2e import NETWORK, PRICE, X402World

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs/examples/x402_sign_in.py"
SIGNER = ROOT / "tests/agents/siwx_sign.py"
INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\nsouth,5\n"}
METRIC = "tollbooth_wallet_sign_ins_total"
pytestmark = [pytest.mark.postgres, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def _key(wallet: LocalAccount) -> str:
    return "0x" + bytes(wallet.key).hex()


def client_call(
    python: Path, url: str, world: X402World, wallet: LocalAccount, *, pay: bool
) -> dict[str, Any]:
    """One call of docs/examples/x402_sign_in.py, as it is, in its own environment."""
    env = {
        **os.environ,
        "BUYER_KEY": _key(wallet),
        "TOKEN": world.token,
        "NETWORK": NETWORK,
        "TIMEOUT": "60",
        "PAY": "1" if pay else "0",
    }
    done = subprocess.run(
        [str(python), str(EXAMPLE), url, json.dumps(INPUT)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def official_proof(python: Path, url: str, required_header: str, wallet: LocalAccount) -> str:
    """The SIGN-IN-WITH-X header the SDK's client hook makes for this 402 (not sent)."""
    done = subprocess.run(
        [str(python), str(SIGNER), url, required_header],
        env={**os.environ, "BUYER_KEY": _key(wallet)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    header = json.loads(done.stdout.strip().splitlines()[-1])["header"]
    assert header, "the SDK's hook found no sign-in-with-x challenge to sign"
    return str(header)


def challenge(url: str, body: dict[str, Any] | None = None) -> str:
    response = requests.post(url, json=body or INPUT, timeout=30)
    assert response.status_code == 402, response.text
    return response.headers["PAYMENT-REQUIRED"]


def send(url: str, proof: str, body: dict[str, Any] | None = None) -> requests.Response:
    return requests.post(url, json=body or INPUT, headers={"SIGN-IN-WITH-X": proof}, timeout=60)


def refused(response: requests.Response) -> str:
    """The ordinary 402 (a fresh challenge, nothing delivered), and why sign-in was refused."""
    assert response.status_code == 402, response.text
    problem = response.json()
    assert problem["code"] == "payment_required" and "Repr-Digest" not in response.headers
    assert "sign-in-with-x" in problem["paymentRequired"]["extensions"]
    return str(problem["sign_in"]["refused"])


@pytest.fixture
def bought(make_x402_world, settings, http_server, start_worker, siwx_python) -> dict[str, Any]:
    """Payer 0 bought INPUT with the official client (its sign-in tried first, refused)."""
    world = make_x402_world()
    # No duplicate window: only a sign-in can answer a second call without a payment.
    Offering.objects.update(duplicate_window=timedelta(0))
    settings.X402_RESULT_WAIT_SECONDS = 30
    start_worker("w1")
    url = f"{http_server}{world.paid_url}"
    first = client_call(siwx_python, url, world, world.payers[0], pay=True)
    assert first["outcome"] == "response" and first["status"] == 200, first
    assert "payment-response" in first["headers"]
    assert world.seller_balance() == PRICE and not WalletSignIn.objects.exists()
    return {"world": world, "url": url, "server": http_server, "first": first}


def test_payer_fetches_its_result_again_by_signing_in_without_paying(bought, siwx_python):
    world, url = bought["world"], bought["url"]
    purchase = Purchase.objects.get()
    honoured = REGISTRY.get_sample_value(METRIC, {"outcome": "honoured"}) or 0.0

    # PAY=0: the client has no way to pay at all; it can only sign in.
    again = client_call(siwx_python, url, world, world.payers[0], pay=False)

    assert again["outcome"] == "response" and again["status"] == 200, again
    assert again["body"] == bought["first"]["body"]
    assert json.loads(again["body"])["title"] == "Sales"
    assert "payment-response" not in again["headers"]  # nothing was paid in this exchange
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
    assert Purchase.objects.count() == 1 and PaymentAttempt.objects.count() == 1
    event = PurchaseEvent.objects.get(subject="result.reaccessed")
    assert event.purchase_id == purchase.pk and event.actor == world.payers[0].address
    assert event.evidence["address"] == world.payers[0].address
    assert event.evidence["uri"] == url and event.evidence["chain_id"] == NETWORK
    sign_in = WalletSignIn.objects.get()
    assert sign_in.purchase_id == purchase.pk and sign_in.nonce == event.evidence["nonce"]
    delivered = PurchaseEvent.objects.filter(subject="result.redelivered").last()
    assert delivered is not None and delivered.evidence["channel"] == "wallet_sign_in"
    assert REGISTRY.get_sample_value(METRIC, {"outcome": "honoured"}) == honoured + 1


def test_another_wallet_signing_in_gets_nothing(bought, siwx_python):
    world, url = bought["world"], bought["url"]
    stranger = world.payers[1]

    got = client_call(siwx_python, url, world, stranger, pay=False)
    # Refused, the client falls back to paying, and this one cannot: nothing was delivered.
    assert got["outcome"] == "payment_error", got
    proof = official_proof(siwx_python, url, challenge(url), stranger)
    assert refused(send(url, proof)) == "siwx_not_purchased"

    # Its signature presented as the payer's: the signer is not the address it claims.
    claimed = json.loads(base64.b64decode(proof))
    claimed["address"] = world.payers[0].address
    forged = base64.b64encode(json.dumps(claimed).encode()).decode()
    assert refused(send(url, forged)) == "invalid_siwx_signature"
    _nothing_given(world)


def test_a_proof_is_honoured_once(bought, siwx_python):
    world, url = bought["world"], bought["url"]
    proof = official_proof(siwx_python, url, challenge(url), world.payers[0])
    assert send(url, proof).status_code == 200

    assert refused(send(url, proof)) == "invalid_siwx_nonce"

    # Two copies of a fresh proof at once: one answer, one refusal.
    fresh = official_proof(siwx_python, url, challenge(url), world.payers[0])
    statuses: list[int] = []
    threads = [
        threading.Thread(target=lambda: statuses.append(send(url, fresh).status_code))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(statuses) == [200, 402]
    assert WalletSignIn.objects.count() == 2
    assert PurchaseEvent.objects.filter(subject="result.reaccessed").count() == 2


def test_an_expired_proof_gets_nothing(bought, siwx_python):
    world, url = bought["world"], bought["url"]
    # A challenge this server issued ten minutes ago (the clock injected), signed now.
    old = x402_offer(
        offering_slug=world.offering.slug,
        raw_input=INPUT,
        buyer=None,
        resource_url=url,
        now=timezone.now() - timedelta(minutes=10),
    )
    proof = official_proof(siwx_python, url, old.payment_required, world.payers[0])

    assert refused(send(url, proof)) == "invalid_siwx_expired"
    _nothing_given(world)


def test_a_proof_for_another_resource_or_input_gets_nothing(bought, siwx_python, settings):
    world, url = bought["world"], bought["url"]
    payer = world.payers[0]
    other = OfferingFactory.create(
        asset=world.token, network=NETWORK, pay_to=world.seller.address, price=PRICE
    )
    other_url = f"{bought['server']}/x402/{other.slug}"
    other_input = {"title": "Costs", "csv": "region,units\neast,1\n"}
    # The payer bought both of these too, so only the proof's binding stands in the way.
    for target, body in ((other_url, INPUT), (url, other_input)):
        done = subprocess.run(
            [str(siwx_python), str(EXAMPLE), target, json.dumps(body)],
            env={
                **os.environ,
                "BUYER_KEY": _key(payer),
                "TOKEN": world.token,
                "NETWORK": NETWORK,
                "TIMEOUT": "60",
            },
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert json.loads(done.stdout.strip().splitlines()[-1])["status"] == 200, done.stdout
    proof = official_proof(siwx_python, url, challenge(url), payer)
    signed_in = PurchaseEvent.objects.filter(subject="result.reaccessed")

    assert refused(send(other_url, proof)) == "invalid_siwx_uri_mismatch"
    assert refused(send(url, proof, other_input)) == "invalid_siwx_nonce"
    assert not signed_in.exists() and not WalletSignIn.objects.exists()
    assert send(url, proof).status_code == 200  # where and for what it was issued: honoured


def test_a_result_past_its_retention_is_not_given_by_sign_in(bought, siwx_python):
    world, url = bought["world"], bought["url"]
    Result.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    proof = official_proof(siwx_python, url, challenge(url), world.payers[0])

    assert refused(send(url, proof)) == "siwx_not_purchased"
    _nothing_given(world)


def _nothing_given(world: X402World) -> None:
    assert not PurchaseEvent.objects.filter(subject="result.reaccessed").exists()
    assert not WalletSignIn.objects.exists()
    assert Purchase.objects.count() == 1 and world.seller_balance() == PRICE
