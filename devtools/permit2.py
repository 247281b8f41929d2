"""Permit2 and the x402 `upto` proxy on a local chain, and a buyer's Permit2 approval.

`upto` (issue 34, part 2) settles through two contracts at fixed addresses that the x402 SDKs
name (`x402.mechanisms.evm.constants`): Uniswap's Permit2, which checks the buyer's signed
ceiling, and the x402 upto proxy, the spender that signature names. Neither exists on a fresh
anvil, so set-up places both with `anvil_setCode` (docs/chain.md):

- Permit2's runtime is read from the installed npm package `@uniswap/v4-periphery` 1.0.3
  (MIT, as Permit2 itself): bytes 484..9636 of `DeployPermit2`'s deployed code are the
  runtime its `vm.etch` places. Nothing of it is in this repository; its SHA-256 pins the
  version. It was built on chain 31337 at another address, and caches that domain separator
  as an immutable, returned whenever block.chainid is 31337: on 31337 that 32-byte constant is
  replaced with the separator for the canonical address. On other chain ids Permit2 computes
  it from block.chainid and its own address, so nothing is patched.
- The proxy is ours: contracts/X402UptoPermit2Proxy.sol, storage-free, compiled to
  devtools/artifacts/X402UptoPermit2Proxy.json (node scripts/compile_contracts.js).

Demo and test tooling only: production never imports it (an import-linter contract).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol, cast

from eth_abi import encode as abi_encode
from eth_account.signers.local import LocalAccount
from eth_typing import ChecksumAddress, HexStr
from hexbytes import HexBytes
from web3 import Web3
from web3.types import TxParams
from x402.mechanisms.evm.constants import (
    PERMIT2_ADDRESS,
    UPTO_PERMIT2_WITNESS_TYPES,
    X402_UPTO_PERMIT2_PROXY_ADDRESS,
)

from devtools.anvil import REPO_ROOT
from devtools.test_token import _send, _wait_ok
from payments.chain.token import token_contract

PERMIT2 = Web3.to_checksum_address(PERMIT2_ADDRESS)
UPTO_PROXY = Web3.to_checksum_address(X402_UPTO_PERMIT2_PROXY_ADDRESS)
MAX_UINT256 = 2**256 - 1

PERMIT2_PACKAGE = REPO_ROOT / "node_modules" / "@uniswap" / "v4-periphery"
PERMIT2_ARTIFACT = PERMIT2_PACKAGE / "foundry-out" / "DeployPermit2.sol" / "DeployPermit2.json"
PERMIT2_RUNTIME = slice(484, 9636)
# Of the 9,152 bytes as shipped (before any patch): another package version fails here, loudly.
PERMIT2_RUNTIME_SHA256 = "60f506dfaba70e6353b90771b0d9e8f91ee6b1e3c4bd42a66e8085426ade2886"
PROXY_ARTIFACT = Path(__file__).resolve().parent / "artifacts" / "X402UptoPermit2Proxy.json"

# Permit2's EIP-712 domain has no version: (name, chainId, verifyingContract).
_DOMAIN_TYPEHASH = Web3.keccak(
    text="EIP712Domain(string name,uint256 chainId,address verifyingContract)"
)
_PERMIT2_NAME_HASH = Web3.keccak(text="Permit2")
_DOMAIN_SEPARATOR_SELECTOR = Web3.keccak(text="DOMAIN_SEPARATOR()")[:4]
# DOMAIN_SEPARATOR(): CHAINID, PUSH32 <cached chain id>, SUB, PUSH2 <dest>, JUMPI,
# PUSH32 <cached separator>: the two immutables, where the compiler inlined them.
_CACHED_DOMAIN = re.compile(rb"\x46\x7f(.{32})\x03\x61..\x57\x7f(.{32})", re.DOTALL)


class Permit2SetupError(RuntimeError):
    """The package is missing or not the pinned version, or the chain reads back wrong."""


class ChainControl(Protocol):
    """What set-up needs of a node: devtools.anvil.AnvilNode or AnvilRpc."""

    def w3(self) -> Web3: ...

    def rpc(self, method: str, params: Any = ()) -> Any: ...


@dataclass(frozen=True)
class CachedDomain:
    """Permit2's immutables as compiled: the chain id and the separator it cached, and where
    the separator's 32 bytes sit in the runtime."""

    chain_id: int
    separator: bytes
    offset: int


def permit2_domain_separator(chain_id: int, address: str = PERMIT2) -> bytes:
    """The separator Permit2 at `address` signs under on `chain_id` (what buyers sign)."""
    return Web3.keccak(
        abi_encode(
            ["bytes32", "bytes32", "uint256", "address"],
            [_DOMAIN_TYPEHASH, _PERMIT2_NAME_HASH, chain_id, Web3.to_checksum_address(address)],
        )
    )


@cache
def permit2_runtime() -> bytes:
    """Permit2's runtime as the package ships it, unpatched."""
    try:
        artifact = json.loads(PERMIT2_ARTIFACT.read_text())
    except FileNotFoundError:
        raise Permit2SetupError(
            f"{PERMIT2_ARTIFACT} is missing: run `npm ci` (package.json pins "
            "@uniswap/v4-periphery 1.0.3)"
        ) from None
    runtime = bytes(HexBytes(artifact["deployedBytecode"]["object"]))[PERMIT2_RUNTIME]
    digest = hashlib.sha256(runtime).hexdigest()
    if digest != PERMIT2_RUNTIME_SHA256:
        raise Permit2SetupError(
            f"Permit2's runtime in {PERMIT2_ARTIFACT} hashes to {digest}, not the pinned "
            f"{PERMIT2_RUNTIME_SHA256}: not @uniswap/v4-periphery 1.0.3?"
        )
    return runtime


def cached_domain(runtime: bytes) -> CachedDomain:
    """Where Permit2 keeps the chain id and separator it was built with (exactly one place)."""
    found = list(_CACHED_DOMAIN.finditer(runtime))
    if len(found) != 1:
        raise Permit2SetupError(f"expected one cached EIP-712 domain in Permit2, found {found}")
    match = found[0]
    return CachedDomain(int.from_bytes(match[1], "big"), match[2], match.start(2))


def permit2_runtime_for(chain_id: int) -> bytes:
    """The runtime to place on `chain_id`: on the chain it was built for, its cached separator
    replaced with the canonical address's; elsewhere as shipped."""
    runtime = permit2_runtime()
    cached = cached_domain(runtime)
    if cached.chain_id != chain_id:
        return runtime
    start, end = cached.offset, cached.offset + 32
    return runtime[:start] + permit2_domain_separator(chain_id) + runtime[end:]


@cache
def proxy_runtime() -> bytes:
    artifact: dict[str, Any] = json.loads(PROXY_ARTIFACT.read_text())
    return bytes(HexBytes(artifact["deployedBytecode"]))


def proxy_abi() -> list[dict[str, Any]]:
    abi: list[dict[str, Any]] = json.loads(PROXY_ARTIFACT.read_text())["abi"]
    return abi


def read_domain_separator(w3: Web3, address: str = PERMIT2) -> bytes:
    """Permit2's DOMAIN_SEPARATOR() as the chain answers it."""
    call = {"to": Web3.to_checksum_address(address), "data": _DOMAIN_SEPARATOR_SELECTOR}
    return bytes(w3.eth.call(cast(TxParams, call)))


def place_upto_contracts(anvil: ChainControl) -> dict[str, str]:
    """Put Permit2 and the upto proxy at their canonical addresses (again, harmlessly, if
    they are there). Raises Permit2SetupError unless Permit2 then answers the separator a
    buyer signs under on this chain."""
    w3 = anvil.w3()
    chain_id = w3.eth.chain_id
    anvil.rpc("anvil_setCode", [PERMIT2, "0x" + permit2_runtime_for(chain_id).hex()])
    anvil.rpc("anvil_setCode", [UPTO_PROXY, "0x" + proxy_runtime().hex()])
    expected = permit2_domain_separator(chain_id)
    answered = read_domain_separator(w3)
    if answered != expected:
        raise Permit2SetupError(
            f"Permit2 on chain {chain_id} answers DOMAIN_SEPARATOR {answered.hex()}, "
            f"not {expected.hex()}: every signature would fail"
        )
    return {"permit2": PERMIT2, "upto_proxy": UPTO_PROXY, "domain_separator": "0x" + expected.hex()}


def permit2_allowance(w3: Web3, token: str, owner: str) -> int:
    """What Permit2 may move of `owner`'s `token` (the ERC-20 allowance)."""
    allowance: int = (
        token_contract(w3, token)
        .functions.allowance(Web3.to_checksum_address(owner), PERMIT2)
        .call()
    )
    return allowance


def approve_permit2(
    w3: Web3,
    token: str,
    owner: LocalAccount,
    amount: int = MAX_UINT256,
    *,
    timeout: float = 30.0,
) -> HexStr:
    """The buyer's one-time step before any `upto` payment: `approve(Permit2, amount)` on the
    token, sent and paid for by the buyer (the stock x402 clients never send it). Waits for
    the receipt; returns the tx hash."""
    call = token_contract(w3, token).functions.approve(PERMIT2, amount)
    tx = call.build_transaction({"from": owner.address, "chainId": w3.eth.chain_id})
    tx_hash = _send(w3, owner, tx)
    _wait_ok(w3, tx_hash, timeout)
    return tx_hash


def approve_permit2_for(
    w3: Web3, token: str, owners: list[LocalAccount], amount: int = MAX_UINT256
) -> list[ChecksumAddress]:
    """Approve Permit2 for each wallet (the demo's and the tests' buyers at set-up)."""
    for owner in owners:
        approve_permit2(w3, token, owner, amount)
    return [owner.address for owner in owners]


# --- settling and signing by hand (tests of the proxy's own checks) --------------------------


def upto_settle_args(payload: dict[str, Any], amount: int) -> tuple[Any, ...]:
    """The proxy's `settle` arguments for an x402 upto payload (`{permit2Authorization,
    signature}`, as the SDK client builds it) and the amount to charge."""
    auth = payload["permit2Authorization"]
    permit = (
        (Web3.to_checksum_address(auth["permitted"]["token"]), int(auth["permitted"]["amount"])),
        int(auth["nonce"]),
        int(auth["deadline"]),
    )
    witness = auth["witness"]
    return (
        permit,
        amount,
        Web3.to_checksum_address(auth["from"]),
        (
            Web3.to_checksum_address(witness["to"]),
            Web3.to_checksum_address(witness["facilitator"]),
            int(witness["validAfter"]),
        ),
        bytes(HexBytes(payload["signature"])),
    )


def send_upto_settle(
    w3: Web3,
    sender: LocalAccount,
    payload: dict[str, Any],
    amount: int,
    *,
    gas: int | None = None,
) -> HexStr:
    """Call the proxy's `settle` from `sender`, whoever that is. A fixed `gas` skips the
    estimate, so a settlement that must revert is still mined (and seen to revert). Returns
    the tx hash without waiting."""
    proxy = w3.eth.contract(address=UPTO_PROXY, abi=proxy_abi())
    params: dict[str, Any] = {"from": sender.address, "chainId": w3.eth.chain_id}
    if gas is not None:
        params["gas"] = gas
    tx = proxy.functions.settle(*upto_settle_args(payload, amount)).build_transaction(
        cast(TxParams, params)
    )
    return _send(w3, sender, tx)


def sign_upto_permit(
    account: LocalAccount,
    *,
    chain_id: int,
    token: str,
    ceiling: int,
    pay_to: str,
    facilitator: str,
    deadline: int,
    valid_after: int = 0,
    nonce: int | None = None,
) -> dict[str, Any]:
    """An upto payload signed without the SDK client, for what it never signs (a validAfter
    in the future, a chosen nonce): the same EIP-712 message, from the SDK's own types."""
    witness = {
        "to": Web3.to_checksum_address(pay_to),
        "facilitator": Web3.to_checksum_address(facilitator),
    }
    message: dict[str, Any] = {
        "permitted": {"token": Web3.to_checksum_address(token), "amount": ceiling},
        "spender": UPTO_PROXY,
        "nonce": secrets.randbits(256) if nonce is None else nonce,
        "deadline": deadline,
        "witness": {**witness, "validAfter": valid_after},
    }
    signed = account.sign_typed_data(
        domain_data={"name": "Permit2", "chainId": chain_id, "verifyingContract": PERMIT2},
        message_types=UPTO_PERMIT2_WITNESS_TYPES,
        message_data=message,
    )
    return {
        "permit2Authorization": {
            "from": account.address,
            "permitted": {"token": message["permitted"]["token"], "amount": str(ceiling)},
            "spender": UPTO_PROXY,
            "nonce": str(message["nonce"]),
            "deadline": str(deadline),
            "witness": {**witness, "validAfter": str(valid_after)},
        },
        "signature": signed.signature.to_0x_hex(),
    }
