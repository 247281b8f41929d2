"""The finality policy per network: documented defaults, and no silent typo."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from payments.rails.x402.networks import network_config


def test_defaults_local_by_depth_base_by_the_finalized_tag():
    local = network_config("eip155:31337")
    assert (local.finality, local.finality_depth) == ("depth", 3)
    for base in ("eip155:84532", "eip155:8453"):
        config = network_config(base)
        assert (config.finality, config.finality_depth) == ("finalized", 64)


def test_depth_defaults_to_the_confirmations_when_unset(settings):
    raw = {k: v for k, v in settings.X402_NETWORKS["eip155:31337"].items()}
    raw.pop("finality_depth")
    raw.pop("finality")
    settings.X402_NETWORKS = {**settings.X402_NETWORKS, "eip155:31337": raw}
    config = network_config("eip155:31337")
    assert (config.finality, config.finality_depth) == ("depth", raw["confirmations"])


def test_an_unknown_policy_is_refused_not_taken_as_final(settings):
    raw = {**settings.X402_NETWORKS["eip155:31337"], "finality": "finalised"}
    settings.X402_NETWORKS = {**settings.X402_NETWORKS, "eip155:31337": raw}
    with pytest.raises(ImproperlyConfigured, match="finality must be one of"):
        network_config("eip155:31337")
