"""The load generator: `python -m bench.load_client < spec.json`, one process of threads.

Standard library only (http.client, one keep-alive connection per thread), so the client
spends as little of the shared CPU as a Python client can; the runner starts one process
per core so the GIL does not cap the load. Each thread plays one agent with its own API key,
runs `warmup` seconds uncounted, then counts the HTTP calls that complete inside the
`duration` window. Prints one JSON object: calls, units, errors (with a sample), seconds.

Scenarios (the `scenario` of the spec):
- `post`: POST the same path, headers and body again and again (a replay; the bare anchor).
- `insert`: POST a new quote-shaped body each time (the one-INSERT anchor).
- `purchase`: quote, then pay the quote from the prepaid balance with a new Idempotency-Key:
  two calls per purchase.
- `replay`: one purchase first (uncounted), then replay its pay request with the same key
  and body under `pay_prefix`, which must answer `Idempotent-Replayed: true`.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

CSV = "region,units\nnorth,3\nsouth,5\n"


class UnexpectedAnswer(Exception):
    pass


@dataclass
class Tally:
    calls: int = 0
    units: int = 0
    errors: int = 0
    samples: list[str] = field(default_factory=list)


class Agent:
    def __init__(self, spec: dict[str, Any], agent: dict[str, Any], index: int) -> None:
        parts = urlsplit(spec["base_url"])
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.connection = http.client.HTTPConnection(self.host, self.port, timeout=30)
        self.headers = {
            "Authorization": f"Bearer {agent['api_key']}",
            "Content-Type": "application/json",
            # What the TLS-terminating load balancer adds; production redirects plain HTTP.
            "X-Forwarded-Proto": "https",
        }
        self.spec = spec
        self.index = index
        self.counter = 0
        self.replay: tuple[str, str] | None = None

    def call(self, path: str, body: bytes, expect: int, extra: dict[str, str] | None = None) -> Any:
        try:
            self.connection.request(
                "POST", path, body=body, headers={**self.headers, **(extra or {})}
            )
            response = self.connection.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException):
            self.connection.close()  # reconnect on the next call
            raise
        if response.status != expect:
            raise UnexpectedAnswer(f"{path} -> {response.status}: {payload[:200]!r}")
        if response.getheader("Connection", "").lower() == "close":
            self.connection.close()
        return response, payload

    def quote_body(self) -> bytes:
        self.counter += 1
        title = f"bench {self.spec['run']} {self.spec['process']}-{self.index}-{self.counter}"
        return json.dumps(
            {"offering": self.spec["offering"], "input": {"title": title, "csv": CSV}}
        ).encode()

    def purchase(self) -> tuple[str, str]:
        _, payload = self.call("/api/v1/quotes", self.quote_body(), 201)
        quote = json.loads(payload)["id"]
        key = f"bench-{uuid.uuid4()}"
        self.call(
            f"/api/v1/quotes/{quote}/purchase",
            b'{"rail": "prepaid"}',
            201,
            {"Idempotency-Key": key},
        )
        return quote, key

    def unit(self) -> int:
        """One unit of work; returns the HTTP calls it made."""
        scenario = self.spec["scenario"]
        if scenario == "post":
            self.call(self.spec["path"], self.spec["body"].encode(), self.spec["expect"])
            return 1
        if scenario == "insert":
            self.call(self.spec["path"], self.quote_body(), 201)
            return 1
        if scenario == "purchase":
            self.purchase()
            return 2
        if scenario == "replay":
            if self.replay is None:
                raise RuntimeError("replay without its purchase")
            quote, key = self.replay
            response, _ = self.call(
                f"{self.spec['pay_prefix']}/{quote}/purchase",
                b'{"rail": "prepaid"}',
                201,
                {"Idempotency-Key": key},
            )
            if response.getheader("Idempotent-Replayed") != "true":
                raise UnexpectedAnswer("a replay answered without Idempotent-Replayed: true")
            return 1
        raise ValueError(f"unknown scenario {scenario!r}")


def run_agent(
    agent: Agent, start_at: float, stop_at: float, tally: Tally, lock: threading.Lock
) -> None:
    if agent.spec["scenario"] == "replay":
        agent.replay = agent.purchase()  # the answer every later call replays
    while True:
        now = time.monotonic()
        if now >= stop_at:
            break
        try:
            calls = agent.unit()
        except (UnexpectedAnswer, OSError, http.client.HTTPException) as error:
            with lock:
                tally.errors += 1
                if len(tally.samples) < 3:
                    tally.samples.append(str(error))
            continue
        if start_at <= time.monotonic() <= stop_at:
            with lock:
                tally.calls += calls
                tally.units += 1
    agent.connection.close()


def main() -> int:
    spec = json.load(sys.stdin)
    agents = [Agent(spec, agent, i) for i, agent in enumerate(spec["agents"])]
    # The window starts after the setup (the replay's first purchase) and the warmup.
    start_at = time.monotonic() + spec["setup"] + spec["warmup"]
    stop_at = start_at + spec["duration"]
    tally, lock = Tally(), threading.Lock()
    threads = [
        threading.Thread(target=run_agent, args=(agent, start_at, stop_at, tally, lock))
        for agent in agents
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(
        json.dumps(
            {
                "calls": tally.calls,
                "units": tally.units,
                "errors": tally.errors,
                "samples": tally.samples,
                "seconds": spec["duration"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
