"""Fulfilment evidence for support: execution attempts, result metadata, receipts. View-only."""

from __future__ import annotations

from django.contrib import admin

from core.admin import ReadOnlyModelAdmin
from fulfillment.models import ExecutionAttempt, Receipt, Result


@admin.register(ExecutionAttempt)
class ExecutionAttemptAdmin(ReadOnlyModelAdmin):
    # Fits 1366 px beside the filters with the worker and the job ref readable: the executor
    # is a filter and on the attempt's page.
    list_display = (
        "pk",
        "purchase",
        "worker",
        "state",
        "job_ref",
        "tries",
        "takeovers",
        "started_at",
        "finished_at",
    )
    list_filter = ("state", "executor")
    list_select_related = ("purchase",)
    search_fields = ("=purchase__ref", "=job_ref")
    # The lease token is worker plumbing, not evidence.
    fields = (
        "purchase",
        "executor",
        "worker",
        "state",
        "job_ref",
        "job_idempotency_key",
        "tries",
        "takeovers",
        "lease_expires_at",
        "reason_code",
        # An execution that ended unknown: when its job is asked next, and how often it was.
        "next_check_at",
        "checks",
        "started_at",
        "finished_at",
    )


@admin.register(Result)
class ResultAdmin(ReadOnlyModelAdmin):
    list_display = (
        "purchase",
        "content_type",
        "size",
        "sha256",
        "created_at",
        "expires_at",
        "first_delivered_at",
    )
    list_select_related = ("purchase",)
    search_fields = ("=purchase__ref", "=sha256")
    # Never the body: it is the buyer's paid output, and the hash is the evidence.
    fields = (
        "purchase",
        "execution",
        "content_type",
        "size",
        "sha256",
        "created_at",
        "expires_at",
        "first_delivered_at",
    )


@admin.register(Receipt)
class ReceiptAdmin(ReadOnlyModelAdmin):
    # Fits 1366 px beside the filters with the wallet and the transaction readable: the
    # network is a filter and on the receipt's page.
    list_display = (
        "public_id",
        "purchase",
        "payer",
        "amount",
        "transaction",
        "delivered_at",
    )
    list_filter = ("network",)
    list_select_related = ("purchase",)
    search_fields = ("=public_id", "=purchase__ref", "=payer", "=transaction")
