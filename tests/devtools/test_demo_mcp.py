"""`make demo` as a reader of the README runs it, then `demo_agent.py --mcp` in a second
terminal: the real demo (scripts/demo.py on its embedded defaults: its chain, web, MCP server,
worker and the sample upstream as supervised processes) and the official x402 MCP client.
The upstream's own count shows one effect, and the agent's repeated call none more."""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import requests

from devtools.sample_upstream import DEMO_OFFERING
from tests.fixtures.demo import demo_env

ROOT = Path(__file__).resolve().parents[2]


def _agent_mcp(env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "scripts/demo_agent.py", "--mcp"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def _line(lines: list[str], head: str) -> str:
    return next(line for line in lines if line.startswith(head + " "))[len(head) + 1 :]


def test_demo_agent_mcp_buys_from_the_demo_upstream_once(running_demo) -> None:
    env, banner = running_demo
    # The MCP door at the banner's one address, routed to the ASGI role as production does.
    mcp_url = f"http://127.0.0.1:{env['DEMO_PORT']}/mcp"
    assert f"MCP tools      {mcp_url}" in banner
    assert f"offering {DEMO_OFFERING!r} runs on the sample upstream" in banner
    chain = json.loads((Path(env["TOLLBOOTH_VAR_DIR"]) / "demo-chain.json").read_text())
    stats_url = chain["upstream"]["stats_url"]
    assert requests.get(stats_url, timeout=5).json()["effects"] == 0

    first = _agent_mcp(env)

    purchase = _line(first, "purchase")
    assert purchase.startswith("pur_")
    result = json.loads(_line(first, "result"))
    # The upstream's own answer: the purchase's key, its first effect, the agent's input.
    assert result == {
        "key": f"tollbooth-{purchase}",
        "effect": 1,
        "input": {"message": "hello from the demo agent"},
    }
    assert _line(first, "upstream effects") == "1 calls 1"
    assert _line(first, "paid").startswith("ok settlement 0x")

    # The stock client re-signs the same call: answered from the same purchase, not run again.
    again = _agent_mcp(env)
    assert _line(again, "duplicate of").startswith(purchase)
    assert _line(again, "purchase") == purchase
    assert _line(again, "upstream effects") == "1 calls 1"
    assert requests.get(stats_url, timeout=5).json() == {
        "effects": 1,
        "calls": 1,
        "replayed": 0,
        "refused": 0,
    }


class _OnceUnavailable(http.server.BaseHTTPRequestHandler):
    """In front of the running demo: the first quote request is answered as an outage
    answers it (503 + Retry-After, nothing done); everything else goes to the demo as sent."""

    upstream = ""
    refused: list[str] = []

    def _relay(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/api/v1/quotes" and not self.refused:
            self.refused.append(self.path)
            payload = b'{"code": "service_unavailable", "detail": "try again"}'
            self.send_response(503)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
        answer = requests.request(
            self.command, self.upstream + self.path, data=body, headers=headers, timeout=60
        )
        self.send_response(answer.status_code)
        for name, value in answer.headers.items():
            if name.lower() not in ("transfer-encoding", "connection", "content-encoding"):
                self.send_header(name, value)
        self.end_headers()
        self.wfile.write(answer.content)

    do_GET = do_POST = _relay

    def log_message(self, *args: object) -> None:  # quiet
        pass


def test_the_banners_agent_waits_out_an_outage_and_its_receipt_names_the_demos_address(
    running_demo,
) -> None:
    """The banner's "Try it" line, as printed (with this run's TOLLBOOTH_VAR_DIR), buys once
    through a 503 on its first step (waited out for its Retry-After, not a crash), and the
    receipt names the paid URL at the address the demo serves (DEMO_PORT, not 8000)."""
    env, banner = running_demo
    var = env["TOLLBOOTH_VAR_DIR"]
    assert f"Try it:  TOLLBOOTH_VAR_DIR={var} " in banner
    base = f"http://127.0.0.1:{env['DEMO_PORT']}"
    _OnceUnavailable.upstream, _OnceUnavailable.refused = base, []
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OnceUnavailable)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        done = subprocess.run(
            [sys.executable, "scripts/demo_agent.py", f"http://127.0.0.1:{proxy.server_port}"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        proxy.shutdown()

    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "  503 service_unavailable: trying again in 1 s" in lines
    assert _OnceUnavailable.refused == ["/api/v1/quotes"]
    start = next(i for i, line in enumerate(lines) if line.startswith("receipt "))
    receipt = json.loads("\n".join([lines[start][len("receipt ") :], *lines[start + 1 :]]))
    # The signed receipt names the paid resource (docs/receipts.md `resourceUrl`).
    assert receipt["signed"] is not None, receipt
    named = json.dumps(receipt["signed"])
    assert f'"resourceUrl": "http://127.0.0.1:{env["DEMO_PORT"]}/x402/' in named, named


def test_the_agent_without_a_demo_says_where_it_looked(tmp_path: Path) -> None:
    env = {**demo_env(tmp_path), "TOLLBOOTH_VAR_DIR": str(tmp_path / "nothing-here")}
    for mode in ([], ["--x402"]):
        done = subprocess.run(
            [sys.executable, "scripts/demo_agent.py", *mode, "http://127.0.0.1:9"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode != 0
        assert "Traceback" not in done.stderr, done.stderr
        assert str(tmp_path / "nothing-here") in done.stderr
        assert "make demo" in done.stderr and "TOLLBOOTH_VAR_DIR" in done.stderr


def test_the_demo_has_a_funded_refund_wallet_and_its_chain_reaches_finality_unattended(
    running_demo,
) -> None:
    """Finance's "Pay out from the refund wallet" needs a wallet: the demo makes and funds
    one and hands its key to the processes. On a chain that mines a block per transaction,
    empty blocks keep coming, so a payback sent at block N is final at N + 3 without anyone
    mining by hand."""
    env, banner = running_demo
    chain = json.loads((Path(env["TOLLBOOTH_VAR_DIR"]) / "demo-chain.json").read_text())
    refunds = chain["refund_wallet"]["address"]
    assert f"Refund wallet  {refunds} (1000 test USDC)" in banner
    assert "refund_wallet_key" not in chain  # the key goes to the processes, not the file
    rpc = chain["rpc_url"]

    def call(method: str, params: list) -> str:
        answer = requests.post(
            rpc, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params}, timeout=5
        )
        return str(answer.json()["result"])

    balance_of = "0x70a08231" + refunds[2:].lower().rjust(64, "0")
    held = int(call("eth_call", [{"to": chain["token"], "data": balance_of}, "latest"]), 16)
    assert held == 1_000 * 10**6
    head = int(call("eth_blockNumber", []), 16)
    deadline = time.monotonic() + 15
    while int(call("eth_blockNumber", []), 16) < head + 3:
        assert time.monotonic() < deadline, "no blocks without transactions"
        time.sleep(0.5)


def _staff_session(base: str, banner: str, username: str) -> requests.Session:
    """Logged in through the admin's own login form, with the banner's password."""
    password = next(
        line.split("/", 1)[1].strip()
        for line in banner.splitlines()
        if line.strip().startswith(f"{username} ") and "/" in line
    )
    session = requests.Session()
    form = session.get(f"{base}/admin/login/", timeout=10)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text)
    assert token is not None, form.text[:500]
    answer = session.post(
        f"{base}/admin/login/?next=/admin/",
        data={
            "csrfmiddlewaretoken": token.group(1),
            "username": username,
            "password": password,
            "next": "/admin/",
        },
        headers={"Referer": f"{base}/admin/login/"},
        timeout=10,
    )
    assert answer.ok and "/admin/login/" not in answer.url, answer.text[:500]
    return session


def test_finance_reads_the_dashboard_and_exports_the_books_on_the_demos_embedded_database(
    running_demo,
) -> None:
    """The embedded default is whole for finance: on the demo's own SQLite database, with an
    x402 sale, a refused execution refunded and a late transfer owed back, both roles'
    dashboards answer and the books export (admin and command) runs."""
    env, banner = running_demo
    base = f"http://127.0.0.1:{env['DEMO_PORT']}"
    manage_env = {**env, "DJANGO_SETTINGS_MODULE": "config.settings.local"}
    bought = subprocess.run(
        [sys.executable, "scripts/demo_agent.py", "--x402", base],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert bought.returncode == 0, bought.stdout + bought.stderr
    for situation in ("execution-failed", "late-transfer"):
        played = subprocess.run(
            [sys.executable, "manage.py", "demo_situation", situation],
            cwd=ROOT, env=manage_env, capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        assert played.returncode == 0, played.stdout + played.stderr

    for role in ("finance", "support"):
        page = _staff_session(base, banner, role).get(
            f"{base}/admin/purchases/purchase/dashboard/", timeout=30
        )
        assert page.status_code == 200, (role, page.text[:800])
    finance = _staff_session(base, banner, "finance")
    books = finance.get(f"{base}/admin/payments/exportbatch/books/", timeout=30)
    assert books.status_code == 200
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', books.text)
    assert token is not None
    last_month = (datetime.now(UTC).replace(day=1) - timedelta(days=1)).strftime("%Y-%m")
    csv_answer = finance.post(
        f"{base}/admin/payments/exportbatch/books/",
        data={"csrfmiddlewaretoken": token.group(1), "month": last_month},
        headers={"Referer": f"{base}/admin/payments/exportbatch/books/"},
        timeout=60,
    )
    assert csv_answer.status_code == 200, csv_answer.text[:800]
    assert csv_answer.headers["Content-Type"].startswith("text/csv")
    exported = subprocess.run(
        [sys.executable, "manage.py", "books_export", "--month", last_month],
        cwd=ROOT, env=manage_env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.splitlines()[0] == csv_answer.text.splitlines()[0]
