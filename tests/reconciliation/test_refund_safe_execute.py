"""A refund batch paid from a real Safe on the local chain (issue 21 §2, §3).

Safe's own contracts (npm @safe-global/safe-contracts, deployed from their published
bytecode) make a 1-of-1 Safe owned by a generated key, funded with the test USDC. Finance
exports the owed refunds as a Transaction Builder file; the file decodes back to exactly
those transfers; the owner executes it as the Safe app does (execTransaction delegatecalling
MultiSendCallOnly); the destinations receive exactly what was owed. The payback watch (the
beat's task, run for real) then closes exactly the exported refunds once their transfers
are final, each on its own transfer log, while a hand payback from another seller wallet is
only offered as a match. The period's books count the batch's gas once, as a cost.
"""

from __future__ import annotations

import csv
import io
import json
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from eth_abi import decode as abi_decode

from backoffice.books import Period, books_daily
from backoffice.books_export import books_export
from backoffice.roles import roles_ensure
from devtools.safe import (
    builder_calldata,
    safe_contract,
    safe_create,
    safe_deploy,
    safe_execute_batch,
)
from devtools.test_token import mint
from payments.chain.safe_batch import safe_batch_checksum
from payments.chain.token import balance_of
from payments.models import Refund
from purchases.tasks import refund_paybacks_watch_task
from tests.fixtures.anvil import new_account
from tests.reconciliation.test_refund_paybacks import fund_seller, owed_refund, send_transfer
from tests.x402.e2e import NETWORK, PRICE, X402World

pytestmark = [pytest.mark.postgres]

FINALITY_DEPTH = 3


def _finance() -> Client:
    user = User.objects.create_user(username="fay-finance", is_staff=True)
    user.groups.add(roles_ensure()["finance"])
    client = Client()
    client.force_login(user)
    return client


def _watch() -> dict[str, int]:
    """One run of the beat's payback watch task, as the worker runs it."""
    result: dict[str, int] = refund_paybacks_watch_task.apply().get()
    return result


@pytest.mark.django_db
def test_an_executed_safe_batch_pays_and_closes_exactly_its_refunds(
    x402_world: X402World, settings: Any
) -> None:
    world = x402_world
    owner = new_account(world.node)
    deployment = safe_deploy(world.w3, world.deployer)
    safe = safe_create(world.w3, deployment, owner, owners=[owner.address], threshold=1)
    assert safe_contract(world.w3, safe).functions.getOwners().call() == [owner.address]
    mint(world.w3, world.token, world.deployer, safe, 10 * PRICE)
    # The owner who executes pays the gas: listed as a seller wallet, the books count it.
    settings.TOLLBOOTH = {
        **settings.TOLLBOOTH,
        "REFUND_SAFE": safe,
        "SELLER_WALLETS": [owner.address],
        "PAYBACK_RECHECK": timedelta(0),
    }
    settings.X402_NETWORKS[NETWORK]["finality_depth"] = FINALITY_DEPTH

    first = owed_refund(world, world.payers[0])
    partial = owed_refund(world, world.payers[1], amount=PRICE // 5)
    again = owed_refund(world, world.payers[0])  # the same destination and amount as `first`
    by_hand = owed_refund(world, world.payers[2])  # not exported: paid from the seller EOA
    exported = [first, partial, again]

    response = _finance().post(
        reverse("admin:payments_refund_changelist"),
        {"action": "export_safe_batch", "_selected_action": [r.pk for r in exported], "index": 0},
    )
    assert response.status_code == 200
    batch = json.loads(response.content)
    assert batch["meta"]["createdFromSafeAddress"] == safe
    assert safe_batch_checksum(batch) == batch["meta"]["checksum"]
    decoded = []
    for transaction in batch["transactions"]:
        data = builder_calldata(transaction)
        assert data[:4] == bytes.fromhex("a9059cbb")  # transfer(address,uint256)
        destination, amount = abi_decode(["address", "uint256"], data[4:])
        decoded.append((transaction["to"].lower(), destination, amount))
    owed = [(world.token.lower(), r.payer.lower(), r.amount) for r in exported]
    assert decoded == owed

    # Another seller wallet pays one refund back by hand (before the batch: the batch's
    # block stays the newest, not final under the policy).
    fund_seller(world)
    hand_tx = send_transfer(world, world.seller, world.payers[2].address, PRICE)

    holders = [safe, *(p.address for p in world.payers[:3])]
    before = {h: balance_of(world.w3, world.token, h) for h in holders}
    receipt = safe_execute_batch(world.w3, deployment, safe, batch, signers=[owner], executor=owner)
    assert receipt["status"] == 1
    assert receipt["to"] == safe  # one execTransaction on the Safe carries the whole batch
    moved = {h: balance_of(world.w3, world.token, h) - before[h] for h in holders}
    assert moved == {
        safe: -(2 * PRICE + PRICE // 5),
        world.payers[0].address: 2 * PRICE,
        world.payers[1].address: PRICE // 5,
        world.payers[2].address: 0,
    }

    # Mined but not final yet: claimed, nothing closed, the hand payback only offered.
    seen = _watch()
    assert (seen["pending"], seen["closed"], seen["matched"]) == (3, 0, 1)
    assert set(Refund.objects.values_list("state", flat=True)) == {Refund.State.OWED}
    world.node.mine(FINALITY_DEPTH)
    seen = _watch()
    assert (seen["closed"], seen["pending"], seen["dropped"]) == (3, 0, 0)

    tx_hash = receipt["transactionHash"].to_0x_hex().lower()
    closed = {r.pk: r for r in Refund.objects.filter(pk__in=[r.pk for r in exported])}
    assert {r.state for r in closed.values()} == {Refund.State.PAID}
    assert {r.paid_reference for r in closed.values()} == {tx_hash}
    logs = [r.payback_log_index for r in closed.values()]
    assert len(set(logs)) == 3  # one transfer log per refund: none closes two
    by_hand.refresh_from_db()
    assert (by_hand.state, by_hand.match_tx_hash) == (Refund.State.OWED, hand_tx.lower())

    # The books: the batch's gas once, as a cost, on one of its refunds.
    now = timezone.now()
    export = books_export(
        period=Period.days(now.date(), now.date()),
        created_by="test",
        now=now + timedelta(days=1),
    )
    rows = list(csv.DictReader(io.StringIO(export.content.decode())))
    refund_rows = [r for r in rows if r["record"] == "refund" and r["transaction"] == tx_hash]
    assert len(refund_rows) == 3
    gas = Decimal(receipt["gasUsed"] * receipt["effectiveGasPrice"]).scaleb(-18)
    with_gas = [r for r in refund_rows if r["gas"]]
    assert len(with_gas) == 1 and Decimal(with_gas[0]["gas"]) == gas
    assert with_gas[0]["gas_symbol"] == "ETH"
    total = next(r for r in rows if r["record"] == "total")
    assert Decimal(total["gas"]) >= gas
    assert Decimal(total["refunds"]) == Decimal(2 * PRICE + PRICE // 5).scaleb(-6)
    # The dashboard's chart counts the same gas on the day it was paid back.
    (today,) = [day for day in books_daily(now=now) if day.day == now.date()]
    assert today.gas == {"ETH": gas}


@pytest.mark.django_db
def test_a_2_of_2_safe_moves_nothing_on_one_signature_and_nothing_closes(
    x402_world: X402World, settings: Any
) -> None:
    world = x402_world
    alice, bob = new_account(world.node), new_account(world.node)
    deployment = safe_deploy(world.w3, world.deployer)
    safe = safe_create(
        world.w3, deployment, alice, owners=[alice.address, bob.address], threshold=2
    )
    mint(world.w3, world.token, world.deployer, safe, 10 * PRICE)
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "REFUND_SAFE": safe}
    refunds = [owed_refund(world, world.payers[0]), owed_refund(world, world.payers[1])]
    response = _finance().post(
        reverse("admin:payments_refund_changelist"),
        {"action": "export_safe_batch", "_selected_action": [r.pk for r in refunds], "index": 0},
    )
    batch = json.loads(response.content)
    before = balance_of(world.w3, world.token, safe)

    # One owner's signature is not the threshold: Safe refuses, the chain records a revert.
    refused = safe_execute_batch(world.w3, deployment, safe, batch, signers=[alice], executor=alice)
    assert refused["status"] == 0
    assert balance_of(world.w3, world.token, safe) == before
    assert _watch()["closed"] == 0
    assert set(Refund.objects.values_list("state", flat=True)) == {Refund.State.OWED}

    done = safe_execute_batch(world.w3, deployment, safe, batch, signers=[alice, bob], executor=bob)
    assert done["status"] == 1
    assert balance_of(world.w3, world.token, safe) == before - 2 * PRICE
    assert _watch()["closed"] == 2  # final at once under the world's depth of one block
    assert set(Refund.objects.values_list("state", flat=True)) == {Refund.State.PAID}
