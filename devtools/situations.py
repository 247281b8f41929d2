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
import time
from collections.abc import Callable
from datetime import timedelta

import requests
from django.conf import settings
from django.urls import reverse
from django.utils import timezone

from devtools.situation_steps import (
    NETWORK,
    REPORT,
    WORD_STATS,
    Played,
    SituationFailed,
    Stage,
    StageProcesses,
    attempt_for,
    broadcast_elsewhere,
    expect,
    fulfillment_state_of,
    get_as_agent,
    in_process_pay,
    mining_paused,
    pay_prepaid,
    payment_id,
    payment_state_of,
    played,
    quote_open,
    ref_of,
    refusing_facilitator,
    report_input,
    retry_until_stored,
    sign,
    unique,
    wait,
    x402_offer_in_process,
    x402_payment,
    x402_post,
    x402_until_paid,
)
from fulfillment.models import ExecutionAttempt, Result
from payments.models import LedgerEntry
from payments.services import ledger_credit
from purchases.models import IdempotencyRecord, Purchase
from purchases.services.fulfil.sweeper import purchases_sweep_stalled
from purchases.services.jobs import reconcile
from purchases.services.shared.buyers import api_key_issue, buyer_create

__all__ = ["NETWORK", "SITUATIONS", "Played", "SituationFailed", "Stage", "StageProcesses"]


# --- the twelve ----------------------------------------------------------------------------
def dropped_connection_and_retry(stage: Stage) -> Played:
    """The agent's connection drops before the answer; it retries with the same payment id
    and gets the stored answer: one purchase, one debit."""
    quote = quote_open(stage, REPORT, report_input())
    key = payment_id("drop")
    with contextlib.suppress(requests.exceptions.ReadTimeout):
        # The answer is never read: a client that gave up, a proxy that cut the line.
        pay_prepaid(stage, quote, key, read_timeout=0.001)
    answer = retry_until_stored(stage, quote, key)
    ref = answer["purchase"]
    wait(lambda: fulfillment_state_of(ref) == "succeeded", 60, "the report to be delivered")
    return played("dropped-connection", ref, stage, "retried with the same payment id: replayed")


def settlement_pending_then_mined(stage: Stage) -> Played:
    """Mining stalls: the paid request answers 202 settlement_pending with the tx hash; once
    a block is mined the same signed payment (a poll) finds it paid."""
    header = x402_payment(stage, report_input(), "pending")
    with mining_paused(stage):
        pending = x402_post(stage, header)
        expect(pending, 202, "settlement_pending")
        stage.chain.mine()
    ref = x402_until_paid(stage, header)
    return played("settlement-pending", ref, stage, "answered pending, then mined")


def dropped_broadcast_and_rebroadcast(stage: Stage) -> Played:
    """The node loses the broadcast; the next poll sends the same bytes at once (the first
    broadcast has answered, so no backoff holds the first resubmission)."""
    header = x402_payment(stage, report_input(), "rebroadcast")
    with mining_paused(stage):
        expect(x402_post(stage, header), 202, "settlement_pending")
        attempt = attempt_for(header)
        stage.chain.drop_transaction(attempt.tx_hash or "")
        again = x402_post(stage, header)
        expect(again, 202, "settlement_pending")
        stage.chain.mine()
    ref = x402_until_paid(stage, header)
    return played(
        "dropped-broadcast",
        ref,
        stage,
        "dropped from the pool, resent identically at the next poll",
    )


def authorization_window_closed_unused(stage: Stage) -> Played:
    """The broadcast is lost and the authorization's window closes with its nonce unused:
    the reconciler proves it can never land and fails the purchase."""
    valid_before = int(time.time()) + 35  # the shortest window the seller accepts
    header = x402_payment(stage, report_input(), "window", valid_before=valid_before)
    with mining_paused(stage):
        expect(x402_post(stage, header), 202, "settlement_pending")
        attempt = attempt_for(header)
        stage.chain.drop_transaction(attempt.tx_hash or "")
        stage.chain.set_next_block_timestamp(valid_before + 1)  # the chain's clock passes it
        stage.chain.mine()
    grace = settings.TOLLBOOTH["SETTLEMENT_GRACE"]
    started = attempt.broadcast_started_at or timezone.now()
    later = max(timezone.now() + timedelta(seconds=36), started + grace + timedelta(seconds=1))
    reconcile.reconcile_pending_settlements(now=later)  # the reconciler's pass, run then
    ref = ref_of(attempt)
    wait(lambda: payment_state_of(ref) == "failed", 10, "the purchase to fail")
    return played("authorization-expired", ref, stage, "window closed unused (reconciled later)")


def two_authorizations_for_one_quote(stage: Stage) -> Played:
    """The first authorization is refused, the buyer pays the quote again with a second one,
    and then the first lands too: a duplicate settlement, refund owed at once."""
    with refusing_facilitator(stage) as (double, client):
        offer = x402_offer_in_process(client, report_input())
        first = sign(stage, offer, 0, "duo-first")
        expect(in_process_pay(client, first), 402, "payment_failed")
        double.mode = "ok"
        second = in_process_pay(client, sign(stage, offer, 1, "duo-second"))
        if second.status_code not in (200, 202):
            raise SituationFailed(f"second payment: {second.status_code} {second.content!r}")
        attempt = attempt_for(first)
        # The paid work finishes before the first authorization lands, so the case reads
        # the same on every run: paid, done, and a duplicate owed back.
        wait(lambda: fulfillment_state_of(ref_of(attempt)) == "succeeded", 60, "the work")
        broadcast_elsewhere(stage, first)
    reconcile.watch_failed_attempts()  # the beat job's pass, now; its alert follows from beat
    ref = ref_of(attempt)
    return played("two-authorizations", ref, stage, "duplicate settlement: refund owed")


def transfer_after_failure(stage: Stage) -> Played:
    """The purchase failed (refused), yet its authorization is broadcast and lands later:
    the recorded failure stands and a refund is owed."""
    with refusing_facilitator(stage) as (_double, client):
        offer = x402_offer_in_process(client, report_input())
        payment = sign(stage, offer, 0, "late")
        expect(in_process_pay(client, payment), 402, "payment_failed")
        attempt = attempt_for(payment)
        broadcast_elsewhere(stage, payment)
    reconcile.watch_failed_attempts()
    return played("late-transfer", ref_of(attempt), stage, "late settlement: refund owed")


def execution_failed_by_policy(stage: Stage) -> Played:
    """The paid work fails for good (a CSV with no rows); the offering's policy refunds the
    prepaid balance."""
    quote = quote_open(stage, REPORT, {"title": unique("Empty"), "csv": "region,units\n"})
    answer = retry_until_stored(stage, quote, payment_id("policy"))
    ref = answer["purchase"]
    wait(lambda: fulfillment_state_of(ref) == "failed", 60, "the execution to fail")
    return played("execution-failed", ref, stage, "job failed: refunded by policy")


def worker_killed_mid_job(stage: Stage) -> Played:
    """The worker dies after the external job exists; the next worker takes the execution
    over from its job ref (the job is polled, never started twice)."""
    quote = quote_open(stage, WORD_STATS, {"text": unique("the cat"), "duration_ms": 6000})
    ref = retry_until_stored(stage, quote, payment_id("killed"))["purchase"]
    attempt = wait(
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
    wait(lambda: fulfillment_state_of(ref) == "succeeded", 90, "the take-over to finish")
    return played("worker-killed", ref, stage, "worker SIGKILLed; taken over from the job ref")


def job_service_down(stage: Stage) -> Played:
    """The job service is down: each try is counted and retried, the purchase stays running
    (unknown is not failed); when the service is back the next try delivers."""
    stage.processes.stop_job_service()
    try:
        quote = quote_open(stage, WORD_STATS, {"text": unique("the hat"), "duration_ms": 100})
        ref = retry_until_stored(stage, quote, payment_id("jobsvc"))["purchase"]
        wait(
            lambda: Purchase.objects.get(ref=ref).events.filter(reason_code="executor_retry"),
            60,
            "a failed try",
        )
    finally:
        stage.processes.start_job_service()
    wait(lambda: fulfillment_state_of(ref) == "succeeded", 90, "the retry to deliver")
    return played("job-service-down", ref, stage, "tries failed while down, then delivered")


def payment_id_reused_with_changed_request(stage: Stage) -> Played:
    """The agent reuses a payment id for another quote: 409 payment_identifier_conflict,
    and the first purchase is untouched."""
    key = payment_id("conflict")
    ref = retry_until_stored(stage, quote_open(stage, REPORT, report_input()), key)["purchase"]
    other = quote_open(stage, REPORT, report_input())
    conflict = pay_prepaid(stage, other, key)
    expect(conflict, 409, "payment_identifier_conflict")
    return played("payment-id-conflict", ref, stage, "same id, other quote: 409 conflict")


def prepaid_balance_too_small(stage: Stage) -> Played:
    """A buyer with 0.10 of balance buys a 0.25 report: 402 insufficient_funds, nothing
    debited. Today no purchase is recorded, so the buyer's page is the one to open."""
    buyer = buyer_create(name=unique("short-balance-agent"), spend_cap=50_000_000)
    key = api_key_issue(buyer=buyer, label="demo situation")
    ledger_credit(
        buyer_id=buyer.pk,
        asset=stage.token,
        amount=100_000,
        kind=LedgerEntry.Kind.TOP_UP,
        reference=f"demo-situation:{buyer.ref}",
    )
    short = Stage(**{**stage.__dict__, "agent_api_key": key, "http": requests.Session()})
    sent_id = payment_id("short")
    refused = pay_prepaid(short, quote_open(short, REPORT, report_input()), sent_id)
    expect(refused, 402, "insufficient_funds")
    ref = refused.json().get("purchase")
    if ref:
        return played("balance-too-small", ref, stage, "402 insufficient_funds")
    # No purchase is kept: the case is the payment id the buyer sent (its idempotency
    # record shows the stored refusal and the buyer's balance; docs/admin.md).
    record = IdempotencyRecord.objects.get(key=sent_id, principal=buyer.ref)
    url = stage.base_url + reverse("admin:purchases_idempotencyrecord_change", args=[record.pk])
    notes = [f"402 insufficient_funds; no purchase kept; search the payment id {sent_id}"]
    return Played("balance-too-small", None, url, notes)


def result_after_retention(stage: Stage) -> Played:
    """The result was delivered and kept for the offering's retention; asked for after it,
    the answer is 410 result_expired naming the receipt."""
    answer = retry_until_stored(
        stage, quote_open(stage, REPORT, report_input()), payment_id("retention")
    )
    ref = answer["purchase"]
    wait(lambda: fulfillment_state_of(ref) == "succeeded", 60, "the report to be delivered")
    result_url = stage.base_url + answer["links"]["result"]
    expect(get_as_agent(stage, result_url), 200, None)
    # Retention is days: the result is aged past it, as the tests do.
    aged = timezone.now() - timedelta(seconds=1)
    Result.objects.filter(purchase__ref=ref).update(expires_at=aged)
    expect(get_as_agent(stage, result_url), 410, "result_expired")
    return played("result-expired", ref, stage, "asked for after retention: 410 with receipt")


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
