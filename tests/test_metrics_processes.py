"""The in-process counters, counted in one process and scraped from another (issue 33, part
5: `tollbooth_payment_identifier_conflicts_total` had no sample after a conflict, because
the scrape was answered by a process that had not seen it).

A real second process (`runserver` on the test database) takes a payment-id conflict; this
process answers the scrape, as another gunicorn worker or the ASGI role would."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
from django.test import Client

from tests.conftest import CSV_INPUT
from tests.factories import BuyerFactory, OfferingFactory, fund
from tests.test_metrics import scrape

CONFLICTS = ("tollbooth_payment_identifier_conflicts_total", (("scope", "prepaid"),))


def _conflict_in(server_url: str, api_key: str, slug: str) -> None:
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {api_key}"

    def quote(title: str) -> str:
        answer = session.post(
            f"{server_url}/api/v1/quotes",
            json={"offering": slug, "input": {**CSV_INPUT, "title": title}},
            timeout=30,
        )
        assert answer.status_code in (200, 201), answer.text
        return str(answer.json()["id"])

    def pay(quote_id: str) -> requests.Response:
        return session.post(
            f"{server_url}/api/v1/quotes/{quote_id}/purchase",
            json={"rail": "prepaid"},
            headers={"Idempotency-Key": "metrics-processes-0001"},
            timeout=30,
        )

    assert pay(quote("A")).status_code == 201
    conflict = pay(quote("B"))  # the same payment id for another request
    assert conflict.status_code == 409 and conflict.json()["code"] == "payment_identifier_conflict"


# A second process on the test database: PostgreSQL (an in-memory SQLite is this process's).
@pytest.mark.postgres
def test_a_conflict_seen_by_one_process_is_in_the_scrape_another_answers(
    transactional_db, start_server, tmp_path: Path, settings
):
    from purchases.services.shared.buyers import api_key_issue

    counters = tmp_path / "metrics"
    counters.mkdir()
    buyer = BuyerFactory.create()
    fund(buyer, 10_000_000)
    offering = OfferingFactory.create()
    server = start_server({"PROMETHEUS_MULTIPROC_DIR": str(counters)})
    own_before = scrape(Client()).get(CONFLICTS, 0.0)  # what earlier tests counted here

    _conflict_in(server.url, api_key_issue(buyer=buyer), offering.slug)

    settings.TOLLBOOTH_METRICS_PROCESS_DIR = str(counters)
    here = scrape(Client())
    assert here[CONFLICTS] == 1.0
    assert any(name == "python_info" for name, _ in here)
    # The serving process's own scrape sums the same files.
    served = requests.get(f"{server.url}/metrics", timeout=30)
    assert 'tollbooth_payment_identifier_conflicts_total{scope="prepaid"} 1.0' in served.text
    # Unshared, this process knows nothing of it: the defect the directory mends.
    settings.TOLLBOOTH_METRICS_PROCESS_DIR = ""
    assert scrape(Client()).get(CONFLICTS, 0.0) == own_before
