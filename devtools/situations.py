"""The twelve failure situations support rehearses, played on a stage: the running demo
(`manage.py demo_situation`) or a test's world (tests/browser), by the same functions.

Each plays the failure for real where it can: API calls over HTTP to the stage's server,
its chain paused, dropped from or mined by hand, its worker killed, its job service stopped.
Where waiting would take minutes (a lease running out, a rebroadcast backoff, the
reconciler's grace), the situation moves that one timestamp back as the tests do, and says so.

Two situations need a payment that fails provably while its authorization can still land:
a direct-mode relayer never produces one (it waits for the chain), so they pay through a
facilitator double that refuses, in this process, with Django's test client; the chain, the
reconciler and the database are the stage's own.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import requests
from django.conf import settings
from django.test import Client
from django.test.utils import override_settings
from django.urls import reverse
from django.utils import timezone
from eth_account import Account
from eth_account.signers.local import LocalAccount
from x402.http.utils import decode_payment_signature_header

from devtools.anvil import AnvilRpc
from devtools.facilitator_double import FacilitatorDouble
from devtools.test_token import send_transfer_with_authorization
from devtools.x402_signer import payment_signature_for
from fulfillment.models import ExecutionAttempt, Result
from payments.models import LedgerEntry, PaymentAttempt
from payments.services import ledger_credit
from purchases.models import Purchase
from purchases.services import reconcile
from purchases.services.buyers import api_key_issue, buyer_create
from purchases.services.sweeper import purchases_sweep_stalled

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


# --- the twelve ----------------------------------------------------------------------------
def dropped_connection_and_retry(stage: Stage) -> Played:
    """The agent's connection drops before the answer; it retries with the same payment id
    and gets the stored answer: one purchase, one debit."""
    quote = _quote(stage, REPORT, _report_input())
    key = _payment_id("drop")
    with contextlib.suppress(requests.exceptions.ReadTimeout):
        # The answer is never read: a client that gave up, a proxy that cut the line.
        _pay_prepaid(stage, quote, key, read_timeout=0.001)
    answer = _retry_until_stored(stage, quote, key)
    ref = answer["purchase"]
    _wait(lambda: _fulfillment(ref) == "succeeded", 60, "the report to be delivered")
    return _played("dropped-connection", ref, stage, "retried with the same payment id: replayed")


def settlement_pending_then_mined(stage: Stage) -> Played:
    """Mining stalls: the paid request answers 202 settlement_pending with the tx hash; once
    a block is mined the same signed payment (a poll) finds it paid."""
    header = _x402_payment(stage, _report_input(), "pending")
    with _mining_paused(stage):
        pending = _x402_post(stage, header)
        _expect(pending, 202, "settlement_pending")
        stage.chain.mine()
    ref = _x402_until_paid(stage, header)
    return _played("settlement-pending", ref, stage, "answered pending, then mined")


def dropped_broadcast_and_rebroadcast(stage: Stage) -> Played:
    """The node loses the broadcast; the next poll past the backoff sends the same bytes."""
    header = _x402_payment(stage, _report_input(), "rebroadcast")
    with _mining_paused(stage):
        _expect(_x402_post(stage, header), 202, "settlement_pending")
        attempt = _attempt_for(header)
        stage.chain.drop_transaction(attempt.tx_hash or "")
        _age_broadcast(attempt, seconds=31)  # the first resubmission backoff is 30 s
        again = _x402_post(stage, header)
        _expect(again, 202, "settlement_pending")
        stage.chain.mine()
    ref = _x402_until_paid(stage, header)
    return _played(
        "dropped-broadcast", ref, stage, "dropped from the pool, resent identically (aged 31 s)"
    )


def authorization_window_closed_unused(stage: Stage) -> Played:
    """The broadcast is lost and the authorization's window closes with its nonce unused:
    the reconciler proves it can never land and fails the purchase."""
    valid_before = int(time.time()) + 35  # the shortest window the seller accepts
    header = _x402_payment(stage, _report_input(), "window", valid_before=valid_before)
    with _mining_paused(stage):
        _expect(_x402_post(stage, header), 202, "settlement_pending")
        attempt = _attempt_for(header)
        stage.chain.drop_transaction(attempt.tx_hash or "")
        stage.chain.set_next_block_timestamp(valid_before + 1)  # the chain's clock passes it
        stage.chain.mine()
    grace = settings.TOLLBOOTH["SETTLEMENT_GRACE"]
    started = attempt.broadcast_started_at or timezone.now()
    later = max(timezone.now() + timedelta(seconds=36), started + grace + timedelta(seconds=1))
    reconcile.reconcile_pending_settlements(now=later)  # the reconciler's pass, run then
    ref = _ref_of(attempt)
    _wait(lambda: _payment(ref) == "failed", 10, "the purchase to fail")
    return _played("authorization-expired", ref, stage, "window closed unused (reconciled later)")


def two_authorizations_for_one_quote(stage: Stage) -> Played:
    """The first authorization is refused, the buyer pays the quote again with a second one,
    and then the first lands too: a duplicate settlement, refund owed at once."""
    with _refusing_facilitator(stage) as (double, client):
        offer = _x402_offer_in_process(client, _report_input())
        first = _sign(stage, offer, 0, "duo-first")
        _expect(_in_process_pay(client, first), 402, "payment_failed")
        double.mode = "ok"
        second = _in_process_pay(client, _sign(stage, offer, 1, "duo-second"))
        if second.status_code not in (200, 202):
            raise SituationFailed(f"second payment: {second.status_code} {second.content!r}")
        attempt = _attempt_for(first)
        _broadcast_elsewhere(stage, first)
    reconcile.watch_failed_attempts()  # the beat job's pass, now; its alert follows from beat
    ref = _ref_of(attempt)
    return _played("two-authorizations", ref, stage, "duplicate settlement: refund owed")


def transfer_after_failure(stage: Stage) -> Played:
    """The purchase failed (refused), yet its authorization is broadcast and lands later:
    the recorded failure stands and a refund is owed."""
    with _refusing_facilitator(stage) as (_double, client):
        offer = _x402_offer_in_process(client, _report_input())
        payment = _sign(stage, offer, 0, "late")
        _expect(_in_process_pay(client, payment), 402, "payment_failed")
        attempt = _attempt_for(payment)
        _broadcast_elsewhere(stage, payment)
    reconcile.watch_failed_attempts()
    return _played("late-transfer", _ref_of(attempt), stage, "late settlement: refund owed")


def execution_failed_by_policy(stage: Stage) -> Played:
    """The paid work fails for good (a CSV with no rows); the offering's policy refunds the
    prepaid balance."""
    quote = _quote(stage, REPORT, {"title": _unique("Empty"), "csv": "region,units\n"})
    answer = _retry_until_stored(stage, quote, _payment_id("policy"))
    ref = answer["purchase"]
    _wait(lambda: _fulfillment(ref) == "failed", 60, "the execution to fail")
    return _played("execution-failed", ref, stage, "job failed: refunded by policy")


def worker_killed_mid_job(stage: Stage) -> Played:
    """The worker dies after the external job exists; the next worker takes the execution
    over from its job ref (the job is polled, never started twice)."""
    quote = _quote(stage, WORD_STATS, {"text": _unique("the cat"), "duration_ms": 6000})
    ref = _retry_until_stored(stage, quote, _payment_id("killed"))["purchase"]
    attempt = _wait(
        lambda: ExecutionAttempt.objects.filter(purchase__ref=ref).exclude(job_ref="").first(),
        60,
        "the job ref to be recorded",
    )
    stage.processes.kill_worker()
    # The lease would run out in a minute: moved, as the tests do, so the sweeper acts now.
    ExecutionAttempt.objects.filter(pk=attempt.pk).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    purchases_sweep_stalled()
    _wait(lambda: _fulfillment(ref) == "succeeded", 90, "the take-over to finish")
    return _played("worker-killed", ref, stage, "worker SIGKILLed; taken over from the job ref")


def job_service_down(stage: Stage) -> Played:
    """The job service is down: each try is counted and retried, the purchase stays running
    (unknown is not failed); when the service is back the next try delivers."""
    stage.processes.stop_job_service()
    try:
        quote = _quote(stage, WORD_STATS, {"text": _unique("the hat"), "duration_ms": 100})
        ref = _retry_until_stored(stage, quote, _payment_id("jobsvc"))["purchase"]
        _wait(
            lambda: Purchase.objects.get(ref=ref).events.filter(reason_code="executor_retry"),
            60,
            "a failed try",
        )
    finally:
        stage.processes.start_job_service()
    _wait(lambda: _fulfillment(ref) == "succeeded", 90, "the retry to deliver")
    return _played("job-service-down", ref, stage, "tries failed while down, then delivered")


def payment_id_reused_with_changed_request(stage: Stage) -> Played:
    """The agent reuses a payment id for another quote: 409 payment_identifier_conflict,
    and the first purchase is untouched."""
    key = _payment_id("conflict")
    ref = _retry_until_stored(stage, _quote(stage, REPORT, _report_input()), key)["purchase"]
    other = _quote(stage, REPORT, _report_input())
    conflict = _pay_prepaid(stage, other, key)
    _expect(conflict, 409, "payment_identifier_conflict")
    return _played("payment-id-conflict", ref, stage, "same id, other quote: 409 conflict")


def prepaid_balance_too_small(stage: Stage) -> Played:
    """A buyer with 0.10 of balance buys a 0.25 report: 402 insufficient_funds, nothing
    debited. Today no purchase is recorded, so the buyer's page is the one to open."""
    buyer = buyer_create(name=_unique("short-balance-agent"), spend_cap=50_000_000)
    key = api_key_issue(buyer=buyer, label="demo situation")
    ledger_credit(
        buyer_id=buyer.pk,
        asset=stage.token,
        amount=100_000,
        kind=LedgerEntry.Kind.TOP_UP,
        reference=f"demo-situation:{buyer.ref}",
    )
    short = Stage(**{**stage.__dict__, "agent_api_key": key, "http": requests.Session()})
    refused = _pay_prepaid(short, _quote(short, REPORT, _report_input()), _payment_id("short"))
    _expect(refused, 402, "insufficient_funds")
    ref = refused.json().get("purchase")
    if ref:
        return _played("balance-too-small", ref, stage, "402 insufficient_funds")
    url = stage.base_url + reverse("admin:purchases_buyer_change", args=[buyer.pk])
    return Played("balance-too-small", None, url, ["402 insufficient_funds; no purchase kept"])


def result_after_retention(stage: Stage) -> Played:
    """The result was delivered and kept for the offering's retention; asked for after it,
    the answer is 410 result_expired naming the receipt."""
    answer = _retry_until_stored(
        stage, _quote(stage, REPORT, _report_input()), _payment_id("retention")
    )
    ref = answer["purchase"]
    _wait(lambda: _fulfillment(ref) == "succeeded", 60, "the report to be delivered")
    result_url = stage.base_url + answer["links"]["result"]
    _expect(_get(stage, result_url), 200, None)
    # Retention is days: the result is aged past it, as the tests do.
    aged = timezone.now() - timedelta(seconds=1)
    Result.objects.filter(purchase__ref=ref).update(expires_at=aged)
    _expect(_get(stage, result_url), 410, "result_expired")
    return _played("result-expired", ref, stage, "asked for after retention: 410 with receipt")


SITUATIONS: dict[str, Callable[[Stage], Played]] = {
    "dropped-connection": dropped_connection_and_retry,
    "settlement-pending": settlement_pending_then_mined,
    "dropped-broadcast": dropped_broadcast_and_rebroadcast,
    "authorization-expired": authorization_window_closed_unused,
    "two-authorizations": two_authorizations_for_one_quote,
    "late-transfer": transfer_after_failure,
    "execution-failed": execution_failed_by_policy,
    "worker-killed": worker_killed_mid_job,
    "job-service-down": job_service_down,
    "payment-id-conflict": payment_id_reused_with_changed_request,
    "balance-too-small": prepaid_balance_too_small,
    "result-expired": result_after_retention,
}


# --- prepaid over HTTP -------------------------------------------------------------------
def _unique(text: str) -> str:
    return f"{text} {secrets.token_hex(4)}"


def _report_input() -> dict[str, str]:
    # A fresh title each time: a repeat inside the duplicate window is answered as a copy.
    return {"title": _unique("Rehearsal"), "csv": "region,units\nnorth,3\nsouth,5\n"}


def _payment_id(label: str) -> str:
    return f"situation-{label}-{secrets.token_hex(8)}"


def _headers(stage: Stage) -> dict[str, str]:
    return {"Authorization": f"Bearer {stage.agent_api_key}"}


def _quote(stage: Stage, offering: str, data: dict[str, Any]) -> str:
    response = stage.http.post(
        f"{stage.base_url}/api/v1/quotes",
        json={"offering": offering, "input": data},
        headers=_headers(stage),
        timeout=15,
    )
    _expect(response, 201, None)
    return str(response.json()["id"])


def _pay_prepaid(
    stage: Stage, quote: str, key: str, *, read_timeout: float = 30.0
) -> requests.Response:
    return stage.http.post(
        f"{stage.base_url}/api/v1/quotes/{quote}/purchase",
        json={"rail": "prepaid"},
        headers={**_headers(stage), "Idempotency-Key": key},
        timeout=(5.0, read_timeout),
    )


def _retry_until_stored(stage: Stage, quote: str, key: str) -> dict[str, Any]:
    """What a disciplined agent does: same id until the stored answer (201) arrives."""
    for _ in range(60):
        answer = _pay_prepaid(stage, quote, key)
        if answer.status_code == 201:
            body: dict[str, Any] = answer.json()
            return body
        if answer.status_code != 409 or answer.json().get("code") != "payment_in_flight":
            raise SituationFailed(f"purchase: {answer.status_code} {answer.text[:300]}")
        time.sleep(float(answer.headers.get("Retry-After", "1")))
    raise SituationFailed("the purchase stayed in flight")


def _get(stage: Stage, url: str) -> requests.Response:
    return stage.http.get(url, headers=_headers(stage), timeout=15)


# --- x402 over HTTP --------------------------------------------------------------------
def _x402_url(stage: Stage) -> str:
    return f"{stage.base_url}/x402/{REPORT}"


def _x402_payment(
    stage: Stage, data: dict[str, Any], label: str, *, valid_before: int | None = None
) -> str:
    offer = stage.http.post(_x402_url(stage), json=data, timeout=15)
    _expect(offer, 402, None)
    header = offer.headers["PAYMENT-REQUIRED"]
    _X402_INPUTS[header] = data
    return _sign(stage, header, 0, label, valid_before=valid_before, data=data)


_X402_INPUTS: dict[str, dict[str, Any]] = {}  # signed payment -> the input it pays for


def _sign(
    stage: Stage,
    offer: str,
    wallet: int,
    label: str,
    *,
    valid_before: int | None = None,
    data: dict[str, Any] | None = None,
) -> str:
    signed = payment_signature_for(
        offer, stage.wallet(wallet), _payment_id(label), chain_id=31337, valid_before=valid_before
    )
    _X402_INPUTS[signed] = data or _X402_INPUTS.get(offer, {})
    return signed


def _x402_post(stage: Stage, payment: str) -> requests.Response:
    return stage.http.post(
        _x402_url(stage),
        json=_X402_INPUTS[payment],
        headers={"PAYMENT-SIGNATURE": payment},
        timeout=stage.confirmation_timeout + 60,
    )


def _x402_until_paid(stage: Stage, payment: str) -> str:
    """Resend the same signed payment (the agent's poll) until the result is served."""
    for _ in range(120):
        answer = _x402_post(stage, payment)
        if answer.status_code == 200:
            return _ref_of(_attempt_for(payment))
        if answer.status_code not in (202, 409):
            raise SituationFailed(f"x402 poll: {answer.status_code} {answer.text[:300]}")
        time.sleep(0.5)
    raise SituationFailed("the x402 purchase was not delivered in time")


@contextlib.contextmanager
def _mining_paused(stage: Stage) -> Iterator[None]:
    stage.chain.set_automine(False)
    try:
        yield
    finally:
        stage.chain.set_automine(True)  # a rehearsal must never leave the chain stalled


# --- x402 through a refusing facilitator, in this process -----------------------------------
@contextlib.contextmanager
def _refusing_facilitator(stage: Stage) -> Iterator[tuple[FacilitatorDouble, Client]]:
    gas = _gas_account(stage)
    with FacilitatorDouble(stage.chain.rpc_url, gas) as double:
        double.mode = "reject"
        local = {**settings.X402_NETWORKS[NETWORK], "mode": "facilitator"}
        local.update({"facilitator_url": double.url, "facilitator_timeout": 5.0})
        networks = {**settings.X402_NETWORKS, NETWORK: local}
        with override_settings(X402_NETWORKS=networks, X402_RESULT_WAIT_SECONDS=0):
            yield double, Client()


def _x402_offer_in_process(client: Client, data: dict[str, Any]) -> str:
    offer = client.post(f"/x402/{REPORT}", data, content_type="application/json")
    if offer.status_code != 402:
        raise SituationFailed(f"offer: {offer.status_code} {offer.content!r}")
    header = str(offer["PAYMENT-REQUIRED"])
    _X402_INPUTS[header] = data
    return header


def _in_process_pay(client: Client, payment: str) -> Any:
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


def _broadcast_elsewhere(stage: Stage, payment: str) -> None:
    """Someone holding the signed authorization sends it themselves, and it lands."""
    signed = decode_payment_signature_header(payment).payload
    send_transfer_with_authorization(
        stage.chain.w3(), stage.token, _gas_account(stage), signed["authorization"],
        signed["signature"],
    )  # fmt: skip


# --- reading what happened -------------------------------------------------------------
def _attempt_for(payment: str) -> PaymentAttempt:
    nonce = decode_payment_signature_header(payment).payload["authorization"]["nonce"]
    attempts = PaymentAttempt.objects.filter(authorization_nonce__iexact=nonce)
    attempt = attempts.order_by("-pk").first()
    if attempt is None:
        raise SituationFailed("no payment attempt was recorded for the signed payment")
    return attempt


def _ref_of(attempt: PaymentAttempt) -> str:
    return str(Purchase.objects.values_list("ref", flat=True).get(pk=attempt.purchase_id))


def _age_broadcast(attempt: PaymentAttempt, *, seconds: int) -> None:
    PaymentAttempt.objects.filter(pk=attempt.pk).update(
        broadcast_started_at=timezone.now() - timedelta(seconds=seconds)
    )


def _fulfillment(ref: str) -> str:
    return str(Purchase.objects.values_list("fulfillment_state", flat=True).get(ref=ref))


def _payment(ref: str) -> str:
    return str(Purchase.objects.values_list("payment_state", flat=True).get(ref=ref))


def _expect(response: Any, status: int, code: str | None) -> None:
    body = response.json() if "json" in response.headers.get("Content-Type", "") else {}
    got = body.get("code") or body.get("status")
    if response.status_code != status or (code is not None and got != code):
        content = getattr(response, "text", None) or response.content
        raise SituationFailed(f"expected {status} {code or ''}, got {response.status_code}: "
                              f"{str(content)[:300]}")  # fmt: skip


def _wait(condition: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SituationFailed(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def _played(name: str, ref: str, stage: Stage, note: str) -> Played:
    pk = Purchase.objects.values_list("pk", flat=True).get(ref=ref)
    url = stage.base_url + reverse("admin:purchases_purchase_change", args=[pk])
    return Played(name, ref, url, [note])
