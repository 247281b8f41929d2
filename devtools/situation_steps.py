"""The steps the failure situations (devtools/situations.py) are made of: the stage they are
played on, the agent's requests (prepaid and x402, over HTTP or in this process through a
refusing facilitator double), and the reads that say what happened."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import requests
from django.conf import settings
from django.test import Client
from django.test.utils import override_settings
from django.urls import reverse
from eth_account import Account
from eth_account.signers.local import LocalAccount
from x402.http.utils import decode_payment_signature_header

from devtools.anvil import AnvilRpc
from devtools.facilitator_double import FacilitatorDouble
from devtools.test_token import send_transfer_with_authorization
from devtools.x402_signer import payment_signature_for
from payments.models import PaymentAttempt
from purchases.models import Purchase

NETWORK = "eip155:31337"
REPORT = "csv-report"
WORD_STATS = "word_stats"
GAS = 10**20  # wei for a throwaway broadcaster's gas
T = TypeVar("T")


class StageProcesses(Protocol):
    """The stage's long-running processes, for the situations that take one down."""

    def kill_worker(self) -> None:
        """SIGKILL the Celery worker; return once a worker runs again."""

    def stop_job_service(self) -> None: ...

    def start_job_service(self) -> None: ...


@dataclass
class Stage:
    """Where situations are played: the server, its chain, a funded prepaid agent and
    funded wallets, and control of its processes."""

    base_url: str
    chain: AnvilRpc
    token: str
    agent_api_key: str
    wallet_keys: list[str]
    processes: StageProcesses
    confirmation_timeout: float = 5.0
    http: requests.Session = field(default_factory=requests.Session, repr=False)

    def __post_init__(self) -> None:
        self.http.trust_env = False  # 127.0.0.1, whatever proxy the environment names

    def wallet(self, index: int) -> LocalAccount:
        account: LocalAccount = Account.from_key(self.wallet_keys[index])
        return account


@dataclass
class Played:
    situation: str
    purchase_ref: str | None
    admin_url: str
    notes: list[str]


class SituationFailed(RuntimeError):
    """The stage did not answer as the situation expects (the demo may be down)."""


# --- prepaid over HTTP -------------------------------------------------------------------
def unique(text: str) -> str:
    return f"{text} {secrets.token_hex(4)}"


def report_input() -> dict[str, str]:
    # A fresh title each time: a repeat inside the duplicate window is answered as a copy.
    return {"title": unique("Rehearsal"), "csv": "region,units\nnorth,3\nsouth,5\n"}


def payment_id(label: str) -> str:
    return f"situation-{label}-{secrets.token_hex(8)}"


def _headers(stage: Stage) -> dict[str, str]:
    return {"Authorization": f"Bearer {stage.agent_api_key}"}


def quote_open(stage: Stage, offering: str, data: dict[str, Any]) -> str:
    response = stage.http.post(
        f"{stage.base_url}/api/v1/quotes",
        json={"offering": offering, "input": data},
        headers=_headers(stage),
        timeout=15,
    )
    expect(response, 201, None)
    return str(response.json()["id"])


def pay_prepaid(
    stage: Stage, quote: str, key: str, *, read_timeout: float = 30.0
) -> requests.Response:
    return stage.http.post(
        f"{stage.base_url}/api/v1/quotes/{quote}/purchase",
        json={"rail": "prepaid"},
        headers={**_headers(stage), "Idempotency-Key": key},
        timeout=(5.0, read_timeout),
    )


def retry_until_stored(stage: Stage, quote: str, key: str) -> dict[str, Any]:
    """What a disciplined agent does: same id until the stored answer (201) arrives."""
    for _ in range(60):
        answer = pay_prepaid(stage, quote, key)
        if answer.status_code == 201:
            body: dict[str, Any] = answer.json()
            return body
        if answer.status_code != 409 or answer.json().get("code") != "payment_in_flight":
            raise SituationFailed(f"purchase: {answer.status_code} {answer.text[:300]}")
        time.sleep(float(answer.headers.get("Retry-After", "1")))
    raise SituationFailed("the purchase stayed in flight")


def get_as_agent(stage: Stage, url: str) -> requests.Response:
    return stage.http.get(url, headers=_headers(stage), timeout=15)


# --- x402 over HTTP --------------------------------------------------------------------
def _x402_url(stage: Stage) -> str:
    return f"{stage.base_url}/x402/{REPORT}"


def x402_payment(
    stage: Stage, data: dict[str, Any], label: str, *, valid_before: int | None = None
) -> str:
    offer = stage.http.post(_x402_url(stage), json=data, timeout=15)
    expect(offer, 402, None)
    header = offer.headers["PAYMENT-REQUIRED"]
    _X402_INPUTS[header] = data
    return sign(stage, header, 0, label, valid_before=valid_before, data=data)


_X402_INPUTS: dict[str, dict[str, Any]] = {}  # signed payment -> the input it pays for


def sign(
    stage: Stage,
    offer: str,
    wallet: int,
    label: str,
    *,
    valid_before: int | None = None,
    data: dict[str, Any] | None = None,
) -> str:
    signed = payment_signature_for(
        offer, stage.wallet(wallet), payment_id(label), chain_id=31337, valid_before=valid_before
    )
    _X402_INPUTS[signed] = data or _X402_INPUTS.get(offer, {})
    return signed


def x402_post(stage: Stage, payment: str) -> requests.Response:
    return stage.http.post(
        _x402_url(stage),
        json=_X402_INPUTS[payment],
        headers={"PAYMENT-SIGNATURE": payment},
        timeout=stage.confirmation_timeout + 60,
    )


def x402_until_paid(stage: Stage, payment: str) -> str:
    """Resend the same signed payment (the agent's poll) until the result is served."""
    for _ in range(120):
        answer = x402_post(stage, payment)
        if answer.status_code == 200:
            return ref_of(attempt_for(payment))
        if answer.status_code not in (202, 409):
            raise SituationFailed(f"x402 poll: {answer.status_code} {answer.text[:300]}")
        time.sleep(0.5)
    raise SituationFailed("the x402 purchase was not delivered in time")


@contextlib.contextmanager
def mining_paused(stage: Stage) -> Iterator[None]:
    stage.chain.set_automine(False)
    try:
        yield
    finally:
        stage.chain.set_automine(True)  # a rehearsal must never leave the chain stalled


# --- x402 through a refusing facilitator, in this process -----------------------------------
@contextlib.contextmanager
def refusing_facilitator(stage: Stage) -> Iterator[tuple[FacilitatorDouble, Client]]:
    gas = _gas_account(stage)
    with FacilitatorDouble(stage.chain.rpc_url, gas) as double:
        double.mode = "reject"
        local = {**settings.X402_NETWORKS[NETWORK], "mode": "facilitator"}
        local.update({"facilitator_url": double.url, "facilitator_timeout": 5.0})
        networks = {**settings.X402_NETWORKS, NETWORK: local}
        with override_settings(X402_NETWORKS=networks, X402_RESULT_WAIT_SECONDS=0):
            yield double, Client()


def x402_offer_in_process(client: Client, data: dict[str, Any]) -> str:
    offer = client.post(f"/x402/{REPORT}", data, content_type="application/json")
    if offer.status_code != 402:
        raise SituationFailed(f"offer: {offer.status_code} {offer.content!r}")
    header = str(offer["PAYMENT-REQUIRED"])
    _X402_INPUTS[header] = data
    return header


def in_process_pay(client: Client, payment: str) -> Any:
    return client.post(
        f"/x402/{REPORT}",
        _X402_INPUTS[payment],
        content_type="application/json",
        headers={"PAYMENT-SIGNATURE": payment},
    )


def _gas_account(stage: Stage) -> LocalAccount:
    account: LocalAccount = Account.create()
    stage.chain.rpc("anvil_setBalance", [account.address, hex(GAS)])
    return account


def broadcast_elsewhere(stage: Stage, payment: str) -> None:
    """Someone holding the signed authorization sends it themselves, and it lands."""
    signed = decode_payment_signature_header(payment).payload
    send_transfer_with_authorization(
        stage.chain.w3(), stage.token, _gas_account(stage), signed["authorization"],
        signed["signature"],
    )  # fmt: skip


# --- reading what happened -------------------------------------------------------------
def attempt_for(payment: str) -> PaymentAttempt:
    nonce = decode_payment_signature_header(payment).payload["authorization"]["nonce"]
    attempts = PaymentAttempt.objects.filter(authorization_nonce__iexact=nonce)
    attempt = attempts.order_by("-pk").first()
    if attempt is None:
        raise SituationFailed("no payment attempt was recorded for the signed payment")
    return attempt


def ref_of(attempt: PaymentAttempt) -> str:
    return str(Purchase.objects.values_list("ref", flat=True).get(pk=attempt.purchase_id))


def fulfillment_state_of(ref: str) -> str:
    return str(Purchase.objects.values_list("fulfillment_state", flat=True).get(ref=ref))


def payment_state_of(ref: str) -> str:
    return str(Purchase.objects.values_list("payment_state", flat=True).get(ref=ref))


def expect(response: Any, status: int, code: str | None) -> None:
    body = response.json() if "json" in response.headers.get("Content-Type", "") else {}
    got = body.get("code") or body.get("status")
    if response.status_code != status or (code is not None and got != code):
        content = getattr(response, "text", None) or response.content
        raise SituationFailed(f"expected {status} {code or ''}, got {response.status_code}: "
                              f"{str(content)[:300]}")  # fmt: skip


def wait(condition: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SituationFailed(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def played(name: str, ref: str, stage: Stage, note: str) -> Played:
    pk = Purchase.objects.values_list("pk", flat=True).get(ref=ref)
    url = stage.base_url + reverse("admin:purchases_purchase_change", args=[pk])
    return Played(name, ref, url, [note])
