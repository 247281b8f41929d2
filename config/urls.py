from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from backoffice.metrics import metrics_view
from doors.x402.views import (
    ReceiptKeysApi,
    X402DiscoveryApi,
    X402PaidApi,
    X402PassThroughApi,
    X402PurchaseCapabilityApi,
)

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("doors.rest.urls", namespace="api")),
    path("x402/<slug:offering>", X402PaidApi.as_view(), name="x402-paid"),
    path(
        "x402/purchases/<str:ref>/<str:token>",
        X402PurchaseCapabilityApi.as_view(),
        name="x402-purchase-capability",
    ),
    # After the capability URLs, which share its shape: an existing API sold path by path.
    path(
        "x402/<slug:offering>/<path:rest>",
        X402PassThroughApi.as_view(),
        name="x402-paid-passed",
    ),
    path(".well-known/x402", X402DiscoveryApi.as_view(), name="x402-discovery"),
    path(".well-known/tollbooth-receipts", ReceiptKeysApi.as_view(), name="receipt-keys"),
    path("metrics", metrics_view, name="metrics"),
    path(
        "api/schema/",
        SpectacularAPIView.as_view(permission_classes=[], authentication_classes=[]),
        name="schema",
    ),
    path(
        "api/docs/",
        SpectacularSwaggerView.as_view(
            url_name="schema", permission_classes=[], authentication_classes=[]
        ),
        name="api-docs",
    ),
]

# Unrouted paths and errors outside the API views answer problem+json like the rest.
handler400 = "doors.rest.problems.bad_request_view"
handler404 = "doors.rest.problems.not_found_view"
handler500 = "doors.rest.problems.server_error_view"
