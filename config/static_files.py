"""The admin's static files from the app itself (WhiteNoise), native on the ASGI app too.

WhiteNoise 6.12's middleware is synchronous only: on the ASGI role's event loop Django
would hop to a thread and back around it on every request, though it serves nothing there
but the rare static file (core.middleware says what the hops cost a paid call). Here the
look-up, a dictionary read of the files collected at start-up, runs inline in either mode;
only serving a file (reading it) leaves the event loop.
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from whitenoise.middleware import WhiteNoiseMiddleware


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any = None, **kwargs: Any) -> None:
        super().__init__(get_response, **kwargs)
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self._call_async(request)
        return super().__call__(request)

    async def _call_async(self, request: HttpRequest) -> HttpResponseBase:
        if self.autorefresh:  # development: a look at the disk per request
            static_file = await sync_to_async(self.find_file)(request.path_info)
        else:
            static_file = self.files.get(request.path_info)
        if static_file is None:
            return await self.get_response(request)
        return await sync_to_async(self.serve)(static_file, request)
