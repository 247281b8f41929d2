"""Settle x402 payments through a standard facilitator (`POST /verify`, `POST /settle`).

Only a well-formed HTTP 200 JSON answer counts as proof either way. Everything else (a
timeout, a refused connection, 5xx, HTML, truncated JSON, a success body under an error
status, a reason we do not know) is PENDING: the facilitator may have broadcast, so only
the chain can tell, and unknown is never failed.

Classification (see `classify_verify` and `classify_settle`):

  /verify  200 {"isValid": true}                        -> go on to /settle
  /verify  200 {"isValid": false, reason in PROVEN}     -> FAILED  facilitator_rejected:<r>
  /verify  200 {"isValid": false, any other reason}     -> PENDING facilitator_unresolved:<r>
  /verify  401 or 403 (our credentials refused)         -> PENDING facilitator_refused_credentials
  /verify  anything else (no answer, non-200, bad JSON) -> PENDING facilitator_unavailable
  /settle  200 {"success": true, "transaction": 0x..64 hex, network ours or absent,
                no errorReason}                         -> CONFIRMED (tx_hash)
  /settle  200 {"success": false, reason in PROVEN, no transaction named}
                                                        -> FAILED  facilitator_rejected:<r>
  /settle  200 {"success": false, "settlement_pending"} -> PENDING settlement_pending
  /settle  5xx {"success": false, "settlement_pending"} -> PENDING settlement_pending (how the
                                                           CDP facilitator answers it)
  /settle  200 {"success": false, any other reason}     -> PENDING facilitator_unresolved:<r>
  /settle  200 or 202 naming a `paymentId` (Circle), no confirmed hash
                                                        -> PENDING settlement_pending, the
                                                           facilitator's payment id kept
  /settle  401 or 403 (our credentials refused)         -> PENDING facilitator_refused_credentials
  /settle  no answer (timeout, refused, cut mid-body)   -> PENDING facilitator_unavailable
  /settle  no answer within the paying request's budget (`wait_until`, shorter than the
           timeout)                                     -> PENDING facilitator_still_settling
  /settle  any other answer (non-200, 3xx, HTML, bad JSON, success without a usable hash)
                                                        -> PENDING facilitator_bad_response
PENDING outcomes carry the transaction hash whenever the body names a well-formed one.

A 401 or 403 is our outage, never the buyer's failure: the facilitator refused our
credentials (facilitator_auth.py), so it said nothing about the payment. Each one is counted
(`tollbooth_facilitator_refusals_total`) and announced (`facilitator_refused`, which the
purchases app turns into an alert naming the facilitator and the status). Before anything
is recorded, `verify_before_record` lets the paying request answer 503 + Retry-After.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import requests
from django.dispatch import Signal
from prometheus_client import Counter
from x402.schemas import PaymentPayload

from payments.rails.base import (
    FACILITATOR_PAYMENT_ID,
    SETTLER_ANSWERS,
    SettlementOutcome,
    SettlementStatus,
)
from payments.rails.x402.facilitator_auth import FacilitatorAuth
from payments.rails.x402.types import Authorization, NetworkConfig, PreparedBroadcast, Requirements
from payments.rails.x402.wire import requirements_wire

VERIFY = "verify"
SETTLE = "settle"

REASON_UNAVAILABLE = "facilitator_unavailable"
REASON_BAD_RESPONSE = "facilitator_bad_response"
REASON_SETTLEMENT_PENDING = "settlement_pending"
# /settle not answered within what was left of the paying request's wait budget.
REASON_STILL_SETTLING = "facilitator_still_settling"
REJECTED_PREFIX = "facilitator_rejected:"
# /settle always gets this long to answer, however little of the request's budget is left:
# the request that sends it is the one that can answer with its result.
MIN_SETTLE_READ_SECONDS = 1.0
UNRESOLVED_PREFIX = "facilitator_unresolved:"
# The facilitator refused our credentials: our outage, it said nothing about the payment.
REASON_REFUSED_CREDENTIALS = "facilitator_refused_credentials"
REFUSAL_STATUSES = frozenset({401, 403})
_PAYMENT_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")

facilitator_refusals = Counter(
    "tollbooth_facilitator_refusals_total",
    "Facilitator calls refused with HTTP 401 or 403 (our credentials): our outage, never a "
    "buyer's failure.",
    ["network", "facilitator", "endpoint", "status"],
)
# Sent (network, facilitator, endpoint, status) for each refusal; purchases turns it into an
# alert. Receivers must not raise into the paying request (`send_robust`).
facilitator_refused = Signal()

# Reasons that prove the authorization was not, and cannot have been, executed through this
# facilitator: properties of the payload against our requirements that no later block, clock
# tick or earlier broadcast could change. Deliberately excluded: anything that depends on chain
# state or time (nonce already used, insufficient funds/balance, valid_before/valid_after,
# simulation or transaction failures, invalid_transaction_state), because the same signed
# authorization may already have moved the money in an earlier broadcast; and facilitator-side
# errors (unsupported network, failed to verify), which are not verdicts on the payment.
PROVEN_REJECTIONS = frozenset(
    {
        "invalid_signature",
        "invalid_exact_evm_payload_signature",
        "invalid_payload",
        "invalid_exact_evm_payload",
        "invalid_scheme",
        "unsupported_scheme",
        "invalid_x402_version",
        "invalid_payment_requirements",
        "network_mismatch",
        "invalid_exact_evm_payload_recipient_mismatch",
        "invalid_exact_evm_payload_authorization_value_mismatch",
    }
)

REASON_CODE_MAX = 64  # reason_code columns are CharField(max_length=64)
EXCERPT_CHARS = 200
MAX_BODY_BYTES = 64 * 1024  # a facilitator answer is a few hundred bytes
_TX_HASH = re.compile(r"0x[0-9a-fA-F]{64}")
_UNSAFE_CODE_CHARS = re.compile(r"[^A-Za-z0-9_.:-]")


@dataclass(frozen=True)
class HttpReply:
    """What one HTTP exchange with the facilitator produced, fault or not."""

    status: int | None  # None: no HTTP answer at all
    body: bytes = b""
    transport_error: str = ""  # set when the exchange broke (even after a status line)

    def json_object(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.body)
        except (ValueError, RecursionError):  # bad JSON, bad encoding, absurd nesting
            return None
        return data if isinstance(data, dict) else None

    def evidence(self, stage: str) -> dict[str, Any]:
        excerpt = self.body[: EXCERPT_CHARS * 4].decode("utf-8", "replace")[:EXCERPT_CHARS]
        seen: dict[str, Any] = {"stage": stage, "http_status": self.status, "body_excerpt": excerpt}
        if self.transport_error:
            seen["transport_error"] = self.transport_error
        return seen


class FacilitatorRefused(Exception):
    """The facilitator refused our credentials (HTTP 401 or 403) before anything was
    recorded: the paying request answers 503 + Retry-After. Names no secret."""

    def __init__(self, *, network: str, facilitator: str, endpoint: str, status: int) -> None:
        super().__init__(f"{facilitator} refused our credentials at /{endpoint}: HTTP {status}")
        self.network = network
        self.facilitator = facilitator
        self.endpoint = endpoint
        self.status = status


class FacilitatorSettler:
    """Settler for a standard x402 facilitator at `network.facilitator_url`, called with
    `network.facilitator_auth`. One instance serves one attempt (X402Context.settler)."""

    def __init__(self) -> None:
        # /verify's answer asked before the attempt was recorded, used by its first broadcast
        # instead of asking again.
        self._verified: dict[tuple[str, str], HttpReply] = {}

    def prepare(self, *, authorization: Authorization, network: NetworkConfig) -> PreparedBroadcast:
        # The facilitator signs and sends the transaction: no hash exists before it answers.
        return PreparedBroadcast()

    def verify_before_record(
        self, *, authorization: Authorization, requirements: Requirements, network: NetworkConfig
    ) -> None:
        """/verify, before anything is recorded. Raises FacilitatorRefused when the
        facilitator refuses our credentials (401/403): nothing may be recorded then, the
        buyer retries. Any other answer is kept for this attempt's first broadcast, which
        judges it as it always has (so /verify is asked once per paid request)."""
        body = settlement_request(authorization, requirements, network)
        reply = _call(network, "POST", VERIFY, body, network.facilitator_timeout)
        if reply.status in REFUSAL_STATUSES:
            raise FacilitatorRefused(
                network=network.caip2,
                facilitator=facilitator_name(network.facilitator_url),
                endpoint=VERIFY,
                status=reply.status,
            )
        self._verified[_authorization_key(authorization)] = reply

    def broadcast(
        self,
        *,
        authorization: Authorization,
        requirements: Requirements,
        network: NetworkConfig,
        prepared: PreparedBroadcast,
        wait_until: float | None = None,
    ) -> SettlementOutcome:
        """/verify, then exactly one /settle. `wait_until` (the paying request's budget, a
        time.monotonic() value) shortens the wait for /settle's answer, never below
        `MIN_SETTLE_READ_SECONDS`: a facilitator that has not answered by then may still
        broadcast, so the outcome is PENDING `facilitator_still_settling`, found later on
        chain by (payer, nonce). Connecting and /verify keep `facilitator_timeout`."""
        body = settlement_request(authorization, requirements, network)
        timeout = network.facilitator_timeout
        verified = self._verified.pop(_authorization_key(authorization), None)
        if verified is None:
            verified = _call(network, "POST", VERIFY, body, timeout)
        answers = [answer_summary(VERIFY, verified)]
        verdict = classify_verify(verified)
        if verdict is not None:
            return _with_answers(verdict, answers)
        read = settle_read_timeout(timeout, wait_until)
        # Exactly one /settle per broadcast: a retry is the caller's decision, after it has
        # reconciled the first attempt on chain.
        settled = _call(network, "POST", SETTLE, body, timeout, read_timeout=read)
        answers.append(answer_summary(SETTLE, settled))
        outcome = classify_settle(settled, network=requirements.network)
        if read < timeout and settled.status is None and settled.transport_error:
            # No answer within what was left of the request's budget: not a fault of the
            # facilitator's, and it may still settle. Said so; pending as before.
            outcome = replace(outcome, reason_code=REASON_STILL_SETTLING)
        return _with_answers(outcome, answers)


def _authorization_key(authorization: Authorization) -> tuple[str, str]:
    return authorization.payer.lower(), authorization.nonce.lower()


def facilitator_name(url: str) -> str:
    """How alerts, metrics and /readyz name a facilitator: host[:port] and path of its URL,
    never userinfo or a query (either could carry a credential)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{host}{port}{parts.path.rstrip('/')}"[:120]


def _call(
    network: NetworkConfig,
    method: str,
    endpoint: str,
    body: dict[str, Any] | None,
    timeout: float,
    *,
    read_timeout: float | None = None,
) -> HttpReply:
    """One call to the network's facilitator, with its credentials; a refusal of them is
    counted and announced."""
    url = f"{network.facilitator_url.rstrip('/')}/{endpoint}"
    reply = _exchange(
        method,
        url,
        body,
        timeout,
        read_timeout=read_timeout,
        auth=network.facilitator_auth,
    )
    if reply.status in REFUSAL_STATUSES:
        _refused(network.caip2, network.facilitator_url, endpoint, reply.status)
    return reply


def _refused(network: str, url: str, endpoint: str, status: int) -> None:
    name = facilitator_name(url)
    facilitator_refusals.labels(network, name, endpoint, str(status)).inc()
    facilitator_refused.send_robust(
        sender=FacilitatorSettler, network=network, facilitator=name, endpoint=endpoint,
        status=status,
    )  # fmt: skip


def settle_read_timeout(timeout: float, wait_until: float | None) -> float:
    """How long /settle's answer is waited for: `timeout`, or what is left until
    `wait_until` if less, but at least MIN_SETTLE_READ_SECONDS."""
    if wait_until is None:
        return timeout
    return min(timeout, max(wait_until - time.monotonic(), MIN_SETTLE_READ_SECONDS))


_ANSWER_FIELDS = {  # wire field -> timeline field, per stage
    VERIFY: (("isValid", "is_valid"), ("invalidReason", "invalid_reason"), ("payer", "payer")),
    SETTLE: (
        ("success", "success"),
        ("errorReason", "error_reason"),
        ("transaction", "transaction"),
        ("network", "network"),
    ),
}


def answer_summary(stage: str, reply: HttpReply) -> dict[str, Any]:
    """What one facilitator answer said, as the timeline keeps it: HTTP status, the verdict
    fields (trimmed), a transport fault. Never the body."""
    summary: dict[str, Any] = {"stage": stage, "http_status": reply.status}
    if reply.transport_error:
        summary["transport_error"] = reply.transport_error
    data = reply.json_object()
    if data is None:
        summary["json"] = False
        return summary
    for wire, name in _ANSWER_FIELDS[stage]:
        if wire in data:
            value = data[wire]
            summary[name] = value if isinstance(value, bool) else str(value)[:EXCERPT_CHARS]
    return summary


def _with_answers(outcome: SettlementOutcome, answers: list[dict[str, Any]]) -> SettlementOutcome:
    return replace(outcome, evidence={**outcome.evidence, SETTLER_ANSWERS: answers})


def settlement_request(
    authorization: Authorization, requirements: Requirements, network: NetworkConfig
) -> dict[str, Any]:
    """The JSON body of /verify and /settle: x402 v2 payload plus the requirements it meets."""
    accepted = requirements_wire(requirements, network)
    payload = PaymentPayload(x402_version=2, accepted=accepted, payload=authorization.as_wire())
    return {
        "x402Version": 2,
        "paymentPayload": payload.model_dump(mode="json", by_alias=True, exclude_none=True),
        "paymentRequirements": accepted.model_dump(mode="json", by_alias=True, exclude_none=True),
    }


def facilitator_supported(
    url: str, timeout: float, auth: FacilitatorAuth | None = None
) -> dict[str, Any] | None:
    """GET /supported: the facilitator's kinds, extensions and signers, or None on any fault."""
    reply = _exchange("GET", f"{url.rstrip('/')}/supported", None, timeout, auth=auth)
    if reply.status != 200 or reply.transport_error:
        return None
    return reply.json_object()


# --- classification ---------------------------------------------------------------------


def classify_verify(reply: HttpReply) -> SettlementOutcome | None:
    """None when the facilitator says the payment is valid; otherwise the outcome to return.

    /verify never broadcasts, so nothing has left the building yet: faults are PENDING with
    `settle_called: False`, and the caller may safely try again.
    """
    ok = reply.status == 200 and not reply.transport_error
    data = reply.json_object() if ok else None
    is_valid = data.get("isValid") if data is not None else None
    if is_valid is True:
        return None
    evidence = reply.evidence(VERIFY) | {"settle_called": False}
    if reply.status in REFUSAL_STATUSES and not reply.transport_error:
        return _pending(REASON_REFUSED_CREDENTIALS, evidence)
    if data is None or is_valid is not False:
        return _pending(REASON_UNAVAILABLE, evidence)
    reason = _reason_text(data.get("invalidReason"))
    evidence["invalid_reason"] = reason
    if reason in PROVEN_REJECTIONS:
        return SettlementOutcome(
            SettlementStatus.FAILED, reason_code=_code(REJECTED_PREFIX, reason), evidence=evidence
        )
    return _pending(_code(UNRESOLVED_PREFIX, reason), evidence)


def classify_settle(reply: HttpReply, *, network: str) -> SettlementOutcome:
    """CONFIRMED or FAILED only on a well-formed HTTP 200 JSON answer; PENDING otherwise."""
    evidence = reply.evidence(SETTLE)
    if reply.status is None or reply.transport_error:
        return _pending(REASON_UNAVAILABLE, evidence)
    data = reply.json_object()
    if reply.status in REFUSAL_STATUSES:
        # Our credentials, refused: it says nothing of the payment (and names no hash).
        return _pending(REASON_REFUSED_CREDENTIALS, evidence)
    if data is None:
        return _pending(REASON_BAD_RESPONSE, evidence)
    payment_id = data.get("paymentId")
    if isinstance(payment_id, str) and _PAYMENT_ID.fullmatch(payment_id):
        evidence[FACILITATOR_PAYMENT_ID] = payment_id
    raw_tx = data.get("transaction")
    tx_hash = raw_tx if isinstance(raw_tx, str) and _TX_HASH.fullmatch(raw_tx) else None
    success = data.get("success")
    evidence["success"] = success if success is None or isinstance(success, bool) else "?"
    evidence["transaction"] = str(raw_tx)[:80] if raw_tx else None
    if "errorReason" in data:
        evidence["error_reason"] = _reason_text(data["errorReason"])
    if _pending_under_server_error(reply.status, success, evidence):
        # The CDP facilitator answers an unconfirmed broadcast this way: pending, named so.
        return _pending(REASON_SETTLEMENT_PENDING, evidence, tx_hash)
    if _pending_with_payment_id(reply.status, success, data, evidence):
        # Circle's facilitator: accepted (200 or 202) under its own payment id, no verdict.
        return _pending(REASON_SETTLEMENT_PENDING, evidence, tx_hash)
    if reply.status != 200 or not isinstance(success, bool):
        # e.g. 503 with a success body: the facilitator contradicts itself, so it proves nothing.
        return _pending(REASON_BAD_RESPONSE, evidence, tx_hash)
    if success:
        # A success that also names an error, another network or no usable hash is not proof.
        proven = not data.get("errorReason") and data.get("network") in (None, network)
        if tx_hash is not None and proven:
            return SettlementOutcome(SettlementStatus.CONFIRMED, tx_hash=tx_hash, evidence=evidence)
        return _pending(REASON_BAD_RESPONSE, evidence, tx_hash)
    return _refusal(_reason_text(data.get("errorReason")), raw_tx, tx_hash, evidence)


def _pending_under_server_error(status: int, success: object, evidence: dict[str, Any]) -> bool:
    """A 5xx whose JSON says `success: false`, `errorReason: "settlement_pending"`. Either way
    it is PENDING; this only decides whether it is labelled for what it says."""
    return (
        500 <= status <= 599
        and success is False
        and evidence.get("error_reason") == REASON_SETTLEMENT_PENDING
    )


def _pending_with_payment_id(
    status: int, success: object, data: dict[str, Any], evidence: dict[str, Any]
) -> bool:
    """A 200 or 202 naming the facilitator's payment id that is not a proven success (no
    `success: true`) nor a refusal with a reason: the facilitator has taken it and will
    settle, so it is pending under that id."""
    if status not in (200, 202) or FACILITATOR_PAYMENT_ID not in evidence:
        return False
    if status == 202:
        return True
    return success is not True and not data.get("errorReason")


def _refusal(
    reason: str, raw_tx: object, tx_hash: str | None, evidence: dict[str, Any]
) -> SettlementOutcome:
    if reason == REASON_SETTLEMENT_PENDING:
        # Broadcast, confirmation not established: non-terminal, reconcile this hash.
        return _pending(REASON_SETTLEMENT_PENDING, evidence, tx_hash)
    if reason in PROVEN_REJECTIONS and not raw_tx:
        return SettlementOutcome(
            SettlementStatus.FAILED, reason_code=_code(REJECTED_PREFIX, reason), evidence=evidence
        )
    # A proven reason next to a named transaction means something was sent: not proof.
    return _pending(_code(UNRESOLVED_PREFIX, reason), evidence, tx_hash)


def _pending(
    reason_code: str, evidence: dict[str, Any], tx_hash: str | None = None
) -> SettlementOutcome:
    return SettlementOutcome(
        SettlementStatus.PENDING, tx_hash=tx_hash, reason_code=reason_code, evidence=evidence
    )


def _reason_text(value: object) -> str:
    if isinstance(value, str) and value.strip():
        return value.strip()[:EXCERPT_CHARS]
    return "unspecified"


def _code(prefix: str, reason: str) -> str:
    return (prefix + _UNSAFE_CODE_CHARS.sub("_", reason))[:REASON_CODE_MAX]


# --- HTTP -------------------------------------------------------------------------------


def _exchange(
    method: str,
    url: str,
    body: dict[str, Any] | None,
    timeout: float,
    *,
    read_timeout: float | None = None,
    auth: FacilitatorAuth | None = None,
) -> HttpReply:
    """One request, never raising: a fault becomes an HttpReply with `transport_error`.
    `auth`: the facilitator's credentials, a fresh JWT per call for a CDP key.

    No redirects (a 307 would resend /settle elsewhere) and no retries. `timeout` bounds the
    connection, `read_timeout` (default: `timeout`) the wait for the answer; the body must
    arrive within their sum of the start, so a facilitator that trickles bytes cannot hold us.
    """
    read = timeout if read_timeout is None else read_timeout
    deadline = time.monotonic() + timeout + read
    headers = {"Accept-Encoding": "identity"}  # tiny answers: no decompression games
    try:
        if auth is not None:
            headers |= auth.headers(method, url)
        with requests.request(
            method,
            url,
            json=body,
            headers=headers,
            timeout=(timeout, read),
            stream=True,
            allow_redirects=False,
        ) as response:
            content, error = _read_body(response, deadline)
            return HttpReply(response.status_code, content, error)
    except Exception as exc:  # once /settle may have left, any fault is "unknown", never a raise
        return HttpReply(None, b"", type(exc).__name__)


def _read_body(response: requests.Response, deadline: float) -> tuple[bytes, str]:
    # read1 returns whatever has arrived, so the deadline is checked between small reads
    # (iter_content would block until a whole chunk is filled, however slowly it trickles).
    body = bytearray()
    try:
        while chunk := response.raw.read1(8192, decode_content=True):
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                return bytes(body), "body_too_large"
            if time.monotonic() > deadline:
                return bytes(body), "deadline_exceeded"
    except Exception as exc:  # cut mid-body: what arrived is evidence, not an answer
        return bytes(body), type(exc).__name__
    return bytes(body), ""
