"""Production's URLs plus the anchors; never routed outside `make bench` (bench/settings.py)."""

from django.urls import path

from bench.anchors import BareApi, OneInsertApi
from config import urls as production_urls
from doors.rest.views import QuotePurchaseApi

urlpatterns = [
    *production_urls.urlpatterns,
    path("bench/bare", BareApi.as_view(), name="bench-bare"),
    path("bench/insert", OneInsertApi.as_view(), name="bench-insert"),
    # A diagnostic, not an anchor: the real pay view without its throttles, to say how much
    # of a replay's cost the throttle counters are.
    path(
        "bench/unthrottled/quotes/<str:public_id>/purchase",
        QuotePurchaseApi.as_view(throttle_classes=[]),
        name="bench-unthrottled-purchase",
    ),
]

handler400 = production_urls.handler400
handler404 = production_urls.handler404
handler500 = production_urls.handler500
