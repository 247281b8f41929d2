"""The dispute evidence pack (issue 33, part 3) on the prepaid door: one signed document
with the sale, the payment, the work, the receipt, refunds, escalations and the timeline;
exported by `evidence_export` (on the timeline), checked offline by `evidence_verify` and
by the docs' snippet with eth-account alone; a changed byte fails; a pack sealed before a
key rotation still verifies; nothing secret is in it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction
from django.utils import timezone
from eth_account import Account
from rest_framework.test import APIClient

from core.actors import Actor
from core.canonical import canonical_json, sha256_hex
from fulfillment import receipt_signing
from fulfillment.evidence_seal import PackInvalid, pack_verify
from fulfillment.models import ExecutionAttempt, Result
from fulfillment.receipt_signing import receipt_verify
from purchases import event_subjects
from purchases.events import event_note
from purchases.models import Escalation, Offering, Purchase
from purchases.services.remedy.remedies import (
    escalation_open,
    escalation_resolve,
    purchase_refund_create,
)
from tests.conftest import CSV_INPUT
from tests.purchases.test_signed_receipts import KEY, _bought

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]
ROOT = Path(__file__).resolve().parents[2]


def _published() -> list[str]:
    keys = APIClient().get("/.well-known/tollbooth-receipts").json()["keys"]
    return [key["address"] for key in keys]


def _export(purchase: Purchase, tmp_path: Path, name: str = "pack.json") -> tuple[Path, dict]:
    out = tmp_path / name
    call_command("evidence_export", purchase.ref, "--out", str(out), "--by", "sam-support",
                 stderr=StringIO())  # fmt: skip
    return out, json.loads(out.read_text())


def _verify(path: Path, *args: str) -> str:
    out = StringIO()
    call_command("evidence_verify", str(path), *args, stdout=out)
    return out.getvalue()


def test_a_prepaid_purchase_pack_holds_the_sale_payment_work_and_receipt(
    client_for_buyer, offering, tmp_path
):
    purchase = _bought(client_for_buyer, offering)
    client_for_buyer.get(f"/api/v1/purchases/{purchase.ref}/result")  # delivered: a receipt

    path, pack = _export(purchase, tmp_path)

    assert f"valid: signed by {_published()[0]}" in _verify(path, "--address", _published()[0])
    content, result = pack["content"], Result.objects.get(purchase=purchase)
    assert pack["seal"]["purchase"] == content["purchase"]["ref"] == purchase.ref
    assert pack["keyId"] == receipt_signing.signing_key().key_id
    assert content["purchase"]["rail"] == "prepaid"
    assert content["sold"]["offering"]["slug"] == offering.slug
    assert content["sold"]["offering"]["termsVersion"] == offering.version
    assert content["sold"]["offering"]["currentTermsVersion"] == offering.version
    assert content["sold"]["quote"]["inputSha256"] == purchase.quote.input_hash
    assert content["sold"]["quote"]["price"] == str(offering.price)
    assert purchase.buyer is not None
    assert content["paidBy"] == {"payer": purchase.payer, "buyerRef": purchase.buyer.ref}
    assert [(e["kind"], e["amount"]) for e in content["payment"]["ledger"]] == [
        ("purchase_debit", str(-offering.price))
    ]
    assert [e["state"] for e in content["work"]["executions"]] == ["succeeded"]
    assert content["work"]["result"]["sha256"] == result.sha256
    signed = content["receipt"]["signed"]
    assert receipt_verify(signed, addresses=_published())
    assert signed["payload"]["resultSha256"] == result.sha256
    subjects = [row["subject"] for row in content["timeline"]]
    assert subjects[0] == "quote" and event_subjects.RESULT_DELIVERED in subjects
    assert content["issuer"]["keepUntil"] > content["issuer"]["issuedAt"]
    exported = purchase.events.get(subject=event_subjects.EVIDENCE_EXPORTED)
    assert (exported.actor_type, exported.actor, exported.reason_code) == (
        "staff",
        "sam-support",
        "command",
    )
    assert exported.evidence["pack_sha256"] == sha256_hex(path.read_bytes())
    assert exported.evidence["bytes"] == path.stat().st_size


def test_a_refunded_and_escalated_purchase_pack_holds_the_refund_and_the_resolution(
    client_for_buyer, offering, tmp_path
):
    purchase = _bought(client_for_buyer, offering)
    now, system = timezone.now(), Actor.system("test")
    with transaction.atomic():
        escalation = escalation_open(
            purchase=purchase,
            owner=Escalation.OwnerRole.SUPPORT,
            reason_code="execution_outcome_unknown",
            now=now,
            actor=system,
        )
    with transaction.atomic():
        purchase_refund_create(
            purchase=purchase,
            attempt=purchase.payment_attempts.get(),
            reason_code="goodwill",
            now=now,
            actor=system,
        )
    escalation_resolve(
        escalation=escalation, by="sam-support", resolution="Refunded in full.", now=now
    )

    path, pack = _export(purchase, tmp_path)

    assert "valid: signed by" in _verify(path)
    content = pack["content"]
    [refund] = content["refunds"]
    assert (refund["method"], refund["state"], refund["amount"], refund["reasonCode"]) == (
        "ledger_credit",
        "paid",
        str(offering.price),
        "goodwill",
    )
    assert [e["kind"] for e in content["payment"]["ledger"]] == [
        "purchase_debit",
        "refund_credit",
    ]
    [escalated] = content["escalations"]
    assert (escalated["state"], escalated["reasonCode"], escalated["resolution"]) == (
        "resolved",
        "execution_outcome_unknown",
        "Refunded in full.",
    )
    subjects = {row["subject"] for row in content["timeline"]}
    assert {event_subjects.REFUND, event_subjects.ESCALATION} <= subjects
    # Staff names stay with the seller: the timeline says "staff", not who.
    assert "sam-support" not in path.read_text()


@pytest.mark.parametrize(
    ("where", "change", "reason"),
    [
        ("content", lambda c: c["payment"].update(amount="1"), "content_changed"),
        ("content", lambda c: c["work"]["result"].update(sha256="00" * 32), "content_changed"),
        ("content", lambda c: c["timeline"].pop(), "content_changed"),
        ("seal", lambda s: s.update(issuedAt=s["issuedAt"] + 1), "unknown_signer"),
        ("seal", lambda s: s.update(purchase="pur_other"), "purchase_mismatch"),
    ],
)
def test_a_changed_pack_fails_verification(
    client_for_buyer, offering, tmp_path, where, change, reason
):
    purchase = _bought(client_for_buyer, offering)
    path, pack = _export(purchase, tmp_path)

    change(pack[where])
    path.write_text(canonical_json(pack))

    with pytest.raises(CommandError, match=f"invalid evidence pack: {reason}"):
        _verify(path)


def test_a_pack_resealed_over_changed_content_fails_on_its_signature(
    client_for_buyer, offering, tmp_path
):
    """The forger recomputes the content hash: the signature no longer recovers our key."""
    purchase = _bought(client_for_buyer, offering)
    _, pack = _export(purchase, tmp_path)
    pack["content"]["payment"]["amount"] = "1"
    pack["seal"]["contentSha256"] = sha256_hex(canonical_json(pack["content"]))

    with pytest.raises(PackInvalid, match="unknown_signer"):
        pack_verify(pack, addresses=_published())
    other = Account.create()
    with pytest.raises(PackInvalid, match="unknown_signer"):
        pack_verify(pack, addresses=[other.address])


def test_a_pack_sealed_before_a_key_rotation_still_verifies(
    client_for_buyer, offering, tmp_path, settings
):
    purchase = _bought(client_for_buyer, offering)
    old_path, old_pack = _export(purchase, tmp_path, "old.json")
    old_key = receipt_signing.signing_key()
    new_key = "0x" + Account.create().key.hex().removeprefix("0x")
    settings.RECEIPTS = {
        **settings.RECEIPTS,
        "KEY": new_key,
        "RETIRED_KEYS": [f"{old_key.key_id}={old_key.address}"],
    }
    keys = tmp_path / "keys.json"
    keys.write_text(APIClient().get("/.well-known/tollbooth-receipts").content.decode())

    new_path, new_pack = _export(purchase, tmp_path, "new.json")

    assert f"signed by {old_key.address} (key {old_key.key_id})" in _verify(
        old_path, "--keys", str(keys)
    )
    assert f"signed by {old_key.address}" in _verify(old_path)  # this deployment's keys
    new_address = Account.from_key(new_key).address
    assert f"signed by {new_address}" in _verify(new_path, "--keys", str(keys))
    assert old_pack["keyId"] == old_key.key_id != new_pack["keyId"]
    # Only the retired key's address given: the new pack is refused, the old one passes.
    assert "valid" in _verify(old_path, "--address", old_key.address)
    with pytest.raises(CommandError, match="unknown_signer"):
        _verify(new_path, "--address", old_key.address)


def test_nothing_secret_is_in_the_pack(client_for_buyer, offering, tmp_path):
    purchase = _bought(client_for_buyer, offering)
    api_key = client_for_buyer._credentials["HTTP_AUTHORIZATION"].removeprefix("Bearer ")
    execution = ExecutionAttempt.objects.get(purchase=purchase)
    # Evidence a boundary event might carry: the pack keeps the hash or drops it.
    event_note(
        subject=event_subjects.PAYMENT_ID_REPLAYED,
        purchase=purchase,
        actor=Actor.system("worker-host-7"),
        evidence={
            "signature": "0x" + "ab" * 65,
            "raw_transaction": "0x02f8deadbeef",
            "input": CSV_INPUT,
            "answer": {"body": "the paid output itself"},
            "headers": {"Authorization": f"Bearer {api_key}"},
            "worker": "worker-host-7",
            "upstream_secret": "s3cr3t-upstream",
            "payment_id": "pay-client-chosen-id-0001",
        },
    )
    result = Result.objects.get(purchase=purchase)

    path, _ = _export(purchase, tmp_path)

    text = path.read_text()
    assert "valid" in _verify(path)
    for secret in (
        KEY,  # the buyer's payment id: client-supplied, never in clear (as on receipts)
        api_key,
        api_key[:16],
        CSV_INPUT["csv"],
        json.dumps(CSV_INPUT["csv"])[1:-1],
        "ab" * 65,
        "0x02f8deadbeef",
        "the paid output itself",
        "worker-host-7",
        "s3cr3t-upstream",
        "pay-client-chosen-id-0001",
        execution.lease_token,
        bytes(result.body).decode(errors="ignore")[:40],
    ):
        assert secret not in text, secret
    assert sha256_hex("0x" + "ab" * 65) in text  # the signature's digest stands for it


def test_the_docs_snippet_verifies_a_pack_with_eth_account_alone(
    client_for_buyer, offering, tmp_path
):
    """docs/evidence.md's verifier, run as written in a fresh interpreter that imports no
    Tollbooth code (and no Django)."""
    docs = (ROOT / "docs/evidence.md").read_text()
    snippet = re.search(r"<!-- verify-snippet -->\n```python\n(.*?)```", docs, re.S)
    assert snippet is not None
    purchase = _bought(client_for_buyer, offering)
    client_for_buyer.get(f"/api/v1/purchases/{purchase.ref}/result")
    good, pack = _export(purchase, tmp_path)
    pack["content"]["payment"]["amount"] = "1"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(pack, indent=2))
    script = tmp_path / "verify_pack.py"
    script.write_text(snippet.group(1))

    def run(path: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-I", str(script), str(path), _published()[0]],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=tmp_path,
        )

    ok, forged = run(good), run(bad)
    assert (ok.returncode, ok.stdout.strip()) == (0, f"valid {purchase.ref}"), ok.stderr
    assert (forged.returncode, forged.stdout.strip()) == (1, "INVALID"), forged.stderr


def test_an_unknown_purchase_is_refused_and_nothing_is_recorded(tmp_path):
    with pytest.raises(CommandError, match="purchase_not_found: pur_nope"):
        call_command("evidence_export", "pur_nope", "--out", str(tmp_path / "x.json"))
    assert not (tmp_path / "x.json").exists()


def test_terms_changed_after_the_sale_show_as_a_newer_current_version(
    client_for_buyer, offering, tmp_path
):
    purchase = _bought(client_for_buyer, offering)
    sold_at = offering.version
    Offering.objects.filter(pk=offering.pk).update(version=sold_at + 1, price=offering.price * 2)

    _, pack = _export(purchase, tmp_path)

    sold = pack["content"]["sold"]
    assert (sold["offering"]["termsVersion"], sold["offering"]["currentTermsVersion"]) == (
        sold_at,
        sold_at + 1,
    )
    assert sold["quote"]["price"] == str(offering.price)  # as sold, not as offered now
