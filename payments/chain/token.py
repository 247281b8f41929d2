"""TestUSDC and EIP-3009 ("transfer with authorization") helpers.

The buyer signs an EIP-712 TransferWithAuthorization; anyone (the seller, a facilitator)
broadcasts it. Authorizations travel in the x402 shape: every number is a decimal string,
the nonce and signature are 0x-hex. Amounts are ints in atomic units (6 decimals), never
floats.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Mapping
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, Literal, TypedDict

from eth_abi import encode as abi_encode
from eth_account import Account
from eth_account.messages import SignableMessage
from eth_typing import ChecksumAddress
from hexbytes import HexBytes
from web3 import Web3
from web3.contract import Contract
from web3.types import TxParams

from core import eip712

ARTIFACT_PATH = Path(__file__).resolve().parent / "artifacts" / "TestUSDC.json"
DECIMALS = 6

# Both overloads exist on USDC v2.2; the v,r,s one also on older FiatToken deployments.
TWA_VRS = "transferWithAuthorization(address,address,uint256,uint256,uint256,bytes32,uint8,bytes32,bytes32)"  # noqa: E501
TWA_BYTES = "transferWithAuthorization(address,address,uint256,uint256,uint256,bytes32,bytes)"
_TWA_HEAD_TYPES = ["address", "address", "uint256", "uint256", "uint256", "bytes32"]
_TWA_VRS_TYPES = [*_TWA_HEAD_TYPES, "uint8", "bytes32", "bytes32"]
_TWA_BYTES_TYPES = [*_TWA_HEAD_TYPES, "bytes"]
# The 4-byte selectors, hashed once at import rather than looked up in the ABI per call.
TWA_VRS_SELECTOR = Web3.keccak(text=TWA_VRS)[:4]
TWA_BYTES_SELECTOR = Web3.keccak(text=TWA_BYTES)[:4]
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{40}")

_AUTHORIZATION_TYPES = {
    "EIP712Domain": [
        {"name": "name", "type": "string"},
        {"name": "version", "type": "string"},
        {"name": "chainId", "type": "uint256"},
        {"name": "verifyingContract", "type": "address"},
    ],
    "TransferWithAuthorization": [
        {"name": "from", "type": "address"},
        {"name": "to", "type": "address"},
        {"name": "value", "type": "uint256"},
        {"name": "validAfter", "type": "uint256"},
        {"name": "validBefore", "type": "uint256"},
        {"name": "nonce", "type": "bytes32"},
    ],
}

_DOMAIN_FIELDS = eip712.fields_of(_AUTHORIZATION_TYPES["EIP712Domain"])
_PRIMARY = "TransferWithAuthorization"
_MESSAGE_FIELDS = eip712.fields_of(_AUTHORIZATION_TYPES[_PRIMARY])

Authorization = TypedDict(
    "Authorization",
    # "from" is a keyword, hence the functional form.
    {"from": str, "to": str, "value": str, "validAfter": str, "validBefore": str, "nonce": str},
)


# --- artifact and contract -----------------------------------------------------------------


@cache
def load_artifact() -> dict[str, Any]:
    artifact: dict[str, Any] = json.loads(ARTIFACT_PATH.read_text())
    return artifact


# Building a contract object parses the whole ABI (tens of milliseconds of CPU): once per
# client and token, not once per call. Weak keys: a client dropped takes its contracts along.
_CONTRACTS: weakref.WeakKeyDictionary[Web3, dict[str, Contract]] = weakref.WeakKeyDictionary()
_CONTRACTS_LOCK = threading.Lock()


def token_contract(w3: Web3, token: str) -> Contract:
    address = checksummed(token)
    with _CONTRACTS_LOCK:
        contract = _CONTRACTS.setdefault(w3, {}).get(address)
    if contract is None:
        contract = w3.eth.contract(address=address, abi=load_artifact()["abi"])
        with _CONTRACTS_LOCK:
            _CONTRACTS.setdefault(w3, {})[address] = contract
    return contract


def balance_of(w3: Web3, token: str, holder: str) -> int:
    balance: int = (
        token_contract(w3, token).functions.balanceOf(Web3.to_checksum_address(holder)).call()
    )
    return balance


def authorization_state(w3: Web3, token: str, authorizer: str, nonce: bytes | str) -> bool:
    """True once the authorization (authorizer, nonce) has been used on chain."""
    used: bool = (
        token_contract(w3, token)
        .functions.authorizationState(Web3.to_checksum_address(authorizer), _nonce_bytes(nonce))
        .call()
    )
    return used


# --- signing and verifying off chain ---------------------------------------------------------


def transfer_authorization_typed_data(
    *,
    token_address: str,
    chain_id: int,
    name: str,
    version: str,
    authorization: Mapping[str, Any],
) -> SignableMessage:
    """The EIP-712 message a buyer signs for `authorization` (x402 shape or ints)."""
    message = {
        "from": checksummed(authorization["from"]),
        "to": checksummed(authorization["to"]),
        "value": _as_int(authorization["value"], "value"),
        "validAfter": _as_int(authorization["validAfter"], "validAfter"),
        "validBefore": _as_int(authorization["validBefore"], "validBefore"),
        "nonce": _nonce_bytes(authorization["nonce"]),
    }
    domain = {
        "name": name,
        "version": version,
        "chainId": chain_id,
        "verifyingContract": checksummed(token_address),
    }
    # What encode_typed_data gives for _AUTHORIZATION_TYPES, the domain hashed once per
    # token (core/eip712.py).
    return eip712.signable(_DOMAIN_FIELDS, domain, _PRIMARY, _MESSAGE_FIELDS, message)


@lru_cache(maxsize=4096)
def checksummed(address: str) -> ChecksumAddress:
    """Web3.to_checksum_address, remembered: a keccak per call, and payers, relayers and
    tokens recur on every paid request. Raises as it does (failures are not cached)."""
    return Web3.to_checksum_address(address)


def recover_authorization_signer(
    *,
    token_address: str,
    chain_id: int,
    name: str,
    version: str,
    authorization: Mapping[str, Any],
    signature: str | bytes,
) -> ChecksumAddress:
    """Who signed `authorization`. Valid only if this equals authorization["from"].

    Covers EOA signatures only: a smart-contract wallet (ERC-1271) can be judged on chain only.
    """
    signable = transfer_authorization_typed_data(
        token_address=token_address,
        chain_id=chain_id,
        name=name,
        version=version,
        authorization=authorization,
    )
    signer: ChecksumAddress = Account.recover_message(
        signable, signature=_normalize_signature(signature)
    )
    return signer


# --- broadcasting ---------------------------------------------------------------------------


def build_transfer_with_authorization_tx(
    w3: Web3,
    token: str,
    sender: str,
    authorization: Mapping[str, Any],
    signature: str | bytes,
    *,
    signature_form: Literal["vrs", "bytes"] = "vrs",
    gas: int | None = None,
) -> TxParams:
    """An unsigned transaction calling transferWithAuthorization, sent by `sender`.

    Without `gas`, web3 estimates it, which raises ContractLogicError (with the revert
    reason) for an authorization that would revert, before any gas is spent.
    """
    sig = _normalize_signature(signature)
    contract = token_contract(w3, token)
    head = (
        Web3.to_checksum_address(authorization["from"]),
        Web3.to_checksum_address(authorization["to"]),
        _as_int(authorization["value"], "value"),
        _as_int(authorization["validAfter"], "validAfter"),
        _as_int(authorization["validBefore"], "validBefore"),
        _nonce_bytes(authorization["nonce"]),
    )
    if signature_form == "vrs":
        fn = contract.get_function_by_signature(TWA_VRS)(*head, sig[64], sig[:32], sig[32:64])
    else:
        fn = contract.get_function_by_signature(TWA_BYTES)(*head, sig)
    params: TxParams = {"from": Web3.to_checksum_address(sender), "chainId": w3.eth.chain_id}
    if gas is not None:
        params["gas"] = gas
    tx: TxParams = fn.build_transaction(params)
    return tx


def transfer_with_authorization_calldata(
    authorization: Mapping[str, Any],
    signature: str | bytes,
    *,
    signature_form: Literal["vrs", "bytes"] = "vrs",
) -> bytes:
    """The calldata of transferWithAuthorization (either overload), the same bytes web3's
    contract function would encode, from the ABI types and a precomputed selector: the
    settlement's hot path builds it on every paid call."""
    sig = _normalize_signature(signature)
    head = [
        _abi_address(authorization["from"], "from"),
        _abi_address(authorization["to"], "to"),
        _as_int(authorization["value"], "value"),
        _as_int(authorization["validAfter"], "validAfter"),
        _as_int(authorization["validBefore"], "validBefore"),
        _nonce_bytes(authorization["nonce"]),
    ]
    if signature_form == "vrs":
        args = abi_encode(_TWA_VRS_TYPES, [*head, sig[64], sig[:32], sig[32:64]])
        return TWA_VRS_SELECTOR + args
    return TWA_BYTES_SELECTOR + abi_encode(_TWA_BYTES_TYPES, [*head, sig])


# --- value checks ---------------------------------------------------------------------------


def _require_int(value: object, field: str) -> None:
    # bool is an int subclass and float loses precision: refuse both.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"{field} must be a non-negative int, got {value!r}")


def _as_int(value: object, field: str) -> int:
    """x402 sends numbers as decimal strings; accept those and ints, nothing else."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    _require_int(value, field)
    assert isinstance(value, int)
    return value


def _abi_address(value: object, field: str) -> str:
    """Any-case 0x + 40 hex, lower-cased: the ABI encoder then checks no EIP-55 checksum
    (a keccak), as web3 checked none after checksumming it itself."""
    if not isinstance(value, str) or not _ADDRESS.fullmatch(value):
        raise ValueError(f"{field} must be an address (0x + 40 hex characters), got {value!r}")
    return value.lower()


def _nonce_bytes(nonce: bytes | str) -> bytes:
    raw = bytes(HexBytes(nonce))
    if len(raw) != 32:
        raise ValueError(f"an EIP-3009 nonce is 32 bytes, got {len(raw)}")
    return raw


def _normalize_signature(signature: str | bytes) -> bytes:
    """65 bytes r || s || v with v in {27, 28} (some signers emit 0/1)."""
    sig = bytearray(HexBytes(signature))
    if len(sig) != 65:
        raise ValueError(f"expected a 65-byte signature, got {len(sig)} bytes")
    if sig[64] < 27:
        sig[64] += 27
    return bytes(sig)
