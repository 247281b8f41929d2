"""A door's answer that first waits for a payment's money, slept through on an event loop.

The paid flow returns a wait for the money as a value (PaymentPending,
purchases.services.checkout.flow) when its door asked for it, which a door does only while
an event loop serves it (`waits_returned`, set by doors.x402.paid_async). The door answers
`Waiting`: that value, and how it finishes its answer once the flow resumed after the wait.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from purchases.services.checkout.flow import PaymentPending

R = TypeVar("R")

_RETURNED: ContextVar[bool] = ContextVar("x402_waits_returned", default=False)


@dataclass(frozen=True)
class Waiting(Generic[R]):
    """`pending`'s wait, then `finish(resumed)`: the door's answer, given the flow resumed
    (a call that returns what the flow answers, or raises as the flow would)."""

    pending: PaymentPending[Any]
    finish: Callable[[Callable[[], Any]], R]


@contextmanager
def waits_returned() -> Iterator[None]:
    """Inside: the caller is an event loop that sleeps through a payment's wait itself."""
    token = _RETURNED.set(True)
    try:
        yield
    finally:
        _RETURNED.reset(token)


def returns_wait() -> bool:
    """Whether a payment's wait is returned to this door's caller (`waits_returned`)."""
    return _RETURNED.get()
