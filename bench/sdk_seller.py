"""The anchor: the `x402` package's own FastAPI seller, as a seller following the SDK builds it.

Its payment middleware, an `x402ResourceServer` with the exact-EVM server scheme, and an
in-process facilitator (its `FacilitatorWeb3Signer` broadcasting on the bench's anvil)
instead of an HTTP facilitator. The signer blocks (web3, `time.sleep` between receipt
reads), so the facilitator is the SDK's synchronous one (`x402FacilitatorSync`, which the
SDK offers for blocking signers) and its verify and settle run on a pool of
SETTLEMENT_THREADS threads, off uvicorn's event loop: what the SDK's README pairs FastAPI
with is a remote facilitator over HTTP, whose calls never block the loop either. The pool's
size is the anchor's concurrency: 32, as many as the most agents a figure drives at
2-second blocks, so the anchor never queues a payment behind a busy thread there
(`SDK_SETTLEMENT_THREADS` changes it). Until issue 22 the async facilitator ran the blocking
signer on the event loop itself: one settlement at a time, and every missed receipt read
stalled the whole process for 100 ms (docs/benchmarks.md, the superseded figures). The paid
route runs the same report computation as Tollbooth's `report` offering, so both sell the
same work.

    uvicorn bench.sdk_seller:app   # env: RPC_URL, TOKEN, PAY_TO, PRICE, FACILITATOR_KEY
"""

from __future__ import annotations

import asyncio
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request, Response
from x402 import x402FacilitatorSync, x402ResourceServer
from x402.http.middleware.fastapi import payment_middleware
from x402.http.types import PaymentOption, RouteConfig
from x402.mechanisms.evm.exact.register import (
    register_exact_evm_facilitator,
    register_exact_evm_server,
)
from x402.mechanisms.evm.signers import FacilitatorWeb3Signer
from x402.schemas import (
    AssetAmount,
    PaymentPayload,
    PaymentRequirements,
    SettleResponse,
    SupportedResponse,
    VerifyResponse,
)

from fulfillment.executors.base import JobSpec
from fulfillment.executors.report import ReportExecutor

NETWORK = "eip155:31337"
PATH = "/report"
# The anchor's concurrency: settlements waiting for their receipt at once (module docstring).
SETTLEMENT_THREADS = int(os.environ.get("SDK_SETTLEMENT_THREADS", "32"))


class InProcessFacilitatorClient:
    """The resource server's facilitator client, answered by the SDK's synchronous
    facilitator in this process, on a thread pool: a blocking receipt wait holds one of the
    pool's threads, never the event loop."""

    def __init__(self, facilitator: x402FacilitatorSync, threads: int) -> None:
        self._facilitator = facilitator
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="x402-settle")

    async def verify(
        self, payload: PaymentPayload, requirements: PaymentRequirements
    ) -> VerifyResponse:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, self._facilitator.verify, payload, requirements
        )

    async def settle(
        self, payload: PaymentPayload, requirements: PaymentRequirements
    ) -> SettleResponse:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, self._facilitator.settle, payload, requirements
        )

    def get_supported(self) -> SupportedResponse:
        return self._facilitator.get_supported()


def build_app(*, rpc_url: str, token: str, pay_to: str, price: int, facilitator_key: str) -> Any:
    signer = FacilitatorWeb3Signer(private_key=facilitator_key, rpc_url=rpc_url)
    facilitator = register_exact_evm_facilitator(x402FacilitatorSync(), signer, networks=NETWORK)
    client = InProcessFacilitatorClient(facilitator, SETTLEMENT_THREADS)
    server = register_exact_evm_server(x402ResourceServer(client), networks=NETWORK)
    price_option = AssetAmount(
        amount=str(price), asset=token, extra={"name": "USDC", "version": "2"}
    )
    routes = {
        f"POST {PATH}": RouteConfig(
            accepts=PaymentOption(
                scheme="exact", pay_to=pay_to, price=price_option, network=NETWORK
            ),
            description="CSV statistics report",
            mime_type="application/json",
        )
    }
    app = FastAPI()
    gate = payment_middleware(routes, server)

    @app.middleware("http")
    async def x402_gate(request: Request, call_next: Any) -> Any:
        return await gate(request, call_next)

    @app.post(PATH)
    async def report(request: Request) -> Response:
        job = JobSpec(purchase_ref="sdk", operation="report", input=await request.json(),
                      idempotency_key=uuid.uuid4().hex)  # fmt: skip
        output = ReportExecutor().start(job).output
        assert output is not None
        return Response(output.content, media_type=output.content_type)

    return app


def _app_from_env() -> Any:
    if "RPC_URL" not in os.environ:
        return None  # imported for its types, not served
    return build_app(
        rpc_url=os.environ["RPC_URL"],
        token=os.environ["TOKEN"],
        pay_to=os.environ["PAY_TO"],
        price=int(os.environ["PRICE"]),
        facilitator_key=os.environ["FACILITATOR_KEY"],
    )


app = _app_from_env()
