"""Our own x402 verification against a real anvil chain (no mocks, no database)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
from hexbytes import HexBytes

from payments.rails.x402.chain import ChainReader, ChainUnavailable
from payments.rails.x402.types import Authorization, NetworkConfig, Requirements, VerificationFailed
from payments.rails.x402.verify import (
    SETTLEMENT_MARGIN_SECONDS,
    VERIFICATION_NEXT_MOVE,
    VERIFICATION_REASONS,
    parse_authorization,
    verify_payment,
)
from tests.fixtures.anvil import closed_port_url
from tests.x402.chain_env import PRICE, ChainEnv

SECP256K1_N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141


def verify(
    chain: ChainEnv,
    authorization: Authorization,
    requirements: Requirements | None = None,
    *,
    now: int | None = None,
    reader: ChainReader | None = None,
    network: NetworkConfig | None = None,
) -> None:
    verify_payment(
        authorization=authorization,
        requirements=requirements or chain.requirements(),
        network=network or chain.network,
        now=chain.now() if now is None else now,
        reader=reader or chain.reader(),
    )


def reason_of(chain: ChainEnv, authorization: Authorization, **kwargs: Any) -> str:
    with pytest.raises(VerificationFailed) as caught:
        verify(chain, authorization, **kwargs)
    assert caught.value.reason_code in VERIFICATION_REASONS
    return caught.value.reason_code


def with_signature(authorization: Authorization, signature: bytes) -> Authorization:
    return dataclasses.replace(authorization, signature=HexBytes(signature).to_0x_hex())


# --- the happy path ---------------------------------------------------------------------------


def test_valid_payment_passes(chain: ChainEnv) -> None:
    verify(chain, chain.authorization())


def test_requirement_addresses_compare_case_insensitively(chain: ChainEnv) -> None:
    lowered = chain.requirements(asset=chain.token.lower(), pay_to=chain.seller.address.lower())
    verify(chain, chain.authorization(), lowered)


def test_v_as_zero_or_one_is_accepted(chain: ChainEnv) -> None:
    # Some signers emit v as 0/1; the broadcaster normalises it to 27/28.
    authorization = chain.authorization()
    raw = bytearray(HexBytes(authorization.signature))
    raw[64] -= 27
    verify(chain, with_signature(authorization, bytes(raw)))


# --- terms ------------------------------------------------------------------------------------


def test_network_mismatch(chain: ChainEnv) -> None:
    required = chain.requirements(network="eip155:8453")
    assert reason_of(chain, chain.authorization(), requirements=required) == "network_mismatch"


def test_asset_mismatch(chain: ChainEnv) -> None:
    required = chain.requirements(asset=chain.stranger.address)
    assert reason_of(chain, chain.authorization(), requirements=required) == "asset_mismatch"


def test_signature_by_another_key(chain: ChainEnv) -> None:
    # Signed by the stranger, claiming to come from the payer: one rule, invalid_signature.
    forged = chain.sign(chain.stranger)
    forged["authorization"]["from"] = chain.payer.address
    assert reason_of(chain, parse_authorization(forged)) == "invalid_signature"


def test_signature_over_other_terms(chain: ChainEnv) -> None:
    # The payer signed a smaller value; the payload claims the price.
    signed = chain.sign(value=PRICE - 1)
    signed["authorization"]["value"] = str(PRICE)
    assert reason_of(chain, parse_authorization(signed)) == "invalid_signature"


def test_signature_under_another_domain(chain: ChainEnv) -> None:
    signed = chain.sign(version="1")
    assert reason_of(chain, parse_authorization(signed)) == "invalid_signature"


@pytest.mark.parametrize("mutate", ["flip_r", "v_29", "high_s", "zero_rs"])
def test_bad_signature_bytes(chain: ChainEnv, mutate: str) -> None:
    authorization = chain.authorization()
    raw = bytearray(HexBytes(authorization.signature))
    if mutate == "flip_r":
        raw[5] ^= 0xFF
    elif mutate == "v_29":
        raw[64] = 29
    elif mutate == "high_s":
        # The same signature in its malleable form: recoverable, but the token refuses it.
        s = int.from_bytes(raw[32:64], "big")
        raw[32:64] = (SECP256K1_N - s).to_bytes(32, "big")
        raw[64] = 55 - raw[64]
    else:
        raw[:64] = bytes(64)
    assert reason_of(chain, with_signature(authorization, bytes(raw))) == "invalid_signature"


def test_recipient_mismatch(chain: ChainEnv) -> None:
    authorization = chain.authorization(chain.sign(to=chain.stranger.address))
    assert reason_of(chain, authorization) == "recipient_mismatch"


@pytest.mark.parametrize("value", [PRICE - 1, PRICE + 1, 0])
def test_amount_must_be_exact(chain: ChainEnv, value: int) -> None:
    authorization = chain.authorization(chain.sign(value=value))
    assert reason_of(chain, authorization) == "amount_mismatch"


def test_first_failure_wins(chain: ChainEnv) -> None:
    # Wrong recipient and wrong amount: the recipient is checked first.
    authorization = chain.authorization(chain.sign(to=chain.stranger.address, value=1))
    assert reason_of(chain, authorization) == "recipient_mismatch"
    # Wrong network and a forged signature: the network is checked first.
    forged = dataclasses.replace(authorization, payer=chain.stranger.address)
    required = chain.requirements(network="eip155:1")
    assert reason_of(chain, forged, requirements=required) == "network_mismatch"


# --- validity window --------------------------------------------------------------------------


def test_not_yet_valid(chain: ChainEnv) -> None:
    now = chain.now()
    authorization = chain.authorization(chain.sign(valid_after=now + 120))
    assert reason_of(chain, authorization, now=now) == "authorization_not_yet_valid"
    verify(chain, authorization, now=now + 120)  # valid_after == now is fine


def test_expired(chain: ChainEnv) -> None:
    now = chain.now()
    authorization = chain.authorization(chain.sign(valid_before=now - 1))
    assert reason_of(chain, authorization, now=now) == "authorization_expired"


def test_window_must_cover_settlement(chain: ChainEnv) -> None:
    now = chain.now()
    edge = now + SETTLEMENT_MARGIN_SECONDS
    short = chain.authorization(chain.sign(valid_before=edge - 1))
    assert reason_of(chain, short, now=now) == "authorization_expired"
    verify(chain, chain.authorization(chain.sign(valid_before=edge)), now=now)


# --- on chain ---------------------------------------------------------------------------------


def test_used_nonce(chain: ChainEnv) -> None:
    authorization = chain.authorization()
    verify(chain, authorization)
    chain.settle(authorization)
    assert reason_of(chain, authorization) == "authorization_used"


def test_insufficient_balance(chain: ChainEnv) -> None:
    # The stranger holds no USDC; everything else about the authorization is right.
    authorization = chain.authorization(chain.sign(chain.stranger))
    assert reason_of(chain, authorization) == "insufficient_balance"


def test_chain_unavailable_propagates(chain: ChainEnv) -> None:
    down = chain.reader(rpc_url=closed_port_url())
    with pytest.raises(ChainUnavailable):
        verify(chain, chain.authorization(), reader=down)
    # Off-chain failures are still decided without the chain.
    wrong = chain.authorization(chain.sign(value=1))
    assert reason_of(chain, wrong, reader=down) == "amount_mismatch"


# --- parsing ----------------------------------------------------------------------------------


def test_parse_normalises(chain: ChainEnv) -> None:
    signed: Any = copy.deepcopy(chain.sign())
    auth = signed["authorization"]
    auth["from"] = auth["from"].lower()
    auth["nonce"] = auth["nonce"].upper().replace("0X", "0x")
    auth["value"] = PRICE  # ints are tolerated
    parsed = parse_authorization(signed)
    assert parsed.payer == chain.payer.address  # checksummed
    assert parsed.nonce == auth["nonce"].lower()
    assert parsed.value == PRICE
    assert parsed.as_wire()["authorization"]["value"] == str(PRICE)


def _broken(chain: ChainEnv, path: tuple[str, ...], value: Any) -> Any:
    signed: Any = copy.deepcopy(chain.sign())
    target = signed
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return signed


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("authorization", "value"), 0.01),
        (("authorization", "value"), 10000.0),
        (("authorization", "value"), True),
        (("authorization", "value"), -1),
        (("authorization", "value"), "-1"),
        (("authorization", "value"), "1e4"),
        (("authorization", "value"), " 10000"),
        (("authorization", "value"), ""),
        (("authorization", "value"), "\u0661\u0660"),  # non-ASCII digits
        (("authorization", "value"), str(2**256)),
        (("authorization", "validBefore"), None),
        (("authorization", "nonce"), "0x" + "ab" * 31),
        (("authorization", "nonce"), "ab" * 32),
        (("authorization", "nonce"), "0x" + "zz" * 32),
        (("authorization", "from"), "0x1234"),
        (("authorization", "to"), "not an address"),
        (("signature",), "0x" + "00" * 64),
        (("signature",), 12),
        (("authorization", "from"), KeyError),
        (("authorization", "nonce"), KeyError),
        (("signature",), KeyError),
        (("authorization",), KeyError),
        (("authorization",), "from=0x..."),
    ],
)
def test_malformed_payloads(chain: ChainEnv, path: tuple[str, ...], value: Any) -> None:
    with pytest.raises(VerificationFailed) as caught:
        parse_authorization(_broken(chain, path, value))
    assert caught.value.reason_code == "invalid_payload"
    assert caught.value.detail


def test_bad_checksum_is_malformed(chain: ChainEnv) -> None:
    # An EIP-55 example with one letter's case flipped: mixed case, wrong checksum.
    valid = "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed"
    typo = "0x5AAeb6053F3E94C9b9A09f33669435E7Ef1BeAed"
    assert parse_authorization(_broken(chain, ("authorization", "to"), valid)).to == valid
    with pytest.raises(VerificationFailed, match="checksum"):
        parse_authorization(_broken(chain, ("authorization", "to"), typo))


@pytest.mark.parametrize("payload", [None, [], "payload", 42])
def test_payload_must_be_an_object(payload: object) -> None:
    with pytest.raises(VerificationFailed) as caught:
        parse_authorization(payload)
    assert caught.value.reason_code == "invalid_payload"


def test_every_reason_is_documented_and_the_buyers_move() -> None:
    assert set(VERIFICATION_NEXT_MOVE) == set(VERIFICATION_REASONS)
    assert set(VERIFICATION_NEXT_MOVE.values()) == {"buyer"}
    assert all(text and "\n" not in text for text in VERIFICATION_REASONS.values())
