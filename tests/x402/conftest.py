"""Fixtures of the x402 suite: a chain context per test on the session's anvil nodes.

The `x402_*world` fixtures live in tests/x402/e2e.py (the reconciliation suite uses them
too); nodes, fresh keys and token deployment in tests/fixtures/anvil.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devtools.anvil import AnvilNode
from devtools.facilitator_double import FacilitatorDouble
from payments.rails.x402.chain import ChainReader
from payments.rails.x402.types import NetworkConfig, Requirements
from tests.fixtures.anvil import closed_port_url
from tests.x402.chain_env import ChainEnv, FacilitatorChain, make_env, make_facilitator_chain
from tests.x402.rpc_proxy import RpcProxy


@pytest.fixture
def chain(anvil_node: AnvilNode) -> ChainEnv:
    return make_env(anvil_node)


@pytest.fixture
def network(chain: ChainEnv) -> NetworkConfig:
    return chain.network


@pytest.fixture
def requirements(chain: ChainEnv) -> Requirements:
    return chain.requirements()


@pytest.fixture
def reader(chain: ChainEnv) -> ChainReader:
    return chain.reader()


@pytest.fixture
def no_mining_chain(paused_anvil: AnvilNode) -> ChainEnv:
    """Transactions wait in the pool until mined by hand (`env.node.mine()`)."""
    env = make_env(paused_anvil)
    paused_anvil.set_automine(False)
    return env


@pytest.fixture
def direct_env(anvil_node: AnvilNode) -> ChainEnv:
    """For the direct settler: an automining node, a relayer of the test's own."""
    return make_env(anvil_node, confirmation_timeout=3.0)


@pytest.fixture
def paused_env(paused_anvil: AnvilNode) -> ChainEnv:
    """For the direct settler with mining paused after set-up: nothing mines until `mine()`."""
    env = make_env(paused_anvil, confirmation_timeout=0.5)
    paused_anvil.set_automine(False)
    return env


@pytest.fixture
def gap_env(anvil_node: AnvilNode) -> ChainEnv:
    """For tests that leave the relayer's nonces gapped: the relayer is the test's own, so
    its queued transactions block nobody else on the shared node."""
    return make_env(anvil_node, confirmation_timeout=0.5)


@pytest.fixture
def closed_rpc_url() -> str:
    return closed_port_url()


@pytest.fixture
def rpc_proxy(chain: ChainEnv) -> Iterator[RpcProxy]:
    """A recording JSON-RPC proxy in front of `chain`'s node."""
    proxy = RpcProxy(chain.node.rpc_url)
    yield proxy
    proxy.close()


@pytest.fixture
def facilitator_chain(anvil_node: AnvilNode) -> FacilitatorChain:
    return make_facilitator_chain(anvil_node)


@pytest.fixture
def facilitator_double(facilitator_chain: FacilitatorChain) -> Iterator[FacilitatorDouble]:
    """A facilitator double on a free port, settling on `facilitator_chain`; mode `ok`."""
    with FacilitatorDouble(facilitator_chain.rpc_url, facilitator_chain.relayer) as double:
        yield double


@pytest.fixture
def facilitator_network(
    facilitator_chain: FacilitatorChain, facilitator_double: FacilitatorDouble
) -> NetworkConfig:
    """mode "facilitator", pointing at the double, facilitator_timeout = 1.5 s."""
    return facilitator_chain.network_config(facilitator_double.url)


@pytest.fixture(autouse=True)
def _paid_url_on_the_event_loop(settings) -> None:  # type: ignore[no-untyped-def]
    """The paid URL as the ASGI app serves it (config/urls_asgi.py): its wait for the block
    handed to an event loop (doors/x402/paid_async.py). Django's test client drives that
    view on the test's own thread, so every x402 test runs the handed-off path."""
    settings.ROOT_URLCONF = "config.urls_asgi"
