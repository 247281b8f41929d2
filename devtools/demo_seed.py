"""Demo data: offerings, funded agents with API keys, a support and a finance login.

Idempotent: the second run reuses what the first created and the credentials it saved.
Every secret is generated here at run time and written only to the var/ directory.
"""

from __future__ import annotations

import json
import secrets
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import Group, User
from django.db import transaction

from core.actors import Actor
from devtools.sample_upstream import DEMO_OFFERING as UPSTREAM_OFFERING
from devtools.sample_upstream import DEMO_SECRET_ENV as UPSTREAM_SECRET_ENV
from fulfillment.executors.report import REPORT_INPUT_SCHEMA
from fulfillment.models import Upstream
from payments.models import LedgerEntry
from payments.services import ledger_credit
from purchases.models import Buyer, BuyerWallet, Offering
from purchases.services.fulfil.upstreams import offering_upstream_save
from purchases.services.quote.offerings import offering_update
from purchases.services.shared.buyers import api_key_issue, buyer_create

DEMO_ASSET = "0x" + "0" * 38 + "dc"  # replaced by the deployed test USDC when the chain runs
DEMO_SELLER = "0x" + "5e11e2" * 6 + "5e11"
DEMO_NETWORK = "eip155:31337"
CREDENTIALS_FILE = "demo-credentials.json"
# The offering whose work is the demo's sample upstream (devtools/sample_upstream.py): a
# seller's own signed HTTP endpoint that counts its effects.
UPSTREAM_SPEC: dict[str, Any] = {
    "slug": UPSTREAM_OFFERING,
    "title": "Counted echo (the seller's own HTTP upstream)",
    "executor": "http",
    "price": 50_000,
    "description": "Echoes the message from the sample upstream, which counts every effect.",
    "input_schema": {
        "type": "object",
        "required": ["message"],
        "additionalProperties": False,
        "properties": {"message": {"type": "string", "minLength": 1, "maxLength": 200}},
    },
}

OFFERINGS: list[dict[str, Any]] = [
    {
        "slug": "csv-report",
        "title": "CSV statistics report",
        "executor": "report",
        "price": 250_000,
        "description": "Per-column statistics of a CSV (Decimal exact).",
        "input_schema": REPORT_INPUT_SCHEMA,
    },
    {
        "slug": "word_stats",
        "title": "Word statistics (external job service)",
        "executor": "http_job",
        "price": 100_000,
        "description": "Word counts computed by the external job service.",
        "input_schema": {
            "type": "object",
            "required": ["text"],
            "additionalProperties": False,
            "properties": {
                "text": {"type": "string", "minLength": 1},
                "duration_ms": {"type": "integer", "minimum": 0, "maximum": 60000},
                "request_id": {"type": "string"},
            },
        },
        "volatile_fields": ["request_id"],
    },
    {
        "slug": "limited-report",
        "title": "CSV report (limited edition)",
        "executor": "report",
        "price": 1_000_000,
        "stock": 3,
        "refund_policy": "escalate",
        "description": "Same report, only three for sale.",
        "input_schema": REPORT_INPUT_SCHEMA,
    },
]


def _offering_ensure(spec: dict[str, Any], *, asset: str, network: str, pay_to: str) -> None:
    """Create the offering once; later runs keep what staff edited in the admin (price,
    stock, retention...) and move only where it is paid: each run deploys a new token."""
    chain_facts = {"asset": asset, "network": network, "pay_to": pay_to}
    existing = Offering.objects.filter(slug=spec["slug"]).first()
    if existing is None:
        Offering.objects.create(**spec, **chain_facts, result_retention=timedelta(days=7))
    else:
        offering_update(
            offering_id=existing.pk, changes=chain_facts, actor=Actor.system("seed_demo")
        )


def _upstream_ensure(url: str, *, asset: str, network: str, pay_to: str) -> None:
    """The sample upstream's offering, pointed at where this run's upstream listens."""
    _offering_ensure(UPSTREAM_SPEC, asset=asset, network=network, pay_to=pay_to)
    offering = Offering.objects.get(slug=UPSTREAM_OFFERING)
    config = {"kind": Upstream.Kind.HTTP, "url": url, "secret_env": UPSTREAM_SECRET_ENV}
    upstream = Upstream.objects.filter(offering=offering).first()
    if upstream is None:
        Upstream.objects.create(offering=offering, timeout_seconds=5, **config)
    elif upstream.url != url:  # a new port this run; what staff tuned stays
        upstream.url = url
        offering_upstream_save(
            offering_id=offering.pk, upstream=upstream, actor=Actor.system("seed_demo")
        )


def _credentials_path() -> Path:
    return Path(settings.VAR_DIR) / CREDENTIALS_FILE


def _staff_user(username: str, group: str, saved: dict[str, Any]) -> dict[str, str]:
    password = saved.get(username) or secrets.token_urlsafe(12)
    user, _ = User.objects.get_or_create(username=username, defaults={"is_staff": True})
    user.is_staff = True
    user.set_password(password)
    user.save()
    user.groups.add(Group.objects.get(name=group))
    return {"username": username, "password": password}


def _agent(
    name: str, funds: int, asset: str, saved: dict[str, Any], wallet: str | None
) -> dict[str, str]:
    buyer = Buyer.objects.filter(name=name).first()
    if buyer is None or name not in saved:
        buyer = buyer or buyer_create(name=name, spend_cap=50_000_000)
        saved[name] = api_key_issue(buyer=buyer, label="demo")
    if wallet:
        # Each demo run starts a new chain with new wallets; the newest is the buyer's.
        BuyerWallet.objects.filter(buyer=buyer).delete()
        BuyerWallet.objects.update_or_create(address=wallet.lower(), defaults={"buyer": buyer})
    ledger_credit(
        buyer_id=buyer.pk,
        asset=asset,
        amount=funds,
        kind=LedgerEntry.Kind.TOP_UP,
        reference=f"demo-top-up:{buyer.ref}:{asset}",
    )
    return {"buyer": buyer.ref, "name": name, "api_key": saved[name]}


@transaction.atomic
def demo_seed(
    *,
    asset: str = DEMO_ASSET,
    network: str = DEMO_NETWORK,
    pay_to: str = DEMO_SELLER,
    wallets: dict[str, str] | None = None,
    upstream_url: str = "",
) -> dict[str, Any]:
    """Create or refresh the demo data; return the logins and keys to print. With
    `upstream_url`, also the offering sold from the sample upstream listening there."""
    from backoffice.roles import roles_ensure

    roles_ensure()
    path = _credentials_path()
    saved: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    for spec in OFFERINGS:
        _offering_ensure(spec, asset=asset, network=network, pay_to=pay_to)
    slugs = [spec["slug"] for spec in OFFERINGS]
    if upstream_url:
        _upstream_ensure(upstream_url, asset=asset, network=network, pay_to=pay_to)
        slugs.append(UPSTREAM_OFFERING)
    wallets = wallets or {}
    agents = [
        _agent(name, funds, asset, saved, wallets.get(name))
        for name, funds in (("demo-agent-alice", 20_000_000), ("demo-agent-bob", 1_000_000))
    ]
    staff = [_staff_user("support", "support", saved), _staff_user("finance", "finance", saved)]
    superuser = _staff_user("admin", "support", saved)
    User.objects.filter(username="admin").update(is_superuser=True)
    saved.update({s["username"]: s["password"] for s in [*staff, superuser]})
    path.write_text(json.dumps(saved, indent=2))
    path.chmod(0o600)
    return {
        "agents": agents,
        "staff": [*staff, superuser],
        "credentials_file": str(path),
        "offerings": slugs,
    }
