"""cdp-sdk as a test-time oracle for our CDP facilitator JWT (issue 35, part 1).

We mint the JWT ourselves (PyJWT + cryptography: cdp-sdk would add 17 packages to every
worker); this checks ours against the one CDP's own Python SDK builds for the same call to
the hosted facilitator, for both kinds of CDP Secret API key: the same JWT header keys and
values (but the random nonce, in the same form), the same claims (but the times, whose
span is the same), each verifying with the key's public half."""

from __future__ import annotations

import re
from typing import Any

import jwt
import pytest
from cdp.x402.x402 import (
    COINBASE_FACILITATOR_BASE_URL,
    COINBASE_FACILITATOR_V2_ROUTE,
    create_cdp_auth_headers,
)

from payments.rails.x402.facilitator_auth import CDP, FacilitatorAuth, cdp_jwt
from tests.x402.test_facilitator_auth import KEY_ID, ed25519_key, es256_key

CALLS = {"verify": "POST", "settle": "POST", "supported": "GET"}
NONCE = re.compile(r"^[0-9]{16}$")


def _decoded(token: str, public_key: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    header = jwt.get_unverified_header(token)
    claims = jwt.decode(
        token, public_key, algorithms=[header["alg"]], options={"verify_nbf": False}
    )
    # cdp-sdk writes `"aud": null` when no audience is asked for: no claim, as ours says.
    return header, {name: value for name, value in claims.items() if value is not None}


@pytest.mark.parametrize("make_key", [ed25519_key, es256_key], ids=["ed25519", "es256"])
@pytest.mark.parametrize("call", CALLS)
def test_our_jwt_carries_what_cdp_sdks_carries_for_the_same_call(make_key, call):
    secret, public_key = make_key()
    theirs_headers = create_cdp_auth_headers(KEY_ID, secret)()[call]
    theirs = theirs_headers["Authorization"].removeprefix("Bearer ")
    url = f"{COINBASE_FACILITATOR_BASE_URL}{COINBASE_FACILITATOR_V2_ROUTE}/{call}"
    ours = cdp_jwt(FacilitatorAuth(kind=CDP, secret=secret, key_id=KEY_ID), CALLS[call], url)

    their_header, their_claims = _decoded(theirs, public_key)
    our_header, our_claims = _decoded(ours, public_key)

    assert our_header.keys() == their_header.keys()
    assert {k: v for k, v in our_header.items() if k != "nonce"} == {
        k: v for k, v in their_header.items() if k != "nonce"
    }
    assert NONCE.match(our_header["nonce"]) and NONCE.match(their_header["nonce"])
    assert our_header["nonce"] != their_header["nonce"]
    assert our_claims.keys() == their_claims.keys()
    timeless = ("nbf", "exp", "iat")
    assert {k: v for k, v in our_claims.items() if k not in timeless} == {
        k: v for k, v in their_claims.items() if k not in timeless
    }
    assert our_claims["exp"] - our_claims["nbf"] == their_claims["exp"] - their_claims["nbf"]
    assert abs(our_claims["nbf"] - their_claims["nbf"]) <= 5
