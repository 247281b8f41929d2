"""A scripted agent that buys a report the disciplined way, prepaid or over x402.

It writes its payment id (and, for x402, the signed payment) to disk before sending,
retries with the same id, and looks the purchase up instead of paying again.
Usage: demo_agent.py [--x402 | --mcp] [BASE_URL]
--mcp calls the `counted-echo` tool on the demo's MCP endpoint with the official x402 MCP
client (`x402.mcp`), paying from the first demo wallet; the work runs on the demo's sample
upstream, whose own count of effects it prints after the call. Run it twice: the second
call is answered from the same purchase (inside the duplicate window), never charged again,
and the count does not move.
It prints the purchase ref (what support looks up in the admin) and the receipt. It reads
the demo's credentials and chain details from $TOLLBOOTH_VAR_DIR (default ./var), as
`make demo` writes them. A 503 or 429 (an outage, a rate limit) is waited out as its
Retry-After says, on every step, as a disciplined agent does; nothing is paid twice for it.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
USE_X402 = "--x402" in sys.argv
USE_MCP = "--mcp" in sys.argv
# The demo's files, wherever `make demo` put them (it honours TOLLBOOTH_VAR_DIR too).
VAR = Path(os.environ.get("TOLLBOOTH_VAR_DIR") or ROOT / "var")
CHAIN = VAR / "demo-chain.json"


def _default_base() -> str:
    """Where the running demo listens: its chain file says (DEMO_HOST / DEMO_PORT)."""
    if CHAIN.exists():
        return str(json.loads(CHAIN.read_text()).get("base_url") or "http://127.0.0.1:8000")
    host, port = os.environ.get("DEMO_HOST", "127.0.0.1"), os.environ.get("DEMO_PORT", "8000")
    return f"http://{host}:{port}"


BASE = ARGS[0] if ARGS else _default_base()
# Answers that mean "not now": waited out for their Retry-After, then the same request again.
NOT_NOW = (429, 503)
PATIENCE = 20  # tries of one step before giving up
REPORT_INPUT = {"title": "Demo sales", "csv": "region,units\nnorth,3\nsouth,5\neast,8\n"}
CREDENTIALS = VAR / "demo-credentials.json"
JOURNAL = VAR / "demo-agent-journal.json"


def send(method: str, url: str, *, timeout: float, **kwargs: Any) -> requests.Response:
    """One step of the purchase, the same request again after each 503/429 for as long as
    its Retry-After says (an outage is not a refusal: nothing was done or charged)."""
    for _ in range(PATIENCE):
        response = requests.request(method, url, timeout=timeout, **kwargs)
        if response.status_code not in NOT_NOW:
            return response
        wait = int(response.headers.get("Retry-After", "1"))
        print(f"  {response.status_code} {_code(response)}: trying again in {wait} s")
        time.sleep(wait)
    return response


def _code(response: requests.Response) -> str:
    try:
        return str(response.json().get("code", ""))
    except ValueError:
        return response.reason or ""


def _demo_file(path: Path) -> Any:
    """A file `make demo` wrote; a clear word and exit 2 when there is none."""
    if not path.exists():
        sys.exit(
            f"demo_agent: {path} is not there: start the demo (make demo) first, or set "
            "TOLLBOOTH_VAR_DIR to the directory it printed (its banner's 'Try it' lines say)."
        )
    return json.loads(path.read_text())


def buy_over_x402() -> int:
    """402 -> sign an EIP-3009 authorization -> resend with PAYMENT-SIGNATURE until settled."""
    from eth_account import Account
    from x402.http.utils import decode_payment_response_header

    from devtools.x402_signer import payment_signature_for

    chain = _demo_file(CHAIN)
    wallet = Account.from_key(chain["buyers"][0]["private_key"])
    url = chain["paid_urls"]["csv-report"]
    offer = send("POST", url, json=REPORT_INPUT, timeout=10)
    print("offer", offer.status_code, offer.json()["code"], "quote", offer.json()["quote"])
    payment_id = f"demo-x402-{secrets.token_hex(10)}"
    header = payment_signature_for(
        offer.headers["PAYMENT-REQUIRED"], wallet, payment_id, chain_id=chain["chain_id"]
    )
    # The signed payment is written down before it is sent: after a crash, resend this.
    JOURNAL.write_text(json.dumps({"payment_id": payment_id, "payment_signature": header}))
    for _ in range(60):
        response = send(
            "POST", url, json=REPORT_INPUT, headers={"PAYMENT-SIGNATURE": header}, timeout=60
        )
        if response.status_code not in (202, 409):
            break
        print(
            "  ", response.status_code, response.json().get("status") or response.json().get("code")
        )
        time.sleep(int(response.headers.get("Retry-After", "1")))
    print("paid", response.status_code, response.headers.get("Content-Type"))
    if "PAYMENT-RESPONSE" in response.headers:
        settle = decode_payment_response_header(response.headers["PAYMENT-RESPONSE"])
        print("settlement", settle.success, settle.transaction, settle.network)
    print(json.dumps(response.json(), indent=2)[:600])
    receipt_link = response.links.get("receipt", {}).get("url")
    if receipt_link:  # the receipt names the purchase: what to quote to support
        receipt = send("GET", urljoin(url, receipt_link), timeout=10).json()
        print("purchase", receipt["purchase"])
        print("receipt", json.dumps(receipt, indent=2))
    return 0 if response.status_code == 200 else 1


MCP_INPUT = {"message": "hello from the demo agent"}


async def _mcp_call(chain: dict) -> Any:
    """One tools/call by the stock x402 MCP client: it probes, signs the offer, pays."""
    from datetime import timedelta

    from eth_account import Account
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from x402 import x402Client
    from x402.mcp import x402MCPSession
    from x402.mechanisms.evm.exact import ExactEvmClientScheme

    client = x402Client()
    signer = Account.from_key(chain["buyers"][0]["private_key"])
    client.register(chain["network"], ExactEvmClientScheme(signer=signer))
    # The client pays well-known USDC only: the demo's test token must be allowed.
    client.set_spend_controls(
        {"allowed_assets": [{"network": chain["network"], "asset": chain["token"]}]}
    )
    async with (
        streamable_http_client(chain["mcp_url"]) as (read, write, _),
        ClientSession(read, write) as mcp_session,
    ):
        session = x402MCPSession(mcp_session, client)
        await session.initialize()
        return await session.call_tool(
            chain["upstream"]["offering"], MCP_INPUT, read_timeout_seconds=timedelta(seconds=60)
        )


def buy_over_mcp() -> int:
    """Call the tool until its result is there: a pending answer is repeated (the client
    re-signs; the same purchase answers it, never a second charge)."""
    import asyncio

    chain = _demo_file(CHAIN)
    for _ in range(30):
        result = asyncio.run(_mcp_call(chain))
        meta = (result.raw_result.meta if result.raw_result else None) or {}
        text = result.content[0].text
        # Pending is an error result that says so (docs/mcp.md): never taken for the result.
        said = (result.raw_result.structuredContent if result.raw_result else None) or {}
        if said.get("state") != "pending":
            break
        print("  pending:", said.get("awaiting"), "ask again in", said.get("retry_after_seconds"))
        time.sleep(int(meta.get("tollbooth/retry-after", 1)))
    settle = meta.get("x402/payment-response") or {}
    print("paid", "error" if result.is_error else "ok", "settlement", settle.get("transaction"))
    if meta.get("tollbooth/duplicate-of"):
        print("duplicate of", meta["tollbooth/duplicate-of"], "(answered, not charged again)")
    links = [item.uri for item in result.content if getattr(item, "type", "") == "resource_link"]
    if links:  # the receipt names the purchase: what to quote to support
        print("purchase", requests.get(str(links[-1]), timeout=10).json()["purchase"])
    print("result", text[:600])
    stats = requests.get(chain["upstream"]["stats_url"], timeout=10).json()
    print("upstream effects", stats["effects"], "calls", stats["calls"])
    return 1 if result.is_error else 0


def main() -> int:
    if USE_MCP:
        return buy_over_mcp()
    if USE_X402:
        return buy_over_x402()
    api_key = _demo_file(CREDENTIALS)["demo-agent-alice"]
    headers = {"Authorization": f"Bearer {api_key}"}
    request = {"offering": "csv-report", "input": REPORT_INPUT}
    quoted = send("POST", f"{BASE}/api/v1/quotes", json=request, headers=headers, timeout=10)
    quote = quoted.json()
    if quoted.status_code not in (200, 201):
        print("quote", quoted.status_code, quote.get("code"), quote.get("detail"))
        return 1
    print("quote", quote["id"], "price", quote["price"], "expires", quote["expires_at"])

    # Store the payment id and request durably *before* sending: a crash after this point
    # retries with the same id instead of paying twice.
    payment_id = f"demo-{secrets.token_hex(12)}"
    JOURNAL.write_text(json.dumps({"payment_id": payment_id, "quote": quote["id"]}))
    purchase_url = f"{BASE}/api/v1/quotes/{quote['id']}/purchase"
    for _ in range(10):
        response = send(
            "POST",
            purchase_url,
            json={"rail": "prepaid"},
            timeout=10,
            headers={**headers, "Idempotency-Key": payment_id},
        )
        if response.status_code != 409 or response.json()["code"] != "payment_in_flight":
            break
        time.sleep(int(response.headers.get("Retry-After", "1")))
    body = response.json()
    print("purchase", response.status_code, body.get("purchase"), body.get("code", ""))
    if response.status_code not in (200, 201):  # 200: the stored answer of an earlier try
        return 1
    result_url = f"{BASE}{body['links']['result']}"
    for _ in range(60):
        result = send("GET", result_url, headers=headers, timeout=10)
        if result.status_code != 202:
            break
        time.sleep(int(result.headers.get("Retry-After", "1")))
    print("result", result.status_code, result.headers.get("Content-Type"))
    print(json.dumps(result.json(), indent=2)[:800])
    status = send("GET", f"{BASE}{body['links']['self']}", headers=headers, timeout=10).json()
    receipt = send("GET", f"{BASE}{status['links']['receipt']}", timeout=10).json()
    print("receipt", json.dumps(receipt, indent=2))
    return 0 if result.status_code == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
