"""How a catalog file writes money and durations: never a float for money (an integer of
the asset's smallest unit, or a string with the asset's symbol), durations as "7d", "1h30m"."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
_AMOUNT = re.compile(r"(\d+(?:\.\d+)?)\s+([A-Za-z][A-Za-z0-9.]{0,15})")


def money_parse(value: Any, *, symbol: str, decimals: int) -> int:
    """Atomic units from 250000, "250000" or "0.25 USDC". Raises ValueError saying why."""
    if isinstance(value, bool | float):
        raise ValueError(
            f"a float is never money: write an integer of atomic units or a string such as "
            f'"0.25 {symbol}"'
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must not be negative")
        return value
    if not isinstance(value, str):
        raise ValueError(f'an integer of atomic units or a string such as "0.25 {symbol}"')
    text = value.strip().replace("_", "")
    if text.isdigit():
        return int(text)
    match = _AMOUNT.fullmatch(text)
    if match is None:
        raise ValueError(f'name the unit: "{value}" is neither atomic units nor "0.25 {symbol}"')
    if match[2] != symbol:
        raise ValueError(f"the amount is in {match[2]} but the offering's asset is {symbol}")
    try:
        atomic = Decimal(match[1]).scaleb(decimals)
    except InvalidOperation as exc:  # pragma: no cover - the pattern admits only digits
        raise ValueError(f"not an amount: {value!r}") from exc
    if atomic != atomic.to_integral_value():
        raise ValueError(f"{symbol} has {decimals} decimals: {match[1]} has more")
    return int(atomic)


def money_text(amount: int, *, symbol: str, decimals: int) -> str:
    """The exact amount in whole units with the symbol, e.g. "0.25 USDC"."""
    whole = Decimal(amount).scaleb(-decimals)
    text = format(whole.normalize(), "f") if whole else "0"
    return f"{text} {symbol}"


def duration_parse(value: Any) -> timedelta:
    """From seconds (an integer) or "7d", "12h", "1h30m", "10s", "0s"."""
    if isinstance(value, bool | float):
        raise ValueError('whole seconds or a string such as "7d", "1h30m", "10s"')
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must not be negative")
        return timedelta(seconds=value)
    match = _DURATION.fullmatch(str(value).strip()) if isinstance(value, str) else None
    if match is None or not any(match.groups()):
        raise ValueError(f'not a duration: {value!r} (write e.g. "7d", "1h30m", "10s")')
    seconds = sum(
        int(part or 0) * size for part, (_, size) in zip(match.groups(), _UNITS, strict=True)
    )
    return timedelta(seconds=seconds)


def duration_text(value: timedelta) -> str:
    """The compact form duration_parse reads: 7 days is "7d", 90 seconds "1m30s"."""
    seconds = int(value.total_seconds())
    if seconds == 0:
        return "0s"
    parts = []
    for unit, size in _UNITS:
        count, seconds = divmod(seconds, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def decimal_parse(value: Any) -> Decimal:
    """A decimal that is not money (a timeout in seconds): a number or a numeric string."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError('a number of seconds, e.g. 10 or "2.5"')
    try:
        return Decimal(str(value))
    except InvalidOperation as exc:
        raise ValueError(f"not a number: {value!r}") from exc
