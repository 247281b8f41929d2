"""A backlog of pending x402 settlements whose outcome is already on a local chain.

For the reconciliation test and benchmark: `landed` attempts whose transfers were mined
(reconciliation finds them confirmed) and `expired` ones whose window closed long ago with
the nonce unused (it finds them failed). The rows are written in bulk and the transfers sent
in JSON-RPC batches of raw transactions, so 10,000 take seconds, not minutes: the
authorizations are signed over the EIP-712 digest computed here once per domain, and the
relayer transactions locally with consecutive nonces, each key parsed once.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import requests
from django.utils import timezone
from eth_abi import encode as abi_encode
from eth_account._utils.signing import sign_transaction_dict
from eth_account.signers.local import LocalAccount
from eth_keys.datatypes import PrivateKey
from hexbytes import HexBytes
from web3 import Web3

from payments.chain.token import TWA_BYTES
from payments.models import PaymentAttempt
from purchases.models import Offering, Purchase, Quote

SEND_BATCH = 500
TRANSFER_GAS = 120_000  # transferWithAuthorization uses ~75-90k: fixed, so no estimate per call
_TRANSFER_TYPEHASH = Web3.keccak(
    text="TransferWithAuthorization(address from,address to,uint256 value,uint256 validAfter,"
    "uint256 validBefore,bytes32 nonce)"
)
_DOMAIN_TYPEHASH = Web3.keccak(
    text="EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)"
)
_SELECTOR = Web3.keccak(text=TWA_BYTES)[:4]


@dataclass(frozen=True)
class Backlog:
    attempt_ids: list[int]
    landed: int
    expired: int


def _domain_separator(token: str, chain_id: int, name: str, version: str) -> bytes:
    return Web3.keccak(
        abi_encode(
            ["bytes32", "bytes32", "bytes32", "uint256", "address"],
            [
                _DOMAIN_TYPEHASH,
                Web3.keccak(text=name),
                Web3.keccak(text=version),
                chain_id,
                Web3.to_checksum_address(token),
            ],
        )
    )


def _sign(key: PrivateKey, domain: bytes, fields: tuple[str, str, int, int, int, bytes]) -> str:
    struct = Web3.keccak(
        abi_encode(
            ["bytes32", "address", "address", "uint256", "uint256", "uint256", "bytes32"],
            [_TRANSFER_TYPEHASH, *fields],
        )
    )
    digest = bytes(Web3.keccak(b"\x19\x01" + domain + struct))
    # eth_keys directly, with the key parsed once: eth_account re-derives the public key on
    # every call, which doubles the cost of pure-Python ECDSA.
    signature = key.sign_msg_hash(digest)
    return (
        "0x"
        + (
            signature.r.to_bytes(32, "big")
            + signature.s.to_bytes(32, "big")
            + bytes([signature.v + 27])
        ).hex()
    )


def _rpc_batch(url: str, calls: list[tuple[str, list[Any]]]) -> list[Any]:
    body = [
        {"jsonrpc": "2.0", "id": i, "method": method, "params": params}
        for i, (method, params) in enumerate(calls)
    ]
    reply = requests.post(url, json=body, timeout=120).json()
    errors = [entry["error"] for entry in reply if entry.get("error")]
    if errors:
        raise RuntimeError(f"{len(errors)} calls failed, first: {errors[0]}")
    return [entry["result"] for entry in sorted(reply, key=lambda e: e["id"])]


def settlement_backlog_create(
    *,
    offering: Offering,
    rpc_url: str,
    chain_id: int,
    payer: LocalAccount,
    relayer: LocalAccount,
    landed: int,
    expired: int = 0,
    token_name: str = "USDC",  # noqa: S107 (the EIP-712 domain name, not a secret)
    token_version: str = "2",  # noqa: S107 (the EIP-712 domain version)
) -> Backlog:
    """Write `landed + expired` pending purchases and attempts; mine the `landed` transfers.

    The payer must hold `landed * offering.price` of the token and the relayer ETH for gas;
    the node must be mining. Every attempt was broadcast an hour ago, so it is due now.
    """
    now = timezone.now()
    w3 = Web3(Web3.HTTPProvider(rpc_url))
    domain = _domain_separator(offering.asset, chain_id, token_name, token_version)
    open_until = int(now.timestamp()) + 3600
    total = landed + expired
    quotes = Quote.objects.bulk_create(
        (
            Quote(
                offering=offering,
                quote_key=f"backlog-{secrets.token_hex(8)}",
                canonical_input={},
                input_hash="h",
                price=offering.price,
                asset=offering.asset,
                network=offering.network,
                pay_to=offering.pay_to,
                offering_version=1,
                expires_at=now + timedelta(minutes=15),
                public_id=f"qt_{secrets.token_hex(10)}",
            )
            for _ in range(total)
        ),
        batch_size=2000,
    )
    purchases = Purchase.objects.bulk_create(
        (
            Purchase(
                quote=quote,
                offering=offering,
                amount=offering.price,
                asset=offering.asset,
                network=offering.network,
                rail="x402",
                payer=payer.address.lower(),
                ref=f"pur_{secrets.token_hex(10)}",
            )
            for quote in quotes
        ),
        batch_size=2000,
    )
    Purchase.objects.filter(pk__in=[p.pk for p in purchases]).update(
        payment_state="settlement_pending"
    )
    relayer_nonce = w3.eth.get_transaction_count(relayer.address, "pending")
    gas_price = w3.eth.gas_price
    payer_key = PrivateKey(bytes(payer.key))
    relayer_key = PrivateKey(bytes(relayer.key))
    attempts: list[PaymentAttempt] = []
    raw_transactions: list[str] = []
    for index, purchase in enumerate(purchases):
        lands = index < landed
        valid_before = open_until if lands else 1_000  # long closed, nonce never used
        nonce = secrets.token_bytes(32)
        fields = (payer.address, offering.pay_to, offering.price, 0, valid_before, nonce)
        # Only a transfer that lands needs a real signature (pure-Python ECDSA is slow);
        # an expired one is never submitted.
        signature = _sign(payer_key, domain, fields) if lands else "0x" + "11" * 65
        wire = {
            "signature": signature,
            "authorization": {
                "from": payer.address,
                "to": offering.pay_to,
                "value": str(offering.price),
                "validAfter": "0",
                "validBefore": str(valid_before),
                "nonce": HexBytes(nonce).to_0x_hex(),
            },
        }
        tx_hash = None
        if lands:
            call = abi_encode(
                ["address", "address", "uint256", "uint256", "uint256", "bytes32", "bytes"],
                [*fields, HexBytes(signature)],
            )
            # The key parsed once (eth_account would re-derive its public key per call).
            _, _, _, encoded = sign_transaction_dict(
                relayer_key,
                {
                    "to": Web3.to_checksum_address(offering.asset),
                    "data": bytes(_SELECTOR + call),
                    "gas": TRANSFER_GAS,
                    "gasPrice": gas_price * 2,  # stays above a rising base fee
                    "nonce": relayer_nonce + len(raw_transactions),
                    "chainId": chain_id,
                    "value": 0,
                },
            )
            raw_transactions.append(HexBytes(encoded).to_0x_hex())
            tx_hash = Web3.keccak(encoded).to_0x_hex()
        attempts.append(
            PaymentAttempt(
                purchase=purchase,
                rail="x402",
                payer=payer.address.lower(),
                network=offering.network,
                asset=offering.asset,
                amount=offering.price,
                fingerprint="backlog",
                authorization=wire,
                authorization_nonce=HexBytes(nonce).to_0x_hex(),
                valid_before_at=datetime.fromtimestamp(valid_before, tz=UTC),
                broadcast_started_at=now - timedelta(hours=1),
                tx_hash=tx_hash,
                search_from_block=0,
            )
        )
    PaymentAttempt.objects.bulk_create(attempts, batch_size=2000)
    PaymentAttempt.objects.filter(pk__in=[a.pk for a in attempts]).update(
        state="settlement_pending"
    )
    hashes: list[str] = []
    # Into the pool with automine off, then mined a block at a time: with automine on, a
    # 500-transaction batch mining as it arrived sometimes left anvil answering nothing for
    # minutes (the bench's set-up timed out about one run in three).
    (automine,) = _rpc_batch(rpc_url, [("anvil_getAutomine", [])])
    _rpc_batch(rpc_url, [("evm_setAutomine", [False])])
    try:
        for start in range(0, len(raw_transactions), SEND_BATCH):
            chunk = raw_transactions[start : start + SEND_BATCH]
            hashes += _rpc_batch(rpc_url, [("eth_sendRawTransaction", [raw]) for raw in chunk])
        for _ in range(len(raw_transactions)):  # bound: at least one transfer per block
            (pool,) = _rpc_batch(rpc_url, [("txpool_status", [])])
            if int(pool["pending"], 16) == 0:
                break
            _rpc_batch(rpc_url, [("evm_mine", [])])
    finally:
        _rpc_batch(rpc_url, [("evm_setAutomine", [automine])])
    _wait_mined(rpc_url, hashes)
    return Backlog([a.pk for a in attempts], landed, expired)


def _wait_mined(rpc_url: str, hashes: list[str], timeout: float = 60.0) -> None:
    """Every transfer mined and successful before reconciliation looks."""
    deadline = time.monotonic() + timeout
    waiting = hashes
    while waiting:
        still: list[str] = []
        for start in range(0, len(waiting), SEND_BATCH):
            chunk = waiting[start : start + SEND_BATCH]
            receipts = _rpc_batch(rpc_url, [("eth_getTransactionReceipt", [h]) for h in chunk])
            for tx_hash, receipt in zip(chunk, receipts, strict=True):
                if receipt is None:
                    still.append(tx_hash)
                elif int(receipt["status"], 16) != 1:
                    raise RuntimeError(f"backlog transfer {tx_hash} reverted")
        if still and time.monotonic() > deadline:
            raise RuntimeError(f"{len(still)} backlog transfers not mined in {timeout} s")
        if still:
            # A batch may reach the pool out of nonce order; automine then leaves the later
            # ones waiting for a block that has no reason to come: mine one.
            _rpc_batch(rpc_url, [("evm_mine", [])])
            time.sleep(0.05)
        waiting = still
