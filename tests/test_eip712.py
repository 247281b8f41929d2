"""core/eip712 hashes exactly what eth-account's encode_typed_data hashes (the receipts and
the EIP-3009 authorizations sign and recover through it), and refuses what it refuses."""

from __future__ import annotations

import os

import pytest
from eth_account import Account
from eth_account.messages import encode_typed_data

from core import eip712
from fulfillment import evidence_seal, receipt_signing
from payments.chain import token


def _authorization(**over: object) -> dict[str, object]:
    return {
        "from": Account.create().address.lower(),
        "to": Account.create().address,
        "value": "1000000",
        "validAfter": "0",
        "validBefore": str(2**256 - 1),
        "nonce": "0x" + os.urandom(32).hex(),
        **over,
    }


@pytest.mark.parametrize("chain_id", [1, 31337, 84532])
def test_authorization_matches_encode_typed_data(chain_id: int) -> None:
    auth = _authorization()
    token_address = Account.create().address.lower()
    ours = token.transfer_authorization_typed_data(
        token_address=token_address,
        chain_id=chain_id,
        name="USD Coin",
        version="2",
        authorization=auth,
    )
    theirs = encode_typed_data(
        full_message={
            "types": token._AUTHORIZATION_TYPES,
            "primaryType": "TransferWithAuthorization",
            "domain": {
                "name": "USD Coin",
                "version": "2",
                "chainId": chain_id,
                "verifyingContract": token.checksummed(token_address),
            },
            "message": {
                "from": token.checksummed(str(auth["from"])),
                "to": auth["to"],
                "value": 1000000,
                "validAfter": 0,
                "validBefore": 2**256 - 1,
                "nonce": bytes.fromhex(str(auth["nonce"])[2:]),
            },
        }
    )
    assert ours == theirs
    # A second token on the same chain has a domain of its own (the cache is keyed by it).
    other = token.transfer_authorization_typed_data(
        token_address=Account.create().address,
        chain_id=chain_id,
        name="USD Coin",
        version="2",
        authorization=auth,
    )
    assert other.header != ours.header and other.body == ours.body


def test_authorization_signed_by_payer_recovers() -> None:
    payer = Account.create()
    auth = _authorization(**{"from": payer.address})
    kwargs = {"token_address": payer.address, "chain_id": 31337, "name": "T", "version": "1"}
    signature = payer.sign_message(
        token.transfer_authorization_typed_data(authorization=auth, **kwargs)
    ).signature
    assert (
        token.recover_authorization_signer(authorization=auth, signature=signature, **kwargs)
        == payer.address
    )


@pytest.mark.parametrize(
    "over",
    [{"value": str(2**256)}, {"value": -1}, {"nonce": "0x1234"}, {"to": "0x1234"}],
)
def test_authorization_out_of_its_types_is_refused(over: dict[str, object]) -> None:
    with pytest.raises((ValueError, TypeError)):
        token.transfer_authorization_typed_data(
            token_address=Account.create().address,
            chain_id=1,
            name="T",
            version="1",
            authorization=_authorization(**over),
        )


def test_receipt_matches_encode_typed_data() -> None:
    payload = {
        "version": 1,
        "network": "eip155:31337",
        "resourceUrl": "https://x/x402/report",
        "payer": Account.create().address,
        "issuedAt": 1767225600,
        "transaction": "0x" + "ab" * 32,
        "receipt": "rcpt_1",
        "purchase": "pur_1",
        "offering": "report",
        "amount": "10000",
        "asset": Account.create().address,
        "settledAt": 1767225601,
        "resultSha256": "00" * 32,
    }
    theirs = encode_typed_data(
        full_message={
            "types": receipt_signing.TYPES,
            "primaryType": receipt_signing.PRIMARY_TYPE,
            "domain": receipt_signing.DOMAIN,
            "message": payload,
        }
    )
    assert receipt_signing._typed(payload) == theirs


def test_evidence_seal_matches_encode_typed_data() -> None:
    seal = {"version": 1, "purchase": "pur_1", "issuedAt": 1767225600, "contentSha256": "ab" * 32}
    theirs = encode_typed_data(
        full_message={
            "types": evidence_seal.TYPES,
            "primaryType": evidence_seal.PRIMARY_TYPE,
            "domain": evidence_seal.DOMAIN,
            "message": seal,
        }
    )
    assert evidence_seal.SEAL.signable(seal) == theirs
    # Its own domain: a receipt's signature never passes for a pack's.
    assert (
        evidence_seal.SEAL.signable(seal).header
        != receipt_signing.RECEIPT.signable(
            {f["name"]: 0 if f["type"] == "uint256" else "" for f in receipt_signing.RECEIPT_FIELDS}
        ).header
    )


def test_unsupported_type_is_not_guessed() -> None:
    with pytest.raises(NotImplementedError):
        eip712.struct_hash("S", (("xs", "uint256[]"),), {"xs": [1]})
