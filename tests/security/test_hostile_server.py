"""One anonymous request must not kill the web process (issue 8, item 1).

py_ecc raises the recursion limit to 100,000 on import; a body of nested `[` then
overflowed the C stack of the JSON decoder and the server died with SIGSEGV. This runs
the real server process and checks it answers, and keeps answering.
"""

from __future__ import annotations

import base64

import pytest
import requests

from purchases.services.shared.buyers import api_key_issue
from tests.factories import BuyerFactory, OfferingFactory

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.django_db(transaction=True)]
DEEP = b"[" * 100_000


def test_deeply_nested_json_is_refused_and_the_server_keeps_serving(start_server):
    offering = OfferingFactory.create()
    api_key = api_key_issue(buyer=BuyerFactory.create())
    server = start_server({})
    json_headers = {"Content-Type": "application/json"}
    attacks = [
        (f"/x402/{offering.slug}", DEEP, json_headers),
        ("/api/v1/quotes", DEEP, {**json_headers, "Authorization": f"Bearer {api_key}"}),
        (
            f"/x402/{offering.slug}",
            b"{}",
            {**json_headers, "PAYMENT-SIGNATURE": base64.b64encode(b"[" * 10_000).decode()},
        ),
    ]
    for path, body, headers in attacks:
        response = requests.post(f"{server.url}{path}", data=body, headers=headers, timeout=30)
        assert response.status_code == 400, response.text
        assert response.headers["Content-Type"] == "application/problem+json"
        assert response.json()["code"] in {"json_too_deep", "payment_signature_malformed"}
        assert response.json()["retryable"] is False
        assert server.process.poll() is None, server.log_path.read_text()
    # Still serving honest requests.
    offerings = requests.get(
        f"{server.url}/api/v1/offerings",
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=10,
    )
    assert offerings.status_code == 200
    assert offering.slug in {o["offering"] for o in offerings.json()["offerings"]}
