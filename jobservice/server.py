"""A small external job service with its own idempotency, for tests and the demo.

Run: python -m jobservice.server --port 8765 --db var/jobservice.sqlite3   (--port 0: any free port)

API (JSON unless noted):
  POST /jobs               header Idempotency-Key (required), body {"operation", "input"}
                           201 {"id", "status", "operation", "created": true}   new job
                           200 same job with "created": false                  same key, same body
                           422 same key, different body; unsupported operation or input
                           400 missing key or malformed body
  GET  /jobs/{id}          {"id", "status": running|succeeded|failed, "operation", "error"?}
  GET  /jobs/{id}/result   the result bytes with their content type; 409 not finished, 404 unknown
  GET  /jobs?idempotency_key=K   the job created under K, or 404
  GET  /stats              {"jobs_created", "create_requests", "replayed"}: jobs that exist,
                           POST /jobs received (after fault injection), answered by replay
  GET  /health             {"status": "ok"}
  GET|POST /_faults        read / replace the injected faults (see `Faults`)

A job runs for input.duration_ms (default 300) measured on this server's clock from creation,
then ends `succeeded`, or `failed` when input.fail is true. Operation "word_stats" counts the
words of input.text. Jobs and counters live in SQLite (WAL), so they survive a restart.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import secrets
import signal
import sqlite3
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

DEFAULT_DURATION_MS = 300
MAX_DURATION_MS = 3_600_000
MAX_BODY_BYTES = 2_000_000
MAX_KEY_LENGTH = 255
TOP_WORDS = 10
# Fault injection never touches these, so a test can always observe and reset the service.
CONTROL_PATHS = frozenset({"/health", "/stats", "/_faults"})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    idempotency_key TEXT NOT NULL UNIQUE,
    request_sha256 TEXT NOT NULL,
    operation TEXT NOT NULL,
    created_at REAL NOT NULL,
    duration_ms INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    error TEXT,
    result BLOB,
    result_content_type TEXT
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
_JOB_PATH = re.compile(r"/jobs/([^/]+)(/result)?")
_WORD = re.compile(r"\w+(?:'\w+)*")


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str = "application/json"


def canonical_json(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def json_reply(status: int, payload: Any) -> Reply:
    return Reply(status, canonical_json(payload))


class Rejected(Exception):
    """The request is answered with an error status; nothing was changed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# --- operations ----------------------------------------------------------------------


def word_stats(data: Mapping[str, Any]) -> Reply:
    text = data.get("text")
    if not isinstance(text, str):
        raise Rejected(422, "input.text must be a string")
    words = _WORD.findall(text.casefold())
    counts = Counter(words)
    top = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:TOP_WORDS]
    result = {
        "operation": "word_stats",
        "word_count": len(words),
        "unique_words": len(counts),
        "top_words": [{"word": word, "count": count} for word, count in top],
    }
    return json_reply(200, result)


OPERATIONS = {"word_stats": word_stats}


@dataclass(frozen=True)
class Plan:
    """What a new job will do, decided (and validated) before it is stored."""

    operation: str
    duration_ms: int
    fail: bool
    result: Reply


def plan_job(operation: str, data: Mapping[str, Any]) -> Plan:
    handler = OPERATIONS.get(operation)
    if handler is None:
        raise Rejected(422, f"unsupported operation {operation!r}")
    duration = data.get("duration_ms", DEFAULT_DURATION_MS)
    if isinstance(duration, bool) or not isinstance(duration, int):
        raise Rejected(422, "input.duration_ms must be an integer")
    if not 0 <= duration <= MAX_DURATION_MS:
        raise Rejected(422, f"input.duration_ms must be between 0 and {MAX_DURATION_MS}")
    fail = data.get("fail", False)
    if not isinstance(fail, bool):
        raise Rejected(422, "input.fail must be a boolean")
    return Plan(operation, duration, fail, handler(data))


# --- storage -------------------------------------------------------------------------


class JobStore:
    """One SQLite connection shared by the request threads, serialized by a lock.

    The lock also makes "look up the key, else insert" atomic, so two concurrent requests
    with one key can never create two jobs (the UNIQUE constraint is the backstop).
    """

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def submit(self, key: str, operation: str, data: Mapping[str, Any]) -> tuple[bool, sqlite3.Row]:
        """Return (created, job). Raises Rejected for a reused key or an invalid job."""
        digest = hashlib.sha256(canonical_json({"operation": operation, "input": data})).hexdigest()
        with self._lock:
            row = self._one("SELECT * FROM jobs WHERE idempotency_key = ?", key)
            if row is not None:
                if row["request_sha256"] != digest:
                    raise Rejected(422, "Idempotency-Key was already used with a different request")
                self._bump("replayed")
                return False, row
            return True, self._insert(key, digest, plan_job(operation, data))

    def _insert(self, key: str, digest: str, plan: Plan) -> sqlite3.Row:
        job = {
            "id": "job_" + secrets.token_hex(12),
            "key": key,
            "digest": digest,
            "operation": plan.operation,
            "created_at": time.time(),
            "duration_ms": plan.duration_ms,
            "outcome": "failed" if plan.fail else "succeeded",
            "error": "the job failed (input.fail)" if plan.fail else None,
            "result": None if plan.fail else plan.result.body,
            "content_type": plan.result.content_type,
        }
        self._db.execute(
            "INSERT INTO jobs VALUES (:id, :key, :digest, :operation, :created_at, :duration_ms,"
            " :outcome, :error, :result, :content_type)",
            job,
        )
        row = self._one("SELECT * FROM jobs WHERE id = ?", job["id"])
        assert row is not None
        return row

    def count_create_request(self) -> None:
        with self._lock:
            self._bump("create_requests")

    def get(self, job_id: str) -> sqlite3.Row | None:
        with self._lock:
            return self._one("SELECT * FROM jobs WHERE id = ?", job_id)

    def find(self, key: str) -> sqlite3.Row | None:
        with self._lock:
            return self._one("SELECT * FROM jobs WHERE idempotency_key = ?", key)

    def stats(self) -> dict[str, int]:
        with self._lock:
            counters = dict(self._db.execute("SELECT name, value FROM counters").fetchall())
            jobs = self._db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
        return {
            "jobs_created": jobs,
            "create_requests": counters.get("create_requests", 0),
            "replayed": counters.get("replayed", 0),
        }

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _one(self, sql: str, *params: Any) -> sqlite3.Row | None:
        row: sqlite3.Row | None = self._db.execute(sql, params).fetchone()
        return row

    def _bump(self, name: str) -> None:
        self._db.execute(
            "INSERT INTO counters VALUES (?, 1) ON CONFLICT(name) DO UPDATE SET value = value + 1",
            (name,),
        )


def job_status(row: sqlite3.Row, now: float) -> str:
    finished = now >= row["created_at"] + row["duration_ms"] / 1000
    return str(row["outcome"]) if finished else "running"


def job_view(row: sqlite3.Row, now: float) -> dict[str, Any]:
    view: dict[str, Any] = {
        "id": row["id"],
        "status": job_status(row, now),
        "operation": row["operation"],
    }
    if view["status"] == "failed":
        view["error"] = row["error"]
    return view


# --- faults --------------------------------------------------------------------------


@dataclass
class Faults:
    """Injected misbehaviour, consumed one request at a time (control paths excepted).

    fail_next:        the next N requests answer `fail_status` (default 503).
    hang_next:        the next N requests wait `hang_seconds` before answering.
    after_processing: apply the faults after the request took effect, i.e. the job exists
                      but the client sees an error or a timeout (the ambiguous case).
    """

    fail_next: int = 0
    fail_status: int = 503
    hang_next: int = 0
    hang_seconds: float = 0.0
    after_processing: bool = False

    @classmethod
    def from_json(cls, data: Any) -> Faults:
        if not isinstance(data, dict) or set(data) - set(cls.__dataclass_fields__):
            raise Rejected(400, f"faults must be an object with keys {sorted(asdict(cls()))}")
        faults = cls(**data)
        counts_ok = all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for v in (faults.fail_next, faults.hang_next)
        )
        if not counts_ok or not isinstance(faults.after_processing, bool):
            raise Rejected(400, "fail_next/hang_next must be integers >= 0")
        if not isinstance(faults.fail_status, int) or not 400 <= faults.fail_status <= 599:
            raise Rejected(400, "fail_status must be an HTTP error status")
        if not isinstance(faults.hang_seconds, int | float) or not 0 <= faults.hang_seconds <= 600:
            raise Rejected(400, "hang_seconds must be between 0 and 600")
        return faults


@dataclass(frozen=True)
class FaultAction:
    hang_seconds: float
    fail_status: int | None
    after_processing: bool


# --- the service ---------------------------------------------------------------------


class JobService:
    """Routing and fault bookkeeping; HTTP parsing stays in `Handler`."""

    def __init__(self, store: JobStore, faults: Faults) -> None:
        self.store = store
        self._faults = faults
        self._faults_lock = threading.Lock()

    def take_fault(self, path: str) -> FaultAction | None:
        if path in CONTROL_PATHS:
            return None
        with self._faults_lock:
            f = self._faults
            hang = f.hang_seconds if f.hang_next > 0 else 0.0
            status = f.fail_status if f.fail_next > 0 else None
            f.hang_next = max(f.hang_next - 1, 0)
            f.fail_next = max(f.fail_next - 1, 0)
            after = f.after_processing
        if not hang and status is None:
            return None
        return FaultAction(hang, status, after)

    def route(self, method: str, target: str, idempotency_key: str, body: bytes) -> Reply:
        url = urlsplit(target)
        try:
            if method == "GET":
                return self._get(url.path, parse_qs(url.query))
            if method == "POST":
                return self._post(url.path, idempotency_key, body)
            raise Rejected(405, "method not allowed")
        except Rejected as exc:
            return json_reply(exc.status, {"error": str(exc)})

    def _get(self, path: str, query: dict[str, list[str]]) -> Reply:
        if path == "/health":
            return json_reply(200, {"status": "ok"})
        if path == "/stats":
            return json_reply(200, self.store.stats())
        if path == "/_faults":
            with self._faults_lock:
                return json_reply(200, asdict(self._faults))
        if path == "/jobs":
            key = (query.get("idempotency_key") or [""])[0]
            if not key:
                raise Rejected(400, "idempotency_key query parameter is required")
            return self._job_reply(self.store.find(key))
        match = _JOB_PATH.fullmatch(path)
        if match is None:
            raise Rejected(404, "not found")
        row = self.store.get(unquote(match.group(1)))
        return self._result_reply(row) if match.group(2) else self._job_reply(row)

    def _post(self, path: str, idempotency_key: str, body: bytes) -> Reply:
        if path == "/_faults":
            faults = Faults.from_json(_parse_json(body))
            with self._faults_lock:
                self._faults = faults
            return json_reply(200, asdict(faults))
        if path != "/jobs":
            raise Rejected(404, "not found")
        self.store.count_create_request()  # every POST /jobs that got past fault injection
        key = idempotency_key.strip()
        if not key or len(key) > MAX_KEY_LENGTH:
            raise Rejected(400, f"Idempotency-Key header is required (max {MAX_KEY_LENGTH} chars)")
        data = _parse_json(body)
        if not isinstance(data, dict) or not isinstance(data.get("operation"), str):
            raise Rejected(400, "body must be an object with a string 'operation'")
        if not isinstance(data.get("input"), dict) or set(data) - {"operation", "input"}:
            raise Rejected(400, "body must be exactly {'operation': str, 'input': object}")
        created, row = self.store.submit(key, data["operation"], data["input"])
        return json_reply(
            201 if created else 200, {**job_view(row, time.time()), "created": created}
        )

    @staticmethod
    def _job_reply(row: sqlite3.Row | None) -> Reply:
        if row is None:
            raise Rejected(404, "no such job")
        return json_reply(200, job_view(row, time.time()))

    @staticmethod
    def _result_reply(row: sqlite3.Row | None) -> Reply:
        if row is None:
            raise Rejected(404, "no such job")
        status = job_status(row, time.time())
        if status != "succeeded":
            raise Rejected(409, f"the job has no result (status {status})")
        return Reply(200, bytes(row["result"]), row["result_content_type"])


def _content_length(header: str | None) -> int | None:
    """The body length, or None when it is unusable (malformed or over MAX_BODY_BYTES)."""
    try:
        length = int(header or 0)
    except ValueError:
        return None
    return length if 0 <= length <= MAX_BODY_BYTES else None


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise Rejected(400, f"body is not valid JSON: {exc}") from exc


# --- HTTP ----------------------------------------------------------------------------


class JobServiceHTTPServer(ThreadingHTTPServer):
    # A hanging (fault-injected) request must not keep the process alive at shutdown.
    daemon_threads = True

    def __init__(self, address: tuple[str, int], service: JobService, *, quiet: bool) -> None:
        self.service = service
        self.quiet = quiet
        super().__init__(address, Handler)


class Handler(BaseHTTPRequestHandler):
    server: JobServiceHTTPServer
    server_version = "jobservice/1"

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def _handle(self, method: str) -> None:
        length = _content_length(self.headers.get("Content-Length"))
        if length is None:
            self._send(json_reply(413, {"error": "bad Content-Length or body too large"}))
            return
        body = self.rfile.read(length) if length else b""  # read first: a hang keeps the body
        service = self.server.service
        fault = service.take_fault(urlsplit(self.path).path)
        if fault is not None and not fault.after_processing:
            time.sleep(fault.hang_seconds)
            if fault.fail_status is not None:
                self._send(json_reply(fault.fail_status, {"error": "injected fault"}))
                return
        try:
            key = self.headers.get("Idempotency-Key", "")
            reply = service.route(method, self.path, key, body)
        except Exception as exc:  # an unexpected bug must still produce an answer
            reply = json_reply(500, {"error": f"internal error: {exc}"})
        if fault is not None and fault.after_processing:
            time.sleep(fault.hang_seconds)
            if fault.fail_status is not None:
                reply = json_reply(fault.fail_status, {"error": "injected fault"})
        self._send(reply)

    def _send(self, reply: Reply) -> None:
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)
        except (BrokenPipeError, ConnectionResetError):
            self.log_message("client went away before the reply to %s", self.path)

    def log_message(self, format: str, *args: Any) -> None:
        if not self.server.quiet:
            super().log_message(format, *args)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jobservice.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    parser.add_argument("--db", required=True, help="SQLite file (created if missing)")
    parser.add_argument("--quiet", action="store_true", help="no access log")
    parser.add_argument("--fail-next", type=int, default=0)
    parser.add_argument("--fail-status", type=int, default=503)
    parser.add_argument("--hang-next", type=int, default=0)
    parser.add_argument("--hang-seconds", type=float, default=0.0)
    parser.add_argument("--faults-after-processing", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faults = Faults(
        fail_next=args.fail_next,
        fail_status=args.fail_status,
        hang_next=args.hang_next,
        hang_seconds=args.hang_seconds,
        after_processing=args.faults_after_processing,
    )
    service = JobService(JobStore(args.db), faults)
    server = JobServiceHTTPServer((args.host, args.port), service, quiet=args.quiet)

    def stop(signum: int, frame: FrameType | None) -> None:
        # shutdown() waits for serve_forever() to return, which runs on this (main) thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"jobservice listening on http://{args.host}:{server.server_port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    finally:
        server.server_close()
        service.store.close()
    print("jobservice stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
