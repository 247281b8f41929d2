"""How often a broadcast looks for its receipt: at once, then closer to the chain's pace.

A fixed 0.25 s sleep made every settlement on a fast chain (anvil with automine, a rollup
sequencer that confirms in tens of milliseconds) wait a whole interval for a receipt that was
there a few milliseconds after the send. The first looks come quickly and the gaps double up
to the settler's interval, so a slow chain costs a handful of extra cheap reads per
settlement, never a faster steady rate.

On the ASGI role's event loop a waiting payment does not keep that schedule: it looks once
per block, right after it (`chain_head_pacing`, core.waits). One watcher per event loop and
node asks for the head (eth_blockNumber) every HEAD_LOOK_SECONDS while any payment waits and
wakes them all when it moves. At 2-second blocks a paid call made 2.1 to 3 receipt looks
instead of 5.6 to 12.3 (32 to 1 agents, the tests' anvil behind a counting proxy), and a payment
sees its block within about 0.05 s of it instead of 0.25 s. A payment still looks every
PACED_CEILING_SECONDS should the head look fail.
"""

from __future__ import annotations

from collections.abc import Iterator

from core.waits import Pacing
from payments.rails.x402.rpc import JsonRpcClient, quantity

FIRST_LOOK_SECONDS = 0.005
GROWTH = 2.0
HEAD_LOOK_SECONDS = 0.05
PACED_CEILING_SECONDS = 2.0
# After a block, a watcher that learnt the chain's clock does not look for this share of it.
HEAD_QUIET_FRACTION = 0.75


def receipt_poll_delays(*, ceiling: float, first: float = FIRST_LOOK_SECONDS) -> Iterator[float]:
    """Sleeps between receipt look-ups: `first`, doubling, then `ceiling` for ever."""
    delay = min(first, ceiling)
    while True:
        yield delay
        delay = min(delay * GROWTH, ceiling)


def chain_head_pacing(rpc: JsonRpcClient) -> Pacing:
    """Receipt looks on an event loop paced by the head of `rpc`'s node: one watcher per
    event loop and node URL (an error or a reply that is not a block number is no new block)."""
    return Pacing(
        key=("chain head", rpc.url),
        look=lambda: quantity(rpc.call("eth_blockNumber")),
        interval=HEAD_LOOK_SECONDS,
        ceiling=PACED_CEILING_SECONDS,
        # No head look for 3/4 of the block time it learns (Base's 2 s: ~10 looks a block,
        # not 40; Ethereum's 12 s: ~60, not 240), counted against a hosted node's quota.
        quiet=HEAD_QUIET_FRACTION,
    )
