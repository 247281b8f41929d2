"""The walk of one prepaid pay from the view to the answer (bench/walk.py, issue 20).

Not a test (pytest collects only `test_*.py`): run by hand through pytest, for the suite's
fixtures (a funded buyer, its API key, committed rows):

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python -m pytest \\
        bench/by_hand/walk_prepaid_pay.py -q -s -p no:cacheprovider

The walked request is POST /api/v1/quotes/<id>/purchase with a new Idempotency-Key
through the real view (APIClient), paid from the balance. WARM_UP rounds first.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from rest_framework.test import APIClient

from bench.walk import Walk
from purchases.models import Buyer, Offering
from tests.factories import fund

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

WARM_UP = 3


def test_walk_prepaid_pay(
    buyer: Buyer, offering: Offering, make_client: Callable[[Buyer], APIClient]
) -> None:
    client = make_client(buyer)
    fund(buyer, 10_000_000_000)
    for n in range(WARM_UP + 1):
        data = {"title": f"Walk {n}", "csv": f"region,units\nnorth,{n}\n"}
        quoted = client.post(
            "/api/v1/quotes", {"offering": offering.slug, "input": data}, format="json"
        )
        assert quoted.status_code == 201, quoted.content
        with Walk() as walk:
            paid = client.post(
                f"/api/v1/quotes/{quoted.json()['id']}/purchase",
                {"rail": "prepaid"},
                format="json",
                HTTP_IDEMPOTENCY_KEY=f"walk-prepaid-{n:08d}",
            )
        assert paid.status_code == 201, paid.content
    print()
    print(walk.report("one prepaid pay"))
