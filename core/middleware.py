"""A middleware native to both servers Tollbooth runs under.

Django adapts a synchronous-only middleware on the ASGI app's event loop with a hop to a
thread and one back for every request (and one more pair around the next synchronous one
below it); the ASGI role serves the paid URL, so every paid call paid for three such
middlewares in hops (issue 22: about a tenth of the server's CPU per paid call at 64
agents). A subclass of `BothModesMiddleware` runs its short, non-blocking checks inline in
either mode: on WSGI as a plain call, on ASGI in the coroutine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest
from django.http.response import HttpResponseBase

Handler = Callable[[HttpRequest], Any]


class BothModesMiddleware:
    """`answer` may answer instead of what is below (None: go on); `finish` may change the
    answer on its way out. Neither may block: `answer_async` is where a subclass that must
    wait on I/O moves that wait off the event loop."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Handler) -> None:
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)  # Django then awaits us without an adapter

    def __call__(self, request: HttpRequest) -> HttpResponseBase | Awaitable[HttpResponseBase]:
        if self.async_mode:
            return self._call_async(request)
        answer = self.answer(request)
        if answer is None:
            answer = self.finish(request, self.get_response(request))
        return answer

    async def _call_async(self, request: HttpRequest) -> HttpResponseBase:
        answer = await self.answer_async(request)
        if answer is None:
            answer = self.finish(request, await self.get_response(request))
        return answer

    def answer(self, request: HttpRequest) -> HttpResponseBase | None:
        return None

    async def answer_async(self, request: HttpRequest) -> HttpResponseBase | None:
        return self.answer(request)

    def finish(self, request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        return response
