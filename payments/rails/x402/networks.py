"""Network configuration from settings, one place."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

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
        facilitator_url=raw.get("facilitator_url") or settings.X402_FACILITATOR_URL,
        facilitator_timeout=float(
            raw.get("facilitator_timeout") or settings.X402_FACILITATOR_TIMEOUT
        ),
        relayer_private_key=raw.get("relayer_private_key", ""),
        max_timeout_seconds=int(raw.get("max_timeout_seconds", 300)),
        explorer_tx_url=raw.get("explorer_tx_url", ""),
        finality=_finality(caip2, raw),
        finality_depth=int(raw.get("finality_depth") or raw["confirmations"]),
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
