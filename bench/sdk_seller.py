"""The anchor: the `x402` package's own FastAPI seller, as its README builds it.

Its payment middleware, an `x402ResourceServer` with the exact-EVM server scheme, and an
in-process `x402Facilitator` (its `FacilitatorWeb3Signer` broadcasting on the bench's anvil)
instead of an HTTP facilitator: the SDK's fastest configuration. The paid route runs the same
report computation as Tollbooth's `report` offering, so both sell the same work.

    uvicorn bench.sdk_seller:app   # env: RPC_URL, TOKEN, PAY_TO, PRICE, FACILITATOR_KEY
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from fastapi import FastAPI, Request, Response
from x402 import x402Facilitator, x402ResourceServer
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


class InProcessFacilitatorClient:
    """The resource server's facilitator client, answered by a facilitator in this process."""

    def __init__(self, facilitator: x402Facilitator) -> None:
        self._facilitator = facilitator

    async def verify(
        self, payload: PaymentPayload, requirements: PaymentRequirements
    ) -> VerifyResponse:
        return await self._facilitator.verify(payload, requirements)

    async def settle(
        self, payload: PaymentPayload, requirements: PaymentRequirements
    ) -> SettleResponse:
        return await self._facilitator.settle(payload, requirements)

    def get_supported(self) -> SupportedResponse:
        return self._facilitator.get_supported()


def build_app(*, rpc_url: str, token: str, pay_to: str, price: int, facilitator_key: str) -> Any:
    signer = FacilitatorWeb3Signer(private_key=facilitator_key, rpc_url=rpc_url)
    facilitator = register_exact_evm_facilitator(x402Facilitator(), signer, networks=NETWORK)
    server = register_exact_evm_server(
        x402ResourceServer(InProcessFacilitatorClient(facilitator)), networks=NETWORK
    )
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
