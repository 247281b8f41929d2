"""The EIP-3009 test USDC for the demo and the tests: deploy it, mint, sign authorizations
like a buyer, and broadcast them like any third party. Never imported by production code
(an import-linter contract in `make lint`); production reads the token through
payments.chain.token."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any, Literal, TypedDict, cast

from eth_account.signers.local import LocalAccount
from eth_typing import ChecksumAddress, HexStr
from hexbytes import HexBytes
from web3 import Web3
from web3.types import TxParams, TxReceipt

from payments.chain.token import (
    Authorization,
    _require_int,
    build_transfer_with_authorization_tx,
    load_artifact,
    token_contract,
    transfer_authorization_typed_data,
)


class SignedAuthorization(TypedDict):
    """The `payload` of an x402 "exact" EVM PaymentPayload."""

    signature: str
    authorization: Authorization


class ChainTxError(RuntimeError):
    """A transaction was mined but reverted."""


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


def cancel_authorization(
    w3: Web3, token: str, authorizer: LocalAccount, nonce: str, *, timeout: float = 30.0
) -> HexStr:
    """The authorizer cancels its unused authorization `nonce` (EIP-3009 cancelAuthorization,
    as on Circle's USDC), signing it and paying the gas itself; waits for the receipt."""
    contract = token_contract(w3, token)
    domain = {
        "name": contract.functions.name().call(),
        "version": contract.functions.version().call(),
        "chainId": w3.eth.chain_id,
        "verifyingContract": Web3.to_checksum_address(token),
    }
    types = {"CancelAuthorization": [
        {"name": "authorizer", "type": "address"}, {"name": "nonce", "type": "bytes32"},
    ]}  # fmt: skip
    message = {"authorizer": authorizer.address, "nonce": HexBytes(nonce)}
    signed = authorizer.sign_typed_data(domain, types, message)
    call = contract.functions.cancelAuthorization(
        authorizer.address, HexBytes(nonce), signed.signature
    )
    tx = call.build_transaction(cast(TxParams, {"from": authorizer.address}))
    tx_hash = _send(w3, authorizer, tx)
    _wait_ok(w3, tx_hash, timeout)
    return tx_hash


# TestUSDC keeps its EIP-712 `name` and `version` in storage slots 0 and 1 (the first two
# state variables; `owner` is immutable, so it lives in the runtime code): code copied alone
# to another address reads "" for both and signs under an empty domain.
NAME_SLOT, VERSION_SLOT = 0, 1


def short_string_slot(text: str) -> str:
    """A Solidity `string` of at most 31 bytes as its storage word: the bytes left-aligned,
    the length times two in the last byte."""
    raw = text.encode()
    if len(raw) > 31:
        raise ValueError(f"{text!r}: a long string does not fit one slot")
    return "0x" + (raw.ljust(31, b"\0") + bytes([len(raw) * 2])).hex()


def place_test_usdc_at(
    anvil: Any, address: str, deployer: LocalAccount, *, name: str, version: str
) -> dict[str, str]:
    """Put TestUSDC at `address` (e.g. Base's USDC on a chain impersonating Base): deploy it
    from `deployer` (its only minter, immutable in the code), copy the runtime code there
    (`anvil_setCode`) and write `name`/`version` into slots 0-1 (`anvil_setStorageAt`). Read
    back: the token's name, version and DOMAIN_SEPARATOR, which must equal the EIP-712 domain
    (name, version, chain id, address) a buyer signs under. Raises ChainTxError otherwise."""
    w3 = anvil.w3()
    deployed = deploy_test_usdc(w3, deployer, name, version)
    target = Web3.to_checksum_address(address)
    anvil.rpc("anvil_setCode", [target, w3.eth.get_code(deployed).to_0x_hex()])
    for slot, text in ((NAME_SLOT, name), (VERSION_SLOT, version)):
        anvil.rpc("anvil_setStorageAt", [target, hex(slot), short_string_slot(text)])
    token = token_contract(w3, target)
    read = {
        "name": token.functions.name().call(),
        "version": token.functions.version().call(),
        "domain_separator": HexBytes(token.functions.DOMAIN_SEPARATOR().call()).to_0x_hex(),
    }
    expected = HexBytes(
        Web3.keccak(
            w3.codec.encode(
                ["bytes32", "bytes32", "bytes32", "uint256", "address"],
                [
                    Web3.keccak(
                        text="EIP712Domain(string name,string version,uint256 chainId,"
                        "address verifyingContract)"
                    ),
                    Web3.keccak(text=name),
                    Web3.keccak(text=version),
                    w3.eth.chain_id,
                    target,
                ],
            )
        )
    ).to_0x_hex()
    if (read["name"], read["version"], read["domain_separator"]) != (name, version, expected):
        raise ChainTxError(f"the token at {target} reads {read}, not ({name}, {version})")
    return {**read, "address": target, "deployed_at": deployed}
