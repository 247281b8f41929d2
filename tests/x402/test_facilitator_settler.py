"""FacilitatorSettler against a real HTTP facilitator double settling on a real anvil chain.

What the facilitator *said* is compared with what the chain *did*: a fault is never FAILED
when money may have moved, and /settle is called exactly once per broadcast().
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest
from eth_typing import HexStr

from devtools.facilitator_double import FacilitatorDouble
from payments.rails.base import SettlementOutcome
from payments.rails.base import SettlementStatus as S
from payments.rails.x402.facilitator import (
    MIN_SETTLE_READ_SECONDS,
    PROVEN_REJECTIONS,
    REASON_CODE_MAX,
    FacilitatorSettler,
    HttpReply,
    classify_settle,
    classify_verify,
    facilitator_supported,
)
from payments.rails.x402.types import NetworkConfig, PreparedBroadcast
from tests.fixtures.anvil import closed_port_url
from tests.x402.chain_env import USDC, FacilitatorChain

VALUE = 3 * USDC // 100  # 0.03 USDC
TX = "0x" + "ab" * 32
NET = "eip155:31337"


def settle(chain: FacilitatorChain, network: NetworkConfig) -> SettlementOutcome:
    settler = FacilitatorSettler()
    authorization = chain.sign(VALUE)
    prepared = settler.prepare(authorization=authorization, network=network)
    return settler.broadcast(
        authorization=authorization,
        requirements=chain.requirements(VALUE),
        network=network,
        prepared=prepared,
    )


# --- against the double -----------------------------------------------------------------


def test_ok_is_confirmed_and_pays_the_seller_exactly_once(
    facilitator_chain: FacilitatorChain,
    facilitator_double: FacilitatorDouble,
    facilitator_network: NetworkConfig,
) -> None:
    payer_before = facilitator_chain.balance(facilitator_chain.payer.address)

    outcome = settle(facilitator_chain, facilitator_network)

    assert outcome.status == S.CONFIRMED
    assert outcome.tx_hash == facilitator_double.broadcasts[0]
    assert facilitator_double.broadcast_count == 1
    assert facilitator_double.calls["verify"] == 1
    assert facilitator_double.calls["settle"] == 1
    assert facilitator_chain.balance(facilitator_chain.seller) == VALUE
    assert facilitator_chain.balance(facilitator_chain.payer.address) == payer_before - VALUE
    assert outcome.tx_hash is not None
    receipt = facilitator_chain.w3.eth.get_transaction_receipt(HexStr(outcome.tx_hash))
    assert receipt["status"] == 1


@dataclass(frozen=True)
class Fault:
    mode: str
    status: S
    reason_code: str
    broadcasts: int  # what the double sent on chain
    names_tx: bool  # the answer names the hash, so the outcome must carry it


FAULTS = [
    Fault("hang", S.PENDING, "facilitator_unavailable", 1, False),
    Fault("trickle", S.PENDING, "facilitator_unavailable", 1, False),
    Fault("html_502", S.PENDING, "facilitator_bad_response", 0, False),
    Fault("success_503", S.PENDING, "facilitator_bad_response", 1, True),
    Fault("truncated", S.PENDING, "facilitator_bad_response", 1, False),
    Fault("settlement_pending", S.PENDING, "settlement_pending", 1, True),
    # The CDP facilitator's way of saying it: HTTP 500, success false, the hash (issue 18 #13).
    Fault("settlement_pending_500", S.PENDING, "settlement_pending", 1, True),
    Fault(
        "invalid_transaction_state",
        S.PENDING,
        "facilitator_unresolved:invalid_transaction_state",
        0,
        False,
    ),
    Fault(
        "settle_reject",
        S.FAILED,
        "facilitator_rejected:invalid_exact_evm_payload_signature",
        0,
        False,
    ),
]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.mode for f in FAULTS])
def test_settle_faults_are_never_failed_when_money_may_have_moved(
    fault: Fault,
    facilitator_chain: FacilitatorChain,
    facilitator_double: FacilitatorDouble,
    facilitator_network: NetworkConfig,
) -> None:
    facilitator_double.mode = fault.mode

    outcome = settle(facilitator_chain, facilitator_network)

    assert (outcome.status, outcome.reason_code) == (fault.status, fault.reason_code)
    assert facilitator_double.broadcast_count == fault.broadcasts
    assert facilitator_chain.balance(facilitator_chain.seller) == VALUE * fault.broadcasts
    assert facilitator_double.calls["settle"] == 1
    expected_tx = facilitator_double.broadcasts[0] if fault.names_tx else None
    assert outcome.tx_hash == expected_tx
    assert outcome.evidence["stage"] == "settle"
    assert len(outcome.evidence["body_excerpt"]) <= 200


def test_reject_at_verify_is_failed_and_never_settles(
    facilitator_chain: FacilitatorChain,
    facilitator_double: FacilitatorDouble,
    facilitator_network: NetworkConfig,
) -> None:
    facilitator_double.mode = "reject"

    outcome = settle(facilitator_chain, facilitator_network)

    assert outcome.status == S.FAILED
    assert outcome.reason_code == "facilitator_rejected:invalid_exact_evm_payload_signature"
    assert outcome.tx_hash is None
    assert outcome.evidence["stage"] == "verify"
    assert outcome.evidence["invalid_reason"] == "invalid_exact_evm_payload_signature"
    assert facilitator_double.calls["verify"] == 1
    assert facilitator_double.calls["settle"] == 0
    assert facilitator_double.broadcast_count == 0
    assert facilitator_chain.balance(facilitator_chain.seller) == 0


@pytest.mark.parametrize(
    "reason",
    ["insufficient_funds", "invalid_exact_evm_nonce_already_used", "something_new"],
)
def test_state_dependent_verify_rejection_is_pending(
    reason: str,
    facilitator_chain: FacilitatorChain,
    facilitator_double: FacilitatorDouble,
    facilitator_network: NetworkConfig,
) -> None:
    # The same authorization may already have moved the money in an earlier broadcast.
    facilitator_double.mode = "reject"
    facilitator_double.reject_reason = reason

    outcome = settle(facilitator_chain, facilitator_network)

    assert outcome.status == S.PENDING
    assert outcome.reason_code == f"facilitator_unresolved:{reason}"
    assert outcome.evidence["settle_called"] is False
    assert facilitator_double.calls["settle"] == 0


def test_verify_fault_is_pending_and_settle_is_not_called(
    facilitator_chain: FacilitatorChain,
    facilitator_double: FacilitatorDouble,
    facilitator_network: NetworkConfig,
) -> None:
    facilitator_double.mode = "verify_down"

    outcome = settle(facilitator_chain, facilitator_network)

    assert outcome.status == S.PENDING
    assert outcome.reason_code == "facilitator_unavailable"
    assert outcome.evidence["stage"] == "verify"
    assert outcome.evidence["http_status"] == 503
    assert facilitator_double.calls["settle"] == 0
    assert facilitator_chain.balance(facilitator_chain.seller) == 0


@pytest.mark.parametrize(
    ("mode", "timeouts", "http_status", "transport_error"),
    [("hang", 1, None, "ReadTimeout"), ("trickle", 2, 200, "deadline_exceeded")],
)
def test_a_slow_facilitator_cannot_hold_us(
    mode: str,
    timeouts: int,
    http_status: int | None,
    transport_error: str,
    facilitator_chain: FacilitatorChain,
    facilitator_double: FacilitatorDouble,
    facilitator_network: NetworkConfig,
) -> None:
    # hang: silent past the read timeout. trickle: every read is quick, the body never ends;
    # the settler gives up 2 x facilitator_timeout after sending /settle.
    facilitator_double.mode = mode
    timeout = facilitator_network.facilitator_timeout
    assert facilitator_double.hang_seconds > timeouts * timeout + 1.0

    started = time.monotonic()
    outcome = settle(facilitator_chain, facilitator_network)
    elapsed = time.monotonic() - started

    assert elapsed < timeouts * timeout + 1.0
    assert outcome.status == S.PENDING
    assert outcome.evidence["http_status"] == http_status
    assert outcome.evidence["transport_error"] == transport_error


def test_a_settle_not_answered_within_the_paying_requests_budget_is_still_settling(
    facilitator_chain: FacilitatorChain,
    facilitator_double: FacilitatorDouble,
    facilitator_network: NetworkConfig,
) -> None:
    # The facilitator broadcasts, then answers nothing for longer than its timeout; the
    # paying request's budget is already spent: /settle still goes, once, and is given
    # MIN_SETTLE_READ_SECONDS (below facilitator_timeout) to answer.
    facilitator_double.mode = "hang"
    assert facilitator_network.facilitator_timeout > MIN_SETTLE_READ_SECONDS
    settler = FacilitatorSettler()
    authorization = facilitator_chain.sign(VALUE)
    prepared = settler.prepare(authorization=authorization, network=facilitator_network)

    outcome = settler.broadcast(
        authorization=authorization,
        requirements=facilitator_chain.requirements(VALUE),
        network=facilitator_network,
        prepared=prepared,
        wait_until=time.monotonic(),
    )

    # Pending, and said to be ours: the facilitator was not down, we stopped waiting.
    assert (outcome.status, outcome.reason_code) == (S.PENDING, "facilitator_still_settling")
    assert outcome.evidence["transport_error"] == "ReadTimeout"
    assert facilitator_double.calls["settle"] == 1
    assert facilitator_double.broadcast_count == 1  # the money moved: pending, never failed
    assert facilitator_chain.balance(facilitator_chain.seller) == VALUE


def test_each_broadcast_calls_settle_once(
    facilitator_chain: FacilitatorChain,
    facilitator_double: FacilitatorDouble,
    facilitator_network: NetworkConfig,
) -> None:
    facilitator_double.mode = "settlement_pending"

    outcomes = [settle(facilitator_chain, facilitator_network) for _ in range(2)]

    assert [o.status for o in outcomes] == [S.PENDING, S.PENDING]
    assert facilitator_double.calls["settle"] == 2
    assert [o.tx_hash for o in outcomes] == facilitator_double.broadcasts


def test_closed_port_is_pending_unavailable(facilitator_chain: FacilitatorChain) -> None:
    network = facilitator_chain.network_config(closed_port_url())

    outcome = settle(facilitator_chain, network)

    assert outcome.status == S.PENDING
    assert outcome.reason_code == "facilitator_unavailable"
    assert outcome.evidence["stage"] == "verify"
    assert outcome.evidence["transport_error"] == "ConnectionError"


def test_request_body_is_x402_v2(
    facilitator_chain: FacilitatorChain,
    facilitator_double: FacilitatorDouble,
    facilitator_network: NetworkConfig,
) -> None:
    settler = FacilitatorSettler()
    authorization = facilitator_chain.sign(VALUE)
    requirements = facilitator_chain.requirements(VALUE)
    settler.broadcast(
        authorization=authorization,
        requirements=requirements,
        network=facilitator_network,
        prepared=PreparedBroadcast(),
    )

    [verify_body] = facilitator_double.bodies["verify"]
    [settle_body] = facilitator_double.bodies["settle"]
    assert verify_body == settle_body
    assert settle_body["x402Version"] == 2
    assert settle_body["paymentPayload"]["payload"] == authorization.as_wire()
    assert settle_body["paymentPayload"]["accepted"] == settle_body["paymentRequirements"]
    assert settle_body["paymentRequirements"] == {
        "scheme": "exact",
        "network": facilitator_chain.caip2,
        "asset": facilitator_chain.token,
        "amount": str(VALUE),
        "payTo": facilitator_chain.seller,
        "maxTimeoutSeconds": 300,
        "extra": {"name": "USDC", "version": "2", "quote": requirements.quote_id},
    }


def test_prepare_knows_no_hash(facilitator_chain: FacilitatorChain) -> None:
    network = facilitator_chain.network_config(closed_port_url())
    prepared = FacilitatorSettler().prepare(
        authorization=facilitator_chain.sign(VALUE), network=network
    )
    assert prepared == PreparedBroadcast()


def test_supported(
    facilitator_double: FacilitatorDouble, facilitator_chain: FacilitatorChain
) -> None:
    supported = facilitator_supported(facilitator_double.url, 1.5)

    assert supported is not None
    assert supported["kinds"][0]["network"] == facilitator_chain.caip2
    assert facilitator_supported(closed_port_url(), 1.5) is None


# --- the classification table, without HTTP ----------------------------------------------


def reply(status: int | None, document: object) -> HttpReply:
    body = document if isinstance(document, bytes) else json.dumps(document).encode()
    return HttpReply(status, body)


@pytest.mark.parametrize(
    ("status", "document", "expected", "reason_code", "tx_hash"),
    [
        (200, {"success": True, "transaction": TX, "network": NET}, S.CONFIRMED, "", TX),
        (200, {"success": True, "transaction": TX}, S.CONFIRMED, "", TX),
        (200, {"success": True, "transaction": ""}, S.PENDING, "facilitator_bad_response", None),
        (200, {"success": True, "transaction": "0x12"}, S.PENDING, "facilitator_bad_response", None),  # noqa: E501
        (200, {"success": True, "transaction": TX, "network": "eip155:1"}, S.PENDING,
         "facilitator_bad_response", TX),
        (200, {"success": "true", "transaction": TX}, S.PENDING, "facilitator_bad_response", TX),
        (200, {"success": True, "transaction": TX, "errorReason": "settlement_pending"},
         S.PENDING, "facilitator_bad_response", TX),
        (201, {"success": True, "transaction": TX}, S.PENDING, "facilitator_bad_response", TX),
        (307, b"", S.PENDING, "facilitator_bad_response", None),
        (200, [{"success": True}], S.PENDING, "facilitator_bad_response", None),
        (200, b"\xff\xfe not json", S.PENDING, "facilitator_bad_response", None),
        (200, {"success": False, "errorReason": "insufficient_funds", "transaction": ""},
         S.PENDING, "facilitator_unresolved:insufficient_funds", None),
        (200, {"success": False, "errorReason": "transaction_failed", "transaction": TX},
         S.PENDING, "facilitator_unresolved:transaction_failed", TX),
        (200, {"success": False, "errorReason": "invalid_signature", "transaction": TX},
         S.PENDING, "facilitator_unresolved:invalid_signature", TX),
        (200, {"success": False, "errorReason": "invalid_signature", "transaction": ""},
         S.FAILED, "facilitator_rejected:invalid_signature", None),
        (200, {"success": False, "transaction": ""}, S.PENDING,
         "facilitator_unresolved:unspecified", None),
        (400, {"success": False, "errorReason": "invalid_signature"}, S.PENDING,
         "facilitator_bad_response", None),
        (500, {"success": False, "errorReason": "settlement_pending", "transaction": TX},
         S.PENDING, "settlement_pending", TX),
        (503, {"success": False, "errorReason": "settlement_pending", "transaction": ""},
         S.PENDING, "settlement_pending", None),
        (500, {"success": True, "errorReason": "settlement_pending", "transaction": TX},
         S.PENDING, "facilitator_bad_response", TX),
        (500, {"success": False, "errorReason": "transaction_failed", "transaction": TX},
         S.PENDING, "facilitator_bad_response", TX),
        (400, {"success": False, "errorReason": "settlement_pending", "transaction": TX},
         S.PENDING, "facilitator_bad_response", TX),
    ],
)  # fmt: skip
def test_settle_classification(
    status: int, document: object, expected: S, reason_code: str, tx_hash: str | None
) -> None:
    outcome = classify_settle(reply(status, document), network=NET)
    assert (outcome.status, outcome.reason_code, outcome.tx_hash) == (
        expected,
        reason_code,
        tx_hash,
    )


def test_settle_cut_mid_body_is_unavailable_even_with_a_status() -> None:
    outcome = classify_settle(
        HttpReply(200, b'{"success": true', "ChunkedEncodingError"), network=NET
    )
    assert (outcome.status, outcome.reason_code) == (S.PENDING, "facilitator_unavailable")
    assert outcome.evidence["http_status"] == 200


@pytest.mark.parametrize(
    ("status", "document", "expected"),
    [
        (200, {"isValid": True}, None),
        (200, {"isValid": "false"}, S.PENDING),
        (500, {"isValid": False, "invalidReason": "invalid_signature"}, S.PENDING),
        (200, {"isValid": False, "invalidReason": "invalid_signature"}, S.FAILED),
        (200, {"isValid": False}, S.PENDING),
        (None, b"", S.PENDING),
    ],
)
def test_verify_classification(status: int | None, document: object, expected: S | None) -> None:
    outcome = classify_verify(reply(status, document))
    assert (outcome.status if outcome else None) == expected


def test_reason_codes_fit_the_column_and_evidence_is_short() -> None:
    reason = "invalid_exact_evm_payload_authorization_value_mismatch"
    assert reason in PROVEN_REJECTIONS
    body = {"success": False, "errorReason": reason, "transaction": "", "pad": "x" * 5000}
    outcome = classify_settle(reply(200, body), network=NET)
    assert outcome.status == S.FAILED
    assert len(outcome.reason_code) <= REASON_CODE_MAX
    assert outcome.reason_code.startswith("facilitator_rejected:invalid_exact_evm")
    assert len(outcome.evidence["body_excerpt"]) == 200
