"""One set of the seller's own wallets (purchases.selectors.seller_wallets) for both its
readers: a refund's payback is trusted from one on the refund's network, and the books flag
a payment from one (on any network) as no revenue."""

from __future__ import annotations

import pytest
from eth_account import Account

from payments.models import RelayerAccount
from purchases.selectors import seller_wallets
from tests.factories import OfferingFactory

pytestmark = pytest.mark.django_db

HERE, THERE = "eip155:31337", "eip155:84532"
RECIPIENT_HERE = "0x" + "A1" * 20
RECIPIENT_THERE = "0x" + "B2" * 20
RELAYER_HERE = "0x" + "C3" * 20
RELAYER_THERE = "0x" + "D4" * 20
TREASURY = "0x" + "E5" * 20


@pytest.fixture
def wallets_on_two_networks(settings):
    OfferingFactory(slug="here", network=HERE, pay_to=RECIPIENT_HERE)
    OfferingFactory(slug="there", network=THERE, pay_to=RECIPIENT_THERE)
    RelayerAccount.objects.create(network=HERE, address=RELAYER_HERE)
    RelayerAccount.objects.create(network=THERE, address=RELAYER_THERE)
    key = Account.create()
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "SELLER_WALLETS": [TREASURY]}
    settings.X402_NETWORKS = {
        HERE: {**settings.X402_NETWORKS.get(HERE, {}), "relayer_private_key": key.key.hex()},
        THERE: {
            k: v
            for k, v in settings.X402_NETWORKS.get(HERE, {}).items()
            if k != "relayer_private_key"
        },
    }
    return str(key.address).lower()


def test_one_network_holds_its_recipients_relayers_and_the_listed_wallets(wallets_on_two_networks):
    configured = wallets_on_two_networks
    assert seller_wallets(network=HERE) == {
        RECIPIENT_HERE.lower(),
        RELAYER_HERE.lower(),
        configured,
        TREASURY.lower(),
    }
    assert seller_wallets(network=THERE) == {
        RECIPIENT_THERE.lower(),
        RELAYER_THERE.lower(),
        TREASURY.lower(),
    }


def test_every_network_is_the_union_of_each(wallets_on_two_networks):
    assert seller_wallets() == seller_wallets(network=HERE) | seller_wallets(network=THERE)
