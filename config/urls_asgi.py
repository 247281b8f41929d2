"""The site as the ASGI app serves it (config/asgi.py): config.urls with the x402 paid URL
on the event loop, so a payment waiting for its block holds no thread
(doors/x402/paid_async.py)."""

from django.urls import URLPattern, path

from config.urls import handler400, handler404, handler500  # noqa: F401
from config.urls import urlpatterns as site
from doors.x402.paid_async import x402_paid

_ON_THE_LOOP = {
    "x402-paid": "x402/<slug:offering>",
    "x402-paid-passed": "x402/<slug:offering>/<path:rest>",
}

urlpatterns = [
    path(_ON_THE_LOOP[pattern.name], x402_paid, name=pattern.name)
    if isinstance(pattern, URLPattern) and pattern.name in _ON_THE_LOOP
    else pattern
    for pattern in site
]
