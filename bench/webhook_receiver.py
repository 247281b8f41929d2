"""A webhook receiver in a process of its own, for bench/webhooks_load.py: answers 200 after
`delay` seconds and appends each event's id to a file, one a line. Its own process, so its
threads never take the GIL from the purchases the bench times.

    python -m bench.webhook_receiver PORT DELAY_SECONDS OUT_FILE
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve(port: int, delay: float, out: str) -> None:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if delay:
                time.sleep(delay)
            with lock, open(out, "a") as ids:
                ids.write(json.loads(body)["id"] + "\n")
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    serve(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
