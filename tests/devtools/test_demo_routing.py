"""The demo's one address routes by path as production's balancer does (docs/deployment.md):
the x402 paid URL and the MCP door to the ASGI role, where a payment waiting for its block
holds no thread, the rest to the WSGI role. Through the real demo (scripts/demo.py, its
supervised processes), then a paid purchase by the stock x402 client at the banner's URL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from devtools.demo_router import haproxy_acls, routes_to_asgi

ROOT = Path(__file__).resolve().parents[2]
REPORT_INPUT = {"title": "Routed", "csv": "region,units\nnorth,3\nsouth,5\n"}
# What each role's server names itself: gunicorn's gthread (WSGI) and uvicorn (ASGI).
WSGI, ASGI = "gunicorn", "uvicorn"


@pytest.mark.parametrize(
    ("path", "to_asgi"),
    [
        ("/x402/csv-report", True),
        ("/x402/csv-report/", True),
        ("/mcp", True),
        ("/mcp/sse", True),
        ("/mcp/messages/", True),
        ("/x402/purchases/pur_abc/token", False),  # a status URL: the WSGI role
        ("/x402/legacy-api/items/7", True),  # an offering sold as a path prefix
        ("/mcpx", False),
        ("/api/v1/quotes", False),
        ("/.well-known/x402", False),
        ("/admin/", False),
        ("/readyz", False),
    ],
)
def test_the_demos_routing_rule_is_the_balancers(path: str, to_asgi: bool) -> None:
    assert routes_to_asgi(path) is to_asgi


def test_the_haproxy_acls_are_built_from_the_same_rule() -> None:
    from bench.hosts_net import HAPROXY_CONFIG

    assert "{acls}" in HAPROXY_CONFIG
    assert "acl paid_url path_reg ^/x402/[^/]+(/.*)?$" in haproxy_acls()


def _served_by(response: requests.Response) -> str:
    return response.headers.get("Server", "")


def test_the_demos_one_address_routes_paid_urls_to_asgi_and_a_stock_client_buys_there(
    running_demo,
) -> None:
    env, banner = running_demo
    base = f"http://127.0.0.1:{env['DEMO_PORT']}"
    var = Path(env["TOLLBOOTH_VAR_DIR"])
    chain = json.loads((var / "demo-chain.json").read_text())
    paid_url = chain["paid_urls"]["csv-report"]
    # The banner names the paid URLs and the MCP door at its one address.
    assert paid_url == f"{base}/x402/csv-report"
    assert f"    {paid_url}\n" in banner
    assert f"MCP tools      {base}/mcp " in banner
    assert chain["mcp_url"] == f"{base}/mcp"

    # The paid URL's 402 comes from the ASGI role; the status URLs, the API, the admin,
    # discovery and health from the WSGI role.
    offer = requests.post(paid_url, json=REPORT_INPUT, timeout=30)
    assert offer.status_code == 402, offer.text
    assert _served_by(offer) == ASGI
    with requests.get(f"{base}/mcp/sse", stream=True, timeout=30) as sse:
        assert sse.status_code == 200
        assert sse.headers["Content-Type"].startswith("text/event-stream")
        assert _served_by(sse) == ASGI
        assert next(sse.iter_lines()).startswith(b"event: endpoint")  # streamed at once
    for path in ("/readyz", "/api/v1/offerings", "/admin/login/", "/.well-known/x402",
                 "/x402/purchases/pur_nothing/token"):  # fmt: skip
        answer = requests.get(f"{base}{path}", timeout=30)
        assert answer.status_code < 500, (path, answer.status_code)
        assert _served_by(answer) == WSGI, path

    # The stock client (docs/examples/x402_buy.py, as it is) buys at the banner's URL.
    buyer = chain["buyers"][1]
    wallet = {"BUYER_KEY": buyer["private_key"], "NETWORK": chain["network"]}
    bought = subprocess.run(
        [sys.executable, "docs/examples/x402_buy.py", paid_url, json.dumps(REPORT_INPUT)],
        cwd=ROOT,
        env={**env, **wallet, "TOKEN": chain["token"], "TIMEOUT": "90"},
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert bought.returncode == 0, bought.stdout + bought.stderr
    got = json.loads(bought.stdout.splitlines()[-1])
    assert got["outcome"] == "response" and got["status"] == 200, got
    assert got["headers"]["server"] == ASGI
    assert "payment-response" in got["headers"]
    assert json.loads(got["body"])["title"] == "Routed", got["body"]

    # The access logs agree: the paid calls reached the ASGI role, never the WSGI one.
    asgi_log = (var / "logs" / "mcp.log").read_text()
    wsgi_log = (var / "logs" / "web.log").read_text()
    assert '"POST /x402/csv-report HTTP/1.1" 200' in asgi_log
    assert "POST /x402/csv-report" not in wsgi_log
    assert "GET /readyz" in wsgi_log
