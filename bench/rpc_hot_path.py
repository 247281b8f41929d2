"""CPU of a direct settlement's chain traffic: web3.py (as before) against plain JSON-RPC.

A settlement here is what a paid x402 call asks of the chain in direct mode: verification's
funds_state, the relayer's prepare (fees, pending nonce, nonce allocation, signing) and the
broadcast (send, then receipt looks until confirmed). The anchor is the same three steps as
web3 did them (bench/web3_settlement.py, commit 94cd2e1, on `requests`); ours is
ChainReader.funds_state and DirectSettler as they are now (payments/rails/x402/rpc.py underneath,
on urllib3).

One anvil (automine) with the test USDC and a funded payer; each side its own relayer. Both
sides run in this process, back to back in every repeat, the order alternating. CPU is this
process's (`time.process_time`): anvil and PostgreSQL run in processes of their own and are
not counted, so the figure holds whatever the machine's load. Authorizations are signed
before the clock starts. HTTP requests are counted where each side sends them: the anchor's
on its per-thread `requests` session, ours on the thread's transport.

Run through the runner (it sets up Django and the bench database):

    .venv/bin/python bench/run.py --scale full --only bench.rpc_hot_path
"""

from __future__ import annotations

import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests
from eth_account import Account
from eth_account.signers.local import LocalAccount
from hexbytes import HexBytes

from bench.common import Figure, Scale
from core.waits import waited_out
from devtools.anvil import AnvilNode
from devtools.test_token import sign_transfer_authorization
from payments.rails.x402.types import Authorization, NetworkConfig, Requirements

PRICE = 10_000
TOKEN_NAME, TOKEN_VERSION = "USDC", "2"  # the EIP-712 domain the test USDC is deployed with
FUNDS = 1_000 * 10**6
ETH = 10**18
# (settlements per side per repeat, repeats); a few settlements per side warm up first.
SIZES = {Scale.SMOKE: (3, 1), Scale.FULL: (150, 5)}
WARM_UP = 5
STEPS = ("funds_state", "prepare", "broadcast")


class _CountingAdapter(requests.adapters.HTTPAdapter):
    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    def send(self, *args: Any, **kwargs: Any) -> requests.Response:
        self.sent += 1
        return super().send(*args, **kwargs)


@dataclass
class _Side:
    name: str
    settle: Callable[[NetworkConfig, Authorization], dict[str, float]]  # CPU seconds per step
    network: NetworkConfig
    cpu: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STEPS})
    per_repeat: list[float] = field(default_factory=list)  # CPU seconds per settlement
    requests: int = 0
    settlements: int = 0


def _timed(steps: dict[str, float], step: str, fn: Callable[[], Any]) -> Any:
    started = time.process_time()
    result = fn()
    steps[step] = time.process_time() - started
    return result


def _settle_web3(network: NetworkConfig, authorization: Authorization) -> dict[str, float]:
    from bench.web3_settlement import web3_broadcast, web3_funds_state, web3_prepare
    from payments.rails.x402.chain import ChainReader

    steps: dict[str, float] = {}

    def funds() -> Any:
        ChainReader(network)  # the rail builds a reader per request on either path
        return web3_funds_state(network, authorization.payer, authorization.nonce)

    used, _balance, _head = _timed(steps, "funds_state", funds)
    assert not used
    prepared = _timed(
        steps, "prepare", lambda: web3_prepare(authorization=authorization, network=network)
    )
    outcome = _timed(steps, "broadcast", lambda: web3_broadcast(network=network, prepared=prepared))
    assert outcome.status == "confirmed", outcome
    return steps


def _settle_plain(network: NetworkConfig, authorization: Authorization) -> dict[str, float]:
    from payments.rails.x402.chain import ChainReader
    from payments.rails.x402.direct import DirectSettler

    settler = DirectSettler()
    steps: dict[str, float] = {}
    requirements = Requirements(
        network=network.caip2,
        asset=network.token_address,
        amount=authorization.value,
        pay_to=authorization.to,
        max_timeout_seconds=300,
        quote_id=None,
    )

    def funds() -> Any:
        # A reader per request, as the rail builds it.
        return ChainReader(network).funds_state(authorization.payer, authorization.nonce)

    used, _balance, _head = _timed(steps, "funds_state", funds)
    assert not used
    prepared = _timed(
        steps, "prepare", lambda: settler.prepare(authorization=authorization, network=network)
    )
    outcome = _timed(
        steps,
        "broadcast",
        # Slept through on this thread, as a blocking caller does (core.waits).
        lambda: waited_out(
            settler.broadcast(
                authorization=authorization,
                requirements=requirements,
                network=network,
                prepared=prepared,
            )
        ),
    )
    assert outcome.status == "confirmed", outcome
    return steps


def _funded_key(node: AnvilNode) -> LocalAccount:
    account: LocalAccount = Account.create()
    node.rpc("anvil_setBalance", [account.address, hex(1_000 * ETH)])
    return account


def _network(node: AnvilNode, token: str, relayer: LocalAccount) -> NetworkConfig:
    return NetworkConfig(
        caip2=f"eip155:{node.chain_id}",
        chain_id=node.chain_id,
        rpc_url=node.rpc_url,
        token_address=token,
        token_name=TOKEN_NAME,
        token_version=TOKEN_VERSION,
        confirmations=1,
        confirmation_timeout=10.0,
        mode="direct",
        relayer_private_key=HexBytes(relayer.key).to_0x_hex(),
    )


def _authorizations(
    node: AnvilNode, token: str, payer: LocalAccount, count: int
) -> list[Authorization]:
    from payments.rails.x402.verify import parse_authorization

    now = int(node.w3().eth.get_block("latest")["timestamp"])
    seller = Account.create().address
    signed = [
        sign_transfer_authorization(
            payer,
            token_address=token,
            chain_id=node.chain_id,
            name=TOKEN_NAME,
            version=TOKEN_VERSION,
            to=seller,
            value=PRICE,
            valid_after=0,
            valid_before=now + 3600,
            nonce=secrets.token_bytes(32),
        )
        for _ in range(count)
    ]
    return [parse_authorization(one) for one in signed]


def _measure(side: _Side, authorizations: list[Authorization], sent: Callable[[], int]) -> None:
    sent_before, cpu = sent(), 0.0
    for authorization in authorizations:
        steps = side.settle(side.network, authorization)
        for step, seconds in steps.items():
            side.cpu[step].append(seconds)
        cpu += sum(steps.values())
    side.per_repeat.append(cpu / len(authorizations))
    side.requests += sent() - sent_before
    side.settlements += len(authorizations)


def _describe(side: _Side) -> str:
    steps = ", ".join(f"{s} {statistics.median(side.cpu[s]) * 1000:.2f}" for s in STEPS)
    return (
        f"{side.name}: {statistics.median(side.per_repeat) * 1000:.2f} ms CPU/settlement "
        f"(median per step: {steps}), {side.requests / side.settlements:.1f} HTTP requests"
    )


def run(scale: Scale) -> list[Figure]:
    from bench.web3_settlement import web3_session
    from payments.models import RelayerAccount
    from payments.rails.x402.rpc import thread_transport
    from tests.fixtures.anvil import deploy_funded_usdc  # dev tooling: batched mints

    per_repeat, repeats = SIZES[scale]
    with AnvilNode() as node:
        deployer, payer = _funded_key(node), _funded_key(node)
        token = deploy_funded_usdc(node, deployer, [payer.address], FUNDS)
        relayers = [_funded_key(node), _funded_key(node)]
        sides = [
            _Side("web3 (before)", _settle_web3, _network(node, token, relayers[0])),
            _Side("plain JSON-RPC (ours)", _settle_plain, _network(node, token, relayers[1])),
        ]
        web3_counter = _CountingAdapter()
        web3_session(node.rpc_url).mount("http://", web3_counter)
        transport = thread_transport(node.rpc_url)
        counters = {
            sides[0].name: lambda: web3_counter.sent,
            sides[1].name: lambda: transport.requests_sent,
        }
        try:
            for side in sides:  # imports, clients, contracts, connections: not counted
                for authorization in _authorizations(node, token, payer, WARM_UP):
                    side.settle(side.network, authorization)
            for repeat in range(repeats):
                for side in sides if repeat % 2 == 0 else sides[::-1]:
                    authorizations = _authorizations(node, token, payer, per_repeat)
                    _measure(side, authorizations, counters[side.name])
        finally:
            RelayerAccount.objects.filter(address__in=[r.address for r in relayers]).delete()
    web3_side, plain_side = sides
    ratios = [
        before / after
        for before, after in zip(web3_side.per_repeat, plain_side.per_repeat, strict=True)
    ]
    return [
        Figure(
            name="direct settlement's chain CPU, web3 / plain JSON-RPC",
            ratios=ratios,
            detail=f"{_describe(web3_side)}; {_describe(plain_side)}; "
            f"{per_repeat} settlements per side per repeat",
            extra={side.name: _describe(side) for side in sides},
        )
    ]
