"""Demo data: offerings, funded agents with API keys, a support and a finance login.

Idempotent: the second run reuses what the first created and the credentials it saved.
Every secret is generated here at run time and written only to the var/ directory.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import Group, User
from django.db import transaction

from backoffice.catalog.apply import catalog_apply
from backoffice.catalog.checks import catalog_parse
from core.actors import Actor
from devtools.sample_upstream import DEMO_OFFERING as UPSTREAM_OFFERING
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
# The demo's catalog is a catalog file a seller can copy (docs/offerings-as-code.md).
OFFERINGS_FILE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "offerings.yaml"


def _offerings_seed(*, asset: str, network: str, pay_to: str, upstream_url: str) -> list[str]:
    """Create the file's offerings that are missing, through the same apply as
    `manage.py offerings apply`; later runs keep what staff edited in the admin (price,
    stock, retention...) and move only where it is paid (each run deploys a new token) and
    where the sample upstream listens. Without `upstream_url`, no counted-echo."""
    facts = {"asset": asset, "network": network, "pay_to": pay_to}
    catalog = catalog_parse(
        OFFERINGS_FILE.read_text(), name=OFFERINGS_FILE.name, defaults_override=facts
    )
    entries = dict(catalog.entries)
    echo = entries.pop(UPSTREAM_OFFERING)
    if upstream_url:
        entries[UPSTREAM_OFFERING] = replace(
            echo, upstream={**(echo.upstream or {}), "url": upstream_url}
        )
    actor = Actor.system("seed_demo")
    existing = {o.slug: o for o in Offering.objects.filter(slug__in=entries)}
    missing = {slug: entry for slug, entry in entries.items() if slug not in existing}
    catalog_apply(catalog=replace(catalog, entries=missing), actor=actor)
    for offering in existing.values():
        offering_update(offering_id=offering.pk, changes=facts, actor=actor)
    if upstream_url and UPSTREAM_OFFERING in existing:
        _upstream_move(existing[UPSTREAM_OFFERING], upstream_url, actor)
    return list(entries)


def _upstream_move(offering: Offering, url: str, actor: Actor) -> None:
    """The sample upstream listens on a new port this run; what staff tuned stays."""
    upstream = Upstream.objects.filter(offering=offering).first()
    if upstream is not None and upstream.url != url:
        upstream.url = url
        offering_upstream_save(offering_id=offering.pk, upstream=upstream, actor=actor)


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
    slugs = _offerings_seed(asset=asset, network=network, pay_to=pay_to, upstream_url=upstream_url)
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
