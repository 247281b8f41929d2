"""TestUSDC and EIP-3009 ("transfer with authorization") helpers.

The buyer signs an EIP-712 TransferWithAuthorization; anyone (the seller, a facilitator)
broadcasts it. Authorizations travel in the x402 shape: every number is a decimal string,
the nonce and signature are 0x-hex. Amounts are ints in atomic units (6 decimals), never
floats.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any, Literal, TypedDict, cast

from eth_account import Account
from eth_account.messages import SignableMessage, encode_typed_data
from eth_account.signers.local import LocalAccount
from eth_typing import ChecksumAddress, HexStr
from hexbytes import HexBytes
from web3 import Web3
from web3.contract import Contract
from web3.types import TxParams, TxReceipt

ARTIFACT_PATH = Path(__file__).resolve().parent / "artifacts" / "TestUSDC.json"
DECIMALS = 6

# Both overloads exist on USDC v2.2; the v,r,s one also on older FiatToken deployments.
TWA_VRS = "transferWithAuthorization(address,address,uint256,uint256,uint256,bytes32,uint8,bytes32,bytes32)"  # noqa: E501
TWA_BYTES = "transferWithAuthorization(address,address,uint256,uint256,uint256,bytes32,bytes)"

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

Authorization = TypedDict(
    "Authorization",
    # "from" is a keyword, hence the functional form.
    {"from": str, "to": str, "value": str, "validAfter": str, "validBefore": str, "nonce": str},
)


class SignedAuthorization(TypedDict):
    """The `payload` of an x402 "exact" EVM PaymentPayload."""

    signature: str
    authorization: Authorization


class ChainTxError(RuntimeError):
    """A transaction was mined but reverted."""


# --- artifact and contract -----------------------------------------------------------------


@cache
def load_artifact() -> dict[str, Any]:
    artifact: dict[str, Any] = json.loads(ARTIFACT_PATH.read_text())
    return artifact


def token_contract(w3: Web3, token: str) -> Contract:
    return w3.eth.contract(address=Web3.to_checksum_address(token), abi=load_artifact()["abi"])


def _send(
    w3: Web3,
    sender: LocalAccount,
    tx: TxParams,
    *,
    nonce: int | None = None,
) -> HexStr:
    """Sign locally and broadcast. The account nonce comes from the node's pending count
    unless given: a cached nonce would leave a gap after a dropped transaction."""
    if nonce is None:
        nonce = w3.eth.get_transaction_count(sender.address, "pending")
    # eth_account types its input as a plain dict; TxParams is a TypedDict.
    signed = sender.sign_transaction(cast(dict[str, Any], {**tx, "nonce": nonce}))
    return HexStr(w3.eth.send_raw_transaction(signed.raw_transaction).to_0x_hex())


def _wait_ok(w3: Web3, tx_hash: HexStr, timeout: float) -> TxReceipt:
    receipt = w3.eth.wait_for_transaction_receipt(tx_hash, timeout=timeout)
    if receipt["status"] != 1:
        raise ChainTxError(f"transaction {tx_hash} reverted")
    return receipt


def deploy_test_usdc(
    w3: Web3,
    deployer: LocalAccount,
    name: str = "USDC",
    version: str = "2",
    *,
    timeout: float = 30.0,
) -> ChecksumAddress:
    """Deploy TestUSDC (the deployer becomes the only minter) and wait for it."""
    artifact = load_artifact()
    factory = w3.eth.contract(abi=artifact["abi"], bytecode=artifact["bytecode"])
    tx = factory.constructor(name, version).build_transaction(
        {"from": deployer.address, "chainId": w3.eth.chain_id}
    )
    receipt = _wait_ok(w3, _send(w3, deployer, tx), timeout)
    address = receipt["contractAddress"]
    assert address is not None
    return address


def mint(
    w3: Web3,
    token: str,
    owner_account: LocalAccount,
    to: str,
    amount: int,
    *,
    timeout: float = 30.0,
) -> HexStr:
    """Mint `amount` atomic units to `to` and wait for it. Returns the tx hash."""
    _require_int(amount, "amount")
    fn = token_contract(w3, token).functions.mint(Web3.to_checksum_address(to), amount)
    tx = fn.build_transaction({"from": owner_account.address, "chainId": w3.eth.chain_id})
    tx_hash = _send(w3, owner_account, tx)
    _wait_ok(w3, tx_hash, timeout)
    return tx_hash


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
        "from": Web3.to_checksum_address(authorization["from"]),
        "to": Web3.to_checksum_address(authorization["to"]),
        "value": _as_int(authorization["value"], "value"),
        "validAfter": _as_int(authorization["validAfter"], "validAfter"),
        "validBefore": _as_int(authorization["validBefore"], "validBefore"),
        "nonce": _nonce_bytes(authorization["nonce"]),
    }
    return encode_typed_data(
        full_message={
            "types": _AUTHORIZATION_TYPES,
            "primaryType": "TransferWithAuthorization",
            "domain": {
                "name": name,
                "version": version,
                "chainId": chain_id,
                "verifyingContract": Web3.to_checksum_address(token_address),
            },
            "message": message,
        }
    )


def sign_transfer_authorization(
    account: LocalAccount,
    *,
    token_address: str,
    chain_id: int,
    name: str,
    version: str,
    to: str,
    value: int,
    valid_after: int,
    valid_before: int,
    nonce: bytes | None = None,
) -> SignedAuthorization:
    """Sign an EIP-3009 authorization from `account` to `to`; a random nonce if none given."""
    for field, number in (("value", value), ("valid_after", valid_after),
                          ("valid_before", valid_before)):  # fmt: skip
        _require_int(number, field)
    authorization: Authorization = {
        "from": account.address,
        "to": Web3.to_checksum_address(to),
        "value": str(value),
        "validAfter": str(valid_after),
        "validBefore": str(valid_before),
        "nonce": HexBytes(secrets.token_bytes(32) if nonce is None else nonce).to_0x_hex(),
    }
    signable = transfer_authorization_typed_data(
        token_address=token_address,
        chain_id=chain_id,
        name=name,
        version=version,
        authorization=authorization,
    )
    signed = account.sign_message(signable)
    return {"signature": signed.signature.to_0x_hex(), "authorization": authorization}


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


def send_transfer_with_authorization(
    w3: Web3,
    token: str,
    sender_account: LocalAccount,
    authorization: Mapping[str, Any],
    signature: str | bytes,
    *,
    signature_form: Literal["vrs", "bytes"] = "vrs",
    nonce: int | None = None,
    gas: int | None = None,
) -> HexStr:
    """Broadcast the authorization, paying gas from `sender_account`. Returns the tx hash
    at once; the caller waits for the receipt (and reconciles if that wait fails)."""
    tx = build_transfer_with_authorization_tx(
        w3, token, sender_account.address, authorization, signature,
        signature_form=signature_form, gas=gas,
    )  # fmt: skip
    return _send(w3, sender_account, tx, nonce=nonce)


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
