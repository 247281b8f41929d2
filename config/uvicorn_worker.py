"""The ASGI role's gunicorn worker (config/gunicorn_asgi.py): uvicorn on uvloop's event loop
with httptools' HTTP parser, named rather than left to uvicorn's "auto".

"auto" falls back, silently, to asyncio's own loop and h11's pure-Python parser when either
is not installed, and that fallback costs the paid call about a fifth more CPU at 64 agents
(docs/benchmarks.md, "uvloop and httptools"). Named, a missing one stops the worker at boot.
Subclassing to set CONFIG_KWARGS is how uvicorn's documentation configures its worker.
"""

from __future__ import annotations

from typing import Any

from uvicorn.workers import UvicornWorker


class TollboothUvicornWorker(UvicornWorker):
    CONFIG_KWARGS: dict[str, Any] = {"loop": "uvloop", "http": "httptools"}
