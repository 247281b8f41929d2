"""Authenticated facilitators (issue 35, part 1): a CDP-shaped JWT minted per call with either
kind of CDP Secret API key, or a static header; refusals (401/403) are our outage, pending,
never a buyer's failure. Against the facilitator double on a real anvil chain, keys
generated here (no secret in the repository)."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jwt
import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from django.core.exceptions import ImproperlyConfigured
from prometheus_client import REGISTRY

import config.health as health
from devtools.facilitator_double import CDP_BASE_PATH, FacilitatorDouble
from payments.rails.base import SettlementStatus as S
from payments.rails.x402.facilitator import (
    REASON_REFUSED_CREDENTIALS,
    FacilitatorRefused,
    FacilitatorSettler,
    HttpReply,
    classify_settle,
    classify_verify,
    facilitator_supported,
)
from payments.rails.x402.facilitator_auth import (
    FacilitatorAuth,
    FacilitatorAuthInvalid,
    cdp_jwt,
    facilitator_auth,
)
from payments.rails.x402.networks import facilitator_credentials_check, network_config
from payments.rails.x402.types import NetworkConfig
from tests.x402.chain_env import USDC, FacilitatorChain

VALUE = 2 * USDC // 100
KEY_ID = "organizations/org-test/apiKeys/key-test"
NET = "eip155:31337"


def ed25519_key() -> tuple[str, ed25519.Ed25519PublicKey]:
    """A CDP Ed25519 secret as CDP issues it: base64 of seed (32) + public key (32)."""
    key = ed25519.Ed25519PrivateKey.generate()
    raw = key.private_bytes_raw() + key.public_key().public_bytes_raw()
    return base64.b64encode(raw).decode(), key.public_key()


def es256_key() -> tuple[str, ec.EllipticCurvePublicKey]:
    """A CDP EC secret as CDP issues it: a PEM EC P-256 private key."""
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    ).decode()
    return pem, key.public_key()


PublicKey = ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey
KEY_KINDS: dict[str, tuple[Callable[[], tuple[str, PublicKey]], str]] = {
    "ed25519": (ed25519_key, "EdDSA"),
    "es256": (es256_key, "ES256"),
}


def cdp_auth(secret: str, key_id: str = KEY_ID) -> FacilitatorAuth:
    auth = facilitator_auth({"cdp_api_key_id": key_id, "cdp_api_key_secret": secret}, where="test")
    assert auth is not None
    return auth


def authenticated(
    double: FacilitatorDouble, network: NetworkConfig, kind: str = "ed25519"
) -> tuple[NetworkConfig, FacilitatorAuth]:
    """The network pointed at the double's CDP base path with a fresh key it requires."""
    make_key, _ = KEY_KINDS[kind]
    secret, public = make_key()
    double.require_cdp_key(KEY_ID, public)
    auth = cdp_auth(secret)
    return replace(network, facilitator_url=double.cdp_url, facilitator_auth=auth), auth


def settle(
    chain: FacilitatorChain, network: NetworkConfig, settler: FacilitatorSettler | None = None
):
    settler = settler or FacilitatorSettler()
    authorization = chain.sign(VALUE)
    return settler.broadcast(
        authorization=authorization,
        requirements=chain.requirements(VALUE),
        network=network,
        prepared=settler.prepare(authorization=authorization, network=network),
    )


def refusals(network: str, endpoint: str, status: int) -> float:
    labels = {"network": network, "endpoint": endpoint, "status": str(status)}
    total = 0.0
    for metric in REGISTRY.collect():
        if metric.name != "tollbooth_facilitator_refusals":
            continue
        for sample in metric.samples:
            if sample.name.endswith("_total") and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                total += sample.value
    return total


# --- the token --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KEY_KINDS)
def test_a_cdp_token_is_minted_for_that_very_call(kind: str) -> None:
    make_key, algorithm = KEY_KINDS[kind]
    secret, public = make_key()
    auth = cdp_auth(secret)
    url = "https://api.cdp.coinbase.com:8443/platform/v2/x402/settle"
    before = int(time.time())

    token = auth.headers("POST", url)["Authorization"].removeprefix("Bearer ")
    other = cdp_jwt(auth, "POST", url)

    header = jwt.get_unverified_header(token)
    assert header["alg"] == algorithm and header["kid"] == KEY_ID and header["typ"] == "JWT"
    assert len(header["nonce"]) == 16 and header["nonce"].isdigit()
    assert jwt.get_unverified_header(other)["nonce"] != header["nonce"]  # fresh per call
    claims = jwt.decode(token, public, algorithms=[algorithm], issuer="cdp")
    assert claims["sub"] == KEY_ID and claims["iss"] == "cdp"
    assert before <= claims["nbf"] <= int(time.time())
    assert claims["exp"] - claims["nbf"] == 120
    assert claims["uris"] == ["POST api.cdp.coinbase.com:8443/platform/v2/x402/settle"]
    assert set(claims) == {"sub", "iss", "nbf", "exp", "uris"}


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ({"cdp_api_key_id": KEY_ID}, "both its id and its secret"),
        ({"cdp_api_key_id": KEY_ID, "cdp_api_key_secret": "bm90LWEta2V5"}, "neither PEM"),
        (
            {
                "cdp_api_key_id": KEY_ID,
                "cdp_api_key_secret": "-----BEGIN EC PRIVATE KEY-----\nAAAA",
            },
            "PEM",
        ),
        ({"bearer_token": "tok-secret-1", "api_key": "x"}, "one facilitator credential"),
        ({"api_key": "tok-secret-1"}, "name and its value"),
    ],
)
def test_unusable_credentials_are_refused_without_showing_them(
    raw: dict[str, str], problem: str
) -> None:
    with pytest.raises(ImproperlyConfigured, match=problem) as refused:
        facilitator_auth(raw, where="X402_BASE_...")
    for secret in raw.values():
        if secret != KEY_ID:
            assert secret not in str(refused.value)


def test_mismatched_ed25519_halves_are_refused() -> None:
    secret, _ = ed25519_key()
    raw = base64.b64decode(secret)
    other = ed25519.Ed25519PrivateKey.generate().public_key().public_bytes_raw()
    with pytest.raises(FacilitatorAuthInvalid, match="halves"):
        facilitator_auth(
            {"cdp_api_key_id": KEY_ID,
             "cdp_api_key_secret": base64.b64encode(raw[:32] + other).decode()},
            where="test",
        )  # fmt: skip


def test_credentials_are_never_in_a_repr() -> None:
    secret, _ = ed25519_key()
    auth = cdp_auth(secret)
    network = replace(network_config(NET), facilitator_auth=auth)
    assert secret not in repr(auth) and secret not in repr(network)


def test_a_network_with_its_own_facilitator_uses_only_its_own_credentials(settings: Any) -> None:
    settings.X402_FACILITATOR_URL = "https://global.example/x402"
    settings.X402_FACILITATOR_AUTH = {"bearer_token": "global-token"}
    settings.X402_NETWORKS = {
        NET: {
            **settings.X402_NETWORKS[NET],
            "mode": "facilitator",
            "facilitator_url": "",
            "facilitator_auth": {},
        },
        "eip155:8453": {
            **settings.X402_NETWORKS["eip155:8453"],
            "mode": "facilitator",
            "facilitator_url": "https://own.example/x402",
            "facilitator_auth": {"api_key_header": "X-Api-Key", "api_key": "own-key"},
        },
    }
    shared = network_config(NET)
    assert shared.facilitator_url == "https://global.example/x402"
    assert shared.facilitator_auth is not None
    assert shared.facilitator_auth.headers("GET", shared.facilitator_url) == {
        "Authorization": "Bearer global-token"
    }
    own = network_config("eip155:8453")
    assert own.facilitator_url == "https://own.example/x402"
    assert own.facilitator_auth is not None
    assert own.facilitator_auth.headers("GET", own.facilitator_url) == {"X-Api-Key": "own-key"}

    settings.X402_NETWORKS["eip155:8453"]["facilitator_auth"] = {}
    assert network_config("eip155:8453").facilitator_auth is None  # never the global token


# --- through the double -----------------------------------------------------------------


@pytest.mark.parametrize("kind", KEY_KINDS)
def test_settles_authenticated_under_cdps_base_path(
    kind: str,
    facilitator_chain: FacilitatorChain,
    facilitator_double: FacilitatorDouble,
    facilitator_network: NetworkConfig,
) -> None:
    network, _ = authenticated(facilitator_double, facilitator_network, kind)

    outcome = settle(facilitator_chain, network)

    assert (outcome.status, outcome.tx_hash) == (S.CONFIRMED, facilitator_double.broadcasts[0])
    assert facilitator_chain.balance(facilitator_chain.seller) == VALUE
    assert not facilitator_double.refusals
    uris = [
        jwt.decode(t, options={"verify_signature": False})["uris"]
        for t in facilitator_double.tokens
    ]
    host = facilitator_double.url.removeprefix("http://")
    assert uris == [[f"POST {host}{CDP_BASE_PATH}/verify"], [f"POST {host}{CDP_BASE_PATH}/settle"]]
    assert facilitator_supported(network.facilitator_url, 1.5, network.facilitator_auth) is not None


def test_the_double_refuses_missing_expired_forged_and_misdirected_tokens(
    facilitator_double: FacilitatorDouble,
) -> None:
    secret, public = es256_key()
    facilitator_double.require_cdp_key(KEY_ID, public)
    auth = cdp_auth(secret)
    forged = cdp_auth(es256_key()[0])  # same key id, another key
    supported = f"{facilitator_double.cdp_url}/supported"
    settle_url = f"{facilitator_double.cdp_url}/settle"

    def status(token: str | None, url: str = supported) -> int:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return requests.get(url, headers=headers, timeout=5).status_code

    assert status(cdp_jwt(auth, "GET", supported)) == 200
    assert status(None) == 401
    assert status(cdp_jwt(auth, "GET", supported, now=int(time.time()) - 600)) == 401
    assert status(cdp_jwt(forged, "GET", supported)) == 401
    assert status(cdp_jwt(auth, "GET", settle_url)) == 401  # minted for another call
    assert facilitator_double.refusals == {
        "missing_token": 1, "expired": 1, "bad_signature": 1, "wrong_uri": 1,
    }  # fmt: skip
    assert facilitator_double.calls["supported"] == 1  # refused calls reach nothing


@pytest.mark.parametrize(
    ("header", "value", "sent"),
    [
        ("Authorization", "Bearer tok-123", {"bearer_token": "tok-123"}),
        ("X-Api-Key", "key-456", {"api_key_header": "X-Api-Key", "api_key": "key-456"}),
    ],
)
def test_a_static_header_authenticates_other_facilitators(
    header: str,
    value: str,
    sent: dict[str, str],
    facilitator_chain: FacilitatorChain,
    facilitator_double: FacilitatorDouble,
    facilitator_network: NetworkConfig,
) -> None:
    facilitator_double.require_header(header, value)
    network = replace(facilitator_network, facilitator_auth=facilitator_auth(sent, where="t"))

    assert settle(facilitator_chain, network).status == S.CONFIRMED
    assert not facilitator_double.refusals


def test_a_revoked_key_at_verify_is_pending_never_failed_and_counted(
    facilitator_chain: FacilitatorChain,
    facilitator_double: FacilitatorDouble,
    facilitator_network: NetworkConfig,
) -> None:
    network, _ = authenticated(facilitator_double, facilitator_network)
    facilitator_double.revoke(KEY_ID)
    counted = refusals(network.caip2, "verify", 401)

    outcome = settle(facilitator_chain, network)

    assert (outcome.status, outcome.reason_code) == (S.PENDING, REASON_REFUSED_CREDENTIALS)
    assert outcome.evidence["settle_called"] is False
    assert facilitator_double.calls["settle"] == 0 and facilitator_double.broadcast_count == 0
    assert refusals(network.caip2, "verify", 401) == counted + 1
    assert facilitator_double.refusals == {"revoked_key": 1}


def test_before_recording_a_refusal_raises_and_a_valid_answer_is_not_asked_twice(
    facilitator_chain: FacilitatorChain,
    facilitator_double: FacilitatorDouble,
    facilitator_network: NetworkConfig,
) -> None:
    network, _ = authenticated(facilitator_double, facilitator_network)
    authorization = facilitator_chain.sign(VALUE)
    requirements = facilitator_chain.requirements(VALUE)
    settler = FacilitatorSettler()
    settler.verify_before_record(
        authorization=authorization, requirements=requirements, network=network
    )
    outcome = settler.broadcast(
        authorization=authorization,
        requirements=requirements,
        network=network,
        prepared=settler.prepare(authorization=authorization, network=network),
    )
    assert outcome.status == S.CONFIRMED
    assert facilitator_double.calls["verify"] == 1  # the answer before recording was used

    facilitator_double.revoke(KEY_ID)
    with pytest.raises(FacilitatorRefused) as refused:
        FacilitatorSettler().verify_before_record(
            authorization=facilitator_chain.sign(VALUE), requirements=requirements, network=network
        )
    assert (refused.value.status, refused.value.endpoint) == (401, "verify")
    assert refused.value.facilitator.endswith(CDP_BASE_PATH)


def test_a_key_revoked_between_verify_and_settle_leaves_the_payment_pending(
    facilitator_chain: FacilitatorChain,
    facilitator_double: FacilitatorDouble,
    facilitator_network: NetworkConfig,
) -> None:
    network, _ = authenticated(facilitator_double, facilitator_network)
    authorization = facilitator_chain.sign(VALUE)
    requirements = facilitator_chain.requirements(VALUE)
    settler = FacilitatorSettler()
    settler.verify_before_record(
        authorization=authorization, requirements=requirements, network=network
    )
    facilitator_double.revoke(KEY_ID)

    outcome = settler.broadcast(
        authorization=authorization,
        requirements=requirements,
        network=network,
        prepared=settler.prepare(authorization=authorization, network=network),
    )

    assert (outcome.status, outcome.reason_code) == (S.PENDING, REASON_REFUSED_CREDENTIALS)
    assert outcome.tx_hash is None
    assert facilitator_double.broadcast_count == 0


@pytest.mark.parametrize("status", [401, 403])
def test_refusals_are_classified_as_our_outage(status: int) -> None:
    # Even a body that would prove a rejection says nothing under a refusal of our key.
    body = json.dumps(
        {"isValid": False, "invalidReason": "invalid_signature", "success": False,
         "errorReason": "invalid_signature"}
    ).encode()  # fmt: skip
    verdict = classify_verify(HttpReply(status, body))
    assert verdict is not None
    assert (verdict.status, verdict.reason_code) == (S.PENDING, REASON_REFUSED_CREDENTIALS)
    settled = classify_settle(HttpReply(status, body), network=NET)
    assert (settled.status, settled.reason_code) == (S.PENDING, REASON_REFUSED_CREDENTIALS)


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (202, b'{"paymentId": "pay_42", "status": "pending"}'),
        (200, b'{"paymentId": "pay_42", "success": false}'),
        (202, b'{"paymentId": "pay_42", "success": true, "transaction": "0x' + b"ab" * 32 + b'"}'),
    ],
)
def test_a_facilitators_payment_id_is_pending_and_kept(status: int, body: bytes) -> None:
    outcome = classify_settle(HttpReply(status, body), network=NET)
    assert (outcome.status, outcome.reason_code) == (S.PENDING, "settlement_pending")
    assert outcome.evidence["facilitator_payment_id"] == "pay_42"


def test_a_proven_success_naming_a_payment_id_is_confirmed_and_keeps_it() -> None:
    tx = "0x" + "cd" * 32
    body = f'{{"paymentId": "pay_7", "success": true, "transaction": "{tx}"}}'.encode()
    outcome = classify_settle(HttpReply(200, body), network=NET)
    assert (outcome.status, outcome.tx_hash) == (S.CONFIRMED, tx)
    assert outcome.evidence["facilitator_payment_id"] == "pay_7"


def test_readiness_checks_each_facilitator_with_its_credentials(
    settings: Any, facilitator_double: FacilitatorDouble
) -> None:
    secret, public = ed25519_key()
    facilitator_double.require_cdp_key(KEY_ID, public)
    settings.X402_FACILITATOR_URL = ""
    settings.X402_NETWORKS = {
        NET: {
            **settings.X402_NETWORKS[NET],
            "token_address": "0x" + "1" * 40,
            "mode": "facilitator",
            "facilitator_url": facilitator_double.cdp_url,
            "facilitator_auth": {"cdp_api_key_id": KEY_ID, "cdp_api_key_secret": secret},
        }
    }
    check = health.readiness_checks()[f"facilitator:{NET}"]
    check()  # /supported answered with a fresh token: ready
    assert facilitator_double.calls["supported"] == 1 and len(facilitator_double.tokens) == 1

    facilitator_double.revoke(KEY_ID)
    with pytest.raises(FacilitatorRefused, match="HTTP 401"):
        check()
    results = health._run({"facilitator": check})
    assert results["facilitator"]["error"] == "FacilitatorRefused"
    assert secret not in str(results)


def test_unusable_credentials_fail_the_system_check_and_direct_mode_ignores_them(
    settings: Any,
) -> None:
    settings.X402_FACILITATOR_URL = "https://global.example/x402"
    settings.X402_FACILITATOR_AUTH = {"cdp_api_key_id": KEY_ID, "cdp_api_key_secret": "bm9wZQ=="}
    settings.X402_NETWORKS = {NET: {**settings.X402_NETWORKS[NET], "mode": "facilitator"}}

    errors = facilitator_credentials_check()

    assert [e.id for e in errors] == ["payments.E001"]
    assert "global facilitator" in errors[0].msg and "bm9wZQ" not in errors[0].msg
    settings.X402_NETWORKS[NET]["mode"] = "direct"
    assert facilitator_credentials_check() == []
    assert network_config(NET).facilitator_auth is None  # direct mode calls no facilitator
