"""The paying agents of `make bench-hosts` (bench/hosts.py): the official x402 client with
the SDK's payment-identifier hook, retrying a call under its payment id until it is answered.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

NETWORK = "eip155:31337"
SLUG = "bench-report"
CSV = "region,units,price\nnorth,3,1.50\nsouth,5,2.25\neast,8,0.75\nwest,1,9.99\n"
CALL_TIMEOUT = 30.0  # one HTTP attempt; a call retries until ANSWER_DEADLINE
ANSWER_DEADLINE = 120.0
# After the load: calls still unanswered are retried, 202s polled, this long. Above the
# heal-relayers job's 5 minutes: a relayer nonce handed out on a host cut off before it
# sent waits for that job (docs/x402.md, "Nonce gaps").
RECOVERY_DEADLINE = 420.0


@dataclass
class Call:
    payer: str
    payment_id: str
    started: float
    finished: float = 0.0
    status: int | None = None  # the answer kept: 200, or 202 with status_url
    status_url: str = ""
    resolved: int | None = None  # the status URL's final answer
    attempts: list[str] = field(default_factory=list)
    body: dict[str, str] = field(default_factory=dict, repr=False)
    agent: Agent | None = field(default=None, repr=False)
    answered_at: float = 0.0  # when it was answered 200, or its 202 resolved

    @property
    def done(self) -> bool:
        return self.status == 200 or (self.status == 202 and self.resolved is not None)

    @property
    def latency(self) -> float:
        return self.finished - self.started


class Agent:
    """One paying agent: the stock client with the SDK's payment-identifier hook."""

    def __init__(self, wallet: Any, token: str, name: str) -> None:
        import requests
        from x402 import x402ClientSync
        from x402.extensions.payment_identifier import append_payment_identifier_to_extensions
        from x402.http.clients.requests import wrapRequestsWithPayment
        from x402.mechanisms.evm.exact import ExactEvmClientScheme

        client = x402ClientSync()
        client.register(NETWORK, ExactEvmClientScheme(signer=wallet))
        client.set_spend_controls({"allowed_assets": [{"network": NETWORK, "asset": token}]})

        def add_payment_id(context: Any) -> None:
            extensions = context.payment_required.extensions
            if extensions is not None:
                append_payment_identifier_to_extensions(extensions, self.payment_id)

        client.on_before_payment_creation(add_payment_id)
        session = requests.Session()
        session.trust_env = False  # straight to the load balancer, whatever proxy is set
        self.session = wrapRequestsWithPayment(session, client)
        self.address = wallet.address
        self.name = name
        self.payment_id = ""
        self.count = 0

    def call(self, url: str) -> Call:
        """One paid call, retried under its payment id until it is answered."""
        self.count += 1
        payment_id = f"hosts-{self.name}-{self.count}-{secrets.token_hex(6)}"
        body = {"title": f"{self.name}-{self.count}-{secrets.token_hex(4)}", "csv": CSV}
        call = Call(self.address, payment_id, time.perf_counter(), body=body, agent=self)
        self.retry(call, url, ANSWER_DEADLINE)
        return call

    def retry(self, call: Call, url: str, seconds: float) -> None:
        """Ask under the call's payment id (a new authorization each time, as the SDK
        signs) until it is answered 200 or 202, or `seconds` pass."""
        self.payment_id = call.payment_id
        deadline = time.monotonic() + seconds
        while True:
            try:
                response = self.session.post(url, json=call.body, timeout=CALL_TIMEOUT)
            except Exception as exc:  # a reset or a timeout: retried under the same id
                call.attempts.append(type(exc).__name__)
            else:
                call.attempts.append(_named(response))
                if response.status_code in (200, 202):
                    call.status = response.status_code
                    call.status_url = response.headers.get("Location", "")
                    call.finished = call.answered_at = time.perf_counter()
                    return
            if time.monotonic() > deadline:
                call.finished = time.perf_counter()
                return
            time.sleep(1.0)


def _named(response: Any) -> str:
    """The status, and a problem's code: "409 payment_in_flight"."""
    if response.status_code in (200, 202):
        return str(response.status_code)
    try:
        code = response.json().get("code") or response.json().get("error") or ""
    except ValueError:
        code = ""
    return f"{response.status_code} {code}".strip()


def drive(url: str, agents: list[Agent], calls: int) -> tuple[list[Call], float]:
    results: list[Call] = []
    lock = threading.Lock()
    start = threading.Barrier(len(agents) + 1)

    def work(agent: Agent) -> None:
        start.wait()
        for _ in range(calls):
            call = agent.call(url)
            with lock:
                results.append(call)

    threads = [threading.Thread(target=work, args=(a,), daemon=True) for a in agents]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - began


def recover(base: str, calls: list[Call]) -> None:
    """After the load: each agent asks again for its calls still unanswered (same payment
    id), then polls its 202s' status URLs until they answer something other than 202."""
    deadline = time.monotonic() + RECOVERY_DEADLINE
    by_agent: dict[int, list[Call]] = {}
    for call in calls:
        if not call.done and call.agent is not None:
            by_agent.setdefault(id(call.agent), []).append(call)
    threads = [threading.Thread(target=_recover_agent, args=(base, mine, deadline), daemon=True)
               for mine in by_agent.values()]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _recover_agent(base: str, calls: list[Call], deadline: float) -> None:
    import requests

    session = requests.Session()
    session.trust_env = False
    for call in calls:
        if call.status not in (200, 202) and call.agent is not None:
            call.agent.retry(call, f"{base}/x402/{SLUG}", max(0.0, deadline - time.monotonic()))
        while call.status == 202 and call.resolved is None and time.monotonic() < deadline:
            with contextlib.suppress(requests.RequestException):
                answer = session.get(base + call.status_url, timeout=10)
                if answer.status_code != 202:
                    call.resolved = answer.status_code
                    call.answered_at = time.perf_counter()
                    break
            time.sleep(1.0)
