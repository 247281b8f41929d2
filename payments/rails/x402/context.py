"""One x402 attempt's way to the money, derived once per paid request (issue 20 §1).

Every step of a paid request (verify, verify funds, record, settle, describe it on the
timeline, judge a resend) needs the same three things: the network's configuration, the
settler its mode names, and the buyer's parsed authorization. `X402Rail.verify` builds them
once; the orchestration hands the context on (to `verify_funds`, then through the `Charge`
to `record`, which keeps it on the attempt instance it returns), so the later steps read it
instead of deriving it again. An attempt read back from the database has none: the rail
derives it from the row once, and keeps it on that instance the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from payments.rails.x402.settlers import settler_for
from payments.rails.x402.types import Authorization, NetworkConfig, Settler


@dataclass(frozen=True)
class X402Context:
    """What never changes for one attempt: its network (by id, as recorded), the buyer's
    signed authorization, and the settler of the network's mode."""

    network: NetworkConfig
    authorization: Authorization

    @cached_property
    def settler(self) -> Settler:
        # Built on first use: a request refused before settling never needs one.
        return settler_for(self.network)
