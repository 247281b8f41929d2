"""The middleware chain runs natively on the ASGI app's event loop (core.middleware).

Django adapts any synchronous-only middleware on ASGI with a hop to a thread and back per
request; the ASGI role serves the paid URL, so no middleware of ours may be synchronous
only. Each of ours answers the same through Django's AsyncClient (the chain loaded in async
mode, as the ASGI handler loads it) as through the synchronous Client.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from asgiref.sync import iscoroutinefunction
from django.conf import settings
from django.test import AsyncClient, Client
from django.utils.module_loading import import_string

from core.middleware import BothModesMiddleware


def _both(path: str, method: str = "get", **extra: Any) -> list[Any]:
    """The answer through the synchronous chain, then through the asynchronous one."""
    sync_answer = getattr(Client(), method)(path, **extra)
    async_answer = asyncio.run(getattr(AsyncClient(), method)(path, **extra))
    return [sync_answer, async_answer]


def test_every_middleware_is_native_on_the_event_loop():
    synchronous_only = [
        path
        for path in settings.MIDDLEWARE
        if not getattr(import_string(path), "async_capable", False)
    ]
    assert synchronous_only == []


def test_an_async_chain_takes_no_adapter_around_ours():
    """Django wraps a middleware in a thread hop unless the instance reads as a coroutine
    function when what it wraps is one (BaseHandler.adapt_method_mode)."""

    async def inner(request: Any) -> Any:
        raise AssertionError("not called")

    for middleware in (
        BothModesMiddleware,
        import_string("config.static_files.StaticFilesMiddleware"),
    ):
        assert iscoroutinefunction(middleware(inner))
        assert not iscoroutinefunction(middleware(lambda request: None))


def test_probes_answer_alike_in_both_modes():
    for answer in _both("/healthz", HTTP_HOST="10.0.0.7"):
        assert (answer.status_code, answer.json()) == (200, {"status": "alive"})
        assert answer["Cache-Control"] == "no-store"
    for answer in _both("/healthz", "post"):
        assert (answer.status_code, answer["Allow"]) == (405, "GET, HEAD")


@pytest.mark.django_db(transaction=True)
def test_readiness_waits_off_the_event_loop_and_answers(settings):
    settings.X402_NETWORKS = {}
    settings.TOLLBOOTH_READINESS_CACHE_SECONDS = 0
    for answer in _both("/readyz", HTTP_HOST="10.0.0.7"):
        assert answer.status_code == 200, answer.content
        assert set(answer.json()["checks"]) == {"database", "broker"}


@pytest.mark.django_db(transaction=True)
def test_hostile_text_is_refused_and_problems_are_not_stored_in_both_modes():
    for answer in _both("/api/v1/purchases", QUERY_STRING="ref=%00"):
        assert answer.status_code == 400, answer.content
        assert answer.json()["code"] == "invalid_text"
        assert answer["Cache-Control"] == "no-store"
    for answer in _both("/api/v1/no-such-thing"):  # a problem, not cached
        assert answer.status_code == 404
        assert answer["Content-Type"] == "application/problem+json"
        assert answer["Cache-Control"] == "no-store"


def test_static_files_are_served_in_both_modes(settings):
    settings.WHITENOISE_USE_FINDERS = True  # the admin's files, without a collectstatic
    for answer in _both("/static/admin/css/base.css"):
        assert answer.status_code == 200
        assert b"".join(answer.streaming_content).startswith(b"/*")
    for answer in _both("/static/admin/css/none-such.css"):
        assert answer.status_code == 404
