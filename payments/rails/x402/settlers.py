"""Which settler a network uses: one line per mode."""

from __future__ import annotations

import importlib

from payments.rails.x402.types import NetworkConfig, Settler

_SETTLERS = {
    "direct": "payments.rails.x402.direct.DirectSettler",
    "facilitator": "payments.rails.x402.facilitator.FacilitatorSettler",
}


def settler_for(network: NetworkConfig) -> Settler:
    module_name, _, attr = _SETTLERS[network.mode].rpartition(".")
    settler: Settler = getattr(importlib.import_module(module_name), attr)()
    return settler
