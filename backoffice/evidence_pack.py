"""A purchase's dispute evidence pack (issue 33, part 3): one signed JSON document a seller
hands to a buyer, a platform or an auditor, that verifies years later offline.

What it holds (docs/evidence.md): what was sold (the offering's terms at their version, the
quote's terms, the input's SHA-256), who paid, the payment evidence (attempts, the
authorization's terms, tx hashes, blocks, finality, facilitator ids, ledger entries), the
work (execution attempts, the result's SHA-256 and size, delivery), the signed receipt,
refunds with their paybacks and payouts, escalations and the whole timeline.

What it never holds, whatever the offering: the buyer's input (its SHA-256 stands for it:
the pack outlives the input's and the result's retention, and is handed to third parties),
the result's bytes, the authorization's signature (its SHA-256; a settled one is in the
transaction's calldata on chain), key material, lease tokens, stored HTTP answers and
headers, the relayer's signed transactions, workers' names and staff usernames (their role
stands for them: the seller's own timeline keeps who). The timeline's evidence goes through
the same filter (`_scrubbed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.actors import AGENT, Actor
from core.canonical import sha256_hex
from core.errors import DomainError, ErrorCode
from fulfillment import evidence_seal
from fulfillment.models import Receipt, Result
from fulfillment.receipt_signing import receipt_decode, signing_key
from payments.models import PaymentAttempt, Refund
from purchases import event_subjects
from purchases.events import event_record
from purchases.models import Escalation, Purchase, RefundRequest
from purchases.refund_request_selectors import refund_request_status
from purchases.selectors import CaseRecords, purchase_case_records

# Evidence keys never copied from the timeline into a pack (exact names, any depth), and
# substrings that mark a key as a credential whatever its name.
_DROPPED_KEYS = frozenset(
    {
        "input",
        "inputs",
        "canonical_input",
        "raw_transaction",
        "relayer_nonce",
        "worker",
        "lease_token",
        "headers",
        "response_headers",
        "response_body",
        "response_text",
        "body",
        "body_excerpt",
        "more_body",
        "answer",
        "url",
        "status_url",
    }
)
_SECRET_MARKS = ("secret", "token", "password", "private", "api_key", "apikey", "key_hash")
# Kept as their SHA-256: the authorization's signature, and client-supplied ids (never in
# clear outside, as on receipts).
_HASHED_KEYS = frozenset({"signature", "payment_id", "idempotency_key"})


def _at(value: datetime | None) -> str | None:
    return value.astimezone(UTC).isoformat() if value else None


def _scrubbed(value: Any) -> Any:
    """Timeline evidence without the buyer's input, stored answers, credentials and the
    authorization's signature (replaced by its SHA-256)."""
    if isinstance(value, dict):
        kept: dict[str, Any] = {}
        for key, item in value.items():
            lowered = str(key).lower()
            if lowered in _DROPPED_KEYS or any(mark in lowered for mark in _SECRET_MARKS):
                continue
            if lowered in _HASHED_KEYS and isinstance(item, str):
                kept[f"{key}Sha256"] = sha256_hex(item)
                continue
            kept[key] = _scrubbed(item)
        return kept
    if isinstance(value, list):
        return [_scrubbed(item) for item in value]
    return value


def _sold(purchase: Purchase) -> dict[str, Any]:
    offering, quote = purchase.offering, purchase.quote
    return {
        "offering": {
            "slug": offering.slug,
            "title": offering.title,
            # The quote's terms (below) are as sold; the policies here are the offering's
            # now: a currentTermsVersion above termsVersion says they may have changed since.
            "termsVersion": quote.offering_version,
            "currentTermsVersion": offering.version,
            "deliveryCondition": offering.delivery_condition,
            "refundPolicy": offering.refund_policy,
            "irreversible": offering.irreversible,
            "resultRetentionSeconds": int(offering.result_retention.total_seconds()),
        },
        "quote": {
            "id": quote.public_id,
            "price": str(quote.price),
            "asset": quote.asset,
            "assetSymbol": offering.asset_symbol,
            "assetDecimals": offering.asset_decimals,
            "network": quote.network,
            "payTo": quote.pay_to,
            "inputSha256": quote.input_hash,
            "createdAt": _at(quote.created_at),
            "expiresAt": _at(quote.expires_at),
        },
    }


def _authorization(attempt: PaymentAttempt) -> dict[str, Any] | None:
    wire = attempt.authorization
    if not isinstance(wire, dict):
        return None
    terms = wire.get("authorization")
    signature = wire.get("signature")
    return {
        "terms": terms if isinstance(terms, dict) else None,
        "signatureSha256": sha256_hex(signature) if isinstance(signature, str) else None,
    }


def _attempt(attempt: PaymentAttempt) -> dict[str, Any]:
    return {
        "rail": attempt.rail,
        "state": attempt.state,
        "reasonCode": attempt.reason_code,
        "payer": attempt.payer,
        "amount": str(attempt.amount),
        "asset": attempt.asset,
        "network": attempt.network,
        "fingerprint": attempt.fingerprint,
        "authorization": _authorization(attempt),
        "txHash": attempt.tx_hash,
        "blockNumber": attempt.block_number,
        "blockAt": _at(attempt.block_at),
        "finalAt": _at(attempt.final_at),
        "reorgedAt": _at(attempt.reorged_at),
        "finalitySeen": attempt.finality_seen or None,
        "facilitatorPaymentId": attempt.facilitator_payment_id or None,
        "settlementReference": attempt.settlement_reference or None,
        "sentBy": attempt.sent_by or None,
        "resubmissions": attempt.resubmissions,
        "createdAt": _at(attempt.created_at),
    }


def _payment(purchase: Purchase, records: CaseRecords) -> dict[str, Any]:
    return {
        "amount": str(purchase.amount),
        "asset": purchase.asset,
        "network": purchase.network,
        "paidAt": _at(purchase.paid_at),
        "attempts": [_attempt(a) for a in records.attempts],
        "ledger": [
            {
                "reference": e.reference,
                "kind": e.kind,
                "amount": str(e.amount),
                "asset": e.asset,
                "createdAt": _at(e.created_at),
            }
            for e in purchase.ledger_entries.order_by("pk")
        ],
    }


def _work(records: CaseRecords) -> dict[str, Any]:
    result: Result | None = records.result
    return {
        "executions": [
            {
                "executor": e.executor,
                "state": e.state,
                "reasonCode": e.reason_code,
                "jobRef": e.job_ref or None,
                "tries": e.tries,
                "takeovers": e.takeovers,
                "startedAt": _at(e.started_at),
                "finishedAt": _at(e.finished_at),
            }
            for e in records.executions
        ],
        "result": None
        if result is None
        else {
            "sha256": result.sha256,
            "size": result.size,
            "contentType": result.content_type,
            "createdAt": _at(result.created_at),
            "firstDeliveredAt": _at(result.first_delivered_at),
            "keptUntil": _at(result.expires_at),
        },
    }


def _receipt(receipt: Receipt | None) -> dict[str, Any] | None:
    if receipt is None:
        return None
    return {
        "id": receipt.public_id,
        "transaction": receipt.transaction,
        "resultSha256": receipt.body_sha256,
        "deliveredAt": _at(receipt.delivered_at),
        # The receipt as signed and sent, so it verifies on its own (docs/receipts.md).
        "signed": receipt_decode(receipt.signed) if receipt.signed else None,
    }


def _refund(refund: Refund) -> dict[str, Any]:
    return {
        "method": refund.method,
        "state": refund.state,
        "amount": str(refund.amount),
        "asset": refund.asset,
        "network": refund.network,
        "payer": refund.payer,
        "reasonCode": refund.reason_code,
        "refundedTransaction": refund.transaction or None,
        "createdAt": _at(refund.created_at),
        "decidedAt": _at(refund.decided_at),
        "paidAt": _at(refund.paid_at),
        "paidReference": refund.paid_reference or None,
        "payback": None
        if not refund.payback_tx_hash
        else {
            "txHash": refund.payback_tx_hash,
            "logIndex": refund.payback_log_index,
            "blockNumber": refund.payback_block_number,
            "code": refund.payback_code,
            "checkedAt": _at(refund.payback_checked_at),
        },
        "payouts": [
            {
                "state": p.state,
                "amount": str(p.amount),
                "destination": p.destination,
                "txHash": p.tx_hash,
                "blockNumber": p.block_number,
                "confirmedAt": _at(p.confirmed_at),
            }
            for p in refund.payouts.order_by("pk")
        ],
    }


def _refund_request(request: RefundRequest) -> dict[str, Any]:
    # The buyer's own words and signed message are its evidence; the signature is its
    # SHA-256 (as the authorization's); who decided stays with the seller.
    status, reason_code = refund_request_status(request)
    return {
        "id": request.public_id,
        "channel": request.channel,
        "requestedBy": request.requested_by,
        "amount": str(request.amount),
        "asset": request.asset,
        "reason": request.reason,
        "signedMessage": request.signed_message or None,
        "signatureSha256": sha256_hex(request.signature) if request.signature else None,
        "createdAt": _at(request.created_at),
        "deadlineAt": _at(request.deadline_at),
        "decision": None if request.state == RefundRequest.State.OPEN else request.state,
        "decidedAt": _at(request.decided_at),
        "status": status,
        "reasonCode": reason_code or None,
    }


def _escalation(escalation: Escalation) -> dict[str, Any]:
    # Its note and who assigned or resolved it stay with the seller; the resolution is said.
    return {
        "owner": escalation.owner,
        "reasonCode": escalation.reason_code,
        "state": escalation.state,
        "createdAt": _at(escalation.created_at),
        "deadlineAt": _at(escalation.deadline_at),
        "resolvedAt": _at(escalation.resolved_at),
        "resolutionCode": escalation.resolution_code,
        "resolution": escalation.resolution,
    }


def _timeline(purchase: Purchase) -> list[dict[str, Any]]:
    return [
        {
            "at": _at(e.created_at),
            "subject": e.subject,
            "from": e.from_state,
            "to": e.to_state,
            "actorType": e.actor_type,
            # Agents are the buyer's own names; staff and system names stay with the seller.
            "actor": e.actor if e.actor_type == AGENT else "",
            "reasonCode": e.reason_code,
            "evidence": _scrubbed(e.evidence),
        }
        for e in purchase.events.order_by("created_at", "pk")
    ]


def evidence_content(*, purchase: Purchase, now: datetime) -> dict[str, Any]:
    """The pack's content: everything the seller knows about this purchase that may leave it."""
    records = purchase_case_records(purchase=purchase)
    return {
        "purchase": {
            "ref": purchase.ref,
            "channel": purchase.channel,
            "rail": purchase.rail,
            "paymentState": purchase.payment_state,
            "fulfillmentState": purchase.fulfillment_state,
            "reasonCode": purchase.reason_code,
            "createdAt": _at(purchase.created_at),
        },
        "sold": _sold(purchase),
        "paidBy": {
            "payer": purchase.payer,
            "buyerRef": purchase.buyer.ref if purchase.buyer else None,
        },
        "payment": _payment(purchase, records),
        "work": _work(records),
        "receipt": _receipt(records.receipt),
        "refunds": [_refund(r) for r in records.refunds],
        "refundRequests": [
            _refund_request(r)
            for r in RefundRequest.objects.select_related("refund")
            .filter(purchase=purchase)
            .order_by("pk")
        ],
        "escalations": [_escalation(e) for e in records.escalations],
        "timeline": _timeline(purchase),
        "issuer": {
            "seller": settings.TOLLBOOTH_PUBLIC_URL,
            "keys": settings.TOLLBOOTH_PUBLIC_URL + "/.well-known/tollbooth-receipts",
            "issuedAt": _at(now),
            "keepUntil": _at(now + settings.TOLLBOOTH["EVIDENCE_RETENTION"]),
        },
    }


@dataclass(frozen=True)
class EvidencePack:
    text: str
    purchase: str
    sha256: str
    key_id: str

    @property
    def filename(self) -> str:
        return f"evidence-{self.purchase}.json"


def evidence_pack_build(*, purchase: Purchase, now: datetime | None = None) -> EvidencePack:
    """The purchase's pack, sealed with the current receipt key. Reads only; records nothing
    (evidence_pack_export records who took it). Raises ImproperlyConfigured when no receipt
    key is set (production without TOLLBOOTH_RECEIPT_KEY)."""
    now = now or timezone.now()
    key = signing_key()
    content = evidence_content(purchase=purchase, now=now)
    text = evidence_seal.pack_seal(
        content=content, purchase=purchase.ref, issued_at=int(now.timestamp()), key=key
    )
    return EvidencePack(
        text=text, purchase=purchase.ref, sha256=sha256_hex(text), key_id=key.key_id
    )


def evidence_pack_export(
    *, purchase_ref: str, actor: Actor, channel: str, now: datetime | None = None
) -> EvidencePack:
    """Build the pack and put its export on the purchase's timeline (who, when, by which
    door: `admin` or `command`, the file's SHA-256 and key id), so each copy handed over can
    be matched later. Raises DomainError(purchase_not_found), ImproperlyConfigured (no
    receipt key)."""
    now = now or timezone.now()
    purchase = (
        Purchase.objects.select_related("quote", "offering", "buyer", "result", "receipt")
        .defer("result__body")
        .filter(ref=purchase_ref)
        .first()
    )
    if purchase is None:
        raise DomainError(ErrorCode.PURCHASE_NOT_FOUND, purchase=purchase_ref)
    pack = evidence_pack_build(purchase=purchase, now=now)
    with transaction.atomic():
        event_record(
            subject=event_subjects.EVIDENCE_EXPORTED,
            purchase=purchase,
            actor=actor,
            reason_code=channel,
            evidence={
                "pack_sha256": pack.sha256,
                "key_id": pack.key_id,
                "bytes": len(pack.text.encode()),
            },
        )
    return pack
