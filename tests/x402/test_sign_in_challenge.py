"""The sign-in-with-x challenge a quoted 402 declares, and proofs no client would send: each
is the ordinary 402 saying why, never a 5xx and never a result. (The official client's own
sign-in, and the refusals of what it signs, run in tests/agents/test_wallet_sign_in.py.)"""

from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone
from prometheus_client import REGISTRY
from x402.http.utils import decode_payment_required_header
from x402.schemas import PaymentRequired

from doors.mcp.calls import ToolCall, tool_call
from doors.x402.waiting import Waiting
from purchases.models import PurchaseEvent, WalletSignIn
from purchases.services.jobs.housekeeping import purge_expired_quotes
from tests.factories import PurchaseFactory
from tests.x402.e2e import NETWORK, X402World

INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\n"}
pytestmark = pytest.mark.django_db


def _extensions(response: Any) -> dict[str, Any]:
    required = decode_payment_required_header(response["PAYMENT-REQUIRED"])
    assert isinstance(required, PaymentRequired)
    return dict(required.extensions or {})


def test_a_quoted_402_declares_a_challenge_for_its_url_host_network_and_input(
    client, x402_world: X402World
):
    first = client.post(x402_world.paid_url, INPUT, content_type="application/json")
    second = client.post(x402_world.paid_url, INPUT, content_type="application/json")

    assert first.status_code == 402
    declared = _extensions(first)["sign-in-with-x"]
    info = declared["info"]
    url = f"http://testserver{x402_world.paid_url}"
    assert info["domain"] == "testserver" and info["uri"] == url
    assert info["resources"] == [url] and info["version"] == "1"
    assert len(info["nonce"]) == 32 and int(info["nonce"], 16) >= 0
    issued = datetime.fromisoformat(info["issuedAt"].replace("Z", "+00:00"))
    expires = datetime.fromisoformat(info["expirationTime"].replace("Z", "+00:00"))
    assert expires - issued == timedelta(minutes=5)
    assert abs(timezone.now() - issued) < timedelta(seconds=30)
    assert declared["supportedChains"] == [{"chainId": NETWORK, "type": "eip191"}]
    assert declared["schema"]["required"][:3] == ["domain", "address", "uri"]
    # A fresh nonce per 402, and nothing stored for it.
    assert _extensions(second)["sign-in-with-x"]["info"]["nonce"] != info["nonce"]
    assert not WalletSignIn.objects.exists()


def test_no_challenge_without_an_input_or_when_switched_off(client, x402_world, settings):
    price_only = client.head(x402_world.paid_url)
    assert price_only.status_code == 402 and "sign-in-with-x" not in _extensions(price_only)

    settings.X402_SIGN_IN_TTL_SECONDS = 0
    quoted = client.post(x402_world.paid_url, INPUT, content_type="application/json")
    assert quoted.status_code == 402 and "sign-in-with-x" not in _extensions(quoted)
    proof = base64.b64encode(b'{"domain": "testserver"}').decode()
    refused = client.post(
        x402_world.paid_url, INPUT, content_type="application/json", HTTP_SIGN_IN_WITH_X=proof
    )
    assert refused.status_code == 402 and refused.json()["sign_in"]["refused"] == (
        "siwx_not_offered"
    )


def _counted(outcome: str) -> float:
    value = REGISTRY.get_sample_value("tollbooth_wallet_sign_ins_total", {"outcome": outcome})
    return value or 0.0


def _b64(document: Any) -> str:
    return base64.b64encode(json.dumps(document).encode()).decode()


def _proof_like(x402_world: X402World, client: Any, **changes: Any) -> dict[str, Any]:
    """A well-formed proof of this 402's challenge, fields changed, signed by nobody."""
    info = _extensions(client.post(x402_world.paid_url, INPUT, content_type="application/json"))[
        "sign-in-with-x"
    ]["info"]
    proof = {
        **info,
        "address": "0x" + "11" * 20,
        "chainId": NETWORK,
        "type": "eip191",
        "signature": "0x" + "22" * 65,
    }
    return {**proof, **changes}


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda w, c: "!!not base64!!", "invalid_siwx_header"),
        (lambda w, c: _b64([1, 2, 3]), "invalid_siwx_header"),
        (lambda w, c: _b64({"domain": "testserver"}), "invalid_siwx_header"),
        (lambda w, c: "A" * 5000, "invalid_siwx_header"),
        (lambda w, c: base64.b64encode(b"[" * 5000 + b"]" * 5000).decode(), "invalid_siwx_header"),
        (lambda w, c: base64.b64encode(b"[" * 900 + b"]" * 900).decode(), "invalid_siwx_header"),
        (
            lambda w, c: _b64(_proof_like(w, c, domain="evil.example")),
            "invalid_siwx_domain_mismatch",
        ),
        (lambda w, c: _b64(_proof_like(w, c, chainId="eip155:1")), "invalid_siwx_chain_id"),
        (lambda w, c: _b64(_proof_like(w, c, nonce="0" * 32)), "invalid_siwx_nonce"),
        (
            lambda w, c: _b64(_proof_like(w, c, expirationTime="2099-01-01T00:00:00.000Z")),
            "invalid_siwx_nonce",
        ),
        (lambda w, c: _b64(_proof_like(w, c, issuedAt="yesterday")), "invalid_siwx_issued_at"),
        (lambda w, c: _b64(_proof_like(w, c)), "invalid_siwx_signature"),
        (lambda w, c: _b64(_proof_like(w, c, signature="0x1234")), "invalid_siwx_signature"),
        (lambda w, c: _b64(_proof_like(w, c, address="nobody")), "invalid_siwx_signature"),
        (
            lambda w, c: _b64(_proof_like(w, c, signature="0x" + "22" * 64 + "99")),
            "invalid_siwx_signature",
        ),
        (lambda w, c: _b64(_proof_like(w, c, signature="0xzz")), "invalid_siwx_signature"),
    ],
)
def test_proofs_no_client_would_send_get_the_402_saying_why(client, x402_world, make, reason):
    counted_before = _counted(reason)
    response = client.post(
        x402_world.paid_url,
        INPUT,
        content_type="application/json",
        HTTP_SIGN_IN_WITH_X=make(x402_world, client),
    )

    assert response.status_code == 402
    body = response.json()
    assert body["sign_in"]["refused"] == reason
    assert _counted(reason) == counted_before + 1
    assert body["paymentRequired"]["error"] == f"sign-in refused: {reason}"
    assert "sign-in-with-x" in _extensions(response)  # a fresh challenge to try again
    assert not WalletSignIn.objects.exists()
    assert not PurchaseEvent.objects.filter(subject="result.reaccessed").exists()


def test_a_get_with_a_refused_proof_is_the_get_402(client, x402_world):
    garbage = {"HTTP_SIGN_IN_WITH_X": "!!"}
    quoted = client.get(x402_world.paid_url, INPUT, **garbage)
    price_only = client.get(x402_world.paid_url, {"nope": "1"}, **garbage)

    assert quoted.status_code == 402 and quoted.json()["sign_in"]["refused"] == (
        "invalid_siwx_header"
    )
    assert "sign-in-with-x" in _extensions(quoted)
    # Not an input at all: the price-only 402, as a GET without a proof gets.
    assert price_only.status_code == 402 and "sign_in" not in price_only.json()
    assert price_only.json()["errors"] and "sign-in-with-x" not in _extensions(price_only)


def test_used_nonces_are_pruned_once_their_challenge_expired(x402_world):
    now = timezone.now()
    purchase = PurchaseFactory.create(executed=True)
    for nonce, expires_at in (("a" * 32, now - timedelta(seconds=1)), ("b" * 32, now)):
        WalletSignIn.objects.create(
            nonce=nonce, address="0x1", purchase=purchase, created_at=now, expires_at=expires_at
        )

    stats = purge_expired_quotes(now=now)

    assert stats["sign_ins_pruned"] == 1
    assert list(WalletSignIn.objects.values_list("nonce", flat=True)) == ["b" * 32]


@pytest.mark.django_db(transaction=True)
def test_the_mcp_door_offers_no_sign_in_it_cannot_take(x402_live_world):
    x402_world = x402_live_world
    result = tool_call(
        ToolCall(
            name=x402_world.offering.slug,
            arguments=INPUT,
            meta={},
            authorization=None,
            base_url="http://testserver",
        )
    )

    assert not isinstance(result, Waiting)  # an offer: nothing to wait for
    assert result.isError and result.structuredContent is not None
    extensions = result.structuredContent["extensions"]
    assert "payment-identifier" in extensions and "sign-in-with-x" not in extensions
