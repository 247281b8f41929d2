"""Which failures mean "a dependency is unreachable right now" (answered 503, retryable),
as opposed to a bug (500).

A request that loses its database or broker half-way cannot know more than that: what it
committed stays committed, the payment id it held is given back (or recognised as
abandoned, purchases/services/checkout/leases.py), and the buyer's retry with the same id resumes
from the recovery point. So the honest answer is "unavailable, retry after N seconds",
never "internal error".
"""

from __future__ import annotations

import sqlite3

from django.db import utils as db_utils
from kombu.exceptions import OperationalError as BrokerUnreachable
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# PostgreSQL SQLSTATE classes that say the server cannot serve us now: 08 connection
# exception, 53 insufficient resources (too many connections), 57P0x the server shutting
# down, restarting or not yet accepting connections. Not 40 (deadlock, serialization
# failure): those are races the code must handle, and stay 500s that reach the logs.
_PG_UNAVAILABLE = ("08", "53", "57P0")
# SQLite (the embedded default): the file is locked past the busy timeout, unreadable or gone.
_SQLITE_UNAVAILABLE = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_CANTOPEN", "SQLITE_IOERR")


def dependency_unreachable(exc: BaseException) -> bool:
    """True if `exc` says the database or the broker cannot be reached (or is refusing
    connections), not that our code or data is wrong."""
    if isinstance(exc, BrokerUnreachable | RedisConnectionError | RedisTimeoutError):
        return True
    if isinstance(exc, db_utils.InterfaceError):
        return True  # the connection is gone (closed under us)
    if not isinstance(exc, db_utils.OperationalError):
        return False
    cause = exc.__cause__
    if isinstance(cause, sqlite3.OperationalError):
        name = getattr(cause, "sqlite_errorname", "")
        return name.startswith(_SQLITE_UNAVAILABLE)
    sqlstate = getattr(cause, "sqlstate", None)
    # No SQLSTATE: the client could not reach the server at all (refused, reset, timed out).
    return sqlstate is None or str(sqlstate).startswith(_PG_UNAVAILABLE)
