from django.urls import path

# schema registers the OpenAPI description of the API-key authentication on import.
from doors.rest import schema, views  # noqa: F401

app_name = "api"

urlpatterns = [
    path("offerings", views.OfferingListApi.as_view(), name="offering-list"),
    path("balance", views.BalanceDetailApi.as_view(), name="balance-detail"),
    path("quotes", views.QuoteCreateApi.as_view(), name="quote-create"),
    path(
        "quotes/<str:public_id>/purchase", views.QuotePurchaseApi.as_view(), name="quote-purchase"
    ),
    path("purchases/<str:ref>", views.PurchaseDetailApi.as_view(), name="purchase-detail"),
    path("purchases/<str:ref>/result", views.PurchaseResultApi.as_view(), name="purchase-result"),
    path(
        "purchases/<str:ref>/refund-requests",
        views.RefundRequestCreateApi.as_view(),
        name="refund-request-create",
    ),
    path(
        "purchases/<str:ref>/refund-requests/<str:public_id>",
        views.RefundRequestDetailApi.as_view(),
        name="refund-request-detail",
    ),
    path("receipts/<str:public_id>", views.ReceiptDetailApi.as_view(), name="receipt-detail"),
    path("webhook-callback", views.WebhookCallbackApi.as_view(), name="webhook-callback"),
]
