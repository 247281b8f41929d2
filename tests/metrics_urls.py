"""A tiny URLconf for the metrics view tests, until config/urls.py wires /metrics."""

from django.urls import path

from backoffice.metrics import metrics_view

urlpatterns = [path("metrics", metrics_view, name="metrics")]
