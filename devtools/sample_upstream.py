"""A seller's HTTP upstream for tests and the demo: verifies Tollbooth's signature, answers a
repeated Idempotency-Key with its first answer, and counts its real effects.

    python -m devtools.sample_upstream --db /tmp/up.sqlite3 --secret-env MY_SECRET [--port 0]
    python -m devtools.sample_upstream --db ... --secret-env 1=OLD_SECRET --secret-env 2=NEW

Prints "sample upstream listening on <port>". `--secret-env [KEY_ID=]NAME`, repeatable: each
secret it accepts, by key id (none: the single-secret header `v1=...`). Effects are rows in
its own SQLite file, so a killed and restarted upstream still knows what it did. Routes:
  POST|GET /work   the paid operation (signed). Input fields that steer it, for tests:
                   "sleep": seconds to wait AFTER the effect is committed (a slow answer),
                   "fail_times": answer 503 AFTER the effect this many times for the key,
                   "reject": a 4xx status answered BEFORE any effect,
                   "size": bytes of result to return,
                   "slow": seconds to wait before EVERY answer, repeats included (an
                   upstream slower than its caller's timeout, however often it is asked).
  ANY /api/...     an existing API sold path by path (an upstream in `request` mode):
                   signed like /work; its effect echoes the request as it arrived
                   {"method", "target" (path and query), "content_type", "body"}.
  GET /health      unsigned dry-run target: no effect.
  GET /stats       {"effects", "calls", "replayed", "refused"}.
  PUT /keys        a JSON list of key ids, among those it was started with: the secrets it
                   accepts from now on (a seller's deploy adding or dropping one during a
                   rotation, without a restart); answers the list now accepted. Unsigned:
                   a local test tool, never exposed.
The signature check below is the one docs/upstreams.md gives sellers.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import sqlite3
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

MAX_SKEW_SECONDS = 300
# How `make demo` runs it: the offering it sells and the variable naming its secret.
DEMO_OFFERING = "counted-echo"
DEMO_SECRET_ENV = "TOLLBOOTH_DEMO_UPSTREAM_SECRET"  # noqa: S105  (a variable's name)


def verify(
    secrets: Mapping[str, bytes], headers: Mapping[str, str], method: str, path: str, body: bytes
) -> bool:
    """Tollbooth's v1 signature, checked as a seller would (docs/upstreams.md). secrets: every
    secret accepted now, by key id ("" for one without a key id)."""
    timestamp = headers.get("tollbooth-timestamp", "")
    if not timestamp.isdigit() or abs(time.time() - int(timestamp)) > MAX_SKEW_SECONDS:
        return False  # missing, or too old: a replayed request
    signed = f"{timestamp}\n{method}\n{path}\n{hashlib.sha256(body).hexdigest()}".encode()
    # "kid=2;v1=<hex>, kid=1;v1=<hex>" during a rotation; "v1=<hex>" for a secret without id.
    for entry in headers.get("tollbooth-signature", "").split(","):
        fields = {}
        for part in entry.split(";"):
            name, _, value = part.strip().partition("=")
            fields[name] = value
        secret = secrets.get(fields.get("kid", ""))
        if secret is None:
            continue  # a key we do not hold (yet, or any more): another entry may match
        expected = hmac.new(secret, signed, hashlib.sha256).hexdigest()
        if hmac.compare_digest(expected, fields.get("v1", "")):
            return True
    return False


class Store:
    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.lock = threading.Lock()
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS effects (key TEXT PRIMARY KEY, body BLOB, fails INT)"
        )
        self.counts = {"calls": 0, "replayed": 0, "refused": 0}
        self.accepted: list[str] = []

    def effect(self, key: str, data: dict[str, object]) -> tuple[bytes, bool]:
        """The answer for `key`, doing the effect only the first time; (body, replayed)."""
        with self.lock:
            row = self.db.execute("SELECT body FROM effects WHERE key=?", (key,)).fetchone()
            if row:
                return bytes(row[0]), True
            number = self.db.execute("SELECT count(*) FROM effects").fetchone()[0] + 1
            size = int(str(data.get("size", 0)))
            body = json.dumps({"key": key, "effect": number, "input": data}).encode()
            body = body + b" " * max(0, size - len(body))
            self.db.execute("INSERT INTO effects VALUES (?, ?, 0)", (key, body))
            return body, False

    def fail_once_more(self, key: str, times: int) -> bool:
        with self.lock:
            fails = self.db.execute("SELECT fails FROM effects WHERE key=?", (key,)).fetchone()[0]
            if fails >= times:
                return False
            self.db.execute("UPDATE effects SET fails=fails+1 WHERE key=?", (key,))
            return True

    def stats(self) -> dict[str, int]:
        with self.lock:
            effects = self.db.execute("SELECT count(*) FROM effects").fetchone()[0]
            return {"effects": effects, **self.counts}


def make_handler(store: Store, secrets: dict[str, bytes]) -> type[BaseHTTPRequestHandler]:
    store.accepted = list(secrets)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self._route()

        def do_POST(self) -> None:
            self._route()

        def do_PUT(self) -> None:
            self._route()

        def do_PATCH(self) -> None:
            self._route()

        def do_DELETE(self) -> None:
            self._route()

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _route(self) -> None:
            path = urlsplit(self.path).path
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if path == "/stats":
                return self._send(200, json.dumps(store.stats()).encode())
            if path == "/keys" and self.command == "PUT":
                return self._keys(body)
            if path == "/health":
                return self._send(200, b'{"ok": true}')
            if path.startswith("/api/"):
                return self._api(body)
            if path != "/work":
                return self._send(404, b'{"error": "no such route"}')
            return self._work(body)

        def _signed_key(self, body: bytes) -> str | None:
            """The call's Idempotency-Key, if it is signed by a secret accepted now."""
            store.counts["calls"] += 1
            headers = {k.lower(): v for k, v in self.headers.items()}
            key = headers.get("idempotency-key", "")
            accepted = {kid: secrets[kid] for kid in store.accepted}
            if not verify(accepted, headers, self.command, self.path, body) or not key:
                store.counts["refused"] += 1
                return None
            return key

        def _api(self, body: bytes) -> None:
            key = self._signed_key(body)
            if key is None:
                return self._send(401, b'{"error": "bad signature or no key"}')
            seen: dict[str, object] = {
                "method": self.command,
                "target": self.path,
                "content_type": self.headers.get("Content-Type", ""),
                "body": body.decode("utf-8", "replace"),
            }
            answer, replayed = store.effect(key, seen)
            store.counts["replayed"] += int(replayed)
            return self._send(200, answer)

        def _keys(self, body: bytes) -> None:
            wanted = json.loads(body)
            if not isinstance(wanted, list) or not set(wanted) <= set(secrets):
                return self._send(400, json.dumps({"known": list(secrets)}).encode())
            store.accepted = [str(kid) for kid in wanted]
            return self._send(200, json.dumps(store.accepted).encode())

        def _work(self, body: bytes) -> None:
            key = self._signed_key(body)
            if key is None:
                return self._send(401, b'{"error": "bad signature or no key"}')
            query = dict(parse_qsl(urlsplit(self.path).query))
            data: dict[str, object] = json.loads(body) if body else dict(query)
            if data.get("reject"):
                return self._send(int(str(data["reject"])), b'{"error": "rejected"}')
            answer, replayed = store.effect(key, data)
            store.counts["replayed"] += int(replayed)
            if store.fail_once_more(key, int(str(data.get("fail_times", 0)))):
                return self._send(503, b'{"error": "answer lost after the effect"}')
            if not replayed and data.get("sleep"):
                time.sleep(float(str(data["sleep"])))
            if data.get("slow"):
                time.sleep(float(str(data["slow"])))
            return self._send(200, answer)

    return Handler


def secrets_from_env(names: list[str]) -> dict[str, bytes]:
    """{key id: secret} from `[KEY_ID=]NAME` arguments (no key id: the key id "")."""
    secrets = {}
    for name in names:
        kid, _, env = name.rpartition("=")
        secrets[kid] = os.environ[env].encode()
    return secrets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--secret-env", required=True, action="append")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    store = Store(args.db)
    secrets = secrets_from_env(args.secret_env)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(store, secrets))
    print(f"sample upstream listening on {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
