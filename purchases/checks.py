"""System checks that read the catalog: registered with the `database` tag, so they run only
where a database is named (`check --database default`, `check --deploy --database default`,
`migrate`, and `make serve`'s startup), never at import or in `AppConfig.ready()`."""

from __future__ import annotations

from collections.abc import Iterable

from django.conf import settings
from django.core.checks import CheckMessage, Error
from django.db import DatabaseError, connections

# Chain ids of development nodes: anvil and Hardhat (31337), Ganache and geth --dev (1337).
# Their coins and tokens are free to mint: a sale settled there is no sale.
LOCAL_CHAIN_IDS = frozenset({31337, 1337})


def network_is_local(caip2: str) -> bool:
    """Whether a CAIP-2 network is a development chain (`eip155:31337`, `eip155:1337`)."""
    namespace, _, reference = caip2.partition(":")
    return namespace == "eip155" and reference.isdigit() and int(reference) in LOCAL_CHAIN_IDS


def local_network_offerings_check(
    databases: Iterable[str] | None = None, **_: object
) -> list[CheckMessage]:
    """Production (`X402_REFUSE_LOCAL_NETWORKS`, set by config.settings.production) refuses
    to serve while an active offering names a local chain: its buyers would "pay" with a
    token anyone can mint. Inactive offerings are history and pass. Before the first
    migration there is no catalog, so nothing to refuse."""
    if not databases or not getattr(settings, "X402_REFUSE_LOCAL_NETWORKS", False):
        return []
    from purchases.models import Offering

    problems: list[CheckMessage] = []
    for alias in databases:
        table = Offering._meta.db_table
        try:
            if table not in connections[alias].introspection.table_names():
                continue
            slugs = [
                (slug, network)
                for slug, network in Offering.objects.using(alias)
                .filter(is_active=True, network__startswith="eip155:")
                .order_by("slug")
                .values_list("slug", "network")
                if network_is_local(network)
            ]
        except DatabaseError as exc:  # the database's own checks say it is unreachable
            problems.append(
                Error(f"cannot read the catalog in database {alias!r}: {exc}", id="purchases.E002")
            )
            continue
        if slugs:
            named = ", ".join(f"{slug} ({network})" for slug, network in slugs)
            problems.append(
                Error(
                    f"active offerings name a local development chain: {named}",
                    hint="Move them to a real network (e.g. eip155:8453) or deactivate them "
                    "(`manage.py offerings apply FILE` or the admin), then start again. "
                    "docs/deployment.md#local-networks-are-refused",
                    obj=alias,
                    id="purchases.E001",
                )
            )
    return problems
