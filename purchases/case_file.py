"""The case file's "Now": what is happening to a purchase, whose move it is, until when,
whether it can still change, and which staff actions are safe. Pure: no database, no clock.

`purchase_case(facts, now=...)` looks the purchase's (payment state, fulfilment state,
reason code) up in `CASE_TABLE` (most specific row first), then lays the open remedies
over it: an open escalation names its owner and deadline, a proposed refund waits for
finance, an owed one is finance's to pay back. `case_table_rows()` and `REASON_CODES` are
the table as data, for the runbook and its test (`python manage.py case_table`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from core.errors import ErrorCode, Owner
from purchases.case_checks import case_said, refund_risk
from purchases.case_facts import CaseFacts

ANY = "*"


class Action(StrEnum):
    """Staff actions on a purchase (purchases/services/remedy/case_actions.py runs each)."""

    RECHECK_SETTLEMENT = "recheck_settlement"
    RECONCILE_EXECUTION = "reconcile_execution"
    REDELIVER_RESULT = "redeliver_result"
    ASSIGN = "assign"
    PROPOSE_REFUND = "propose_refund"
    RESOLVE = "resolve"
    APPROVE_REFUND = "approve_refund"  # finance's


ACTION_LABELS = {
    Action.RECHECK_SETTLEMENT: "Re-check settlement now",
    Action.RECONCILE_EXECUTION: "Reconcile execution now",
    Action.REDELIVER_RESULT: "Redeliver the result",
    Action.ASSIGN: "Assign or escalate",
    Action.PROPOSE_REFUND: "Propose a refund or compensation",
    Action.RESOLVE: "Resolve with a reason code",
    Action.APPROVE_REFUND: "Approve or decline the proposed refund",
}


class Deadline(StrEnum):
    """Where the deadline of a row comes from."""

    QUOTE_EXPIRY = "quote_expiry"  # the quote's expiry
    NEXT_CHECK = "next_check"  # the pending attempt's next reconciliation look-up
    # A pending settlement: reconciliation resolves it by RECONCILIATION_DEADLINE from its
    # broadcast, or escalates it (purchases.services.jobs.reconcile._escalate_if_overdue).
    SETTLEMENT_ESCALATION = "settlement_escalation"
    AUTHORIZATION_WINDOW = "authorization_window"  # the authorization's validBefore
    # A failure: until when it can still change (a new payment for its open quote, or an
    # authorization it received that is unspent and still valid); final after.
    FAILED_FINAL = "failed_final"
    EXECUTION_CHECK = "execution_check"  # lease expiry (running) or sweep (queued)
    RESULT_RETENTION = "result_retention"  # the stored result's expiry
    ESCALATION = "escalation"  # the earliest open escalation's deadline
    # After a late transfer: the last moment money for it can still land, by a new payment
    # for its quote or by an authorization it received that is not spent.
    STILL_PAYABLE = "still_payable"
    # Settled, not final yet: the finality watch escalates it if the chain still cannot say
    # by RECONCILIATION_DEADLINE after the settlement (purchases.services.settle.finality).
    FINALITY = "finality"
    NONE = "none"


class Finality(StrEnum):
    OPEN = "open"  # can still change
    FINAL_AT_DEADLINE = "final_at_deadline"  # can change until the deadline, final after
    FINAL = "final"


# Why an escalation was closed: a fixed list so closed cases can be counted.
RESOLUTION_CODES = {
    "settlement_confirmed": "Settlement confirmed on chain",
    "settlement_failed_confirmed": "Settlement failure confirmed; buyer told to pay again",
    "result_delivered": "Result found and delivered",
    "refund_proposed": "Refund or compensation proposed to finance",
    "buyer_informed": "Buyer informed; nothing else to do",
    "work_rerun_safely": "Conflicting effects resolved; work resumed",
    # Closed by the system: an unknown execution's later check got the executor's answer.
    "execution_completed_on_recheck": "The job finished after all; result stored (automatic)",
    "execution_failed_on_recheck": "The executor said the work failed; remedy applied (automatic)",
    "no_action_needed": "No action needed (duplicate or already resolved)",
    "other": "Other (say what in the note)",
}
# Closed by the system only: never offered to a person, nor taken from one.
AUTOMATIC_RESOLUTION_CODES = frozenset(
    {"execution_completed_on_recheck", "execution_failed_on_recheck"}
)
# What a person may resolve with (the resolve forms, case_resolve).
STAFF_RESOLUTION_CODES = {
    code: label for code, label in RESOLUTION_CODES.items()
    if code not in AUTOMATIC_RESOLUTION_CODES
}  # fmt: skip


@dataclass(frozen=True)
class Row:
    payment: str
    fulfillment: str
    reason: str
    sentence: str
    owner: Owner
    deadline: Deadline
    actions: tuple[Action, ...] = ()
    finality: Finality = Finality.OPEN


R = Row
PAY_ACTIONS = (Action.RECHECK_SETTLEMENT, Action.ASSIGN)
RUN_ACTIONS = (Action.RECONCILE_EXECUTION, Action.ASSIGN)
DONE_ACTIONS = (Action.REDELIVER_RESULT, Action.PROPOSE_REFUND, Action.ASSIGN)
BROKEN_ACTIONS = (Action.RECONCILE_EXECUTION, Action.PROPOSE_REFUND, Action.ASSIGN)
RECON, BUYER, SUPPORT, NOBODY = Owner.RECONCILIATION, Owner.BUYER, Owner.SUPPORT, Owner.NONE
PENDING_SAY = "Broadcast; whether it settled is not known yet. "
FAILED_SAY = "Settlement provably failed: no money moved. "
RUN_FAILED_SAY = "Paid, but the work provably did not run. "
UNKNOWN_SAY = "Paid; the work may or may not have run, so nothing is refunded blindly. "

CASE_TABLE: tuple[Row, ...] = (
    # --- before and during payment --------------------------------------------------
    R("unpaid", ANY, ANY, "No payment recorded yet; the buyer may pay while the quote is open.",
      BUYER, Deadline.QUOTE_EXPIRY, (Action.ASSIGN,)),
    R("paying", ANY, ANY, "Payment recorded and being broadcast; the paying request owns it, "
      "then reconciliation.", RECON, Deadline.NEXT_CHECK, PAY_ACTIONS),
    R("settlement_pending", ANY, ANY, PENDING_SAY + "Reconciliation looks it up by tx hash "
      "and (payer, nonce); it is never re-signed.", RECON, Deadline.NEXT_CHECK, PAY_ACTIONS),
    R("settlement_pending", ANY, "settlement_pending", PENDING_SAY + "Reconciliation looks it "
      "up by tx hash and (payer, nonce).", RECON, Deadline.NEXT_CHECK, PAY_ACTIONS),
    R("settlement_pending", ANY, "awaiting_confirmations", "The transfer is mined; waiting for "
      "enough confirmations.", RECON, Deadline.NEXT_CHECK, PAY_ACTIONS),
    R("settlement_pending", ANY, "confirmation_timeout", PENDING_SAY + "No receipt arrived "
      "within the wait; reconciliation looks again.", RECON, Deadline.NEXT_CHECK, PAY_ACTIONS),
    R("settlement_pending", ANY, "not_on_chain_yet", "The authorization's nonce is unused and "
      "no broadcast of it is known: the same signed authorization is resubmitted until its "
      "window closes.", RECON, Deadline.AUTHORIZATION_WINDOW, PAY_ACTIONS),
    R("settlement_pending", ANY, "rpc_error", PENDING_SAY + "The node answered the broadcast "
      "with an error; the transaction may still have been sent, so it is looked up first.",
      RECON, Deadline.NEXT_CHECK, PAY_ACTIONS),
    R("settlement_pending", ANY, "chain_unavailable", PENDING_SAY + "The chain could not be "
      "read; look-ups back off and escalate past the deadline.", RECON, Deadline.NEXT_CHECK,
      PAY_ACTIONS),
    R("settlement_pending", ANY, "authorization_used_untraced", "The nonce is used on chain but "
      "the transaction that used it is not found yet.", RECON, Deadline.NEXT_CHECK, PAY_ACTIONS),
    R("settlement_pending", ANY, "broadcast_not_prepared", "The settlement transaction could "
      "not be prepared; nothing was sent. The next look-up tries again.", RECON,
      Deadline.NEXT_CHECK, PAY_ACTIONS),
    R("settlement_pending", ANY, "facilitator_unavailable", PENDING_SAY + "The facilitator did "
      "not answer; the chain is asked instead.", RECON, Deadline.NEXT_CHECK, PAY_ACTIONS),
    R("settlement_pending", ANY, "facilitator_still_settling", PENDING_SAY + "The paying "
      "request's wait budget ended before the facilitator answered /settle; it may still "
      "broadcast, so the chain is asked instead.", RECON, Deadline.NEXT_CHECK, PAY_ACTIONS),
    R("settlement_pending", ANY, "facilitator_refused_credentials", PENDING_SAY + "The "
      "facilitator refused the seller's credentials (HTTP 401/403): the seller's outage, not "
      "the buyer's. Operations were alerted to fix the key; the chain is asked instead.",
      RECON, Deadline.NEXT_CHECK, PAY_ACTIONS),
    R("settlement_pending", ANY, "facilitator_bad_response", PENDING_SAY + "The facilitator's "
      "answer was unreadable; the chain is asked instead.", RECON, Deadline.NEXT_CHECK,
      PAY_ACTIONS),
    R("settlement_pending", ANY, "settlement_reorged", "Paid until a reorg undid the transfer "
      "before it was final (the result may already be delivered): the same signed "
      "authorization is being settled again while its window is open; if it cannot land, the "
      "payment is reversed and support escalated.", RECON, Deadline.AUTHORIZATION_WINDOW,
      PAY_ACTIONS),
    R("settlement_pending", ANY, "facilitator_unresolved:*", PENDING_SAY + "The facilitator "
      "refused for a reason that does not prove the transfer failed.", RECON,
      Deadline.NEXT_CHECK, PAY_ACTIONS),
    # --- the authorization flow: held while the work runs, settled after -----------------
    R("authorized", ANY, ANY, "Authorization verified and held (the authorization flow): the "
      "work runs before any money moves. It is settled when the work succeeds (or, still "
      "unknown, at the settle margin before its validBefore), never if the work provably "
      "fails.", RECON, Deadline.AUTHORIZATION_WINDOW, RUN_ACTIONS),
    R("released", ANY, ANY, "The work provably failed under the authorization flow: the "
      "authorization was never settled and the buyer was told so. It lapses at its "
      "validBefore; a transfer landing before then is owed back.", NOBODY,
      Deadline.AUTHORIZATION_WINDOW, (Action.ASSIGN,), Finality.FINAL_AT_DEADLINE),
    # --- paid: the work ----------------------------------------------------------------
    R("paid", "not_started", ANY, "Paid; the work is not queued yet.", RECON,
      Deadline.EXECUTION_CHECK, RUN_ACTIONS),
    R("paid", "queued", ANY, "Paid; the work is queued for a worker.", RECON,
      Deadline.EXECUTION_CHECK, RUN_ACTIONS),
    R("paid", "running", ANY, "Paid; a worker is running the work.", RECON,
      Deadline.EXECUTION_CHECK, RUN_ACTIONS),
    R("paid", "succeeded", ANY, "Paid and done: the result is stored for the buyer until "
      "retention ends; the receipt stays.", BUYER, Deadline.RESULT_RETENTION, DONE_ACTIONS,
      Finality.FINAL),
    R("paid", "succeeded", "late_settlement_fulfilled", "A transfer landed after the purchase "
      "had failed; it was accepted and the work is done.", BUYER, Deadline.RESULT_RETENTION,
      DONE_ACTIONS, Finality.FINAL),
    R("paid", "failed", ANY, RUN_FAILED_SAY + "The offering's policy refunds it or escalates "
      "to support.", SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS, Finality.FINAL),
    R("paid", "failed", "job_failed", RUN_FAILED_SAY + "The job service reported the job "
      "failed.", SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS, Finality.FINAL),
    R("paid", "failed", "job_rejected", RUN_FAILED_SAY + "The job service refused the job.",
      SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS, Finality.FINAL),
    R("paid", "failed", "invalid_report_input", RUN_FAILED_SAY + "The input could not be "
      "processed.", SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS, Finality.FINAL),
    R("paid", "failed", "executor_not_registered", RUN_FAILED_SAY + "The offering names an "
      "executor this deployment does not have.", SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS,
      Finality.FINAL),
    R("paid", "failed", "upstream_rejected", RUN_FAILED_SAY + "The seller's upstream answered "
      "a 4xx the offering declares definitive.", SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS,
      Finality.FINAL),
    R("paid", "failed", "not_fetchable", RUN_FAILED_SAY + "The executor could not return the "
      "output.", SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS, Finality.FINAL),
    R("paid", "unknown", ANY, UNKNOWN_SAY + "Inspect the job, then resolve.", SUPPORT,
      Deadline.ESCALATION, BROKEN_ACTIONS),
    R("paid", "unknown", "job_status_unknown", UNKNOWN_SAY + "The job service kept answering "
      "'unknown'.", SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS),
    R("paid", "unknown", "job_still_running", UNKNOWN_SAY + "The job was still running when "
      "the worker's time ran out.", SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS),
    R("paid", "unknown", "job_service_unavailable", UNKNOWN_SAY + "The job service was "
      "unreachable.", SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS),
    R("paid", "unknown", "upstream_unreachable", UNKNOWN_SAY + "The seller's upstream timed "
      "out or dropped the connection on every try.", SUPPORT, Deadline.ESCALATION,
      BROKEN_ACTIONS),
    R("paid", "unknown", "upstream_unavailable", UNKNOWN_SAY + "The seller's upstream kept "
      "answering 5xx, 429 or an undeclared 4xx (401: check its secret).", SUPPORT,
      Deadline.ESCALATION, BROKEN_ACTIONS),
    R("paid", "unknown", "upstream_result_too_large", UNKNOWN_SAY + "The upstream did the work "
      "but its answer was over the offering's size cap: not stored, never refunded blindly.",
      SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS),
    R("paid", "unknown", "upstream_tool_error", UNKNOWN_SAY + "The seller's MCP tool answered "
      "an error; MCP does not say whether it acted, so nothing is retried or refunded.",
      SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS),
    R("paid", "unknown", "upstream_secret_missing", UNKNOWN_SAY + "No call was made: the "
      "upstream's secret variable is not set on the workers.", SUPPORT, Deadline.ESCALATION,
      BROKEN_ACTIONS),
    R("paid", "unknown", "result_unavailable", UNKNOWN_SAY + "The job finished but its result "
      "could not be fetched.", SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS),
    R("paid", "unknown", "execution_tries_exhausted", UNKNOWN_SAY + "Every try was spent.",
      SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS),
    R("paid", "unknown", "execution_deadline_passed", UNKNOWN_SAY + "The execution deadline "
      "passed.", SUPPORT, Deadline.ESCALATION, BROKEN_ACTIONS),
    # --- failed and final ---------------------------------------------------------------
    R("failed", ANY, ANY, FAILED_SAY + "The buyer may pay again with a new authorization; a "
      "late transfer would become a refund.", BUYER, Deadline.FAILED_FINAL, (Action.ASSIGN,),
      Finality.FINAL_AT_DEADLINE),
    R("failed", ANY, "transaction_reverted", FAILED_SAY + "The settlement transaction "
      "reverted.", BUYER, Deadline.FAILED_FINAL, (Action.ASSIGN,), Finality.FINAL_AT_DEADLINE),
    R("failed", ANY, "authorization_expired_unused", FAILED_SAY + "The authorization's window "
      "closed with its nonce unused.", BUYER, Deadline.FAILED_FINAL, (Action.ASSIGN,),
      Finality.FINAL_AT_DEADLINE),
    R("failed", ANY, "authorization_used_elsewhere", FAILED_SAY + "The nonce was used by a "
      "transfer that did not pay us.", BUYER, Deadline.FAILED_FINAL, (Action.ASSIGN,),
      Finality.FINAL_AT_DEADLINE),
    # A facilitator's refusal proves nothing settled through it, not that the signed
    # authorization cannot land: anyone holding it may broadcast it until its window closes.
    R("failed", ANY, "facilitator_rejected:*", "The facilitator refused the payment: nothing "
      "settled through it. The signed authorization can still land until its window closes; "
      "a transfer then would be owed back.", BUYER, Deadline.FAILED_FINAL, (Action.ASSIGN,),
      Finality.FINAL_AT_DEADLINE),
    # Chosen by the remedy, whatever the purchase's own reason: money did move after all.
    # The landed authorization cannot land again, so only a new payment for the quote or
    # another open authorization can still change it; final once neither can (purchase_case).
    R("failed", ANY, "late_settlement", "The payment failed, then a transfer for it landed "
      "anyway: the failure stands and that money goes back to the payer.", BUYER,
      Deadline.STILL_PAYABLE, (Action.ASSIGN,), Finality.FINAL_AT_DEADLINE),
    R("failed", "succeeded", ANY, "The result was delivered on verification, but settlement "
      "failed: the work is unpaid.", SUPPORT, Deadline.FAILED_FINAL, (Action.ASSIGN,),
      Finality.FINAL_AT_DEADLINE),
    # --- paid, then undone by a reorg ----------------------------------------------------
    R("reversed", ANY, ANY, "Delivered, payment reversed: a reorg undid the transfer and the "
      "same authorization can no longer settle (window closed, or nonce spent elsewhere). "
      "Support asks the buyer for a new payment or writes it off.", SUPPORT,
      Deadline.ESCALATION, (Action.ASSIGN,)),
    R("reversed", ANY, "payment_reversed", "Delivered, payment reversed: a reorg undid the "
      "transfer and the same authorization can no longer settle (window closed, or nonce "
      "spent elsewhere). Support asks the buyer for a new payment or writes it off.", SUPPORT,
      Deadline.ESCALATION, (Action.ASSIGN,)),
    R("void", ANY, ANY, "Failed for good: every authorization it received is provably "
      "unusable.", NOBODY, Deadline.NONE, (Action.ASSIGN,), Finality.FINAL),
    R("void", ANY, "authorizations_unusable", "Failed for good: every authorization it "
      "received is provably unusable (window closed or nonce used).", NOBODY, Deadline.NONE,
      (Action.ASSIGN,), Finality.FINAL),
    R("void", ANY, "late_settlement", "Failed for good, but a transfer for it landed after it "
      "had failed: that money goes back to the payer.", NOBODY, Deadline.NONE,
      (Action.ASSIGN,), Finality.FINAL),
)  # fmt: skip

# Reason codes that are not purchase reason codes but reach the case as escalation or
# refund reasons, and the error codes an agent is answered with about an existing
# purchase: what each tells support.
REASON_CODES: dict[str, str] = {
    "execution_failed": "The paid work failed; a refund or an escalation is linked.",
    "execution_outcome_unknown": "The work may have run; support inspects the job.",
    "work_done_unpaid": "The authorization flow ran the work, then its authorization could "
    "not land (cancelled, funds moved, window closed): done, unpaid. Support asks the buyer "
    "for a payment or writes it off.",
    "authorization_released": "The work provably failed: the held authorization was never "
    "settled (nothing charged).",
    "settlement_unresolved_reconciliation": "A settlement stayed unresolved past the "
    "reconciliation deadline.",
    "settlement_unresolved_support": "A settlement stayed unresolved past the support deadline.",
    "settlement_resubmissions_exhausted": "The same authorization was resubmitted the most "
    "times allowed; it waits for its window to close.",
    "reconciliation_row_failed": "A reconciliation job failed on this purchase's row.",
    "late_settlement": "A transfer landed after the purchase failed: a refund is owed.",
    "duplicate_settlement": "A second transfer landed for a paid purchase: a refund is owed.",
    "support_refund": "Support proposed a refund of the payment.",
    "support_compensation": "Support proposed a compensation.",
    "buyer_refund_request": "Support approved the buyer's refund request: a refund proposed.",
    "staff_escalated": "A staff member escalated the purchase.",
    "duplicate_answered": "A repeated payment was answered with this purchase, not charged.",
}
ERROR_CODES_ABOUT_A_PURCHASE: dict[ErrorCode, str] = {
    ErrorCode.QUOTE_ALREADY_PAID: "A second payment for the quote was refused before the "
    "chain; the buyer was pointed at this purchase.",
    ErrorCode.AUTHORIZATION_IN_USE: "An authorization already paying this purchase was "
    "presented again for another.",
    ErrorCode.QUOTE_EXPIRED: "A new payment for this failed purchase came after its quote expired.",
    ErrorCode.SPEND_CAP_EXCEEDED: "A new payment for this purchase would pass the buyer's cap.",
    ErrorCode.PAYMENT_FAILED: "The buyer was told settlement failed (see the reason code).",
    ErrorCode.PAYMENT_REVERSED: "The buyer was told the delivered purchase's payment was "
    "reversed (a reorg undid it and the authorization can no longer settle).",
    ErrorCode.PAYMENT_NOT_COMPLETE: "The buyer asked for the result before the payment "
    "condition held.",
    ErrorCode.EXECUTION_FAILED: "The buyer asked for the result of failed or unknown work.",
    ErrorCode.RESULT_EXPIRED: "The buyer asked for the result after its retention; the "
    "receipt remains.",
    ErrorCode.RETENTION_EXPIRED: "A payment id past retention was replayed; answered from "
    "the receipt.",
    ErrorCode.PAYMENT_IN_FLIGHT: "A retry arrived while the first request still ran.",
    ErrorCode.REFUND_REQUEST_OPEN: "The buyer asked for a refund while its earlier request "
    "was still open.",
    ErrorCode.REFUND_NOT_AVAILABLE: "The buyer asked for a refund before any payment settled.",
    ErrorCode.REFUND_AMOUNT_EXCEEDS_REFUNDABLE: "The buyer asked for more back than is left "
    "after earlier refunds.",
    ErrorCode.IDEMPOTENCY_KEY_REUSED: "The buyer reused a refund request's key for another "
    "request.",
    ErrorCode.REFUND_REQUEST_SIGNATURE_INVALID: "A refund request came signed by a wallet "
    "other than the payer's (or changed after signing).",
    ErrorCode.REFUND_REQUEST_EXPIRED: "A wallet-signed refund request came past its expiry.",
}


# Whose move each of those codes leaves and the safe next step, for the runbook
# (docs/runbook.md is generated from this; tests/test_docs.py keeps it so).
FINANCE = Owner.FINANCE
REASON_MOVES: dict[str, tuple[Owner, str]] = {
    "execution_failed": (FINANCE, "Finance pays the refund back (prepaid: credited at once); "
                         "with an escalation instead, support decides the remedy."),
    "execution_outcome_unknown": (SUPPORT, "Reconcile execution now (asks the job service about "
                                  "the saved job); refund only once the job is known not to "
                                  "have run."),
    "work_done_unpaid": (SUPPORT, "Ask the buyer for a new payment, or write it off; never "
                         "settle another authorization of theirs for it unasked."),
    "authorization_released": (NOBODY, "None: nothing was charged. A transfer that lands before "
                               "its validBefore becomes a refund owed back."),
    "settlement_unresolved_reconciliation": (RECON, "Wait; re-check settlement now. Never ask "
                                             "the buyer to sign again."),
    "settlement_unresolved_support": (SUPPORT, "Re-check settlement now; look the tx hash up "
                                      "on the explorer; resolve with what the chain shows."),
    "settlement_resubmissions_exhausted": (SUPPORT, "Wait for the window to close (then it "
                                           "fails provably); never re-sign."),
    "reconciliation_row_failed": (SUPPORT, "Re-check settlement or reconcile execution now; "
                                  "tell engineering if it fails again."),
    "late_settlement": (FINANCE, "Finance pays it back and marks it paid with the reference; "
                        "support tells the buyer."),
    "duplicate_settlement": (FINANCE, "Finance pays the extra transfer back and marks it paid."),
    "support_refund": (FINANCE, "Finance approves or declines the proposal."),
    "support_compensation": (FINANCE, "Finance approves or declines the proposal."),
    "buyer_refund_request": (FINANCE, "Finance approves or declines the proposal."),
    "staff_escalated": (SUPPORT, "The named owner acts by the deadline, then resolves with a "
                        "reason code."),
    "duplicate_answered": (NOBODY, "Nothing: the buyer was answered with this purchase."),
    ErrorCode.QUOTE_ALREADY_PAID.value: (NOBODY, "Nothing: point the buyer at this purchase."),
    ErrorCode.AUTHORIZATION_IN_USE.value: (BUYER, "The buyer looks this purchase up; never "
                                           "re-sign blindly."),
    ErrorCode.QUOTE_EXPIRED.value: (BUYER, "A new quote and a new authorization."),
    ErrorCode.SPEND_CAP_EXCEEDED.value: (BUYER, "The buyer's owner raises the cap, or waits."),
    ErrorCode.PAYMENT_FAILED.value: (BUYER, "Read the reason code; a new authorization if the "
                                     "failure is proven."),
    ErrorCode.PAYMENT_REVERSED.value: (SUPPORT, "Ask the buyer for a new payment or write "
                                       "it off, then resolve the escalation; never resubmit "
                                       "(the authorization can no longer land)."),
    ErrorCode.PAYMENT_NOT_COMPLETE.value: (RECON, "Wait for settlement; the buyer asks again."),
    ErrorCode.EXECUTION_FAILED.value: (SUPPORT, "See the execution's reason and the remedy "
                                       "linked to it."),
    ErrorCode.RESULT_EXPIRED.value: (NOBODY, "Point the buyer to the receipt; the result is "
                                     "gone."),
    ErrorCode.RETENTION_EXPIRED.value: (NOBODY, "Nothing: the receipt answered it."),
    ErrorCode.PAYMENT_IN_FLIGHT.value: (BUYER, "The buyer waits Retry-After and retries with "
                                        "the same payment id."),
    ErrorCode.REFUND_REQUEST_OPEN.value: (SUPPORT, "Decide the open request (Purchases > Refund "
                                          "requests); the buyer polls it."),
    ErrorCode.REFUND_NOT_AVAILABLE.value: (NOBODY, "Nothing was charged yet: nothing to "
                                           "return."),
    ErrorCode.REFUND_AMOUNT_EXCEEDS_REFUNDABLE.value: (BUYER, "The buyer asks for at most what "
                                                       "is left (the answer says how much)."),
    ErrorCode.IDEMPOTENCY_KEY_REUSED.value: (BUYER, "The buyer uses a new key for a new "
                                             "request."),
    ErrorCode.REFUND_REQUEST_SIGNATURE_INVALID.value: (BUYER, "Only the paying wallet may ask "
                                                       "by signature; nothing was recorded."),
    ErrorCode.REFUND_REQUEST_EXPIRED.value: (BUYER, "The buyer signs a new request with a "
                                             "later expiry."),
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    sentence: str
    owner: Owner
    deadline_at: datetime | None
    deadline_source: Deadline
    finality: Finality
    actions: tuple[Action, ...]
    row: Row
    late_transfer: bool = False
    duplicate_transfer: bool = False
    notes: tuple[str, ...] = field(default=())
    # When a state that is final at a deadline becomes final: the row's own deadline, kept
    # when a remedy's owner replaces the deadline shown.
    final_after_at: datetime | None = None
    escalation_reason: str = ""  # the earliest open escalation's reason code, if any
    # A refund owed and not yet paid back: the purchase may be final (settled) while its
    # remedy is still open, and the page says both.
    refund_open: bool = False
    # The next automatic check that can move it, and what it is (none once final, or when
    # only a person can move it).
    next_check_at: datetime | None = None
    next_check: str = ""
    links: tuple[str, ...] = ()  # records to open (an owed refund), by kind: "refund:<pk>"
    # What refunding now risks (the work's outcome unknown), said on the refund forms.
    refund_warning: str = ""
    # Finance, while a refund is owed or proposed and an escalation names another owner: the
    # money stays finance's move beside the escalation's (issue 33, part 5: an assignment to
    # support took it off finance).
    refund_owner: Owner | None = None

    @property
    def is_final(self) -> bool:
        return self.finality == Finality.FINAL

    @property
    def changes_until(self) -> datetime | None:
        """Until when the state can still change, when that is known."""
        return self.final_after_at


_INDEX = {(r.payment, r.fulfillment, r.reason): r for r in CASE_TABLE}


def reason_key(reason_code: str) -> str:
    """Facilitator codes carry the facilitator's own words after a prefix: one row each."""
    prefix, separator, _ = reason_code.partition(":")
    return f"{prefix}:*" if separator else reason_code


def case_row(*, payment: str, fulfillment: str, reason_code: str) -> Row:
    """The most specific row: exact, then any reason, then any fulfilment state."""
    reason = reason_key(reason_code)
    for key in (
        (payment, fulfillment, reason),
        (payment, ANY, reason),
        (payment, fulfillment, ANY),
        (payment, ANY, ANY),
    ):
        if key in _INDEX:
            return _INDEX[key]
    raise LookupError(f"no case row for payment state {payment!r}")


def _deadline(row: Row, facts: CaseFacts) -> datetime | None:
    source = row.deadline
    if source == Deadline.QUOTE_EXPIRY:
        return facts.quote_expires_at
    if source == Deadline.NEXT_CHECK:
        return facts.settlement_escalates_at or facts.next_check_at or _first_look_up(facts)
    if source == Deadline.AUTHORIZATION_WINDOW:
        return facts.valid_before_at or facts.next_check_at
    if source == Deadline.EXECUTION_CHECK:
        if facts.fulfillment_state == "running" and facts.execution is not None:
            return facts.execution.give_up_at
        if facts.fulfillment_state == "running" and facts.lease_expires_at:
            return facts.lease_expires_at
        return facts.updated_at + facts.sweep_grace
    if source == Deadline.RESULT_RETENTION:
        return facts.result_expires_at
    if source == Deadline.ESCALATION and facts.escalations:
        return min(e.deadline_at for e in facts.escalations)
    if source in (Deadline.STILL_PAYABLE, Deadline.FAILED_FINAL):
        window = facts.landable_valid_before_at
        return max(facts.quote_expires_at, window) if window else facts.quote_expires_at
    return None


def _first_look_up(facts: CaseFacts) -> datetime | None:
    """An attempt with no look-up scheduled yet is reconciliation's after the grace."""
    created = facts.pending_created_at
    return created + facts.settlement_grace if created else None


def _is_safe(action: Action, facts: CaseFacts, now: datetime) -> bool:
    """The table offers an action for the state; the facts say whether it is safe now."""
    if action == Action.RECHECK_SETTLEMENT:
        return facts.rail == "x402" and (facts.has_pending_attempt or facts.unfinal is not None)
    if action == Action.RECONCILE_EXECUTION:
        if facts.fulfillment_state == "unknown":
            return True
        stalled_at = facts.lease_expires_at if facts.fulfillment_state == "running" else None
        due = stalled_at or facts.updated_at + facts.sweep_grace
        return facts.fulfillment_state in ("not_started", "queued", "running") and due <= now
    if action == Action.REDELIVER_RESULT:
        return facts.result_expires_at is not None and facts.result_expires_at > now
    if action == Action.PROPOSE_REFUND:
        live = [r for r in facts.refunds if r.state != "declined"]
        open_ones = [r for r in live if r.state in ("proposed", "owed")]
        return not open_ones and sum(r.amount for r in live) < facts.amount
    if action == Action.RESOLVE:
        return bool(facts.escalations)
    if action == Action.APPROVE_REFUND:
        return any(r.state == "proposed" for r in facts.refunds)
    return True


def escalated_note(owner: str, reason_code: str = "") -> str:
    """The Now box's note for an open escalation; without its reason for a role that does
    not see escalations' reason codes."""
    return f"Escalated to {owner}: {reason_code}." if reason_code else f"Escalated to {owner}."


LATE = "late_settlement"
DUPLICATE = "duplicate_settlement"


def _row_for(facts: CaseFacts) -> Row:
    """A late transfer rewrites the story of a failed purchase (money moved after all),
    whatever reason the failure itself carried; otherwise the purchase's own reason."""
    late = any(r.reason_code == LATE and r.state != "declined" for r in facts.refunds)
    failed = facts.payment_state in ("failed", "void")
    return case_row(
        payment=facts.payment_state,
        fulfillment=facts.fulfillment_state,
        reason_code=LATE if late and failed else facts.reason_code,
    )


@dataclass
class _Now:
    """The case while the overlays are laid on it."""

    owner: Owner
    deadline_at: datetime | None
    deadline_source: Deadline
    notes: list[str]
    candidates: list[Action]
    finality: Finality = Finality.OPEN
    # When a state final at a deadline becomes final: the row's own deadline, kept when a
    # remedy's owner replaces the deadline shown.
    final_after_at: datetime | None = None

    def no_deadline(self) -> None:
        self.deadline_at, self.deadline_source = None, Deadline.NONE


def _still_payable_overlay(
    row: Row, row_deadline_at: datetime | None, now_: _Now, now: datetime
) -> None:
    """After a late transfer only a new payment for its quote, or an authorization it
    received and not yet spent, can change the failure. Once neither can, it is final
    and nobody waits on the buyer (the sweep only relabels it void later)."""
    if row.deadline not in (Deadline.STILL_PAYABLE, Deadline.FAILED_FINAL):
        return
    if row_deadline_at is not None and row_deadline_at > now:
        now_.notes.append(
            "It can still change while its quote is open for a new payment, or while an "
            "authorization it received and not yet spent is still valid."
        )
        return
    now_.finality, now_.final_after_at = Finality.FINAL, None
    if now_.deadline_source in (Deadline.STILL_PAYABLE, Deadline.FAILED_FINAL):
        now_.no_deadline()
    if now_.owner == Owner.BUYER:
        now_.owner = Owner.NONE


def _transfer_notes(facts: CaseFacts, now_: _Now) -> None:
    for reason, what in ((LATE, "after it had failed"), (DUPLICATE, "after it was paid")):
        found = [r for r in facts.refunds if r.reason_code == reason and r.state != "declined"]
        if found:
            still_owed = any(r.state in ("proposed", "owed") for r in found)
            outcome = "that money is owed back" if still_owed else "it was paid back"
            now_.notes.append(f"A transfer for it landed {what}: {outcome}.")


def _remedy_overlay(facts: CaseFacts, now_: _Now) -> None:
    """Open refunds are finance's, with no deadline (one stays open until a person marks
    it paid back); a payment refunded in full leaves support nothing to do."""
    proposed = [r for r in facts.refunds if r.state == "proposed"]
    owed = [r for r in facts.refunds if r.state == "owed"]
    paid_back = sum(r.amount for r in facts.refunds if r.state == "paid")
    _transfer_notes(facts, now_)
    if owed:
        now_.notes.append(f"{len(owed)} refund(s) owed to the payer: finance pays back.")
    if proposed:
        now_.notes.append(f"{len(proposed)} refund(s) proposed: not owed until finance approves.")
        now_.candidates.append(Action.APPROVE_REFUND)
    if owed or proposed:
        now_.owner = Owner.FINANCE
        now_.no_deadline()
    elif paid_back >= facts.amount > 0 and now_.owner == Owner.SUPPORT:
        now_.owner = Owner.NONE
        now_.notes.append("The payment was refunded in full.")


def _result_overlay(facts: CaseFacts, now_: _Now, now: datetime) -> None:
    expired = facts.result_expires_at is not None and facts.result_expires_at <= now
    if now_.deadline_source == Deadline.RESULT_RETENTION and expired:
        now_.no_deadline()  # nothing is left to fetch, so nothing to wait for
        now_.notes.append("The result's retention has ended: only the receipt remains.")
        if now_.owner == Owner.BUYER:
            now_.owner = Owner.NONE
    if facts.result_delivered_at is not None and now_.owner == Owner.BUYER:
        now_.owner = Owner.NONE  # the buyer has the result: nobody has a move to make
        now_.notes.append("The result was delivered to the buyer.")


def _unfinal_overlay(facts: CaseFacts, now_: _Now) -> None:
    """Paid and settled, but a reorg can still undo the transfer: not final, and the finality
    watch's move (nobody else's) until the network's finality policy says so."""
    unfinal = facts.unfinal
    if unfinal is None or facts.payment_state != "paid" or now_.finality != Finality.FINAL:
        return
    now_.finality = Finality.OPEN
    if now_.owner in (Owner.BUYER, Owner.NONE):
        now_.owner = Owner.RECONCILIATION
        now_.deadline_at, now_.deadline_source = unfinal.escalates_at, Deadline.FINALITY
    now_.candidates.insert(0, Action.RECHECK_SETTLEMENT)


def purchase_case(facts: CaseFacts, *, now: datetime) -> Case:
    """The "Now" of a purchase: sentence, owner, deadline, finality and the safe actions."""
    row = _row_for(facts)
    row_deadline_at = _deadline(row, facts)
    final_after_at = row_deadline_at if row.finality == Finality.FINAL_AT_DEADLINE else None
    now_ = _Now(
        row.owner,
        row_deadline_at,
        row.deadline,
        [],
        list(row.actions),
        row.finality,
        final_after_at,
    )
    _result_overlay(facts, now_, now)
    _remedy_overlay(facts, now_)
    _still_payable_overlay(row, row_deadline_at, now_, now)
    _unfinal_overlay(facts, now_)
    escalation_reason = ""
    if facts.escalations:
        first = min(facts.escalations, key=lambda e: (e.deadline_at, e.pk))
        escalation_reason = first.reason_code
        now_.owner, now_.deadline_source = Owner(first.owner), Deadline.ESCALATION
        now_.deadline_at = first.deadline_at
        now_.notes.append(escalated_note(first.owner, first.reason_code))
        now_.candidates.extend([Action.RESOLVE, Action.ASSIGN])
    if now_.deadline_at is None:
        now_.no_deadline()  # a source with nothing to read (no escalation open) is no deadline
    actions = tuple(a for a in dict.fromkeys(now_.candidates) if _is_safe(a, facts, now))
    reasons = {r.reason_code for r in facts.refunds if r.state != "declined"}
    said = case_said(facts, owner=now_.owner, is_final=now_.finality == Finality.FINAL, now=now)
    if now_.deadline_source == Deadline.NEXT_CHECK and facts.settlement_escalates_at:
        now_.deadline_source = Deadline.SETTLEMENT_ESCALATION
    owed = tuple(f"refund:{r.pk}" for r in facts.refunds if r.state == "owed")
    refund_waits = any(r.state in ("owed", "proposed") for r in facts.refunds)
    refund_owner = Owner.FINANCE if refund_waits and now_.owner != Owner.FINANCE else None
    return Case(
        sentence=said.sentence or row.sentence,
        owner=now_.owner,
        deadline_at=now_.deadline_at,
        deadline_source=now_.deadline_source,
        finality=now_.finality,
        actions=actions,
        row=row,
        late_transfer=LATE in reasons,
        duplicate_transfer=DUPLICATE in reasons,
        notes=(*now_.notes, *said.notes),
        final_after_at=now_.final_after_at,
        escalation_reason=escalation_reason,
        refund_open=bool(owed),
        next_check_at=said.next_check_at,
        next_check=said.next_check if said.next_check_at else "",
        links=owed,
        refund_warning=refund_risk(facts),
        refund_owner=refund_owner,
    )


def relative(deadline_at: datetime | None, now: datetime) -> str:
    """'in 3 h 05 min', 'overdue by 12 min', or '' for no deadline."""
    if deadline_at is None:
        return ""
    seconds = int((deadline_at - now).total_seconds())
    span = abs(seconds)
    days, rest = divmod(span, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        text = f"{days} d {hours} h"
    elif hours:
        text = f"{hours} h {minutes:02d} min"
    elif minutes:
        text = f"{minutes} min {secs:02d} s"
    else:
        text = f"{secs} s"
    return f"in {text}" if seconds >= 0 else f"overdue by {text}"


def case_table_rows() -> list[dict[str, str]]:
    """The table as data: one dict per row, for the runbook and its check."""
    return [
        {
            "payment_state": r.payment,
            "fulfillment_state": r.fulfillment,
            "reason_code": r.reason,
            "sentence": r.sentence,
            "owner": r.owner.value,
            "deadline": r.deadline.value,
            "finality": r.finality.value,
            "actions": ", ".join(a.value for a in r.actions),
        }
        for r in CASE_TABLE
    ]


def case_reason_codes() -> set[str]:
    """Every reason code the case file explains (table rows, remedies, error answers)."""
    table = {r.reason for r in CASE_TABLE if r.reason != ANY}
    return table | set(REASON_CODES) | {c.value for c in ERROR_CODES_ABOUT_A_PURCHASE}
