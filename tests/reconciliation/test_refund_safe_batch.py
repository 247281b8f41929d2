"""Refunds paid from a Safe: the refund list exports a Safe Transaction Builder batch of token
transfers (issue 21 §2), in the Builder's own format and checksum; the file decodes back to
exactly the refunds owed (executed by a real Safe in test_refund_safe_execute.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from eth_abi import decode as abi_decode
from eth_abi import encode as abi_encode
from web3 import Web3

from backoffice.roles import roles_ensure
from payments.chain.safe_batch import safe_batch_checksum
from payments.models import ExportBatch, Refund
from tests.reconciliation.test_refund_paybacks import fund_seller, owed_refund
from tests.x402.e2e import PRICE, X402World

pytestmark = [pytest.mark.postgres]

# A batch the Safe Transaction Builder (1.18.2) exported, with the checksum it computed
# (published in safe-global's safe-cli-nodejs, TRANSACTION_BUILDER_FORMAT_ANALYSIS.md).
SAFE_EXPORTED: dict[str, Any] = {
    "version": "1.0",
    "chainId": "1",
    "createdAt": 1761326849944,
    "meta": {
        "name": "Transactions Batch",
        "description": "",
        "txBuilderVersion": "1.18.2",
        "createdFromSafeAddress": "0xA77DE01e157f9f57C7c4A326eeE9C4874D0598b6",
        "createdFromOwnerAddress": "",
        "checksum": "0x8b5032f716845c8b08bab3d63dbd9ba92e056f3557793cd041e59b84e16aa989",
    },
    "transactions": [
        {
            "to": "0xA0b86991c6218b36c1d19D4a2e9Eb0cE3606eB48",
            "value": "0",
            "data": None,
            "contractMethod": {
                "inputs": [
                    {"internalType": "address", "name": "spender", "type": "address"},
                    {"internalType": "uint256", "name": "value", "type": "uint256"},
                ],
                "name": "approve",
                "payable": False,
            },
            "contractInputsValues": {
                "spender": "0x474e5Ded6b5D078163BFB8F6dBa355C3aA5478C8",
                "value": "100000000000",
            },
        }
    ],
}


def test_the_checksum_is_the_transaction_builders() -> None:
    assert safe_batch_checksum(SAFE_EXPORTED) == SAFE_EXPORTED["meta"]["checksum"]
    changed = json.loads(json.dumps(SAFE_EXPORTED))
    changed["transactions"][0]["contractInputsValues"]["value"] = "100000000001"
    assert safe_batch_checksum(changed) != SAFE_EXPORTED["meta"]["checksum"]


def _calldata(transaction: dict[str, Any]) -> bytes:
    """What the Safe app encodes from the Builder's contractMethod and input values."""
    method = transaction["contractMethod"]
    types = [i["type"] for i in method["inputs"]]
    values = transaction["contractInputsValues"]
    args = [
        values[i["name"]] if i["type"] == "address" else int(values[i["name"]])
        for i in method["inputs"]
    ]
    selector = Web3.keccak(text=f"{method['name']}({','.join(types)})")[:4]
    return bytes(selector) + abi_encode(types, args)


@pytest.mark.django_db
def test_finance_exports_a_safe_batch_that_decodes_to_the_refunds_owed(
    x402_world: X402World, settings: Any
) -> None:
    world = x402_world
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "REFUND_SAFE": world.seller.address}
    fund_seller(world)
    first = owed_refund(world, world.payers[0])
    second = owed_refund(world, world.payers[1], amount=PRICE // 5)  # a partial refund
    user = User.objects.create_user(username="fay-finance", is_staff=True)
    user.groups.add(roles_ensure()["finance"])
    finance = Client()
    finance.force_login(user)
    response = finance.post(
        reverse("admin:payments_refund_changelist"),
        {"action": "export_safe_batch", "_selected_action": [first.pk, second.pk], "index": 0},
    )
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    batch = json.loads(response.content)
    assert (batch["version"], batch["chainId"]) == ("1.0", "31337")
    assert batch["meta"]["createdFromSafeAddress"] == world.seller.address
    assert safe_batch_checksum(batch) == batch["meta"]["checksum"]
    decoded = []
    for transaction in batch["transactions"]:
        data = _calldata(transaction)
        assert data[:4] == bytes.fromhex("a9059cbb")  # ERC-20 transfer(address,uint256)
        destination, amount = abi_decode(["address", "uint256"], data[4:])
        decoded.append((transaction["to"], transaction["value"], destination, amount))
    assert decoded == [
        (world.token, "0", world.payers[0].address.lower(), PRICE),
        (world.token, "0", world.payers[1].address.lower(), PRICE // 5),
    ]
    record = ExportBatch.objects.get(kind="safe_batch")
    assert (record.row_count, record.filters["refunds"]) == (2, [first.pk, second.pk])
    assert record.filters["safe"] == world.seller.address.lower()  # which Safe pays them

    # Its execution by a real Safe, and the refunds closing by themselves once it is on
    # chain: tests/reconciliation/test_refund_safe_execute.py.


@pytest.mark.django_db
def test_a_safe_batch_runs_on_one_network(x402_world: X402World) -> None:
    world = x402_world
    first = owed_refund(world, world.payers[0])
    other = owed_refund(world, world.payers[1])
    Refund.objects.filter(pk=other.pk).update(network="eip155:84532")
    user = User.objects.create_user(username="fay-finance", is_staff=True)
    user.groups.add(roles_ensure()["finance"])
    finance = Client()
    finance.force_login(user)
    response = finance.post(
        reverse("admin:payments_refund_changelist"),
        {"action": "export_safe_batch", "_selected_action": [first.pk, other.pk], "index": 0},
        follow=True,
    )
    assert "a Safe batch runs on one chain" in response.content.decode()
    assert not ExportBatch.objects.exists()
