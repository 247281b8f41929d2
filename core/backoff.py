"""Exponential backoff with jitter: the one rule every retry here follows (the outbox's relay,
execution retries, webhook deliveries); each keeps its own base, cap and jitter."""

from __future__ import annotations

import random
from datetime import timedelta


def backoff_delay(
    tries: int,
    *,
    base_seconds: float,
    cap_seconds: float,
    jitter: tuple[float, float],
    rng: random.Random | None = None,
) -> timedelta:
    """How long after the `tries`-th failed try the next one is due: base, 2x base, 4x base
    ... at most the cap, times a factor drawn from `jitter` (so what failed together is not
    all retried in the same second)."""
    seconds = min(cap_seconds, base_seconds * 2.0 ** max(tries - 1, 0))
    low, high = jitter
    return timedelta(seconds=seconds * (rng or random).uniform(low, high))
