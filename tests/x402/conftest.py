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


@pytest.fixture
def x402_live_world(settings: Any, transactional_db: None) -> Iterator[X402World]:
    """The same world with committed data, for tests that race real threads or processes."""
    world, node = build_world(settings)
    with node:
        yield world


@pytest.fixture
def x402_paused_world(settings: Any, db: None) -> Iterator[X402World]:
    """Mining paused after set-up: broadcasts wait in the mempool until `node.mine()`."""
    world, node = build_world(settings, no_mining=True)
    with node:
        yield world
