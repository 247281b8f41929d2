"""A Safe Transaction Builder batch file of ERC-20 transfers, for sellers whose funds sit in a
Safe multisig: finance imports it in the Safe app's Transaction Builder, the owners sign and
execute it, and the payback watch finds each transfer on chain (payments.paybacks).

The format is the Transaction Builder's own (safe-global/safe-react-apps, apps/tx-builder:
`BatchFile` and its `meta.checksum`): keccak-256 of the file serialized with sorted keys and
`meta.name` set to null, computed before the checksum is added. The Builder recomputes it on
import; a file whose checksum does not match is flagged as changed since it was saved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from eth_utils import keccak, to_checksum_address

TX_BUILDER_VERSION = "1.18.2"  # the Builder version whose files we write (same shape)
TRANSFER_METHOD = {
    "inputs": [
        {"internalType": "address", "name": "to", "type": "address"},
        {"internalType": "uint256", "name": "value", "type": "uint256"},
    ],
    "name": "transfer",
    "payable": False,
}


@dataclass(frozen=True)
class SafeTransfer:
    destination: str
    amount: int  # atomic units


def _serialize(value: Any) -> str:
    # The Builder's serializeJSONObject: JSON.stringify of the sorted keys, then each value
    # followed by a comma; arrays comma-joined; scalars as JSON.stringify writes them.
    if isinstance(value, list):
        return "[" + ",".join(_serialize(item) for item in value) + "]"
    if isinstance(value, dict):
        keys = sorted(value)
        head = json.dumps(keys, separators=(",", ":"), ensure_ascii=False)
        return "{" + head + "".join(_serialize(value[key]) + "," for key in keys) + "}"
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def safe_batch_checksum(batch: dict[str, Any]) -> str:
    """The Transaction Builder's checksum of `batch` (its own `meta.checksum` left out)."""
    meta = {k: v for k, v in batch["meta"].items() if k != "checksum"}
    return "0x" + keccak(text=_serialize({**batch, "meta": {**meta, "name": None}})).hex()


def safe_transfer_batch(
    *,
    chain_id: int,
    token: str,
    transfers: list[SafeTransfer],
    safe_address: str,
    name: str,
    description: str,
    created_at_ms: int,
) -> dict[str, Any]:
    """One `transfer(to, value)` call on `token` per transfer, in order, with its checksum."""
    if any(t.amount <= 0 for t in transfers):
        raise ValueError("every transfer moves a positive amount")
    batch: dict[str, Any] = {
        "version": "1.0",
        "chainId": str(chain_id),
        "createdAt": created_at_ms,
        "meta": {
            "name": name,
            "description": description,
            "txBuilderVersion": TX_BUILDER_VERSION,
            "createdFromSafeAddress": to_checksum_address(safe_address) if safe_address else "",
            "createdFromOwnerAddress": "",
        },
        "transactions": [
            {
                "to": to_checksum_address(token),
                "value": "0",
                "data": None,
                "contractMethod": TRANSFER_METHOD,
                "contractInputsValues": {
                    "to": to_checksum_address(t.destination),
                    "value": str(t.amount),
                },
            }
            for t in transfers
        ],
    }
    batch["meta"]["checksum"] = safe_batch_checksum(batch)
    return batch
