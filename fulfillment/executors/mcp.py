"""The `mcp` executor: the work is one tool call on the seller's MCP server (Streamable HTTP).

The purchase's key travels in the call's `_meta` (`tollbooth/idempotency_key`,
`tollbooth/purchase`), but MCP has no standard idempotency: a call whose outcome is unknown
(timeout, dropped connection, an error result) is escalated at once rather than repeated,
unless the seller declared the tool idempotent (then it is retried like `http`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from datetime import timedelta
from typing import Any

from fulfillment.executors.base import (
    ExecutorError,
    JobOutput,
    JobSpec,
    JobStatus,
    Started,
    UpstreamSpec,
)

_REF_PREFIX = "mcp_"


class McpExecutor:
    name = "mcp"
    finishes_in_start = True

    def __init__(self, upstream: UpstreamSpec) -> None:
        self.upstream = upstream

    def start(self, job: JobSpec) -> Started:
        up = self.upstream
        try:
            result = asyncio.run(asyncio.wait_for(_call(up, job), timeout=up.timeout + 5))
        except Exception as exc:
            raise ExecutorError(
                "upstream_unreachable", f"tools/call {up.tool}: {exc!r}", retryable=up.idempotent
            ) from exc
        if result.isError:
            # A tool error proves nothing about its effect: never "failed", never refunded.
            raise ExecutorError("upstream_tool_error", _text(result)[:300], retryable=up.idempotent)
        output = _output(result)
        if len(output.content) > up.max_result_bytes:
            raise ExecutorError(
                "upstream_result_too_large",
                f"answer over {up.max_result_bytes} bytes: the work ran, the result is not kept",
                retryable=False,
            )
        ref = _REF_PREFIX + hashlib.sha256(job.idempotency_key.encode()).hexdigest()[:32]
        return Started(job_ref=ref, output=output)

    def poll(self, job_ref: str) -> JobStatus:
        return JobStatus.SUCCEEDED if job_ref.startswith(_REF_PREFIX) else JobStatus.UNKNOWN

    def fetch(self, job_ref: str) -> JobOutput:
        raise ExecutorError("result_unavailable", "an MCP tool's answer is not kept upstream")


async def _call(up: UpstreamSpec, job: JobSpec) -> Any:
    # Imported here: the MCP client is needed only by offerings that use it.
    import httpx
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    meta = {
        "tollbooth/idempotency_key": job.idempotency_key,
        "tollbooth/purchase": job.purchase_ref,
    }
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(up.timeout)) as http,
        streamable_http_client(up.url, http_client=http) as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        return await session.call_tool(
            up.tool,
            job.input,
            read_timeout_seconds=timedelta(seconds=up.timeout),
            meta=meta,
        )


def tool_names(up: UpstreamSpec) -> list[str]:
    """The server's tools (initialize + tools/list: no tool is called). For checks."""
    return asyncio.run(asyncio.wait_for(_list(up), timeout=up.timeout + 5))


async def _list(up: UpstreamSpec) -> list[str]:
    import httpx
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(up.timeout)) as http,
        streamable_http_client(up.url, http_client=http) as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        return [tool.name for tool in (await session.list_tools()).tools]


def _text(result: Any) -> str:
    return "\n".join(getattr(block, "text", "") for block in result.content)


def _output(result: Any) -> JobOutput:
    if result.structuredContent is not None:
        body = json.dumps(result.structuredContent, sort_keys=True, separators=(",", ":"))
        return JobOutput(content=body.encode(), content_type="application/json")
    return JobOutput(content=_text(result).encode(), content_type="text/plain; charset=utf-8")
