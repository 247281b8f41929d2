"""The restore drill of docs/going-live.md, as a test: x402 sales (a real anvil chain,
direct mode) and a prepaid one, each with its signed receipt, on PostgreSQL; a
`pg_dump --format=custom` of that database, a `pg_restore` into a fresh one, and Django
pointed at the restored database in a process of its own (`manage.py shell` with its
DATABASE_URL): every receipt stored there still verifies against the keys the seller
published, and the period's books are byte for byte the original's (same lines, same
totals)."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from backoffice.books import Period
from backoffice.books_export import books_export
from fulfillment.models import Receipt
from fulfillment.receipt_signing import receipt_verify
from purchases.models import Buyer, Purchase
from purchases.services.fulfil.execution import purchase_execute
from tests.factories import BuyerFactory, fund
from tests.x402.e2e import PRICE, X402World, ask, sign_payment

pytestmark = [pytest.mark.postgres]

ROOT = Path(__file__).resolve().parents[1]

# Run by the restored database's own Django: the books of the same period, and every
# receipt as stored, in one JSON line.
ON_THE_RESTORED_DATABASE = """
import json, os
from datetime import datetime
from backoffice.books import Period
from backoffice.books_export import books_export
from django.db import connection
from fulfillment.models import Receipt
def drill_time(name):
    return datetime.fromisoformat(os.environ[f"DRILL_{name}"])
start, end, now = drill_time("START"), drill_time("END"), drill_time("NOW")
books = books_export(period=Period(start, end), created_by="restore drill", now=now)
receipts = list(Receipt.objects.order_by("public_id").values_list("public_id", "signed"))
database = connection.settings_dict["NAME"]
print(json.dumps({"database": database, "books": books.content.decode(), "receipts": receipts}))
"""


def _client_env() -> dict[str, str]:
    db = connection.settings_dict
    env = {**os.environ, "PGHOST": str(db["HOST"] or "127.0.0.1"), "PGUSER": str(db["USER"])}
    if db["PORT"]:
        env["PGPORT"] = str(db["PORT"])
    if db["PASSWORD"]:
        env["PGPASSWORD"] = str(db["PASSWORD"])
    return env


def _run(*args: str, env: dict[str, str]) -> str:
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"{args[0]} failed: {done.stderr}"
    return done.stdout


def _major(version_text: str) -> int:
    found = re.search(r"(\d+)(?:\.\d+)?", version_text)
    assert found, version_text
    return int(found.group(1))


@pytest.fixture
def restored_name() -> Iterator[str]:
    """A fresh database beside the test database, dropped afterwards."""
    name = f"{connection.settings_dict['NAME']}_restored"[:63]
    env = _client_env()
    _run("dropdb", "--if-exists", name, env=env)
    yield name
    _run("dropdb", "--if-exists", "--force", name, env=env)


def _sell(client: APIClient, world: X402World, payer: Any, title: str) -> bytes:
    """One paid x402 purchase, run and answered with its result and signed receipt."""
    body = {"title": title, "csv": "region,units\nnorth,3\nsouth,5\n"}
    required = ask(client, world, body)
    assert required.status_code == 402
    payment = sign_payment(required["PAYMENT-REQUIRED"], payer, None)
    assert ask(client, world, body, payment=payment).status_code in (200, 202)
    purchase = Purchase.objects.filter(offering=world.offering).latest("pk")
    purchase_execute(purchase_id=purchase.pk, worker="drill")
    paid = ask(client, world, body, payment=payment)
    assert paid.status_code == 200 and "Tollbooth-Receipt" in paid
    return bytes(paid.content)


def _sell_prepaid(client: APIClient, world: X402World) -> None:
    """One purchase of the same offering from a prepaid balance: the books' other rail."""
    body = {"offering": world.offering.slug, "input": {"title": "Prepaid", "csv": "a,b\n1,2\n"}}
    quote = client.post("/api/v1/quotes", body, format="json")
    assert quote.status_code == 201, quote.content
    paid = client.post(
        f"/api/v1/quotes/{quote.json()['id']}/purchase",
        {"rail": "prepaid"},
        format="json",
        HTTP_IDEMPOTENCY_KEY="restore-drill-prepaid-0001",
    )
    assert paid.status_code in (201, 202), paid.content
    purchase = Purchase.objects.get(ref=paid.json()["purchase"])
    purchase_execute(purchase_id=purchase.pk, worker="drill")


def test_a_pg_dump_restored_into_a_fresh_database_keeps_receipts_and_books(
    x402_live_world: X402World,
    restored_name: str,
    tmp_path: Path,
    make_client: Callable[[Buyer], APIClient],
) -> None:
    for tool in ("pg_dump", "pg_restore", "createdb", "dropdb"):
        assert shutil.which(tool), f"{tool} is missing: `make test` installs postgresql-client"
    world, client, env = x402_live_world, APIClient(), _client_env()
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        server = _major(cursor.fetchone()[0])
    assert _major(_run("pg_dump", "--version", env=env)) >= server  # pg_dump refuses newer

    since = timezone.now() - timedelta(seconds=1)
    for index, payer in enumerate(world.payers[:2]):
        _sell(client, world, payer, f"Sales {index}")
    buyer = BuyerFactory.create()
    fund(buyer, 10 * PRICE, asset=world.token)
    _sell_prepaid(make_client(buyer), world)
    head = datetime.fromtimestamp(world.w3.eth.get_block("latest")["timestamp"], tz=UTC)
    end = max(head, timezone.now()) + timedelta(seconds=1)
    period = Period(since, end)
    original = books_export(period=period, created_by="restore drill", now=end)
    signed = dict(Receipt.objects.values_list("public_id", "signed"))
    assert len(signed) == 3 and all(signed.values())
    published = APIClient().get("/.well-known/tollbooth-receipts").json()
    addresses = [key["address"] for key in published["keys"]]

    dump = tmp_path / "tollbooth.dump"
    name = str(connection.settings_dict["NAME"])
    _run("pg_dump", "--format=custom", "--no-owner", f"--file={dump}", name, env=env)
    _run("createdb", restored_name, env=env)
    _run("pg_restore", "--no-owner", "--exit-on-error", f"--dbname={restored_name}", str(dump),
         env=env)  # fmt: skip

    db = connection.settings_dict
    auth = f"{db['USER']}:{db['PASSWORD']}" if db["PASSWORD"] else str(db["USER"])
    restored_env = {
        **env,
        "DJANGO_SETTINGS_MODULE": "config.settings.test",
        "DATABASE_URL": f"postgres://{auth}@{db['HOST']}:{db['PORT'] or 5432}/{restored_name}",
        "X402_LOCAL_RPC_URL": world.node.rpc_url,
        "X402_LOCAL_TOKEN": world.token,
        "X402_LOCAL_RELAYER_KEY": world.relayer.key.hex(),
        "TOLLBOOTH_SELLER_WALLETS": ",".join(django_settings.TOLLBOOTH["SELLER_WALLETS"]),
        "DRILL_START": period.start.isoformat(),
        "DRILL_END": period.end.isoformat(),
        "DRILL_NOW": end.isoformat(),
    }
    manage = (sys.executable, str(ROOT / "manage.py"))
    out = _run(*manage, "shell", "-c", ON_THE_RESTORED_DATABASE, env=restored_env)
    restored = json.loads(out.strip().splitlines()[-1])

    assert restored["database"] == restored_name
    assert dict(restored["receipts"]) == signed
    for text in signed.values():
        receipt_verify(json.loads(text), addresses=addresses)
    keys = tmp_path / "tollbooth-receipts.json"
    keys.write_text(json.dumps(published))
    first = tmp_path / "receipt.json"
    first.write_text(restored["receipts"][0][1])
    checked = _run(*manage, "receipt_verify", str(first), "--keys", str(keys), env=restored_env)
    assert "valid: signed by" in checked
    assert restored["books"] == original.content.decode()
    rows = list(csv.DictReader(io.StringIO(original.content.decode())))
    sales = {row["purchase"] for row in rows if row["record"] == "sale"}
    assert sales == set(Purchase.objects.values_list("ref", flat=True))
    revenue = sum(Decimal(row["revenue"]) for row in rows if row["record"] == "total")
    assert revenue == Decimal(3 * PRICE) / 10**6
    assert {row["rail"] for row in rows if row["record"] == "sale"} == {"x402", "prepaid"}
