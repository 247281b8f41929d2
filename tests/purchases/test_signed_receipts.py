"""Signed receipts (issue 21 §4) on the prepaid door: the paid answer carries a receipt the
buyer can verify offline with nothing but the receipt and the published address; any
changed field fails; a payment id seen again after its record was compacted is answered
with the same receipt, byte for byte; the verify command and the docs' snippet agree."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone
from eth_account import Account
from rest_framework.test import APIClient

from fulfillment import receipt_signing
from fulfillment.models import Receipt, Result
from fulfillment.receipt_signing import ReceiptInvalid, receipt_verify
from purchases.models import Purchase
from purchases.services.fulfil.execution import purchase_execute
from purchases.services.jobs import housekeeping
from tests.purchases.test_prepaid_purchase_api import new_quote, pay

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]
ROOT = Path(__file__).resolve().parents[2]
KEY = "pay-receipt-0001-aaaaaaaa"


def _published() -> list[str]:
    keys = APIClient().get("/.well-known/tollbooth-receipts").json()["keys"]
    return [key["address"] for key in keys]


def _bought(client, offering) -> Purchase:
    response = pay(client, new_quote(client, offering), key=KEY)
    assert response.status_code == 201, response.content
    purchase = Purchase.objects.get(ref=response.json()["purchase"])
    purchase_execute(purchase_id=purchase.pk, worker="test")
    return purchase


def _header(response) -> dict:
    return json.loads(base64.b64decode(response["Tollbooth-Receipt"]))


def test_the_paid_result_carries_a_receipt_that_verifies_offline(client_for_buyer, offering):
    purchase = _bought(client_for_buyer, offering)

    answer = client_for_buyer.get(f"/api/v1/purchases/{purchase.ref}/result")

    assert answer.status_code == 200
    receipt = _header(answer)
    result = Result.objects.get(purchase=purchase)
    row = Receipt.objects.get(purchase=purchase)
    purchase.refresh_from_db()
    assert row.issued_at is not None and purchase.paid_at is not None
    assert receipt["format"] == "eip712"
    assert receipt["payload"] == {
        "version": 1,
        "network": "prepaid",
        "resourceUrl": f"http://localhost:8000/x402/{offering.slug}",
        "payer": purchase.payer,
        "issuedAt": int(row.issued_at.timestamp()),
        "transaction": row.transaction,
        "receipt": row.public_id,
        "purchase": purchase.ref,
        "offering": offering.slug,
        "amount": "250000",
        "asset": offering.asset,
        "settledAt": int(purchase.paid_at.timestamp()),
        "resultSha256": result.sha256,
    }
    signer = receipt_verify(receipt, addresses=_published())
    assert receipt["keyId"] == receipt_signing.key_id_for(signer)
    # The same bytes on every later answer and on the public receipt.
    again = client_for_buyer.get(f"/api/v1/purchases/{purchase.ref}/result")
    assert again["Tollbooth-Receipt"] == answer["Tollbooth-Receipt"]
    public = APIClient().get(f"/api/v1/receipts/{row.public_id}").json()
    assert public["signed"] == receipt


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("network", "eip155:8453"),
        ("resourceUrl", "http://localhost:8000/x402/other"),
        ("payer", "buy_someone_else"),
        ("issuedAt", 1),
        ("transaction", "0x" + "11" * 32),
        ("receipt", "rcp_other"),
        ("purchase", "pur_other"),
        ("offering", "other"),
        ("amount", "250001"),
        ("asset", "0x" + "22" * 20),
        ("settledAt", 2),
        ("resultSha256", "00" * 32),
    ],
)
def test_changing_any_field_fails_verification(client_for_buyer, offering, field, value):
    purchase = _bought(client_for_buyer, offering)
    receipt = _header(client_for_buyer.get(f"/api/v1/purchases/{purchase.ref}/result"))
    addresses = _published()
    receipt_verify(receipt, addresses=addresses)

    forged = {**receipt, "payload": {**receipt["payload"], field: value}}

    with pytest.raises(ReceiptInvalid) as refused:
        receipt_verify(forged, addresses=addresses)
    assert refused.value.reason == "unknown_signer"


def test_another_key_or_a_broken_signature_fails(client_for_buyer, offering):
    purchase = _bought(client_for_buyer, offering)
    receipt = _header(client_for_buyer.get(f"/api/v1/purchases/{purchase.ref}/result"))

    with pytest.raises(ReceiptInvalid) as other_key:
        receipt_verify(receipt, addresses=[Account.create().address])
    with pytest.raises(ReceiptInvalid) as broken:
        receipt_verify({**receipt, "signature": "0x1234"}, addresses=_published())
    with pytest.raises(ReceiptInvalid) as missing:
        payload = {k: v for k, v in receipt["payload"].items() if k != "amount"}
        receipt_verify({**receipt, "payload": payload}, addresses=_published())

    assert (other_key.value.reason, broken.value.reason, missing.value.reason) == (
        "unknown_signer",
        "bad_signature",
        "missing_fields",
    )


def test_a_rotated_key_stays_published_and_old_receipts_still_verify(
    client_for_buyer, offering, settings
):
    purchase = _bought(client_for_buyer, offering)
    old = _header(client_for_buyer.get(f"/api/v1/purchases/{purchase.ref}/result"))
    old_key = receipt_signing.signing_key()
    new_key = "0x" + Account.create().key.hex().removeprefix("0x")
    settings.RECEIPTS = {
        **settings.RECEIPTS,
        "KEY": new_key,
        "RETIRED_KEYS": [f"{old_key.key_id}={old_key.address}"],
    }

    keys = APIClient().get("/.well-known/tollbooth-receipts").json()["keys"]

    assert [(key["status"], key["address"]) for key in keys] == [
        ("current", Account.from_key(new_key).address),
        ("retired", old_key.address),
    ]
    assert receipt_verify(old, addresses=[key["address"] for key in keys]) == old_key.address
    # Issued receipts are never re-signed: the stored bytes are sent again.
    again = client_for_buyer.get(f"/api/v1/purchases/{purchase.ref}/result")
    assert _header(again) == old


def test_a_payment_id_past_retention_is_answered_with_the_same_receipt(client_for_buyer, offering):
    purchase = _bought(client_for_buyer, offering)
    paid = client_for_buyer.get(f"/api/v1/purchases/{purchase.ref}/result")
    compacted = housekeeping.compact_payment_ids(now=timezone.now() + timedelta(hours=25))
    assert compacted["compacted"] == 1

    again = pay(client_for_buyer, purchase.quote.public_id, key=KEY)

    assert again.status_code == 410 and again.json()["code"] == "retention_expired"
    assert again["Tollbooth-Receipt"] == paid["Tollbooth-Receipt"]
    assert again.json()["signed_receipt"] == _header(paid)
    assert purchase.ledger_entries.count() == 1  # answered from the receipt, never sold again


def test_the_verify_command_needs_only_the_receipt_and_the_address(
    client_for_buyer, offering, tmp_path
):
    purchase = _bought(client_for_buyer, offering)
    answer = client_for_buyer.get(f"/api/v1/purchases/{purchase.ref}/result")
    header = tmp_path / "receipt.b64"
    header.write_text(answer["Tollbooth-Receipt"])
    address = _published()[0]
    out = StringIO()

    call_command("receipt_verify", str(header), "--address", address, stdout=out)

    assert f"valid: signed by {address}" in out.getvalue()
    assert f"purchase: {purchase.ref}" in out.getvalue()
    forged = _header(answer)
    forged["payload"]["amount"] = "1"
    header.write_text(json.dumps(forged))
    with pytest.raises(CommandError, match="invalid receipt: unknown_signer"):
        call_command("receipt_verify", str(header), "--address", address, stdout=StringIO())


@pytest.mark.parametrize(
    ("keys_file", "named"),
    [
        (None, "No such file"),
        ("not json", "not a /.well-known/tollbooth-receipts document"),
        ('{"keys": [{"id": "k1"}]}', "not a /.well-known/tollbooth-receipts document"),
    ],
)
def test_a_keys_file_that_is_not_the_published_document_is_named_not_a_crash(
    tmp_path, keys_file, named
):
    keys = tmp_path / "keys.json"
    if keys_file is not None:
        keys.write_text(keys_file)
    receipt = tmp_path / "receipt.b64"
    receipt.write_text("e30=")

    for command in ("receipt_verify", "evidence_verify"):
        with pytest.raises(CommandError, match=named):
            call_command(command, str(receipt), "--keys", str(keys), stdout=StringIO())


def test_the_docs_snippet_verifies_with_eth_account_alone(client_for_buyer, offering, tmp_path):
    """docs/receipts.md's standalone snippet, run as written in a fresh interpreter that
    imports no Tollbooth code (and no Django)."""
    docs = (ROOT / "docs/receipts.md").read_text()
    snippet = re.search(r"<!-- verify-snippet -->\n```python\n(.*?)```", docs, re.S)
    assert snippet is not None
    purchase = _bought(client_for_buyer, offering)
    answer = client_for_buyer.get(f"/api/v1/purchases/{purchase.ref}/result")
    forged = _header(answer)
    forged["payload"]["resultSha256"] = "00" * 32
    script = tmp_path / "verify.py"
    script.write_text(snippet.group(1))

    def run(receipt: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-I", str(script), receipt, _published()[0]],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=tmp_path,
        )

    good = run(answer["Tollbooth-Receipt"])
    bad = run(base64.b64encode(json.dumps(forged).encode()).decode())
    assert (good.returncode, good.stdout.strip()) == (0, "valid"), good.stderr
    assert (bad.returncode, bad.stdout.strip()) == (1, "INVALID")
