"""Network configuration from settings, one place."""

from __future__ import annotations

from django.conf import settings
from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured

from payments.rails.x402.facilitator_auth import FacilitatorAuth, facilitator_auth
from payments.rails.x402.types import NetworkConfig

FINALITY_POLICIES = ("depth", "finalized")


class UnknownNetwork(LookupError):
    pass


def network_is_settled(caip2: str) -> bool:
    """Whether we settle on this network (its configuration is read where it is used)."""
    return caip2 in settings.X402_NETWORKS


def relayer_networks() -> list[str]:
    """Networks we settle on in direct mode with a relayer signer configured (an environment
    key, or TOLLBOOTH_RELAYER_SIGNER's class)."""
    from payments.signers import relayer_address

    return [
        caip2
        for caip2, raw in settings.X402_NETWORKS.items()
        if raw.get("mode") == "direct" and relayer_address(network=caip2) is not None
    ]


def network_config(caip2: str) -> NetworkConfig:
    """Raises UnknownNetwork for a network we do not settle on."""
    raw = settings.X402_NETWORKS.get(caip2)
    if raw is None:
        raise UnknownNetwork(caip2)
    if raw["mode"] == "facilitator":
        facilitator_url, facilitator_auth = network_facilitator(caip2, raw)
    else:  # our relayer settles: no facilitator is called, its credentials are not read
        facilitator_url = raw.get("facilitator_url") or settings.X402_FACILITATOR_URL
        facilitator_auth = None
    return NetworkConfig(
        caip2=caip2,
        chain_id=int(raw["chain_id"]),
        rpc_url=raw["rpc_url"],
        rpc_url_fallback=raw.get("rpc_url_fallback") or "",
        token_address=raw["token_address"],
        token_name=raw["token_name"],
        token_version=raw["token_version"],
        confirmations=int(raw["confirmations"]),
        confirmation_timeout=float(raw["confirmation_timeout"]),
        mode=raw["mode"],
        facilitator_url=facilitator_url,
        facilitator_auth=facilitator_auth,
        facilitator_timeout=float(
            raw.get("facilitator_timeout") or settings.X402_FACILITATOR_TIMEOUT
        ),
        relayer_private_key=raw.get("relayer_private_key", ""),
        max_timeout_seconds=int(raw.get("max_timeout_seconds", 300)),
        explorer_tx_url=raw.get("explorer_tx_url", ""),
        finality=_finality(caip2, raw),
        finality_depth=int(raw.get("finality_depth") or raw["confirmations"]),
    )


def facilitator_credentials_check(**_: object) -> list[CheckMessage]:
    """System check (`check`, `migrate`, `runserver`, `check --deploy`): every network
    settled through a facilitator has usable credentials (or none), so a malformed key is
    found at deploy time, not by a buyer's payment. Names the setting, never the value."""
    problems: list[CheckMessage] = []
    for caip2, raw in settings.X402_NETWORKS.items():
        if raw.get("mode") != "facilitator":
            continue
        try:
            network_facilitator(caip2, raw)
        except ImproperlyConfigured as exc:
            problems.append(Error(str(exc), id="payments.E001"))
    return problems


def network_facilitator(caip2: str, raw: dict) -> tuple[str, FacilitatorAuth | None]:
    """The facilitator a network settles through and the credentials it is called with: the
    network's own URL with its own credentials, else the global URL with the global ones (a
    token never goes to a facilitator it was not issued for). Raises FacilitatorAuthInvalid
    (an ImproperlyConfigured naming the setting, never the secret)."""
    own = str(raw.get("facilitator_url") or "")
    if own:
        return own, facilitator_auth(raw.get("facilitator_auth"), where=f"{caip2} facilitator")
    return settings.X402_FACILITATOR_URL, facilitator_auth(
        getattr(settings, "X402_FACILITATOR_AUTH", None), where="global facilitator"
    )


def _finality(caip2: str, raw: dict) -> str:
    """Raises ImproperlyConfigured for a policy we do not know (a typo must not mean
    "final at once")."""
    policy = str(raw.get("finality") or "depth")
    if policy not in FINALITY_POLICIES:
        raise ImproperlyConfigured(f"{caip2}: finality must be one of {FINALITY_POLICIES}")
    return policy


def explorer_tx_url(*, network: str, tx_hash: str | None) -> str | None:
    """The block explorer's page for a transaction, or None (no hash, a local chain, or a
    network we do not settle on)."""
    template = settings.X402_NETWORKS.get(network, {}).get("explorer_tx_url", "")
    if not tx_hash or not template:
        return None
    return str(template).replace("{tx_hash}", tx_hash)
