"""Fixtures shared by the x402 end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.x402.e2e import X402World, build_world


@pytest.fixture
def x402_world(settings: Any, db: None) -> Iterator[X402World]:
    world, node = build_world(settings)
    with node:
        yield world
