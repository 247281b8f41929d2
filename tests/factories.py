"""factory_boy factories: one per model, a trait per interesting state."""

from __future__ import annotations

from datetime import timedelta

import factory
from django.utils import timezone

from fulfillment.executors.report import REPORT_INPUT_SCHEMA
from payments.models import LedgerEntry
from purchases.models import Buyer, Offering

USDC_LOCAL = "0x" + "a0" * 20
SELLER = "0x" + "5e" * 20
# Agents may tag requests with an id of their own; it is volatile, so it never splits quotes.
REPORT_SCHEMA_WITH_REQUEST_ID = {
    **REPORT_INPUT_SCHEMA,
    "properties": {**REPORT_INPUT_SCHEMA["properties"], "request_id": {"type": "string"}},
}


class OfferingFactory(factory.django.DjangoModelFactory[Offering]):
    class Meta:
        model = Offering
        django_get_or_create = ("slug",)

    slug = factory.Sequence(lambda n: f"csv-report-{n}")
    title = "CSV statistics report"
    price = 250_000  # 0.25 USDC
    asset = USDC_LOCAL
    network = "eip155:31337"
    pay_to = SELLER
    executor = "report"
    input_schema = REPORT_SCHEMA_WITH_REQUEST_ID
    volatile_fields = ["request_id"]
    result_retention = timedelta(days=7)

    class Params:
        with_stock = factory.Trait(stock=2)
        http_job = factory.Trait(
            executor="http_job",
            input_schema={
                "type": "object",
                "required": ["text"],
                "properties": {
                    "text": {"type": "string"},
                    "duration_ms": {"type": "integer"},
                    "fail": {"type": "boolean"},
                    "request_id": {"type": "string"},
                },
            },
        )
        escalating = factory.Trait(refund_policy=Offering.RefundPolicy.ESCALATE)


class BuyerFactory(factory.django.DjangoModelFactory[Buyer]):
    class Meta:
        model = Buyer

    name = factory.Sequence(lambda n: f"agent-{n}")


def fund(buyer: Buyer, amount: int, asset: str = USDC_LOCAL) -> LedgerEntry:
    return LedgerEntry.objects.create(
        buyer=buyer,
        asset=asset,
        amount=amount,
        kind=LedgerEntry.Kind.TOP_UP,
        reference=f"topup:{buyer.ref}:{timezone.now().timestamp()}:{LedgerEntry.objects.count()}",
    )
