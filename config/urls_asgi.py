"""The site as the ASGI app serves it (config/asgi.py): config.urls with the x402 paid URL
on the event loop, so a payment waiting for its block holds no thread
(doors/x402/paid_async.py)."""

from django.urls import URLPattern, path

from config.urls import handler400, handler404, handler500  # noqa: F401
from config.urls import urlpatterns as site
from doors.x402.paid_async import x402_paid

urlpatterns = [
    path("x402/<slug:offering>", x402_paid, name="x402-paid")
    if isinstance(pattern, URLPattern) and pattern.name == "x402-paid"
    else pattern
    for pattern in site
]
