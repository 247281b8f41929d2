"""Every subject a timeline event (PurchaseEvent.subject) can carry, with what it means.

One list, so the admin's case file can label each subject for people
(`backoffice.timeline.EVENT_LABELS`) and a test can prove none is missing. Code that writes a
boundary event names its subject from here (a lower service's `Change`, or older code, with
the same string); tests/purchases/test_timeline_events.py checks that every subject the code
writes is listed, tests/purchases/test_timeline_labels.py that each has a label.
"""

from __future__ import annotations

# --- state moves -------------------------------------------------------------------------
QUOTE = "quote"
PURCHASE_PAYMENT = "purchase.payment"
PURCHASE_FULFILLMENT = "purchase.fulfillment"
PURCHASE_DUPLICATE = "purchase.duplicate"
PAYMENT_ATTEMPT = "payment_attempt"
EXECUTION_ATTEMPT = "execution_attempt"
REFUND = "refund"
ESCALATION = "escalation"

# --- settlement: one authorization's way to the money (same nonce in every event) ---------
PAYMENT_BROADCAST = "payment_attempt.broadcast"
PAYMENT_DROPPED = "payment_attempt.dropped"
PAYMENT_RESUBMITTED = "payment_attempt.resubmitted"
PAYMENT_RESUBMIT_REFUSED = "payment_attempt.resubmit_refused"
PAYMENT_RELAYER_GAP_CLOSED = "payment_attempt.relayer_gap_closed"
PAYMENT_REORGED = "payment_attempt.reorged"
PAYMENT_FINAL = "payment_attempt.final"
FACILITATOR_ANSWERED = "facilitator.answered"

# --- payouts: a refund paid from the refund wallet (purchases/services/remedy/payouts.py) ---
PAYOUT = "payout"
PAYOUT_BROADCAST = "payout.broadcast"
PAYOUT_REBROADCAST = "payout.rebroadcast"

# --- the payment id ------------------------------------------------------------------------
PAYMENT_ID_REPLAYED = "payment_id.replayed"
PAYMENT_ID_IN_FLIGHT = "payment_id.in_flight"
PAYMENT_ID_CONFLICT = "payment_id.conflict"
PAYMENT_ID_RETENTION_EXPIRED = "payment_id.retention_expired"

# --- execution and delivery ----------------------------------------------------------------
EXECUTION_RETRIED = "execution_attempt.retried"
EXECUTION_RECHECKED = "execution_attempt.rechecked"
RESULT_DELIVERED = "result.delivered"
RESULT_REDELIVERED = "result.redelivered"
RESULT_REACCESSED = "result.reaccessed"
RESULT_RETENTION_EXPIRED = "result.retention_expired"
RECEIPT_FETCHED = "receipt.fetched"
RECEIPT_ISSUED = "receipt.issued"

# --- staff actions on the case file (purchases/services/remedy/case_actions.py) -----------------
ESCALATION_ASSIGNED = "escalation.assigned"
CASE_SETTLEMENT_RECHECKED = "case.settlement_rechecked"
CASE_EXECUTION_RECONCILED = "case.execution_reconciled"
CASE_RESULT_REDELIVERED = "case.result_redelivered"
EVIDENCE_EXPORTED = "evidence.exported"

# --- refund requests from buyers (purchases/services/remedy/refund_requests.py) ------------
REFUND_REQUEST = "refund_request"
REFUND_REQUEST_ASSIGNED = "refund_request.assigned"

# --- what is sold -------------------------------------------------------------------------
OFFERING_CREATED = "offering.created"
OFFERING_CHANGED = "offering.changed"
OFFERING_UPSTREAM_CHANGED = "offering.upstream_changed"

# --- telling people -------------------------------------------------------------------------
ALERT_SENT = "alert.sent"
ALERT_FAILED = "alert.failed"

SUBJECTS: dict[str, str] = {
    QUOTE: "The quote moved (accepted by the first payment, expired, stock released).",
    PURCHASE_PAYMENT: "The purchase's payment state moved (paying, pending, paid, failed).",
    PURCHASE_FULFILLMENT: "The purchase's fulfilment state moved (queued, running, done...).",
    PURCHASE_DUPLICATE: "A new payment repeated this purchase; answered with it, not charged.",
    PAYMENT_ATTEMPT: "A payment attempt moved (recorded, pending, succeeded, failed).",
    EXECUTION_ATTEMPT: "An execution attempt moved (claimed, taken over, succeeded, ended).",
    REFUND: "A refund was recorded as owed, credited or marked paid back.",
    ESCALATION: "An escalation was opened for a person, or resolved.",
    PAYMENT_BROADCAST: "The first broadcast of the signed authorization (mode, tx hash, nonce).",
    PAYMENT_DROPPED: (
        "A look-up found the sent transaction unknown to the node and the authorization's "
        "nonce unused: it never reached the chain (once per submission)."
    ),
    PAYMENT_RESUBMITTED: "The same signed authorization was sent again (try number, nonce).",
    PAYMENT_RESUBMIT_REFUSED: "No more resubmissions: the limit was reached; support escalated.",
    PAYMENT_RELAYER_GAP_CLOSED: (
        "This payment's relayer transaction was lost and its nonce held up later ones: just "
        "before another purchase's broadcast it was re-sent byte for byte (`rebroadcast`) or "
        "its nonce given to a 0-value self-transfer (`gap_filled`)."
    ),
    PAYMENT_REORGED: (
        "A reorg moved or undid the settled transfer before it was final: reason "
        "settlement_reorged (gone; the same authorization is settled again, or the payment "
        "is reversed) or transfer_moved (in the chain again, in another block or transaction)."
    ),
    PAYMENT_FINAL: "The settled transfer is final under the network's policy: no longer watched.",
    FACILITATOR_ANSWERED: (
        "What the facilitator answered to /verify or /settle: HTTP status, valid or success, "
        "the reason it gave, the transaction (never the whole body)."
    ),
    PAYOUT: (
        "A payout of a refund moved: approved (awaiting a second approver, or recorded with "
        "its signed transaction), confirmed final, provably failed, or cancelled."
    ),
    PAYOUT_BROADCAST: "The payout's signed transaction was sent (or the send was refused).",
    PAYOUT_REBROADCAST: (
        "The payout's transaction was unknown to the node with its nonce free (dropped): "
        "the same signed bytes were sent again."
    ),
    PAYMENT_ID_REPLAYED: "The same payment id and request came again: the stored answer.",
    PAYMENT_ID_IN_FLIGHT: "The payment id came again while its first request ran: 409.",
    PAYMENT_ID_CONFLICT: (
        "The payment id was reused by another payer or for a changed request: refused 409; "
        "this purchase was not changed."
    ),
    PAYMENT_ID_RETENTION_EXPIRED: (
        "The payment id came again after its record's retention: answered with the receipt."
    ),
    EXECUTION_RETRIED: "The executor could not say what happened: another try after backoff.",
    EXECUTION_RECHECKED: (
        "An execution that ended unknown was checked again (outcome: still unknown with the "
        "next check's time, succeeded, or failed for sure)."
    ),
    RESULT_DELIVERED: "The result was delivered for the first time (channel, digest).",
    RESULT_REDELIVERED: "The result was fetched again after its first delivery (channel).",
    RESULT_REACCESSED: (
        "The payer signed in with its wallet (sign-in-with-x) and was answered with this "
        "purchase, no payment (address, nonce, chain, resource); the delivery follows."
    ),
    RESULT_RETENTION_EXPIRED: "The result was asked for after its retention: 410, the receipt.",
    RECEIPT_FETCHED: "The public receipt was fetched (noted at most once an hour).",
    RECEIPT_ISSUED: "The signed receipt was issued: the payment became final after the result.",
    ESCALATION_ASSIGNED: "Staff set an escalation's owner, deadline and note (or opened one).",
    CASE_SETTLEMENT_RECHECKED: "Staff re-checked the settlement on chain; what it showed.",
    CASE_EXECUTION_RECONCILED: "Staff reconciled the execution: staged again or inspected.",
    CASE_RESULT_REDELIVERED: "Staff prepared a redelivery of the result (the capability link).",
    EVIDENCE_EXPORTED: (
        "The signed evidence pack was exported (admin or evidence_export; who, the file's "
        "SHA-256 and key id)."
    ),
    REFUND_REQUEST: (
        "A buyer's refund request was opened (amount, channel: API key or the paying wallet's "
        "signature, reason) or decided by staff (approved: the refund proposal it fed; "
        "denied: the reason code the buyer reads)."
    ),
    REFUND_REQUEST_ASSIGNED: "Staff took a buyer's refund request to work (assign to me).",
    OFFERING_CREATED: (
        "An offering was created, in the admin or by a catalog file's apply (the fields; the "
        "file's name and SHA-256 when a file did it)."
    ),
    OFFERING_CHANGED: (
        "An offering's fields were changed, in the admin or by a catalog file's apply (before "
        "and after; the file's name and SHA-256 when a file did it); a change of terms moved "
        "its version."
    ),
    OFFERING_UPSTREAM_CHANGED: (
        "Staff added, changed or removed an offering's upstream (the fields, before and "
        "after; secrets are only named); the offering's terms version moved."
    ),
    ALERT_SENT: "An alert reached people (kind, channels, recipients).",
    ALERT_FAILED: "An alert reached nobody (kind, channels tried, error); the sweeper retries.",
}
