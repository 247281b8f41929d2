"""A refund wallet on the test's x402 world: a fresh key (never one from the repository),
ETH for gas and test USDC minted to it, named to settings as the environment would."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eth_account.signers.local import LocalAccount

from devtools.test_token import mint
from payments.chain.token import balance_of
from payments.models import Refund
from tests.factories import PaymentAttemptFactory, PurchaseFactory, RefundFactory
from tests.x402.e2e import NETWORK, PRICE, X402World

WALLET_FUNDS = 100 * PRICE
FINALITY_DEPTH = 3


@dataclass
class PayoutWorld:
    world: X402World
    wallet: LocalAccount

    def balance(self, holder: str) -> int:
        return balance_of(self.world.w3, self.world.token, holder)

    def wallet_sent(self) -> int:
        """Transactions the refund wallet ever got mined or pending."""
        return int(self.world.w3.eth.get_transaction_count(self.wallet.address, "pending"))

    def owed_refund(self, payer: LocalAccount | None = None, amount: int = PRICE) -> Refund:
        """A chain refund owed to `payer` for a purchase of the world's offering."""
        payer = payer or self.world.payers[0]
        purchase = PurchaseFactory.create(quote__offering=self.world.offering, paid=True)
        attempt = PaymentAttemptFactory.create(
            purchase=purchase,
            payer=payer.address,
            network=NETWORK,
            asset=self.world.token,
            amount=PRICE,
            succeeded=True,
        )
        return RefundFactory.create(payment_attempt=attempt, amount=amount)


def add_refund_wallet(
    world: X402World, settings: Any, *, cap: int = 10 * PRICE, funds: int = WALLET_FUNDS
) -> PayoutWorld:
    """Fund a new refund wallet and point settings at it: its key as
    X402_LOCAL_REFUND_WALLET_KEY would set it, the day's cap for the world's token."""
    wallet = world.new_account()
    if funds:
        mint(world.w3, world.token, world.deployer, wallet.address, funds)
    world.network_settings["refund_wallet_key"] = wallet.key.hex()
    world.network_settings["finality_depth"] = FINALITY_DEPTH
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "PAYOUT_DAILY_CAPS": {world.token.lower(): cap}}
    return PayoutWorld(world, wallet)


def worker_env(payout_world: PayoutWorld, rpc_url: str | None = None) -> dict[str, str]:
    """The same configuration for a worker process, through its environment."""
    world = payout_world.world
    return {
        "X402_LOCAL_RPC_URL": rpc_url or world.node.rpc_url,
        "X402_LOCAL_TOKEN": world.token,
        "X402_LOCAL_RELAYER_KEY": world.relayer.key.hex(),
        "X402_LOCAL_MODE": "direct",
        "X402_LOCAL_FINALITY_DEPTH": str(FINALITY_DEPTH),
        "X402_LOCAL_REFUND_WALLET_KEY": payout_world.wallet.key.hex(),
        "TOLLBOOTH_PAYOUT_DAILY_CAPS": f"{world.token.lower()}={10 * PRICE}",
        "TOLLBOOTH_PAYOUT_BROADCAST_GRACE_SECONDS": "1",
        "TOLLBOOTH_PAYOUT_RECHECK_SECONDS": "1",
    }
