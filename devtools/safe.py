"""Safe's own contracts on the local chain, and a Transaction Builder file executed as the Safe
app does: the test stand-in for the seller's multisig (never imported by production).

The contracts are Safe's published build (npm `@safe-global/safe-contracts`, its hardhat
artifacts with their bytecode), deployed as they are: the Safe singleton, the proxy factory,
MultiSendCallOnly and the compatibility fallback handler. A Safe is a proxy set up with its
owners and threshold. A batch of several calls runs as the Safe app runs it: one
`execTransaction` that delegatecalls MultiSendCallOnly with the packed calls, signed by the
owners (EIP-712 SafeTx hash, signatures ordered by owner address); a batch of one is one
plain call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

from eth_abi import encode as abi_encode
from eth_account.signers.local import LocalAccount
from eth_typing import ChecksumAddress, HexStr
from web3 import Web3
from web3.contract import Contract
from web3.logs import DISCARD
from web3.types import TxParams, TxReceipt

from devtools.anvil import REPO_ROOT

ARTIFACTS = REPO_ROOT / "node_modules" / "@safe-global" / "safe-contracts" / "build" / "artifacts"
ARTIFACT_PATHS = {
    "Safe": "contracts/Safe.sol/Safe.json",
    "SafeProxyFactory": "contracts/proxies/SafeProxyFactory.sol/SafeProxyFactory.json",
    "MultiSendCallOnly": "contracts/libraries/MultiSendCallOnly.sol/MultiSendCallOnly.json",
    "CompatibilityFallbackHandler": (
        "contracts/handler/CompatibilityFallbackHandler.sol/CompatibilityFallbackHandler.json"
    ),
}
ZERO = "0x0000000000000000000000000000000000000000"
CALL, DELEGATECALL = 0, 1
EXEC_GAS = 1_500_000  # fixed: a failing batch is still mined (and seen to revert)


@lru_cache(maxsize=8)
def safe_artifact(name: str) -> dict[str, Any]:
    """Safe's compiled contract `name` (abi, bytecode) from the npm package."""
    artifact: dict[str, Any] = json.loads((ARTIFACTS / ARTIFACT_PATHS[name]).read_text())
    return artifact


def _send(w3: Web3, sender: LocalAccount, tx: TxParams) -> TxReceipt:
    tx = {**tx, "nonce": w3.eth.get_transaction_count(sender.address, "pending")}
    signed = sender.sign_transaction(cast(dict[str, Any], tx))
    tx_hash = w3.eth.send_raw_transaction(signed.raw_transaction)
    receipt = w3.eth.wait_for_transaction_receipt(tx_hash, timeout=30, poll_latency=0.01)
    if receipt["status"] != 1:
        raise RuntimeError(f"transaction {tx_hash.to_0x_hex()} reverted")
    return receipt


def _deploy(w3: Web3, deployer: LocalAccount, name: str) -> ChecksumAddress:
    artifact = safe_artifact(name)
    factory = w3.eth.contract(abi=artifact["abi"], bytecode=artifact["bytecode"])
    tx = factory.constructor().build_transaction(
        {"from": deployer.address, "chainId": w3.eth.chain_id}
    )
    address = _send(w3, deployer, tx)["contractAddress"]
    assert address is not None
    return address


@dataclass(frozen=True)
class SafeDeployment:
    singleton: ChecksumAddress
    proxy_factory: ChecksumAddress
    multi_send_call_only: ChecksumAddress
    fallback_handler: ChecksumAddress


def safe_deploy(w3: Web3, deployer: LocalAccount) -> SafeDeployment:
    """Deploy Safe's singleton, proxy factory, MultiSendCallOnly and fallback handler."""
    return SafeDeployment(*(_deploy(w3, deployer, name) for name in ARTIFACT_PATHS))


def safe_contract(w3: Web3, address: str) -> Contract:
    return w3.eth.contract(
        address=Web3.to_checksum_address(address), abi=safe_artifact("Safe")["abi"]
    )


def safe_create(
    w3: Web3,
    deployment: SafeDeployment,
    creator: LocalAccount,
    *,
    owners: list[str],
    threshold: int,
    salt: int = 0,
) -> ChecksumAddress:
    """A new Safe (a proxy of the singleton) with `owners` and `threshold`."""
    singleton = safe_contract(w3, deployment.singleton)
    initializer = singleton.encode_abi(
        "setup",
        [
            [Web3.to_checksum_address(o) for o in owners],
            threshold,
            ZERO,
            b"",
            deployment.fallback_handler,
            ZERO,
            0,
            ZERO,
        ],
    )
    factory = w3.eth.contract(
        address=deployment.proxy_factory, abi=safe_artifact("SafeProxyFactory")["abi"]
    )
    call = factory.functions.createProxyWithNonce(deployment.singleton, initializer, salt)
    tx = call.build_transaction({"from": creator.address, "chainId": w3.eth.chain_id})
    receipt = _send(w3, creator, tx)
    # The proxy's own SafeSetup log is another contract's event: skipped, not warned about.
    (created,) = factory.events.ProxyCreation().process_receipt(receipt, errors=DISCARD)
    return Web3.to_checksum_address(created["args"]["proxy"])


def builder_calldata(transaction: dict[str, Any]) -> bytes:
    """A Transaction Builder transaction's calldata, as the Safe app encodes it: its `data`
    when given, else `contractMethod` applied to `contractInputsValues`."""
    if transaction.get("data"):
        return bytes.fromhex(str(transaction["data"]).removeprefix("0x"))
    method = transaction.get("contractMethod")
    if method is None:
        return b""
    types = [i["type"] for i in method["inputs"]]
    values = transaction["contractInputsValues"]
    args = [
        Web3.to_checksum_address(values[i["name"]]) if i["type"] == "address"
        else int(values[i["name"]]) if i["type"].startswith(("uint", "int"))
        else values[i["name"]]
        for i in method["inputs"]
    ]  # fmt: skip
    selector = Web3.keccak(text=f"{method['name']}({','.join(types)})")[:4]
    return bytes(selector) + abi_encode(types, args)


def multi_send_packed(calls: list[tuple[str, int, bytes]]) -> bytes:
    """MultiSend's packed transactions: operation (1 byte, a call), to (20), value (32),
    data length (32), data; one after another."""
    packed = b""
    for to, value, data in calls:
        packed += (
            CALL.to_bytes(1, "big")
            + bytes.fromhex(Web3.to_checksum_address(to)[2:])
            + value.to_bytes(32, "big")
            + len(data).to_bytes(32, "big")
            + data
        )
    return packed


def safe_execute_batch(
    w3: Web3,
    deployment: SafeDeployment,
    safe: str,
    batch: dict[str, Any],
    *,
    signers: list[LocalAccount],
    executor: LocalAccount,
) -> TxReceipt:
    """Execute a Transaction Builder file as the Safe app does, signed by `signers` (owners,
    at least the threshold) and sent by `executor` (who pays the gas). Returns the receipt of
    the `execTransaction` (its status says whether the Safe ran the batch)."""
    calls = [(t["to"], int(t["value"]), builder_calldata(t)) for t in batch["transactions"]]
    if len(calls) == 1:
        to, value, data, operation = *calls[0], CALL
    else:
        multi_send = w3.eth.contract(
            address=deployment.multi_send_call_only, abi=safe_artifact("MultiSendCallOnly")["abi"]
        )
        packed = multi_send_packed(calls)
        to, value, operation = deployment.multi_send_call_only, 0, DELEGATECALL
        data = bytes.fromhex(multi_send.encode_abi("multiSend", [packed])[2:])
    contract = safe_contract(w3, safe)
    nonce = contract.functions.nonce().call()
    tx_args = [Web3.to_checksum_address(to), value, data, operation, 0, 0, 0, ZERO, ZERO]
    safe_tx_hash = contract.functions.getTransactionHash(*tx_args, nonce).call()
    signatures = b""
    for signer in sorted(signers, key=lambda s: int(s.address, 16)):
        signed = signer.unsafe_sign_hash(safe_tx_hash)
        signatures += signed.r.to_bytes(32, "big") + signed.s.to_bytes(32, "big")
        signatures += signed.v.to_bytes(1, "big")
    tx = contract.functions.execTransaction(*tx_args, signatures).build_transaction(
        {"from": executor.address, "chainId": w3.eth.chain_id, "gas": EXEC_GAS}
    )
    tx = {**tx, "nonce": w3.eth.get_transaction_count(executor.address, "pending")}
    signed_tx = executor.sign_transaction(cast(dict[str, Any], tx))
    tx_hash = w3.eth.send_raw_transaction(signed_tx.raw_transaction)
    return w3.eth.wait_for_transaction_receipt(HexStr(tx_hash.to_0x_hex()), timeout=30)
